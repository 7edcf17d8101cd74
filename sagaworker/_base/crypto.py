"""Encryption at rest of the journal's arguments, results and metadata (opt-in).

``SAGAWORKER_ENCRYPTION_KEYS`` holds comma-separated Fernet keys: the first encrypts, every
one decrypts (``MultiFernet``), so a new key is put first and the old ones stay listed until
``sagaworker db rotate-key`` has re-encrypted the journal.

The journal's JSON columns that carry user data are of type :class:`SealedJSON`. With a
cipher attached to the engine, a value is stored as ``{"$sagaworker_enc": "<Fernet token of
its JSON>"}``; a clear value reads as it is, so a journal written before the keys were set
still reads (a value is taken for ciphertext only when it is that one key holding a string
shaped like a Fernet token). Reading an encrypted value without keys, or with keys none of
which decrypts it, raises :class:`ConfigurationError` naming the setting, never a garbage
value.

The cipher is found through the engine's dialect (one per engine): each ``Sagaworker``
attaches its own when it makes its engine, so several in one process, each with its own
database and keys, do not mix. An engine nobody attached a cipher to (plain SQL tools,
another process's engine) writes clear values and refuses to read encrypted ones.
"""

from __future__ import annotations

import json
import weakref
from typing import Any

from pydantic import SecretStr
from sqlalchemy import JSON, Engine
from sqlalchemy.dialects.postgresql import JSONB
from sqlalchemy.engine import Dialect
from sqlalchemy.types import TypeDecorator, TypeEngine

from .canonical import RESERVED_KEY, from_wire, to_wire
from .errors import ConfigurationError

__all__ = ["MARKER", "SETTING", "Cipher", "SealedJSON", "attach", "cipher_for", "cipher_of",
           "is_sealed", "parse_keys"]

#: the one key of the JSON object an encrypted value is stored as (reserved)
MARKER = RESERVED_KEY
SETTING = "SAGAWORKER_ENCRYPTION_KEYS"
MAKE_KEY = ('python -c "from cryptography.fernet import Fernet; '
            'print(Fernet.generate_key().decode())"')

_ciphers: weakref.WeakKeyDictionary[Dialect, Cipher] = weakref.WeakKeyDictionary()


def parse_keys(raw: str) -> list[str]:
    """The keys of a comma-separated list, each checked; ConfigurationError says how to make
    one (the message names the key's position, never its value)."""
    from cryptography.fernet import Fernet

    keys = [k.strip() for k in raw.split(",") if k.strip()]
    for i, key in enumerate(keys, 1):
        try:
            Fernet(key)
        except (ValueError, TypeError):
            raise ConfigurationError(
                f"{SETTING}: key {i} of {len(keys)} is not a Fernet key (32 url-safe "
                f"base64-encoded bytes); make one with: {MAKE_KEY}") from None
    return keys


def fingerprint(key: str) -> str:
    """A key's name in the journal: which key sealed its values, telling nothing of it."""
    import hashlib
    import hmac

    return hmac.new(key.encode(), b"sagaworker key fingerprint",
                    hashlib.sha256).hexdigest()[:16]


class Cipher:
    """The keys of ``SAGAWORKER_ENCRYPTION_KEYS``: seals with the first, opens with any."""

    def __init__(self, keys: list[str]) -> None:
        from cryptography.fernet import Fernet, MultiFernet

        if not keys:
            raise ConfigurationError(f"{SETTING} holds no key; make one with: {MAKE_KEY}")
        #: the keys' fingerprints, the sealing key's first
        self.fingerprints = [fingerprint(k) for k in keys]
        self._first = Fernet(keys[0])
        self._all = MultiFernet([Fernet(k) for k in keys])

    def seal(self, value: Any) -> dict[str, str]:
        """``value`` (JSON-ready) as the stored wrapper, encrypted with the first key."""
        plain = json.dumps(value, separators=(",", ":"), ensure_ascii=False)
        return {MARKER: self._all.encrypt(plain.encode()).decode("ascii")}

    def open(self, sealed: dict[str, str], where: str) -> Any:
        """The clear value of a stored wrapper; ConfigurationError if no key decrypts it."""
        from cryptography.fernet import InvalidToken

        try:
            plain = self._all.decrypt(sealed[MARKER].encode("ascii"))
        except (InvalidToken, UnicodeEncodeError):
            raise ConfigurationError(
                f"none of the keys in {SETTING} decrypts {where} in the journal: it was "
                "written with another key; list that key too (after the current first "
                "one), or restore the keys the journal was written with") from None
        return json.loads(plain)

    def is_current(self, sealed: dict[str, str]) -> bool:
        """Encrypted with the first key already (``db rotate-key`` leaves it as it is)."""
        from cryptography.fernet import InvalidToken

        try:
            self._first.decrypt(sealed[MARKER].encode("ascii"))
        except (InvalidToken, UnicodeEncodeError):
            return False
        return True


def cipher_of(keys: SecretStr | str | None) -> Cipher | None:
    """The cipher of the setting's value; None when it is unset or empty."""
    raw = keys.get_secret_value() if isinstance(keys, SecretStr) else keys
    if raw is None or not raw.strip():
        return None
    return Cipher(parse_keys(raw))


def attach(engine: Engine, cipher: Cipher | None) -> None:
    """Every statement on ``engine`` seals and opens journal values with ``cipher``."""
    if cipher is None:
        _ciphers.pop(engine.dialect, None)
    else:
        _ciphers[engine.dialect] = cipher


def cipher_for(engine: Engine) -> Cipher | None:
    return _ciphers.get(engine.dialect)


def is_sealed(value: Any) -> bool:
    """``value`` is a stored wrapper: the one key ``MARKER`` holding a string shaped like a
    Fernet token. Anything else (a dict that got in with that key, journaled before the
    key was refused in user data) is clear data and reads as it is, asking for no key."""
    return (isinstance(value, dict) and len(value) == 1
            and isinstance(token := value.get(MARKER), str) and _is_token(token))


#: a Fernet token's bytes around its ciphertext: version, timestamp, IV, then the HMAC
_FERNET_OVERHEAD = 1 + 8 + 16 + 32


def _is_token(token: str) -> bool:
    """Shaped like a Fernet token: url-safe base64 of version 0x80, a timestamp, an IV,
    whole AES blocks (one at least) and an HMAC. Says nothing of whether a key opens it."""
    import base64
    import binascii

    try:
        raw = base64.b64decode(token.encode("ascii"), altchars=b"-_", validate=True)
    except (binascii.Error, UnicodeEncodeError, ValueError):
        return False
    body = len(raw) - _FERNET_OVERHEAD
    return raw[:1] == b"\x80" and body >= 16 and body % 16 == 0


class SealedJSON(TypeDecorator[Any]):
    """JSON (JSONB on PostgreSQL) whose values are encrypted when the engine has a cipher.

    ``what`` names the column in errors. ``None`` is stored as it always was (it tells
    nothing), and the args digest is taken over the clear values before they get here.
    ``container``: the column holds a dict by construction (kwargs, metadata), whose own
    keys are never read as kombu's type tag.
    """

    impl = JSON
    cache_ok = True

    def __init__(self, what: str, container: bool = False) -> None:
        super().__init__()
        self.what = what
        self.container = container

    def load_dialect_impl(self, dialect: Dialect) -> TypeEngine[Any]:
        return dialect.type_descriptor(JSONB() if dialect.name == "postgresql" else JSON())

    def process_bind_param(self, value: Any, dialect: Dialect) -> Any:
        if value is None:
            return None
        value = to_wire(value)  # datetimes, Decimals, UUIDs as kombu's JSON tags them
        cipher = _ciphers.get(dialect)
        return value if cipher is None else cipher.seal(value)

    def process_result_value(self, value: Any, dialect: Dialect) -> Any:
        if not is_sealed(value):
            return from_wire(value, container=self.container)
        cipher = _ciphers.get(dialect)
        if cipher is None:
            raise ConfigurationError(
                f"{self.what} in the journal is encrypted; set {SETTING} to the keys it was "
                "written with (the same value the workers have) to read it")
        return from_wire(cipher.open(value, self.what), container=self.container)
