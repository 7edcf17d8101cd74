"""The worker side of a tool step: claim the attempt, run the tool, journal the outcome."""

from __future__ import annotations

import contextvars
import time
from collections.abc import Sequence
from datetime import UTC, datetime
from typing import Any

import structlog
from celery import Task
from celery.exceptions import Ignore, Reject, Retry

from .._base.awaiting import settle
from .._base.canonical import unheld_result
from .._base.errors import BadInput
from .._base.registry import ToolSpec
from .._base.types import ENVELOPE, SagaStatus
from .._journal.rows import idempotency_key
from .._machine.machine import Claim, Held, Start, new_token, worker_label
from .._observe import tracing
from .._observe.logging import get_logger
from .._observe.redact import call_reprs, error_text, secret_values
from .._observe.sanitize import celery_safe, is_sanitized, sanitized
from .._runtime import Runtime
from .claims import after_outcome, not_run
from .eager import Advance, Eager, EagerRetry
from .failures import Failures
from .heartbeat import Heartbeat
from .verify import verify

__all__ = ["ENVELOPE", "Executor", "Heartbeat", "ToolTask", "current_idempotency_key"]

log = get_logger()
_current_key: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "sagaworker_idempotency_key", default=None)


def current_idempotency_key() -> str | None:
    """Inside a running tool: the step's stable key (the same on every retry and re-run)."""
    return _current_key.get()


class ToolTask(Task):  # type: ignore[misc]
    """Base of every journaled tool task: late acks, requeued when a worker is lost."""

    acks_late = True
    reject_on_worker_lost = True
    # celery inspect (and Flower) show the redacted argsrepr only
    Request = "sagaworker._observe.celery_logs:RedactedRequest"
    ignore_result = True
    sagaworker_spec: ToolSpec
    sagaworker_executor: Executor

    def apply_async(self, args: Any = None, kwargs: Any = None, **options: Any) -> Any:
        # every publish (a Celery retry, a direct call) carries the redacted reprs: the
        # task-sent event is built from them before any publish signal runs
        keys = self.sagaworker_executor.rt.settings.redact_keys
        if keys and options.get("argsrepr") is None:
            options["argsrepr"], options["kwargsrepr"] = call_reprs(
                self.sagaworker_spec.signature, args or (), kwargs or {}, keys)
        return super().apply_async(args, kwargs, **options)

    def retry(self, args: Any = None, kwargs: Any = None, exc: Any = None, throw: bool = True,
              eta: datetime | None = None, countdown: float | None = None,
              max_retries: int | None = None, **options: Any) -> Any:
        if getattr(self.request, "sagaworker_eager", False):
            return self._eager_retry(exc, throw, max_retries, eta, countdown)
        if isinstance(exc, BaseException) and not is_sanitized(exc):
            # Celery keeps the retry's exception (its Retry text, the task-retried event)
            exc = sanitized(exc, *self.sagaworker_executor.secrets(
                self.sagaworker_spec, self.request.args or (), self.request.kwargs or {}))
        # Journal when Celery's retry message is due and its count, before Celery publishes
        # it: the sweeper resends a lost one (a SIGKILLed worker holding its ETA message, a
        # purged queue), never one still scheduled. A retry past max_retries (Celery raises
        # instead) and one that lets the tool go on (throw=False) publish nothing to wait for.
        if throw and not self._past_max(max_retries):
            self.sagaworker_executor.failures.retrying(
                self.request.id, exc, _delay(self, eta, countdown),
                int(self.request.retries or 0) + 1)
        return super().retry(args=args, kwargs=kwargs, exc=exc, throw=throw, eta=eta,
                              countdown=countdown, max_retries=max_retries, **options)

    def _eager_retry(self, exc: Any, throw: bool, max_retries: int | None,
                     eta: datetime | None, countdown: float | None) -> Any:
        """A retry asked for by a step run eagerly (no message of its own): past the task's
        retries it raises as Celery would; else the step goes to the broker (``Eager``)."""
        if self._past_max(max_retries):
            if isinstance(exc, BaseException):
                raise exc
            raise self.MaxRetriesExceededError(f"Can't retry {self.name}[{self.request.id}]")
        if not throw:  # the tool goes on and returns: its outcome is journaled as usual
            return Retry(exc=exc, when=eta or countdown)
        # journaled before the hand-over's publish, as a delivered step's retry is: a worker
        # lost in between leaves the sweeper the retry, when due and with its count
        delay = _delay(self, eta, countdown)
        self.sagaworker_executor.failures.retrying(self.request.id, exc, delay, 1)
        raise EagerRetry(self.name, delay)

    def _past_max(self, max_retries: int | None) -> bool:
        """Celery's own test: a retry now would exceed the task's ``max_retries``."""
        limit = self.max_retries if max_retries is None else max_retries
        return limit is not None and int(self.request.retries or 0) + 1 > limit

    def on_failure(self, exc: BaseException, task_id: str, args: Any, kwargs: Any,
                   einfo: Any) -> None:
        # Only an exception the tool itself raised, after Celery gave up retrying, makes
        # the entry FAILED (``Failures``): in the run's span (traced), which ends here
        with tracing.resumed(task_id) as span:
            failed = self.sagaworker_executor.failures.gave_up(
                task_id, self.sagaworker_spec, exc, args, kwargs)
            span.outcome("failed" if failed else "raised")

    def on_retry(self, exc: BaseException, task_id: str, args: Any, kwargs: Any,
                 einfo: Any) -> None:
        tracing.finish_parked(task_id, "retried")  # the run's span: Celery retries it


class Executor:
    def __init__(self, rt: Runtime, *, advance: Advance | None = None) -> None:
        self.rt = rt
        self.failures = Failures(rt, self.fail_step)
        self.heartbeat = Heartbeat(rt)
        #: called with a flow saga's id once one of its steps is EXECUTED
        self.advance = advance
        self.eager = Eager(self)

    def run(self, task: ToolTask, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        spec = task.sagaworker_spec
        env = kwargs.pop(ENVELOPE, None)
        if env is None and task.request.called_directly:
            return spec.fn(*args, **kwargs)
        task_id = task.request.id
        try:
            saga_id, seq = _envelope(env)
        except BadInput as exc:
            log.error("bad_message", tool=spec.name, task_id=task_id, error=str(exc))
            raise Reject(str(exc), requeue=False) from exc
        with structlog.contextvars.bound_contextvars(saga_id=saga_id, seq=seq, tool=spec.name,
                                                     task_id=task_id,
                                                     worker=task.request.hostname):
            # Celery never holds what the tool raised: its events show a redacted copy
            return celery_safe(lambda: self._run(task, spec, saga_id, seq, args, kwargs),
                               self.rt.settings.redact_keys,
                               lambda: self.secrets(spec, args, kwargs)[1])

    def secrets(self, spec: ToolSpec, args: Any, kwargs: Any
                ) -> tuple[frozenset[str], list[str]]:
        """The redact keys, and the secret values of one call of ``spec``."""
        keys = self.rt.settings.redact_keys
        return keys, secret_values(spec.signature, args, kwargs, keys) if keys else []

    def _run(self, task: ToolTask, spec: ToolSpec, saga_id: str, seq: int,
             args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """One delivery: claim the step, run the tool, journal its outcome; then carry
        its flow on (the next step may run here: ``Eager``)."""
        if self.run_step(spec, saga_id, seq, task.request.id, args, kwargs,
                         retries=int(task.request.retries or 0)):
            self.eager.carry(saga_id, carrier=task)
        return None

    def run_step(self, spec: ToolSpec, saga_id: str, seq: int, task_id: str,
                 args: Sequence[Any], kwargs: dict[str, Any], *, eager: bool = False,
                 claimed: tuple[str, Claim] | None = None,
                 retries: int | None = None) -> bool:
        """Claim, run, journal the outcome: True when the step is EXECUTED in a flow that
        the caller is to advance. What the tool raises goes on to Celery (its retries,
        then FAILED in ``on_failure``); run ``eager``ly (no Celery request), it makes the
        step FAILED here: eager steps are only tools without Celery retries. ``claimed``:
        (token, claim) of a claim taken already (with the eager step's INTENT);
        ``retries``: the Celery retry count of the message delivered."""
        started = time.time_ns()
        if claimed is not None:
            token, claim = claimed
        else:
            token = new_token()
            claim = self.rt.machine.claim_start(saga_id, seq, spec.name, token=token,
                                                worker=worker_label(),
                                                idempotent=spec.idempotent, task_id=task_id,
                                                retries=retries)
        if not self._runs(claim, spec, saga_id, seq):
            if claim.start is Start.NOT_DUE and retries is not None:
                self.when_due(claim, spec, saga_id, seq, task_id, args, kwargs, retries)
            return False
        calling = False  # from the tool's call on, its claim is never released here
        try:
            # traced: the run's span, from the claim on, is the child of the step's
            # journaled enqueue span (however it came: the producer, the relay, the sweeper)
            span = tracing.step_span(spec.name, saga_id, seq, claim.attempt,
                                     claim.row.trace_context, started)
        except Exception as exc:
            self.failures.unstarted(saga_id, seq, token, exc, None if eager else task_id)
            raise
        advance = False
        try:
            with span.current():
                if claim.rerun:
                    log.warning("step_rerun", attempts=claim.attempt, detail="idempotent "
                                "tool: its earlier attempt died with no outcome")
                problem = verify(self.rt, spec, claim.row, args, kwargs)
                if problem is not None:
                    span.outcome("failed", problem)
                    self.fail_step(saga_id, seq, spec.name, token, problem, task_id=task_id)
                else:
                    calling = True
                    value, duration_ms = self._attempt(task_id, spec, saga_id, seq, token,
                                                       args, kwargs)
                    advance = self._journal_outcome(task_id, spec, saga_id, seq, token,
                                                    claim.attempt, value, duration_ms, span)
        except Exception as exc:
            if not calling:
                self.failures.unstarted(saga_id, seq, token, exc, None if eager else task_id)
            if self._raised(exc, span, spec, task_id, args, kwargs, eager=eager):
                raise
            return False
        span.end()
        return advance

    def _raised(self, exc: Exception, span: tracing.Spanned, spec: ToolSpec, task_id: str,
                args: Sequence[Any], kwargs: dict[str, Any], *, eager: bool) -> bool:
        """What follows an exception out of a step's run: True when it goes on (to Celery,
        or to the eager caller), False when its verdict is journaled here."""
        span.fail(exc, None if span.span is None else error_text(
            exc, spec.signature, args, kwargs, self.rt.settings.redact_keys))
        if eager and isinstance(exc, EagerRetry):  # the caller hands it to the broker
            self.failures.forget(task_id)
            span.outcome("retried")
            span.end()
            return True
        # Eager: no Celery verdict follows, the tool's exception is its last word. Reject
        # or Ignore: the tool's own (sagaworker's are raised before the run), no verdict of
        # Celery's follows these either, and a step needs an outcome (else the sweeper
        # would send it again for ever): FAILED both.
        if eager or isinstance(exc, Reject | Ignore):
            span.outcome("failed" if self.failures.gave_up(
                task_id, spec, exc, args, kwargs) else "raised")
            span.end()
            return not eager
        tracing.park(task_id, span)  # Celery's verdict (a retry, or on_failure) ends it
        return True

    def _runs(self, claim: Claim, spec: ToolSpec, saga_id: str, seq: int) -> bool:
        """True when this delivery runs the tool; otherwise says (and does) why not."""
        if claim.start in (Start.UNKNOWN, Start.MISMATCH):
            msg = (f"no journal entry for saga {saga_id!r} step {seq}; tool messages must be "
                   "sent by saga.enqueue(), which journals them first"
                   if claim.start is Start.UNKNOWN else
                   f"saga {saga_id!r} step {seq} is journaled as tool "
                   f"{claim.row.tool_name!r}, not {spec.name!r}; the message is not run")
            log.error("unknown_step" if claim.start is Start.UNKNOWN else "bad_message",
                      error=msg)
            raise Reject(msg, requeue=False)
        return not_run(self.rt, claim, saga_id, seq, spec.name)

    def when_due(self, claim: Claim, spec: ToolSpec, saga_id: str, seq: int, task_id: str,
                 args: Sequence[Any], kwargs: dict[str, Any], retries: int) -> None:
        """A Celery retry delivered before its journaled due time (its ETA set on a host
        whose clock runs ahead of this one's or the database's) is not run early, nor
        dropped: sent again, with its count, for the time left on the database's clock."""
        self.rt.bus.publish_step(saga_id, seq, spec.name, list(args), dict(kwargs), task_id,
                                 claim.row.queue, retries=retries,
                                 countdown=max(float(claim.row.due_in), 0.001))

    def _attempt(self, task_id: str, spec: ToolSpec, saga_id: str, seq: int, token: str,
                 args: Sequence[Any], kwargs: dict[str, Any]) -> tuple[Any, float]:
        """Run the tool under its lease (kept fresh by the heartbeat): its value and
        duration. An exception goes through ``failures`` and on to Celery."""
        key = _current_key.set(idempotency_key(saga_id, seq, "execute"))
        held: Held = (saga_id, seq, False, token)
        self.heartbeat.hold(held)
        self.failures.running(task_id, (saga_id, seq, token, spec, args, kwargs))
        started = time.perf_counter()
        try:
            value = settle(spec.fn(*args, **kwargs))
        except Exception as exc:
            self.heartbeat.drop(held)
            self.failures.finished(task_id)
            self.failures.raised(task_id, spec, saga_id, seq, token, exc, args, kwargs)
            raise
        finally:
            _current_key.reset(key)
            self.failures.finished(task_id)
            self.heartbeat.drop(held)
        return value, round((time.perf_counter() - started) * 1000, 3)

    def _journal_outcome(self, task_id: str, spec: ToolSpec, saga_id: str, seq: int,
                         token: str, attempt: int, value: Any, duration_ms: float,
                         span: tracing.Spanned) -> bool:
        """Journal the attempt's outcome; True when its flow is to be advanced."""
        rt = self.rt
        # The effect happened: a result that cannot be journaled (not JSON, or over
        # SAGAWORKER_MAX_RESULT_BYTES) still makes the step EXECUTED (so its undo runs),
        # with the error saying why its result is missing.
        error = unheld_result(value, rt.settings.max_result_bytes)
        reason = f"step {seq} ({spec.name}) failed: {error}"
        outcome = rt.machine.executed(saga_id, seq, token, None if error else value,
                                      duration_ms, error=error, fail_reason=reason,
                                      span_context=span.carrier)
        span.outcome("executed" if outcome.applied else "fenced", error)
        if not outcome.applied:
            # Another attempt took the entry over (this one's lease lapsed): its outcome is
            # the journal's, and this effect is reported, never journaled over it.
            log.error("step_outcome_fenced", attempt=attempt, duration_ms=duration_ms,
                      detail="this attempt's lease lapsed and the entry moved on; its "
                             "effect happened and is not journaled")
            return False
        # an earlier attempt's note (a retry that then succeeded) is of no use now; a note
        # is fenced by its token anyway, so a stale one can never fail a newer attempt
        self.failures.forget(task_id)
        if error is not None:  # the saga was asked to fail with the outcome
            log.warning("step_failed", error=error, executed=True)
            self._after_outcome(saga_id, outcome.status, reason)
            return False
        log.info("step_executed", duration_ms=duration_ms, attempt=attempt)
        if outcome.status is SagaStatus.COMPENSATING:
            rt.bus.send_compensate(saga_id)  # a late arrival: the chain undoes it first
            return False
        # The flow moves on in the worker that journaled the outcome: no message and no
        # polling. Lost with this worker, the sweeper sends the advance again.
        return outcome.flow is not None and self.advance is not None

    def fail_step(self, saga_id: str, seq: int, tool: str, token: str, error: str, *,
                  task_id: str | None = None, in_doubt: bool = False) -> None:
        status = self.rt.machine.failed(saga_id, seq, token, error, in_doubt=in_doubt)
        if status is None:
            return
        with structlog.contextvars.bound_contextvars(saga_id=saga_id, seq=seq, tool=tool,
                                                     task_id=task_id):
            log.warning("step_failed", error=error, in_doubt=in_doubt)
        self._after_outcome(saga_id, status, f"step {seq} ({tool}) failed: {error}")

    def _after_outcome(self, saga_id: str, status: SagaStatus | None, reason: str) -> None:
        after_outcome(self.rt, saga_id, status, reason)


def _delay(task: Task, eta: datetime | None, countdown: float | None) -> float:
    """Seconds until the retry Celery is asked for is due (its countdown, its ETA, or the
    task's ``default_retry_delay``, as Celery computes it)."""
    if countdown is not None:
        return max(float(countdown), 0.0)
    if eta is not None:
        return max((eta - datetime.now(UTC)).total_seconds(), 0.0)
    return max(float(task.default_retry_delay or 0), 0.0)


def _envelope(env: Any) -> tuple[str, int]:
    if not isinstance(env, dict):
        raise BadInput(f"malformed sagaworker envelope {env!r}: expected a dict "
                       "with saga_id and seq; enqueue tools with saga.enqueue()")
    saga_id, seq = env.get("saga_id"), env.get("seq")
    if not isinstance(saga_id, str) or not isinstance(seq, int) or isinstance(seq, bool):
        raise BadInput(f"malformed sagaworker envelope {env!r}: saga_id must be a str "
                       "and seq an int")
    return saga_id, seq
