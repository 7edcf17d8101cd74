"""``sagaworker db rotate-key``: re-encrypt the journal with the first key.

A batch of sagas is one short transaction that locks the saga rows, then their entries
(the state machine's own lock order, so live workers only wait a moment), reads the
stored values as they are (wrappers, not decrypted), and rewrites the ones that are clear
or encrypted with another key than the first, or sealed before values were sealed for their
place (their column and row). Values sealed with the first key for their place already
are left alone, so a second run rewrites nothing and an interrupted one just carries on. A
value sealed for another place (copied there with SQL) stops the run, naming the row: it
is never sealed again for the row it was copied to. An entry's args digests (``args_digest``,
``approved_digest``) are rewritten under the first key too, each only where it is its
arguments' digest (unkeyed, or under another key): one that is not stays as it is, and
matches nothing.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import JSON, Column, Connection, Engine, Table, bindparam, select, update
from sqlalchemy.dialects.postgresql import JSONB
from sqlalchemy.sql import type_coerce

from .._base import digests
from .._base.crypto import NONCE, SETTING, Cipher, SealedJSON, is_sealed
from .._base.errors import ConfigurationError
from .readiness import forget_keys
from .repository import retrying
from .schema import entries, sagas

__all__ = ["rotate_keys"]

#: the stored JSON as it is: wrappers are read and written without the cipher
_RAW = JSON().with_variant(JSONB(), "postgresql")


def _sealed_columns(table: Table) -> list[Column[Any]]:
    return [c for c in table.columns if isinstance(c.type, SealedJSON)]


def rotate_keys(engine: Engine, cipher: Cipher | None, *, batch: int = 100) -> int:
    """Re-encrypt every value (clear ones included) with the first key; returns how many
    rows (sagas and entries) were rewritten."""
    if cipher is None:
        raise ConfigurationError(
            f"rotate-key needs {SETTING}: put the new key first, keep the old ones after "
            "it, then run it again (docs/encryption.md)")
    after: str | None = None
    rewritten = 0
    while True:
        done, after = _rotate_batch(engine, cipher, after, batch)
        rewritten += done
        if after is None:
            with engine.begin() as conn:
                forget_keys(conn, cipher)
            return rewritten


@retrying
def _rotate_batch(engine: Engine, cipher: Cipher, after: str | None,
                  batch: int) -> tuple[int, str | None]:
    """One transaction: up to ``batch`` sagas after ``after`` and all their entries.
    Returns the rows rewritten and the last saga id (None when no saga is left)."""
    with engine.begin() as conn:
        q = (select(sagas.c.saga_id, sagas.c.place_nonce, *_raw(sagas))
             .order_by(sagas.c.saga_id).limit(batch))
        if after is not None:
            q = q.where(sagas.c.saga_id > after)
        rows = conn.execute(q.with_for_update()).all()
        if not rows:
            return 0, None
        ids = [r.saga_id for r in rows]
        nonces = {r.saga_id: r.place_nonce for r in rows}
        done = sum(_rewrite(conn, cipher, sagas, r, r.place_nonce,
                            sagas.c.saga_id == r.saga_id) for r in rows)
        ents = conn.execute(select(entries.c.saga_id, entries.c.seq, entries.c.task_id,
                                   entries.c.args_digest, entries.c.approved_digest,
                                   *_raw(entries))
                            .where(entries.c.saga_id.in_(ids))
                            .order_by(entries.c.saga_id, entries.c.seq)
                            .with_for_update()).all()
        done += sum(_rewrite(conn, cipher, entries, e, nonces[e.saga_id],
                             entries.c.saga_id == e.saga_id, entries.c.seq == e.seq)
                    for e in ents)
        return done, ids[-1]


def _raw(table: Table) -> list[Any]:
    return [type_coerce(c, _RAW).label(c.name) for c in _sealed_columns(table)]


def _rewrite(conn: Connection, cipher: Cipher, table: Table, row: Any,
             nonce: str | None, *where: Any) -> int:
    new: dict[str, Any] = {}
    clear: dict[str, Any] = {}
    for col in _sealed_columns(table):
        value = clear[col.name] = getattr(row, col.name)
        if value is None:
            continue  # None is never encrypted (SealedJSON stores it as it is)
        sealed: SealedJSON = col.type  # type: ignore[assignment]
        place = sealed.place_of([nonce if name == NONCE else getattr(row, name)
                                 for name in sealed.place])
        if is_sealed(value):
            opened = clear[col.name] = cipher.open(value, sealed.what, place)
            if cipher.is_current(value) and cipher.is_placed(value):
                continue
            value = opened
        new[col.name] = cipher.seal(value, place)
    if table is entries:
        new.update(_digests(cipher, row, clear["args"] or [], clear["kwargs"] or {}))
    if not new:
        return 0
    conn.execute(update(table).where(*where).values(
        {table.c[k]: bindparam(f"v_{k}", type_=_RAW if k in clear else None) for k in new}),
        {f"v_{k}": v for k, v in new.items()})
    return 1


def _digests(cipher: Cipher, row: Any, args: Any, kwargs: Any) -> dict[str, str]:
    """An entry's digests keyed under the first key, where they are not yet and are its
    arguments' (a stored value that would read as another's is left as it is)."""
    out = {}
    for name in ("args_digest", "approved_digest"):
        stored = getattr(row, name)
        if stored and not digests.is_current(cipher, stored) and digests.matches(
                cipher, stored, args, kwargs, clear_ok=True):
            out[name] = digests.digest(cipher, args, kwargs)
    return out
