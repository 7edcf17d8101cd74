"""The state machine's moves (``_lifecycle`` lists them): each one guarded transaction.

Rules every method keeps:
- it locks the saga row first, then entry rows (the one lock order: no deadlocks), except
  the two single-statement hot paths (claim and EXECUTED) whose one statement is the
  compare-and-set;
- a forward attempt and an undo try are fenced by a random token taken when they are
  claimed: heartbeat, release, outcome and failure match on it, so a stale attempt, a late
  heartbeat or a duplicate delivery never writes over a newer one;
- tokens are made by the caller, outside the transaction, so a transaction replayed after
  a lost COMMIT (``retrying``) recognises its own write and answers as the first time did;
- leases are measured on the database's clock (``db_now``/``db_later``).
"""

from __future__ import annotations

import os
import secrets
import socket
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from sqlalchemy import and_, func, or_, select, update

from .._base.settings import Settings
from .._base.types import OPEN, OutcomeResult, Phase, SagaStatus
from . import pgfast as _pgfast
from .dialect import db_later, db_now
from .lifecycle import move
from .repository import Journal, now, retrying
from .schema import entries, sagas

__all__ = ["Claim", "Executed", "Held", "Machine", "Start", "UndoClaim", "UndoState",
           "new_token", "worker_label"]


def new_token() -> str:
    """A fresh attempt or undo token."""
    return secrets.token_hex(16)


def worker_label() -> str:
    """Who runs an attempt, for people to read. No behaviour depends on it."""
    return f"{socket.gethostname()}|{os.getpid()}"


class Start(Enum):
    RUN = "run"                  # this delivery runs the tool
    DONE = "done"                # already EXECUTED: the journaled result stands
    FINISHED = "finished"        # FAILED / CANCELLED / REJECTED: nothing to do
    BUSY = "busy"                # another delivery's attempt is still running
    CANCELLED = "cancelled"      # the saga is failing: the step is not run
    IN_DOUBT = "in_doubt"        # an earlier attempt died with no outcome
    NOT_APPROVED = "not_approved"
    UNKNOWN = "unknown"          # no such saga or entry
    MISMATCH = "mismatch"        # the message names another tool than the journal


@dataclass(frozen=True)
class Claim:
    start: Start
    attempt: int = 0
    row: Any = None
    saga_status: SagaStatus | None = None
    rerun: bool = False


@dataclass(frozen=True)
class Executed:
    """What journaling EXECUTED came to: ``applied`` False when the attempt was fenced."""

    applied: bool
    status: SagaStatus | None
    flow: str | None = None  # the saga's flow: the worker advances it at once


class UndoClaim(Enum):
    CLAIMED = "claimed"
    BUSY = "busy"                # another undo of the saga is live
    WAITING = "waiting"          # a forward step still runs; its outcome re-sends the chain
    FINISHED = "finished"
    NOT_COMPENSATING = "not_compensating"


@dataclass(frozen=True)
class UndoState:
    state: UndoClaim
    row: Any = None
    attempt: int = 0
    status: SagaStatus | None = None
    reason: str | None = None
    dirty_tools: tuple[str, ...] = ()
    #: forward steps found dead (in doubt) by this move: the caller logs step_in_doubt
    in_doubt: tuple[Any, ...] = ()
    #: undos given up by this move because their worker died on every try
    died: tuple[tuple[Any, str], ...] = field(default=())


#: what a process holds a lease on: (saga id, seq, True for an undo, token)
Held = tuple[str, int, bool, str]

_INTENT, _EXECUTED = Phase.INTENT.value, Phase.EXECUTED.value
_OPEN_VALUES = [s.value for s in OPEN]
_CLAIM = move("step", "claim")
_EXECUTE = move("step", "execute")


def _alive(col: Any) -> Any:
    return (col > db_now()).label("alive")


class Machine:
    """Every move that changes a status, a phase, an attempt or an undo try."""

    def __init__(self, journal: Journal, settings: Settings) -> None:
        self.j = journal
        self.settings = settings

    @property
    def lease(self) -> float:
        return self.settings.lease_seconds

    # -- a step's attempts ---------------------------------------------------------

    def claim_start(self, saga_id: str, seq: int, tool: str, *, token: str, worker: str,
                    idempotent: bool, task_id: str | None) -> Claim:
        """Move ``claim``: this delivery runs the tool, or is told why not."""
        engine = self.j.engine
        if _pgfast.enabled(engine):
            # the same compare-and-set as below, one round trip (``_pgfast``)
            got = _pgfast.claim(engine, saga_id=saga_id, seq=seq, tool=tool, token=token,
                                worker=worker, task_id=task_id, lease=self.lease, t=now())
            if got is not None:
                return Claim(Start.RUN, attempt=got.attempts, row=got)
            with engine.begin() as conn:
                return self._claim_locked(conn, saga_id, seq, tool, token, worker,
                                          idempotent, task_id)
        with engine.begin() as conn:
            # Fast path, one statement: an ungated INTENT nobody holds, in an open saga
            # not asked to fail. The entry row is the serialization point: moves that
            # cancel it (begin_compensation, finish) are compare-and-sets on that row, so
            # a claim lands first (the step runs, the chain waits for it) or finds it no
            # longer INTENT. Gated steps take the locked path: their IRREVERSIBLE effect
            # must see a failure request that committed a moment before.
            claimed = conn.execute(
                update(entries)
                .where(entries.c.saga_id == saga_id, entries.c.seq == seq,
                       entries.c.phase == _INTENT, entries.c.lease_until.is_(None),
                       entries.c.tool_name == tool, entries.c.approved_by.is_(None),
                       sagas.c.saga_id == entries.c.saga_id,
                       sagas.c.status.in_(_OPEN_VALUES), sagas.c.fail_requested_at.is_(None))
                .values(attempts=entries.c.attempts + 1, started_at=now(),
                        lease_until=db_later(self.lease), worker=worker, attempt_token=token,
                        retry_due_at=None, task_id=func.coalesce(task_id, entries.c.task_id),
                        resends=0, resend_at=None, updated_at=now())
                .returning(*entries.c)).first()  # (SQLite returns the target table only)
            if claimed is not None:
                return Claim(Start.RUN, attempt=claimed.attempts, row=claimed)
            return self._claim_locked(conn, saga_id, seq, tool, token, worker, idempotent,
                                      task_id)

    def _claim_locked(self, conn: Any, saga_id: str, seq: int, tool: str, token: str,
                      worker: str, idempotent: bool, task_id: str | None) -> Claim:
        # Lock the saga row, then read the entry in a statement of its own (a joined
        # SELECT ... FOR UPDATE OF sagas would read the entry from the snapshot taken
        # before the lock wait).
        saga = self.j.lock_saga(conn, saga_id)
        row = conn.execute(select(entries, _alive(entries.c.lease_until))
                           .where(entries.c.saga_id == saga_id, entries.c.seq == seq)).first()
        if saga is None or row is None:
            return Claim(Start.UNKNOWN)
        status = SagaStatus(saga.status)
        if row.tool_name != tool:
            return Claim(Start.MISMATCH, row=row, saga_status=status)
        phase = Phase(row.phase)
        if phase is Phase.EXECUTED:
            return Claim(Start.DONE, row=row, saga_status=status)
        if phase is Phase.AWAITING_APPROVAL:
            return Claim(Start.NOT_APPROVED, row=row, saga_status=status)
        if phase is not Phase.INTENT:
            return Claim(Start.FINISHED, row=row, saga_status=status)
        if row.attempt_token == token and row.lease_until is not None:
            # our own claim, whose COMMIT reply was lost: replayed, it is still ours
            return Claim(Start.RUN, attempt=row.attempts, row=row, saga_status=status,
                         rerun=row.reruns > 0)
        if row.alive:
            return Claim(Start.BUSY, row=row, saga_status=status)
        died = row.lease_until is not None  # started, lease lapsed, no outcome journaled
        failing = status not in OPEN or saga.fail_requested_at is not None
        if died and (failing or not idempotent or row.reruns >= self.settings.max_reruns):
            if not failing:
                why = (f"died on each of its {row.reruns + 1} attempts"
                       if idempotent else "its worker was lost")
                self._request_failure(conn, saga, f"step {seq} ({row.tool_name}) in doubt: "
                                                  f"{why}")
            self._doubt(conn, saga_id, seq, row.attempt_token, idempotent and not failing,
                        row.reruns)
            return Claim(Start.IN_DOUBT, row=row, saga_status=status)
        if failing:
            why = ("its Celery retry was not run" if row.started_at is not None
                   else "it never started")
            self._cancel(conn, saga_id, seq, f"cancelled: the saga is failing and {why}")
            return Claim(Start.CANCELLED, row=row, saga_status=status)
        self.j.set_entry(conn, saga_id, seq, entries.c.phase == _INTENT,
                         attempts=row.attempts + 1, started_at=now(),
                         lease_until=db_later(self.lease), worker=worker, attempt_token=token,
                         retry_due_at=None, reruns=row.reruns + (1 if died else 0),
                         task_id=task_id or row.task_id, resends=0, resend_at=None)
        return Claim(Start.RUN, attempt=row.attempts + 1, row=row, saga_status=status,
                     rerun=died)

    def _doubt(self, conn: Any, saga_id: str, seq: int, token: str | None, exhausted: bool,
               reruns: int) -> None:
        """Move ``doubt``: the attempt's worker was lost before an outcome."""
        why = (f"in doubt: the attempt's worker was lost before an outcome was journaled, "
               f"on each of {reruns + 1} attempts (SAGAWORKER_MAX_RERUNS); the effect may or "
               "may not have happened" if exhausted else
               "in doubt: the attempt's worker was lost before an outcome was journaled; "
               "the effect may or may not have happened")
        self.j.set_entry(conn, saga_id, seq, entries.c.phase == _INTENT,
                         phase=move("step", "doubt").target, in_doubt=True, lease_until=None,
                         attempt_token=token, error=why)

    def _cancel(self, conn: Any, saga_id: str, seq: int, why: str) -> int:
        return int(self.j.set_entry(conn, saga_id, seq, entries.c.phase == _INTENT,
                                    entries.c.lease_until.is_(None),
                                    phase=move("step", "cancel").target, error=why))

    def _request_failure(self, conn: Any, saga: Any, reason: str) -> None:
        """Ask a saga to fail, once: the first reason stands."""
        if saga.fail_requested_at is None and SagaStatus(saga.status) in OPEN:
            self.j.touch(conn, saga.saga_id, fail_requested_at=now(), reason=reason)

    def heartbeat(self, held: list[Held]) -> None:
        """Move ``heartbeat``: extend the leases this process still holds, by token.

        One short transaction each; an undo's also tells the sweeper the chain moves.
        """
        for saga_id, seq, undo, token in held:
            with self.j.engine.begin() as conn:
                if undo:
                    self.j.touch(conn, saga_id, chain_touched_at=now())
                    conn.execute(update(entries).where(
                        entries.c.saga_id == saga_id, entries.c.seq == seq,
                        entries.c.compensation.is_(None), entries.c.undo_token == token,
                        entries.c.comp_lease_until.is_not(None))
                        .values(comp_lease_until=db_later(self.lease)))
                else:
                    conn.execute(update(entries).where(
                        entries.c.saga_id == saga_id, entries.c.seq == seq,
                        entries.c.phase == _INTENT, entries.c.attempt_token == token,
                        entries.c.lease_until.is_not(None))
                        .values(lease_until=db_later(self.lease)))

    def release(self, saga_id: str, seq: int, token: str, error: str) -> SagaStatus | None:
        """Move ``release``: the attempt raised; Celery may retry it (not in doubt)."""
        with self.j.engine.begin() as conn:
            saga = self.j.lock_saga(conn, saga_id)
            if saga is None:
                return None
            self.j.set_entry(conn, saga_id, seq, entries.c.phase == _INTENT,
                             entries.c.attempt_token == token,
                             lease_until=None, error=error,
                             retry_due_at=db_later(self.settings.relay_after))
            return SagaStatus(saga.status)

    def retry_due(self, saga_id: str, seq: int, token: str, delay: float,
                  retries: int) -> None:
        """When Celery's retry message of a released attempt is due (the sweeper resends
        it when it does not come)."""
        with self.j.engine.begin() as conn:
            self.j.set_entry(conn, saga_id, seq, entries.c.phase == _INTENT,
                             entries.c.attempt_token == token, entries.c.lease_until.is_(None),
                             retry_due_at=db_later(max(delay, 0.0)), celery_retries=retries)

    def executed(self, saga_id: str, seq: int, token: str, result: Any,
                 duration_ms: float, *, error: str | None = None) -> Executed:
        """Move ``execute``; ``applied`` False when another attempt fenced this one out.
        ``error``: the effect happened but its result cannot be journaled (result None)."""
        t = now()
        engine = self.j.engine
        if _pgfast.enabled(engine):
            got = _pgfast.executed(engine, saga_id=saga_id, seq=seq, token=token,
                                   result=result, duration_ms=duration_ms, t=t, error=error)
            if got is not None:
                return Executed(True, SagaStatus(got[0]), got[1])
        with engine.begin() as conn:
            if _pgfast.enabled(engine):
                # a miss of the statement above: a replay of our own outcome, or fenced
                saga = self.j.lock_saga(conn, saga_id)
            else:
                saga = self.j.lock_saga(conn, saga_id)
                if saga is None:
                    return Executed(False, None)
                n = self.j.set_entry(conn, saga_id, seq, entries.c.phase == _INTENT,
                                     entries.c.attempt_token == token,
                                     phase=_EXECUTE.target, result=result, executed_at=t,
                                     exec_order=saga.exec_counter + 1, lease_until=None,
                                     duration_ms=duration_ms, error=error)
                if n:
                    self.j.touch(conn, saga_id, exec_counter=saga.exec_counter + 1)
                    return Executed(True, SagaStatus(saga.status), saga.flow)
            if saga is None:
                return Executed(False, None)
            row = self.j.entry(conn, saga_id, seq)
            replay = row is not None and row.phase == _EXECUTED and row.attempt_token == token
            return Executed(replay, SagaStatus(saga.status), saga.flow)

    def failed(self, saga_id: str, seq: int, token: str, error: str, *,
               in_doubt: bool = False) -> SagaStatus | None:
        """Move ``fail``: the saga status, or None when the attempt no longer holds it."""
        with self.j.engine.begin() as conn:
            saga = self.j.lock_saga(conn, saga_id)
            if saga is None:
                return None
            n = self.j.set_entry(conn, saga_id, seq, entries.c.phase == _INTENT,
                                 entries.c.attempt_token == token,
                                 phase=move("step", "fail").target, error=error,
                                 in_doubt=in_doubt, lease_until=None)
            if not n:
                row = self.j.entry(conn, saga_id, seq)
                replay = (row is not None and row.phase == Phase.FAILED.value
                          and row.attempt_token == token)
                return SagaStatus(saga.status) if replay else None
            tool = self.j.entry(conn, saga_id, seq).tool_name
            self._request_failure(conn, saga, f"step {seq} ({tool}) failed: {error}")
            return SagaStatus(saga.status)

    # -- the saga --------------------------------------------------------------------

    def request_failure(self, saga_id: str, reason: str) -> SagaStatus:
        """Journal that the saga must fail (gates close at once); raises for COMPLETED."""
        from .._base.errors import SagaNotFound, SagaworkerError

        with self.j.engine.begin() as conn:
            saga = self.j.lock_saga(conn, saga_id)
            if saga is None:
                raise SagaNotFound(f"no saga {saga_id!r}")
            status = SagaStatus(saga.status)
            if status is SagaStatus.COMPLETED:
                raise SagaworkerError(
                    f"saga {saga_id!r} is COMPLETED; a completed saga is not undone. Begin a "
                    "new saga for the correction")
            self._request_failure(conn, saga, reason)
            return status

    def abort(self, saga_id: str, *, reason: str, actor: str) -> SagaStatus:
        """An operator asks a saga to fail (gates close at once); refused once terminal."""
        from .._base.errors import SagaNotFound, SagaworkerError

        with self.j.engine.begin() as conn:
            saga = self.j.lock_saga(conn, saga_id)
            if saga is None:
                raise SagaNotFound(f"no saga {saga_id!r}")
            status = SagaStatus(saga.status)
            if status not in OPEN:
                raise SagaworkerError(
                    f"saga {saga_id!r} is {status.value}; only a RUNNING or AWAITING_APPROVAL "
                    "saga can be aborted")
            self._request_failure(conn, saga, f"aborted by {actor}: {reason}")
            self.j.audit(conn, saga_id, None, "abort", actor, reason)
            return status

    def fail_overdue(self, saga_id: str) -> Any:
        """The deadline passed: ask the saga to fail; its row when this call did."""
        with self.j.engine.begin() as conn:
            saga = self.j.lock_saga(conn, saga_id)
            if (saga is None or SagaStatus(saga.status) not in OPEN
                    or saga.fail_requested_at is not None or saga.deadline_at is None):
                return None
            self._request_failure(conn, saga, "deadline passed")
            return saga

    def begin_compensation(self, saga_id: str, reason: str | None,
                           token: str) -> tuple[bool, int, str]:
        """Move ``begin_compensation``: one failure handler wins and starts the chain."""
        t = now()
        with self.j.engine.begin() as conn:
            saga = self.j.lock_saga(conn, saga_id)
            if saga is None:
                return False, 0, ""
            if SagaStatus(saga.status) not in OPEN:
                replay = (saga.status == SagaStatus.COMPENSATING.value
                          and saga.chain_token == token)
                return replay, self._executed_count(conn, saga_id), saga.reason or ""
            why = saga.reason or reason or "saga failed"
            self.j.touch(conn, saga_id, status=move("saga", "begin_compensation").target,
                         reason=why, compensation_started_at=t, chain_touched_at=t,
                         fail_requested_at=saga.fail_requested_at or t, chain_token=token)
            # Steps not running are never run now (an unstarted one, or one waiting for
            # its Celery retry); undecided gates close. Running ones are waited for.
            conn.execute(update(entries).where(
                entries.c.saga_id == saga_id,
                ((entries.c.phase == _INTENT) & entries.c.lease_until.is_(None))
                | (entries.c.phase == Phase.AWAITING_APPROVAL.value),
            ).values(phase=move("step", "cancel").target, updated_at=t,
                     error="cancelled: the saga is compensating; this step was not run"))
            return True, self._executed_count(conn, saga_id), why

    @staticmethod
    def _executed_count(conn: Any, saga_id: str) -> int:
        return int(conn.execute(select(func.count()).select_from(entries).where(
            entries.c.saga_id == saga_id, entries.c.phase == _EXECUTED)).scalar() or 0)

    def complete(self, saga_id: str, *, result: Any = None) -> None:
        """Move ``complete``: RUNNING -> COMPLETED once every step EXECUTED."""
        from .._base.errors import SagaNotFound, SagaworkerError

        with self.j.engine.begin() as conn:
            saga = self.j.lock_saga(conn, saga_id)
            if saga is None:
                raise SagaNotFound(f"no saga {saga_id!r}")
            if saga.status == SagaStatus.COMPLETED.value:
                return
            if saga.status != SagaStatus.RUNNING.value or saga.fail_requested_at is not None:
                raise SagaworkerError(
                    f"saga {saga_id!r} is {saga.status}"
                    f"{' and failing' if saga.fail_requested_at else ''}; "
                    "only a RUNNING saga with every step EXECUTED can complete")
            # an EXECUTED step with an error had its effect but no journaled result: its
            # worker is asking the saga to fail, so it cannot complete
            bad = conn.execute(select(entries.c.seq, entries.c.tool_name, entries.c.phase)
                               .where(entries.c.saga_id == saga_id,
                                      (entries.c.phase != _EXECUTED)
                                      | entries.c.error.is_not(None))).all()
            if bad:
                listed = ", ".join(f"#{b.seq} {b.tool_name} {b.phase}" for b in bad)
                raise SagaworkerError(
                    f"saga {saga_id!r} cannot complete: steps not EXECUTED ({listed}); "
                    "wait for them (step.result()) or call saga.fail(reason)")
            self.j.touch(conn, saga_id, status=move("saga", "complete").target,
                         finished_at=now(), result=result)

    # -- undos -----------------------------------------------------------------------

    def claim_undo(self, saga_id: str, token: str) -> UndoState:
        """Move ``claim_undo``: the latest-EXECUTED entry without an outcome, if it may run."""
        with self.j.engine.begin() as conn:
            return self._claim_undo(conn, saga_id, token, self.j.lock_saga(conn, saga_id))

    def record_and_claim(self, saga_id: str, seq: int, result: OutcomeResult,
                         detail: str | None, attempts: int, token: str,
                         next_token: str) -> tuple[bool, UndoState]:
        """Journal one outcome and claim the next undo, in one transaction."""
        with self.j.engine.begin() as conn:
            # One statement locks the saga row, numbers the outcome in the report and
            # tells the sweeper the chain moves (a miss below leaves a harmless gap).
            saga = conn.execute(
                update(sagas).where(sagas.c.saga_id == saga_id)
                .values(comp_counter=sagas.c.comp_counter + 1, chain_touched_at=now(),
                        updated_at=now(), resends=0, resend_at=None)
                .returning(*sagas.c)).first()
            if saga is None:
                return False, UndoState(UndoClaim.NOT_COMPENSATING)
            recorded = self._record(conn, saga_id, seq, result, detail, attempts, token,
                                    order=saga.comp_counter)
            # recording changes neither the status nor the reason: the locked row serves
            return recorded, self._claim_undo(conn, saga_id, next_token, saga, touched=True)

    def _record(self, conn: Any, saga_id: str, seq: int, result: OutcomeResult,
                detail: str | None, attempts: int | None, token: str, *,
                order: int | None = None) -> bool:
        """Moves ``record``/``skip``/``give_up``: once; True also for our own replay."""
        if order is None:  # the report's order first (a miss leaves a harmless gap)
            order = conn.execute(
                update(sagas).where(sagas.c.saga_id == saga_id)
                .values(comp_counter=sagas.c.comp_counter + 1, chain_touched_at=now(),
                        updated_at=now(), resends=0, resend_at=None)
                .returning(sagas.c.comp_counter)).scalar()
        extra = {} if attempts is None else {"compensation_attempts": attempts}
        n = self.j.set_entry(conn, saga_id, seq, entries.c.compensation.is_(None),
                             entries.c.undo_token == token,
                             compensation=result.value, compensation_detail=detail,
                             compensated_at=now(), comp_lease_until=None, comp_order=order,
                             **extra)
        if n:
            return True
        row = self.j.entry(conn, saga_id, seq)  # only on a miss: our own replayed outcome?
        return bool(row is not None and row.undo_token == token
                    and row.compensation is not None)

    def _claim_undo(self, conn: Any, saga_id: str, token: str, saga: Any, *,
                    touched: bool = False) -> UndoState:
        if saga is None or saga.status != SagaStatus.COMPENSATING.value:
            if saga is not None and saga.closed_by == token:  # our own finish, replayed
                return self._finished_state(conn, saga_id, SagaStatus(saga.status), ())
            return UndoState(UndoClaim.NOT_COMPENSATING,
                             status=SagaStatus(saga.status) if saga else None)
        doubted: list[Any] = []
        # One read for what may hold the chain back: forward attempts and undos that
        # started and have no outcome (none, in the common case).
        held = conn.execute(select(
            entries, _alive(entries.c.lease_until),
            _alive(entries.c.comp_lease_until).label("comp_alive")).where(
                entries.c.saga_id == saga_id,
                or_(and_(entries.c.phase == _INTENT, entries.c.lease_until.is_not(None)),
                    and_(entries.c.phase == _EXECUTED, entries.c.compensation.is_(None),
                         entries.c.comp_lease_until.is_not(None))))).all()
        # 1. No undo while a forward step of the saga runs: a late arrival is undone
        #    first, once it has an outcome (its EXECUTED re-sends the chain).
        for p in held:
            if p.phase != _INTENT:
                continue
            if p.alive:
                return UndoState(UndoClaim.WAITING, row=p, in_doubt=tuple(doubted))
            self._doubt(conn, saga_id, p.seq, p.attempt_token, False, p.reruns)
            doubted.append(p)
        died: list[tuple[Any, str]] = []
        tries = 1 + self.settings.compensation_retries
        live = [r for r in held if r.phase == _EXECUTED]
        while True:
            # 2. At most one undo of a saga at any moment.
            mine = [r for r in live if r.undo_token == token]
            if mine:  # our own claim, whose COMMIT reply was lost
                r = mine[0]
                return UndoState(UndoClaim.CLAIMED, row=r, attempt=r.compensation_attempts,
                                 reason=saga.reason, in_doubt=tuple(doubted),
                                 died=tuple(died))
            if any(r.comp_alive for r in live):
                return UndoState(UndoClaim.BUSY, row=live[0], in_doubt=tuple(doubted),
                                 died=tuple(died))
            # 3. Latest EXECUTED first: claimed in one statement, unless its last try's
            #    worker died with the tries used up (read below).
            latest = (select(entries.c.seq).where(
                entries.c.saga_id == saga_id, entries.c.phase == _EXECUTED,
                entries.c.compensation.is_(None))
                .order_by(entries.c.exec_order.desc()).limit(1).scalar_subquery())
            claimed = conn.execute(
                update(entries)
                .where(entries.c.saga_id == saga_id, entries.c.seq == latest,
                       or_(entries.c.comp_lease_until.is_(None),
                           entries.c.compensation_attempts < tries))
                .values(compensation_attempts=entries.c.compensation_attempts + 1,
                        comp_lease_until=db_later(self.lease), comp_worker=worker_label(),
                        undo_token=token, updated_at=now())
                .returning(*entries.c)).first()
            if claimed is not None:
                if not touched:
                    self.j.touch(conn, saga_id, chain_touched_at=now())
                return UndoState(UndoClaim.CLAIMED, row=claimed,
                                 attempt=claimed.compensation_attempts, reason=saga.reason,
                                 in_doubt=tuple(doubted), died=tuple(died))
            row = conn.execute(
                select(entries).where(entries.c.saga_id == saga_id,
                                      entries.c.phase == _EXECUTED,
                                      entries.c.compensation.is_(None))
                .order_by(entries.c.exec_order.desc()).limit(1)).first()
            if row is None:
                return self._finish(conn, saga, token, tuple(doubted), tuple(died))
            # Its last try's worker died (OOM, segfault, os._exit, a hard time limit):
            # that try counts, and the tries are used up.
            detail = (f"the undo's worker died during try {row.compensation_attempts} "
                      f"of {tries} (killed, out of memory, os._exit or a hard time "
                      "limit); the effect is still live")
            self.j.set_entry(conn, saga_id, row.seq, undo_token=token)
            self._record(conn, saga_id, row.seq, OutcomeResult.COMPENSATION_FAILED,
                         detail, None, token)
            died.append((row, detail))
            live = self._live_undos(conn, saga_id)

    @staticmethod
    def _live_undos(conn: Any, saga_id: str) -> list[Any]:
        return list(conn.execute(select(
            entries, _alive(entries.c.comp_lease_until).label("comp_alive")).where(
                entries.c.saga_id == saga_id, entries.c.phase == _EXECUTED,
                entries.c.compensation.is_(None), entries.c.comp_lease_until.is_not(None))
        ).all())

    def _finish(self, conn: Any, saga: Any, token: str, doubted: tuple[Any, ...],
                died: tuple[tuple[Any, str], ...]) -> UndoState:
        """Moves ``finish``/``finish_dirty``: every undo has an outcome, nothing runs."""
        saga_id = saga.saga_id
        for p in conn.execute(select(entries).where(entries.c.saga_id == saga_id,
                                                    entries.c.phase == _INTENT)).all():
            if not self._cancel(conn, saga_id, p.seq,
                                "cancelled: the saga compensated and this step was not run"):
                return UndoState(UndoClaim.WAITING, row=p, in_doubt=doubted, died=died)
        dirty = self._dirty(conn, saga_id)
        status = SagaStatus(move("saga", "finish_dirty" if dirty else "finish").target)
        self.j.touch(conn, saga_id, status=status.value, finished_at=now(), closed_by=token)
        return UndoState(UndoClaim.FINISHED, status=status, dirty_tools=dirty,
                         in_doubt=doubted, died=died)

    def _finished_state(self, conn: Any, saga_id: str, status: SagaStatus,
                        doubted: tuple[Any, ...]) -> UndoState:
        return UndoState(UndoClaim.FINISHED, status=status,
                         dirty_tools=self._dirty(conn, saga_id), in_doubt=doubted)

    @staticmethod
    def _dirty(conn: Any, saga_id: str) -> tuple[str, ...]:
        return tuple(conn.execute(select(entries.c.tool_name).where(
            entries.c.saga_id == saga_id,
            entries.c.compensation == OutcomeResult.COMPENSATION_FAILED.value)
            .order_by(entries.c.comp_order)).scalars().all())

    def release_undo(self, saga_id: str, seq: int, token: str, detail: str) -> None:
        """Move ``release_undo``: it raised with tries left."""
        with self.j.engine.begin() as conn:
            self.j.lock_saga(conn, saga_id)
            self.j.set_entry(conn, saga_id, seq, entries.c.compensation.is_(None),
                             entries.c.undo_token == token,
                             comp_lease_until=None, compensation_detail=detail)

    def reopen_dirty(self, saga_id: str, actor: str | None) -> list[int]:
        """Moves ``redrive``/``reopen``: COMPENSATION_FAILED outcomes reopen."""
        with self.j.engine.begin() as conn:
            saga = self.j.lock_saga(conn, saga_id)
            if saga is None or saga.status != SagaStatus.COMPENSATION_FAILED.value:
                return []
            seqs = list(conn.execute(select(entries.c.seq).where(
                entries.c.saga_id == saga_id,
                entries.c.compensation == OutcomeResult.COMPENSATION_FAILED.value)).scalars())
            conn.execute(update(entries).where(entries.c.saga_id == saga_id,
                                               entries.c.seq.in_(seqs))
                         .values(compensation=None, comp_lease_until=None, undo_token=None,
                                 updated_at=now()))
            self.j.touch(conn, saga_id, status=move("saga", "redrive").target,
                         finished_at=None, closed_by=None, chain_touched_at=now())
            self.j.audit(conn, saga_id, None, "retry_compensation", actor,
                         f"re-running undos of steps {seqs}")
            return seqs



for _name in ("claim_start", "heartbeat", "abort", "fail_overdue", "release", "retry_due",
              "executed", "failed", "begin_compensation", "claim_undo", "record_and_claim",
              "release_undo",
              "reopen_dirty"):
    setattr(Machine, _name, retrying(getattr(Machine, _name)))
