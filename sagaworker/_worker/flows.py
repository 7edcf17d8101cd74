"""Durable flows: sagas whose steps the workers carry forward from the journal.

A worker *replays* the flow function from the top each time an awaited step has an
outcome: a call already in the journal returns its journaled result at once; the first
call beyond the journal journals that step's INTENT (a compare-and-set on the saga's last
seq, so two replays never journal a step twice) and publishes it, and the replay stops
there. The worker that journals a step's EXECUTED replays the flow right away (no message,
no polling); the sweeper re-sends an advance that was lost with a worker.
"""

from __future__ import annotations

import inspect
import threading
from collections.abc import Callable
from typing import Any

import structlog
from sqlalchemy.exc import IntegrityError

from .._base.canonical import (
    bad_argument,
    canonical_args,
    check_json,
    check_size,
    oversize,
)
from .._base.errors import (
    BadInput,
    ConfigurationError,
    SagaworkerError,
)
from .._base.patches import PatchMarker
from .._base.types import OPEN, Phase, SagaStatus
from .._journal.app_tx import AppTx
from .._journal.reads import NewEntry
from .._machine.divergence import held, release
from .._observe import process as _process
from .._observe import tracing
from .._observe.logging import get_logger
from .._observe.redact import scrub_text, secret_values
from .._producer.producer import Hold, Producer
from .._producer.saga import saga_secrets
from .._runtime import Runtime
from .reach import reaches
from .replay import FlowContext, FlowHandle, FlowSpec, Replay, replay

__all__ = ["FlowContext", "FlowHandle", "FlowSpec", "Flows", "flow_name", "unknown_flow"]

log = get_logger()
_RESERVED = ("metadata", "deadline")
_ON_DIVERGENCE = ("hold", "compensate")
#: replays in one advance that journal only patch markers (each is one more position)
_MARKER_ROUNDS = 100
_PENDING = (Phase.INTENT, Phase.AWAITING_APPROVAL)  # a step without an outcome yet
#: the status of an advance's span when the replay fails its saga
_TRACED_ERRORS = {"diverged": "the flow diverged from its journal",
                  "raised": "the flow raised: its saga fails"}


def flow_name(fn: Callable[..., Any], name: str | None) -> str:
    """Check a flow function can be imported by name by every worker; its name."""
    qual = getattr(fn, "__qualname__", "")
    if getattr(fn, "__name__", "") == "<lambda>" or "<locals>" in qual:
        raise ConfigurationError(
            f"flow {qual or fn!r} is a lambda or a nested function; declare flows at module "
            "level (every worker imports a flow by its name)")
    params = list(inspect.signature(fn).parameters.values())
    if not params:
        raise ConfigurationError(
            f"flow {qual} takes no arguments; its first parameter is the FlowContext, e.g. "
            f"def {fn.__name__}(s: FlowContext, ...)")
    for p in params[1:]:
        if p.name in _RESERVED:
            raise ConfigurationError(
                f"flow {qual} has a parameter named {p.name!r}, which sw.start() takes for "
                "itself; rename the parameter")
    return name or f"{fn.__module__}.{qual}"


def unknown_flow(name: str) -> str:
    """What a worker that does not know a flow says: where the flow lives, how to fix."""
    module = name.rsplit(".", 1)[0] if "." in name else "its module"
    return (f"this worker does not know flow {name!r}; import {module} from the worker's -A "
            "module (or list it in Celery's include=) so every worker registers it; the "
            "sweeper sends the advance again")


class Flows:
    """The registry of flows and the replay that advances them."""

    def __init__(self, rt: Runtime, producer: Producer, app: Any = None) -> None:
        self.rt = rt
        self.producer = producer
        self.app = app  # the Celery app: whose -A module a worker imports
        self.heartbeat: Any = None  # the worker's (Executor's): a running unit's lease
        self.specs: dict[str, FlowSpec] = {}
        self._reach_checked: set[str] = set()

    def add(self, fn: Callable[..., Any], name: str | None,
            on_divergence: str = "hold") -> FlowSpec:
        if on_divergence not in _ON_DIVERGENCE:
            raise ConfigurationError(
                f"on_divergence={on_divergence!r}: give 'hold' (the default: a diverged saga "
                "waits for a fixed deploy and `sagaworker flows resume`) or 'compensate'")
        spec = FlowSpec(flow_name(fn, name), fn, on_divergence)
        known = self.specs.get(spec.name)
        if known is not None and known.fn is not fn:
            raise ConfigurationError(f"two flows are named {spec.name!r}; pass name=... to one")
        self.specs[spec.name] = spec
        return spec

    def spec_of(self, flow: Any) -> FlowSpec:
        for spec in self.specs.values():
            if spec.fn is flow or spec.name == flow:
                return spec
        raise ConfigurationError(
            f"{getattr(flow, '__qualname__', flow)!r} is not a registered flow; decorate it "
            "with @sw.flow() and pass the decorated function")

    def validate(self) -> None:
        """Every flow is still importable by its name (every worker imports it so)."""
        import importlib

        for spec in self.specs.values():
            fn = spec.fn
            try:
                obj: Any = importlib.import_module(fn.__module__)
                for part in fn.__qualname__.split("."):
                    obj = getattr(obj, part)
            except (ImportError, AttributeError) as exc:
                raise ConfigurationError(
                    f"flow {spec.name!r} cannot be imported by its name ({exc}); declare it at "
                    "module level in a module every worker imports") from exc

    def start(self, saga_id: str, flow: Any, args: tuple[Any, ...], kwargs: dict[str, Any],
              metadata: dict[str, Any] | None, deadline: float | None,
              tx: AppTx | None = None) -> str | None:
        """Journal a flow saga (in its start span, traced: its context, returned, is
        journaled with it) and send its first advance."""
        spec = self.spec_of(flow)
        self._check_reach(spec)
        sig = inspect.signature(spec.fn)
        try:
            sig.bind(None, *args, **kwargs)
        except TypeError as exc:
            raise BadInput(f"malformed arguments for flow {spec.name!r}: {exc}") from exc
        bad = bad_argument(sig.replace(parameters=list(sig.parameters.values())[1:]),
                           args, kwargs)
        if bad is not None:
            check_json([args, kwargs], f"the arguments of flow {spec.name!r} ({bad})")
        check_size(canonical_args(args, kwargs), f"the arguments of flow {spec.name!r}",
                   self.rt.settings.max_args_bytes)
        with tracing.span("saga start", root=True, saga_id=saga_id,
                          flow=spec.name) as s:
            self.rt.machine.create_saga(saga_id, dict(metadata or {}), deadline=deadline,
                                        flow=spec.name, flow_args=list(args),
                                        flow_kwargs=dict(kwargs), tx=tx,
                                        trace_context=s.carrier)
            if tx is None:
                self.rt.bus.send_advance(saga_id)
            else:  # once the caller's transaction committed (else the sweeper advances it)
                tx.after_commit(lambda: self._send_advance(saga_id, s.carrier),
                                saga_id=saga_id)
        return s.carrier

    def _check_reach(self, spec: FlowSpec) -> None:
        """Once per flow: warn when a worker on the app's module would not import it."""
        if spec.name in self._reach_checked:
            return
        self._reach_checked.add(spec.name)
        module = spec.fn.__module__
        if self.app is not None and reaches(self.app, module) is False:
            log.warning("flow_not_imported_by_app", flow=spec.name,
                        detail=f"a worker started with -A {self.app.main} does not import "
                               f"{module}: it will not know this flow (flow_unknown); import "
                               f"{module} from {self.app.main} or list it in Celery's "
                               "include=")

    def _send_advance(self, saga_id: str, carrier: str | None) -> None:
        with tracing.within(carrier):
            self.rt.bus.send_advance(saga_id)

    # -- the replay -----------------------------------------------------------------------

    def advance(self, saga_id: str, hold: Hold | None = None) -> list[tuple[int, NewEntry]]:
        """Replay the flow from the journal and move it on; idempotent. The next steps
        ``hold`` keeps are journaled but not published: returned, for the caller (the
        worker) to run them itself (eager steps)."""
        with structlog.contextvars.bound_contextvars(saga_id=saga_id):
            return self._advance(saga_id, hold)

    def _advance(self, saga_id: str, hold: Hold | None,
                 rounds: int = 0) -> list[tuple[int, NewEntry]]:
        j = self.rt.journal
        saga, rows = j.saga_and_entries(saga_id)
        if saga is None or saga.flow is None:
            return []
        if SagaStatus(saga.status) not in OPEN or saga.fail_requested_at is not None:
            return []  # failures end the flow: compensation runs, the flow is not advanced
        spec = self.specs.get(saga.flow)
        if spec is None:
            log.error("flow_unknown", flow=saga.flow, detail=unknown_flow(saga.flow))
            return []
        # traced: a child of the saga's start span, whichever message or worker advanced it
        with tracing.span(f"advance {spec.name}", parent=saga.trace_context, saga_id=saga_id,
                          flow=spec.name) as s:
            # while the flow's code runs, its redacted arguments are scrubbed from every
            # log line of this process, as a running tool's are (its own logging and
            # print(), and a model SDK's logging inside it)
            held = f"flow:{saga_id}:{threading.get_ident()}"
            _process.hold(held, self._secrets(spec, saga))
            try:
                run = replay(self.rt, self.producer, spec, saga, rows, live=True,
                             heartbeat=self.heartbeat)
            finally:
                _process.release(held)
            # (no text of the flow's in the status: its reason may quote a secret)
            s.outcome(run.kind, _TRACED_ERRORS.get(run.kind) if not run.ctx.from_journal(
                run.error) else None)
            if saga.divergence is not None and run.kind != "diverged" and release(j, saga_id):
                log.info("flow_divergence_resolved", flow=spec.name,
                         detail="the flow replays its journal again; it moves on")
            kept = self._move(spec, saga, rows, run, hold) or []
        if (run.kind == "waits" and run.ctx.new and not kept and rounds < _MARKER_ROUNDS
                and all(isinstance(t, PatchMarker) for t, _, _ in run.ctx.new)):
            return self._advance(saga_id, hold, rounds + 1)  # only markers: nothing awaited
        return kept

    def _move(self, spec: FlowSpec, saga: Any, rows: list[Any], run: Replay,
              hold: Hold | None = None) -> list[tuple[int, NewEntry]] | None:
        """Act on what a replay came to: journal its next steps, or fail, or complete."""
        j, saga_id = self.rt.journal, saga.saga_id
        # what this replay read: the sweeper re-sends the advance while more steps have an
        # outcome than that (an outcome journaled after the read, its advance lost)
        seen = sum(Phase(r.phase) not in _PENDING for r in rows)
        if run.kind == "waits":
            # journaling the next steps also records ``seen`` (one transaction); a replay
            # that only waits on a running step or a gate records it alone
            if run.ctx.new:  # (a patch marker is an outcome the moment it is journaled)
                seen += sum(isinstance(t, PatchMarker) for t, _, _ in run.ctx.new)
                return self._journal_new(saga_id, run.ctx, run.ctx.last_seq, seen, hold)
            j.mark_advanced(saga_id, seen)
            return None
        if run.kind == "diverged":
            self._diverged(spec, saga, run, seen)
            return None
        if run.kind == "raised":
            exc = run.error
            if run.ctx.from_journal(exc):
                return None  # that step's failure already fails the saga
            what = (f"{type(exc).__name__}: {exc}" if isinstance(exc, SagaworkerError)
                    else f"the flow raised {type(exc).__name__}: {exc}")
            self._fail(saga_id, self._scrubbed(spec, saga, what))
            return None
        value = run.value
        try:
            what = f"the return value of flow {spec.name!r}"
            too_large = oversize(check_json(value, what), self.rt.settings.max_result_bytes)
            if too_large is not None:  # every reader would be served it
                raise BadInput(f"{what} is {too_large}; nothing was journaled")
        except BadInput as exc:
            self._fail(saga_id, str(exc))
            return None
        if any(Phase(r.phase) in _PENDING for r in rows):
            j.mark_advanced(saga_id, seen)
            return None  # an enqueued step still runs: its outcome advances the flow again
        try:
            self.rt.machine.complete(saga_id, result=value, expect_seq=run.ctx.last_seq)
        except SagaworkerError as exc:
            log.info("flow_not_completed", detail=str(exc))
            return None
        log.info("saga_completed", flow=spec.name)
        return None

    def _diverged(self, spec: FlowSpec, saga: Any, run: Replay, seen: int) -> None:
        """Held: nothing journaled, nothing run, nothing undone; paged once per divergence
        (before it is recorded: a worker lost in between pages again rather than never);
        the sweeper replays it again every SAGAWORKER_DIVERGED_RETRY. Failed instead, for a
        flow declared ``on_divergence="compensate"``. Not held when the journal holds a
        patch marker this code never asks for: newer code wrote it (a rolling deploy), and
        a worker running that code moves it on (the sweeper re-sends the advance)."""
        j, saga_id, d = self.rt.journal, saga.saga_id, run.divergence
        detail = self._scrubbed(spec, saga, run.detail)
        if spec.on_divergence == "compensate":
            self._fail(saga_id, detail, event="flow_diverged")
            return
        if d is not None and d.newer:
            log.warning("flow_newer_than_code", flow=spec.name, seq=d.seq, detail=detail,
                        resolve="a worker running the code that journaled the patch "
                                "advances it; finish the deploy")
            return
        if saga.divergence != detail:
            log.error("flow_diverged", flow=spec.name, seq=run.divergence_seq,
                      detail=detail, held=True,
                      journaled=self._scrubbed(spec, saga, d.journaled) if d else None,
                      asked=self._scrubbed(spec, saga, d.asked) if d else None,
                      resolve=f"deploy code that replays the journal (a rollback, or "
                              f"s.patched(...)), then `sagaworker flows resume {saga_id}`; "
                              f"or `sagaworker abort {saga_id} --reason R` to compensate")
        held(j, saga_id, detail, run.ctx.last_seq)
        j.mark_advanced(saga_id, seen)

    def _journal_new(self, saga_id: str, ctx: FlowContext, last_seq: int, seen: int,
                     hold: Hold | None = None) -> list[tuple[int, NewEntry]]:
        try:
            # journaled only if the journal is still what this replay saw (last_seq)
            done = self.producer.enqueue(saga_id, ctx.new, expect_seq=last_seq, seen=seen,
                                         hold=hold)
        except BadInput as exc:
            self._fail(saga_id, str(exc))
            return []
        except SagaworkerError as exc:
            log.info("flow_not_advanced", detail=str(exc))
            return []
        except IntegrityError:
            # (a race journals nothing: the saga's last seq guards the write) what the
            # replay asked for breaks a rule of the journal's: the same on every advance,
            # so that saga's bad move, never retried as a blip (nor quoted: it is SQL)
            self._fail(saga_id, "the flow asked for steps the journal refuses (a tool-call "
                                "id it holds already): fix the flow or the agent's tools")
            return []
        return [(seq, e) for seq, e in done if e.held]

    def _secrets(self, spec: FlowSpec, saga: Any) -> list[str]:
        """The values of the flow's redacted parameters in this saga."""
        keys = self.rt.settings.redact_keys
        if not keys:
            return []
        return secret_values(inspect.signature(spec.fn), [None, *(saga.flow_args or [])],
                             saga.flow_kwargs or {}, keys)

    def _scrubbed(self, spec: FlowSpec, saga: Any, text: str) -> str:
        """An error the flow's code raised, without the values of its redacted parameters
        nor of its steps' (the reason is journaled and logged)."""
        values = self._secrets(spec, saga)
        if not self.rt.settings.redact_keys:
            return text
        # and its steps' (the flow may hand a secret to a tool under another name)
        return scrub_text(text, sorted({*values, *saga_secrets(self.rt, saga.saga_id)},
                                       key=len, reverse=True))

    def _fail(self, saga_id: str, reason: str, *, event: str | None = None) -> None:
        if event == "flow_diverged":
            log.error(event, detail=reason)
        try:
            self.producer.fail(saga_id, reason)
        except SagaworkerError as exc:
            log.info("flow_fail_refused", detail=str(exc))
