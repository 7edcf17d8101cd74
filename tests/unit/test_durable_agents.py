"""The Pydantic AI durability in-process (the real journal and replay on SQLite): outside a
flow it changes nothing; inside one, the toolkit's compensation check holds."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from celery import Celery

from sagaworker import ConfigurationError, FlowContext, Sagaworker, Settings
from sagaworker.testing import check_compensation

pytest.importorskip("pydantic_ai")

from pydantic_ai import Agent
from pydantic_ai.messages import ModelResponse, TextPart, ToolCallPart
from pydantic_ai.models.function import FunctionModel

from sagaworker.agents import pydantic_ai as sw_agents

SENT: list[int] = []
AGENT: dict[str, Any] = {}


def book(city: str) -> str:
    """Book a room in a city."""
    return f"room in {city}"


def unbook() -> None:
    return None


def pay(amount: int) -> str:
    """Pay an amount."""
    return f"paid {amount}"


def unpay() -> None:
    return None


def model(messages: list[Any], info: Any) -> ModelResponse:
    turn = sum(isinstance(m, ModelResponse) for m in messages)
    SENT.append(turn)
    plan = [("book", {"city": "Porto"}), ("pay", {"amount": 90})]
    if turn < len(plan):
        name, args = plan[turn]
        return ModelResponse(parts=[ToolCallPart(name, args, tool_call_id=f"c{turn}")])
    return ModelResponse(parts=[TextPart("all set")])


async def trip(s: FlowContext) -> str:
    return str((await AGENT["a"].run("go")).output)


@pytest.fixture
def sw(tmp_path: Path) -> Iterator[Sagaworker]:
    SENT.clear()
    sw = Sagaworker(Celery("durable", broker="memory://"), settings=Settings(
        database_url=f"sqlite:///{tmp_path / 'j.db'}", broker_url="memory://"))
    sw.compensation(unbook)
    sw.compensation(unpay)
    tools = [sw.tool(compensable_by="unbook")(book), sw.tool(compensable_by="unpay")(pay)]
    AGENT["a"] = Agent(FunctionModel(model), name="trip",
                       capabilities=[sw_agents.Durability(sw)],
                       toolsets=[sw_agents.flow_toolset(tools)])
    AGENT["tools"] = tools
    sw.flow()(trip)
    yield sw


def test_outside_a_flow_the_capability_changes_nothing_but_a_flow_tool_refuses(
        sw: Sagaworker) -> None:
    with pytest.raises(ConfigurationError, match="runs inside a flow only"):
        asyncio.run(AGENT["a"].run("go"))
    assert SENT == [0]  # the model was asked, as without the capability


def test_a_flow_toolset_takes_sagaworker_tools_only(sw: Sagaworker) -> None:
    with pytest.raises(ConfigurationError, match="not a sagaworker tool"):
        sw_agents.flow_toolset([book])


def test_a_durable_agent_flow_compensates_its_tools_in_reverse(sw: Sagaworker) -> None:
    """Each tool failed in turn: what ran is undone latest first; the model requests
    (durable units) are no tool of the check."""
    cases = check_compensation(sw, trip)
    assert [c.tool for c in cases] == ["tests.unit.test_durable_agents.book",
                                       "tests.unit.test_durable_agents.pay"]


def test_openai_agents_run_outside_a_flow_is_runner_run(sw: Sagaworker) -> None:
    """Outside a flow: the SDK's own Runner.run; a flow tool refuses to run there."""
    pytest.importorskip("agents")
    from agents import Agent as OaiAgent
    from agents import Model, ModelResponse, Usage, set_tracing_disabled
    from openai.types.responses import ResponseOutputMessage, ResponseOutputText

    from sagaworker.agents import openai_agents as sw_oai

    set_tracing_disabled(True)

    class Says(Model):
        async def get_response(self, *args: Any, **kwargs: Any) -> Any:
            SENT.append(0)
            return ModelResponse(output=[ResponseOutputMessage(
                id="m", type="message", role="assistant", status="completed",
                content=[ResponseOutputText(text="hi", type="output_text", annotations=[],
                                            logprobs=[])])], usage=Usage(), response_id=None)

        def stream_response(self, *args: Any, **kwargs: Any) -> Any:
            raise NotImplementedError

    result = asyncio.run(sw_oai.run(OaiAgent(name="a", model=Says()), "hello"))
    assert result.final_output == "hi" and SENT == [0]
    with pytest.raises(ConfigurationError, match="not a sagaworker tool"):
        sw_oai.flow_tools([book])


def test_which_function_tools_are_run_again_after_a_lost_worker(sw: Sagaworker) -> None:
    """A function tool's call is in doubt after its worker was lost unless it is named in
    ``idempotent_tools`` or its metadata says ``idempotent``; a bare string is refused."""
    from types import SimpleNamespace

    from pydantic_ai import Tool

    from sagaworker.agents._pydantic_ai_durable import _idempotence

    resolve = _idempotence(frozenset({"lookup"}))
    marked = SimpleNamespace(tool_def=Tool(book, metadata={"idempotent": True}).tool_def)
    plain = SimpleNamespace(tool_def=Tool(book).tool_def)
    assert [resolve(None, t, n)["idempotent"] for t, n in [  # type: ignore[arg-type]
        (plain, "lookup"), (marked, "book"), (plain, "book"), (None, "")]] == [
        True, True, False, False]
    with pytest.raises(ConfigurationError, match="pass a set"):
        sw_agents.Durability(sw, idempotent_tools="lookup")
