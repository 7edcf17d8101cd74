"""A step's first row, journaled by its producer: INTENT (move ``journal``), AWAITING_APPROVAL
(``gate``, the saga awaiting a decision with it) or a flow's patch marker (``mark``), in one
transaction with the saga's seq bumped; on PostgreSQL one step in one round trip
(``pgfast.intent``). And a step journaled once per caller's call id (an agent's tool call)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NoReturn

from sqlalchemy import Connection, insert, select, update
from sqlalchemy.exc import IntegrityError, InterfaceError, OperationalError

from .._base.crypto import Placed
from .._base.errors import SagaNotFound, SagaworkerError
from .._base.patches import MARKER_DETAIL
from .._base.types import OPEN_VALUES, OutcomeResult, Phase, SagaStatus
from .._journal import pgconn
from .._journal.app_tx import AppTx
from .._journal.dialect import db_now
from .._journal.reads import NewEntry
from .._journal.repository import retrying
from .._journal.schema import entries, sagas
from . import pgfast as _pgfast
from .lifecycle import performs
from .moves_base import MoveBase

__all__ = ["IntentMoves"]


class IntentMoves(MoveBase):
    """The moves that journal a step's first row."""

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
                and not new[0].marker and _pgfast.enabled(self.j.engine)):
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
        return self.j.write(body, lambda: self._seqs_of(saga_id, [e.task_id for e in new]))

    def _seqs_of(self, saga_id: str, task_ids: list[str]) -> list[int] | None:
        """The seqs of the entries journaled with these task ids (new for every enqueue),
        in their order, if all of them are in the journal (one transaction wrote them)."""
        with self.j.engine.connect() as conn:
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
        server process is done with it (``pgconn.settle``), the entry's task id (new for
        every enqueue) tells, and the statement is sent again only when no entry carries
        it. So a step is never journaled twice, and a stale connection
        (a PostgreSQL restart) costs a retry, not an error.
        """
        claim = None if e.claim is None else (e.claim.token, e.claim.worker, e.claim.lease)
        # sealed for the saga's nonce, as this process knows it: the statement checks it
        # still is (a saga id used again has another), else the locked path reads it
        place = self.j.place(saga_id)

        def once() -> tuple[int, bool] | None:
            return _pgfast.intent(self.j.engine, saga_id=saga_id, tool=e.tool_name,
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
            self.j.forget_nonce(saga_id)
            raise _NonceMoved  # (or the saga takes no step: the locked path says which)
        if got is None:
            if expect_seq is not None:  # the flow moved on (or is over): nothing journaled
                return None
            with self.j.reader.connect() as conn:
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
        pgconn.settle(self.j.engine, exc)
        return _pgfast.intent_seq(self.j.engine, saga_id, task_id)

    def add_call(self, saga_id: str, e: NewEntry) -> tuple[Any, bool]:
        """Journal ``e`` unless the saga holds a step with its ``call_id`` already:
        ``(row, False)`` for that step, else ``(seq, True)``. Two callers racing with one
        id: the unique index lets one insert, the other reads its step."""
        assert e.call_id is not None
        found = self.j.call_row(saga_id, e.call_id)
        if found is not None:
            return found, False
        try:
            return self.add_entries(saga_id, [e])[0], True
        except IntegrityError:
            found = self.j.call_row(saga_id, e.call_id)
            if found is None:
                raise
            return found, False


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
