"""The approval signer: HMAC over the step, constant-time checked, expiring."""

from __future__ import annotations

import base64
import json

import pytest

from sagaworker import ApprovalInvalid, ConfigurationError
from sagaworker._approvals import Signer


def test_round_trip() -> None:
    """A token signed with the secret verifies and carries the step it names."""
    s = Signer("k", 60)
    body = s.verify(s.sign("saga", 3, "tool", "d" * 64, "nonce"))
    assert (body["s"], body["q"], body["t"], body["d"], body["n"]) == (
        "saga", 3, "tool", "d" * 64, "nonce")


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
