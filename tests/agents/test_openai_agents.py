"""sagaworker.agents.openai_agents through real workers, with a scripted model of the OpenAI
Agents SDK's own Model interface (no network, no key, tracing off): the journal decides what
a tool call did, not the SDK's failure_error_function nor its approvals."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
from collections.abc import Awaitable, Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
from agents import (
    Agent,
    FunctionTool,
    ModelResponse,
    Runner,
    RunResult,
    Usage,
    default_tool_error_function,
    function_tool,
    set_tracing_disabled,
)
from agents.models.interface import Model
from openai.types.responses import (
    ResponseFunctionToolCall,
    ResponseOutputMessage,
    ResponseOutputText,
)

from sagaworker import ApprovalRejected, Phase, SagaStatus, ToolFailed
from sagaworker.agents import openai_agents as sw_oai
from sagaworker.agents._core import GatePending, failed_in
from tests.conftest import (
    BROKERS,
    ROOT,
    Cluster,
    _broker,
    _pg,
    db_name,
    need,
    new_settings,
    uid,
    wait_for,
    worker_env,
)

pytestmark = [pytest.mark.services, pytest.mark.one_broker]
set_tracing_disabled(True)  # no trace exporter, no key
T = 60
TOOLS = ("book_hotel", "charge_card", "send_voucher")
#: what the SDK's default failure_error_function tells the model about any tool error
SDK_ERROR_TEXT = default_tool_error_function(None, Exception())  # type: ignore[arg-type]


# -- the scripted model --------------------------------------------------------------------

Turn = list[Any] | Callable[[list[Any]], Awaitable[list[Any]]]


class Scripted(Model):
    """The SDK's Model interface answering from a script: each call to ``get_response``
    takes the next turn, a list of output items or an async function of the input the model
    was given. Every input it was shown is kept in ``seen``."""

    def __init__(self, *turns: Turn) -> None:
        self.turns = list(turns)
        self.seen: list[list[Any]] = []

    async def get_response(self, system_instructions: str | None, input: Any,
                           model_settings: Any, tools: list[Any], output_schema: Any,
                           handoffs: list[Any], tracing: Any, *,
                           previous_response_id: str | None, conversation_id: str | None,
                           prompt: Any) -> ModelResponse:
        given = [input] if isinstance(input, str) else list(input)
        self.seen.append(given)
        if not self.turns:
            raise AssertionError(f"the model was asked once more than scripted: {given}")
        turn = self.turns.pop(0)
        output = turn if isinstance(turn, list) else await turn(given)
        return ModelResponse(output=output, usage=Usage(), response_id=None)

    def stream_response(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError("the scripted model answers get_response only")


def call(name: str, call_id: str, **arguments: Any) -> ResponseFunctionToolCall:
    """A function-call output item (the model asks for a tool)."""
    return raw_call(name, call_id, json.dumps(arguments))


def raw_call(name: str, call_id: str, arguments: str) -> ResponseFunctionToolCall:
    return ResponseFunctionToolCall(id=f"fc-{call_id}", call_id=call_id, type="function_call",
                                    name=name, arguments=arguments)


def say(text: str) -> ResponseOutputMessage:
    """An assistant message (the model's final answer)."""
    return ResponseOutputMessage(id="msg", type="message", role="assistant",
                                 status="completed",
                                 content=[ResponseOutputText(text=text, type="output_text",
                                                             annotations=[], logprobs=[])])


def told(given: list[Any]) -> dict[str, str]:
    """What the tools answered the model, by tool-call id, in the input it was given."""
    return {i["call_id"]: i["output"] for i in given
            if isinstance(i, dict) and i.get("type") == "function_call_output"}


# -- helpers -------------------------------------------------------------------------------

def kinds(c: Cluster, key: str) -> list[tuple[str, str]]:
    return [(r.kind, r.tool) for r in c.ledger(key)]


async def entries(c: Cluster, key: str) -> list[tuple[str, str | None, Phase]]:
    """The saga's entries: (tool, tool-call id, phase), in journal order."""
    rec = await c.sw.ainspect(key)
    return [(e.tool_name.rpartition(".")[2], e.call_id, e.phase) for e in rec.entries]


def agent(c: Cluster, saga: Any, model: Scripted, names: Sequence[str] = TOOLS,
          **options: Any) -> Agent[Any]:
    return Agent(name="trip", model=model,
                 tools=list(sw_oai.tools(saga, [c.tool(n) for n in names], **options)))


def book(key: str, call_id: str = "h1") -> ResponseFunctionToolCall:
    return call("book_hotel", call_id, key=key, city="Oslo", nights=2)


def charge(key: str, card: str, call_id: str = "c1") -> ResponseFunctionToolCall:
    return call("charge_card", call_id, key=key, card=card, amount_cents=12000)


def voucher(key: str, call_id: str = "v1") -> ResponseFunctionToolCall:
    return call("send_voucher", call_id, key=key, email="ana@example.com")


async def token_of(c: Cluster, key: str) -> str:
    (request,) = [p for p in await c.sw.apending_approvals() if p.saga_id == key]
    return request.token


def interrupted(result: RunResult) -> list[str]:
    """The tool-call ids a run stopped at (its interruptions)."""
    return [i.raw_item.call_id for i in result.interruptions]


# -- a failing tool ------------------------------------------------------------------------

def test_the_framework_alone_hands_the_failure_to_the_model(cluster: Cluster) -> None:
    """The same tool functions as plain @function_tool tools, no saga: charge_card raises
    (card declined), the SDK's default failure_error_function turns it into text for the
    model, and the run ends "successfully" with the hotel booked and nothing undone."""
    key = uid("oa-alone")
    fns = {n: cluster.sw.registry.tool(f"tests.apps.cluster.{n}").fn for n in TOOLS}
    model = Scripted([book(key)], [charge(key, "declined")], [say("all booked")])
    plain = Agent(name="trip", model=model, tools=[function_tool(fns[n]) for n in TOOLS])

    result = asyncio.run(Runner.run(plain, "Book Oslo and pay"))
    assert result.final_output == "all booked"
    assert told(model.seen[2])["c1"] == SDK_ERROR_TEXT
    assert kinds(cluster, key) == [("effect", "book_hotel")]


def custom_error_text(ctx: Any, error: Exception) -> str:
    """An app's own failure_error_function: every error becomes advice for the model."""
    return f"that did not work ({error}); try another card"


@pytest.mark.parametrize("failure", ["sdk-default", "app-function"])
def test_a_failed_step_ends_the_run_and_the_saga_compensates(cluster: Cluster,
                                                             failure: str) -> None:
    """book_hotel, then charge_card with a declined card: the step FAILS, the run raises
    with ToolFailed in its cause chain (the SDK's default failure_error_function, or the
    app's own, never sees it), the model is not asked again, and the saga compensates the
    hotel: effect then undo, nothing else."""
    key = uid("oa-trip")
    options = {} if failure == "sdk-default" else {"failure_error_function": custom_error_text}
    model = Scripted([book(key)], [charge(key, "declined")], [say("never asked")])

    async def main() -> tuple[BaseException, Any]:
        saga = await cluster.sw.abegin(key)
        with pytest.raises(Exception) as raised:
            await Runner.run(agent(cluster, saga, model, **options), "Book Oslo and pay")
        return raised.value, await saga.aresult(T)

    exc, res = asyncio.run(main())
    failed = failed_in(exc)
    assert isinstance(failed, ToolFailed), exc
    assert "card declined" in str(failed)
    assert len(model.seen) == 2  # the model never read anything about the failed call
    assert res.status is SagaStatus.COMPENSATED
    assert kinds(cluster, key) == [("effect", "book_hotel"), ("undo", "book_hotel")]
    assert asyncio.run(entries(cluster, key)) == [
        ("book_hotel", "h1", Phase.EXECUTED), ("charge_card", "c1", Phase.FAILED)]


def test_a_trip_with_an_async_tool_completes(cluster: Cluster) -> None:
    """charge_card is an async def tool on the worker: the trip books and pays, the model
    reads both journaled results, and the saga completes."""
    key = uid("oa-ok")
    model = Scripted([book(key)], [charge(key, "4242")], [say("booked and paid")])

    async def main() -> tuple[RunResult, Any]:
        saga = await cluster.sw.abegin(key)
        result = await Runner.run(agent(cluster, saga, model), "Book Oslo and pay")
        await saga.acomplete()
        return result, await saga.aresult(T)

    result, res = asyncio.run(main())
    assert result.final_output == "booked and paid"
    assert told(model.seen[2]) == {"h1": str({"booking": "H-Oslo-2"}),
                                   "c1": str({"charge": "C-12000"})}
    assert res.status is SagaStatus.COMPLETED
    assert kinds(cluster, key) == [("effect", "book_hotel"), ("effect", "charge_card")]


# -- arguments -----------------------------------------------------------------------------

def test_bad_arguments_go_back_to_the_model_and_journal_nothing(cluster: Cluster) -> None:
    """Arguments that fail the SDK's validation (a word for a number, JSON that does not
    parse) are answered as the SDK answers them, through failure_error_function, and
    journal nothing; the model's corrected call journals one step."""
    key = uid("oa-args")
    model = Scripted(
        [call("book_hotel", "bad1", key=key, city="Oslo", nights="two"),
         raw_call("book_hotel", "bad2", '{"key": "' + key + '", "city": ')],
        [book(key, "good")], [say("booked")])

    async def main() -> tuple[RunResult, list[Any]]:
        saga = await cluster.sw.abegin(key)
        result = await Runner.run(agent(cluster, saga, model), "Book Oslo")
        return result, await entries(cluster, key)

    result, journaled = asyncio.run(main())
    assert told(model.seen[1]) == {"bad1": SDK_ERROR_TEXT, "bad2": SDK_ERROR_TEXT}
    assert result.final_output == "booked"
    assert journaled == [("book_hotel", "good", Phase.EXECUTED)]
    assert kinds(cluster, key) == [("effect", "book_hotel")]


def test_the_apps_failure_error_function_reads_why_arguments_were_refused(
        cluster: Cluster) -> None:
    """With the app's own failure_error_function, the model reads why its arguments were
    refused (the SDK's ModelBehaviorError for the tool's input); nothing is journaled."""
    key = uid("oa-why")
    model = Scripted([call("book_hotel", "bad", key=key, city="Oslo")], [say("gave up")])

    async def main() -> list[Any]:
        saga = await cluster.sw.abegin(key)
        tools = agent(cluster, saga, model, failure_error_function=custom_error_text)
        await Runner.run(tools, "Book Oslo")
        return await entries(cluster, key)

    assert asyncio.run(main()) == []
    answer = told(model.seen[1])["bad"]
    assert answer.startswith("that did not work (Invalid JSON input for tool book_hotel: ")
    assert "nights" in answer


# -- gates ---------------------------------------------------------------------------------

def test_a_gate_waits_for_the_signed_approval_not_the_sdks(cluster: Cluster) -> None:
    """send_voucher stops the run with a needs_approval interruption and journals its
    gate. Approved by the SDK alone (state.approve), the resumed run stops at the same call
    again: nothing sent, the gate still waits. Once sw.aapprove signed it (the step runs),
    a run resumed without the SDK's approval still stops there; with it, the model reads
    the voucher's result and the saga completes."""
    key = uid("oa-gate")
    model = Scripted([book(key)], [voucher(key)], [say("voucher sent")])

    async def main() -> dict[str, Any]:
        saga = await cluster.sw.abegin(key)
        trip = agent(cluster, saga, model)
        first = await Runner.run(trip, "Book Oslo and mail the voucher")
        seen: dict[str, Any] = {"first": interrupted(first),
                                "gate": await entries(cluster, key)}
        state = first.to_state()
        state.approve(first.interruptions[0])
        again = await Runner.run(trip, state)
        seen |= {"again": interrupted(again), "after-sdk": await entries(cluster, key),
                 "ledger-after-sdk": kinds(cluster, key), "asked": len(model.seen)}
        await cluster.sw.aapprove(await token_of(cluster, key), approver="ops@example.com")
        still = await Runner.run(trip, again.to_state())  # the SDK was told nothing yet
        seen["still"] = interrupted(still)
        state = still.to_state()
        state.approve(still.interruptions[0])
        seen["final"] = (await Runner.run(trip, state)).final_output
        await saga.acomplete()
        seen["status"] = (await saga.aresult(T)).status
        return seen

    seen = asyncio.run(main())
    waiting = [("book_hotel", "h1", Phase.EXECUTED),
               ("send_voucher", "v1", Phase.AWAITING_APPROVAL)]
    assert seen["first"] == ["v1"] and seen["gate"] == waiting
    assert seen["again"] == ["v1"] and seen["after-sdk"] == waiting
    assert seen["ledger-after-sdk"] == [("effect", "book_hotel")]
    assert seen["still"] == ["v1"]
    assert seen["asked"] == 2  # the SDK's approval alone did not reach the model either
    assert told(model.seen[2])["v1"] == "voucher sent to ana@example.com"
    assert seen["final"] == "voucher sent"
    assert seen["status"] is SagaStatus.COMPLETED
    assert kinds(cluster, key) == [("effect", "book_hotel"), ("effect", "send_voucher")]


def test_the_sdks_rejection_alone_is_no_decision_either(cluster: Cluster) -> None:
    """state.reject on a gate the journal still holds open: the resumed run stops at the
    same call again (the model never reads a rejection the journal did not make), and the
    gate still waits for its signed decision."""
    key = uid("oa-sdkno")
    model = Scripted([book(key)], [voucher(key)], [say("never asked")])

    async def main() -> tuple[list[str], list[Any], Any]:
        saga = await cluster.sw.abegin(key)
        trip = agent(cluster, saga, model)
        first = await Runner.run(trip, "Book Oslo and mail the voucher")
        state = first.to_state()
        state.reject(first.interruptions[0], rejection_message="not now")
        again = await Runner.run(trip, state)
        journaled = await entries(cluster, key)
        await saga.afail("the customer cancelled")
        return interrupted(again), journaled, await saga.aresult(T)

    again, journaled, res = asyncio.run(main())
    assert again == ["v1"]
    assert journaled == [("book_hotel", "h1", Phase.EXECUTED),
                         ("send_voucher", "v1", Phase.AWAITING_APPROVAL)]
    assert len(model.seen) == 2
    assert res.status is SagaStatus.COMPENSATED
    assert kinds(cluster, key) == [("effect", "book_hotel"), ("undo", "book_hotel")]


def test_always_approve_cannot_stand_in_for_the_signed_approval(cluster: Cluster) -> None:
    """state.approve(item, always_approve=True), a decision for every call that cannot be
    forgotten for one: the resumed run ends with GatePending in its cause chain; nothing is
    sent and the gate still waits for its signed decision."""
    key = uid("oa-always")
    model = Scripted([book(key)], [voucher(key)], [say("never asked")])

    async def main() -> tuple[BaseException, list[Any], Any]:
        saga = await cluster.sw.abegin(key)
        trip = agent(cluster, saga, model)
        first = await Runner.run(trip, "Book Oslo and mail the voucher")
        state = first.to_state()
        state.approve(first.interruptions[0], always_approve=True)
        with pytest.raises(Exception) as raised:
            await Runner.run(trip, state)
        journaled = await entries(cluster, key)
        await saga.afail("the customer cancelled")
        return raised.value, journaled, await saga.aresult(T)

    exc, journaled, res = asyncio.run(main())
    assert any(isinstance(e, GatePending) for e in chain(exc)), exc
    assert journaled[-1] == ("send_voucher", "v1", Phase.AWAITING_APPROVAL)
    assert len(model.seen) == 2
    assert res.status is SagaStatus.COMPENSATED
    assert kinds(cluster, key) == [("effect", "book_hotel"), ("undo", "book_hotel")]


def chain(exc: BaseException | None) -> list[BaseException]:
    """An exception and its causes (or contexts), outermost first."""
    out: list[BaseException] = []
    while exc is not None and exc not in out:
        out.append(exc)
        exc = exc.__cause__ or exc.__context__
    return out


#: what the app told the SDK about the voucher's call before resuming the rejected run
SDK_DECISIONS = {"sdk-approved": lambda state, item: state.approve(item),
                 "sdk-rejected": lambda state, item: state.reject(item),
                 "sdk-undecided": lambda state, item: None}


@pytest.mark.parametrize("decision", list(SDK_DECISIONS))
def test_a_rejected_gate_ends_the_run_and_compensates(cluster: Cluster, decision: str) -> None:
    """sw.areject on the voucher's gate: the resumed run raises with ApprovalRejected, a
    ToolFailed, in its cause chain, whatever the SDK was told (approved, rejected: its
    rejection text never reaches the model, or nothing); nothing is sent and the saga
    compensates the hotel."""
    key = uid("oa-reject")
    model = Scripted([book(key)], [voucher(key)], [say("never asked")])

    async def main() -> tuple[BaseException, Any]:
        saga = await cluster.sw.abegin(key)
        trip = agent(cluster, saga, model)
        first = await Runner.run(trip, "Book Oslo and mail the voucher")
        assert interrupted(first) == ["v1"]
        await cluster.sw.areject(await token_of(cluster, key), approver="ops@example.com",
                                 reason="wrong customer")
        state = first.to_state()
        SDK_DECISIONS[decision](state, first.interruptions[0])
        with pytest.raises(Exception) as raised:
            await Runner.run(trip, state)
        return raised.value, await saga.aresult(T)

    exc, res = asyncio.run(main())
    rejected = failed_in(exc)
    assert isinstance(rejected, ApprovalRejected), exc
    assert "wrong customer" in str(rejected)
    assert len(model.seen) == 2
    assert res.status is SagaStatus.COMPENSATED
    assert kinds(cluster, key) == [("effect", "book_hotel"), ("undo", "book_hotel")]


# -- tool-call ids -------------------------------------------------------------------------

def test_a_repeated_tool_call_id_journals_no_second_step(cluster: Cluster) -> None:
    """A run that repeats a tool-call id, resumed from the first run's history or replayed
    from the start, gets the first step's result (the SDK calls the tool again each time);
    the saga holds one step for the id and the hotel is booked once."""
    key = uid("oa-repeat")

    async def main() -> list[Any]:
        saga = await cluster.sw.abegin(key)
        first = Scripted([book(key)], [say("booked")])
        history = (await Runner.run(agent(cluster, saga, first), "Book Oslo")).to_input_list()
        resumed = Scripted([book(key)], [say("booked again")])
        await Runner.run(agent(cluster, saga, resumed),
                         [*history, {"role": "user", "content": "book it again"}])
        replayed = Scripted([book(key)], [say("booked")])
        await Runner.run(agent(cluster, saga, replayed), "Book Oslo")
        return [told(m.seen[1])["h1"] for m in (first, resumed, replayed)]

    answers = asyncio.run(main())
    assert answers == [str({"booking": "H-Oslo-2"})] * 3
    assert asyncio.run(entries(cluster, key)) == [("book_hotel", "h1", Phase.EXECUTED)]
    assert kinds(cluster, key) == [("effect", "book_hotel")]


# -- the tools themselves ------------------------------------------------------------------

def test_names_descriptions_and_schemas_are_the_sdks_own(cluster: Cluster) -> None:
    """Each FunctionTool's name, description and strict parameters schema are what the
    SDK's @function_tool builds from the same function; only the gated tool needs
    approval."""
    saga = cluster.sw.begin(uid("oa-schema"))
    made = sw_oai.tools(saga, [cluster.tool(n) for n in TOOLS])
    for t in made:
        plain = function_tool(cluster.sw.registry.tool(f"tests.apps.cluster.{t.name}").fn)
        assert isinstance(t, FunctionTool)
        assert (t.name, t.description, t.params_json_schema, t.strict_json_schema) == (
            plain.name, plain.description, plain.params_json_schema, True)
    assert [t.name for t in made] == list(TOOLS)
    assert [callable(t.needs_approval) for t in made] == [False, False, True]
    saga.fail("only the schemas were looked at")


def test_importing_without_the_sdk_names_the_extra() -> None:
    """Without the SDK (its package ``agents``), importing the adapter raises
    ConfigurationError naming the extra sagaworker[openai-agents]; with it, the names the
    adapter builds on are the SDK's own (not sagaworker.agents)."""
    code = ("import sys; sys.modules['agents'] = None\n"
            "from sagaworker import ConfigurationError\n"
            "try:\n    import sagaworker.agents.openai_agents\n"
            "except ConfigurationError as exc:\n    print(exc)\n"
            "else:\n    print('imported')\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=ROOT, env={"PYTHONPATH": str(ROOT)}, timeout=60, check=True)
    assert "pip install 'sagaworker[openai-agents]'" in out.stdout, out
    assert sw_oai.FunctionTool.__module__ == "agents.tool"


# -- an agent process that dies ------------------------------------------------------------

#: the sweeper's SAGAWORKER_IDLE_AFTER on the crash tests' worker
IDLE_AFTER = 2
#: the agent: begins the saga (``deadline`` seconds, 0: none), books the hotel, then waits
#: on its model forever; its producer is tests.apps.cluster's, built from the environment
AGENT = """
import asyncio, sys
from agents import Agent, Runner
from sagaworker.agents import openai_agents as sw_oai
from tests.agents.test_openai_agents import Scripted, book
from tests.apps.cluster import sw

async def forever(given):
    await asyncio.Event().wait()

async def main(key, deadline):
    saga = await sw.abegin(key, deadline=deadline or None)
    tools = [sw.registry.tool(f"tests.apps.cluster.{n}").task
             for n in ("book_hotel", "charge_card")]
    model = Scripted([book(key)], forever)
    await Runner.run(Agent(name="trip", model=model, tools=sw_oai.tools(saga, tools)), "Go")

asyncio.run(main(sys.argv[1], float(sys.argv[2])))
"""


@pytest.fixture(scope="module", params=sorted(BROKERS))
def crash_db(request: pytest.FixtureRequest,
             tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    """A worker of its own (SAGAWORKER_IDLE_AFTER short) on a database of its own: no other
    test's sweeper sees its sagas, so the deadline pass and saga_idle are its worker's."""
    need("PostgreSQL", _pg)
    broker = BROKERS[request.param]
    need(request.param, _broker(broker))
    import psycopg

    from sagaworker._journal.migrate import upgrade
    from tests.apps.cluster import forget

    name = db_name("sw_oai")
    with psycopg.connect("host=127.0.0.1 user=root dbname=postgres", autocommit=True) as c:
        c.execute(f'CREATE DATABASE "{name}"')
    url = f"postgresql+psycopg://root@127.0.0.1:5432/{name}"
    upgrade(url)
    tmp = tmp_path_factory.mktemp(f"oai-crash-{request.param}")
    cl = Cluster(new_settings(url, broker, tmp, idle_after=IDLE_AFTER), tmp, request.param)
    cl.start_worker(SAGAWORKER_IDLE_AFTER=str(IDLE_AFTER))
    yield cl
    cl.close()
    cl.sw.journal.engine.dispose()
    forget(url)
    with psycopg.connect("host=127.0.0.1 user=root dbname=postgres", autocommit=True) as c:
        c.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def kill_after_the_hotel(c: Cluster, key: str, deadline: float, log: Path) -> int:
    """Run the agent process, SIGKILL it once its hotel step is EXECUTED (awaited in the
    journal); its return code."""
    env = worker_env(c.settings, c.default_queue)
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-c", AGENT, key, str(deadline)], env=env,
                                cwd=ROOT, stdout=out, stderr=subprocess.STDOUT)
    try:
        def booked() -> bool:
            if proc.poll() is not None:
                raise AssertionError(f"the agent exited ({proc.returncode}): "
                                     f"{log.read_text()[-2000:]}")
            entries = c.sw.inspect(key).entries if c.sw.journal.saga_row(key) else []
            return [(e.call_id, e.phase) for e in entries] == [("h1", Phase.EXECUTED)]

        wait_for(booked, T, "the agent's hotel step to be EXECUTED")
        os.kill(proc.pid, signal.SIGKILL)
        return proc.wait(T)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(T)


def test_a_killed_agents_saga_is_compensated_at_its_deadline(crash_db: Cluster,
                                                             tmp_path: Path) -> None:
    """The agent process is SIGKILLed after booking the hotel, its run unfinished: the saga
    stays RUNNING with nobody to complete or fail it, until its deadline passes: the worker
    logs saga_deadline_passed and the saga compensates the hotel."""
    c, key = crash_db, uid("oa-dead")
    assert kill_after_the_hotel(c, key, 6, tmp_path / "agent.log") == -signal.SIGKILL
    assert c.sw.inspect(key).status is SagaStatus.RUNNING  # killed before its deadline
    res = c.sw.get(key).wait(timeout=T)
    assert (res.status, res.error) == (SagaStatus.COMPENSATED, "deadline passed")
    assert kinds(c, key) == [("effect", "book_hotel"), ("undo", "book_hotel")]
    (event,) = wait_for(lambda: [e for e in c.events(key)
                                 if e["event"] == "saga_deadline_passed"], 10, "the event")
    assert event["level"] == "warning"


def test_a_killed_agents_saga_without_deadline_is_reported_idle(crash_db: Cluster,
                                                                tmp_path: Path) -> None:
    """Without a deadline, the killed agent's saga is RUNNING with no step in flight: the
    sweeper reports it saga_idle once SAGAWORKER_IDLE_AFTER passed; nothing is undone
    until someone fails it (then the hotel is)."""
    c, key = crash_db, uid("oa-idle")
    assert kill_after_the_hotel(c, key, 0, tmp_path / "agent.log") == -signal.SIGKILL
    (event,) = wait_for(lambda: [e for e in c.events(key) if e["event"] == "saga_idle"],
                        IDLE_AFTER + 20, "saga_idle")
    assert event["level"] == "error" and event["idle_s"] >= IDLE_AFTER
    assert kinds(c, key) == [("effect", "book_hotel")]
    saga = c.sw.get(key)
    saga.fail("its agent died")
    assert saga.wait(timeout=T).status is SagaStatus.COMPENSATED
    assert kinds(c, key) == [("effect", "book_hotel"), ("undo", "book_hotel")]
