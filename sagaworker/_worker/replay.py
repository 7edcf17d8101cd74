"""A flow's replay: its function run from the top against its journal, writing nothing.

``FlowContext`` answers each ``call``/``enqueue`` from the journal position by position;
the first step beyond the journal stops the replay (``_Suspend``), a step that differs
from the journal's is a divergence (``_Diverged``). ``replay`` says what the run came to;
the worker (``Flows``) and ``sagaworker.testing`` act on it.
"""

from __future__ import annotations

import hashlib
import inspect
from collections.abc import Awaitable, Callable, Sequence
from contextvars import ContextVar
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

from .._base import digests
from .._base.awaiting import settle
from .._base.errors import ApprovalRejected, ToolFailed
from .._base.patches import PatchMarker, patch_id
from .._base.types import Phase
from .._base.units import MODEL_REQUEST, Unit, unit_input, unit_kind
from .._producer.producer import Producer
from .._runtime import Runtime
from .shown import describe, show_call
from .signals import _Diverged, _Suspend
from .units import Units

__all__ = ["FlowContext", "FlowHandle", "FlowSpec", "Replay", "current_flow", "replay"]

#: the flow context of the replay running in this task (agents' durability reads it)
current_flow: ContextVar[FlowContext | None] = ContextVar("sagaworker_flow", default=None)
_PENDING = (Phase.INTENT.value, Phase.AWAITING_APPROVAL.value)
#: the longest call id the journal holds
_CALL_KEY_MAX = 200


@dataclass(frozen=True)
class FlowSpec:
    name: str
    fn: Callable[..., Any]
    #: what a diverged replay does: "hold" the saga (the default) or "compensate" it
    on_divergence: str = "hold"


@dataclass
class FlowHandle:
    """A step enqueued by a flow; ``FlowContext.gather`` awaits it."""

    position: int


class FlowContext:
    """What a flow function is handed: ``call``, ``enqueue``, ``gather``."""

    def __init__(self, saga_id: str, metadata: dict[str, Any], journal: list[Any],
                 producer: Producer, is_async: bool = False, *, last_seq: int = 0,
                 live: bool = False) -> None:
        self.saga_id = saga_id
        #: the saga's last seq as this replay knows it (its own durable units move it on)
        self.last_seq = last_seq
        #: a worker's replay, which may journal and run durable units; else a read-only one
        #: (``flows check``, ``sagaworker.testing``) that stops where a unit would run
        self.live = live
        self._runs: dict[str, int] = {}
        #: an ``async def`` flow's: ``call`` and ``gather`` are awaited
        self.is_async = is_async
        self.metadata = metadata
        self._journal = journal
        self._producer = producer
        self._cursor = 0
        #: steps asked for beyond the journal, journaled together when the replay stops
        self.new: list[tuple[Any, tuple[Any, ...], dict[str, Any]]] = []
        #: failures raised from the journal (their step's move failed the saga already)
        self.journaled_failures: list[ToolFailed] = []
        self._patches: set[str] = set()
        #: the framework tool-call ids this replay met, with how often (``call_key``)
        self._call_ids: dict[str, int] = {}
        #: the durable units this replay runs (each to its outcome)
        self._units = Units(saga_id, producer, self._journaled)

    def call(self, tool: Any, /, *args: Any, **kwargs: Any) -> Any:
        """The step's journaled result (its saga waits, with no thread, until there is one);
        in an ``async def`` flow, awaited: ``await s.call(...)``."""
        handle = self.enqueue(tool, *args, **kwargs)
        if self.is_async:
            return self._one(handle)
        return self._results((handle,))[0]

    async def _one(self, handle: FlowHandle) -> Any:
        return self._results((handle,))[0]

    async def _all(self, handles: tuple[FlowHandle, ...]) -> list[Any]:
        return self._results(handles)

    def enqueue(self, tool: Any, /, *args: Any, **kwargs: Any) -> FlowHandle:
        """A step that runs beside the next ones until ``gather`` awaits it."""
        spec = self._producer.resolve(tool)  # (not a tool: raised at this position)
        pos = self._cursor
        self._cursor += 1
        if pos < len(self._journal):
            row = self._journal[pos]
            # (the journal's digest is keyed when its values are sealed: the same key's)
            if row.tool_name != spec.name or not digests.matches(
                    self._producer.rt.cipher, row.args_digest, list(args), kwargs,
                    clear_ok=True):
                shown = show_call(self._producer.rt, spec.name, list(args), kwargs)
                asked = f"{spec.name}{shown}"
                raise self._diverged(row, asked, f"asked for {asked}")
        else:
            self.new.append((tool, args, kwargs))
        return FlowHandle(pos)

    def patched(self, change_id: str) -> bool:
        """Whether this saga takes the code path of change ``change_id``: True where it
        reaches this point under code that has it (a marker is journaled here, the first
        time) or its journal holds the marker here; False where its journal, written
        before the change, holds the older code's step here."""
        marker = self._patch(change_id)
        pos = self._cursor
        if pos < len(self._journal):
            if patch_id(self._journal[pos].tool_name) != change_id:
                return False  # the position holds what older code journaled
            self._cursor += 1
            return True
        self._cursor += 1
        self.new.append((marker, (), {}))
        return True

    def deprecate_patch(self, change_id: str) -> None:
        """Change ``change_id`` is in every saga's code path now: a marker journaled here
        by ``patched`` is accepted, none is journaled (the old branch can go)."""
        self._patch(change_id)
        pos = self._cursor
        if pos < len(self._journal) and patch_id(self._journal[pos].tool_name) == change_id:
            self._cursor += 1

    def _patch(self, change_id: str) -> PatchMarker:
        marker = PatchMarker(change_id)  # (a change id that cannot be journaled: BadInput)
        if change_id in self._patches:
            row = self._journal[self._cursor] if self._cursor < len(self._journal) else None
            raise _Diverged(
                row.seq if row is not None else self._cursor + 1,
                describe(self._producer.rt, row) if row is not None else "nothing",
                f"patch {change_id!r} again",
                f"flow diverged at step {row.seq if row is not None else self._cursor + 1}: "
                f"the replay asked for patch {change_id!r} twice (one patch id marks one "
                "change: give each s.patched(...) its own id)")
        self._patches.add(change_id)
        return marker

    def _diverged(self, row: Any, asked: str, did: str) -> _Diverged:
        held = describe(self._producer.rt, row)
        change = patch_id(row.tool_name)
        return _Diverged(row.seq, held, asked,
                         f"flow diverged at step {row.seq}: the journal holds {held}, the "
                         f"replay {did}", newer=change is not None
                         and change not in self._patches)

    def gather(self, *handles: FlowHandle) -> Any:
        """The results of the handles' steps, in the order of the handles (a list; awaited
        in an ``async def`` flow)."""
        return self._all(handles) if self.is_async else self._results(handles)

    def _results(self, handles: tuple[FlowHandle, ...]) -> list[Any]:
        out = []
        for h in handles:
            if h.position >= len(self._journal):
                raise _Suspend()
            row = self._journal[h.position]
            phase = Phase(row.phase)
            if phase is Phase.EXECUTED and row.error is None:
                out.append(row.result)
            elif phase in (Phase.INTENT, Phase.AWAITING_APPROVAL):
                raise _Suspend()
            elif phase is Phase.REJECTED:
                raise self._journaled(ApprovalRejected(
                    f"step {row.seq} ({row.tool_name}) was rejected by {row.rejected_by}: "
                    f"{row.rejection_reason}", saga_id=self.saga_id, seq=row.seq,
                    tool=row.tool_name))
            else:
                raise self._journaled(ToolFailed(
                    f"step {row.seq} ({row.tool_name}) {phase.value}: {row.error}",
                    saga_id=self.saga_id, seq=row.seq, tool=row.tool_name))
        return out

    async def unit(self, name: str, body: Callable[[], Awaitable[Any]], *,
                   idempotent: bool = True, tries: int | None = None,
                   input: str | None = None) -> Any:
        """The journaled result of durable unit ``name`` at this position: ``body`` runs
        here, once, in the replay that first reaches it (``_base.units``). ``idempotent``:
        a body whose worker was lost mid-run may run again (a model request); else that
        attempt is in doubt (section 6), as a tool's. ``tries``: a model request's tries
        in all when it fails for a passing reason (None: SAGAWORKER_MODEL_RETRIES for a
        model request, one for anything else). ``input``: a digest of what the body is
        asked with as this code gives it (a model request's prompt): a replay that finds
        another one journaled diverges ("the prompt changed at turn N")."""
        op = Unit(name, input)
        if tries is None and unit_kind(op.tool_name) == MODEL_REQUEST:
            tries = self._producer.rt.settings.model_retries
        pos = self._cursor
        self._cursor += 1
        if pos < len(self._journal):
            row = self._journal[pos]
            if row.tool_name != op.tool_name:
                raise self._diverged(row, op.tool_name, f"asked for {op.tool_name}")
            if not self._same_input(row, op):
                turn = 1 + sum(unit_kind(r.tool_name) == MODEL_REQUEST
                               for r in self._journal[:pos])
                raise self._diverged(row, op.tool_name, "asked with another input: the "
                                     f"prompt changed at turn {turn}")
            phase = Phase(row.phase)
            if phase is Phase.EXECUTED and row.error is None:
                return row.result
            if phase is not Phase.INTENT:
                return self._results((FlowHandle(pos),))  # (raises its failure)
            if not self.live:
                raise _Suspend()
            # its claim lapsed, or never was: taken over (the row, as this replay sees it)
            row = self._journal[pos] = SimpleNamespace(**dict(row._mapping))
            return await self._units.run(row, op, body, None, idempotent, tries)
        if not self.live:
            raise _Suspend()
        return await self._units.run(self._journal_unit(op), op, body, "claimed", idempotent,
                                     tries)

    def _same_input(self, row: Any, op: Unit) -> bool:
        """Whether the journaled unit was asked with ``op``'s input: true where either has
        none (a unit journaled before inputs were, or asked without one)."""
        cipher = self._producer.rt.cipher
        if op.input is None or digests.matches(cipher, row.args_digest, [op.name], {},
                                               clear_ok=True):
            return True
        return digests.matches(cipher, row.args_digest, [op.name], unit_input(op),
                               clear_ok=True)

    def _journal_unit(self, op: Unit) -> Any:
        """Journal what this replay asked for so far, then the unit, held for this worker."""
        markers = sum(isinstance(t, PatchMarker) for t, _, _ in self.new)
        seen = sum(Phase(r.phase) not in _PENDING for r in self._journal) + markers
        calls = [*self.new, (op, (), {})]
        done = self._producer.enqueue(self.saga_id, calls, expect_seq=self.last_seq,
                                      seen=seen, hold=lambda e: e.tool_name == op.tool_name)
        if not done:
            raise _Suspend()  # another replay journaled these first: it goes on
        self.new.clear()
        for seq, e in done:
            phase = Phase.EXECUTED if e.marker else Phase.INTENT
            self._journal.append(SimpleNamespace(
                seq=seq, tool_name=e.tool_name, phase=phase.value, result=None, error=None,
                args=e.args, kwargs=e.kwargs, args_digest=e.args_digest, claim=e.claim))
        self.last_seq = done[-1][0]
        return self._journal[-1]

    def call_key(self, call_id: str) -> str:
        """A framework's tool-call id as this saga journals it: unique within the saga
        (an id the model used before in this run gets its occurrence, ``#2``, ``#3``; the
        same on every replay) and at most 200 characters (a longer one keeps its start and
        a digest of the whole)."""
        n = self._call_ids[call_id] = self._call_ids.get(call_id, 0) + 1
        key = call_id if n == 1 else f"{call_id}#{n}"
        if len(key) > _CALL_KEY_MAX:
            key = f"{key[:_CALL_KEY_MAX - 41]}#{hashlib.sha256(key.encode()).hexdigest()[:40]}"
        return key

    def check(self, tool: Any, args: Sequence[Any], kwargs: dict[str, Any]) -> None:
        """Raise ``BadInput`` when this call of ``tool`` could not be journaled (arguments
        that do not fit its signature, are not JSON, use a reserved name, or are too
        large): an agent answers its model with a retry instead of failing the saga."""
        self._producer.prepare(tool, args, kwargs)

    def run_id(self, agent: str) -> str:
        """A run id for an agent run of this flow, the same on every replay."""
        n = self._runs.get(agent, 0)
        self._runs[agent] = n + 1
        return f"{self.saga_id}/{agent}/{n}"

    def _journaled(self, exc: ToolFailed) -> ToolFailed:
        self.journaled_failures.append(exc)
        return exc

    def from_journal(self, exc: BaseException | None) -> bool:
        """``exc`` came from the journal, not the flow's own (which fails the saga)."""
        return any(exc is f for f in self.journaled_failures)

    @property
    def consumed(self) -> int:
        return self._cursor


@dataclass
class Replay:
    """One run of a flow's function against its journal, writing nothing: it ``waits``
    (on a step without an outcome, or after enqueuing new ones: ``ctx.new``), ``returned``
    a value, ``raised`` an error, or ``diverged`` from the journal (``detail``)."""

    ctx: FlowContext
    kind: str
    value: Any = None
    error: BaseException | None = None
    detail: str = ""
    divergence: _Diverged | None = None

    @property
    def divergence_seq(self) -> int | None:
        return None if self.divergence is None else self.divergence.seq


def replay(rt: Runtime, producer: Producer, spec: FlowSpec, saga: Any,
           rows: list[Any], *, live: bool = False, heartbeat: Any = None) -> Replay:
    """Run the flow from the top against ``rows`` (what the worker's advance and
    ``sagaworker.testing`` both do). Asking for another tool or other arguments than the
    journal holds at a position, or returning or raising before asking for every
    journaled step, is a divergence. ``live``: a worker's replay, which runs the durable
    units it reaches (and appends them to ``rows``); else one that writes nothing."""
    is_async = inspect.iscoroutinefunction(spec.fn)
    ctx = FlowContext(saga.saga_id, dict(saga.metadata or {}), rows, producer, is_async,
                      last_seq=saga.last_seq, live=live)
    ctx._units.heartbeat = heartbeat
    token = current_flow.set(ctx)
    try:
        return _run(rt, spec, saga, rows, ctx, is_async)
    finally:
        current_flow.reset(token)


def _run(rt: Runtime, spec: FlowSpec, saga: Any, rows: list[Any], ctx: FlowContext,
         is_async: bool) -> Replay:
    try:
        value = spec.fn(ctx, *(saga.flow_args or []), **(saga.flow_kwargs or {}))
        if is_async:  # on this thread's event loop, as an async tool runs
            value = settle(ctx._units.drained(value))
    except _Suspend:
        return Replay(ctx, "waits")
    except _Diverged as exc:
        return Replay(ctx, "diverged", detail=exc.detail, divergence=exc)
    except BaseExceptionGroup as group:  # a task group in the flow (an agent's tools)
        return _grouped(ctx, rows, group)
    except Exception as exc:
        if not ctx.from_journal(exc) and not ctx.new and ctx.consumed < len(rows):
            what = f"raised {type(exc).__name__}"
            return Replay(ctx, "diverged", error=exc, **_unasked(ctx, rows[ctx.consumed], what))
        return Replay(ctx, "raised", error=exc)
    if not ctx.new and ctx.consumed < len(rows):
        return Replay(ctx, "diverged", value=value,
                      **_unasked(ctx, rows[ctx.consumed], "returned"))
    return Replay(ctx, "waits" if ctx.new else "returned", value=value)


def _grouped(ctx: FlowContext, rows: list[Any], group: BaseExceptionGroup[Any]) -> Replay:
    """What a group of the flow's tasks came to: a divergence in any of them, else a
    failure from the journal, else a wait (every task stopped at a step without an
    outcome). A group also holding the flow's own errors fails the saga, as a raise does."""
    leaves = _leaves(group)
    for exc in leaves:
        if isinstance(exc, _Diverged):
            return Replay(ctx, "diverged", detail=exc.detail, divergence=exc)
    for exc in leaves:
        if ctx.from_journal(exc):
            return Replay(ctx, "raised", error=exc)
    own = [e for e in leaves if not isinstance(e, _Suspend)]
    if not own:
        return Replay(ctx, "waits")
    if not isinstance(own[0], Exception):
        raise group  # (a KeyboardInterrupt, a SystemExit: not the flow's to decide)
    return Replay(ctx, "raised", error=own[0])


def _leaves(exc: BaseException) -> list[BaseException]:
    if isinstance(exc, BaseExceptionGroup):
        return [leaf for e in exc.exceptions for leaf in _leaves(e)]
    return [exc]


def _unasked(ctx: FlowContext, row: Any, what: str) -> dict[str, Any]:
    exc = ctx._diverged(row, f"nothing: the flow {what}", f"{what} before asking for it")
    return {"detail": exc.detail, "divergence": exc}
