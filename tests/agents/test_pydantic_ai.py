"""The Pydantic AI adapter through real worker processes, with Pydantic AI's own scripted
model (FunctionModel): a tool call is one journaled saga step, and the journal, not the
framework, decides what happened."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from collections.abc import Callable, Sequence
from typing import Any

import pytest
from pydantic import BaseModel
from pydantic_ai import (
    Agent,
    DeferredToolRequests,
    DeferredToolResults,
    ModelRetry,
    RunContext,
    Tool,
)
from pydantic_ai.capabilities import Hooks
from pydantic_ai.messages import (
    ModelMessage,
    ModelRequest,
    ModelResponse,
    ModelResponsePart,
    TextPart,
    ToolCallPart,
    ToolReturnPart,
)
from pydantic_ai.models.function import AgentInfo, FunctionModel
from pydantic_ai.toolsets import FunctionToolset

from sagaworker import ApprovalRejected, Phase, SagaStatus, ToolFailed
from sagaworker._producer.saga import Saga
from sagaworker.agents import pydantic_ai as sw_agents
from sagaworker.agents._core import failed_in
from tests.conftest import ROOT, Cluster, uid

pytestmark = [pytest.mark.services, pytest.mark.one_broker]
T = 60
TRIP = ("book_hotel", "charge_card", "send_voucher")


class Script:
    """A scripted model: each model request takes the next response; every request's
    messages are kept, so a test sees exactly what the model was told."""

    def __init__(self, *responses: Sequence[ModelResponsePart]) -> None:
        self.responses = [ModelResponse(parts=list(r)) for r in responses]
        self.seen: list[list[ModelMessage]] = []
        self.tools: list[Any] = []

    def __call__(self, messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
        self.seen.append(list(messages))
        self.tools = list(info.function_tools)
        if not self.responses:
            raise AssertionError("the model was asked once more than scripted")
        return self.responses.pop(0)

    def model(self) -> FunctionModel:
        return FunctionModel(self)

    def told(self, request: int) -> list[tuple[str, str, str]]:
        """The tool returns model request ``request`` (0-based) brought the model, as
        (outcome, tool-call id, text): "success", or "retried" for a retry prompt."""
        last = self.seen[request][-1]
        assert isinstance(last, ModelRequest)
        return [(p.outcome, p.tool_call_id, p.model_response_str()) for p in last.parts
                if isinstance(p, ToolReturnPart)]


def call(tool: str, call_id: str, **args: Any) -> ToolCallPart:
    return ToolCallPart(tool, args, tool_call_id=call_id)


def kinds(c: Cluster, key: str) -> list[tuple[str, str]]:
    return [(r.kind, r.tool) for r in c.ledger(key)]


def trip_tools(c: Cluster) -> list[Any]:
    return [c.tool(name) for name in TRIP]


async def entries(c: Cluster, key: str) -> list[tuple[str, str | None, Phase]]:
    rec = await c.sw.ainspect(key)
    return [(e.tool_name.rsplit(".", 1)[-1], e.call_id, e.phase) for e in rec.entries]


def hotel(key: str, call_id: str = "h1") -> ToolCallPart:
    return call("book_hotel", call_id, key=key, city="Lisbon", nights=3)


def declined(key: str, call_id: str = "c1") -> ToolCallPart:
    return call("charge_card", call_id, key=key, card="declined", amount_cents=45_000)


# -- the framework's error handling, at its most forgiving ------------------------

def swallow_into_result() -> dict[str, Any]:
    """A capability whose on_tool_execute_error hands every tool error to the model as
    the tool's result."""
    hooks = Hooks[Any]()

    @hooks.on.tool_execute_error
    async def as_result(ctx: RunContext[Any], *, call: Any, tool_def: Any, args: Any,
                        error: Exception) -> Any:
        return f"the tool failed: {error}; try something else"

    return {"capabilities": [hooks]}


def swallow_into_retry() -> dict[str, Any]:
    """A capability whose wrap_tool_execute turns every tool error into a ModelRetry,
    with a generous retry budget."""
    hooks = Hooks[Any]()

    @hooks.on.tool_execute
    async def as_retry(ctx: RunContext[Any], *, call: Any, tool_def: Any, args: Any,
                       handler: Callable[[Any], Any]) -> Any:
        try:
            return await handler(args)
        except Exception as exc:
            raise ModelRetry(f"the tool failed: {exc}; try again") from exc

    return {"capabilities": [hooks], "retries": 10}


def swallow_beside_output() -> dict[str, Any]:
    """The error handed to the model as a result, and the model's final output in the same
    response as the failing call (the default end strategy runs the call first, then ends
    the run with the output: no next model request)."""
    return {**swallow_into_result(), "output_type": Trip}


FORGIVING = {"into-result": swallow_into_result, "into-retry": swallow_into_retry,
             "beside-output": swallow_beside_output}


class Trip(BaseModel):
    status: str


def final(**fields: Any) -> ToolCallPart:
    return ToolCallPart("final_result", fields, tool_call_id="out")


def failing_response(key: str, config: str) -> list[ModelResponsePart]:
    if config == "beside-output":
        return [declined(key), final(status="booked")]
    return [declined(key)]


# -- tests --------------------------------------------------------------------------

def test_schemas_come_from_pydantic_ais_own_builder(cluster: Cluster) -> None:
    """Each tool's name, description and JSON schema are what Pydantic AI's Tool builds from
    the @sw.tool function itself; ``key`` is an argument like any other."""
    key = uid("pa-schema")
    script = Script([TextPart("nothing to do")])

    async def main() -> None:
        saga = await cluster.sw.abegin(key)
        agent = Agent(script.model(), toolsets=[sw_agents.toolset(saga, trip_tools(cluster))])
        await agent.run("list your tools")
        await saga.acomplete()

    asyncio.run(main())
    fns = [cluster.sw.registry.tool(f"tests.apps.cluster.{n}").fn for n in TRIP]
    own = [Tool(fn, takes_ctx=False).tool_def for fn in fns]
    assert [(t.name, t.description, t.parameters_json_schema) for t in script.tools] == [
        (t.name, t.description, t.parameters_json_schema) for t in own]
    assert [t.name for t in script.tools] == list(TRIP)
    assert script.tools[0].parameters_json_schema["required"] == ["key", "city", "nights"]
    assert script.tools[0].description == "Book a hotel room in a city for a number of nights."


def test_a_failing_tool_ends_the_run_and_the_saga_compensates(cluster: Cluster) -> None:
    """book_hotel, then charge_card with a declined card: the run raises with ToolFailed in
    its cause chain, the model is never asked again, and the saga compensates the hotel."""
    key = uid("pa-fail")
    script = Script([hotel(key)], [declined(key)], [TextPart("all booked")])

    async def main() -> tuple[BaseException, Any]:
        saga = await cluster.sw.abegin(key)
        agent = Agent(script.model(), toolsets=[sw_agents.toolset(saga, trip_tools(cluster))])
        with pytest.raises(Exception) as caught:
            await agent.run("book Lisbon and pay")
        return caught.value, await saga.aresult(T)

    exc, res = asyncio.run(main())
    failure = failed_in(exc)
    assert isinstance(failure, ToolFailed) and "card declined" in str(failure)
    assert (failure.saga_id, failure.seq) == (key, 2)
    assert len(script.seen) == 2  # the model never read the failure
    assert res.status is SagaStatus.COMPENSATED
    assert kinds(cluster, key) == [("effect", "book_hotel"), ("undo", "book_hotel")]
    assert [(t, c) for t, c, _ in asyncio.run(entries(cluster, key))] == [
        ("book_hotel", "h1"), ("charge_card", "c1")]


@pytest.mark.parametrize("config", sorted(FORGIVING))
def test_plain_pydantic_ai_with_forgiving_handling_feeds_the_error_to_the_model(
        config: str) -> None:
    """The framework alone: a plain Pydantic AI tool raising the same ToolFailed under the
    forgiving configuration is handed to the model (as a result or a retry) and the run
    completes: the configurations really do swallow tool errors."""
    def charge_card(key: str, card: str, amount_cents: int) -> str:
        """Charge a card."""
        raise ToolFailed("step 2 (charge_card) failed: Boom: card declined")

    responses = [failing_response("k", config)]
    if config != "beside-output":  # else the output beside the call ends the run
        responses.append([TextPart("gave up")])
    script = Script(*responses)
    options = FORGIVING[config]()
    agent = Agent(script.model(), toolsets=[FunctionToolset([charge_card])], **options)
    result = asyncio.run(agent.run("pay"))
    assert result.output == (Trip(status="booked") if config == "beside-output" else "gave up")
    if config != "beside-output":
        [(outcome, call_id, text)] = script.told(1)
        assert (outcome, call_id) == ("success" if config == "into-result" else "retried", "c1")
        assert "card declined" in text


@pytest.mark.parametrize("config", sorted(FORGIVING))
def test_a_failing_tool_ends_the_run_whatever_error_handling_is_configured(
        cluster: Cluster, config: str) -> None:
    """The same trip under the framework's most forgiving error handling: the run still
    raises with ToolFailed in its cause chain, before the model reads the failure (or instead
    of the output it returned beside the failing call); the saga compensates."""
    key = uid(f"pa-{config}")
    script = Script([hotel(key)], failing_response(key, config), [TextPart("all booked")])

    async def main() -> tuple[BaseException, Any]:
        saga = await cluster.sw.abegin(key)
        agent = Agent(script.model(), toolsets=[sw_agents.toolset(saga, trip_tools(cluster))],
                      **FORGIVING[config]())
        with pytest.raises(Exception) as caught:
            await agent.run("book Lisbon and pay")
        return caught.value, await saga.aresult(T)

    exc, res = asyncio.run(main())
    assert isinstance(failed_in(exc), ToolFailed)
    assert "card declined" in str(failed_in(exc))
    assert len(script.seen) == 2  # never a third request: the model never read the failure
    assert res.status is SagaStatus.COMPENSATED
    assert kinds(cluster, key) == [("effect", "book_hotel"), ("undo", "book_hotel")]


def test_arguments_that_do_not_fit_go_back_as_a_retry_and_journal_nothing(
        cluster: Cluster) -> None:
    """Arguments Pydantic AI's validator refuses (nights="many") and arguments the journal
    refuses (a city over SAGAWORKER_MAX_ARGS_BYTES) each go back to the model as a retry
    prompt and journal nothing; the corrected call journals one step."""
    key = uid("pa-args")
    script = Script([call("book_hotel", "b1", key=key, city="Lisbon", nights="many")],
                    [call("book_hotel", "b2", key=key, city="L" * 300_000, nights=3)],
                    [hotel(key, "b3")], [TextPart("booked")])

    async def main() -> Any:
        saga = await cluster.sw.abegin(key)
        agent = Agent(script.model(), retries=3,
                      toolsets=[sw_agents.toolset(saga, trip_tools(cluster))])
        result = await agent.run("book Lisbon")
        after_retries = await entries(cluster, key)
        await saga.acomplete()
        return result, after_retries, await saga.aresult(T)

    result, journaled, res = asyncio.run(main())
    assert result.output == "booked"
    told = [script.told(n)[0] for n in (1, 2, 3)]
    assert [(outcome, call_id) for outcome, call_id, _ in told] == [
        ("retried", "b1"), ("retried", "b2"), ("success", "b3")]
    assert "valid integer" in told[0][2]
    assert "SAGAWORKER_MAX_ARGS_BYTES" in told[1][2] and "nothing was journaled" in told[1][2]
    assert journaled == [("book_hotel", "b3", Phase.EXECUTED)]
    assert kinds(cluster, key) == [("effect", "book_hotel")]
    assert res.status is SagaStatus.COMPLETED


def gated_script(key: str, *after: Sequence[ModelResponsePart]) -> Script:
    return Script([hotel(key)], [call("send_voucher", "v1", key=key, email="ana@example.org")],
                  *after)


async def deferred_run(c: Cluster, key: str, script: Script) -> tuple[Saga, Any, Any]:
    """Book the hotel, then reach the voucher's gate: the run ends deferred."""
    saga = await c.sw.abegin(key)
    agent = Agent(script.model(), output_type=[str, DeferredToolRequests],
                  toolsets=[sw_agents.toolset(saga, trip_tools(c))])
    first = await agent.run("book Lisbon and mail the voucher")
    return saga, agent, first


async def token_of(c: Cluster, key: str) -> str:
    return next(r.token for r in await c.sw.apending_approvals() if r.saga_id == key)


def approved_by_framework(call_id: str = "v1") -> DeferredToolResults:
    return DeferredToolResults(approvals={call_id: True})


def test_the_frameworks_approval_alone_keeps_the_gate_pending(cluster: Cluster) -> None:
    """The voucher call pauses the run as a deferred approval; a resumed run approved in
    DeferredToolResults only still pends (no voucher mailed, the entry AWAITING_APPROVAL);
    once the gate is approved with its signed token, the resumed run mails it and completes."""
    key = uid("pa-gate")
    script = gated_script(key, [TextPart("voucher mailed")])

    async def main() -> dict[str, Any]:
        saga, agent, first = await deferred_run(cluster, key, script)
        seen: dict[str, Any] = {"first": first.output, "gate": await entries(cluster, key),
                                "ledger_first": kinds(cluster, key)}
        again = await agent.run(message_history=first.all_messages(),
                                deferred_tool_results=approved_by_framework())
        seen.update(again=again.output, still=await entries(cluster, key),
                    ledger_again=kinds(cluster, key))
        await cluster.sw.aapprove(await token_of(cluster, key), approver="ops-ana")
        done = await agent.run(message_history=again.all_messages(),
                               deferred_tool_results=approved_by_framework())
        seen.update(done=done.output, after=await entries(cluster, key))
        await saga.acomplete()
        seen["result"] = await saga.aresult(T)
        return seen

    seen = asyncio.run(main())
    for out in (seen["first"], seen["again"]):
        assert isinstance(out, DeferredToolRequests)
        assert [c.tool_call_id for c in out.approvals] == ["v1"]
        assert out.metadata["v1"]["saga_id"] == key and out.metadata["v1"]["seq"] == 2
    pending = [("book_hotel", "h1", Phase.EXECUTED),
               ("send_voucher", "v1", Phase.AWAITING_APPROVAL)]
    assert seen["gate"] == pending and seen["still"] == pending
    assert seen["ledger_first"] == seen["ledger_again"] == [("effect", "book_hotel")]
    assert seen["done"] == "voucher mailed"
    assert script.told(2) == [("success", "v1", "voucher sent to ana@example.org")]
    assert seen["after"] == [("book_hotel", "h1", Phase.EXECUTED),
                             ("send_voucher", "v1", Phase.EXECUTED)]
    assert kinds(cluster, key) == [("effect", "book_hotel"), ("effect", "send_voucher")]
    assert seen["result"].status is SagaStatus.COMPLETED


def test_a_rejected_gate_ends_the_resumed_run_and_compensates(cluster: Cluster) -> None:
    """The gate rejected with its signed token: the resumed run (approved by the framework)
    raises with ApprovalRejected (a ToolFailed) in its cause chain; the saga compensates."""
    key = uid("pa-reject")
    script = gated_script(key, [TextPart("voucher mailed")])

    async def main() -> tuple[BaseException, Any]:
        saga, agent, first = await deferred_run(cluster, key, script)
        await cluster.sw.areject(await token_of(cluster, key), approver="ops-ana",
                                 reason="customer cancelled")
        with pytest.raises(Exception) as caught:
            await agent.run(message_history=first.all_messages(),
                            deferred_tool_results=approved_by_framework())
        return caught.value, await saga.aresult(T)

    exc, res = asyncio.run(main())
    rejected = failed_in(exc)
    assert isinstance(rejected, ApprovalRejected) and "customer cancelled" in str(rejected)
    assert len(script.seen) == 2  # the model was not asked again
    assert res.status is SagaStatus.COMPENSATED
    assert kinds(cluster, key) == [("effect", "book_hotel"), ("undo", "book_hotel")]


def test_a_replayed_tool_call_id_journals_no_second_step(cluster: Cluster) -> None:
    """A run replayed from its message history (up to the model's book_hotel call, as after
    a crash before the tool's return was kept) repeats the tool-call id: it gets the first
    step's result, and the journal holds one step, the ledger one booking."""
    key = uid("pa-replay")
    script = Script([hotel(key)], [TextPart("booked")], [TextPart("booked again")])

    async def main() -> tuple[Any, Any, Any]:
        saga = await cluster.sw.abegin(key)
        agent = Agent(script.model(), toolsets=[sw_agents.toolset(saga, trip_tools(cluster))])
        first = await agent.run("book Lisbon")
        replay = await agent.run(message_history=first.all_messages()[:2])
        await saga.acomplete()
        return first, replay, await entries(cluster, key)

    first, replay, journaled = asyncio.run(main())
    returns = [p for run in (first, replay) for m in run.new_messages() for p in m.parts
               if isinstance(p, ToolReturnPart)]
    assert [(p.tool_call_id, p.content) for p in returns] == [
        ("h1", {"booking": "H-Lisbon-3"}), ("h1", {"booking": "H-Lisbon-3"})]
    assert journaled == [("book_hotel", "h1", Phase.EXECUTED)]
    assert kinds(cluster, key) == [("effect", "book_hotel")]


def test_an_async_tool_completes_the_run(cluster: Cluster) -> None:
    """charge_card is ``async def``: the run books, pays and completes; the saga completes."""
    key = uid("pa-async")
    script = Script([hotel(key)],
                    [call("charge_card", "c1", key=key, card="4242", amount_cents=45_000)],
                    [TextPart("booked and paid")])

    async def main() -> tuple[Any, Any]:
        saga = await cluster.sw.abegin(key)
        agent = Agent(script.model(), toolsets=[sw_agents.toolset(saga, trip_tools(cluster))])
        result = await agent.run("book Lisbon and pay")
        await saga.acomplete()
        return result, await saga.aresult(T)

    result, res = asyncio.run(main())
    assert result.output == "booked and paid"
    assert [(o, c) for o, c, _ in script.told(2)] == [("success", "c1")]
    paid = script.seen[2][-1].parts[0]
    assert isinstance(paid, ToolReturnPart) and paid.content == {"charge": "C-45000"}
    assert res.status is SagaStatus.COMPLETED
    assert kinds(cluster, key) == [("effect", "book_hotel"), ("effect", "charge_card")]


def test_importing_without_pydantic_ai_names_the_extra() -> None:
    """Without Pydantic AI the adapter's import raises ConfigurationError naming the extra."""
    code = ("import sys; sys.modules['pydantic_ai'] = None\n"
            "from sagaworker import ConfigurationError\n"
            "try:\n    import sagaworker.agents.pydantic_ai\n"
            "except ConfigurationError as exc:\n    print('refused:', exc)\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                         text=True, timeout=60, check=True).stdout
    assert out.startswith("refused:") and "pip install 'sagaworker[pydantic-ai]'" in out
