"""Agent hosts that know nothing of sagas, each with `sagaworker mcp` as its MCP server over
stdio and a scripted model, with real workers: Pydantic AI (``MCPToolset`` on FastMCP's
client, which declares the tasks extension, as the ``pydantic-ai[mcp-tasks]`` extra has it)
and the OpenAI Agents SDK (``agents.mcp.MCPServerStdio`` on the MCP SDK's client). The model
begins a saga, books a hotel, then charges a declined card: the hotel is undone once, and
the model's next request tells it what was undone and not to retry in this saga."""

from __future__ import annotations

import json
import re
from typing import Any

import anyio
import pytest
from agents import Agent, ModelResponse, Runner, Usage, set_tracing_disabled
from agents.mcp import MCPServerStdio
from agents.models.interface import Model
from openai.types.responses import (
    ResponseFunctionToolCall,
    ResponseOutputMessage,
    ResponseOutputText,
)
from pydantic_ai import Agent as PaiAgent
from pydantic_ai.mcp import MCPToolset
from pydantic_ai.messages import ModelMessage, ModelRequest, TextPart, ToolCallPart
from pydantic_ai.messages import ModelResponse as PaiResponse
from pydantic_ai.models.function import AgentInfo, FunctionModel

from sagaworker import Phase, SagaStatus
from tests.conftest import ROOT, Cluster, uid
from tests.mcp.serve import COMMAND, env, stdio_transport

pytestmark = [pytest.mark.services, pytest.mark.one_broker]
set_tracing_disabled(True)  # no trace exporter, no key

SAGA_ID = re.compile(r"mcp-[A-Za-z0-9_-]{20,}")
#: what the FAILED answer says, as the model must read it
UNDONE = "book_hotel (step 1) COMPENSATED"
NO_RETRY = "Do not retry it, nor call other tools in this saga"


def plan(key: str, saga_id: str) -> list[tuple[str, dict[str, Any]]]:
    """The calls of turns 1 and 2 (turn 0 begins the saga)."""
    return [("book_hotel", {"saga_id": saga_id, "key": key, "city": "Lisbon", "nights": 2}),
            ("charge_card", {"saga_id": saga_id, "key": key, "card": "declined",
                             "amount_cents": 42000})]


def check(c: Cluster, key: str, requests: list[str]) -> str:
    """The run's effects and the request after the failed call; the saga's id."""
    assert len(requests) == 4, requests
    saga_id = SAGA_ID.search(requests[1])
    assert saga_id is not None, requests[1]
    rec = c.sw.inspect(saga_id.group(0))
    assert rec.status is SagaStatus.COMPENSATED
    assert [(e.seq, e.tool_name.rsplit(".", 1)[-1], e.phase) for e in rec.entries] == [
        (1, "book_hotel", Phase.EXECUTED), (2, "charge_card", Phase.FAILED)]
    assert [(r.kind, r.tool) for r in c.ledger(key)] == [("effect", "book_hotel"),
                                                         ("undo", "book_hotel")]
    assert "card declined" in requests[3]
    assert UNDONE in requests[3] and NO_RETRY in requests[3]
    assert UNDONE not in requests[2]
    return saga_id.group(0)


def test_pydantic_ai_agent_is_told_what_was_undone(cluster: Cluster) -> None:
    """Pydantic AI: the failed call's isError answer comes back to the model as a retry
    prompt carrying the server's text (what was undone, do not retry in this saga)."""
    key = uid("mcp")
    requests: list[str] = []

    def model(messages: list[ModelMessage], info: AgentInfo) -> PaiResponse:
        turn = sum(isinstance(m, PaiResponse) for m in messages)
        last = messages[-1]
        requests.append(repr(last.parts) if isinstance(last, ModelRequest) else "")
        if turn == 0:
            return PaiResponse(parts=[ToolCallPart("saga_begin", {"purpose": "a trip"},
                                                   tool_call_id="c0")])
        if turn < 3:
            found = SAGA_ID.search("".join(requests))
            assert found is not None, requests
            name, args = plan(key, found.group(0))[turn - 1]
            return PaiResponse(parts=[ToolCallPart(name, args, tool_call_id=f"c{turn}")])
        return PaiResponse(parts=[TextPart("The card was declined; the hotel is cancelled.")])

    async def body() -> str:
        toolset = MCPToolset(stdio_transport(cluster, "--wait", "30"))
        agent = PaiAgent(FunctionModel(model), toolsets=[toolset])
        return str((await agent.run("Book a hotel in Lisbon and pay for it")).output)

    assert anyio.run(body) == "The card was declined; the hotel is cancelled."
    check(cluster, key, requests)
    assert "outcome='retried'" in requests[3] and "charge_card FAILED (step 2" in requests[3]


class Scripted(Model):
    """The OpenAI Agents SDK's Model interface, answering from the plan: turn 0 begins the
    saga, turns 1 and 2 call the tools, then it answers. Every input it is given is kept."""

    def __init__(self, key: str) -> None:
        self.key = key
        self.seen: list[list[Any]] = []

    async def get_response(self, system_instructions: str | None, input: Any,
                           *args: Any, **kwargs: Any) -> ModelResponse:
        given = [input] if isinstance(input, str) else list(input)
        self.seen.append(given)
        turn = len(self.seen) - 1
        if turn == 0:
            out: list[Any] = [call("saga_begin", "c0", {"purpose": "a trip"})]
        elif turn < 3:
            found = SAGA_ID.search(json.dumps(given, default=str))
            assert found is not None, given
            name, args_ = plan(self.key, found.group(0))[turn - 1]
            out = [call(name, f"c{turn}", args_)]
        else:
            out = [ResponseOutputMessage(
                id="msg", type="message", role="assistant", status="completed",
                content=[ResponseOutputText(text="The card was declined.", type="output_text",
                                            annotations=[], logprobs=[])])]
        return ModelResponse(output=out, usage=Usage(), response_id=None)

    def stream_response(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError("the scripted model answers get_response only")


def call(name: str, call_id: str, arguments: dict[str, Any]) -> ResponseFunctionToolCall:
    return ResponseFunctionToolCall(id=f"fc-{call_id}", call_id=call_id, type="function_call",
                                    name=name, arguments=json.dumps(arguments))


def told(given: list[Any]) -> str:
    """What the tools answered the model in the input it was given, the latest last."""
    return json.dumps([i["output"] for i in given
                       if isinstance(i, dict) and i.get("type") == "function_call_output"],
                      default=str)


def test_openai_agents_sdk_agent_is_told_what_was_undone(cluster: Cluster) -> None:
    """The OpenAI Agents SDK: the failed call's isError content is the function call's
    output in the model's next input (what was undone, do not retry in this saga)."""
    key = uid("mcp")
    model = Scripted(key)

    async def body() -> str:
        server = MCPServerStdio(
            {"command": COMMAND[0], "args": [*COMMAND[1:], "--wait", "30"],
             "env": env(cluster), "cwd": str(ROOT)},
            name="trips", client_session_timeout_seconds=60)
        async with server:
            agent = Agent(name="trip", model=model, mcp_servers=[server])
            result = await Runner.run(agent, "Book a hotel in Lisbon and pay for it")
            return str(result.final_output)

    assert anyio.run(body) == "The card was declined."
    check(cluster, key, [told(given) for given in model.seen])
