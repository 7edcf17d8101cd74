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


S1, S2, S3 = ("first-secret-" + "1" * 32), ("other-secret-" + "2" * 32), ("next-secret-" + "3" * 32)


def _sw(tmp_path: Path, secret: str) -> Sagaworker:
    sw = Sagaworker(Celery("secrets", broker="memory://"), settings=Settings(
        database_url=f"sqlite:///{tmp_path / 'j.db'}", approval_secret=secret,
        broker_url="memory://", broker_folder=str(tmp_path / "b")))
    sw.rt.bus.publish_step = lambda *a, **k: True  # type: ignore[method-assign]

    @sw.tool(reversibility="IRREVERSIBLE")
    def ship(order: str) -> str:
        return order

    return sw


def test_a_process_with_another_approval_secret_is_refused(tmp_path: Path) -> None:
    """The journal records the fingerprint of the secret its approvals are made with: a
    process holding another one can neither list gates nor approve (ConfigurationError
    naming both fingerprints, nothing changed); a token it signed says it came from
    another secret."""
    from sagaworker._producer.signer import approval_fingerprint

    a = _sw(tmp_path, S1)
    a.journal.create_all()
    a.begin("g-1").enqueue(a.registry.tool("tests.unit.test_approval_tokens.ship").task, "o")
    [req] = a.pending_approvals()
    b = _sw(tmp_path, S2)
    for call in (b.pending_approvals, lambda: b.approve(req.token, approver="mallory")):
        with pytest.raises(ConfigurationError, match=approval_fingerprint(S1)) as err:
            call()
        assert approval_fingerprint(S2) in str(err.value) and S1 not in str(err.value)
    assert a.inspect("g-1").entries[0].phase.value == "AWAITING_APPROVAL"
    with pytest.raises(ApprovalInvalid, match="not signed with the approval secret"):
        Signer(S2, 60).verify(req.token)


def test_an_approval_secret_is_rotated_by_listing_the_new_one_first(tmp_path: Path) -> None:
    """``SAGAWORKER_APPROVAL_SECRET=new,old``: a token made with the old secret still
    approves; new tokens are signed with the new one (which an old-only process refuses
    until it is given both)."""
    a = _sw(tmp_path, S1)
    a.journal.create_all()
    ship = a.registry.tool("tests.unit.test_approval_tokens.ship").task
    a.begin("r-1").enqueue(ship, "o1")
    a.begin("r-2").enqueue(ship, "o2")
    old = {r.saga_id: r.token for r in a.pending_approvals()}
    c = _sw(tmp_path, f"{S3},{S1}")
    c.approve(old["r-1"], approver="alice")
    new = {r.saga_id: r.token for r in c.pending_approvals()}
    assert Signer(S3, 60).verify(new["r-2"])["s"] == "r-2"
    with pytest.raises(ApprovalInvalid, match="not signed"):
        Signer(S1, 60).verify(new["r-2"])
    c.approve(new["r-2"], approver="alice")
    assert [e.entries[0].phase.value for e in (c.inspect("r-1"), c.inspect("r-2"))] == [
        "INTENT", "INTENT"]


def test_a_blank_or_short_rotated_secret_is_named() -> None:
    """Spaces only, or a short secret in the list: the problem names which."""
    assert "only spaces" in (Settings(approval_secret="   ").approval_secret_problem or "")
    assert "#2" in (Settings(approval_secret=f"{S1},short").approval_secret_problem or "")


def test_a_forged_token_of_deeply_nested_json_is_invalid(tmp_path: Path) -> None:
    """A forged token whose payload is JSON nested a million deep is ApprovalInvalid (the
    API's 400, the CLI's error line), never a RecursionError out of the JSON parser."""
    def b64(data: bytes) -> str:
        return base64.urlsafe_b64encode(data).rstrip(b"=").decode()

    forged = f"{b64(b'[' * 1_000_000 + b']' * 1_000_000)}.{b64(b'x' * 32)}"
    with pytest.raises(ApprovalInvalid, match=r"^approval token is not valid \(forged or "):
        Signer("k" * 32, 60).verify(forged)
    sw = Sagaworker(Celery("nested", broker="memory://"), settings=Settings(
        database_url=f"sqlite:///{tmp_path / 'j.db'}", broker_url="memory://",
        approval_secret="k" * 32))
    with pytest.raises(ApprovalInvalid, match=r"^approval token is not valid \(forged or "):
        sw.approve(forged, approver="mallory")
