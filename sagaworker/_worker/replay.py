"""A flow's replay: its function run from the top against its journal, writing nothing.

``FlowContext`` answers each ``call``/``enqueue`` from the journal position by position;
the first step beyond the journal stops the replay (``_Suspend``), a step that differs
from the journal's is a divergence (``_Diverged``). ``replay`` says what the run came to;
the worker (``Flows``) and ``sagaworker.testing`` act on it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .._base.canonical import args_digest
from .._base.errors import ApprovalRejected, ToolFailed
from .._base.types import Phase
from .._journal.runtime import Runtime
from .._observe.redact import redact_call
from .._producer.producer import Producer

__all__ = ["FlowContext", "FlowHandle", "FlowSpec", "Replay", "replay"]


@dataclass(frozen=True)
class FlowSpec:
    name: str
    fn: Callable[..., Any]


class _Suspend(BaseException):
    """The replay reached a step without an outcome: it stops here (not an error)."""


class _Diverged(BaseException):
    def __init__(self, detail: str) -> None:
        super().__init__(detail)
        self.detail = detail


@dataclass
class FlowHandle:
    """A step enqueued by a flow; ``FlowContext.gather`` awaits it."""

    position: int


class FlowContext:
    """What a flow function is handed: ``call``, ``enqueue``, ``gather``."""

    def __init__(self, saga_id: str, metadata: dict[str, Any], journal: list[Any],
                 producer: Producer) -> None:
        self.saga_id = saga_id
        self.metadata = metadata
        self._journal = journal
        self._producer = producer
        self._cursor = 0
        #: steps asked for beyond the journal, journaled together when the replay stops
        self.new: list[tuple[Any, tuple[Any, ...], dict[str, Any]]] = []
        #: failures raised from the journal (their step's move failed the saga already)
        self.journaled_failures: list[ToolFailed] = []

    def call(self, tool: Any, /, *args: Any, **kwargs: Any) -> Any:
        """The step's journaled result (its saga waits, with no thread, until there is one)."""
        return self.gather(self.enqueue(tool, *args, **kwargs))[0]

    def enqueue(self, tool: Any, /, *args: Any, **kwargs: Any) -> FlowHandle:
        """A step that runs beside the next ones until ``gather`` awaits it."""
        pos = self._cursor
        self._cursor += 1
        spec = self._producer.resolve(tool)
        if pos < len(self._journal):
            row = self._journal[pos]
            try:
                digest = args_digest(list(args), kwargs)
            except (TypeError, ValueError):
                digest = "(not JSON)"
            if row.tool_name != spec.name or row.args_digest != digest:
                rt = self._producer.rt
                raise _Diverged(
                    f"flow diverged at step {row.seq}: the journal holds {row.tool_name}"
                    f"{_show(rt, row.tool_name, row.args, row.kwargs)}, the replay asked for "
                    f"{spec.name}{_show(rt, spec.name, list(args), kwargs)}")
        else:
            self.new.append((tool, args, kwargs))
        return FlowHandle(pos)

    def gather(self, *handles: FlowHandle) -> list[Any]:
        """The results of the handles' steps, in the order of the handles."""
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

    def _journaled(self, exc: ToolFailed) -> ToolFailed:
        self.journaled_failures.append(exc)
        return exc

    def from_journal(self, exc: BaseException | None) -> bool:
        """``exc`` came from the journal, not the flow's own (which fails the saga)."""
        return any(exc is f for f in self.journaled_failures)

    @property
    def consumed(self) -> int:
        return self._cursor


def _show(rt: Runtime, tool: str, args: Any, kwargs: Any) -> str:
    """A call as people read it in a reason or a log line: redacted (SAGAWORKER_REDACT)."""
    spec = rt.registry.tool(tool)
    args, kwargs = redact_call(spec.signature if spec is not None else None, args or [],
                               kwargs or {}, rt.settings.redact_keys)
    parts = [repr(a) for a in (args or [])] + [f"{k}={v!r}" for k, v in (kwargs or {}).items()]
    text = f"({', '.join(parts)})"
    return text if len(text) <= 200 else text[:197] + "...)"


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


def replay(rt: Runtime, producer: Producer, spec: FlowSpec, saga: Any,
           rows: list[Any]) -> Replay:
    """Run the flow from the top against ``rows`` (what the worker's advance and
    ``sagaworker.testing`` both do). Asking for another tool or other arguments than the
    journal holds at a position, or returning or raising before asking for every
    journaled step, is a divergence."""
    ctx = FlowContext(saga.saga_id, dict(saga.metadata or {}), rows, producer)
    try:
        value = spec.fn(ctx, *(saga.flow_args or []), **(saga.flow_kwargs or {}))
    except _Suspend:
        return Replay(ctx, "waits")
    except _Diverged as exc:
        return Replay(ctx, "diverged", detail=exc.detail)
    except Exception as exc:
        if not ctx.from_journal(exc) and not ctx.new and ctx.consumed < len(rows):
            return Replay(ctx, "diverged", error=exc,
                          detail=_unasked(rt, rows[ctx.consumed],
                                          f"raised {type(exc).__name__}"))
        return Replay(ctx, "raised", error=exc)
    if not ctx.new and ctx.consumed < len(rows):
        return Replay(ctx, "diverged", value=value,
                      detail=_unasked(rt, rows[ctx.consumed], "returned"))
    return Replay(ctx, "waits" if ctx.new else "returned", value=value)


def _unasked(rt: Runtime, row: Any, what: str) -> str:
    return (f"flow diverged at step {row.seq}: the journal holds {row.tool_name}"
            f"{_show(rt, row.tool_name, row.args, row.kwargs)}, the replay {what} before "
            "asking for it")
