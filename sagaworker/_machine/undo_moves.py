"""An undo's moves: claim the latest-EXECUTED entry's undo, record its outcome, release
it, reopen it for a re-drive; and the chain's finish. One undo of a saga at a time, latest
first, never while a forward step runs (``docs/design.md``)."""

from __future__ import annotations

from typing import Any

from sqlalchemy import and_, or_, select, update

from .._base.canonical import storable
from .._base.types import OutcomeResult, SagaStatus
from .._journal.dialect import db_later, db_now
from .._journal.raw_rows import opened_unless_elsewhere, raw_columns
from .._journal.repository import retrying
from .._journal.schema import entries, sagas
from . import pgfast as _pgfast
from .lifecycle import move, performs
from .moves_base import (
    _EXECUTED,
    _INTENT,
    MoveBase,
    UndoClaim,
    UndoState,
    _alive,
    worker_label,
)

__all__ = ["UndoMoves"]

#: an entry's row as the undo moves read it: user data as stored, opened only for the
#: undo that is claimed (``_opened``), so no other row's values stop the chain
_ROW = raw_columns(entries)


class UndoMoves(MoveBase):
    """The moves of the undos of a saga's EXECUTED entries."""

    @retrying
    def claim_undo(self, saga_id: str, token: str) -> UndoState:
        """Move ``claim_undo``: the latest-EXECUTED entry without an outcome, if it may run."""
        with self.j.engine.begin() as conn:
            return self._claim_undo(conn, saga_id, token, self.j.lock_saga(conn, saga_id))

    @retrying
    def record_and_claim(self, saga_id: str, seq: int, result: OutcomeResult,
                         detail: str | None, attempts: int, token: str,
                         next_token: str) -> tuple[bool, UndoState]:
        """Journal one outcome and claim the next undo, in one transaction (on
        PostgreSQL the common case in one round trip: ``_pgfast.undo_next``)."""
        engine = self.j.engine
        if _pgfast.enabled(engine):
            got = _pgfast.undo_next(engine, saga_id=saga_id, seq=seq, result=result.value,
                                    detail=storable(detail) if detail else detail,
                                    attempts=attempts, token=token, next_token=next_token,
                                    lease=self.lease, worker=worker_label())
            if got is not None:
                return True, UndoState(UndoClaim.CLAIMED, row=got,
                                       attempt=got.compensation_attempts, reason=got.reason,
                                       trace_context=got.trace_context)
        with engine.begin() as conn:
            # One statement locks the saga row, numbers the outcome in the report and
            # tells the sweeper the chain moves (a miss below leaves a harmless gap).
            saga = conn.execute(
                update(sagas).where(sagas.c.saga_id == saga_id)
                .values(comp_counter=sagas.c.comp_counter + 1, chain_touched_at=db_now(),
                        updated_at=db_now(), resends=0, resend_at=None)
                .returning(*raw_columns(sagas))).first()
            if saga is None:
                return False, UndoState(UndoClaim.NOT_COMPENSATING)
            recorded = self._record(conn, saga_id, seq, result, detail, attempts, token,
                                    order=saga.comp_counter)
            # recording changes neither the status nor the reason: the locked row serves
            return recorded, self._claim_undo(conn, saga_id, next_token, saga, touched=True)

    @performs("undo", "record", "skip", "give_up")
    def _record(self, conn: Any, saga_id: str, seq: int, result: OutcomeResult,
                detail: str | None, attempts: int | None, token: str, *,
                order: int | None = None) -> bool:
        """Moves ``record``/``skip``/``give_up``: once; True also for our own replay."""
        if order is None:  # the report's order first (a miss leaves a harmless gap)
            order = conn.execute(
                update(sagas).where(sagas.c.saga_id == saga_id)
                .values(comp_counter=sagas.c.comp_counter + 1, chain_touched_at=db_now(),
                        updated_at=db_now(), resends=0, resend_at=None)
                .returning(sagas.c.comp_counter)).scalar()
        extra = {} if attempts is None else {"compensation_attempts": attempts}
        n = self.j.set_entry(conn, saga_id, seq, entries.c.compensation.is_(None),
                             entries.c.undo_token == token,
                             compensation=result.value, compensation_detail=detail,
                             compensated_at=db_now(), comp_lease_until=None, comp_order=order,
                             **extra)
        if n:
            return True
        row = self.j.entry(conn, saga_id, seq)  # only on a miss: our own replayed outcome?
        return bool(row is not None and row.undo_token == token
                    and row.compensation is not None)

    @performs("undo", "claim_undo")
    def _claim_undo(self, conn: Any, saga_id: str, token: str, saga: Any, *,
                    touched: bool = False) -> UndoState:
        if saga is None or saga.status != SagaStatus.COMPENSATING.value:
            if saga is not None and saga.closed_by == token:  # our own finish, replayed
                doubted, died = self._found(self._decided(conn, saga_id, token), token)
                return self._finished_state(conn, saga_id, SagaStatus(saga.status),
                                            tuple(doubted), tuple(died))
            return UndoState(UndoClaim.NOT_COMPENSATING,
                             status=SagaStatus(saga.status) if saga else None)
        # One read for what may hold the chain back: forward attempts and undos that
        # started and have no outcome (none, in the common case), and what this move
        # found before, if it is replayed after a lost COMMIT (it reports it again).
        held = conn.execute(select(
            *_ROW, _alive(entries.c.lease_until),
            _alive(entries.c.comp_lease_until).label("comp_alive")).where(
                entries.c.saga_id == saga_id,
                or_(and_(entries.c.phase == _INTENT, entries.c.lease_until.is_not(None)),
                    and_(entries.c.phase == _EXECUTED, entries.c.compensation.is_(None),
                         entries.c.comp_lease_until.is_not(None)),
                    entries.c.decided_by == token))).all()
        doubted, died = self._found(held, token)
        # 1. No undo while a forward step of the saga runs: a late arrival is undone
        #    first, once it has an outcome (its EXECUTED re-sends the chain).
        running = self._forward_holds(conn, saga_id, held, doubted, token)
        if running is not None:
            return UndoState(UndoClaim.WAITING, row=running, in_doubt=tuple(doubted))
        tries = 1 + self.settings.compensation_retries
        live = [r for r in held if r.phase == _EXECUTED and r.compensation is None]
        while True:
            # 2. At most one undo of a saga at any moment.
            mine = [r for r in live if r.undo_token == token]
            if mine:  # our own claim, whose COMMIT reply was lost
                r = self._opened(mine[0])
                return UndoState(UndoClaim.CLAIMED, row=r, attempt=r.compensation_attempts,
                                 reason=saga.reason, in_doubt=tuple(doubted),
                                 died=tuple(died), trace_context=saga.trace_context)
            if any(r.comp_alive for r in live):
                return UndoState(UndoClaim.BUSY, row=live[0], in_doubt=tuple(doubted),
                                 died=tuple(died))
            # 3. Latest EXECUTED first: claimed in one statement, unless its last try's
            #    worker died with the tries used up (read below).
            claimed = self._claim_latest(conn, saga_id, token, tries)
            if claimed is not None:
                claimed = self._opened(claimed)
                if not touched:
                    self.j.touch(conn, saga_id, chain_touched_at=db_now())
                return UndoState(UndoClaim.CLAIMED, row=claimed,
                                 attempt=claimed.compensation_attempts, reason=saga.reason,
                                 in_doubt=tuple(doubted), died=tuple(died),
                                 trace_context=saga.trace_context)
            row = conn.execute(
                select(*_ROW).where(entries.c.saga_id == saga_id,
                                      entries.c.phase == _EXECUTED,
                                      entries.c.compensation.is_(None))
                .order_by(entries.c.exec_order.desc()).limit(1)).first()
            if row is None:
                return self._finish(conn, saga, token, tuple(doubted), tuple(died))
            died.append((row, self._died_every_try(conn, saga_id, row, token, tries)))
            live = self._live_undos(conn, saga_id)

    def _opened(self, row: Any) -> Any:
        """The claimed row, its values opened (``unreadable`` says why not: its undo is
        not run, journaled COMPENSATION_FAILED, and the chain goes on)."""
        return opened_unless_elsewhere(row, entries, self.j.engine.dialect)

    def _claim_latest(self, conn: Any, saga_id: str, token: str, tries: int) -> Any:
        """The latest-EXECUTED entry without an outcome, claimed in one statement (unless
        its last try's worker died with the tries used up): its row, or None."""
        latest = (select(entries.c.seq).where(
            entries.c.saga_id == saga_id, entries.c.phase == _EXECUTED,
            entries.c.compensation.is_(None))
            .order_by(entries.c.exec_order.desc()).limit(1).scalar_subquery())
        return conn.execute(
            update(entries)
            .where(entries.c.saga_id == saga_id, entries.c.seq == latest,
                   or_(entries.c.comp_lease_until.is_(None),
                       entries.c.compensation_attempts < tries))
            .values(compensation_attempts=entries.c.compensation_attempts + 1,
                    comp_lease_until=db_later(self.lease), comp_worker=worker_label(),
                    undo_token=token, updated_at=db_now())
            .returning(*_ROW)).first()

    def _forward_holds(self, conn: Any, saga_id: str, held: list[Any],
                       doubted: list[Any], token: str) -> Any:
        """The forward attempt still running, if any; the dead ones found in doubt (and
        added to ``doubted``) on the way."""
        for p in held:
            if p.phase != _INTENT or p.lease_until is None:
                continue
            if p.alive or not self._doubt(conn, saga_id, p.seq, p.attempt_token, False,
                                          p.reruns, by=token):
                return p  # (revived by a late heartbeat since it was read)
            doubted.append(p)
        return None

    @staticmethod
    def _decided(conn: Any, saga_id: str, token: str) -> list[Any]:
        return list(conn.execute(select(*_ROW).where(entries.c.saga_id == saga_id,
                                                       entries.c.decided_by == token)).all())

    @staticmethod
    def _found(rows: list[Any], token: str) -> tuple[list[Any], list[tuple[Any, str]]]:
        """What the move with ``token`` decided before (it is replayed after a lost COMMIT
        reply): forward steps it found in doubt, undos it gave up as died on every try."""
        mine = [r for r in rows if r.decided_by == token]
        return ([r for r in mine if r.in_doubt and r.phase != _INTENT],
                [(r, r.compensation_detail or "") for r in mine
                 if r.compensation == OutcomeResult.COMPENSATION_FAILED.value])

    def _died_every_try(self, conn: Any, saga_id: str, row: Any, token: str,
                        tries: int) -> str:
        """Its last try's worker died (OOM, segfault, os._exit, a hard time limit): that
        try counts, and the tries are used up. The detail journaled."""
        detail = (f"the undo's worker died during try {row.compensation_attempts} "
                  f"of {tries} (killed, out of memory, os._exit or a hard time "
                  "limit); the effect is still live")
        self.j.set_entry(conn, saga_id, row.seq, undo_token=token, decided_by=token)
        self._record(conn, saga_id, row.seq, OutcomeResult.COMPENSATION_FAILED,
                     detail, None, token)
        return detail

    @staticmethod
    def _live_undos(conn: Any, saga_id: str) -> list[Any]:
        return list(conn.execute(select(
            *_ROW, _alive(entries.c.comp_lease_until).label("comp_alive")).where(
                entries.c.saga_id == saga_id, entries.c.phase == _EXECUTED,
                entries.c.compensation.is_(None), entries.c.comp_lease_until.is_not(None))
        ).all())

    @performs("saga", "finish", "finish_dirty")
    def _finish(self, conn: Any, saga: Any, token: str, doubted: tuple[Any, ...],
                died: tuple[tuple[Any, str], ...]) -> UndoState:
        """Moves ``finish``/``finish_dirty``: every undo has an outcome, nothing runs."""
        saga_id = saga.saga_id
        for p in conn.execute(select(*_ROW).where(entries.c.saga_id == saga_id,
                                                    entries.c.phase == _INTENT)).all():
            if not self._cancel(conn, saga_id, p.seq,
                                "cancelled: the saga compensated and this step was not run"):
                return UndoState(UndoClaim.WAITING, row=p, in_doubt=doubted, died=died)
        dirty = self._dirty(conn, saga_id)
        status = SagaStatus(move("saga", "finish_dirty" if dirty else "finish").target)
        self.j.touch(conn, saga_id, status=status.value, finished_at=db_now(), closed_by=token)
        return UndoState(UndoClaim.FINISHED, status=status, dirty_tools=dirty,
                         in_doubt=doubted, died=died)

    def _finished_state(self, conn: Any, saga_id: str, status: SagaStatus,
                        doubted: tuple[Any, ...],
                        died: tuple[tuple[Any, str], ...]) -> UndoState:
        return UndoState(UndoClaim.FINISHED, status=status,
                         dirty_tools=self._dirty(conn, saga_id), in_doubt=doubted, died=died)

    @staticmethod
    def _dirty(conn: Any, saga_id: str) -> tuple[str, ...]:
        return tuple(conn.execute(select(entries.c.tool_name).where(
            entries.c.saga_id == saga_id,
            entries.c.compensation == OutcomeResult.COMPENSATION_FAILED.value)
            .order_by(entries.c.comp_order)).scalars().all())

    @retrying
    @performs("undo", "release_undo")
    def release_undo(self, saga_id: str, seq: int, token: str, detail: str) -> None:
        """Move ``release_undo``: it raised with tries left."""
        with self.j.engine.begin() as conn:
            self.j.lock_saga(conn, saga_id)
            self.j.set_entry(conn, saga_id, seq, entries.c.compensation.is_(None),
                             entries.c.undo_token == token,
                             comp_lease_until=None, compensation_detail=detail)

    @retrying
    @performs("saga", "redrive")
    @performs("undo", "reopen")
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
                                 updated_at=db_now()))
            self.j.touch(conn, saga_id, status=move("saga", "redrive").target,
                         finished_at=None, closed_by=None, chain_touched_at=db_now())
            self.j.audit(conn, saga_id, None, "retry_compensation", actor,
                         f"re-running undos of steps {seqs}")
            return seqs
