"""The failure handler and the compensation runner: undo in strict reverse order.

The chain's position is the journal: each undo is claimed (a token and a lease) and its
outcome journaled once, so a redelivered message, a second chain or a restarted worker
picks up exactly where the journal says, never skipping and never repeating an outcome.
The machine lets no undo start while a forward step of the saga runs, nor beside another
undo of the same saga (``_machine.Machine.claim_undo``).
"""

from __future__ import annotations

import contextvars

import structlog

from .._base.awaiting import settle
from .._base.types import CompensationContext, OutcomeResult, SagaStatus
from .._base.units import FUNCTION_TOOL, MODEL_REQUEST, is_unit, unit_kind
from .._journal.rows import idempotency_key
from .._machine.machine import Held, UndoClaim, UndoState, new_token
from .._observe import tracing
from .._observe.logging import get_logger
from .._observe.redact import error_text
from .._runtime import Runtime
from .._worker.execution import Heartbeat

__all__ = ["Compensator", "current_compensation"]

log = get_logger()
#: how the skip of an agent's durable unit reads (nothing to undo: logged at info)
_UNIT_SKIPS = (f"a {MODEL_REQUEST}: ", f"a {FUNCTION_TOOL}: ")
#: the context of the undo running now (also for zero-argument undos)
current_compensation: contextvars.ContextVar[CompensationContext | None] = (
    contextvars.ContextVar("sagaworker_compensation", default=None))

Outcome3 = tuple[OutcomeResult, str | None, int]


class Compensator:
    def __init__(self, rt: Runtime, heartbeat: Heartbeat) -> None:
        self.rt = rt
        self.heartbeat = heartbeat

    def handle_failure(self, saga_id: str, reason: str | None) -> None:
        """Handle one saga-failure message: only the compare-and-set winner starts a chain."""
        with structlog.contextvars.bound_contextvars(saga_id=saga_id):
            won, executed, why = self.rt.machine.begin_compensation(saga_id, reason,
                                                                    new_token())
            if not won:
                log.debug("saga_failure_duplicate")
                return
            log.warning("saga_failed", reason=why)
            log.info("compensation_started", entries=executed)
            self.run_chain(saga_id)

    def backoff(self, attempt: int) -> float:
        # Capped below the Redis visibility timeout: an ETA message held longer than that
        # is redelivered while it still waits.
        s = self.rt.settings
        cap = min(60.0, s.redeliver_after / 2)
        return float(min(s.compensation_backoff * 2 ** (attempt - 1), cap))

    def run_chain(self, saga_id: str) -> None:
        """Run undos until the chain finishes, waits, or schedules a retry."""
        with structlog.contextvars.bound_contextvars(saga_id=saga_id):
            self._run_chain(saga_id)

    def _run_chain(self, saga_id: str) -> None:
        machine = self.rt.machine
        token = new_token()
        st = machine.claim_undo(saga_id, token)
        self._log_found(st)
        while st.state is UndoClaim.CLAIMED:
            row = st.row
            # traced: a child of the saga's start span, linked to the forward step's run
            with structlog.contextvars.bound_contextvars(saga_id=saga_id, seq=row.seq,
                                                         tool=row.tool_name), tracing.span(
                    f"compensate {row.tool_name}", parent=st.trace_context,
                    link=row.span_context, saga_id=saga_id, seq=row.seq, tool=row.tool_name,
                    attempt=st.attempt) as span:
                outcome = self._try(saga_id, st, token)
                if outcome is None:
                    span.outcome("retried", "the undo raised: it is tried again")
                    return  # a retry is scheduled
                # (not the undo's own text: it may quote a secret, as the logger knows)
                span.outcome(outcome[0].value.lower(), "the undo failed: dirty state"
                             if outcome[0] is OutcomeResult.COMPENSATION_FAILED else None)
                # the outcome and the next claim share one transaction (one per undo)
                next_token = new_token()
                recorded, st = machine.record_and_claim(saga_id, row.seq, *outcome, token,
                                                        next_token)
                token = next_token
                if recorded:  # else journaled by another chain already: never twice
                    self._log_outcome(*outcome)
            self._log_found(st)
        if st.state is UndoClaim.FINISHED:
            self._finished(st)

    def _log_found(self, st: UndoState) -> None:
        """What a claim found on its way: dead forward attempts and dead undos."""
        for p in st.in_doubt:
            log.error("step_in_doubt", seq=p.seq, tool=p.tool_name, attempts=p.attempts)
        for row, detail in st.died:
            with structlog.contextvars.bound_contextvars(seq=row.seq, tool=row.tool_name):
                self._log_outcome(OutcomeResult.COMPENSATION_FAILED, detail,
                                  row.compensation_attempts)

    def _try(self, saga_id: str, st: UndoState, token: str) -> Outcome3 | None:
        """One try of one undo: its outcome, or None when it failed and will be retried."""
        rt, row = self.rt, st.row
        if getattr(row, "unreadable", None):
            return (OutcomeResult.COMPENSATION_FAILED,
                    f"its undo was not run: {row.unreadable}", st.attempt)
        if is_unit(row.tool_name):
            return OutcomeResult.SKIPPED, f"a {unit_kind(row.tool_name)}: nothing to undo", 0
        spec = rt.registry.tool(row.tool_name)
        if spec is None:
            return (OutcomeResult.COMPENSATION_FAILED,
                    f"tool {row.tool_name!r} is not registered in this worker; its undo could "
                    "not run", st.attempt)
        if spec.gated:
            return OutcomeResult.SKIPPED, "irreversible", 0
        undo = rt.registry.undo_for(spec)
        if undo is None:
            return OutcomeResult.SKIPPED, "no undo declared", 0
        ctx = CompensationContext(
            saga_id=saga_id, seq=row.seq, tool_name=row.tool_name, args=list(row.args or []),
            kwargs=dict(row.kwargs or {}), result=row.result, reason=st.reason,
            attempt=st.attempt, idempotency_key=idempotency_key(saga_id, row.seq, "compensate"))
        ctx_token = current_compensation.set(ctx)
        held: Held = (saga_id, row.seq, True, token)
        self.heartbeat.hold(held)
        try:
            settle(undo.fn(ctx) if undo.takes_context else undo.fn())
        except Exception as exc:
            # (journaled, logged and paged: the step's secret values scrubbed, as a
            # forward step's error is)
            detail = error_text(exc, spec.signature, list(row.args or []),
                                dict(row.kwargs or {}), rt.settings.redact_keys)
            if st.attempt < 1 + rt.settings.compensation_retries:
                self.heartbeat.drop(held)
                rt.machine.release_undo(saga_id, row.seq, token, detail)
                delay = self.backoff(st.attempt)
                log.warning("compensation_retry", attempts=st.attempt, detail=detail,
                            retry_in_s=delay)
                rt.bus.send_compensate(saga_id, countdown=delay)
                return None
            return OutcomeResult.COMPENSATION_FAILED, detail, st.attempt
        finally:
            self.heartbeat.drop(held)
            current_compensation.reset(ctx_token)
        return OutcomeResult.COMPENSATED, None, st.attempt

    def _log_outcome(self, result: OutcomeResult, detail: str | None, attempts: int) -> None:
        if result is OutcomeResult.COMPENSATED:
            log.info("compensated", attempts=attempts)
        elif result is OutcomeResult.SKIPPED and (detail or "").startswith(_UNIT_SKIPS):
            log.info("compensation_skipped", detail=detail)  # nothing was there to undo
        elif result is OutcomeResult.SKIPPED:
            log.warning("compensation_skipped", detail=detail)
        else:
            log.error("compensation_failed", dirty_state=True, detail=detail, attempts=attempts)

    def _finished(self, st: UndoState) -> None:
        if st.status is SagaStatus.COMPENSATION_FAILED:
            log.critical("saga_compensation_failed", dirty_tools=list(st.dirty_tools))
        else:
            log.info("saga_compensated")
