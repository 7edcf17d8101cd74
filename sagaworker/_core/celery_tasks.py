"""sagaworker's own Celery tasks, one small function each (as Celery's builtins are):
the failure handler, the compensation chain, a flow's advance, the sweeper, the orphan
report and retention. They run on the ``sagaworker`` queue with late acks."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any, Protocol

import structlog
from celery import Celery
from celery.exceptions import Reject

from .._base.canonical import unstorable
from .._base.settings import Settings
from .._journal.retention import prune
from .._observe.logging import get_logger
from .._observe.process import active_values
from .._observe.sanitize import celery_safe
from .._recovery.compensation import Compensator
from .._recovery.sweeper import Sweeper
from .._runtime import Runtime
from .._worker.execution import Executor
from .._worker.flows import Flows

__all__ = ["register_tasks"]

log = get_logger()


class Parts(Protocol):
    """What the internal tasks call."""

    rt: Runtime
    compensator: Compensator
    flows: Flows
    sweeper: Sweeper
    executor: Executor

    @property
    def settings(self) -> Settings: ...


def _options(parts: Parts) -> dict[str, Any]:
    # shared=False: Celery would otherwise hand these tasks, bound to this Sagaworker, to
    # every other app finalized in the process. No queue=: Celery 6 drops the task
    # attribute; the sagaworker queue is their route (celery_config's task_routes)
    return {"acks_late": True, "reject_on_worker_lost": True, "ignore_result": True,
            "shared": False}


def _context(task: Any) -> AbstractContextManager[Any]:
    return structlog.contextvars.bound_contextvars(task_id=task.request.id,
                                                   worker=task.request.hostname)


def _saga_id(task: Any, saga_id: Any, reason: Any = None, extra: Any = ()) -> str:
    """The message's saga id, or a poison message: dead-lettered (rejected, not requeued),
    never acked and lost, and never retried. ``extra``: arguments the task does not take
    (each task takes its saga id as a default, so a message without one is seen here,
    not failed by Celery's call and acked)."""
    good_id = isinstance(saga_id, str) and saga_id and unstorable(saga_id) is None
    if good_id and not extra and (reason is None or isinstance(reason, str)):
        return str(saga_id)
    bad = (f"arguments hold {len(extra)} more than it takes" if good_id and extra else
           f"reason is a {type(reason).__name__}" if good_id else
           "saga id is missing" if saga_id is None and not extra else
           f"saga id {saga_id!r:.80} is not a saga id")
    msg = (f"malformed {task.name} message: its {bad}; dead-lettered (fail a saga with "
           "sw.get(saga_id).fail(reason) or `sagaworker abort`)")
    log.error("bad_message", error=msg)
    raise Reject(msg, requeue=False)


def _safe(parts: Parts, call: Callable[[], Any]) -> Any:
    """``call()``, an exception handed to Celery only as a redacted copy (its events show
    it): the secret values held for this task (an undo chain's arguments) scrubbed out."""
    return celery_safe(call, parts.settings.redact_keys, active_values)


def add_saga_failed(app: Celery, parts: Parts) -> Any:
    @app.task(name="sagaworker.saga_failed", bind=True, **_options(parts))  # type: ignore[untyped-decorator]
    def saga_failed(self: Any, saga_id: Any = None, reason: Any = None, *extra: Any,
                    **unknown: Any) -> None:
        with _context(self):
            sid = _saga_id(self, saga_id, reason, (*extra, *unknown))
            _safe(parts, lambda: parts.compensator.handle_failure(sid, reason))

    return saga_failed


def add_compensate(app: Celery, parts: Parts) -> Any:
    @app.task(name="sagaworker.compensate", bind=True, **_options(parts))  # type: ignore[untyped-decorator]
    def compensate(self: Any, saga_id: Any = None, *extra: Any, **unknown: Any) -> None:
        with _context(self):
            sid = _saga_id(self, saga_id, None, (*extra, *unknown))
            _safe(parts, lambda: parts.compensator.run_chain(sid))

    return compensate


def add_advance(app: Celery, parts: Parts) -> Any:
    @app.task(name="sagaworker.advance", bind=True, **_options(parts))  # type: ignore[untyped-decorator]
    def advance(self: Any, saga_id: Any = None, *extra: Any, **unknown: Any) -> None:
        with _context(self):
            sid = _saga_id(self, saga_id, None, (*extra, *unknown))
            # the advance may run the flow's next step here (eager steps)
            _safe(parts, lambda: parts.executor.eager.carry(sid, carrier=self))

    return advance


def add_sweep(app: Celery, parts: Parts) -> Any:
    @app.task(name="sagaworker.sweep", **_options(parts))  # type: ignore[untyped-decorator]
    def sweep() -> None:
        _safe(parts, parts.sweeper.sweep)

    return sweep


def add_orphans(app: Celery, parts: Parts) -> Any:
    @app.task(name="sagaworker.orphans", **_options(parts))  # type: ignore[untyped-decorator]
    def orphans() -> None:
        _safe(parts, parts.sweeper.log_orphans)

    return orphans


def add_prune(app: Celery, parts: Parts) -> Any:
    @app.task(name="sagaworker.prune", **_options(parts))  # type: ignore[untyped-decorator]
    def prune_journal() -> int:
        days = parts.settings.retention_days
        return 0 if not days else int(_safe(parts, lambda: prune(parts.rt.journal,
                                                                  days * 86400.0)))

    return prune_journal


BUILTINS: dict[str, Callable[[Celery, Parts], Any]] = {
    "saga_failed": add_saga_failed, "compensate": add_compensate, "advance": add_advance,
    "sweep": add_sweep, "orphans": add_orphans, "prune": add_prune}


def register_tasks(app: Celery, parts: Parts) -> dict[str, Any]:
    """Every internal task on ``app``, by its short name."""
    return {name: add(app, parts) for name, add in BUILTINS.items()}
