"""What a claim that does not run its step says and sends: the same for a tool's delivery
(``execution``) and for a durable unit a flow's replay reaches (``replay``)."""

from __future__ import annotations

from .._base.types import OPEN, SagaStatus
from .._machine.machine import Claim, Start
from .._observe.logging import get_logger
from .._producer.deadlines import deadline_passed
from .._runtime import Runtime

__all__ = ["after_outcome", "not_run"]

log = get_logger()


def not_run(rt: Runtime, claim: Claim, saga_id: str, seq: int, tool: str) -> bool:
    """True when the claim runs the step; otherwise logs why not and sends what the saga
    needs next: its failure for a step found in doubt (paged: ``step_in_doubt``) or a
    passed deadline, its chain when the step was cancelled under it."""
    if claim.overdue:  # the claim found the deadline passed: nothing more runs
        deadline_passed(rt, saga_id, f"step {seq} ({tool}) was not run: the saga's deadline "
                                     "passed before it started")
    if claim.start is Start.IN_DOUBT:
        log.error("step_in_doubt", attempts=claim.row.attempts)
        after_outcome(rt, saga_id, claim.saga_status, f"step {seq} ({tool}) in doubt")
        return False
    if claim.start is Start.HELD:
        log.warning("step_held", detail="its saga is held on a divergence: nothing of it "
                    "runs; the step is sent again once the flow moves on (`sagaworker flows "
                    "resume`), or cancelled by `sagaworker abort`")
        return False
    if claim.start is not Start.RUN:
        log.info(f"step_{claim.start.value}", phase=claim.row.phase if claim.row else None)
        if claim.start is Start.CANCELLED and claim.saga_status is SagaStatus.COMPENSATING:
            rt.bus.send_compensate(saga_id)  # the chain may wait on this entry
        return False
    return True


def after_outcome(rt: Runtime, saga_id: str, status: SagaStatus | None, reason: str) -> None:
    """A step's outcome moved its saga: fail an open one, drive a compensating one's chain."""
    if status in OPEN:
        rt.bus.send_failure(saga_id, reason)
    elif status is SagaStatus.COMPENSATING:
        rt.bus.send_compensate(saga_id)
