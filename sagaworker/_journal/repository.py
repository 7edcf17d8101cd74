"""The journal: every read and write of saga state, each one short transaction.

Invariant kept throughout: every transition that another process may race is a
compare-and-set inside a transaction that first locks the saga row (``FOR UPDATE`` on
PostgreSQL; ``BEGIN IMMEDIATE`` on SQLite), so step starts, EXECUTED commits, the
RUNNING -> COMPENSATING switch and the final status are serialized per saga.
"""

from __future__ import annotations

import secrets
import threading
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from datetime import UTC, datetime
from typing import Any, NoReturn, ParamSpec, TypeVar

from sqlalchemy import (
    Connection,
    Engine,
    insert,
    or_,
    select,
    update,
)
from sqlalchemy.exc import IntegrityError, InterfaceError, OperationalError

from .._base.canonical import storable
from .._base.crypto import Placed
from .._base.errors import SagaExists, SagaNotFound, SagaworkerError
from .._base.patches import MARKER_DETAIL
from .._base.types import (
    OPEN_VALUES,
    OutcomeResult,
    Phase,
    SagaStatus,
)
from .._observe.logging import get_logger
from . import pgfast as _pgfast
from .app_tx import AppTx
from .dialect import db_later, db_now, listens, read_only
from .lifecycle import performs
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

    def watch(self, saga_id: str, wake: Wake | None = None) -> AbstractContextManager[Wake]:
        """What a waiting call sleeps on (``poll``; ``aio``'s own): LISTEN/NOTIFY on PG."""
        if not listens(self.engine):
            return nullcontext(wake or Wake(None))
        if self._notifier is None:
            with self._notifier_lock:
                if self._notifier is None:
                    self._notifier = Notifier(self.engine)
        return self._notifier.watch(saga_id, wake)

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

    # -- producer ----------------------------------------------------------------

    @performs("saga", "begin")
    def create_saga(self, saga_id: str, meta: dict[str, Any], *,
                    deadline: float | None = None, flow: str | None = None,
                    flow_args: list[Any] | None = None,
                    flow_kwargs: dict[str, Any] | None = None, tx: AppTx | None = None,
                    trace_context: str | None = None) -> None:
        # every stamp is the database's clock (a deadline too: a producer whose clock is
        # behind would otherwise give its saga more time, or less)
        traced = {} if trace_context is None else {"trace_context": trace_context}
        # sealed values are sealed for this saga's own nonce: a saga id used again after
        # a prune seals for another one (and a clear value in this saga is refused)
        nonce = secrets.token_hex(16) if self.keyed else None
        at = (saga_id, nonce)
        try:
            (tx.run if tx else self.write)(lambda conn: conn.execute(insert(sagas).values(
                saga_id=saga_id, status=SagaStatus.RUNNING.value, place_nonce=nonce,
                metadata=Placed(meta, at),
                created_at=db_now(), updated_at=db_now(), last_seq=0, exec_counter=0,
                deadline_at=None if deadline is None else db_later(deadline),
                flow=flow, flow_args=Placed(flow_args, at),
                flow_kwargs=Placed(flow_kwargs, at), **traced)))
            self.note_nonce(saga_id, nonce)
        except IntegrityError as exc:
            raise SagaExists(
                f"saga {saga_id!r} already exists; pick a new id, or use sw.get({saga_id!r}) "
                "to carry on the existing one"
            ) from exc

    @performs("step", "journal", "gate", "mark")
    @performs("saga", "await_decision")
    def add_entries(self, saga_id: str, new: Sequence[NewEntry], *,
                    expect_seq: int | None = None, seen: int | None = None,
                    tx: AppTx | None = None) -> list[int]:
        """Journal INTENT (or AWAITING_APPROVAL) rows in one transaction (``tx``: the
        caller's); returns seqs.

        ``expect_seq``: journal them only if the saga's last seq is still that one (a
        flow's replay saw that much of the journal), else nothing (another replay did);
        ``seen``: how many steps had an outcome in what that replay read.
        """
        gated = any(e.gated for e in new)
        if (len(new) == 1 and new[0].call_id is None and tx is None
                and not new[0].marker and _pgfast.enabled(self.engine)):
            try:
                seq = self._intent_fast(saga_id, new[0], expect_seq, seen)
                return [] if seq is None else [seq]
            except _NonceMoved:
                pass  # (the saga's nonce as this process knew it is not the journal's)

        def body(conn: Connection) -> list[int]:
            values: dict[str, Any] = {"last_seq": sagas.c.last_seq + len(new),
                                      "updated_at": db_now()}
            if expect_seq is not None:  # a flow's replay journals its next steps
                values.update(advanced_at=db_now(), advanced_seen=seen,
                              resends=0, resend_at=None)
            if gated:
                values["status"] = SagaStatus.AWAITING_APPROVAL.value
            guard = [] if expect_seq is None else [sagas.c.last_seq == expect_seq]
            bump = (update(sagas)
                    .where(sagas.c.saga_id == saga_id,
                           sagas.c.status.in_(OPEN_VALUES),
                           sagas.c.fail_requested_at.is_(None), *guard)
                    .values(**values)
                    .returning(sagas.c.last_seq, sagas.c.place_nonce))
            row = conn.execute(bump).first()
            if row is None and expect_seq is not None:
                return []
            if row is None:
                _refuse_enqueue(conn, saga_id)
            assert row is not None
            first = int(row[0]) - len(new) + 1
            traced = any(e.trace_context is not None for e in new)
            conn.execute(insert(entries).values(created_at=db_now(), updated_at=db_now()),
                         [_entry_values(saga_id, first + i, e, traced, row[1])
                          for i, e in enumerate(new)])
            gates = [first + i for i, e in enumerate(new) if e.gated]
            if gates:
                conn.execute(update(entries).where(entries.c.saga_id == saga_id,
                                                   entries.c.seq.in_(gates))
                             .values(approval_requested_at=entries.c.created_at))
            markers = [first + i for i, e in enumerate(new) if e.marker]
            if markers:
                conn.execute(update(entries).where(entries.c.saga_id == saga_id,
                                                   entries.c.seq.in_(markers))
                             .values(executed_at=entries.c.created_at))
            return [first + i for i in range(len(new))]

        if tx is not None:
            return tx.run(body)
        return self.write(body, lambda: self._seqs_of(saga_id, [e.task_id for e in new]))

    def _seqs_of(self, saga_id: str, task_ids: list[str]) -> list[int] | None:
        """The seqs of the entries journaled with these task ids (new for every enqueue),
        in their order, if all of them are in the journal (one transaction wrote them)."""
        with self.engine.connect() as conn:
            found = dict(conn.execute(select(entries.c.task_id, entries.c.seq).where(
                entries.c.saga_id == saga_id, entries.c.task_id.in_(task_ids))).all())
        if len(found) != len(task_ids):
            return None
        return [int(found[t]) for t in task_ids]

    @performs("step", "journal", "gate")
    @performs("saga", "await_decision")
    def _intent_fast(self, saga_id: str, e: NewEntry, expect_seq: int | None,
                     seen: int | None) -> int | None:
        """One step's INTENT in one round trip (``_pgfast``); a flow's replay's only if
        the journal is still what it read (else None); an eager step's claimed with it.

        A lost connection leaves it unknown whether the statement committed: once its
        server process is done with it (``_pgfast.settle``), the entry's task id (new for
        every enqueue) tells, and the statement is sent again only when no entry carries
        it. So a step is never journaled twice, and a stale connection
        (a PostgreSQL restart) costs a retry, not an error.
        """
        claim = None if e.claim is None else (e.claim.token, e.claim.worker, e.claim.lease)
        # sealed for the saga's nonce, as this process knows it: the statement checks it
        # still is (a saga id used again has another), else the locked path reads it
        place = self.place(saga_id)

        def once() -> tuple[int, bool] | None:
            return _pgfast.intent(self.engine, saga_id=saga_id, tool=e.tool_name,
                                  args=e.args, kwargs=e.kwargs, digest=e.args_digest,
                                  queue=e.queue, task_id=e.task_id, gated=e.gated,
                                  nonce=e.approval_nonce, trace_context=e.trace_context,
                                  expect=expect_seq, seen=seen, claim=claim, place=place)

        try:
            got = once()
        except (OperationalError, InterfaceError) as exc:
            # the statement may still be running on the server (waiting on the saga row,
            # say): stopped and awaited first, then its commit is visible or never happens;
            # a database away for a moment is waited for, as every move waits for it, so
            # a claim that committed is recognised by its token, never left to lapse into
            # doubt while its worker is alive and its tool never started
            found = self._intent_landed(saga_id, e.task_id, exc)
            got = once() if found is None else (
                found[0], claim is not None and found[1] == claim[0])
        if got is None and place is not None:
            self.forget_nonce(saga_id)
            raise _NonceMoved  # (or the saga takes no step: the locked path says which)
        if got is None:
            if expect_seq is not None:  # the flow moved on (or is over): nothing journaled
                return None
            with self.reader.connect() as conn:
                _refuse_enqueue(conn, saga_id)
        assert got is not None
        if e.claim is not None:
            e.claim.done = got[1]
        return got[0]

    @retrying
    def _intent_landed(self, saga_id: str, task_id: str, exc: BaseException
                       ) -> tuple[int, str | None] | None:
        """Whether the INTENT statement whose reply ``exc`` lost committed: its seq and
        claim token, once its server process is done with it."""
        _pgfast.settle(self.engine, exc)
        return _pgfast.intent_seq(self.engine, saga_id, task_id)

    def mark_advanced(self, saga_id: str, seen: int) -> None:
        """A flow was replayed against a journal in which ``seen`` steps had an outcome:
        the sweeper re-sends the advance while more have one. A compare-and-set: a replay
        that read less never lowers what a later one recorded."""
        with self.engine.begin() as conn:
            conn.execute(update(sagas).where(
                sagas.c.saga_id == saga_id,
                or_(sagas.c.advanced_seen.is_(None), sagas.c.advanced_seen < seen))
                .values(advanced_at=db_now(), advanced_seen=seen, resends=0, resend_at=None))


class _NonceMoved(Exception):
    """The one-statement INTENT missed: the saga's nonce may not be the one this process
    knew (a saga id used again), so the locked path journals the step."""


def _entry_values(saga_id: str, seq: Any, e: NewEntry, traced: bool,
                  nonce: str | None) -> dict[str, Any]:
    """An entry's row, its values sealed for its saga's ``nonce``; its trace context only
    when the batch has one (else no column)."""
    values = {
        "saga_id": saga_id, "seq": seq, "tool_name": e.tool_name,
        "phase": (Phase.EXECUTED if e.marker else Phase.AWAITING_APPROVAL if e.gated
                  else Phase.INTENT).value,
        "args": Placed(e.args, (saga_id, e.task_id, nonce)),
        "kwargs": Placed(e.kwargs, (saga_id, e.task_id, nonce)), "args_digest": e.args_digest,
        "queue": e.queue, "task_id": e.task_id, "attempts": 0,
        "in_doubt": False, "compensation_attempts": 0, "approval_nonce": e.approval_nonce,
        "call_id": e.call_id,
        # a patch marker: nothing to run, nothing to undo (no chain claims it)
        "compensation": OutcomeResult.SKIPPED.value if e.marker else None,
        "compensation_detail": MARKER_DETAIL if e.marker else None}
    if traced:
        values["trace_context"] = e.trace_context
    return values


def _storable(values: dict[str, Any]) -> dict[str, Any]:
    """Text written by a move (an error, a reason, a detail) as PostgreSQL can hold it:
    an exception's message may carry a NUL, which would fail the move with a raw error."""
    return {k: storable(v) if isinstance(v, str) else v for k, v in values.items()}


def _refuse_enqueue(conn: Connection, saga_id: str) -> NoReturn:
    row = conn.execute(select(sagas.c.status, sagas.c.fail_requested_at)
                       .where(sagas.c.saga_id == saga_id)).first()
    if row is None:
        raise SagaNotFound(f"no saga {saga_id!r}; begin it with sw.begin({saga_id!r}) first")
    if row.fail_requested_at is not None and row.status in OPEN_VALUES:
        raise SagaworkerError(
            f"saga {saga_id!r} is failing (compensation requested); it takes no new steps")
    raise SagaworkerError(
        f"saga {saga_id!r} is {row.status}; only a RUNNING or AWAITING_APPROVAL saga "
        "takes new steps: begin a new saga")
