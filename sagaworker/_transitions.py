"""The races: step start, outcome, RUNNING -> COMPENSATING, undo claims and the final status.

Each function is one transaction that locks the saga row first (see ``_journal``).
"""

from __future__ import annotations

import functools
import os
import socket
from dataclasses import dataclass
from datetime import datetime, timedelta
from enum import Enum
from typing import Any

from sqlalchemy import bindparam, func, select, update

from ._dialect import aware, supports_dml_cte
from ._journal import Journal, now, retrying
from ._schema import entries, sagas
from ._types import OPEN, OutcomeResult, Phase, SagaStatus

__all__ = ["Claim", "Held", "Start", "Transitions", "UndoClaim", "UndoState", "worker_gone",
           "worker_id"]


class Start(Enum):
    RUN = "run"                  # this delivery runs the tool
    DONE = "done"                # already EXECUTED: the journaled result stands
    FINISHED = "finished"        # FAILED / CANCELLED / REJECTED: nothing to do
    BUSY = "busy"                # another delivery's attempt is still running
    CANCELLED = "cancelled"      # the saga is compensating: the step is not run
    IN_DOUBT = "in_doubt"        # an earlier attempt died with no outcome
    NOT_APPROVED = "not_approved"
    UNKNOWN = "unknown"          # no such saga or entry


@dataclass(frozen=True)
class Claim:
    start: Start
    attempt: int = 0
    row: Any = None
    saga_status: SagaStatus | None = None
    rerun: bool = False


class UndoClaim(Enum):
    CLAIMED = "claimed"
    BUSY = "busy"
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
    in_doubt: tuple[Any, ...] = ()


#: what a process holds a lease on: (saga id, seq, True for an undo / False for an attempt)
Held = tuple[str, int, bool]


def worker_id() -> str:
    """This process, as journaled on the attempts and undos it holds."""
    return f"{socket.gethostname()}|{os.getpid()}"


def worker_gone(worker: str | None) -> bool:
    """True when the attempt's worker process is on this host and no longer alive."""
    if not worker or "|" not in worker:
        return False
    host, _, pid = worker.rpartition("|")
    if host != socket.gethostname() or not pid.isdigit():
        return False
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    return False


@functools.cache
def _executed_stmt() -> Any:
    bump = (update(sagas).where(sagas.c.saga_id == bindparam("p_saga"))
            .values(exec_counter=sagas.c.exec_counter + 1, updated_at=bindparam("p_t"))
            .returning(sagas.c.exec_counter, sagas.c.status)).cte("bump")
    return (update(entries)
            .where(entries.c.saga_id == bindparam("p_saga"), entries.c.seq == bindparam("p_seq"),
                   entries.c.phase == Phase.INTENT.value)
            .values(phase=Phase.EXECUTED.value,
                    result=bindparam("p_result", type_=entries.c.result.type),
                    executed_at=bindparam("p_t"), updated_at=bindparam("p_t"),
                    exec_order=select(bump.c.exec_counter).scalar_subquery(),
                    lease_until=None, duration_ms=bindparam("p_ms"), error=None)
            .returning(select(bump.c.status).scalar_subquery()))


def _expired(lease: datetime | None, t: datetime) -> bool:
    lease = aware(lease)
    return lease is not None and lease <= t


class Transitions:
    """Every method is one transaction, retried while the database is unreachable."""

    def __init__(self, journal: Journal) -> None:
        self.j = journal

    # -- forward steps -------------------------------------------------------------

    def claim_start(self, saga_id: str, seq: int, *, worker: str, lease: float,
                    idempotent: bool, task_id: str | None) -> Claim:
        t = now()
        with self.j.engine.begin() as conn:
            # Fast path, one statement: an attempt nobody holds, in an open saga. The entry
            # row is the serialization point: begin_compensation cancels unstarted entries
            # and the finalizer cancels released ones with compare-and-sets on that row,
            # so a claim either lands first (the step runs, the chain waits for it) or
            # finds the entry no longer INTENT and takes the full path below.
            claimed = conn.execute(
                update(entries)
                .where(entries.c.saga_id == saga_id, entries.c.seq == seq,
                       entries.c.phase == Phase.INTENT.value, entries.c.lease_until.is_(None),
                       sagas.c.saga_id == entries.c.saga_id,
                       sagas.c.status.in_([st.value for st in OPEN]))
                .values(attempts=entries.c.attempts + 1, started_at=t,
                        lease_until=t + timedelta(seconds=lease), worker=worker,
                        task_id=func.coalesce(task_id, entries.c.task_id), updated_at=t)
                .returning(*entries.c)).first()  # (SQLite returns the target table only)
            if claimed is not None:
                return Claim(Start.RUN, attempt=claimed.attempts, row=claimed)
            # Full path: lock the saga row first, then read the entry in a statement of its
            # own. (One joined SELECT ... FOR UPDATE OF sagas would read the entry from the
            # snapshot taken before the lock wait, so two deliveries queued on the lock
            # both saw the old lease and both ran the tool.)
            saga = self.j.lock_saga(conn, saga_id)
            row = conn.execute(select(entries).where(entries.c.saga_id == saga_id,
                                                     entries.c.seq == seq)).first()
            if saga is None or row is None:
                return Claim(Start.UNKNOWN)
            status = SagaStatus(saga.status)
            phase = Phase(row.phase)
            if phase is Phase.EXECUTED:
                return Claim(Start.DONE, row=row, saga_status=status)
            if phase is Phase.AWAITING_APPROVAL:
                return Claim(Start.NOT_APPROVED, row=row, saga_status=status)
            if phase is not Phase.INTENT:
                return Claim(Start.FINISHED, row=row, saga_status=status)
            lease_until = aware(row.lease_until)
            running = lease_until is not None and lease_until > t and not worker_gone(row.worker)
            if running and row.worker == worker and row.task_id == task_id and row.attempts:
                # our own claim whose commit was lost with the connection: it is ours
                return Claim(Start.RUN, attempt=row.attempts, row=row, saga_status=status)
            if running:
                return Claim(Start.BUSY, row=row, saga_status=status)
            died = lease_until is not None  # started, lease lapsed, no outcome journaled
            if status not in OPEN:
                if died:
                    self._in_doubt(conn, saga_id, seq)
                    return Claim(Start.IN_DOUBT, row=row, saga_status=status)
                self.j.set_entry(conn, saga_id, seq, phase=Phase.CANCELLED.value)
                return Claim(Start.CANCELLED, row=row, saga_status=status)
            if died and not idempotent:
                self._in_doubt(conn, saga_id, seq)
                self.j.touch(conn, saga_id, fail_requested_at=t,
                             reason=f"step {seq} ({row.tool_name}) in doubt")
                return Claim(Start.IN_DOUBT, row=row, saga_status=status)
            attempt = row.attempts + 1
            self.j.set_entry(conn, saga_id, seq, attempts=attempt, started_at=t,
                             lease_until=t + timedelta(seconds=lease), worker=worker,
                             task_id=task_id or row.task_id)
            return Claim(Start.RUN, attempt=attempt, row=row, saga_status=status, rerun=died)

    def _in_doubt(self, conn: Any, saga_id: str, seq: int) -> None:
        self.j.set_entry(conn, saga_id, seq, Phase.INTENT.value == entries.c.phase,
                         phase=Phase.FAILED.value, in_doubt=True, lease_until=None,
                         error="in doubt: the attempt's worker was lost before an outcome "
                               "was journaled; the effect may or may not have happened")

    def heartbeat(self, held: list[Held], worker: str, lease: float) -> None:
        """Extend the leases of the attempts and undos this process is running.

        One short transaction each, taking locks in the order every other transition
        does (saga row, then entry row), so a beat never deadlocks with a chain.
        """
        t = now()
        until = t + timedelta(seconds=lease)
        for saga_id, seq, undo in held:
            with self.j.engine.begin() as conn:
                if undo:  # the chain moves: the sweeper leaves it be
                    self.j.touch(conn, saga_id, chain_touched_at=t)
                    self.j.set_entry(conn, saga_id, seq, entries.c.compensation.is_(None),
                                     entries.c.comp_worker == worker, comp_lease_until=until)
                else:
                    conn.execute(update(entries).where(
                        entries.c.saga_id == saga_id, entries.c.seq == seq,
                        entries.c.phase == Phase.INTENT.value, entries.c.worker == worker)
                        .values(lease_until=until))

    def release_attempt(self, saga_id: str, seq: int, error: str) -> None:
        """An attempt raised and Celery may retry it: it ended, so it is not in doubt."""
        with self.j.engine.begin() as conn:
            self.j.set_entry(conn, saga_id, seq, entries.c.phase == Phase.INTENT.value,
                             lease_until=None, error=error)

    def executed(self, saga_id: str, seq: int, result: Any, duration_ms: float) -> SagaStatus:
        t = now()
        with self.j.engine.begin() as conn:
            if supports_dml_cte(conn):
                # One statement: take the saga row lock and the next execution order, and
                # journal EXECUTED with it.
                status = conn.execute(_executed_stmt(), {
                    "p_saga": saga_id, "p_seq": seq, "p_t": t, "p_result": result,
                    "p_ms": duration_ms}).scalar()
                if status is not None:
                    return SagaStatus(status)
                return SagaStatus(self.j.lock_saga(conn, saga_id).status)
            row = conn.execute(
                update(sagas).where(sagas.c.saga_id == saga_id)
                .values(exec_counter=sagas.c.exec_counter + 1, updated_at=t)
                .returning(sagas.c.exec_counter, sagas.c.status)).one()
            self.j.set_entry(conn, saga_id, seq, entries.c.phase == Phase.INTENT.value,
                             phase=Phase.EXECUTED.value, result=result, executed_at=t,
                             exec_order=row.exec_counter, lease_until=None,
                             duration_ms=duration_ms, error=None)
            return SagaStatus(row.status)

    def failed(self, saga_id: str, seq: int, error: str, *, in_doubt: bool = False,
               reason: str | None = None) -> SagaStatus | None:
        """Journal FAILED; returns the saga status, or None when the entry was not INTENT."""
        with self.j.engine.begin() as conn:
            saga = self.j.lock_saga(conn, saga_id)
            if saga is None:
                return None
            n = self.j.set_entry(
                conn, saga_id, seq,
                entries.c.phase.in_([Phase.INTENT.value, Phase.AWAITING_APPROVAL.value]),
                phase=Phase.FAILED.value, error=error, in_doubt=in_doubt, lease_until=None)
            status = SagaStatus(saga.status)
            if n and status in OPEN and saga.fail_requested_at is None:
                self.j.touch(conn, saga_id, fail_requested_at=now(), reason=reason or error)
            return status if n else None

    # -- failure and compensation ------------------------------------------------

    def begin_compensation(self, saga_id: str, reason: str | None) -> tuple[bool, int, str]:
        """Compare-and-set RUNNING/AWAITING_APPROVAL -> COMPENSATING; one caller wins."""
        t = now()
        with self.j.engine.begin() as conn:
            saga = self.j.lock_saga(conn, saga_id)
            if saga is None or SagaStatus(saga.status) not in OPEN:
                return False, 0, ""
            why = saga.reason or reason or "saga failed"
            self.j.touch(conn, saga_id, status=SagaStatus.COMPENSATING.value, reason=why,
                         compensation_started_at=t, chain_touched_at=t,
                         fail_requested_at=saga.fail_requested_at or t)
            # Steps not yet started are never run now; undecided gates close.
            conn.execute(update(entries).where(
                entries.c.saga_id == saga_id,
                ((entries.c.phase == Phase.INTENT.value) & entries.c.started_at.is_(None))
                | (entries.c.phase == Phase.AWAITING_APPROVAL.value),
            ).values(phase=Phase.CANCELLED.value, updated_at=t))
            n = conn.execute(select(func.count()).select_from(entries).where(
                entries.c.saga_id == saga_id, entries.c.phase == Phase.EXECUTED.value)).scalar()
            return True, int(n or 0), why

    def claim_undo(self, saga_id: str, lease: float, worker: str = "") -> UndoState:
        """Pick the latest-executed entry with no outcome and take its lease."""
        with self.j.engine.begin() as conn:
            return self._claim(conn, saga_id, now(), lease, worker)

    def record_and_claim(self, saga_id: str, seq: int, result: OutcomeResult,
                         detail: str | None, attempts: int, lease: float,
                         worker: str) -> tuple[bool, UndoState]:
        """Journal one outcome and claim the next undo in the same transaction."""
        t = now()
        with self.j.engine.begin() as conn:
            recorded, saga = self._record(conn, saga_id, seq, result, detail, attempts, t)
            return recorded, self._claim(conn, saga_id, t, lease, worker, saga)

    def _claim(self, conn: Any, saga_id: str, t: datetime, lease: float,
               worker: str, saga: Any = None) -> UndoState:
        touched = saga is not None
        if saga is None:
            saga = self.j.lock_saga(conn, saga_id)
        if saga is None or saga.status != SagaStatus.COMPENSATING.value:
            return UndoState(UndoClaim.NOT_COMPENSATING,
                             status=SagaStatus(saga.status) if saga else None)
        row = conn.execute(
            select(entries).where(entries.c.saga_id == saga_id,
                                  entries.c.phase == Phase.EXECUTED.value,
                                  entries.c.compensation.is_(None))
            .order_by(entries.c.exec_order.desc()).limit(1)).first()
        if row is None:
            return self._finish(conn, saga_id, t)
        lease_until = aware(row.comp_lease_until)
        if lease_until is not None and lease_until > t and not worker_gone(row.comp_worker):
            return UndoState(UndoClaim.BUSY, row=row)
        attempt = row.compensation_attempts + 1
        self.j.set_entry(conn, saga_id, row.seq, compensation_attempts=attempt,
                         comp_lease_until=t + timedelta(seconds=lease), comp_worker=worker)
        if not touched:
            self.j.touch(conn, saga_id, chain_touched_at=t)
        return UndoState(UndoClaim.CLAIMED, row=row, attempt=attempt, reason=saga.reason)

    def _finish(self, conn: Any, saga_id: str, t: datetime) -> UndoState:
        pending = conn.execute(select(entries).where(
            entries.c.saga_id == saga_id, entries.c.phase == Phase.INTENT.value)).all()
        doubted = []
        for p in pending:
            lease_until = aware(p.lease_until)
            if lease_until is not None and lease_until > t and not worker_gone(p.worker):
                return UndoState(UndoClaim.WAITING, row=p)
            if lease_until is not None:
                self._in_doubt(conn, saga_id, p.seq)
                doubted.append(p)
            else:
                n = self.j.set_entry(conn, saga_id, p.seq,
                                     entries.c.phase == Phase.INTENT.value,
                                     entries.c.lease_until.is_(None),
                                     phase=Phase.CANCELLED.value)
                if not n:  # a delivery claimed it meanwhile: it runs, the chain waits
                    return UndoState(UndoClaim.WAITING, row=p)
        dirty = conn.execute(select(entries.c.tool_name).where(
            entries.c.saga_id == saga_id,
            entries.c.compensation == OutcomeResult.COMPENSATION_FAILED.value)
            .order_by(entries.c.comp_order)).scalars().all()
        status = SagaStatus.COMPENSATION_FAILED if dirty else SagaStatus.COMPENSATED
        self.j.touch(conn, saga_id, status=status.value, finished_at=t)
        return UndoState(UndoClaim.FINISHED, status=status, dirty_tools=tuple(dirty),
                         in_doubt=tuple(doubted))

    def record_undo(self, saga_id: str, seq: int, result: OutcomeResult, detail: str | None,
                    *, attempts: int | None = None) -> bool:
        """Journal an outcome once; False when one was already journaled."""
        with self.j.engine.begin() as conn:
            return self._record(conn, saga_id, seq, result, detail, attempts, now())[0]

    def _record(self, conn: Any, saga_id: str, seq: int, result: OutcomeResult,
                detail: str | None, attempts: int | None, t: datetime) -> tuple[bool, Any]:
        """Journal one outcome; also takes the saga row lock and returns the saga row."""
        saga = conn.execute(
            update(sagas).where(sagas.c.saga_id == saga_id)
            .values(comp_counter=sagas.c.comp_counter + 1, chain_touched_at=t, updated_at=t)
            .returning(sagas.c.comp_counter, sagas.c.status, sagas.c.reason)).first()
        if saga is None:
            return False, None
        extra = {} if attempts is None else {"compensation_attempts": attempts}
        n = self.j.set_entry(conn, saga_id, seq, entries.c.compensation.is_(None),
                             compensation=result.value, compensation_detail=detail,
                             compensated_at=t, comp_lease_until=None,
                             comp_order=saga.comp_counter, **extra)
        return bool(n == 1), saga

    def release_undo(self, saga_id: str, seq: int, detail: str) -> None:
        with self.j.engine.begin() as conn:
            self.j.set_entry(conn, saga_id, seq, entries.c.compensation.is_(None),
                             comp_lease_until=None, compensation_detail=detail)

    def reopen_dirty(self, saga_id: str, actor: str | None) -> list[int]:
        """Operator re-drive: COMPENSATION_FAILED outcomes reopen; the saga compensates."""
        with self.j.engine.begin() as conn:
            saga = self.j.lock_saga(conn, saga_id)
            if saga is None or saga.status != SagaStatus.COMPENSATION_FAILED.value:
                return []
            seqs = list(conn.execute(select(entries.c.seq).where(
                entries.c.saga_id == saga_id,
                entries.c.compensation == OutcomeResult.COMPENSATION_FAILED.value)).scalars())
            conn.execute(update(entries).where(entries.c.saga_id == saga_id,
                                               entries.c.seq.in_(seqs))
                         .values(compensation=None, comp_lease_until=None, updated_at=now()))
            self.j.touch(conn, saga_id, status=SagaStatus.COMPENSATING.value, finished_at=None,
                         chain_touched_at=now())
            self.j.audit(conn, saga_id, None, "retry_compensation", actor,
                         f"re-running undos of steps {seqs}")
            return seqs


for _name in ("claim_start", "release_attempt", "executed", "failed", "begin_compensation",
              "claim_undo", "record_and_claim", "record_undo", "release_undo",
              "reopen_dirty", "heartbeat"):
    setattr(Transitions, _name, retrying(getattr(Transitions, _name)))
