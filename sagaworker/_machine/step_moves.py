"""A step's moves: claim an attempt, keep its lease, release it, journal its outcome, and
decide its approval gate. Each is one guarded compare-and-set transaction (the rules in
``docs/design.md``); the attempt token fences every write of an attempt."""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Literal

from sqlalchemy import func, or_, select, update

from .._base.crypto import Placed
from .._base.types import OPEN, Phase, SagaStatus
from .._journal.dialect import db_later, db_now, seconds_between
from .._journal.raw_rows import raw_columns
from .._journal.repository import retrying
from .._journal.schema import entries, sagas
from . import pgfast as _pgfast
from .lifecycle import move, performs
from .moves_base import (
    _EXECUTE,
    _EXECUTED,
    _INTENT,
    _OPEN_VALUES,
    Claim,
    Executed,
    Held,
    MoveBase,
    Start,
    _alive,
)

__all__ = ["Released", "StepMoves"]

#: what a release of a claim stopped before its tool came to (``release_unstarted``)
Released = Literal["released", "bound", "fenced"]

#: an entry's row as a claim reads it: user data as stored (a claim never uses it; a
#: gated step's check opens it), so a value copied in with SQL never stops a claim
_ROW = raw_columns(entries)
#: seconds until the entry's Celery retry is due, on the database's clock (None: no retry
#: journaled; 0 or less: due)
_DUE_IN = seconds_between(db_now(), entries.c.retry_due_at).label("due_in")


class StepMoves(MoveBase):
    """The moves of a step (a journal entry) and of its attempts."""

    @retrying
    @performs("step", "claim")
    def claim_start(self, saga_id: str, seq: int, tool: str, *, token: str, worker: str,
                    idempotent: bool, task_id: str | None, retries: int | None = None) -> Claim:
        """Move ``claim``: this delivery runs the tool, or is told why not. ``retries``: the
        Celery count of its message (None: an eager step, a unit), checked (``_in_turn``)."""
        engine = self.j.engine
        if _pgfast.enabled(engine):
            # the same compare-and-set as below, one round trip (``_pgfast``)
            got = _pgfast.claim(engine, saga_id=saga_id, seq=seq, tool=tool, token=token,
                                worker=worker, task_id=task_id, lease=self.lease, retries=retries)
            if got is not None:
                self.j.note_nonce(saga_id, got.place_nonce)  # (its result is sealed for it)
                return Claim(Start.RUN, attempt=got.attempts, row=got)
            with engine.begin() as conn:
                return self._claim_locked(conn, saga_id, seq, tool, token, worker,
                                          idempotent, task_id, retries)
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
                       sagas.c.status.in_(_OPEN_VALUES), sagas.c.fail_requested_at.is_(None),
                       or_(sagas.c.deadline_at.is_(None), sagas.c.deadline_at > db_now()),
                       sagas.c.divergence.is_(None),  # (held: the locked path says so)
                       *_in_turn(retries))
                .values(attempts=entries.c.attempts + 1, started_at=db_now(),
                        lease_until=db_later(self.lease), worker=worker, attempt_token=token,
                        retry_due_at=None, task_id=func.coalesce(entries.c.task_id, task_id),
                        resends=0, resend_at=None, updated_at=db_now())
                .returning(*_ROW)).first()  # (SQLite returns the target table only)
            if claimed is not None:
                return Claim(Start.RUN, attempt=claimed.attempts, row=claimed)
            return self._claim_locked(conn, saga_id, seq, tool, token, worker, idempotent,
                                      task_id, retries)

    def _claim_locked(self, conn: Any, saga_id: str, seq: int, tool: str, token: str,
                      worker: str, idempotent: bool, task_id: str | None,
                      retries: int | None) -> Claim:
        # Lock the saga row, then read the entry in a statement of its own (a joined
        # SELECT ... FOR UPDATE OF sagas would read the entry from the snapshot taken
        # before the lock wait).
        saga = self.j.lock_saga(conn, saga_id)
        row = conn.execute(select(*_ROW, _alive(entries.c.lease_until), _DUE_IN)
                           .where(entries.c.saga_id == saga_id, entries.c.seq == seq)).first()
        if saga is None or row is None:
            return Claim(Start.UNKNOWN)
        status = SagaStatus(saga.status)
        overdue = saga.fail_token == token  # this claim asked (its COMMIT reply lost)
        settled = _settled(row, tool, token, status, overdue)
        if settled is not None:  # (overdue: this claim asked, whatever it answered)
            return replace(settled, overdue=overdue)
        died = row.lease_until is not None  # started, lease lapsed, no outcome journaled
        failing = status not in OPEN or saga.fail_requested_at is not None
        if not failing and self._overdue(conn, saga):
            # the deadline passed: nothing more runs, whether the sweeper saw it yet or not
            self._request_failure(conn, saga, "deadline passed", token)
            failing = overdue = True
        if died and (failing or not idempotent or row.reruns >= self.settings.max_reruns):
            if not self._doubt(conn, saga_id, seq, row.attempt_token,
                               idempotent and not failing, row.reruns, by=token):
                return Claim(Start.BUSY, row=row, saga_status=status, overdue=overdue)
            if not failing:
                why = (f"died on each of its {row.reruns + 1} attempts"
                       if idempotent else "its worker was lost")
                self._request_failure(conn, saga, f"step {seq} ({row.tool_name}) in doubt: "
                                                  f"{why}")
            return Claim(Start.IN_DOUBT, row=row, saga_status=status, overdue=overdue)
        if failing:
            why = ("its Celery retry was not run" if row.started_at is not None
                   else "it never started")
            self._cancel(conn, saga_id, seq, f"cancelled: the saga is failing and {why}",
                         by=token)
            return Claim(Start.CANCELLED, row=row, saga_status=status, overdue=overdue)
        if saga.divergence is not None:
            # held on a divergence: nothing of it runs, an approved gate neither;
            # the entry is left as it is, sent again once a replay releases the hold
            return Claim(Start.HELD, row=row, saga_status=status)
        if (early := _out_of_turn(row, retries, status)) is not None:
            return early
        # a compare-and-set on what was read: a lapsed lease is taken over only if it is
        # still lapsed and still the same attempt's (a late heartbeat may have revived it)
        if not self.j.set_entry(conn, saga_id, seq, entries.c.phase == _INTENT,
                                *_still(row), attempts=row.attempts + 1, started_at=db_now(),
                                lease_until=db_later(self.lease), worker=worker,
                                attempt_token=token, retry_due_at=None,
                                reruns=row.reruns + (1 if died else 0),
                                task_id=row.task_id or task_id, resends=0, resend_at=None):
            return Claim(Start.BUSY, row=row, saga_status=status)
        return Claim(Start.RUN, attempt=row.attempts + 1, row=row, saga_status=status,
                     rerun=died)

    @retrying
    @performs("step", "heartbeat")
    def heartbeat(self, held: list[Held], *, lease: float | None = None) -> int:
        """Move ``heartbeat``: extend the leases this process still holds, by token, by
        ``lease`` seconds (None: SAGAWORKER_REDELIVER_AFTER; an agent's model request is
        held on SAGAWORKER_UNIT_LEASE). How many it kept.

        One short transaction each; an undo's also tells the sweeper the chain moves,
        once its token and lease are found still its own (a fenced undo moves nothing).
        """
        until = db_later(self.lease if lease is None else lease)
        kept = 0
        for saga_id, seq, undo, token in held:
            with self.j.engine.begin() as conn:
                ours = conn.execute(_beat(saga_id, seq, undo, token, until)).rowcount
                if ours and undo:
                    self.j.touch(conn, saga_id, chain_touched_at=db_now())
                kept += 1 if ours else 0
        return kept

    @retrying
    @performs("step", "release")
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

    @retrying
    @performs("step", "release")
    def release_unstarted(self, saga_id: str, seq: int, token: str, error: str
                          ) -> tuple[Released, SagaStatus | None]:
        """Move ``release`` of an attempt stopped before its tool started, counted: at most
        SAGAWORKER_MAX_RERUNS such releases per step (its Celery retries are not counted).
        "bound" past them and "fenced" for an attempt that no longer holds the step:
        nothing written (a bound claim lapses into doubt, paged). With the saga's status."""
        with self.j.engine.begin() as conn:
            saga = self.j.lock_saga(conn, saga_id)
            if saga is None:
                return "fenced", None
            done = func.coalesce(entries.c.releases, 0)
            if self.j.set_entry(conn, saga_id, seq, entries.c.phase == _INTENT,
                                entries.c.attempt_token == token,
                                entries.c.lease_until.is_not(None),
                                done < self.settings.max_reruns,
                                lease_until=None, error=error, releases=done + 1,
                                retry_due_at=db_later(self.settings.relay_after)):
                return "released", SagaStatus(saga.status)
            row = conn.execute(select(entries.c.phase, entries.c.attempt_token,
                                      entries.c.lease_until).where(
                entries.c.saga_id == saga_id, entries.c.seq == seq)).first()
            if row is None or row.phase != _INTENT or row.attempt_token != token:
                return "fenced", SagaStatus(saga.status)
            # our claim still held: the bound; none: our release, replayed after a lost COMMIT
            return ("bound" if row.lease_until is not None else "released",
                    SagaStatus(saga.status))

    @retrying
    @performs("step", "release")
    def retry_later(self, saga_id: str, seq: int, token: str, error: str, delay: float,
                    retries: int) -> SagaStatus | None:
        """Move ``release`` of an attempt whose tool asked Celery for a retry itself
        (``current_task.retry()``): the lease, the retry's due time and its count in one
        commit, before the retry's message is published. A worker lost in between leaves
        the sweeper a row it resends when due, with the count: never early, never with a
        count that would let the tool run past ``max_retries`` (docs/design.md)."""
        with self.j.engine.begin() as conn:
            saga = self.j.lock_saga(conn, saga_id)
            if saga is None:
                return None
            self.j.set_entry(conn, saga_id, seq, entries.c.phase == _INTENT,
                             entries.c.attempt_token == token,
                             entries.c.lease_until.is_not(None),
                             lease_until=None, error=error,
                             retry_due_at=db_later(max(delay, 0.0)), celery_retries=retries)
            return SagaStatus(saga.status)

    @retrying
    def retry_due(self, saga_id: str, seq: int, token: str, delay: float,
                  retries: int) -> None:
        """When Celery's retry message of a released attempt is due (the sweeper resends
        it when it does not come)."""
        with self.j.engine.begin() as conn:
            self.j.set_entry(conn, saga_id, seq, entries.c.phase == _INTENT,
                             entries.c.attempt_token == token, entries.c.lease_until.is_(None),
                             retry_due_at=db_later(max(delay, 0.0)), celery_retries=retries)

    @retrying
    @performs("step", "execute")
    def executed(self, saga_id: str, seq: int, token: str, result: Any,
                 duration_ms: float, *, error: str | None = None,
                 fail_reason: str | None = None, span_context: str | None = None) -> Executed:
        """Move ``execute``; ``applied`` False when another attempt fenced this one out.
        ``error``: the effect happened but its result cannot be journaled (result None);
        the saga is asked to fail (``fail_reason``) in the same transaction, so a worker
        lost right after it leaves the failure to the sweeper, never a live effect.
        ``span_context``: the traced run's, written with the outcome (its undo links to it)."""
        t = db_now()
        engine = self.j.engine
        fast = _pgfast.enabled(engine) and error is None
        if fast:  # (the result sealed for the saga's nonce: ``nonces``)
            got = _pgfast.executed(engine, saga_id=saga_id, seq=seq, token=token,
                                   result=result, duration_ms=duration_ms,
                                   span_context=span_context, place=self.j.place(saga_id))
            if got is not None:
                return Executed(True, SagaStatus(got[0]), got[1])
        with engine.begin() as conn:
            saga = self.j.lock_saga(conn, saga_id)
            if not fast or self.j.keyed:  # (a miss: a replay, fenced, another nonce)
                if saga is None:
                    return Executed(False, None)
                traced = {} if span_context is None else {"span_context": span_context}
                n = self.j.set_entry(conn, saga_id, seq, entries.c.phase == _INTENT,
                                     entries.c.attempt_token == token,
                                     phase=_EXECUTE.target,
                                     result=Placed(result, (saga_id, seq, saga.place_nonce)),
                                     exec_order=saga.exec_counter + 1, lease_until=None,
                                     duration_ms=duration_ms, error=error, executed_at=t, **traced)
                if n:
                    self.j.touch(conn, saga_id, exec_counter=saga.exec_counter + 1)
                    if error is not None:
                        self._request_failure(conn, saga, fail_reason or error)
                    return Executed(True, SagaStatus(saga.status), saga.flow)
            if saga is None:
                return Executed(False, None)
            row = self.j.entry(conn, saga_id, seq)
            replay = row is not None and row.phase == _EXECUTED and row.attempt_token == token
            return Executed(replay, SagaStatus(saga.status), saga.flow)

    @retrying
    @performs("step", "fail")
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
                # our own FAILED, not a doubt another move wrote over our attempt (with
                # its token: an approved gate's decided_by is its approval's, not a doubt)
                replay = (row is not None and row.phase == Phase.FAILED.value
                          and row.attempt_token == token
                          and (row.decided_by is None or not row.in_doubt))
                return SagaStatus(saga.status) if replay else None
            tool = self.j.entry(conn, saga_id, seq).tool_name
            self._request_failure(conn, saga, f"step {seq} ({tool}) failed: {error}")
            return SagaStatus(saga.status)


def _settled(row: Any, tool: str, token: str, status: SagaStatus,
             overdue: bool) -> Claim | None:
    """The claim's answer when the entry is not an INTENT free to take: another tool, an
    outcome already, a gate, our own earlier answer (replayed after a lost COMMIT), or an
    attempt still alive."""
    if row.tool_name != tool:
        return Claim(Start.MISMATCH, row=row, saga_status=status)
    if row.decided_by == token and row.phase != _INTENT:
        # our own doubt or cancel, whose COMMIT reply was lost: the same answer again
        return Claim(Start.IN_DOUBT if row.in_doubt else Start.CANCELLED, row=row,
                     saga_status=status, overdue=overdue)
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
    return None


def _beat(saga_id: str, seq: int, undo: bool, token: str, until: Any) -> Any:
    """A heartbeat's statement: the lease extended while ``token`` holds the row."""
    if undo:
        return update(entries).where(
            entries.c.saga_id == saga_id, entries.c.seq == seq,
            entries.c.compensation.is_(None), entries.c.undo_token == token,
            entries.c.comp_lease_until.is_not(None)).values(comp_lease_until=until)
    return update(entries).where(
        entries.c.saga_id == saga_id, entries.c.seq == seq,
        entries.c.phase == _INTENT, entries.c.attempt_token == token,
        entries.c.lease_until.is_not(None)).values(lease_until=until)


def _in_turn(retries: int | None) -> list[Any]:
    """The claim's guards on a Celery message, as SQL: not a copy of an earlier retry (its
    count is not below the journaled one), and the journaled retry is due, on the
    database's clock (``retries`` None: no Celery message, an eager step or a unit)."""
    if retries is None:
        return []
    return [entries.c.celery_retries <= retries,
            or_(entries.c.retry_due_at.is_(None), entries.c.retry_due_at <= db_now())]


def _out_of_turn(row: Any, retries: int | None, status: SagaStatus) -> Claim | None:
    """``_in_turn`` on the row read: the answer to a message that must not run the step
    (yet). A copy of an earlier retry (the sweeper resent it while its ETA copy waited in a
    busy worker, and that copy ran and asked for the next) is dropped; a retry delivered
    before its journaled due time (an ETA set on a host whose clock runs ahead) is sent
    again for that time (``row.due_in`` seconds on the database's clock)."""
    if retries is None:
        return None
    if retries < row.celery_retries:
        return Claim(Start.SUPERSEDED, row=row, saga_status=status)
    if row.due_in is not None and row.due_in > 0:
        return Claim(Start.NOT_DUE, row=row, saga_status=status)
    return None


def _still(row: Any) -> list[Any]:
    """The entry's attempt is still the one read, and its lease still lapsed (or none)."""
    same = entries.c.attempt_token.is_not_distinct_from(row.attempt_token)
    if row.lease_until is None:
        return [same, entries.c.lease_until.is_(None)]
    return [same, entries.c.lease_until < db_now()]
