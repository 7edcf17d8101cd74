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

Each value is sealed for its place: the column and the row it is written to (the saga; an
entry's arguments also the step's task id, its result its seq), sealed inside the token
(Fernet has no associated data). A read checks the place against the row it came from,
which SQL puts beside the stored value (:meth:`SealedJSON.column_expression`), so a
ciphertext copied into another row or column with SQL is refused
(:class:`SealedElsewhere`), never read as that row's value. A token sealed before places
were (its plaintext is the bare JSON) still reads; ``db rotate-key`` seals it for its place.

A saga journaled with a key has a nonce of its own (``NONCE``), part of the place of each of
its values (its entries' too): a saga id used again after a prune seals for another nonce,
so the pruned saga's values never read as the new one's. Its values are all sealed: a clear
value read from it was written there with SQL, and is refused as a copy is; once ``db
rotate-key`` has sealed every value of the journal, so is a clear value anywhere.

The cipher is found through the engine's dialect (one per engine): each ``Sagaworker``
attaches its own when it makes its engine, so several in one process, each with its own
database and keys, do not mix. An engine nobody attached a cipher to (plain SQL tools,
another process's engine) writes clear values and refuses to read encrypted ones.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any, NamedTuple

from pydantic import SecretStr
from sqlalchemy import JSON, ColumnElement, Engine
from sqlalchemy.dialects.postgresql import JSONB
from sqlalchemy.engine import Dialect
from sqlalchemy.sql import type_coerce
from sqlalchemy.sql.elements import Label
from sqlalchemy.types import TypeDecorator, TypeEngine

from .canonical import from_wire, to_wire
from .errors import ConfigurationError, SealedElsewhere
from .sealed_sql import (
    AT,
    CLEAR,
    MARKER,
    Located,
    derive_place,
    derived_places,
    keyed_only,
    place_columns,
    registered,
    registry,
)

__all__ = ["MARKER", "NONCE", "SETTING", "Cipher", "Placed", "SealedElsewhere", "SealedJSON",
           "attach", "cipher_for", "cipher_of", "derive_place", "is_sealed", "keyed_only",
           "parse_keys", "place_columns"]

#: the place column holding a saga's nonce (None: journaled without a key, or before)
NONCE = "place_nonce"
#: what to do about a value copied into a row (SealedElsewhere's messages end with it)
_FIX = ("from a backup, or delete that saga (docs/encryption.md, \"A value copied with "
        "SQL\")")
#: a sealed plaintext that names its place starts with this (a bare JSON value never does)
_PLACED = b"@"
SETTING = "SAGAWORKER_ENCRYPTION_KEYS"
MAKE_KEY = ('python -c "from cryptography.fernet import Fernet; '
            'print(Fernet.generate_key().decode())"')


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


class Placed(NamedTuple):
    """A value to write to a sealed column, with its row's place: the values of the
    column's place columns (``SealedJSON.place``), in that order (its saga's nonce, last,
    may be left out: None)."""

    value: Any
    at: tuple[Any, ...]


class Cipher:
    """The keys of ``SAGAWORKER_ENCRYPTION_KEYS``: seals with the first, opens with any."""

    def __init__(self, keys: list[str]) -> None:
        from cryptography.fernet import Fernet, MultiFernet

        if not keys:
            raise ConfigurationError(f"{SETTING} holds no key; make one with: {MAKE_KEY}")
        #: the keys' fingerprints, the sealing key's first
        self.fingerprints = [fingerprint(k) for k in keys]
        #: each key's name and the key its args digests are keyed with (``digests``)
        self.digest_keys = [(f[:8], _derived(k, b"sagaworker args digest"))
                            for f, k in zip(self.fingerprints, keys, strict=True)]
        self._first = Fernet(keys[0])
        self._all = MultiFernet([Fernet(k) for k in keys])
        #: the journal holds no token sealed before places (it says so: a new journal,
        #: or ``db rotate-key`` went through it): one found was copied there, refused
        self.placed_only = False

    def legacy(self, nonce: str | None) -> bool:
        """A saga's values may be in clear (its args digests unkeyed): it was journaled
        without a key (no nonce) and ``db rotate-key`` has not sealed the journal yet."""
        return nonce is None and not self.placed_only

    def seal(self, value: Any, place: Sequence[Any]) -> dict[str, str]:
        """``value`` (JSON-ready) as the stored wrapper, encrypted with the first key for
        ``place`` (the column's name, then its row's place values)."""
        plain = json.dumps({"at": list(place), "v": value}, separators=(",", ":"),
                           ensure_ascii=False)
        return {MARKER: self._all.encrypt(_PLACED + plain.encode()).decode("ascii")}

    def open(self, sealed: dict[str, str], where: str,
             place: Sequence[Any] | None) -> Any:
        """The clear value of a stored wrapper read from ``place`` (None: only whether a
        key opens it). ConfigurationError if no key decrypts it; SealedElsewhere if it was
        sealed for another place."""
        from cryptography.fernet import InvalidToken

        try:
            plain = self._all.decrypt(sealed[MARKER].encode("ascii"))
        except (InvalidToken, UnicodeEncodeError):
            raise ConfigurationError(
                f"none of the keys in {SETTING} decrypts {where} in the journal: it was "
                "written with another key; list that key too (after the current first "
                "one), or restore the keys the journal was written with") from None
        if not plain.startswith(_PLACED):
            nonced = place is not None and len(_unnonced(place)) < len(place)
            if place is not None and (self.placed_only or nonced):
                since = ("its saga's are all sealed for their place" if nonced else
                         "db rotate-key has placed every value of this journal since")
                raise SealedElsewhere(
                    f"the value in {_row(place)} was sealed before values had places, and "
                    f"{since}: it was copied there with SQL, not journaled, and is not "
                    f"read; restore the row {_FIX}")
            return json.loads(plain)  # sealed before places were: db rotate-key places it
        got = json.loads(plain[1:])
        if place is not None and got["at"] != list(place):
            was = _row(got["at"])
            if _unnonced(got["at"]) == _unnonced(place):  # the same row of another saga
                was = (f"an earlier saga with the id {place[1]!r} (pruned, its id used "
                       "again)")
            raise SealedElsewhere(
                f"the value in {_row(place)} was sealed for {was}: it was copied there "
                f"with SQL, not journaled, and is not read; restore the row {_FIX}")
        return got["v"]

    def is_placed(self, sealed: dict[str, str]) -> bool:
        """Sealed for its place (not a token sealed before places were)."""
        return bool(self._all.decrypt(sealed[MARKER].encode("ascii")).startswith(_PLACED))

    def is_current(self, sealed: dict[str, str]) -> bool:
        """Encrypted with the first key already (``db rotate-key`` leaves it as it is)."""
        from cryptography.fernet import InvalidToken

        try:
            self._first.decrypt(sealed[MARKER].encode("ascii"))
        except (InvalidToken, UnicodeEncodeError):
            return False
        return True


def _derived(key: str, label: bytes) -> bytes:
    """A key of its own for ``label``, derived from Fernet key ``key``."""
    import base64
    import hashlib
    import hmac

    return hmac.new(base64.urlsafe_b64decode(key), label, hashlib.sha256).digest()


def _unnonced(place: Sequence[Any]) -> list[Any]:
    """A place without its saga's nonce (``{"n": ...}``)."""
    return [v for v in place if not isinstance(v, dict)]


def _row(place: Sequence[Any]) -> str:
    """A place for people: ``sagaworker_entries.args (saga 'a', task 'x')`` (the saga's
    nonce, a random string, is not shown)."""
    values = _unnonced(place)[1:]
    if not values:
        return str(place[0])
    names = ("saga", "task" if str(place[0]).endswith("args") else "step")
    return f"{place[0]} (" + ", ".join(
        f"{n} {v!r}" for n, v in zip(names, values, strict=False)) + ")"


def cipher_of(keys: SecretStr | str | None) -> Cipher | None:
    """The cipher of the setting's value; None when it is unset or empty."""
    raw = keys.get_secret_value() if isinstance(keys, SecretStr) else keys
    if raw is None or not raw.strip():
        return None
    return Cipher(parse_keys(raw))


def attach(engine: Engine, cipher: Cipher | None) -> None:
    """Every statement on ``engine`` seals and opens journal values with ``cipher``.
    Statements compile otherwise with a cipher (``keyed_only``): those compiled already
    are forgotten when that changes."""
    was = registered(engine.dialect)
    if cipher is None:
        registry.pop(engine.dialect, None)
    else:
        registry[engine.dialect] = cipher
    if (was is None) != (cipher is None):
        engine.clear_compiled_cache()


def cipher_for(engine: Engine) -> Cipher | None:
    return _cipher(engine.dialect)


def _cipher(dialect: Dialect) -> Cipher | None:
    got = registered(dialect)
    return got if isinstance(got, Cipher) else None


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

    ``what`` names the column (errors, and the place a value is sealed for); ``place``:
    the columns of its row that place a value (the saga id, and a step's task id or seq).
    A value is written as :class:`Placed` (with those columns' values), whether or not a
    cipher is attached: a write that does not know its row is a bug, found in every test.
    ``None`` is stored as it always was (it tells nothing), and the args digest is taken
    over the clear values before they get here. ``container``: the column holds a dict by
    construction (kwargs, metadata), whose own keys are never read as kombu's type tag.
    The saga's nonce (``NONCE``), last in ``place``, is left out of a place where it is
    None (a saga journaled without a key, or before nonces: its values' places are
    unchanged).
    """

    impl = JSON
    cache_ok = True

    def __init__(self, what: str, place: tuple[str, ...] = ("saga_id",),
                 container: bool = False) -> None:
        super().__init__()
        self.what = what
        self.place = place
        self.container = container

    def load_dialect_impl(self, dialect: Dialect) -> TypeEngine[Any]:
        return dialect.type_descriptor(JSONB() if dialect.name == "postgresql" else JSON())

    def process_bind_param(self, value: Any, dialect: Dialect) -> Any:
        if value is None:
            return None
        if not isinstance(value, Placed):
            raise TypeError(f"internal: {self.what} written without its row's place "
                            "(crypto.Placed)")
        if value.value is None:
            return None
        plain = to_wire(value.value)  # datetimes, Decimals, UUIDs as kombu's JSON tags them
        cipher = _cipher(dialect)
        return plain if cipher is None else cipher.seal(plain, self.place_of(value.at))

    def place_of(self, at: Sequence[Any]) -> list[Any]:
        """The place a value of the row whose place values are ``at`` is sealed for: the
        column, then those values (the saga's nonce as ``{"n": nonce}``, or left out)."""
        values = list(at)
        if len(values) == len(self.place) and self.place[-1] == NONCE:
            nonce = values.pop()
            if nonce is not None:
                values.append({"n": nonce})
        return [self.what, *values]

    def _refuse_clear(self, cipher: Cipher, at: Sequence[Any] | None) -> None:
        """A clear value read by a process with keys: refused where every value is sealed
        (the journal, once ``db rotate-key`` sealed it; a saga with a nonce, journaled
        with a key): it was written there with SQL."""
        nonce = None
        if at is not None and len(at) == len(self.place) and self.place[-1] == NONCE:
            nonce = at[-1]
        if not cipher.legacy(nonce):
            where = "this journal is sealed (db rotate-key)" if cipher.placed_only else (
                "this saga is sealed")
            raise SealedElsewhere(
                f"the value in {_row(self.place_of(at) if at is not None else [self.what])}"
                f" is in clear, and every value of {where}: it was written there with SQL, "
                f"not journaled, and is not read; restore the row {_FIX}")

    def column_expression(self, colexpr: ColumnElement[Any]) -> ColumnElement[Any] | None:
        """Read beside its row's place (the columns ``place`` names, of the same table,
        alias or subquery), added by SQL to a sealed value only; None (as it is) where the
        statement has no such columns, and then a placed token is refused."""
        col = colexpr.element if isinstance(colexpr, Label) else colexpr
        table = getattr(col, "table", None)
        if table is None or not all(name in table.c or name in derived_places
                                    for name in self.place):
            return None
        return type_coerce(Located(col, *place_columns(table, self.place)), self)

    def process_result_value(self, value: Any, dialect: Dialect) -> Any:
        at: Sequence[Any] | None = None
        if isinstance(value, dict) and AT in value and MARKER in value:
            value = dict(value)
            at = value.pop(AT)
        elif (isinstance(value, dict) and len(value) == 2 and CLEAR in value and AT in value
              and registered(dialect) is not None):  # a clear value, beside its place
            value, at = value[CLEAR], value[AT]
        return self.open_at(value, dialect, at)

    def open_at(self, value: Any, dialect: Dialect, at: Sequence[Any] | None) -> Any:
        """A stored value read from the row whose place values are ``at`` (None: unknown,
        a placed token is refused). A place key stored beside a token (put there with
        SQL: sagaworker never writes one) is dropped, never taken for the row's."""
        if isinstance(value, dict) and AT in value and MARKER in value:
            value = {k: v for k, v in value.items() if k != AT}
        cipher = _cipher(dialect)
        if not is_sealed(value):
            if value is not None and cipher is not None:
                self._refuse_clear(cipher, at)
            return from_wire(value, container=self.container)
        if cipher is None:
            raise ConfigurationError(
                f"{self.what} in the journal is encrypted; set {SETTING} to the keys it was "
                "written with (the same value the workers have) to read it")
        place = self.place_of(at) if at is not None else [self.what, "(unknown row)"]
        return from_wire(cipher.open(value, self.what, place), container=self.container)
