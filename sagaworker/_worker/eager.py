"""Eager flow steps: the worker that advances a flow runs the next step itself.

When a worker journals a flow step's EXECUTED, it replays the flow at once; if the replay
asks for a step of a queue this worker consumes, that step is journaled (INTENT) but not
published, and run here, in the slot the finished step frees: claimed, run and journaled
exactly as a delivered message would be (the same compare-and-sets, the same lease), with
no broker round trip. A kill at any point leaves it where the journal says: an INTENT
never claimed is published by the outbox relay, a claimed attempt whose lease lapsed is
delivered again by the sweeper (the claim decides: re-run an idempotent tool, or in
doubt), an outcome whose advance was lost is advanced again by the sweeper.

A step is run eagerly only where that changes nothing a Celery user configured: its tool
has no Celery retries (``autoretry_for``), no time limit and no rate limit (the worker
enforces those on messages), the message that carries the chain has no time limit, the
step waits at no gate, and the chain is short (at most ``MAX_STEPS`` steps or
``MAX_SECONDS`` seconds per delivery, so one flow never holds a slot for long). Anything
else is published as usual.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from typing import Any, Protocol

import structlog
from celery._state import _task_stack  # what celery.current_task reads
from kombu.utils.json import dumps, loads

from .._base.registry import ToolSpec
from .._journal.reads import NewEntry
from .._machine.machine import Claim, Start
from .._machine.pgfast import Claimed
from .._observe import process as _process
from .._observe.logging import get_logger
from .._runtime import Runtime
from .failures import Failures

__all__ = ["MAX_SECONDS", "MAX_STEPS", "Advance", "Eager", "EagerRetry", "Runner", "brief"]

log = get_logger()
#: a flow's advance: its saga id, and which of the new steps this worker keeps to run
Advance = Callable[..., Any]
MAX_STEPS = 32
MAX_SECONDS = 10.0


class EagerRetry(Exception):
    """An eager step's tool asked Celery for a retry: the step goes to the broker (it had
    no message of its own to retry), where Celery's retries apply, due in ``delay``
    seconds (the retry's countdown, journaled before the hand-over)."""

    def __init__(self, tool: str, delay: float = 0.0) -> None:
        super().__init__(tool)
        self.delay = delay


class Runner(Protocol):
    """What eager steps need of the executor."""

    rt: Runtime
    advance: Advance | None
    failures: Failures

    def run_step(self, spec: ToolSpec, saga_id: str, seq: int, task_id: str,
                 args: Sequence[Any], kwargs: dict[str, Any], *, eager: bool = False,
                 claimed: tuple[str, Claim] | None = None) -> bool: ...

    def secrets(self, spec: ToolSpec, args: Any, kwargs: Any
                ) -> tuple[frozenset[str], list[str]]: ...


class Eager:
    """Carries a flow on from the worker that journaled one of its outcomes."""

    def __init__(self, executor: Runner) -> None:
        self.x = executor
        #: the queues this worker process consumes; None outside a worker
        self.consuming: frozenset[str] | None = None

    def carry(self, saga_id: str, *, carrier: Any = None) -> None:
        """Advance the flow; while the advance hands this worker a step, run it and
        advance again. ``carrier``: the Celery task whose delivery this runs in."""
        advance = self.x.advance
        if advance is None:
            return
        until = time.monotonic() + MAX_SECONDS
        open_ = self.consuming is not None and self.x.rt.settings.eager_steps and not (
            carrier is not None and _limited(carrier))
        for n in range(MAX_STEPS + 1):
            keep = open_ and n < MAX_STEPS and time.monotonic() < until
            try:
                held = advance(saga_id, hold=self._one() if keep else None)
            except Exception as exc:
                log.error("flow_advance_failed", saga_id=saga_id, error=brief(exc))
                return
            if not held or not self._run(saga_id, *held[0], carrier=carrier):
                return

    def _one(self) -> Callable[[NewEntry], bool]:
        """Keeps the first of the new steps that this worker may run (one slot: this)."""
        kept: list[NewEntry] = []

        def hold(e: NewEntry) -> bool:
            if kept or not self.eligible(e):
                return False
            kept.append(e)
            return True

        return hold

    def eligible(self, e: NewEntry) -> bool:
        x = self.x
        spec = x.rt.registry.tool(e.tool_name)
        if spec is None or e.gated or self.consuming is None:
            return False
        task = spec.task
        conf = task.app.conf
        if (getattr(task, "autoretry_for", None) or task.time_limit or task.soft_time_limit
                or task.rate_limit or conf.task_time_limit or conf.task_soft_time_limit
                or conf.task_default_rate_limit):
            return False
        return x.rt.bus.queue_of(e.tool_name, e.queue) in self.consuming

    def _run(self, saga_id: str, seq: int, e: NewEntry, *, carrier: Any = None) -> bool:
        """Run one held step here: True when it is EXECUTED and its flow to advance."""
        spec = self.x.rt.registry.tool(e.tool_name)
        if spec is None:  # (eligible() saw it registered)
            return False
        # the arguments as a message would carry them (Celery's JSON), so a tool sees the
        # same values however its step reached it
        args, kwargs = loads(dumps([e.args, e.kwargs]))  # type: ignore[no-untyped-call]
        with structlog.contextvars.bound_contextvars(saga_id=saga_id, seq=seq, tool=spec.name,
                                                     task_id=e.task_id, eager=True):
            # claimed with its INTENT (one statement), or claimed now as any delivery is
            claimed = None if e.claim is None or not e.claim.done else (
                e.claim.token, Claim(Start.RUN, attempt=1, row=Claimed(
                    1, e.args_digest, trace_context=e.trace_context)))
            entered = False  # run_step took the step over: it releases or journals it
            try:
                if claimed is not None and not self._still_held(saga_id, seq, e):
                    return False
                with self._as_delivered(spec, e.task_id, args, kwargs, carrier):
                    entered = True
                    return self.x.run_step(spec, saga_id, seq, e.task_id, args, kwargs,
                                           eager=True, claimed=claimed)
            except EagerRetry as retry:
                # as Celery's first retry: the delivery counts it against max_retries
                sent = self.x.rt.bus.publish_step(saga_id, seq, spec.name, list(args), kwargs,
                                                  e.task_id, e.queue, retries=1,
                                                  countdown=retry.delay)
                log.info("eager_step_retried", published=sent, detail="the tool asked for "
                         "a retry: its step goes through the broker, where Celery retries")
                return False
            except Exception as exc:  # the journal holds where it stopped: recovery takes it
                if claimed is not None and not entered:  # claimed, its tool never called
                    self.x.failures.unstarted(saga_id, seq, claimed[0], exc)
                log.error("eager_step_interrupted", error=brief(exc),
                          detail="the relay or the sweeper sends the step from the journal")
                return False

    def _still_held(self, saga_id: str, seq: int, e: NewEntry) -> bool:
        """A claim taken with its INTENT long before the run (the advance stalled, say on a
        broker blocking its publishes) may have lapsed and been taken by a delivery the
        sweeper sent: past half its lease, the run goes on only if the claim is still
        this one's (its lease renewed by token), else it is left to that delivery."""
        claim = e.claim
        assert claim is not None
        if time.monotonic() - claim.at <= claim.lease / 2:
            return True
        if self.x.rt.machine.heartbeat([(saga_id, seq, False, claim.token)]):
            return True
        log.warning("eager_claim_lost", detail="its claim lapsed before it ran here and "
                    "another delivery holds it: not run here")
        return False

    @contextmanager
    def _as_delivered(self, spec: ToolSpec, task_id: str, args: Sequence[Any],
                      kwargs: dict[str, Any], carrier: Any) -> Iterator[None]:
        """As for a delivered step: its secret values are scrubbed from every log line
        while it runs, and Celery's current task is the step's own (its id, arguments and
        retry count; the carrier's worker; the carrier as its parent), not the carrier."""
        parent = getattr(carrier, "request", None)
        key = f"{task_id}#eager"  # apart from a delivery of the same step in this process
        with ExitStack() as stack:
            _process.hold(key, self._secrets(spec, args, kwargs))
            stack.callback(_process.release, key)
            _task_stack.push(spec.task)
            stack.callback(_task_stack.pop)
            spec.task.push_request(
                id=task_id, args=list(args), kwargs=kwargs, retries=0, called_directly=False,
                sagaworker_eager=True, hostname=getattr(parent, "hostname", None),
                parent_id=getattr(parent, "id", None),
                root_id=getattr(parent, "root_id", None) or getattr(parent, "id", None))
            stack.callback(spec.task.pop_request)
            yield

    def _secrets(self, spec: ToolSpec, args: Sequence[Any], kwargs: dict[str, Any]) -> list[str]:
        try:
            return self.x.secrets(spec, args, kwargs)[1]
        except Exception as exc:  # never leave a claimed step unrun over it
            log.warning("redaction_values_unavailable", error=type(exc).__name__)
            return []


def brief(exc: BaseException) -> str:
    """An error for a log line: its type and first line. A database error's text goes on
    with its statement and parameters (a tool's arguments), which must not be logged."""
    lines = str(getattr(exc, "orig", None) or exc).splitlines()
    return f"{type(exc).__name__}: {lines[0] if lines else ''}"[:300]


def _limited(task: Any) -> bool:
    """The delivery ``task`` runs in has a time limit (the chain must not outlive it)."""
    limits = getattr(task.request, "timelimit", None) or (None, None)
    return bool(any(limits) or task.time_limit or task.soft_time_limit)
