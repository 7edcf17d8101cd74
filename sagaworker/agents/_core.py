"""What every agent adapter shares: a tool call is one journaled step of the saga.

An adapter turns the framework's tool call (its tool-call id, the model's arguments) into
:meth:`AgentTools.call`, and maps what that returns or raises onto the framework:

- the step's journaled result: the tool's return value for the model;
- :class:`~sagaworker.BadInput` (:class:`ArgumentsRefused`): the arguments do not fit the
  tool's signature; nothing was journaled: the framework's own retry (the model is told);
- :class:`GatePending`: the step waits at its approval gate; the framework's
  human-in-the-loop pause (deferred call, interruption, interrupt). A resumed call with
  the same tool-call id finds the same step: it proceeds only once the journal holds the
  gate's signed approval, and pends again until then;
- :class:`~sagaworker.ToolFailed` (:class:`~sagaworker.ApprovalRejected` included): the
  step FAILED (or was rejected, or cancelled) and the saga is failing and compensating:
  the adapter ends the agent run with it in the cause chain, whatever error handling the
  framework or the app configured (the model is never asked to retry it).
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from .._base.canonical import args_digest
from .._base.errors import BadInput, ConfigurationError, SagaworkerError, ToolFailed
from .._base.registry import ToolSpec
from .._base.types import Phase
from .._producer.saga import Saga, Step

__all__ = ["AgentTool", "AgentTools", "ArgumentsRefused", "GatePending", "SagaClosed", "failed_in",
           "prompt_digest", "require", "split_arguments"]


def require(module: str, extra: str) -> Any:
    """Import a framework for its adapter, or say which extra to install."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise ConfigurationError(
            f"this adapter needs {module!r} ({exc}); install the extra: "
            f"pip install 'sagaworker[{extra}]'") from None


class ArgumentsRefused(BadInput):
    """The model's arguments do not fit the tool's signature; nothing was journaled."""


class GatePending(SagaworkerError):
    """The step waits at its approval gate (signed token: ``sw.approve``, CLI, dashboard)."""

    def __init__(self, step: Step) -> None:
        super().__init__(f"step {step.seq} ({step.tool_name}) of saga {step.saga_id!r} waits "
                         "for a signed approval (sagaworker approve, the dashboard, or "
                         "sw.approve); the framework's own approval is not enough")
        self.step = step


class SagaClosed(ToolFailed):
    """The saga takes no more steps (it is failing, or over): the agent run ends, as for a
    failed step, whatever error handling the framework has."""


@dataclass(frozen=True)
class AgentTool:
    """One sagaworker tool as an agent sees it."""

    spec: ToolSpec

    @property
    def name(self) -> str:
        """The name the model calls it by: the function's name (unique in one toolset)."""
        return self.spec.fn.__name__

    @property
    def description(self) -> str:
        return (self.spec.fn.__doc__ or "").strip()

    @property
    def fn(self) -> Callable[..., Any]:
        """The tool's own function (its signature and docstring feed the schema)."""
        return self.spec.fn

    @property
    def gated(self) -> bool:
        return self.spec.gated


class AgentTools:
    """The tools handed to one agent, journaled as steps of ``saga``."""

    def __init__(self, saga: Saga, tools: Iterable[Any]) -> None:
        if not isinstance(saga, Saga):
            raise ConfigurationError(f"{saga!r} is not a saga handle: pass what sw.begin / "
                                     "sw.abegin / sw.get returned")
        self.saga = saga
        self.tools: list[AgentTool] = []
        seen: dict[str, str] = {}
        for t in tools:
            spec = saga.producer.resolve(t)
            tool = AgentTool(spec)
            if tool.name in seen and seen[tool.name] != spec.name:
                raise ConfigurationError(
                    f"two tools are named {tool.name!r} ({seen[tool.name]} and {spec.name}); "
                    "a model calls tools by name: hand one of them to this agent")
            seen[tool.name] = spec.name
            self.tools.append(tool)
        if not self.tools:
            raise ConfigurationError("no tools given: pass the @sw.tool functions the agent "
                                     "may call")

    def __iter__(self) -> Any:
        return iter(self.tools)

    def check(self, tool: AgentTool, args: Sequence[Any], kwargs: dict[str, Any]) -> None:
        """Raise :class:`ArgumentsRefused` when the call would not fit the tool."""
        try:
            self.saga.producer.prepare(tool.spec.name, args, kwargs)
        except BadInput as exc:
            raise ArgumentsRefused(str(exc)) from None

    async def step(self, tool: AgentTool, call_id: str, args: Sequence[Any],
                   kwargs: dict[str, Any]) -> Step:
        """The step for this tool call, journaled on its first call (one per call id)."""
        try:
            return await self.saga.aenqueue_call(call_id, tool.spec.name, args, kwargs)
        except BadInput as exc:
            if "already journaled" in str(exc):
                raise
            raise ArgumentsRefused(str(exc)) from None
        except ConfigurationError:
            raise
        except SagaworkerError as exc:  # failing, compensated, completed, gone: the run ends
            raise SagaClosed(f"{tool.name} was not called: {exc}",
                             saga_id=self.saga.saga_id, tool=tool.spec.name) from exc

    async def call(self, tool: AgentTool, call_id: str, args: Sequence[Any],
                   kwargs: dict[str, Any], timeout: float | None = None) -> Any:
        """Journal (or find) the step, then its journaled result.

        Raises :class:`ArgumentsRefused`, :class:`GatePending`, or ``ToolFailed``."""
        step = await self.step(tool, call_id, args, kwargs)
        if await step.aphase() is Phase.AWAITING_APPROVAL:
            raise GatePending(step)
        return await step.aresult(timeout)

    async def pending(self, tool: AgentTool, call_id: str, args: Sequence[Any],
                      kwargs: dict[str, Any]) -> bool:
        """Journal (or find) a gated call's step; True while it waits for its approval.
        A rejected gate raises ``ApprovalRejected`` (a ``ToolFailed``)."""
        step = await self.step(tool, call_id, args, kwargs)
        phase = await step.aphase()
        if phase is Phase.AWAITING_APPROVAL:
            return True
        if phase in (Phase.REJECTED, Phase.CANCELLED, Phase.FAILED):
            await step.aresult(0)  # raises what result() raises for it
        return False


def split_arguments(fn: Callable[..., Any], validated: dict[str, Any]
                    ) -> tuple[list[Any], dict[str, Any]]:
    """The model's arguments as the tool's own call: its positional parameters in order
    (as ``saga.enqueue(tool, key, ...)`` journals them, and undos read ``ctx.args``), the
    rest by name."""
    kwargs = dict(validated)
    args: list[Any] = []
    for p in inspect.signature(fn).parameters.values():
        if p.kind is p.VAR_POSITIONAL:
            args.extend(kwargs.pop(p.name, ()))
            break
        if p.kind not in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) or p.name not in kwargs:
            break
        args.append(kwargs.pop(p.name))
    return args, kwargs


def failed_in(exc: BaseException) -> ToolFailed | None:
    """The ToolFailed in an exception's cause or context chain, if any."""
    seen: set[int] = set()
    cur: BaseException | None = exc
    while cur is not None and id(cur) not in seen:
        if isinstance(cur, ToolFailed):
            return cur
        seen.add(id(cur))
        cur = cur.__cause__ or cur.__context__
    return None


def prompt_digest(prompt: Any) -> str:
    """A digest of a model request's prompt as the flow's code makes it (instructions,
    system and user prompts, the tools offered): journaled with the request, so that a
    replay under code that prompts otherwise reports the turn. ``prompt`` is made JSON by
    pydantic (an object it cannot encode counts by its type's name: never by an address
    or a time that differs between replays)."""
    from pydantic_core import to_jsonable_python

    plain = to_jsonable_python(prompt, fallback=lambda o: type(o).__name__)
    return args_digest([plain], {})
