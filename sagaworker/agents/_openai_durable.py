"""OpenAI Agents SDK runs inside a flow, durable: a model request is never sent twice.

``run(agent, input, **kwargs)`` is ``Runner.run`` with every model the run uses wrapped,
inside a flow, so that each request is a durable unit of the flow's saga (journaled, sent
once, its response read from the journal by every later replay): the same model-provider
seam Temporal's integration turns into activities. ``flow_tools(tools)`` are the
``@sw.tool`` functions as the SDK's ``FunctionTool``s whose calls are steps of the flow's
saga (undo, reversibility, gate: a gated call waits at its gate with no process).
Outside a flow ``run`` is ``Runner.run``, and a ``flow_tools`` tool raises
``ConfigurationError``.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterable
from typing import Any

from .._base.errors import BadInput, ConfigurationError
from .._base.registry import ToolSpec
from .._worker.replay import current_flow
from ._core import prompt_digest, require

require("agents", "openai-agents")

from agents import (  # noqa: E402
    Agent,
    FunctionTool,
    Model,
    ModelProvider,
    RunConfig,
    RunContextWrapper,
    Runner,
)
from agents.function_schema import function_schema  # noqa: E402
from agents.items import ModelResponse, TResponseOutputItem  # noqa: E402
from agents.models.multi_provider import MultiProvider  # noqa: E402
from agents.usage import Usage  # noqa: E402
from pydantic import TypeAdapter  # noqa: E402
from pydantic_core import to_jsonable_python  # noqa: E402

__all__ = ["flow_tools", "run"]

_OUTPUT: TypeAdapter[list[TResponseOutputItem]] = TypeAdapter(list[TResponseOutputItem])
_USAGE: TypeAdapter[Usage] = TypeAdapter(Usage)


def _model_name(model: Model) -> str:
    """The model a request went to, as people read it (the SDK's models keep its name in
    ``model``; a custom one is named by its class)."""
    name = getattr(model, "model", None)
    return name if isinstance(name, str) and name else type(model).__name__


def _dump(r: ModelResponse, model: str) -> dict[str, Any]:
    """A response as the journal holds it (JSON), in the shape ``model_turn`` reads."""
    return {"model_name": model, "parts": [
        {"part_kind": "tool-call", "tool_name": getattr(o, "name", None)}
        for o in r.output if getattr(o, "type", None) == "function_call"],
        "usage": {"input_tokens": r.usage.input_tokens, "output_tokens": r.usage.output_tokens},
        "response": {"output": _OUTPUT.dump_python(r.output, mode="json"),
                     "usage": _USAGE.dump_python(r.usage, mode="json"),
                     "response_id": r.response_id}}


def _load(payload: dict[str, Any]) -> ModelResponse:
    data = payload["response"]
    return ModelResponse(output=_OUTPUT.validate_python(data["output"]),
                         usage=_USAGE.validate_python(data["usage"]),
                         response_id=data.get("response_id"))


_ASKED = ("system_instructions", "input", "model_settings", "tools", "output_schema",
          "handoffs")


def _prompt(args: tuple[Any, ...], kwargs: dict[str, Any]) -> str:
    """A digest of a model request's prompt (``Model.get_response``'s arguments): the
    instructions, the user, system and developer messages of its input, the tools and
    handoffs it offers, a stored prompt it names. Not the model's own output items nor the
    tools' outputs (journaled: the same on every replay), nor any id."""
    asked = dict(zip(_ASKED, args, strict=False)) | kwargs
    given = asked.get("input")
    items = [{"role": "user", "content": given}] if isinstance(given, str) else given or []
    said = [[i.get("role"), i.get("content")] for i in items
            if isinstance(i, dict) and i.get("role") in ("user", "system", "developer")]
    tools = [[getattr(t, "name", type(t).__name__), getattr(t, "description", None),
              getattr(t, "params_json_schema", None)] for t in asked.get("tools") or ()]
    handoffs = [[getattr(h, "tool_name", None), getattr(h, "tool_description", None)]
                for h in asked.get("handoffs") or ()]
    return prompt_digest([asked.get("system_instructions"), said, tools, handoffs,
                          asked.get("prompt")])


class _JournaledModel(Model):
    """A model whose requests, inside a flow, are durable units of its saga."""

    def __init__(self, inner: Model, name: str, tries: int | None = None) -> None:
        self.inner, self.name, self.tries = inner, name, tries

    async def get_response(self, *args: Any, **kwargs: Any) -> ModelResponse:
        ctx = current_flow.get()
        if ctx is None:
            return await self.inner.get_response(*args, **kwargs)

        async def body() -> dict[str, Any]:
            return _dump(await self.inner.get_response(*args, **kwargs),
                         _model_name(self.inner))

        payload = await ctx.unit(f"{self.name}__model.request", body, tries=self.tries,
                                 input=_prompt(args, kwargs))
        return _load(payload)

    def stream_response(self, *args: Any, **kwargs: Any) -> Any:
        if current_flow.get() is not None:
            raise ConfigurationError("a streamed run is not durable: inside a flow, use "
                                     "sagaworker.agents.openai_agents.run(agent, input)")
        return self.inner.stream_response(*args, **kwargs)


@dataclasses.dataclass
class _Provider(ModelProvider):
    inner: ModelProvider
    agent: str
    tries: int | None = None

    def get_model(self, model_name: str | None) -> Model:
        return _JournaledModel(self.inner.get_model(model_name), self.agent, self.tries)


async def run(agent: Agent[Any], input: Any, *, idempotent_tools: Iterable[str] = (),
              model_retries: int | None = None, **kwargs: Any) -> Any:
    """``Runner.run(agent, input, **kwargs)``; inside a flow, each model request and each
    call of a function tool is a journaled step of the flow's saga, sent (or run) once
    across every replay and worker. A function tool in flight when its worker is lost is
    in doubt (section 6) unless its name is in ``idempotent_tools`` (run again). A model
    request that fails for a passing reason (a rate limit, a 5xx, a timeout) is tried
    ``model_retries`` times in all (None: SAGAWORKER_MODEL_RETRIES) before the run fails."""
    ctx = current_flow.get()
    if ctx is None:
        return await Runner.run(agent, input, **kwargs)
    if not ctx.is_async:
        raise ConfigurationError("sagaworker.agents.openai_agents.run needs an async flow: "
                                 "declare it `async def` and await run(...)")
    if isinstance(idempotent_tools, str):
        raise ConfigurationError("idempotent_tools takes tool names: pass a set, e.g. "
                                 f"{{{idempotent_tools!r}}}")
    if model_retries is not None and (not isinstance(model_retries, int)
                                      or model_retries < 1):
        raise ConfigurationError(f"model_retries={model_retries!r}: give the tries in all, "
                                 "at least 1 (1: never retried)")
    config: RunConfig = kwargs.pop("run_config", None) or RunConfig()
    name = agent.name or "agent"
    model = config.model
    config = dataclasses.replace(
        config, model_provider=_Provider(config.model_provider or MultiProvider(), name,
                                         model_retries),
        model=_JournaledModel(model, name, model_retries) if isinstance(model, Model)
        else model)
    agent = _durable(agent, frozenset(idempotent_tools), {}, model_retries)
    return await Runner.run(agent, input, run_config=config, **kwargs)


def _durable(agent: Agent[Any], idempotent: frozenset[str],
             done: dict[int, Agent[Any]], tries: int | None = None) -> Agent[Any]:
    """A copy of ``agent`` (and of the agents it hands off to) whose model requests and
    plain function tools are durable units; ``flow_tools`` keep being saga steps."""
    if id(agent) in done:
        return done[id(agent)]
    name = agent.name or "agent"
    copy = done[id(agent)] = agent.clone(tools=[
        _journaled_tool(t, name, t.name in idempotent)
        if isinstance(t, FunctionTool) and not getattr(t, _STEP, False) else t
        for t in agent.tools])
    if isinstance(agent.model, Model):
        copy.model = _JournaledModel(agent.model, name, tries)
    copy.handoffs = [_durable(h, idempotent, done, tries) if isinstance(h, Agent) else h
                     for h in agent.handoffs]
    return copy


#: marks a FunctionTool whose calls are saga steps already (``flow_tools``)
_STEP = "_sagaworker_step"


def _journaled_tool(tool: FunctionTool, agent: str, idempotent: bool) -> FunctionTool:
    """``tool`` whose every call, inside a flow, is a durable unit: run once, its output
    journaled (JSON) and read back by every replay."""
    invoke = tool.on_invoke_tool
    unit = f"{agent}__tool.{tool.name}"

    async def on_invoke(ctx: Any, raw: str) -> Any:
        flow = current_flow.get()
        if flow is None:
            return await invoke(ctx, raw)

        async def body() -> Any:
            return _journalable(await invoke(ctx, raw))

        return await flow.unit(unit, body, idempotent=idempotent)

    return dataclasses.replace(tool, on_invoke_tool=on_invoke)


def _journalable(output: Any) -> Any:
    """A tool's output as JSON the journal holds: as it is when it is JSON already, else in
    its JSON form (a pydantic model, a dataclass), else its text (what the SDK would send
    the model)."""
    try:
        json.dumps(output, allow_nan=False)
        return output
    except (TypeError, ValueError):
        pass
    try:
        return to_jsonable_python(output)
    except Exception:
        return str(output)


def flow_tools(tools: Iterable[Any]) -> list[FunctionTool]:
    """The ``@sw.tool`` functions as ``FunctionTool``s whose calls, inside a flow, are steps
    of the flow's saga (named, described and typed as ``@function_tool`` would)."""
    out = []
    for t in tools:
        spec = getattr(t, "sagaworker_spec", None)
        if not isinstance(spec, ToolSpec):
            raise ConfigurationError(f"{t!r} is not a sagaworker tool: decorate it with "
                                     "@sw.tool(...) and pass the decorated function")
        out.append(_flow_tool(spec))
    if not out:
        raise ConfigurationError("no tools given: pass the @sw.tool functions the agent may call")
    return out


def _flow_tool(spec: ToolSpec) -> FunctionTool:
    schema = function_schema(spec.fn, name_override=spec.fn.__name__, strict_json_schema=True)

    async def invoke(_ctx: RunContextWrapper[Any], raw: str) -> str:
        flow = current_flow.get()
        if flow is None or not flow.is_async:
            raise ConfigurationError(
                f"flow tool {schema.name!r} runs inside an async flow only: call the agent "
                "with sagaworker.agents.openai_agents.run from an `async def` @sw.flow()")
        data = json.loads(raw) if raw.strip() else {}
        args, kwargs = schema.to_call_args(schema.params_pydantic_model(**data))
        try:
            flow.check(spec.name, args, kwargs)
        except BadInput as exc:  # the model is told, as the SDK does for bad arguments
            return f"An error occurred while running the tool. Please try again. Error: {exc}"
        return str(await flow.call(spec.name, *args, **kwargs))

    tool = FunctionTool(name=schema.name, description=schema.description or "",
                        params_json_schema=schema.params_json_schema, on_invoke_tool=invoke,
                        strict_json_schema=True)
    setattr(tool, _STEP, True)
    return tool
