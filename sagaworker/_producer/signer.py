"""The approval signer: HMAC tokens over one gated step and its exact arguments.

``SAGAWORKER_APPROVAL_SECRET`` may list several secrets, comma-separated, to rotate one:
the first signs, every one verifies (a token handed out before the rotation still works).
Each secret has a fingerprint (an HMAC of a fixed text, never the secret): the journal
records the ones approvals are made with (``readiness.check_approval_secrets``), so a
process holding another secret is refused before it approves anything.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import time
from typing import Any

from .._base.errors import ApprovalInvalid, ConfigurationError
from .._base.settings import Settings

__all__ = ["Signer", "approval_fingerprint", "signer_for"]

_UNSET = ("approvals need a secret: set SAGAWORKER_APPROVAL_SECRET (the same value on "
          "producers, workers and wherever approvals are decided)")


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


def approval_fingerprint(secret: str) -> str:
    """What the journal records of an approval secret: tells two secrets apart, and
    nothing about either."""
    return hmac.new(secret.encode(), b"sagaworker approval secret fingerprint",
                    hashlib.sha256).hexdigest()[:16]


def split_secrets(secret: str | None) -> list[str]:
    """The secrets of the setting, the signing one first."""
    return [s.strip() for s in (secret or "").split(",") if s.strip()]


class Signer:
    """HMAC tokens over a gated step. ``problem``: why the configured secret may not be
    used (too short); signing and verifying then refuse, saying so."""

    def __init__(self, secret: str | None, ttl: float, *, problem: str | None = None) -> None:
        self.secrets, self.ttl, self.problem = split_secrets(secret), ttl, problem

    @property
    def fingerprints(self) -> list[str]:
        return [approval_fingerprint(s) for s in self.secrets]

    def check(self) -> None:
        """Raise ConfigurationError when approvals cannot work (no secret, a short one)."""
        self._keys()

    def _keys(self) -> list[bytes]:
        if not self.secrets:
            raise ConfigurationError(_UNSET)
        if self.problem:
            raise ConfigurationError(self.problem)
        return [s.encode() for s in self.secrets]

    def bind(self, digest: str, key: bytes | None = None) -> str:
        """What a token carries of the arguments' digest: keyed with the secret (the
        signing one, or ``key``), so the token tells nothing about the arguments (an
        unkeyed SHA-256 of a card number is found by trying every number)."""
        return _b64(hmac.new(key or self._keys()[0], b"args|" + digest.encode(),
                             hashlib.sha256).digest())

    def sign(self, saga_id: str, seq: int, tool: str, digest: str, nonce: str) -> str:
        body = {"s": saga_id, "q": seq, "t": tool, "d": self.bind(digest), "n": nonce,
                "e": int(time.time() + self.ttl)}
        payload = _b64(json.dumps(body, separators=(",", ":"), sort_keys=True).encode())
        mac = hmac.new(self._keys()[0], payload.encode(), hashlib.sha256).digest()
        return f"{payload}.{_b64(mac)}"

    def verify(self, token: str) -> dict[str, Any]:
        """The token's body, checked against each secret; ``key`` in it: the secret that
        signed it (``bind`` the arguments with it)."""
        keys = self._keys()
        try:
            payload, mac = token.strip().split(".")
            body: dict[str, Any] = json.loads(_unb64(payload))
            saga_id, seq = body["s"], body["q"]
            if not isinstance(saga_id, str) or not isinstance(seq, int):
                raise ValueError("bad body")
            signed = _unb64(mac)
        except (ValueError, KeyError, TypeError) as exc:
            raise ApprovalInvalid(
                "approval token is not valid (forged or damaged); nothing changed. Get a "
                "fresh token from sw.pending_approvals() or `sagaworker approvals`") from exc
        key = next((k for k in keys if hmac.compare_digest(
            hmac.new(k, payload.encode(), hashlib.sha256).digest(), signed)), None)
        if key is None:
            raise ApprovalInvalid(
                f"approval token for saga {saga_id!r} step {seq} is not valid: it was "
                "not signed with the approval secret this process holds (it was made where "
                "SAGAWORKER_APPROVAL_SECRET is another, or it is forged); nothing changed. "
                "Use one secret everywhere, and a token from sw.pending_approvals() here")
        if body.get("e", 0) < time.time():
            raise ApprovalInvalid(
                f"approval token for saga {saga_id!r} step {seq} expired; nothing changed. "
                "The gate is still open: get a fresh token from sw.pending_approvals()")
        return {**body, "key": key}


def signer_for(settings: Settings) -> Signer:
    """The settings' signer; it refuses to sign or verify with a secret too short."""
    secret = settings.approval_secret
    return Signer(secret.get_secret_value() if secret is not None else None,
                  settings.approval_ttl,
                  problem=settings.approval_secret_problem if secret is not None else None)
