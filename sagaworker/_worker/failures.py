"""What happens to an attempt whose tool raised (see :class:`Failures`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .._base.registry import ToolSpec
from .._base.types import SagaStatus
from .._observe.logging import get_logger
from .._observe.redact import error_text
from .._runtime import Runtime

__all__ = ["Failures"]

log = get_logger()


class Failures:
    """The failure path of an attempt, in one place. A tool raises: its lease is released
    (not in doubt) and the attempt is noted by task id (``raised``). Celery then either
    retries, and the retry's due time is journaled so the sweeper resends a retry message
    that gets lost (``retrying``); or gives up, and the entry is FAILED, fenced by the
    token of the attempt that raised, which fails the saga (``gave_up``). Infrastructure
    errors and a lost worker are not outcomes: nothing is noted for them."""

    def __init__(self, rt: Runtime, fail_step: Callable[..., None]) -> None:
        self.rt = rt
        self.fail_step = fail_step
        #: task id -> (saga id, seq, token) of the attempt that raised, in this process
        self.noted: dict[str, tuple[str, int, str]] = {}
        #: task id -> (saga id, seq, token, spec, args, kwargs) of a tool running now
        self.live: dict[str, tuple[str, int, str, ToolSpec, Any, Any]] = {}
        #: task ids whose attempt was released before its tool started (``unstarted``):
        #: a Celery retry of it is journaled, a give-up journals no verdict
        self.unstarted_ids: set[str] = set()

    def running(self, task_id: str, attempt: tuple[str, int, str, ToolSpec, Any, Any]
                ) -> None:
        """The attempt ``task_id`` runs its tool now (a retry it asks for is journaled)."""
        self.live[task_id] = attempt
        self.unstarted_ids.discard(task_id)

    def finished(self, task_id: str) -> None:
        self.live.pop(task_id, None)

    def raised(self, task_id: str, spec: ToolSpec, saga_id: str, seq: int, token: str,
               exc: Exception, args: Any, kwargs: Any) -> None:
        noted = self.noted.get(task_id)
        if noted is not None and noted[2] == token:
            return  # released already, with its retry's due time (``retrying``)
        status = self.rt.machine.release(saga_id, seq, token, self._text(
            spec, exc, args, kwargs))
        self.noted[task_id] = (saga_id, seq, token)
        self._chain_waited(saga_id, status)

    def _chain_waited(self, saga_id: str, status: SagaStatus | None) -> None:
        """A released attempt of a compensating saga: its chain waited for it, send it on."""
        if status is SagaStatus.COMPENSATING:
            self.rt.bus.send_compensate(saga_id)

    def unstarted(self, saga_id: str, seq: int, token: str, exc: BaseException,
                  task_id: str | None = None) -> None:
        """The attempt stopped with its step claimed and its tool not called yet (an error
        of its own setup: tracing, the process, the journal): nothing ran, so the claim is
        released, never left to lapse into doubt while its worker lives, and the sweeper
        sends the step again (once twice ``relay_after`` has passed). Not past
        ``SAGAWORKER_MAX_RERUNS`` such releases of the step (counted in the journal; its
        Celery retries are not releases): a setup that always fails would cycle for ever,
        so that attempt's claim is left to lapse, and the step goes in doubt (paged) as a
        lost worker's does; so does a journal that cannot be written now."""
        detail = (f"the attempt stopped before its tool started ({type(exc).__name__}); "
                  "the step is sent again")
        try:
            released, status = self.rt.machine.release_unstarted(saga_id, seq, token, detail)
        except Exception as failed:
            log.warning("claim_not_released", error=type(failed).__name__, detail=detail)
            return
        if released == "bound":
            n = self.rt.settings.max_reruns
            log.error("claim_not_released", error=type(exc).__name__, releases=n,
                      detail=f"the step's claims stopped before its tool started {n + 1} "
                      "times (SAGAWORKER_MAX_RERUNS): this one is left to lapse (the step "
                      "goes in doubt)")
            return
        if released == "fenced":  # another attempt holds the step now: nothing of ours
            return
        log.warning("step_released", detail=detail)
        if task_id is not None:  # (a delivery: Celery may retry it, ``autoretry_for``)
            self.noted[task_id] = (saga_id, seq, token)
            self.unstarted_ids.add(task_id)
        self._chain_waited(saga_id, status)

    def retrying(self, task_id: str, exc: Any, delay: float, retries: int) -> None:
        """Celery is about to publish the retry ``retries`` of ``task_id``, due in
        ``delay`` seconds: journaled first. Asked by the tool itself while it runs, the
        attempt's lease is released in the same commit; asked by ``autoretry_for`` (the
        tool raised, its lease is released), only the due time and count are written."""
        live = self.live.get(task_id)
        if live is not None:
            saga_id, seq, token, spec, args, kwargs = live
            status = self.rt.machine.retry_later(
                saga_id, seq, token, self._text(spec, exc, args, kwargs), delay, retries)
            self.noted[task_id] = (saga_id, seq, token)
            self._chain_waited(saga_id, status)
            return
        noted = self.noted.get(task_id)
        if noted is not None:
            saga_id, seq, token = noted
            self.rt.machine.retry_due(saga_id, seq, token, delay, retries)
        self.unstarted_ids.discard(task_id)

    def _text(self, spec: ToolSpec, exc: Any, args: Any, kwargs: Any) -> str:
        if not isinstance(exc, BaseException):
            exc = Exception("the tool asked Celery for a retry")
        return error_text(exc, spec.signature, args or (), kwargs or {},
                          self.rt.settings.redact_keys)

    def gave_up(self, task_id: str, spec: ToolSpec, exc: BaseException, args: Any,
                kwargs: Any) -> bool:
        """True when the exception was the tool's: its step is FAILED (unless fenced)."""
        noted = self.noted.pop(task_id, None)
        if noted is None or task_id in self.unstarted_ids:
            self.unstarted_ids.discard(task_id)  # released unstarted: it is sent again
            return False
        saga_id, seq, token = noted
        self.fail_step(saga_id, seq, spec.name, token,
                       error_text(exc, spec.signature, args or (), kwargs or {},
                                  self.rt.settings.redact_keys), task_id=task_id)
        return True

    def forget(self, task_id: str) -> None:
        self.noted.pop(task_id, None)

    def clear(self) -> None:
        """After a fork: nothing the parent noted is this process's."""
        self.noted.clear()
        self.live.clear()
        self.unstarted_ids.clear()
