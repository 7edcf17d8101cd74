"""Pydantic AI: a toolset whose every tool call is one journaled step of a saga.

```python
from pydantic_ai import Agent, DeferredToolRequests
from sagaworker.agents import pydantic_ai as sw_agents

saga = await sw.abegin("trip-42", deadline=3600)
agent = Agent(model, output_type=[str, DeferredToolRequests],
              toolsets=[sw_agents.toolset(saga, [book_hotel, charge_card, send_voucher])])
result = await agent.run("Book the hotel and pay for it")
```

How the journal's answers reach Pydantic AI:

- a tool's name, description and argument schema: Pydantic AI's own ``Tool`` built from the
  ``@sw.tool`` function (every parameter is the model's argument, ``key`` included);
- arguments the tool's signature or the journal refuses (not JSON, over
  SAGAWORKER_MAX_ARGS_BYTES): ``ModelRetry``, nothing journaled;
- a gated (IRREVERSIBLE) call: ``ApprovalRequired``, so the run ends with
  ``DeferredToolRequests`` (the agent's ``output_type`` must allow it). A resumed run's
  ``DeferredToolResults`` approval is not a decision: the call pends again until the
  journal holds the gate's approval made with its signed token (``sw.approve``, the CLI,
  the dashboard). An approval with ``ToolApproved(override_args=...)`` ends the run with
  ``BadInput``: the signed token approves the journaled arguments, no others;
- a FAILED (or rejected, or cancelled) step: the run raises it, a ``sagaworker.ToolFailed``.
  An error handler that swallows it (a capability's ``on_tool_execute_error`` or
  ``wrap_tool_execute``, a wrapper toolset turning errors into ``ModelRetry``) does not
  keep the run going: the toolset raises the failure again before the model's next
  request, and when the run would end with an output all the same.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from .._base.errors import ConfigurationError, SagaworkerError
from .._producer.saga import Saga
from ._core import (
    AgentTool,
    AgentTools,
    ArgumentsRefused,
    GatePending,
    require,
    split_arguments,
)

try:
    from pydantic_ai import ApprovalRequired, ModelRetry, RunContext, Tool
    from pydantic_ai.toolsets import FunctionToolset, ToolsetTool, WrapperToolset
except ImportError:
    require("pydantic_ai", "pydantic-ai")  # not installed: ConfigurationError naming the extra
    raise  # installed, and yet a name is missing: an older Pydantic AI than the extra asks

from ._pydantic_ai_durable import Durability, FlowToolset, flow_toolset

__all__ = ["Durability", "FlowToolset", "SagaToolset", "flow_toolset", "toolset"]


def toolset(saga: Saga, tools: Iterable[Any]) -> SagaToolset:
    """A Pydantic AI toolset of ``tools`` (``@sw.tool`` functions), journaled in ``saga``."""
    agent_tools = AgentTools(saga, tools)
    schemas: FunctionToolset[Any] = FunctionToolset(
        [Tool(t.fn, takes_ctx=False, name=t.name) for t in agent_tools.tools])
    return SagaToolset(schemas, agent_tools)


@dataclass
class _Ended:
    """Why the saga takes no more tool calls from this agent (shared by the toolset's
    per-run copies): the run that sees it raises it, whatever handled it before."""

    error: SagaworkerError | None = None

    def check(self) -> None:
        if self.error is not None:
            raise self.error


@dataclass
class SagaToolset(WrapperToolset[Any]):
    """The tools' schemas come from ``wrapped`` (a ``FunctionToolset`` of the tool
    functions); their calls go to the journal, never to the functions."""

    agent_tools: AgentTools
    ended: _Ended = field(default_factory=_Ended)

    async def get_tools(self, ctx: RunContext[Any]) -> dict[str, ToolsetTool[Any]]:
        # listed before every model request: a failure some error handler turned into a
        # tool result or a retry ends the run here, before the model reads it
        self.ended.check()
        return await super().get_tools(ctx)

    async def call_tool(self, name: str, tool_args: dict[str, Any], ctx: RunContext[Any],
                        tool: ToolsetTool[Any]) -> Any:
        self.ended.check()
        agent_tool = self._tool(name)
        if not ctx.tool_call_id:
            raise ConfigurationError(
                f"tool {name!r} was called without a tool-call id; call it from an agent run "
                "(the tool-call id is the journal's key for the call)")
        args, kwargs = split_arguments(agent_tool.fn, tool_args)
        try:
            return await self.agent_tools.call(agent_tool, ctx.tool_call_id, args, kwargs)
        except ArgumentsRefused as exc:
            raise ModelRetry(str(exc)) from exc
        except GatePending as exc:
            raise _deferral(exc) from exc
        except SagaworkerError as exc:
            # a FAILED step, a rejected gate, a saga that takes no more steps: the run ends
            if self.ended.error is None:
                self.ended.error = exc
            raise

    async def __aexit__(self, *exc_info: Any) -> bool | None:
        await super().__aexit__(*exc_info)
        if exc_info[0] is None:
            # the run is ending with an output (an output tool beside the failed call,
            # its failure swallowed): it raises the failure instead
            self.ended.check()
        return None

    def _tool(self, name: str) -> AgentTool:
        for t in self.agent_tools.tools:
            if t.name == name:
                return t
        raise ConfigurationError(f"no tool {name!r} in this toolset (it holds "
                                 f"{', '.join(t.name for t in self.agent_tools.tools)})")


def _deferral(exc: GatePending) -> ApprovalRequired:
    """The gate as Pydantic AI's deferred approval; its metadata names the journal's step."""
    step = exc.step
    return ApprovalRequired(metadata={
        "saga_id": step.saga_id, "seq": step.seq, "tool": step.tool_name,
        "decide": "approve or reject with the gate's signed token (sw.pending_approvals(), "
                  "sagaworker approve, the dashboard); an approval in DeferredToolResults "
                  "alone keeps the call pending"})
