"""Pydantic AI runs inside a flow, durable: a model request is never sent twice.

Built on Pydantic AI's public durable-execution interface (``pydantic_ai.durable_exec``)
as a journal engine: every operation Pydantic AI routes through the backend (a model
request, a call of a function tool the agent holds) is a *durable unit* of the flow's
saga (``FlowContext.unit``): journaled, run once in the worker replaying the flow, its
result (Pydantic AI's own JSON encoding) returned from the journal by every later replay.
The tools of :func:`flow_toolset` are ``@sw.tool`` steps instead, published to the
workers as any flow step, with their undo, reversibility and gate: the replay stops at
one without an outcome and the next one (on whichever worker) goes on from the journal.

Outside a flow the capability changes nothing; a ``flow_toolset`` tool called outside a
flow raises ``ConfigurationError``.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from .._base.errors import BadInput, ConfigurationError
from .._base.registry import ToolSpec
from .._base.units import CallFor
from .._worker.replay import FlowContext, current_flow
from .._worker.signals import _Diverged, _Suspend
from ._core import prompt_digest, split_arguments

try:
    from pydantic_ai import ModelRetry, RunContext, Tool
    from pydantic_ai.durable_exec import (
        JSON_CODEC,
        BaseDurabilityCapability,
        DurabilityEngineSpec,
        DurableOperationId,
        JournalCallableOperationBackend,
        RoleBasedOperationConfig,
        ToolsetCallToolId,
        conversation_id_from_run_id,
    )
    from pydantic_ai.models import Model
    from pydantic_ai.toolsets import AbstractToolset, FunctionToolset, ToolsetTool
except ImportError:
    from ._core import require

    require("pydantic_ai.durable_exec", "pydantic-ai")
    raise

__all__ = ["Durability", "FlowToolset", "flow_toolset"]


def _flow(what: str) -> FlowContext:
    ctx = current_flow.get()
    if ctx is None:
        raise ConfigurationError(
            f"{what} runs inside a flow only: call the agent from an async @sw.flow() "
            "function started with sw.start(...)")
    if not ctx.is_async:
        raise ConfigurationError(
            f"{what} needs an async flow: declare it `async def` and `await agent.run(...)`")
    return ctx


class _Backend(JournalCallableOperationBackend[dict[str, Any]]):
    """Each operation, inside a flow, is one durable unit of the flow's saga: a model
    request may be sent again when its worker was lost mid-request, and is tried again
    (``model_retries`` tries in all) when it fails for a passing reason; a function tool's
    call runs again only if declared idempotent (else it is in doubt)."""

    #: a model request's tries in all (None: SAGAWORKER_MODEL_RETRIES)
    model_retries: int | None = None

    async def execute(self, *, operation_id: DurableOperationId, name: str,
                      body: Callable[[], Awaitable[object]], cache_key: tuple[object, ...],
                      config: dict[str, Any]) -> object:
        ctx = current_flow.get()
        if ctx is None:
            return await body()
        if isinstance(operation_id, ToolsetCallToolId):  # a function tool's call
            return await ctx.unit(name, body, idempotent=bool(config.get("idempotent")))
        return await ctx.unit(name, body, tries=self.model_retries,  # a model request
                              input=_prompt(cache_key))


def _prompt(cache_key: tuple[object, ...]) -> str | None:
    """A digest of a model request's prompt (its cache identity: the model, the messages,
    the settings, the request's parameters, the run's context): the instructions, system
    and user prompts of its messages and the tools it offers. Not the model's responses nor
    the tools' returns (journaled: the same on every replay), nor any time or id."""
    if len(cache_key) < 4:
        return None
    messages, params = cache_key[1], cache_key[3]
    asked = []
    for m in messages if isinstance(messages, list) else []:
        if getattr(m, "kind", None) != "request":
            continue
        asked.append([getattr(m, "instructions", None),
                      [[p.part_kind, p.content] for p in getattr(m, "parts", ())
                       if getattr(p, "part_kind", None) in ("system-prompt", "user-prompt")]])
    offered = [*getattr(params, "function_tools", ()), *getattr(params, "output_tools", ())]
    tools = [[t.name, t.description, t.parameters_json_schema] for t in offered]
    return prompt_digest([asked, tools])


def _idempotence(names: frozenset[str]) -> Callable[[DurableOperationId, object | None, str],
                                                    dict[str, Any]]:
    """Which function tool calls may run again after their worker was lost: those named in
    ``idempotent_tools``, or whose tool says so in its metadata (``{"idempotent": True}``)."""

    def resolve(operation_id: DurableOperationId, tool: object | None,
                tool_name: str) -> dict[str, Any]:
        tool_def = getattr(tool, "tool_def", None)
        metadata = getattr(tool_def, "metadata", None) or {}
        return {"idempotent": tool_name in names or metadata.get("idempotent") is True}

    return resolve


class Durability(BaseDurabilityCapability[Any]):
    """Pydantic AI's durability capability for sagaworker flows: model requests and the
    agent's function tools are journaled units of the flow's saga (sent, or run, once),
    ``flow_toolset`` tools are saga steps with their undo and gate."""

    engine_spec = DurabilityEngineSpec(
        engine_name="sagaworker",
        durable_unit_noun="step",
        durable_container_noun="flow",
        codec=JSON_CODEC,  # the journal holds JSON
        wrapped_toolset_kinds=frozenset({"function"}),
        toolset_lifecycles={"function": "enter-always", "mcp": "enter-always",
                            "dynamic": "enter-never"},
        unsupported_runtime_toolset_kinds=frozenset({"mcp", "dynamic"}),
        journal_discovery=False,  # a function toolset lists its tools the same every replay
        control_flow_error_types=(_Suspend,),  # the replay stops at a step without outcome
        nondeterminism_error_types=(_Diverged,),
    )

    def __init__(self, sw: Any, *, name: str | None = None,
                 models: Mapping[str, Model] | None = None,
                 idempotent_tools: Iterable[str] = (),
                 model_retries: int | None = None) -> None:
        """``idempotent_tools``: the names of the agent's function tools that may run again
        when their worker is lost mid-call (a lookup); any other such call is in doubt, as
        a non-idempotent step's (a tool's metadata ``{"idempotent": True}`` says so too).
        ``model_retries``: a model request's tries in all when it fails for a passing
        reason (a rate limit, a 5xx, a timeout); None: SAGAWORKER_MODEL_RETRIES."""
        super().__init__(models=models, name=name)
        self.sw = sw
        if model_retries is not None and (not isinstance(model_retries, int)
                                          or model_retries < 1):
            raise ConfigurationError(f"model_retries={model_retries!r}: give the tries in "
                                     "all, at least 1 (1: never retried)")
        self.model_retries = model_retries
        if isinstance(idempotent_tools, str):
            raise ConfigurationError("idempotent_tools takes tool names: pass a set, e.g. "
                                     f"{{{idempotent_tools!r}}}")
        self.idempotent_tools = frozenset(idempotent_tools)

    @property
    def in_durable_context(self) -> bool:
        return current_flow.get() is not None

    def get_default_run_id(self) -> str | None:
        ctx = current_flow.get()
        return None if ctx is None else ctx.run_id(self.name or "agent")

    def get_default_conversation_id(self, run_id: str) -> str | None:
        return conversation_id_from_run_id(run_id) if self.in_durable_context else None

    def get_durable_operation_backend(self) -> _Backend:
        backend = _Backend(agent_name=self.name, default_model_id=self.default_model_id,
                           config=RoleBasedOperationConfig(
                               model={}, event={}, capability={}, tool={},
                               resolve_tool=_idempotence(self.idempotent_tools)))
        backend.model_retries = self.model_retries
        return backend


def flow_toolset(tools: Iterable[Any]) -> FlowToolset:
    """A Pydantic AI toolset of ``@sw.tool`` functions whose calls, inside a flow, are steps
    of the flow's saga (named and described as the tools are: section on agents)."""
    specs: list[ToolSpec] = []
    names: dict[str, str] = {}
    for t in tools:
        spec = _spec_of(t)
        name = spec.fn.__name__
        if names.get(name, spec.name) != spec.name:
            raise ConfigurationError(
                f"two tools are named {name!r} ({names[name]} and {spec.name}); a model calls "
                "tools by name: hand one of them to this agent")
        names[name] = spec.name
        specs.append(spec)
    if not specs:
        raise ConfigurationError("no tools given: pass the @sw.tool functions the agent may call")
    schemas: FunctionToolset[Any] = FunctionToolset(
        [Tool(s.fn, takes_ctx=False, name=s.fn.__name__) for s in specs])
    return FlowToolset(specs, schemas)


def _spec_of(tool: Any) -> ToolSpec:
    spec = getattr(tool, "sagaworker_spec", None)
    if not isinstance(spec, ToolSpec):
        raise ConfigurationError(f"{tool!r} is not a sagaworker tool: decorate it with "
                                 "@sw.tool(...) and pass the decorated function")
    return spec


@dataclass
class FlowToolset(AbstractToolset[Any]):
    """A leaf toolset (Pydantic AI's durability leaves it to us): its schemas come from
    the tools' functions, its calls become steps of the running flow's saga."""

    specs: list[ToolSpec]
    schemas: FunctionToolset[Any]
    by_name: dict[str, ToolSpec] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.by_name = {s.fn.__name__: s for s in self.specs}

    @property
    def id(self) -> str | None:
        return None

    async def get_tools(self, ctx: RunContext[Any]) -> dict[str, ToolsetTool[Any]]:
        tools = await self.schemas.get_tools(ctx)
        return {n: _mine(t, self) for n, t in tools.items()}

    async def call_tool(self, name: str, tool_args: dict[str, Any], ctx: RunContext[Any],
                        tool: ToolsetTool[Any]) -> Any:
        spec = self.by_name.get(name)
        if spec is None:
            raise ConfigurationError(f"no tool {name!r} in this toolset")
        flow = _flow(f"flow_toolset tool {name!r}")
        args, kwargs = split_arguments(spec.fn, tool_args)
        asked: Any = spec.name
        if ctx.tool_call_id:  # journaled with the step (the run's id keeps it unique)
            asked = CallFor(spec.name, flow.call_key(f"{ctx.run_id}/{ctx.tool_call_id}"))
        try:
            flow.check(asked, args, kwargs)
        except BadInput as exc:  # the model is told, as a tool outside a flow does
            raise ModelRetry(f"invalid arguments for tool {name}: {exc}") from None
        return await flow.call(asked, *args, **kwargs)


def _mine(tool: ToolsetTool[Any], owner: FlowToolset) -> ToolsetTool[Any]:
    from dataclasses import replace

    return replace(tool, toolset=owner)
