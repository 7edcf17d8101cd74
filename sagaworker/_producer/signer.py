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
import math
import time
from collections import Counter
from typing import Any

from .._base.errors import ApprovalInvalid, ConfigurationError
from .._base.settings import MAKE_SECRET, Settings

__all__ = ["Signer", "approval_fingerprint", "signer_for", "weak_secret"]

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

    def prove(self, saga_id: str, seq: int, task_id: str | None, tool: str, digest: str,
              nonce: str, approver: str) -> str:
        """What the journal keeps of an approval (``approval_proof``): its nonce and an
        HMAC, under a key derived from the signing secret, over the step (saga, seq, task
        id, tool), its arguments' digest and the approver. Only the secret makes one: the
        worker checks it (``proven``) before a gated tool runs."""
        mac = _proof(self._keys()[0], saga_id, seq, task_id, tool, digest, nonce, approver)
        return f"{nonce}.{mac}"

    def proven(self, proof: str | None, saga_id: str, seq: int, task_id: str | None,
               tool: str, digest: str, approver: str) -> bool:
        """Whether ``proof`` approves that step, with the arguments of that digest, by
        ``approver``, made with one of the secrets."""
        nonce, _, mac = (proof or "").partition(".")
        return bool(nonce and mac) and any(hmac.compare_digest(mac.encode(), _proof(
            k, saga_id, seq, task_id, tool, digest, nonce, approver).encode())
            for k in self._keys())

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
        # RecursionError: a forged payload of JSON nested deeper than the parser goes
        except (ValueError, KeyError, TypeError, RecursionError) as exc:
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


def _proof(secret: bytes, *fields: Any) -> str:
    key = hmac.new(secret, b"sagaworker approval proof key", hashlib.sha256).digest()
    body = json.dumps(list(fields), separators=(",", ":"), ensure_ascii=True).encode()
    return _b64(hmac.new(key, body, hashlib.sha256).digest())


def signer_for(settings: Settings) -> Signer:
    """The settings' signer; it refuses to sign or verify with a secret too short."""
    secret = settings.approval_secret
    return Signer(secret.get_secret_value() if secret is not None else None,
                  settings.approval_ttl,
                  problem=settings.approval_secret_problem if secret is not None else None)


#: a secret whose characters carry fewer bits than this is said to look guessable
MIN_SECRET_BITS = 128


def entropy_bits(secret: str) -> float:
    """The secret's length times the Shannon entropy of its characters: a repeated word,
    a run of one character, score low; a random secret of 32 bytes or more scores well
    over 128 (``secrets.token_urlsafe(32)``: about 200)."""
    n = len(secret)
    counts = Counter(secret).values()
    return -sum(c * math.log2(c / n) for c in counts) if n else 0.0


def weak_secret(settings: Settings) -> str | None:
    """A warning when an approval secret looks guessable (it signs approvals, and keys
    what the fingerprints an operator reads are derived from), or None. Never the secret."""
    secret = settings.approval_secret
    for part in split_secrets(secret.get_secret_value() if secret is not None else None):
        bits = entropy_bits(part)
        if bits < MIN_SECRET_BITS:
            return (f"SAGAWORKER_APPROVAL_SECRET looks guessable: its characters carry about "
                    f"{bits:.0f} bits of entropy, under {MIN_SECRET_BITS}; replace it with a "
                    f"random one, the same value everywhere. {MAKE_SECRET}")
    return None
