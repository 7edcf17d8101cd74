"""The approval signer: HMAC over the step, constant-time checked, expiring."""

from __future__ import annotations

import base64
import json
from pathlib import Path

import pytest
from celery import Celery
from pydantic import SecretStr

from sagaworker import ApprovalInvalid, ConfigurationError, Sagaworker, Settings
from sagaworker._producer.approvals import Signer, signer_for


def test_round_trip() -> None:
    """A token signed with the secret verifies and carries the step it names."""
    s = Signer("k", 60)
    body = s.verify(s.sign("saga", 3, "tool", "d" * 64, "nonce"))
    assert (body["s"], body["q"], body["t"], body["d"], body["n"]) == (
        "saga", 3, "tool", s.bind("d" * 64), "nonce")


def test_a_token_tells_nothing_of_the_arguments() -> None:
    """The arguments' digest in a token is keyed with the secret: the plain SHA-256 of
    the arguments (what anyone can compute for every card number) is not in it."""
    from sagaworker._base.canonical import args_digest

    digest = args_digest(["4111111111111111"], {})
    token = Signer("k" * 32, 60).sign("saga", 3, "tool", digest, "nonce")
    payload = json.loads(base64.urlsafe_b64decode(token.split(".")[0] + "=="))
    assert digest not in json.dumps(payload)
    assert payload["d"] != Signer("other" * 8, 60).bind(digest)


def test_forged_and_tampered_tokens_are_refused() -> None:
    """Another secret, an edited payload or garbage are ApprovalInvalid."""
    token = Signer("k", 60).sign("saga", 3, "tool", "d", "n")
    with pytest.raises(ApprovalInvalid):
        Signer("other", 60).verify(token)
    payload, mac = token.split(".")
    body = json.loads(base64.urlsafe_b64decode(payload + "=="))
    body["q"] = 4
    forged = base64.urlsafe_b64encode(json.dumps(body).encode()).rstrip(b"=").decode()
    with pytest.raises(ApprovalInvalid):
        Signer("k", 60).verify(f"{forged}.{mac}")
    for junk in ("", "abc", "a.b.c", "!!.??"):
        with pytest.raises(ApprovalInvalid):
            Signer("k", 60).verify(junk)


def test_expired_token() -> None:
    """A token past its TTL is refused, saying the gate stays open."""
    token = Signer("k", -1).sign("saga", 1, "tool", "d", "n")
    with pytest.raises(ApprovalInvalid, match="expired"):
        Signer("k", 60).verify(token)


def test_no_secret_is_a_clear_configuration_error() -> None:
    """Without SAGAWORKER_APPROVAL_SECRET approvals refuse to work."""
    with pytest.raises(ConfigurationError, match="SAGAWORKER_APPROVAL_SECRET"):
        Signer(None, 60).sign("s", 1, "t", "d", "n")


def test_approval_secret_is_a_secret_of_at_least_32_bytes(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The secret never shows in repr or str; a short one is refused, saying how to make
    a good one (and without echoing it); unset (or empty) stays allowed."""
    secret = "s3cr3t-" + "x" * 25
    s = Settings(approval_secret=secret)
    assert isinstance(s.approval_secret, SecretStr)
    assert s.approval_secret.get_secret_value() == secret
    assert secret not in repr(s) and secret not in str(s)
    assert secret not in repr(s.model_dump())
    short = Settings(approval_secret="short-secret")  # named where it is used, in one line
    with pytest.raises(ConfigurationError) as err:
        signer_for(short).check()
    text = str(err.value)
    assert "at least 32" in text and "secrets.token_urlsafe(32)" in text
    assert "short-secret" not in text and "\n" not in text
    assert short.approval_secret_problem is not None
    assert "short-secret" not in short.approval_secret_problem
    assert Settings(approval_secret=None).approval_secret is None
    monkeypatch.setenv("SAGAWORKER_APPROVAL_SECRET", "")
    assert Settings().approval_secret is None
    monkeypatch.setenv("SAGAWORKER_APPROVAL_SECRET", "tiny")
    with pytest.raises(ConfigurationError, match="token_urlsafe"):
        signer_for(Settings()).check()


def test_a_sagaworker_signs_with_the_secret_value(tmp_path: Path) -> None:
    """The gate keys its HMAC with the secret's value, not its masked form."""
    secret = "k" * 32
    sw = Sagaworker(Celery("secret-unit", broker="memory://"),
                    settings=Settings(database_url=f"sqlite:///{tmp_path / 'j.db'}",
                                      approval_secret=secret, broker_url="memory://",
                                      broker_folder=str(tmp_path / "b")))
    token = sw.gate.signer.sign("saga", 1, "tool", "d", "n")
    assert Signer(secret, 60).verify(token)["s"] == "saga"
    with pytest.raises(ApprovalInvalid):
        Signer("**********", 60).verify(token)
