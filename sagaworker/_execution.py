"""The worker side of a tool step: claim the attempt, run the tool, journal the outcome."""

from __future__ import annotations

import contextvars
import os
import threading
import time
from typing import TYPE_CHECKING, Any

import structlog
from celery import Task
from celery.exceptions import Reject

from ._canonical import args_digest, check_json
from ._errors import BadInput
from ._journal import idempotency_key
from ._logging import get_logger
from ._redact import error_text
from ._transitions import Held, Start, worker_id
from ._types import OPEN, SagaStatus

if TYPE_CHECKING:
    from ._core import Sagaworker
    from ._registry import ToolSpec

__all__ = ["ENVELOPE", "ToolTask", "current_idempotency_key"]

#: the reserved keyword that carries (saga_id, seq) inside a tool message
ENVELOPE = "__sagaworker__"

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
    Request = "sagaworker._redact:RedactedRequest"  # celery inspect shows argsrepr only
    ignore_result = True
    sagaworker_spec: ToolSpec
    sagaworker: Sagaworker

    def on_failure(self, exc: BaseException, task_id: str, args: Any, kwargs: Any,
                   einfo: Any) -> None:
        # Only an exception the tool itself raised, after Celery gave up retrying, makes
        # the entry FAILED; infrastructure errors and a lost worker are not outcomes.
        if self.sagaworker.executor.tool_raised.pop(task_id, None) is None:
            return
        env = (kwargs or {}).get(ENVELOPE) or {}
        self.sagaworker.executor.fail_step(
            env.get("saga_id"), env.get("seq"), self.sagaworker_spec.name,
            error_text(exc, self.sagaworker_spec.signature, args or (), kwargs or {},
                       self.sagaworker.settings.redact_keys), task_id=task_id)


class Executor:
    def __init__(self, sw: Sagaworker) -> None:
        self.sw = sw
        self.tool_raised: dict[str, bool] = {}
        self.heartbeat = Heartbeat(sw)

    def run(self, task: ToolTask, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        spec = task.sagaworker_spec
        env = kwargs.pop(ENVELOPE, None)
        if env is None and task.request.called_directly:
            return spec.fn(*args, **kwargs)
        task_id = task.request.id
        worker = worker_id()
        try:
            saga_id, seq = _envelope(env)
        except BadInput as exc:
            log.error("bad_message", tool=spec.name, task_id=task_id, error=str(exc))
            raise Reject(str(exc), requeue=False) from exc
        with structlog.contextvars.bound_contextvars(saga_id=saga_id, seq=seq, tool=spec.name,
                                                     task_id=task_id,
                                                     worker=task.request.hostname):
            return self._run(task, spec, saga_id, seq, args, kwargs, worker)

    def _run(self, task: ToolTask, spec: ToolSpec, saga_id: str, seq: int,
             args: tuple[Any, ...], kwargs: dict[str, Any], worker: str) -> Any:
        sw = self.sw
        claim = sw.transitions.claim_start(saga_id, seq, worker=worker,
                                           lease=sw.settings.lease_seconds,
                                           idempotent=spec.idempotent, task_id=task.request.id)
        if claim.start is Start.UNKNOWN:
            msg = (f"no journal entry for saga {saga_id!r} step {seq}; tool messages must be "
                   "sent by saga.enqueue(), which journals them first")
            log.error("unknown_step", error=msg)
            raise Reject(msg, requeue=False)
        if claim.start is Start.IN_DOUBT:
            log.error("step_in_doubt", attempts=claim.row.attempts)
            self._after_outcome(saga_id, claim.saga_status, f"step {seq} ({spec.name}) in doubt")
            return None
        if claim.start is not Start.RUN:
            log.info(f"step_{claim.start.value}", phase=claim.row.phase if claim.row else None)
            return None
        row = claim.row
        if claim.rerun:
            log.warning("step_rerun", attempts=claim.attempt,
                        detail="idempotent tool: its earlier attempt died with no outcome")
        problem = self._verify(spec, row, args, kwargs)
        if problem is not None:
            self.fail_step(saga_id, seq, spec.name, problem, task_id=task.request.id)
            return None
        token = _current_key.set(idempotency_key(saga_id, seq, "execute"))
        self.heartbeat.hold(saga_id, seq)
        started = time.perf_counter()
        try:
            value = spec.fn(*args, **kwargs)
        except Exception as exc:
            # The attempt ended (it raised): not in doubt. Celery now retries it or gives
            # up and calls on_failure, which journals FAILED.
            sw.transitions.release_attempt(saga_id, seq, error_text(
                exc, spec.signature, args, kwargs, sw.settings.redact_keys))
            self.tool_raised[task.request.id] = True
            raise
        finally:
            _current_key.reset(token)
            self.heartbeat.drop(saga_id, seq)
        duration_ms = round((time.perf_counter() - started) * 1000, 3)
        try:
            check_json(value, f"the result of tool {spec.name!r}")
        except BadInput as exc:
            # The effect happened but cannot be journaled: a human must look (in doubt).
            self.fail_step(saga_id, seq, spec.name, str(exc), task_id=task.request.id,
                           in_doubt=True)
            return None
        status = sw.transitions.executed(saga_id, seq, value, duration_ms)
        log.info("step_executed", duration_ms=duration_ms, attempt=claim.attempt)
        if status is SagaStatus.COMPENSATING:
            sw.send_compensate(saga_id)  # a late arrival: the chain undoes it too
        return None

    def _verify(self, spec: ToolSpec, row: Any, args: Any, kwargs: Any) -> str | None:
        try:
            sent = args_digest(args, kwargs)
        except (TypeError, ValueError) as exc:
            return f"arguments are not JSON: {exc}"
        if spec.gated:
            # recomputed from the journal's arguments: an edit after approval must show
            journaled = args_digest(row.args or [], row.kwargs or {})
            if not row.approved_by or row.approved_digest != journaled or sent != journaled:
                return ("approval verification failed: the arguments no longer match the "
                        "approved step; not run. Start a new saga with the intended arguments")
        elif sent != row.args_digest:  # the digest journaled with the INTENT
            return "the message's arguments do not match the journal; not run"
        if spec.signature is not None:
            try:
                spec.signature.bind(*args, **kwargs)
            except TypeError as exc:
                return f"malformed arguments for {spec.name}: {exc}"
        return None

    def fail_step(self, saga_id: Any, seq: Any, tool: str, error: str, *,
                  task_id: str | None = None, in_doubt: bool = False) -> None:
        if not isinstance(saga_id, str) or not isinstance(seq, int):
            return
        status = self.sw.transitions.failed(saga_id, seq, error, in_doubt=in_doubt,
                                            reason=f"step {seq} ({tool}) failed: {error}")
        if status is None:
            return
        with structlog.contextvars.bound_contextvars(saga_id=saga_id, seq=seq, tool=tool,
                                                     task_id=task_id):
            log.warning("step_failed", error=error, in_doubt=in_doubt)
        self._after_outcome(saga_id, status, f"step {seq} ({tool}) failed: {error}")

    def _after_outcome(self, saga_id: str, status: SagaStatus | None, reason: str) -> None:
        if status in OPEN:
            self.sw.send_failure(saga_id, reason)
        elif status is SagaStatus.COMPENSATING:
            self.sw.send_compensate(saga_id)


def _envelope(env: Any) -> tuple[str, int]:
    if not isinstance(env, dict):
        raise BadInput(f"malformed sagaworker envelope {env!r}: expected a dict "
                       "with saga_id and seq; enqueue tools with saga.enqueue()")
    saga_id, seq = env.get("saga_id"), env.get("seq")
    if not isinstance(saga_id, str) or not isinstance(seq, int) or isinstance(seq, bool):
        raise BadInput(f"malformed sagaworker envelope {env!r}: saga_id must be a str "
                       "and seq an int")
    return saga_id, seq


class Heartbeat:
    """Keeps the leases of running attempts and undos fresh, so a long tool or undo is
    never taken for dead (and never run a second time beside itself).

    One daemon thread per process, started on first use and again after a fork (prefork
    children inherit no threads).
    """

    def __init__(self, sw: Sagaworker) -> None:
        self.sw = sw
        self.held: set[Held] = set()
        self.lock = threading.Lock()
        self.pid = 0

    def hold(self, saga_id: str, seq: int, *, undo: bool = False) -> None:
        with self.lock:
            self.held.add((saga_id, seq, undo))
            if self.pid != os.getpid():
                self.pid = os.getpid()
                threading.Thread(target=self._beat, daemon=True,
                                 name="sagaworker-heartbeat").start()

    def drop(self, saga_id: str, seq: int, *, undo: bool = False) -> None:
        with self.lock:
            self.held.discard((saga_id, seq, undo))

    def _beat(self) -> None:
        lease = self.sw.settings.lease_seconds
        me = os.getpid()
        while self.pid == me:
            time.sleep(max(lease / 3, 0.2))
            with self.lock:
                held = sorted(self.held)
            if held:
                try:
                    self.sw.transitions.heartbeat(held, worker_id(), lease)
                except Exception as exc:  # the next beat tries again
                    log.warning("heartbeat_failed", error=str(exc)[:200])
