"""sagaworker tools for the OpenAI Agents SDK (``sagaworker[openai-agents]``).

``tools(saga, [book_hotel, charge_card, send_voucher])`` returns one ``FunctionTool`` per
tool, for ``Agent(tools=...)``. Its name, description and strict parameters schema come
from the tool function through the SDK's own ``function_schema`` (as ``@function_tool``
builds them). A call journals one step of ``saga`` keyed by the SDK's tool-call id
(``ToolContext.tool_call_id``) and awaits its journaled outcome; the same id again (a
replayed or resumed run) gets the first step's outcome and journals nothing.

What the SDK does on its own, and what these tools do instead:

- Arguments that do not fit the signature (bad JSON, a failed validation, a refusal by
  sagaworker) are what the SDK calls a ``ModelBehaviorError`` for a tool's input: it goes
  through the tool's ``failure_error_function`` (the SDK's default unless the app passes
  its own to :func:`tools`), whose text is the model's answer for that call. Nothing is
  journaled. ``failure_error_function=None`` makes it end the run, as in the SDK.
- A FAILED step (a rejected or cancelled one included) is never given to
  ``failure_error_function``: the SDK turns any other exception of a tool into text for
  the model and the run goes on, so a declined card would leave a booked hotel. Here the
  run raises (the SDK's ``UserError``) with :class:`~sagaworker.ToolFailed` in its cause
  chain, whatever ``failure_error_function`` the app chose; the saga compensates.
- An IRREVERSIBLE tool has ``needs_approval``: its call journals the gate and the run
  stops with a ``ToolApprovalItem`` in ``result.interruptions``. The SDK's own decision
  (``state.approve(item)`` / ``state.reject(item)``) is not one: while the journal's gate
  waits for its signed approval, a resumed ``Runner.run(agent, state)`` forgets it and
  stops at the same call again (a fresh interruption; the model is not asked). A resumed
  run goes on once both hold: the signed approval (``sw.approve``, the CLI, the
  dashboard: the decision) and the SDK's (its go-ahead: the SDK asks no tool about a
  call it holds at an interruption). A gate closed by ``sw.reject`` (or a failing saga)
  ends the resumed run, whatever the SDK was told, with ``ApprovalRejected`` (a
  ``ToolFailed``) in its cause chain. The SDK consults no tool before it acts on a
  decision, so the journal is read where it lists the tools of each turn (the gated
  tool's ``is_enabled``), and the forgetting is done on the run's own approval records.
  A decision for every call (``always_approve``) cannot be forgotten for one call: a
  gated call it lets through while its gate waits ends the run (``GatePending`` in its
  cause chain), still without running.

A tool's return value reaches the model as ``@function_tool``'s does (``str()`` of it).
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any

from .._base.awaiting import offload
from .._base.types import Phase
from .._producer.saga import Saga, Step
from ._core import AgentTool, AgentTools, ArgumentsRefused, require

require("agents", "openai-agents")

# the SDK's top-level package is ``agents``: these are absolute imports of it, not of
# sagaworker.agents (this package)
from agents import AgentBase, FunctionTool, ModelBehaviorError, RunContextWrapper  # noqa: E402
from agents.function_schema import FuncSchema, function_schema  # noqa: E402
from agents.tool import (  # noqa: E402
    ToolErrorFunction,
    maybe_invoke_function_tool_failure_error_function,
    set_function_tool_failure_error_function,
)
from agents.tool_context import ToolContext  # noqa: E402

from ._openai_durable import _STEP, flow_tools, run  # noqa: E402

__all__ = ["flow_tools", "run", "tools"]


class _SdkDefault:
    """``failure_error_function`` not given: the SDK's default applies (as for
    ``@function_tool``)."""


_SDK_DEFAULT = _SdkDefault()
#: a gate in these phases was closed for good: its step raises what ``result()`` raises
_CLOSED = (Phase.REJECTED, Phase.CANCELLED, Phase.FAILED)
#: the wait for a step that has its outcome already (it returns at once)
_SETTLED = 30.0


def tools(saga: Saga, tools: Iterable[Any], *,
          failure_error_function: ToolErrorFunction | _SdkDefault | None = _SDK_DEFAULT
          ) -> list[FunctionTool]:
    """The ``@sw.tool`` functions ``tools`` as OpenAI Agents SDK ``FunctionTool``s whose
    calls are steps of ``saga``.

    ``failure_error_function`` answers the model when its arguments do not fit (as
    ``@function_tool``'s does; unset: the SDK's default, None: the run raises). It never
    sees a FAILED step: that ends the run, with ``ToolFailed`` in its cause chain."""
    resolved = AgentTools(saga, tools)
    return [_SagaTool(resolved, t, failure_error_function).function_tool for t in resolved]


class _SagaTool:
    """One sagaworker tool as a ``FunctionTool``: its invoker, its gate's two checks."""

    def __init__(self, tools: AgentTools, tool: AgentTool,
                 failure: ToolErrorFunction | _SdkDefault | None) -> None:
        self.tools, self.tool = tools, tool
        self.schema: FuncSchema = function_schema(tool.fn, name_override=tool.name,
                                                  strict_json_schema=True)
        self.function_tool = FunctionTool(
            name=self.schema.name, description=self.schema.description or "",
            params_json_schema=self.schema.params_json_schema, on_invoke_tool=self.invoke,
            strict_json_schema=True,
            needs_approval=self.needs_approval if tool.gated else False,
            is_enabled=self.reconcile if tool.gated else True)
        setattr(self.function_tool, _STEP, True)  # a step already: a durable run keeps it
        if isinstance(failure, _SdkDefault):
            set_function_tool_failure_error_function(self.function_tool)
        else:
            set_function_tool_failure_error_function(self.function_tool, failure)

    def arguments(self, data: Any) -> tuple[list[Any], dict[str, Any]]:
        """The model's arguments as the function's (args, kwargs), validated by the SDK's
        parameters model; :class:`ArgumentsRefused` when they do not fit."""
        try:
            if isinstance(data, str):
                data = json.loads(data) if data.strip() else {}
            if not isinstance(data, dict):
                raise ValueError("expected a JSON object")
            return self.schema.to_call_args(self.schema.params_pydantic_model(**data))
        except (ValueError, TypeError, ModelBehaviorError) as exc:  # pydantic's errors too
            raise ArgumentsRefused(f"invalid arguments for tool {self.tool.name}: "
                                   f"{exc}") from None

    async def invoke(self, ctx: ToolContext[Any], input: str) -> Any:
        """The SDK's ``on_invoke_tool``: the journaled step's result for this call id."""
        try:
            args, kwargs = self.arguments(input)
            return await self.tools.call(self.tool, ctx.tool_call_id, args, kwargs)
        except ArgumentsRefused as exc:
            # what the SDK does for arguments that fail its validation: a ModelBehaviorError
            # through failure_error_function, whose text the model reads (None: it raises)
            error = ModelBehaviorError(f"Invalid JSON input for tool {self.tool.name}: {exc}")
            text = await maybe_invoke_function_tool_failure_error_function(
                function_tool=self.function_tool, context=ctx, error=error)
            if text is None:
                raise error from exc
            return text
        # ToolFailed (ApprovalRejected included) and GatePending propagate: the SDK ends
        # the run with them as the cause of its UserError

    async def needs_approval(self, ctx: RunContextWrapper[Any], params: dict[str, Any],
                             call_id: str) -> bool:
        """The SDK's ``needs_approval`` of a gated tool: journals the gate; True while it
        waits. Arguments that do not fit need none: the call goes on to be refused."""
        try:
            args, kwargs = self.arguments(params)
            return await self.tools.pending(self.tool, call_id, args, kwargs)
        except ArgumentsRefused:
            return False

    async def reconcile(self, ctx: RunContextWrapper[Any], agent: AgentBase) -> bool:
        """The gated tool's ``is_enabled``, read each turn before the SDK acts on its
        approval decisions: a closed gate (rejected, cancelled, failed) ends the run; the
        run's own decision on a call whose gate still waits is forgotten (the call stops
        at its interruption again)."""
        saga = self.tools.saga
        record = await offload(saga.rt.journal.inspect, saga.saga_id)
        for e in record.entries:
            if e.call_id is None or e.tool_name != self.tool.spec.name:
                continue
            if e.phase in _CLOSED:  # the saga is failing: no call of it may go on
                await Step(saga.rt, saga.saga_id, e.seq, e.task_id or "", e.tool_name
                           ).aresult(_SETTLED)  # raises ApprovalRejected / ToolFailed
            decided = ctx.is_tool_approved(self.tool.name, e.call_id)
            if decided is not None and (e.phase is Phase.AWAITING_APPROVAL or not decided):
                # no signed approval yet, or the SDK refused a call the journal approved:
                # either way the SDK's decision is not the journal's; ask again
                _forget(ctx, e.call_id)
        return True


def _forget(ctx: RunContextWrapper[Any], call_id: str) -> None:
    """Drop the run's own decision on one call (the SDK has no public way to)."""
    for record in getattr(ctx, "_approvals", {}).values():
        for field in ("approved", "rejected"):
            decided = getattr(record, field, None)
            if isinstance(decided, list) and call_id in decided:
                decided.remove(call_id)
