"""The failure handler and the compensation runner: undo in strict reverse order.

The chain's position is the journal: each undo is claimed (a lease) and its outcome
journaled once, so a redelivered message, a second chain or a restarted worker picks
up exactly where the journal says, never skipping and never repeating an outcome.
"""

from __future__ import annotations

import contextvars
from typing import TYPE_CHECKING

import structlog

from ._journal import idempotency_key
from ._logging import get_logger
from ._transitions import UndoClaim, UndoState, worker_id
from ._types import CompensationContext, OutcomeResult, SagaStatus

if TYPE_CHECKING:
    from ._core import Sagaworker

__all__ = ["Compensator", "current_compensation"]

log = get_logger()
#: the context of the undo running now (also for zero-argument undos)
current_compensation: contextvars.ContextVar[CompensationContext | None] = (
    contextvars.ContextVar("sagaworker_compensation", default=None))


class Compensator:
    def __init__(self, sw: Sagaworker) -> None:
        self.sw = sw

    def handle_failure(self, saga_id: str, reason: str | None) -> None:
        """Handle one saga-failure message: only the compare-and-set winner starts a chain."""
        with structlog.contextvars.bound_contextvars(saga_id=saga_id):
            won, executed, why = self.sw.transitions.begin_compensation(saga_id, reason)
            if not won:
                log.debug("saga_failure_duplicate")
                return
            log.warning("saga_failed", reason=why)
            log.info("compensation_started", entries=executed)
            self.run_chain(saga_id)

    def backoff(self, attempt: int) -> float:
        # Capped below the Redis visibility timeout: an ETA message held longer than that
        # is redelivered while it still waits.
        cap = min(60.0, self.sw.settings.redeliver_after / 2)
        return float(min(self.sw.settings.compensation_backoff * 2 ** (attempt - 1), cap))

    def run_chain(self, saga_id: str) -> None:
        """Run undos until the chain finishes, waits, or schedules a retry."""
        with structlog.contextvars.bound_contextvars(saga_id=saga_id):
            self._run_chain(saga_id)

    def _run_chain(self, saga_id: str) -> None:
        sw = self.sw
        lease, me = sw.settings.lease_seconds, worker_id()
        st = sw.transitions.claim_undo(saga_id, lease, me)
        while st.state is UndoClaim.CLAIMED:
            row = st.row
            with structlog.contextvars.bound_contextvars(saga_id=saga_id, seq=row.seq,
                                                         tool=row.tool_name):
                outcome = self._try(saga_id, st)
                if outcome is None:
                    return  # a retry is scheduled
                # the outcome and the next claim share one transaction (one per undo)
                recorded, st = sw.transitions.record_and_claim(saga_id, row.seq, *outcome,
                                                               lease, me)
                if recorded:  # else journaled by another chain already: never twice
                    self._log_outcome(*outcome)
        if st.state is UndoClaim.FINISHED:
            self._finished(saga_id, st)

    def _try(self, saga_id: str, st: UndoState) -> tuple[OutcomeResult, str | None, int] | None:
        """One try of one undo: its outcome, or None when it failed and will be retried."""
        sw, row = self.sw, st.row
        spec = sw.registry.tool(row.tool_name)
        if spec is None:
            return (OutcomeResult.COMPENSATION_FAILED,
                    f"tool {row.tool_name!r} is not registered in this worker; its undo could "
                    "not run", st.attempt)
        if spec.gated:
            return OutcomeResult.SKIPPED, "irreversible", 0
        undo = sw.registry.undo_for(spec)
        if undo is None:
            return OutcomeResult.SKIPPED, "no undo declared", 0
        ctx = CompensationContext(
            saga_id=saga_id, seq=row.seq, tool_name=row.tool_name, args=list(row.args or []),
            kwargs=dict(row.kwargs or {}), result=row.result, reason=st.reason,
            attempt=st.attempt, idempotency_key=idempotency_key(saga_id, row.seq, "compensate"))
        token = current_compensation.set(ctx)
        beat = sw.executor.heartbeat
        beat.hold(saga_id, row.seq, undo=True)
        try:
            if undo.takes_context:
                undo.fn(ctx)
            else:
                undo.fn()
        except Exception as exc:
            detail = f"{type(exc).__name__}: {exc}"
            if st.attempt < 1 + sw.settings.compensation_retries:
                sw.transitions.release_undo(saga_id, row.seq, detail)
                delay = self.backoff(st.attempt)
                log.warning("compensation_retry", attempts=st.attempt, detail=detail,
                            retry_in_s=delay)
                sw.send_compensate(saga_id, countdown=delay)
                return None
            return OutcomeResult.COMPENSATION_FAILED, detail, st.attempt
        finally:
            beat.drop(saga_id, row.seq, undo=True)
            current_compensation.reset(token)
        return OutcomeResult.COMPENSATED, None, st.attempt

    def _log_outcome(self, result: OutcomeResult, detail: str | None, attempts: int) -> None:
        if result is OutcomeResult.COMPENSATED:
            log.info("compensated", attempts=attempts)
        elif result is OutcomeResult.SKIPPED:
            log.warning("compensation_skipped", detail=detail)
        else:
            log.error("compensation_failed", dirty_state=True, detail=detail, attempts=attempts)

    def _finished(self, saga_id: str, st: UndoState) -> None:
        for p in st.in_doubt:
            log.error("step_in_doubt", seq=p.seq, tool=p.tool_name, attempts=p.attempts)
        if st.status is SagaStatus.COMPENSATION_FAILED:
            log.critical("saga_compensation_failed", dirty_tools=list(st.dirty_tools))
        else:
            log.info("saga_compensated")
