"""sagaworker.agents.langchain through real workers, with a scripted chat model (no network,
no key): LangChain's create_agent and a LangGraph graph with ToolNode call sagaworker tools
whose outcomes the journal decides, not the framework's error handling."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from collections.abc import Callable, Sequence
from typing import Any

import pytest
from langchain.agents import create_agent
from langchain.agents.middleware import (
    ToolErrorMiddleware,
    ToolRetryMiddleware,
    wrap_tool_call,
)
from langchain_core.language_models import BaseChatModel
from langchain_core.messages import AIMessage, BaseMessage, ToolMessage
from langchain_core.outputs import ChatGeneration, ChatResult
from langchain_core.tools import BaseTool, StructuredTool
from langchain_core.tools.base import create_schema_from_function
from langgraph.checkpoint.memory import InMemorySaver
from langgraph.graph import START, MessagesState, StateGraph
from langgraph.prebuilt import ToolNode, tools_condition
from langgraph.types import Command
from pydantic import Field

from sagaworker import ApprovalRejected, ConfigurationError, Phase, SagaStatus, ToolFailed
from sagaworker.agents import langchain as sw_lc
from sagaworker.agents._core import failed_in
from tests.conftest import ROOT, Cluster, uid

#: the framework's own logic on the journal: make test runs it on one broker, make slow both
pytestmark = pytest.mark.one_broker

T = 60
TOOLS = ("book_hotel", "charge_card", "send_voucher")


# -- the scripted model --------------------------------------------------------------------

class Scripted(BaseChatModel):
    """A chat model that answers from a script: its n-th answer is ``turns[n]``, n being how
    many AI messages the conversation holds (so a replayed or resumed run gets the same
    answer at the same point). Every conversation it was shown is kept in ``seen``."""

    turns: list[AIMessage]
    seen: list[list[BaseMessage]] = Field(default_factory=list)

    @property
    def _llm_type(self) -> str:
        return "scripted"

    def bind_tools(self, tools: Sequence[Any], **kwargs: Any) -> Scripted:  # type: ignore[override]
        return self

    def _generate(self, messages: list[BaseMessage], stop: list[str] | None = None,
                  run_manager: Any = None, **kwargs: Any) -> ChatResult:
        self.seen.append(list(messages))
        n = sum(isinstance(m, AIMessage) for m in messages)
        turn = self.turns[min(n, len(self.turns) - 1)].model_copy(deep=True)
        return ChatResult(generations=[ChatGeneration(message=turn)])


def calls(*wanted: tuple[str, dict[str, Any], str]) -> AIMessage:
    """An AI message asking for tool calls: (tool name, arguments, tool-call id)."""
    return AIMessage("", tool_calls=[{"name": n, "args": a, "id": i, "type": "tool_call"}
                                     for n, a, i in wanted])


def done() -> AIMessage:
    return AIMessage("done")


def trip(key: str, card: str) -> list[AIMessage]:
    """Book the hotel, then pay with ``card``, then say done."""
    return [calls(("book_hotel", {"key": key, "city": "Oslo", "nights": 2}, "h1")),
            calls(("charge_card", {"key": key, "card": card, "amount_cents": 12000}, "c1")),
            done()]


# -- helpers -------------------------------------------------------------------------------

def kinds(c: Cluster, key: str) -> list[tuple[str, str]]:
    return [(r.kind, r.tool) for r in c.ledger(key)]


async def entries(c: Cluster, key: str) -> list[tuple[str, str | None, Phase]]:
    """The saga's entries: (tool, tool-call id, phase), in journal order."""
    rec = await c.sw.ainspect(key)
    return [(e.tool_name.rpartition(".")[2], e.call_id, e.phase) for e in rec.entries]


def adapter_tools(c: Cluster, saga: Any, names: Sequence[str] = TOOLS) -> list[BaseTool]:
    return sw_lc.tools(saga, [c.tool(n) for n in names])


def thread(key: str) -> dict[str, Any]:
    return {"configurable": {"thread_id": key}}


def tool_messages(out: dict[str, Any]) -> list[tuple[str, str]]:
    return [(m.status, str(m.content)) for m in out["messages"] if isinstance(m, ToolMessage)]


def graph(model: Scripted, tools: list[BaseTool], handle: Any) -> Any:
    """A LangGraph agent written by hand: model node, ToolNode, tools_condition."""
    async def agent(state: MessagesState) -> dict[str, Any]:
        return {"messages": [await model.ainvoke(state["messages"])]}

    g = StateGraph(MessagesState)
    g.add_node("agent", agent)
    g.add_node("tools", ToolNode(tools, handle_tool_errors=handle))
    g.add_edge(START, "agent")
    g.add_conditional_edges("agent", tools_condition)
    g.add_edge("tools", "agent")
    return g.compile(checkpointer=InMemorySaver())


@wrap_tool_call
async def swallow_errors(request: Any, handler: Callable[..., Any]) -> Any:
    """The app's own tool error handling, as LangChain's docs show it: any exception
    becomes an error ToolMessage for the model."""
    try:
        return await handler(request)
    except Exception as exc:
        return ToolMessage(f"Tool error: please check your input and try again ({exc})",
                           tool_call_id=request.tool_call["id"], status="error")


def on_error(exc: Exception, request: Any) -> str:
    return f"{request.tool_call['name']} failed: try another card"


def tools_handle_their_errors(tools: list[BaseTool]) -> list[Any]:
    """BaseTool.handle_tool_error on every tool (no middleware)."""
    for t in tools:
        t.handle_tool_error = True
    return []


def handle_everything(exc: Exception) -> str:
    """A custom handle_tool_errors function (its annotation: every Exception)."""
    return f"it did not work ({exc}); try again"


#: create_agent's tool error handling, each configured to hand every error to the model
AGENT_HANDLING: dict[str, Callable[[list[BaseTool]], list[Any]]] = {
    "no-handling": lambda tools: [],
    "ToolErrorMiddleware": lambda tools: [ToolErrorMiddleware(on_error)],
    "ToolRetryMiddleware-continue": lambda tools: [
        ToolRetryMiddleware(max_retries=1, initial_delay=0, on_failure="continue")],
    "wrap_tool_call-returns-error-ToolMessage": lambda tools: [swallow_errors],
    "BaseTool.handle_tool_error": tools_handle_their_errors,
}


# -- without the adapter -------------------------------------------------------------------

#: what the model reads instead of the failure, by the error handling configured
ALONE = {"ToolNode(handle_tool_errors=True)": "Error: Boom('card declined')",
         "create_agent+ToolErrorMiddleware": "charge_card failed: try another card",
         "create_agent+wrap_tool_call": "try again (card declined)"}


@pytest.mark.services
@pytest.mark.parametrize("handling", list(ALONE))
def test_the_framework_alone_hands_the_failure_to_the_model(cluster: Cluster,
                                                             handling: str) -> None:
    """Framework alone: plain @tool functions running the same code (the hotel is booked,
    the declined card raises the same error); LangChain's error handling turns the error
    into an error ToolMessage, the model answers "done", and nothing undoes the hotel."""
    key = uid("lc-alone")
    book = cluster.sw.registry.tool("tests.apps.cluster.book_hotel").fn
    charge = cluster.sw.registry.tool("tests.apps.cluster.charge_card").fn

    async def book_hotel(key: str, city: str, nights: int) -> Any:
        """Book a hotel room in a city for a number of nights."""
        return await asyncio.to_thread(book, key, city, nights)

    async def charge_card(key: str, card: str, amount_cents: int) -> Any:
        """Charge a card."""
        return await charge(key, card, amount_cents)

    plain = [StructuredTool.from_function(coroutine=f) for f in (book_hotel, charge_card)]
    model = Scripted(turns=trip(key, "declined"))

    async def main() -> dict[str, Any]:
        if handling.startswith("ToolNode"):
            return dict(await graph(model, plain, True).ainvoke(
                {"messages": [("user", "book my trip")]}, thread(key)))
        middleware = ([ToolErrorMiddleware(on_error)] if handling.endswith("ErrorMiddleware")
                      else [swallow_errors])
        agent = create_agent(model, tools=plain, middleware=middleware)
        return dict(await agent.ainvoke({"messages": [("user", "book my trip")]}))

    out = asyncio.run(main())
    assert out["messages"][-1].content == "done"
    (ok, _), (status, text) = tool_messages(out)
    assert (ok, status) == ("success", "error")
    assert ALONE[handling] in text
    assert kinds(cluster, key) == [("effect", "book_hotel")]


# -- a failing tool ends the run -----------------------------------------------------------

@pytest.mark.services
@pytest.mark.parametrize("handling", sorted(AGENT_HANDLING))
def test_create_agent_run_ends_and_the_saga_compensates(cluster: Cluster,
                                                        handling: str) -> None:
    """create_agent: book_hotel, then charge_card with the declined card. Whatever tool error
    handling is configured, the run raises RunEnded with ToolFailed as its cause, the model
    is never asked again, and the saga undoes the hotel: exactly [effect, undo]."""
    key = uid("lc-fail")
    model = Scripted(turns=trip(key, "declined"))

    async def main() -> tuple[BaseException, Any, Any]:
        saga = await cluster.sw.abegin(key)
        tools = adapter_tools(cluster, saga)
        agent = create_agent(model, tools=tools, middleware=AGENT_HANDLING[handling](tools))
        with pytest.raises(sw_lc.RunEnded) as raised:
            await agent.ainvoke({"messages": [("user", "book my trip")]})
        return raised.value, await saga.aresult(timeout=T), await entries(cluster, key)

    exc, res, journal = asyncio.run(main())
    failed = failed_in(exc)
    assert isinstance(failed, ToolFailed) and "card declined" in str(failed)
    assert exc.__cause__ is failed
    assert len(model.seen) == 2  # asked for the hotel, then the card; never after the failure
    assert res.status is SagaStatus.COMPENSATED
    assert journal == [("book_hotel", "h1", Phase.EXECUTED), ("charge_card", "c1", Phase.FAILED)]
    assert kinds(cluster, key) == [("effect", "book_hotel"), ("undo", "book_hotel")]


@pytest.mark.services
@pytest.mark.parametrize("handle", [True, handle_everything], ids=["True", "function"])
def test_toolnode_handle_tool_errors_cannot_swallow_a_failed_step(cluster: Cluster,
                                                                   handle: Any) -> None:
    """A LangGraph graph with ToolNode(handle_tool_errors=True, or a handler function): the
    failed charge ends graph.ainvoke with ToolFailed in the cause chain, and the saga
    compensates the hotel."""
    key = uid("lc-node")
    model = Scripted(turns=trip(key, "declined"))

    async def main() -> tuple[BaseException, Any]:
        saga = await cluster.sw.abegin(key)
        app = graph(model, adapter_tools(cluster, saga), handle)
        with pytest.raises(sw_lc.RunEnded) as raised:
            await app.ainvoke({"messages": [("user", "book my trip")]}, thread(key))
        return raised.value, await saga.aresult(timeout=T)

    exc, res = asyncio.run(main())
    assert isinstance(failed_in(exc), ToolFailed)
    assert len(model.seen) == 2
    assert res.status is SagaStatus.COMPENSATED
    assert kinds(cluster, key) == [("effect", "book_hotel"), ("undo", "book_hotel")]


# -- arguments -----------------------------------------------------------------------------

@pytest.mark.services
def test_bad_arguments_go_back_to_the_model_and_journal_nothing(cluster: Cluster) -> None:
    """Arguments the schema refuses (nights="many") and arguments sagaworker refuses (over
    SAGAWORKER_MAX_ARGS_BYTES) come back to the model as LangChain's validation error
    messages and journal nothing; the corrected call journals one step."""
    key = uid("lc-args")
    big = "x" * (cluster.settings.max_args_bytes + 1)
    model = Scripted(turns=[
        calls(("book_hotel", {"key": key, "city": "Oslo", "nights": "many"}, "b1")),
        calls(("book_hotel", {"key": key, "city": big, "nights": 2}, "b2")),
        calls(("book_hotel", {"key": key, "city": "Oslo", "nights": 2}, "b3")),
        done()])

    async def main() -> tuple[dict[str, Any], Any, Any]:
        saga = await cluster.sw.abegin(key)
        agent = create_agent(model, tools=adapter_tools(cluster, saga, ["book_hotel"]))
        out = dict(await agent.ainvoke({"messages": [("user", "book a hotel")]}))
        journal = await entries(cluster, key)
        await saga.acomplete()
        return out, journal, await saga.aresult(timeout=T)

    out, journal, res = asyncio.run(main())
    (s1, t1), (s2, t2), (s3, t3) = tool_messages(out)
    assert (s1, s2, s3) == ("error", "error", "success")
    assert "nights" in t1 and "valid integer" in t1
    assert "SAGAWORKER_MAX_ARGS_BYTES" in t2 and "nothing was journaled" in t2
    assert json.loads(t3) == {"booking": "H-Oslo-2"}
    assert journal == [("book_hotel", "b3", Phase.EXECUTED)]
    assert kinds(cluster, key) == [("effect", "book_hotel")]
    assert res.status is SagaStatus.COMPLETED


# -- gates ---------------------------------------------------------------------------------

def voucher(key: str) -> AIMessage:
    return calls(("send_voucher", {"key": key, "email": "ann@example.com"}, "v1"))


async def token(c: Cluster, key: str) -> str:
    pending = [p for p in await c.sw.apending_approvals() if p.saga_id == key]
    assert len(pending) == 1
    return pending[0].token


@pytest.mark.services
def test_a_gate_waits_for_the_signed_approval_not_the_frameworks(cluster: Cluster) -> None:
    """send_voucher pauses the run with a LangGraph interrupt. Command(resume=approved) from
    the framework alone runs nothing: the call interrupts again, the entry still awaits
    its approval. Once sw.aapprove is given the signed token, the resumed run sends the
    voucher (one step, one effect) and the saga completes."""
    key = uid("lc-gate")
    model = Scripted(turns=[voucher(key), done()])

    async def main() -> None:
        saga = await cluster.sw.abegin(key)
        agent = create_agent(model, tools=adapter_tools(cluster, saga),
                             checkpointer=InMemorySaver())
        out = await agent.ainvoke({"messages": [("user", "mail the voucher")]}, thread(key))
        (paused,) = out["__interrupt__"]
        assert {k: paused.value[k] for k in ("saga_id", "seq", "call_id", "args")} == {
            "saga_id": key, "seq": 1, "call_id": "v1",
            "args": {"key": key, "email": "ann@example.com"}}

        out = await agent.ainvoke(Command(resume={"approved": True}), thread(key))
        assert len(out["__interrupt__"]) == 1  # pending again
        assert await entries(cluster, key) == [("send_voucher", "v1", Phase.AWAITING_APPROVAL)]
        assert await saga.astatus() is SagaStatus.AWAITING_APPROVAL
        assert kinds(cluster, key) == []
        assert len(model.seen) == 1

        await cluster.sw.aapprove(await token(cluster, key), approver="ops@example.com")
        out = await agent.ainvoke(Command(resume={"approved": True}), thread(key))
        assert "__interrupt__" not in out
        assert out["messages"][-1].content == "done"
        assert tool_messages(out) == [("success", "voucher sent to ann@example.com")]
        assert await entries(cluster, key) == [("send_voucher", "v1", Phase.EXECUTED)]
        await saga.acomplete()
        assert (await saga.aresult(timeout=T)).status is SagaStatus.COMPLETED

    asyncio.run(main())
    assert kinds(cluster, key) == [("effect", "send_voucher")]


@pytest.mark.services
def test_a_rejected_gate_ends_the_run_and_compensates(cluster: Cluster) -> None:
    """The hotel is booked, the voucher waits at its gate; sw.areject fails the saga: the
    resumed run raises with ApprovalRejected in its cause chain, the voucher is never
    sent, and the hotel is undone."""
    key = uid("lc-reject")
    model = Scripted(turns=[
        calls(("book_hotel", {"key": key, "city": "Oslo", "nights": 2}, "h1")),
        voucher(key), done()])

    async def main() -> tuple[BaseException, Any]:
        saga = await cluster.sw.abegin(key)
        agent = create_agent(model, tools=adapter_tools(cluster, saga),
                             checkpointer=InMemorySaver())
        out = await agent.ainvoke({"messages": [("user", "book and mail")]}, thread(key))
        assert len(out["__interrupt__"]) == 1
        await cluster.sw.areject(await token(cluster, key), approver="ops@example.com",
                                 reason="wrong customer")
        with pytest.raises(sw_lc.RunEnded) as raised:
            await agent.ainvoke(Command(resume={"approved": True}), thread(key))
        return raised.value, await saga.aresult(timeout=T)

    exc, res = asyncio.run(main())
    assert isinstance(failed_in(exc), ApprovalRejected)
    assert res.status is SagaStatus.COMPENSATED
    assert len(model.seen) == 2
    assert kinds(cluster, key) == [("effect", "book_hotel"), ("undo", "book_hotel")]


# -- one step per tool-call id -------------------------------------------------------------

@pytest.mark.services
def test_a_repeated_tool_call_id_journals_no_second_step(cluster: Cluster) -> None:
    """The graph replayed from the checkpoint before its tools ran calls book_hotel again
    with the same tool-call id, and the same ToolCall invoked twice more by hand: each
    gets the first step's result; one step, one effect."""
    key = uid("lc-replay")
    model = Scripted(turns=[
        calls(("book_hotel", {"key": key, "city": "Oslo", "nights": 2}, "h1")), done()])

    async def main() -> list[str]:
        saga = await cluster.sw.abegin(key)
        tools = adapter_tools(cluster, saga, ["book_hotel"])
        agent = create_agent(model, tools=tools, checkpointer=InMemorySaver())
        first = await agent.ainvoke({"messages": [("user", "book a hotel")]}, thread(key))
        before_tools = [s async for s in agent.aget_state_history(thread(key))
                        if s.next == ("tools",)]
        assert len(before_tools) == 1
        replayed = await agent.ainvoke(None, before_tools[0].config)
        call = dict(model.turns[0].tool_calls[0])
        by_hand = [await tools[0].ainvoke(call) for _ in range(2)]
        assert await entries(cluster, key) == [("book_hotel", "h1", Phase.EXECUTED)]
        await saga.acomplete()
        return [tool_messages(first)[0][1], tool_messages(replayed)[0][1],
                *(str(m.content) for m in by_hand)]

    results = asyncio.run(main())
    assert [json.loads(r) for r in results] == [{"booking": "H-Oslo-2"}] * 4
    assert kinds(cluster, key) == [("effect", "book_hotel")]


# -- async tools, a whole trip -------------------------------------------------------------

@pytest.mark.services
def test_a_trip_with_an_async_tool_completes(cluster: Cluster) -> None:
    """book_hotel, then charge_card (async def on the worker) with a good card: the model
    gets both journaled results, answers done, and the saga completes."""
    key = uid("lc-ok")
    model = Scripted(turns=trip(key, "4242"))

    async def main() -> tuple[dict[str, Any], Any, Any]:
        saga = await cluster.sw.abegin(key)
        agent = create_agent(model, tools=adapter_tools(cluster, saga))
        out = dict(await agent.ainvoke({"messages": [("user", "book my trip")]}))
        journal = await entries(cluster, key)
        await saga.acomplete()
        return out, journal, await saga.aresult(timeout=T)

    out, journal, res = asyncio.run(main())
    assert out["messages"][-1].content == "done"
    assert [(s, json.loads(t)) for s, t in tool_messages(out)] == [
        ("success", {"booking": "H-Oslo-2"}), ("success", {"charge": "C-12000"})]
    assert journal == [("book_hotel", "h1", Phase.EXECUTED),
                       ("charge_card", "c1", Phase.EXECUTED)]
    assert res.status is SagaStatus.COMPLETED
    assert kinds(cluster, key) == [("effect", "book_hotel"), ("effect", "charge_card")]


# -- the tools as LangChain builds them ----------------------------------------------------

@pytest.mark.services
def test_names_descriptions_and_schemas_are_langchains_own(cluster: Cluster) -> None:
    """Each tool's name, description and model-facing schema are what LangChain builds
    from the tool function itself; the tool-call id is injected, never shown the model."""
    saga = cluster.sw.begin(uid("lc-schema"))
    for t in adapter_tools(cluster, saga):
        fn = cluster.sw.registry.tool(f"tests.apps.cluster.{t.name}").fn
        plain = StructuredTool.from_function(func=fn)
        assert (t.name, t.description) == (fn.__name__, plain.description)
        assert t.tool_call_schema.model_json_schema() == \
            create_schema_from_function(t.name, fn).model_json_schema()
        assert sw_lc.CALL_ID in t.get_input_schema().model_fields
    saga.fail("only the schemas were looked at")


@pytest.mark.parametrize("missing", ["langchain_core", "langgraph"])
def test_importing_without_the_framework_names_the_extra(missing: str) -> None:
    """Without langchain-core or langgraph, importing the adapter raises ConfigurationError
    naming the extra sagaworker[langchain]; with them, its framework names are
    LangChain's own (the module named langchain does not shadow the framework)."""
    code = (f"import sys; sys.modules[{missing!r}] = None\n"
            "from sagaworker import ConfigurationError\n"
            "try:\n    import sagaworker.agents.langchain\n"
            "except ConfigurationError as exc:\n    print(exc)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=ROOT, env={"PYTHONPATH": str(ROOT)}, timeout=60, check=True)
    assert "pip install 'sagaworker[langchain]'" in out.stdout
    assert sw_lc.StructuredTool.__module__ == "langchain_core.tools.structured"


@pytest.mark.services
def test_a_gated_tool_outside_a_graph_says_how_to_run_it(cluster: Cluster) -> None:
    """send_voucher invoked on its own (no graph to interrupt) raises ConfigurationError
    saying to run it in a graph with a checkpointer; its gate stays closed."""
    key = uid("lc-nograph")

    async def main() -> None:
        saga = await cluster.sw.abegin(key)
        (send,) = adapter_tools(cluster, saga, ["send_voucher"])
        with pytest.raises(ConfigurationError, match="compiled with a checkpointer"):
            await send.ainvoke(dict(voucher(key).tool_calls[0]))
        assert await entries(cluster, key) == [("send_voucher", "v1", Phase.AWAITING_APPROVAL)]
        await saga.afail("no graph to resume")
        assert (await saga.aresult(timeout=T)).status is SagaStatus.COMPENSATED

    asyncio.run(main())
    assert kinds(cluster, key) == []


def test_the_interrupt_payload_carries_redacted_arguments(
        tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """The gate's LangGraph interrupt payload (checkpointed, shown to people) carries the
    call's arguments redacted as everywhere else: SAGAWORKER_REDACT=card hides the card."""
    from celery import Celery

    from sagaworker import Reversibility, Sagaworker, Settings
    from tests.conftest import UNIT_SECRET

    sw = Sagaworker(Celery("lc-redact", broker="memory://"), settings=Settings(
        database_url=f"sqlite:///{tmp_path / 'j.db'}", broker_url="memory://",
        approval_secret=UNIT_SECRET, redact="card", broker_folder=str(tmp_path / "b")))

    @sw.tool(reversibility=Reversibility.IRREVERSIBLE)
    def pay_out(card: str, amount: int) -> str:
        """Pays out to a card."""
        return "paid"

    class Paused(Exception):
        pass

    seen: list[dict[str, Any]] = []

    def fake_interrupt(payload: dict[str, Any]) -> None:
        seen.append(payload)
        raise Paused

    monkeypatch.setattr(sw_lc, "interrupt", fake_interrupt)
    sw.journal.create_all()

    async def main() -> None:
        saga = await sw.abegin("lc-r-1")
        (tool,) = sw_lc.tools(saga, [pay_out])
        call = {"name": "pay_out", "args": {"card": "4111111111111111", "amount": 5},
                "id": "p1", "type": "tool_call"}
        with pytest.raises(Paused):
            await tool.ainvoke(call)

    asyncio.run(main())
    assert [p["args"] for p in seen] == [{"card": "[REDACTED]", "amount": 5}]
    assert "4111111111111111" not in json.dumps(seen)
