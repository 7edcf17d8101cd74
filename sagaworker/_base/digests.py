"""The args digest the journal keeps of a step's arguments (``args_digest``, and an
approval's ``approved_digest``): what a worker checks a delivered message against, and a
flow's replay the steps its code asks for.

Without keys it is the SHA-256 of the arguments' canonical JSON, as it always was. With
SAGAWORKER_ENCRYPTION_KEYS it is keyed: ``h``, the name of the key (8 hex digits of its
fingerprint) and an HMAC-SHA256 of that JSON under a key derived from it (55 hex digits),
64 characters as before. Someone who reads the journal cannot confirm a guess of a step's
arguments with it (an unkeyed digest of a card number and an amount is found by trying
them), and someone who writes to it cannot make one match arguments of theirs.

A digest journaled before (unkeyed) still matches where the saga's values may be in clear
(``Cipher.legacy``: journaled without a key, and ``db rotate-key`` not run since); rotate-key
rewrites each under the first key.
"""

from __future__ import annotations

import hashlib
import hmac
from typing import Any

from .canonical import canonical_args
from .crypto import Cipher

__all__ = ["digest", "is_current", "matches"]

_KEYED = "h"


def digest(cipher: Cipher | None, args: Any, kwargs: Any) -> str:
    """The digest to journal for these arguments (TypeError, ValueError: not JSON)."""
    text = canonical_args(args, kwargs).encode()
    if cipher is None:
        return hashlib.sha256(text).hexdigest()
    name, key = cipher.digest_keys[0]
    return _keyed(name, key, text)


def _keyed(name: str, key: bytes, text: bytes) -> str:
    return _KEYED + name + hmac.new(key, text, hashlib.sha256).hexdigest()[:55]


def matches(cipher: Cipher | None, stored: str | None, args: Any, kwargs: Any, *,
            clear_ok: bool) -> bool:
    """Whether ``stored`` is these arguments' digest: keyed under one of ``cipher``'s keys,
    or (``clear_ok``, or without keys) unkeyed. Arguments that are not JSON match none."""
    if not stored:
        return False
    try:
        text = canonical_args(args, kwargs).encode()
    except (TypeError, ValueError):
        return False
    if stored.startswith(_KEYED):
        name = stored[1:9]
        return cipher is not None and any(
            n == name and _same(stored, _keyed(n, key, text)) for n, key in cipher.digest_keys)
    if cipher is not None and not clear_ok:
        return False
    return _same(stored, hashlib.sha256(text).hexdigest())


def _same(stored: str, expected: str) -> bool:
    # (bytes: a digest written with SQL may hold anything, a non-ASCII character too)
    return hmac.compare_digest(str(stored).encode(), expected.encode())


def is_current(cipher: Cipher, stored: str | None) -> bool:
    """Keyed under the first key already (``db rotate-key`` leaves it as it is)."""
    return bool(stored) and str(stored).startswith(_KEYED + cipher.digest_keys[0][0])
