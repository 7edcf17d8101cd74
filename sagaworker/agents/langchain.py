"""LangChain and LangGraph tools whose calls are saga steps (the extra ``sagaworker[langchain]``).

``tools(saga, [book_hotel, charge_card, send_voucher])`` returns LangChain tools for
``langchain.agents.create_agent`` and LangGraph's ``ToolNode``. Each is a
``StructuredTool`` whose name, description and argument schema LangChain builds from the
tool's own function (``create_schema_from_function``), plus the tool-call id injected by
LangChain itself (``InjectedToolCallId``), which the model never sees:

- a call journals one step of the saga, the ToolCall's ``id`` on the entry; the same id
  again (a graph replayed from a checkpoint, a resumed run) finds that step, never a
  second one;
- arguments the schema refuses, or that sagaworker refuses (not JSON, too large), journal
  nothing and go back to the model through LangChain's own validation path (a pydantic
  ``ValidationError``: ``ToolNode`` turns it into an error ``ToolMessage`` to retry from);
- an IRREVERSIBLE tool's call pauses the run with a LangGraph ``interrupt`` (the graph
  needs a checkpointer). ``Command(resume=...)`` alone decides nothing: the resumed call
  reads the journal and interrupts again until the gate holds an approval made with a
  signed token (``sw.approve``, the CLI, the dashboard); a rejection ends the run;
- a FAILED (or rejected) step ends the run with :class:`RunEnded`, whose ``__cause__`` is
  the :class:`~sagaworker.ToolFailed`: the saga compensates, and no configured error
  handling (``handle_tool_errors``, ``handle_tool_error``, ``ToolErrorMiddleware``, an
  app's ``wrap_tool_call`` that returns an error ``ToolMessage``) hands it to the model.

Run the agent or graph asynchronously (``ainvoke``, ``astream``): a step is awaited on the
journal's notifications without blocking the loop.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterable
from typing import Annotated, Any

from .._base.errors import ConfigurationError, ToolFailed
from .._observe.redact import redact_call
from .._producer.saga import Saga
from ._core import AgentTool, AgentTools, ArgumentsRefused, GatePending, require

for _framework in ("langchain_core.tools", "langgraph.types"):
    require(_framework, "langchain")

# imported once require() has said which extra is missing, if one is
from langchain_core.tools import BaseTool, InjectedToolCallId, StructuredTool  # noqa: E402
from langchain_core.tools.base import create_schema_from_function  # noqa: E402
from langgraph.types import interrupt  # noqa: E402
from pydantic import BaseModel, ValidationError, create_model  # noqa: E402
from pydantic_core import InitErrorDetails, PydanticCustomError  # noqa: E402

__all__ = ["CALL_ID", "RunEnded", "tools"]

#: the argument LangChain fills with the ToolCall's id (absent from the model's schema)
CALL_ID = "sagaworker_call_id"


class RunEnded(BaseException):
    """A tool call's step FAILED, or its gate was rejected: the agent run ends here, and the
    saga compensates its executed steps. ``__cause__`` (and ``.failed``) is the
    :class:`~sagaworker.ToolFailed` (:class:`~sagaworker.ApprovalRejected` for a rejection).

    A ``BaseException`` on purpose, as ``asyncio.CancelledError`` and pytest's outcomes
    are: LangChain's tool error handling, and the ``wrap_tool_call`` middleware its docs
    show, catch ``Exception`` and give it to the model as an error ``ToolMessage``; the
    model would go on and answer as if the trip stood while its effects are being
    undone. Catch ``RunEnded`` (or use ``sagaworker.agents._core.failed_in``) where the
    run is awaited."""

    def __init__(self, failed: ToolFailed) -> None:
        super().__init__(f"the agent run ended: {failed}; the saga is compensating its "
                         "executed steps (the ToolFailed is this exception's __cause__)")
        self.failed = failed


def tools(saga: Saga, tools: Iterable[Any]) -> list[BaseTool]:
    """The ``@sw.tool`` functions ``tools`` as LangChain tools journaled in ``saga``."""
    agent_tools = AgentTools(saga, tools)
    return [_structured(agent_tools, tool) for tool in agent_tools]


def _structured(tools: AgentTools, tool: AgentTool) -> StructuredTool:
    """One LangChain tool: LangChain's schema of the function, plus the injected call id."""
    signature = inspect.signature(tool.fn)
    if CALL_ID in signature.parameters:
        raise ConfigurationError(
            f"tool {tool.spec.name!r} has a parameter named {CALL_ID!r}, the name the "
            "LangChain adapter gives the tool-call id: rename the parameter")
    base = create_schema_from_function(tool.name, tool.fn)
    if not issubclass(base, BaseModel):  # a pydantic.v1 model: not what LangChain 1.x builds
        raise ConfigurationError(f"LangChain built a pydantic v1 schema for {tool.spec.name!r}")
    injected: dict[str, Any] = {CALL_ID: (Annotated[str, InjectedToolCallId], ...)}
    schema = create_model(tool.name, __base__=base, __doc__=base.__doc__, **injected)

    async def call(*, sagaworker_call_id: Annotated[str, InjectedToolCallId],
                   **given: Any) -> Any:
        args, kwargs = _split(signature, given)
        try:
            return await _outcome(tools, tool, sagaworker_call_id, args, kwargs, given)
        except ArgumentsRefused as refused:
            raise _refusal(tool, refused, given) from None
        except ToolFailed as failed:
            raise RunEnded(failed) from failed

    call.__name__ = call.__qualname__ = tool.name
    call.__doc__ = tool.fn.__doc__
    # no docstring: an empty description (LangChain refuses a tool with none at all)
    return StructuredTool.from_function(coroutine=call, name=tool.name, args_schema=schema,
                                        description=None if tool.fn.__doc__ else "")


async def _outcome(tools: AgentTools, tool: AgentTool, call_id: str, args: list[Any],
                   kwargs: dict[str, Any], given: dict[str, Any]) -> Any:
    """The step's journaled result. At a gate, the run pauses with an interrupt; a resumed
    run gets the framework's resume value back from ``interrupt``, ignores it and reads the
    journal again: still waiting, the next ``interrupt`` pauses the run once more (LangGraph
    matches resume values to interrupts by their order in the task, so each resume answers
    one of them and the loop ends)."""
    while True:
        try:
            return await tools.call(tool, call_id, args, kwargs)
        except GatePending as gate:
            # the payload is the framework's: checkpointed, shown to a human, maybe logged.
            # Its arguments are redacted as everywhere else (SAGAWORKER_REDACT)
            shown = redact_call(tool.spec.signature, [], given,
                                tools.saga.rt.settings.redact_keys)[1]
            _pause(gate, call_id, shown)


def _pause(gate: GatePending, call_id: str, arguments: dict[str, Any]) -> None:
    """Interrupt the graph at the gate (returns only on a resumed run); ``arguments`` as
    people may see them (redacted)."""
    step = gate.step
    try:
        interrupt({"sagaworker": "approval", "saga_id": step.saga_id, "seq": step.seq,
                   "tool": step.tool_name, "call_id": call_id, "args": arguments,
                   "message": str(gate)})
    except (RuntimeError, KeyError) as exc:  # no graph around the call to interrupt
        raise ConfigurationError(
            f"{gate}. A gated tool pauses the run with a LangGraph interrupt: call it from "
            "a graph (create_agent, a StateGraph with ToolNode) compiled with a "
            f"checkpointer, not on its own ({type(exc).__name__}: {exc})") from exc


def _split(signature: inspect.Signature, given: dict[str, Any]) -> tuple[list[Any],
                                                                          dict[str, Any]]:
    """The validated arguments as the function takes them: positional parameters
    positionally (an undo reads ``ctx.args``), the rest by keyword; one call always
    splits the same way, so a repeated call id finds the same arguments."""
    args: list[Any] = []
    kwargs = dict(given)
    positional = True
    for name, param in signature.parameters.items():
        if param.kind is param.VAR_POSITIONAL:
            if positional:  # else left by its name: binding refuses it, as it must
                args.extend(kwargs.pop(name, ()))
        elif param.kind is param.VAR_KEYWORD:
            kwargs.update(kwargs.pop(name, None) or {})
        elif param.kind in (param.POSITIONAL_ONLY, param.POSITIONAL_OR_KEYWORD):
            positional = positional and name in kwargs
            if positional:
                args.append(kwargs.pop(name))
    return args, kwargs


def _refusal(tool: AgentTool, refused: ArgumentsRefused,
             given: dict[str, Any]) -> ValidationError:
    """sagaworker's refusal as the pydantic ValidationError LangChain reports to the model
    (``ToolNode`` makes it a ``ToolInvocationError``, its default handler a message)."""
    return ValidationError.from_exception_data(tool.name, [InitErrorDetails(
        type=PydanticCustomError("arguments_refused", "{reason}", {"reason": str(refused)}),
        loc=("arguments",), input=dict(given))])
