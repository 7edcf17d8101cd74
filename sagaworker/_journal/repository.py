"""The journal: the store every read and every move (``machine``) goes through, each one
short transaction.

Invariant kept throughout: every transition that another process may race is a
compare-and-set inside a transaction that first locks the saga row (``FOR UPDATE`` on
PostgreSQL; ``BEGIN IMMEDIATE`` on SQLite), so step starts, EXECUTED commits, the
RUNNING -> COMPENSATING switch and the final status are serialized per saga.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from datetime import UTC, datetime
from typing import Any, ParamSpec, TypeVar

from sqlalchemy import (
    Connection,
    Engine,
    insert,
    or_,
    update,
)

from .._base.canonical import storable
from .._observe.logging import get_logger
from .dialect import db_now, listens, read_only
from .nonces import SagaNonces
from .notify import Notifier, Wake
from .raw_rows import opened, raw_select
from .reads import JournalReads, NewEntry
from .rows import idempotency_key
from .schema import audit, entries, sagas
from .transactions import DB_RETRY_SECONDS, retrying
from .transactions import write as _write

__all__ = ["DB_RETRY_SECONDS", "Journal", "NewEntry", "idempotency_key", "now", "retrying"]

_log = get_logger()


_T = TypeVar("_T")
_P = ParamSpec("_P")


def now() -> datetime:
    """This host's clock: for people to read only (every stamp is the database's)."""
    return datetime.now(UTC)


class Journal(JournalReads, SagaNonces):
    """Repository over the sagaworker tables."""

    def __init__(self, engine: Engine) -> None:
        #: write transactions (``BEGIN IMMEDIATE`` on SQLite)
        self.engine = engine
        #: read-only transactions: the same pool; on SQLite WAL readers, no write lock
        self.reader = read_only(engine)
        self._notifier: Notifier | None = None
        self._notifier_lock = threading.Lock()
        self._nonces: dict[str, str | None] = {}  # (``SagaNonces``)

    def watch(self, saga_id: str, wake: Wake | None = None, *,
              register_here: bool = True) -> AbstractContextManager[Wake]:
        """What a waiting call sleeps on (``poll``; ``aio``'s own): LISTEN/NOTIFY on PG."""
        if not listens(self.engine):
            return nullcontext(wake or Wake(None))
        if self._notifier is None:
            with self._notifier_lock:
                if self._notifier is None:
                    self._notifier = Notifier(self.engine)
        return self._notifier.watch(saga_id, wake, register_here=register_here)

    def registered(self, saga_id: str) -> bool:
        """Whether this process listens for the saga's notifications already (PostgreSQL):
        a wait on it then registers with no round trip."""
        notifier = self._notifier
        return notifier is not None and notifier.registered(saga_id)

    def write(self, body: Callable[[Connection], _T],
              landed: Callable[[], _T | None] | None = None) -> _T:
        """Run ``body`` in a write transaction (``transactions.write``: replayed when it
        failed before COMMIT, answered from ``landed`` when only the COMMIT's reply was
        lost)."""
        return _write(self.engine, body, landed)

    def create_all(self) -> None:
        """The embedded journal's tables, stamped with the code's revision (``embedded``)."""
        from .embedded import set_up

        set_up(self.engine)

    # -- helpers -----------------------------------------------------------------

    # The moves read rows with their user data as stored: they decide on the clear
    # columns, so a value copied in with SQL (``crypto.SealedElsewhere``) never stops one.

    def lock_saga(self, conn: Connection, saga_id: str) -> Any:
        row = conn.execute(raw_select(sagas).where(sagas.c.saga_id == saga_id)
                           .with_for_update()).first()
        if row is not None:
            self.note_nonce(saga_id, row.place_nonce)
        return row

    @staticmethod
    def entry(conn: Connection, saga_id: str, seq: int, *, opening: bool = False) -> Any:
        """An entry's row (None if there is none); ``opening``: its user data opened,
        raising what a read of it raises."""
        row = conn.execute(raw_select(entries).where(entries.c.saga_id == saga_id,
                                                     entries.c.seq == seq)).first()
        return opened(row, entries, conn.dialect) if opening and row is not None else row

    @staticmethod
    def touch(conn: Connection, saga_id: str, **values: Any) -> None:
        conn.execute(
            update(sagas).where(sagas.c.saga_id == saga_id).values(updated_at=db_now(),
                                                                   **_storable(values))
        )

    @staticmethod
    def set_entry(conn: Connection, saga_id: str, seq: int, *where: Any, **values: Any) -> int:
        stmt = (
            update(entries)
            .where(entries.c.saga_id == saga_id, entries.c.seq == seq, *where)
            .values(updated_at=db_now(), **_storable(values))
        )
        return conn.execute(stmt).rowcount

    def audit(self, conn: Connection, saga_id: str, seq: int | None, action: str,
              actor: str | None, detail: str | None = None, token: str | None = None) -> None:
        conn.execute(insert(audit).values(saga_id=saga_id, seq=seq, action=action,
                                          **_storable({"actor": actor, "detail": detail}),
                                          at=db_now(), token=token))

    def mark_advanced(self, saga_id: str, seen: int) -> None:
        """A flow was replayed against a journal in which ``seen`` steps had an outcome:
        the sweeper re-sends the advance while more have one. A compare-and-set: a replay
        that read less never lowers what a later one recorded."""
        with self.engine.begin() as conn:
            conn.execute(update(sagas).where(
                sagas.c.saga_id == saga_id,
                or_(sagas.c.advanced_seen.is_(None), sagas.c.advanced_seen < seen))
                .values(advanced_at=db_now(), advanced_seen=seen, resends=0, resend_at=None))


def _storable(values: dict[str, Any]) -> dict[str, Any]:
    """Text written by a move (an error, a reason, a detail) as PostgreSQL can hold it:
    an exception's message may carry a NUL, which would fail the move with a raw error."""
    return {k: storable(v) if isinstance(v, str) else v for k, v in values.items()}


