"""A saga's moves: begun, asked to fail, aborted, past its deadline, compensating,
completed. Each is one guarded transaction on the saga row (locked first)."""

from __future__ import annotations

import secrets
from typing import Any

from sqlalchemy import func, insert, select, update
from sqlalchemy.exc import IntegrityError

from .._base.crypto import Placed
from .._base.errors import SagaExists
from .._base.types import OPEN, Phase, SagaStatus
from .._journal.app_tx import AppTx
from .._journal.dialect import db_later, db_now
from .._journal.reads import lookup_id
from .._journal.repository import retrying
from .._journal.schema import audit, entries, sagas
from . import pgfast as _pgfast
from .lifecycle import move, performs
from .moves_base import (
    _EXECUTED,
    _INTENT,
    MoveBase,
    new_token,
)

__all__ = ["SagaMoves"]


class SagaMoves(MoveBase):
    """The moves of a saga's status."""

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
        nonce = secrets.token_hex(16) if self.j.keyed else None
        at = (saga_id, nonce)
        try:
            (tx.run if tx else self.j.write)(lambda conn: conn.execute(insert(sagas).values(
                saga_id=saga_id, status=SagaStatus.RUNNING.value, place_nonce=nonce,
                metadata=Placed(meta, at),
                created_at=db_now(), updated_at=db_now(), last_seq=0, exec_counter=0,
                deadline_at=None if deadline is None else db_later(deadline),
                flow=flow, flow_args=Placed(flow_args, at),
                flow_kwargs=Placed(flow_kwargs, at), **traced)))
            self.j.note_nonce(saga_id, nonce)
        except IntegrityError as exc:
            raise SagaExists(
                f"saga {saga_id!r} already exists; pick a new id, or use sw.get({saga_id!r}) "
                "to carry on the existing one"
            ) from exc

    @retrying
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
        lookup_id(saga_id)  # a NUL or a lone surrogate: BadInput, not a raw database error
        return self._abort(saga_id, reason, actor, new_token())

    @retrying
    def _abort(self, saga_id: str, reason: str, actor: str, token: str) -> SagaStatus:
        from .._base.errors import SagaNotFound, SagaworkerError

        with self.j.engine.begin() as conn:
            saga = self.j.lock_saga(conn, saga_id)
            if saga is None:
                raise SagaNotFound(f"no saga {saga_id!r}")
            status = SagaStatus(saga.status)
            if conn.execute(select(audit.c.id).where(  # our own abort, its COMMIT reply lost
                    audit.c.saga_id == saga_id, audit.c.token == token)).first() is not None:
                return SagaStatus.RUNNING if status not in OPEN else status
            if status not in OPEN:
                raise SagaworkerError(
                    f"saga {saga_id!r} is {status.value}; only a RUNNING or AWAITING_APPROVAL "
                    "saga can be aborted")
            self._request_failure(conn, saga, f"aborted by {actor}: {reason}", token)
            self.j.audit(conn, saga_id, None, "abort", actor, reason, token)
            return status

    def fail_overdue(self, saga_id: str) -> Any:
        """The deadline passed (on the database's clock): ask the saga to fail; its row
        when this call did."""
        return self._fail_overdue(saga_id, new_token())

    @retrying
    def _fail_overdue(self, saga_id: str, token: str) -> Any:
        with self.j.engine.begin() as conn:
            saga = self.j.lock_saga(conn, saga_id)
            if saga is not None and saga.fail_token == token:
                return saga  # our own request, whose COMMIT reply was lost
            if (saga is None or SagaStatus(saga.status) not in OPEN
                    or saga.fail_requested_at is not None or not self._overdue(conn, saga)):
                return None
            self._request_failure(conn, saga, "deadline passed", token)
            return saga

    @retrying
    @performs("saga", "begin_compensation", "begin_compensation_failing")
    def begin_compensation(self, saga_id: str, reason: str | None,
                           token: str) -> tuple[bool, int, str]:
        """Move ``begin_compensation``: one failure handler wins and starts the chain."""
        t = db_now()
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

    @retrying
    @performs("saga", "complete")
    def complete(self, saga_id: str, *, result: Any = None,
                 expect_seq: int | None = None) -> None:
        """Move ``complete``: RUNNING -> COMPLETED once every step EXECUTED. ``expect_seq``:
        the saga's last seq as a flow's replay read it (on PostgreSQL, one round trip)."""
        from .._base.errors import SagaNotFound, SagaworkerError

        engine = self.j.engine
        # (the result sealed for the saga's nonce, written only while it is the saga's)
        if expect_seq is not None and _pgfast.enabled(engine) and _pgfast.complete(
                engine, saga_id=saga_id, result=result, expect=expect_seq,
                place=self.j.place(saga_id)):
            return
        with engine.begin() as conn:
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
                         finished_at=db_now(),
                         result=Placed(result, (saga_id, saga.place_nonce)))

