"""The Celery app the integration tests run in real worker processes.

Its tools record every effect and undo in an oracle ledger (a table the tests read),
written by the tools themselves, so the tests check what really happened.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import time
from datetime import datetime, timedelta
from decimal import Decimal
from typing import Any
from uuid import UUID

from celery import Celery
from sqlalchemy import (
    JSON,
    Column,
    DateTime,
    Integer,
    MetaData,
    String,
    Table,
    create_engine,
    func,
    insert,
)
from sqlalchemy import select as _select
from sqlalchemy.exc import IntegrityError, ProgrammingError

from sagaworker import (
    ApprovalRejected,
    CompensationContext,
    FlowContext,
    Reversibility,
    Sagaworker,
    Settings,
    ToolFailed,
    current_idempotency_key,
)
from sagaworker._journal.dialect import normalize_url

ledger_md = MetaData()
ledger = Table("test_ledger", ledger_md,
               Column("id", Integer, primary_key=True, autoincrement=True),
               Column("key", String(200), index=True), Column("kind", String(20)),
               Column("tool", String(100)), Column("detail", JSON),
               # an idempotency key an effect was applied under: unique, as a payment
               # provider keeps its Idempotency-Key, so a repeat is seen and not applied
               Column("idem", String(200), unique=True),
               Column("at", DateTime(timezone=True), server_default=func.now()))
_engines: dict[str, Any] = {}
_url: list[str] = []
_clients: list[Any] = []  # an async client a tool module caches (review tests)


def engine(url: str | None = None) -> Any:
    url = url or _url[0]
    if url not in _engines:
        # the oracle is "the outside world": it reconnects on its own (pre-ping)
        _engines[url] = create_engine(normalize_url(url), pool_pre_ping=True)
        try:
            ledger_md.create_all(_engines[url])
        except (IntegrityError, ProgrammingError):
            # another process (a worker, the test) created it at the same moment
            ledger_md.create_all(_engines[url])
    return _engines[url]


def record(key: str, kind: str, tool: str, **detail: Any) -> None:
    with engine().begin() as conn:
        conn.execute(insert(ledger).values(key=key, kind=kind, tool=tool, detail=detail))


def record_once(idem: str, key: str, kind: str, tool: str, **detail: Any) -> bool:
    """Apply an effect under an idempotency key: once. A repeat is written as ``repeat``
    (with its own details), so the tests see every try and that it changed nothing."""
    try:
        with engine().begin() as conn:
            conn.execute(insert(ledger).values(key=key, kind=kind, tool=tool, detail=detail,
                                               idem=idem))
        return True
    except IntegrityError:
        record(key, "repeat", tool, of=kind, idem=idem, **detail)
        return False


def count(key: str, kind: str, tool: str) -> int:
    with engine().connect() as conn:
        return len(conn.execute(_select(ledger.c.id).where(
            ledger.c.key == key, ledger.c.kind == kind, ledger.c.tool == tool)).all())




def forget(url: str) -> None:
    """Close the oracle's connections to a database about to be dropped."""
    eng = _engines.pop(url, None)
    if eng is not None:
        eng.dispose()


def rows(url: str, key: str) -> list[Any]:
    """The ledger rows of one test key, in the order they were written."""
    with engine(url).connect() as conn:
        return list(conn.execute(_select(ledger).where(ledger.c.key == key)
                                 .order_by(ledger.c.id)).all())


class Boom(Exception):
    pass


class NotJson:
    pass


class CardError(Exception):
    """Its text comes from an attribute, through its own ``__str__``."""

    def __init__(self, card: str) -> None:
        super().__init__("declined")
        self.card = card

    def __str__(self) -> str:
        return f"card {self.card} declined"


#: a tool parameter's default value that SAGAWORKER_REDACT=card must hide all the same
DEFAULT_CARD = "4000111122223333"


def leak(card: str, shape: str) -> Exception:
    """An exception carrying ``card`` in one of the shapes Celery would show."""
    if shape == "dict":
        return Boom({"card": card, "status": "declined"})
    if shape == "cause":
        try:
            raise ValueError(f"gateway said: card {card} is blocked")
        except ValueError as inner:
            outer = Boom("payment failed")
            outer.__cause__ = inner
            return outer
    if shape == "str":
        return CardError(card)
    if shape == "note":
        noted = Boom("payment failed")
        noted.add_note(f"card was {card}")
        return noted
    return Boom(f"card {card} declined")


# -- flows: module level, so every worker imports them by name ------------------

def three_steps(s: FlowContext, key: str, fail_at: int = 0, sleep: float = 0.0) -> dict[str, Any]:
    """a, b, c one after the other; step ``fail_at`` fails; b takes ``sleep`` seconds."""
    a = s.call("tests.apps.cluster.step", key, "a", fail=fail_at == 1)
    b = s.call("tests.apps.cluster.step", key, "b", fail=fail_at == 2, sleep=sleep)
    c = s.call("tests.apps.cluster.step", key, "c", fail=fail_at == 3)
    return {"a": a, "b": b, "c": c}


def fan_out(s: FlowContext, key: str) -> list[Any]:
    """Three steps at once, gathered, then one more that uses their results."""
    handles = [s.enqueue("tests.apps.cluster.step", key, n) for n in ("x", "y", "z")]
    got = s.gather(*handles)
    return [*got, s.call("tests.apps.cluster.step", key, "after-" + "-".join(got))]


def gated_flow(s: FlowContext, key: str, parcel: str) -> str:
    """A step, then the IRREVERSIBLE ship behind its approval gate."""
    s.call("tests.apps.cluster.step", key, "a")
    return str(s.call("tests.apps.cluster.ship", key, parcel))


def catches_failure(s: FlowContext, key: str) -> str:
    """Catches ToolFailed and carries on: the saga compensates all the same."""
    s.call("tests.apps.cluster.step", key, "a")
    try:
        s.call("tests.apps.cluster.step", key, "b", fail=True)
    except ToolFailed:
        s.call("tests.apps.cluster.step", key, "never")
    return "caught"


def load_flow(s: FlowContext, key: str, fail: bool = False, sleep: float = 0.0) -> list[str]:
    """The fault suite's flow: three steps one after the other, the last failing on demand."""
    return [s.call("tests.apps.cluster.step", key, f"s{n}", sleep=sleep, fail=fail and n == 3)
            for n in (1, 2, 3)]


def pays_then_raises(s: FlowContext, key: str, cc: str) -> None:
    """Pays with ``cc`` (the pay tool's ``card``), then raises quoting it."""
    s.call("tests.apps.cluster.pay", key, cc, 500)
    raise RuntimeError(f"shipping failed after paying with {cc}")


def raises_its_own(s: FlowContext, key: str, rejected: bool = False) -> None:
    """a, then raises a ``ToolFailed`` (``ApprovalRejected``) of its own making: no step
    of its journal failed."""
    s.call("tests.apps.cluster.step", key, "a")
    kind = ApprovalRejected if rejected else ToolFailed
    raise kind("the flow's own verdict: no stock in any warehouse")


async def async_steps(s: FlowContext, key: str, fail_at: int = 0,
                      parcel: str | None = None) -> list[Any]:
    """An ``async def`` flow: a, then b and c at once (``asyncio.gather`` of two calls),
    then ``s.gather`` of two handles, then the gated ship when ``parcel`` is given; step
    ``fail_at`` fails."""
    out = [await s.call("tests.apps.cluster.step", key, "a", fail=fail_at == 1)]
    await asyncio.sleep(0)  # a real await between steps: the replay runs on a loop
    out += await asyncio.gather(s.call("tests.apps.cluster.step", key, "b",
                                       fail=fail_at == 2),
                                s.call("tests.apps.cluster.step", key, "c"))
    handles = [s.enqueue("tests.apps.cluster.step", key, n, fail=fail_at == 4)
               for n in ("d", "e")]
    out += await s.gather(*handles)
    if parcel is not None:
        out.append(await s.call("tests.apps.cluster.ship", key, parcel))
    return out


#: the durable trip agent (tests/integration/test_durable_agents.py), built with the tools
AGENTS: dict[str, Any] = {}


def trip_model(messages: list[Any], info: Any) -> Any:
    """A scripted model for the durable trip: the prompt is ``key|card|voucher|slow``.
    It books the hotel, charges the card, mails the voucher (when asked), then answers;
    every request it serves is in the ledger (``model``, ``turn-N``), and with ``slow`` the
    first request of turn 0 takes 30 s (a worker is killed in it)."""
    from pydantic_ai.messages import ModelResponse, TextPart, ToolCallPart

    key, card, voucher, slow = str(messages[0].parts[-1].content).split("|")
    turn = sum(isinstance(m, ModelResponse) for m in messages)
    before = [r for r in rows(_url[0], key) if (r.kind, r.tool) == ("model", f"turn-{turn}")]
    record(key, "model", f"turn-{turn}")
    if slow == "slow" and turn == 0 and not before:
        time.sleep(30)
    if slow == "stall" and turn == 0 and not before:
        time.sleep(12)  # its worker is stopped (SIGSTOP) meanwhile, for longer
    if slow == "linger" and turn == 0:
        time.sleep(9)  # over two leases of the crash cluster: the heartbeat keeps its claim
    plan = _trip_plan(key, card, voucher)
    if turn < len(plan):
        name, args = plan[turn]
        return ModelResponse(parts=[ToolCallPart(name, args, tool_call_id=f"call-{turn}")])
    return ModelResponse(parts=[TextPart(f"trip booked for {key}")])


def _trip_instructions() -> str:
    """The trip agent's instructions, as the code deployed says (TEST_TRIP_INSTRUCTIONS)."""
    return os.environ.get("TEST_TRIP_INSTRUCTIONS", "Book the trip the prompt asks for.")


def _trip_agent() -> Any:
    if "trip" not in AGENTS:
        from pydantic_ai import Agent
        from pydantic_ai.models.function import FunctionModel

        from sagaworker.agents import pydantic_ai as sw_agents

        sw, tools = AGENTS["tools"]
        AGENTS["trip"] = Agent(FunctionModel(trip_model), name="trip",
                               instructions=_trip_instructions,
                               capabilities=[sw_agents.Durability(sw)],
                               toolsets=[sw_agents.flow_toolset(tools)])
    return AGENTS["trip"]


async def durable_trip(s: FlowContext, key: str, card: str = "visa", voucher: bool = False,
                       slow: bool = False, linger: bool = False, quote: bool = False,
                       stall: bool = False) -> str:
    """The trip agent run inside a flow (Pydantic AI with sagaworker's Durability)."""
    pace = "slow" if slow else "linger" if linger else "stall" if stall else "-"
    first = "voucher" if voucher else "quote" if quote else "-"
    result = await _trip_agent().run(f"{key}|{card}|{first}|{pace}")
    return str(result.output)


def _trip_plan(key: str, card: str, voucher: str) -> list[tuple[str, dict[str, Any]]]:
    plan: list[tuple[str, dict[str, Any]]] = [
        ("book_hotel", {"key": key, "city": "Lisbon", "nights": 2}),
        ("charge_card", {"key": key, "card": card, "amount_cents": 42000})]
    if voucher == "quote":  # first a quote, whose first run takes 30 s (killed in it)
        plan.insert(0, ("quote_room", {"key": key, "city": "Lisbon"}))
    if voucher == "voucher":
        plan.append(("send_voucher", {"key": key, "email": "ana@example.com"}))
    return plan


def _oai_trip_agent() -> Any:
    """The same trip for the OpenAI Agents SDK: a scripted ``Model`` (the turn is the number
    of tool outputs it was shown), run with ``sagaworker.agents.openai_agents.run``."""
    if "oai" not in AGENTS:
        from agents import Agent, Model, ModelResponse, Usage, set_tracing_disabled
        from openai.types.responses import (
            ResponseFunctionToolCall,
            ResponseOutputMessage,
            ResponseOutputText,
        )

        from sagaworker.agents import openai_agents as sw_oai

        set_tracing_disabled(True)

        class Scripted(Model):
            async def get_response(self, system_instructions: Any, input: Any,
                                   *args: Any, **kwargs: Any) -> Any:
                items = [input] if isinstance(input, str) else list(input)
                first = items[0] if isinstance(items[0], str) else items[0]["content"]
                key, card, voucher, slow = str(first).split("|")
                turn = sum(1 for i in items if isinstance(i, dict)
                           and i.get("type") == "function_call_output")
                before = [r for r in rows(_url[0], key)
                          if (r.kind, r.tool) == ("model", f"turn-{turn}")]
                record(key, "model", f"turn-{turn}")
                if slow == "slow" and turn == 0 and not before:
                    await asyncio.sleep(30)
                plan = _trip_plan(key, card, voucher)
                if turn < len(plan):
                    name, args = plan[turn]
                    out: list[Any] = [ResponseFunctionToolCall(
                        id=f"fc-{turn}", call_id=f"call-{turn}", type="function_call",
                        name=name, arguments=json.dumps(args))]
                else:
                    out = [ResponseOutputMessage(
                        id="msg", type="message", role="assistant", status="completed",
                        content=[ResponseOutputText(text=f"trip booked for {key}",
                                                    type="output_text", annotations=[],
                                                    logprobs=[])])]
                return ModelResponse(output=out, usage=Usage(requests=1, input_tokens=10,
                                                             output_tokens=3), response_id=None)

            def stream_response(self, *args: Any, **kwargs: Any) -> Any:
                raise NotImplementedError

        _, tools = AGENTS["tools"]
        AGENTS["oai"] = Agent(name="trip", model=Scripted(), tools=sw_oai.flow_tools(tools),
                              instructions=lambda ctx, agent: _trip_instructions())
    return AGENTS["oai"]


async def durable_trip_oai(s: FlowContext, key: str, card: str = "visa",
                           slow: bool = False) -> str:
    """The trip agent of the OpenAI Agents SDK run inside a flow."""
    from sagaworker.agents import openai_agents as sw_oai

    result = await sw_oai.run(_oai_trip_agent(),
                              f"{key}|{card}|-|{'slow' if slow else '-'}")
    return str(result.final_output)


def strict_steps(s: FlowContext, key: str, fail_at: int = 0, sleep: float = 0.0
                 ) -> dict[str, Any]:
    """``three_steps``, declared ``on_divergence="compensate"``."""
    return three_steps(s, key, fail_at, sleep)


def versioned(s: FlowContext, key: str, parcel: str) -> list[str]:
    """One flow, four versions of its code (``TEST_FLOW_CODE`` of the process that
    replays it, read at each replay: a deploy). 1: a, the gated ship, c. 2: a new step b
    inserted before ship (sagas started under 1 diverge). 3: b behind ``s.patched`` (old
    sagas skip it, new ones run it). 4: the patch deprecated (every saga runs b)."""
    code = os.environ.get("TEST_FLOW_CODE", "1")
    done = [s.call("tests.apps.cluster.step", key, "a")]
    if code == "2" or (code == "3" and s.patched("add-b")):
        done.append(s.call("tests.apps.cluster.step", key, "b"))
    if code == "4":
        s.deprecate_patch("add-b")
        done.append(s.call("tests.apps.cluster.step", key, "b"))
    done.append(s.call("tests.apps.cluster.ship", key, parcel))
    done.append(s.call("tests.apps.cluster.step", key, "c"))
    return done


def pays_noisily(s: FlowContext, key: str, cc: str) -> str:
    """Pays with ``cc`` through a tool whose own log line quotes the card."""
    paid: str = s.call("tests.apps.cluster.noisy_pay", key, cc)
    return paid


def passes_counts(s: FlowContext, key: str) -> str:
    """A step's result (an object) handed on to the next step's arguments, as text."""
    got = s.call("tests.apps.cluster.counts", key)
    done: str = s.call("tests.apps.cluster.step", key, json.dumps(got))
    return done


def logs_its_card(s: FlowContext, key: str, card: str) -> str:
    """Logs and print()s its own card argument (as a model SDK logs inside a flow), then
    pays with it: the worker must scrub the flow's lines as it scrubs a tool's."""
    import sys

    logging.getLogger("shop.flow").warning("flow charging card %s", card)
    print(f"flow printing card {card}")
    print(f"flow printing card {card} to stderr", file=sys.stderr)
    paid: str = s.call("tests.apps.cluster.pay", key, card, 100)
    return paid


def asks_who(s: FlowContext, key: str) -> str:
    """a, then a tool that records which task Celery says is running it."""
    s.call("tests.apps.cluster.step", key, "a")
    who: str = s.call("tests.apps.cluster.whoami", key)
    return who


def idem_flow(s: FlowContext, key: str, sleep: float = 0.0) -> list[Any]:
    """a, then the idempotent b (``sleep`` seconds), then c."""
    return [s.call("tests.apps.cluster.step", key, "a"),
            s.call("tests.apps.cluster.idem", key, "b", sleep=sleep),
            s.call("tests.apps.cluster.step", key, "c")]


def retried_flow(s: FlowContext, key: str) -> list[Any]:
    """a, then b of a tool Celery retries (it fails once), then c."""
    return [s.call("tests.apps.cluster.step", key, "a"),
            s.call("tests.apps.cluster.retried", key, "b", 1),
            s.call("tests.apps.cluster.step", key, "c")]


def retried_by_hand_flow(s: FlowContext, key: str, asks: int = 1) -> list[Any]:
    """a, then b of a tool that asks Celery for a retry itself ``asks`` times, then c."""
    return [s.call("tests.apps.cluster.step", key, "a"),
            s.call("tests.apps.cluster.retries_by_hand", key, "b", asks),
            s.call("tests.apps.cluster.step", key, "c")]


def retried_later_flow(s: FlowContext, key: str, asks: int, countdown: float) -> list[Any]:
    """a, then b of a tool that asks for a retry in ``countdown`` seconds, then c."""
    return [s.call("tests.apps.cluster.step", key, "a"),
            s.call("tests.apps.cluster.retries_later", key, "b", asks, countdown),
            s.call("tests.apps.cluster.step", key, "c")]


# -- a tool's own retry delayed by a busy worker (tests/integration/test_retries.py) ------

def retry_tools(sw: Sagaworker) -> None:
    """The tools of the test of a retry delayed past its due time (registered by ``build``)."""

    @sw.tool(compensable_by="undo_step", max_retries=2)
    def retries_every_time(key: str, name: str, countdown: float) -> str:
        """Asks Celery for a retry in ``countdown`` seconds on every try
        (``current_task.retry(countdown=...)``): Celery allows it three tries, then it
        fails."""
        from celery import current_task

        record(key, "try", name, retries=current_task.request.retries)
        current_task.retry(exc=Boom(f"{name} asks again"), countdown=countdown)
        return name

    @sw.tool()
    def holds_a_process(key: str, name: str, timeout: float) -> str:
        """Keeps its worker process busy: records its start ("try"), then waits until the
        test records "go" for ``key`` and ``name`` (``timeout`` seconds at most)."""
        record(key, "try", name)
        deadline = time.monotonic() + timeout
        while not count(key, "go", name) and time.monotonic() < deadline:
            time.sleep(0.05)
        record(key, "effect", name)
        return name


FLOWS = (passes_counts, logs_its_card, three_steps, fan_out, gated_flow, catches_failure, load_flow,
         pays_then_raises,
         idem_flow, retried_flow, pays_noisily, asks_who, retried_by_hand_flow,
         retried_later_flow, raises_its_own, versioned, async_steps, durable_trip,
         durable_trip_oai)


def _end_with_the_test_run() -> None:
    """In a test worker (its main process): end the worker, children included, once the
    test process that started it is gone (a killed or interrupted run)."""
    import signal
    import threading

    parent = int(os.environ["TESTS_PARENT_PID"])

    def watch() -> None:
        while True:
            time.sleep(1)
            try:
                os.kill(parent, 0)
            except ProcessLookupError:
                os.killpg(os.getpgid(0), signal.SIGKILL)  # (a session of its own)
            except PermissionError:  # (a pid taken by another user's process)
                os.killpg(os.getpgid(0), signal.SIGKILL)

    threading.Thread(target=watch, name="tests-parent-watch", daemon=True).start()


if os.environ.get("TESTS_PARENT_PID") and os.environ.get("TESTS_APP_WORKER") == "1" \
        and os.getpgid(0) == os.getpid():
    _end_with_the_test_run()

if os.environ.get("TESTS_KEYS_EVERY"):
    # how often the worker re-reads which keys seal the journal (test_encryption.py: its
    # default, 30 s, is too long to wait for in a test)
    from sagaworker._core import celery_worker as _celery_worker

    _celery_worker.KEYS_EVERY = float(os.environ["TESTS_KEYS_EVERY"])


# agent runs with plain function tools (it imports this module's ledger: imported here, once
# what it uses is defined)
from tests.apps import agent_runs  # noqa: E402


def build(settings: Settings | None = None) -> tuple[Celery, Sagaworker]:
    """The test app: the same tools in the worker and in the test process (the producer)."""
    settings = settings or Settings()
    app = Celery("tests.apps.cluster")
    app.conf.task_default_queue = os.environ.get("TEST_DEFAULT_QUEUE", "celery")
    app.conf.broker_url = settings.broker_url
    if os.environ.get("TEST_SENT_EVENTS") == "1":
        app.conf.task_send_sent_event = True
    sw = Sagaworker(app, settings=settings)
    if not _url:
        _url.append(settings.database_url)

    @sw.tool(compensable_by="undo_step")
    def step(key: str, name: str, fail: bool = False, sleep: float = 0.0) -> str:
        """A generic effect; fails on demand, takes time on demand."""
        if sleep:
            time.sleep(sleep)
        if fail:
            raise Boom(f"{name} failed on purpose")
        record(key, "effect", name)
        return f"{name}-done"

    @sw.compensation
    def undo_step(ctx: CompensationContext) -> None:
        """Idempotent, as every undo must be: keyed by ``ctx.idempotency_key``, so a try
        repeated after a crash (effect applied, outcome not yet journaled) changes nothing."""
        if os.environ.get("TEST_UNDO_SLEEP"):
            time.sleep(float(os.environ["TEST_UNDO_SLEEP"]))
        record_once(ctx.idempotency_key, ctx.args[0], "undo", ctx.args[1], result=ctx.result,
                    attempt=ctx.attempt, reason=ctx.reason,
                    idempotency_key=ctx.idempotency_key, seq=ctx.seq)

    @sw.tool(compensable_by="undo_then_pause")
    def slow_undo_step(key: str, name: str, pause: float) -> str:
        record(key, "effect", name)
        return name

    @sw.compensation
    def undo_then_pause(ctx: CompensationContext) -> None:
        """Applies its undo (idempotently), then holds the chain for ``pause`` seconds on
        its first try: the window in which a crash leaves the outcome unjournaled."""
        record_once(ctx.idempotency_key, ctx.args[0], "undo", ctx.args[1], attempt=ctx.attempt)
        if ctx.attempt == 1:
            time.sleep(ctx.args[2])

    @sw.tool(compensable_by="undo_broken", reversibility=Reversibility.REVERSIBLE)
    def broken_undo_step(key: str, name: str) -> str:
        record(key, "effect", name)
        return name

    @sw.compensation
    def undo_broken(ctx: CompensationContext) -> None:
        record(ctx.args[0], "undo_try", ctx.args[1], attempt=ctx.attempt,
               idempotency_key=ctx.idempotency_key)
        raise Boom(f"undo of {ctx.args[1]} is broken (try {ctx.attempt})")

    @sw.tool(compensable_by="undo_flaky")
    def flaky_undo_step(key: str, name: str, failures: int) -> str:
        record(key, "effect", name)
        return name

    @sw.compensation
    def undo_flaky(ctx: CompensationContext) -> None:
        record(ctx.args[0], "undo_try", ctx.args[1], attempt=ctx.attempt,
               idempotency_key=ctx.idempotency_key)
        if ctx.attempt <= ctx.args[2]:
            raise Boom(f"flaky undo try {ctx.attempt}")
        record(ctx.args[0], "undo", ctx.args[1], attempt=ctx.attempt)

    @sw.tool(compensable_by="undo_zero")
    def zero_arg_undo_step(key: str) -> str:
        record(key, "effect", "zero")
        return "zero"

    @sw.compensation
    def undo_zero() -> None:
        record(os.environ.get("TEST_ZERO_KEY", "zero"), "undo", "zero")

    @sw.tool()
    def lookup(key: str) -> int:
        """Read-only: no undo, SKIPPED at compensation time."""
        record(key, "effect", "lookup")
        return 42

    @sw.tool(reversibility=Reversibility.IRREVERSIBLE)
    def ship(key: str, parcel: str) -> str:
        record(key, "effect", "ship", parcel=parcel)
        return f"shipped-{parcel}"

    @sw.tool(compensable_by="undo_step", autoretry_for=(Boom,), max_retries=2,
             default_retry_delay=0)
    def retried(key: str, name: str, failures: int) -> str:
        """Fails its first ``failures`` attempts, then succeeds (Celery retries it)."""
        record(key, "try", name)
        if count(key, "try", name) <= failures:
            raise Boom(f"{name} transient failure")
        record(key, "effect", name)
        return name

    @sw.tool(compensable_by="undo_step", max_retries=1)
    def retries_by_hand(key: str, name: str, asks: int) -> str:
        """Its first ``asks`` attempts ask Celery for a retry (``current_task.retry``)."""
        from celery import current_task

        record(key, "try", name)
        if count(key, "try", name) <= asks:
            current_task.retry(exc=Boom(f"{name} asks again"), countdown=0)
        record(key, "effect", name)
        return name

    @sw.tool(compensable_by="undo_step", max_retries=1)
    def retries_later(key: str, name: str, asks: int, countdown: float | None) -> str:
        """Its first ``asks`` attempts ask Celery for a retry in ``countdown`` seconds
        (``current_task.retry(countdown=...)``, as the README shows; None: Celery's
        default delay)."""
        from celery import current_task

        record(key, "try", name, retries=current_task.request.retries)
        if count(key, "try", name) <= asks:
            if countdown is None:
                current_task.retry(exc=Boom(f"{name} asks again"))
            current_task.retry(exc=Boom(f"{name} asks again"), countdown=countdown)
        record(key, "effect", name)
        return name

    @sw.tool(compensable_by="undo_step")
    def celery_verdict(key: str, name: str, how: str) -> str:
        """Raises Celery's ``Ignore`` or ``Reject`` itself (``how``: ignore, reject, requeue)."""
        from celery.exceptions import Ignore, Reject

        record(key, "try", name)
        if how == "ignore":
            raise Ignore()
        raise Reject(f"{name} rejects its message", requeue=how == "requeue")

    @sw.tool(compensable_by="undo_step", idempotent=True)
    def idem(key: str, name: str, sleep: float = 0.0) -> str:
        record(key, "try", name)
        if sleep:
            time.sleep(sleep)
        record(key, "effect", name)
        return name

    @sw.tool(compensable_by="undo_paced")
    def paced(key: str, name: str, sleep: float = 0.0, undo_pause: float = 0.0) -> str:
        """Records its start ("try"), takes ``sleep`` seconds, then records its effect."""
        record(key, "try", name)
        if sleep:
            time.sleep(sleep)
        record(key, "effect", name)
        return name

    @sw.compensation
    def undo_paced(ctx: CompensationContext) -> None:
        """Records its start ("undo_start"), takes ``undo_pause`` seconds, then applies its
        undo (idempotently): two undos that overlap in time interleave their rows."""
        record(ctx.args[0], "undo_start", ctx.args[1], attempt=ctx.attempt)
        time.sleep(float(ctx.kwargs.get("undo_pause", 0.0)))
        record_once(ctx.idempotency_key, ctx.args[0], "undo", ctx.args[1], attempt=ctx.attempt)

    @sw.tool(compensable_by="undo_kills_worker")
    def deadly_undo_step(key: str, name: str) -> str:
        record(key, "effect", name)
        return name

    @sw.compensation
    def undo_kills_worker(ctx: CompensationContext) -> None:
        """Kills its worker process on every try (an OOM kill, a segfault), after writing
        an ``undo_try`` row that proves the try really began."""
        record(ctx.args[0], "undo_try", ctx.args[1], attempt=ctx.attempt)
        os._exit(1)

    @sw.tool(compensable_by="undo_step", idempotent=True)
    def idem_kills_worker(key: str, name: str) -> str:
        """Idempotent, and kills its worker process on every attempt, after its "try" row."""
        record(key, "try", name)
        os._exit(1)

    @sw.tool(compensable_by="undo_step", autoretry_for=(Boom,), max_retries=2,
             default_retry_delay=3)
    def retried_later(key: str, name: str, failures: int) -> str:
        """Like ``retried``, but Celery retries it 3 s later (an ETA message that waits)."""
        record(key, "try", name)
        if count(key, "try", name) <= failures:
            raise Boom(f"{name} transient failure")
        record(key, "effect", name)
        return name

    @sw.tool(compensable_by="undo_pay")
    def pay(key: str, card: str, amount_cents: int, fail: bool = False) -> str:
        """A payment whose error text quotes its card (what SAGAWORKER_REDACT must hide)."""
        if fail:
            raise Boom(f"card {card} declined for {amount_cents} cents")
        record(key, "effect", "pay")
        return "paid"

    @sw.tool(compensable_by="undo_step")
    def counts(key: str) -> dict[str, int]:
        """Returns an object whose keys PostgreSQL's jsonb stores in another order."""
        record(key, "effect", "counts")
        return {"zz": 1, "a": 2, "bbb": 3}

    @sw.tool(compensable_by="undo_step")
    def whoami(key: str) -> str:
        """Records ``celery.current_task``'s request id and arguments."""
        from celery import current_task

        req = current_task.request
        record(key, "effect", "whoami", task_id=req.id, args=list(req.args or []))
        return str(req.id)

    @sw.tool(compensable_by="undo_pay")
    def noisy_pay(key: str, card: str) -> str:
        """A payment that logs its card (the worker must scrub it while the step runs)."""
        logging.getLogger("shop").warning("charging card %s", card)
        record(key, "effect", "noisy_pay")
        return "paid"

    @sw.tool(compensable_by="undo_pay")
    def chatty_pay(key: str, card: str) -> str:
        """A payment that print()s its card, on stdout and stderr (the worker must scrub
        what Celery redirects from them while the step runs)."""
        import sys

        print(f"charging card {card}")
        print(f"card {card} charged", file=sys.stderr)
        record(key, "effect", "chatty_pay")
        return "paid"

    @sw.tool(compensable_by="undo_pay")
    def leaky(key: str, card: str, shape: str) -> str:
        """Fails with ``card`` in an exception of the given shape."""
        raise leak(card, shape)

    @sw.tool(compensable_by="undo_pay", autoretry_for=(Boom,), max_retries=1,
             default_retry_delay=0)
    def leaky_retried(key: str, card: str, shape: str) -> str:
        """Retried by Celery once, then fails: ``shape`` "self" asks for the retry itself
        (``Task.retry(exc=...)``), any other shape is retried through ``autoretry_for``."""
        if shape == "self":
            from celery import current_task

            current_task.retry(exc=leak(card, "plain"), countdown=0)
        raise leak(card, shape)

    @sw.tool(compensable_by="undo_pay")
    def charge_default(key: str, card: str = DEFAULT_CARD, fail: bool = False) -> str:
        """A default card, quoted by its error."""
        if fail:
            raise Boom(f"card {card} declined")
        record(key, "effect", "charge_default")
        return "charged"

    @sw.compensation
    def undo_pay(ctx: CompensationContext) -> None:
        record(ctx.args[0] if ctx.args else ctx.kwargs["key"], "undo", "pay")

    @sw.tool(compensable_by="undo_object")
    def returns_object(key: str) -> Any:
        record(key, "effect", "returns_object")
        return NotJson()

    @sw.compensation
    def undo_object(ctx: CompensationContext) -> None:
        record_once(ctx.idempotency_key, ctx.args[0], "undo", "returns_object",
                    result=ctx.result, args=ctx.args)

    @sw.tool()
    def typed_values(key: str, when: datetime, amount: Decimal, ref: UUID) -> dict[str, Any]:
        """Celery's JSON types in and out: what arrived is recorded by type name."""
        record(key, "effect", "typed_values",
               types=[type(v).__name__ for v in (when, amount, ref)])
        return {"next_day": when + timedelta(days=1), "double": amount * 2, "ref": ref}

    @sw.tool(compensable_by="undo_astep")
    async def astep(key: str, name: str, fail: bool = False, pause: float = 0.0) -> dict[str, Any]:
        """An ``async def`` tool: awaits, then records; reports its idempotency key and
        whether it ran on an event loop (to show the worker ran the coroutine through)."""
        await asyncio.sleep(pause)
        if fail:
            raise Boom(f"{name} failed on purpose")
        record(key, "effect", name)
        return {"name": name, "loop": asyncio.get_running_loop() is not None,
                "key": current_idempotency_key()}

    @sw.compensation
    async def undo_astep(ctx: CompensationContext) -> None:
        await asyncio.sleep(0)
        record_once(ctx.idempotency_key, ctx.args[0], "undo", ctx.args[1],
                    current=current_compensation_key())

    # -- async tools at their edges (tests/integration/test_async_tools.py) -------------
    @sw.tool(compensable_by="undo_abg")
    async def abg(key: str, name: str, delay: float) -> str:
        """An async tool that leaves a background task behind (a fire-and-forget
        notification): the task records a ``late`` effect ``delay`` seconds later."""
        async def later() -> None:
            await asyncio.sleep(delay)
            record(key, "late", name, idem=current_idempotency_key())

        asyncio.get_running_loop().create_task(later())
        record(key, "effect", name)
        return f"{name}-done"

    @sw.compensation
    async def undo_abg(ctx: CompensationContext) -> None:
        record_once(ctx.idempotency_key, ctx.args[0], "undo", ctx.args[1])

    @sw.tool(compensable_by="undo_step", soft_time_limit=1)
    async def aslow(key: str, name: str, sleep: float) -> str:
        """An async tool over its 1 s soft time limit when ``sleep`` > 1; its ``finally``
        records a cleanup (the coroutine is unwound, not abandoned)."""
        try:
            await asyncio.sleep(sleep)
            record(key, "effect", name)
            return f"{name}-done"
        finally:
            record(key, "cleanup", name)

    @sw.tool(compensable_by="undo_step", autoretry_for=(Boom,), max_retries=2,
             default_retry_delay=0)
    async def aretried(key: str, name: str, failures: int) -> str:
        """An async tool retried by Celery: fails its first ``failures`` attempts."""
        await asyncio.sleep(0)
        record(key, "attempt", name)
        if count(key, "attempt", name) <= failures:
            raise Boom(f"{name} attempt failed")
        record(key, "effect", name)
        return f"{name}-done"

    @sw.tool(compensable_by="undo_step")
    async def acached(key: str, name: str, fail_in_gather: bool = False) -> int:
        """Uses an async client the module caches (redis.asyncio, as the README's "a
        client the module caches stays bound to a live loop"); ``fail_in_gather`` fails
        one call of an ``asyncio.gather`` while its sibling is still running."""
        if not _clients:
            import redis.asyncio as aredis

            # the run's own Redis database (tests/conftest.py), never a shared one
            _clients.append(aredis.Redis.from_url(os.environ["TESTS_REDIS_URL"]))
        n = int(await _clients[0].incr(f"sw-review-{key}"))
        if fail_in_gather:
            async def fails() -> None:
                raise Boom(f"{name} failed on purpose")

            await asyncio.gather(fails(), asyncio.sleep(2))
        record(key, "effect", name, n=n)
        return n

    @sw.tool(compensable_by="undo_step")
    def sync_returns_coro(key: str, name: str) -> Any:
        """A plain function returning a coroutine: the worker awaits it."""
        async def go() -> str:
            await asyncio.sleep(0)
            record(key, "effect", name, idem=current_idempotency_key())
            return f"{name}-done"
        return go()

    # the trip an agent books (tests/agents): a hotel, a card charge, a voucher mail
    @sw.tool(compensable_by="cancel_hotel")
    def book_hotel(key: str, city: str, nights: int) -> dict[str, Any]:
        """Book a hotel room in a city for a number of nights."""
        record(key, "effect", "book_hotel", city=city, nights=nights)
        return {"booking": f"H-{city}-{nights}"}

    @sw.compensation
    def cancel_hotel(ctx: CompensationContext) -> None:
        record_once(ctx.idempotency_key, ctx.args[0], "undo", "book_hotel")

    @sw.tool(compensable_by="refund_card")
    async def charge_card(key: str, card: str, amount_cents: int) -> dict[str, Any]:
        """Charge a card; the card "declined" is refused (the step FAILS)."""
        await asyncio.sleep(0)
        if card == "declined":
            raise Boom("card declined")
        record(key, "effect", "charge_card", amount_cents=amount_cents)
        return {"charge": f"C-{amount_cents}"}

    @sw.compensation
    def refund_card(ctx: CompensationContext) -> None:
        record_once(ctx.idempotency_key, ctx.args[0], "undo", "charge_card")

    @sw.tool(reversibility=Reversibility.IRREVERSIBLE)
    def send_voucher(key: str, email: str) -> str:
        """Mail the trip's voucher to a customer (cannot be unsent)."""
        record(key, "effect", "send_voucher", email=email)
        return f"voucher sent to {email}"

    # the durable trip agent is built on its first run (Pydantic AI is a slow import that
    # every other test's worker would pay for)
    AGENTS.clear()
    @sw.tool(idempotent=True)
    def quote_room(key: str, city: str) -> str:
        """Quote a room's price in a city (asking twice is harmless)."""
        first = not any(r.tool == "quote_room" for r in rows(_url[0], key))
        record(key, "effect", "quote_room", city=city)
        if first:
            time.sleep(30)
        return f"Q-{city}"

    AGENTS["tools"] = (sw, [book_hotel, charge_card, send_voucher, quote_room])
    for flow in FLOWS:
        sw.flow()(flow)
    sw.flow(on_divergence="compensate")(strict_steps)
    retry_tools(sw)
    for flow in agent_runs.FLOWS:
        sw.flow()(flow)
    return app, sw


def current_compensation_key() -> str | None:
    from sagaworker._recovery.compensation import current_compensation

    ctx = current_compensation.get(None)
    return None if ctx is None else ctx.idempotency_key


if os.environ.get("TESTS_APP_WORKER") == "1":  # set by the fixtures for worker processes
    app, sw = build()


# a fault between a step's claim and its tool's call (tests/integration/test_hardening.py):
# the run's span cannot be made, once per process, at the n-th step run (TEST_FAIL_AT,
# 1 by default) of the sagas whose id starts with TEST_FAIL_BEFORE_TOOL
if os.environ.get("TEST_FAIL_BEFORE_TOOL"):
    from sagaworker._observe import tracing as _tracing

    _real_span, _runs = _tracing.step_span, []

    def _step_span(tool: str, saga_id: str, *a: Any, **k: Any) -> Any:
        if saga_id.startswith(os.environ["TEST_FAIL_BEFORE_TOOL"]):
            _runs.append(saga_id)
            if len(_runs) == int(os.environ.get("TEST_FAIL_AT", "1")):
                raise RuntimeError("injected: no span before the tool")
        return _real_span(tool, saga_id, *a, **k)

    _tracing.step_span = _step_span  # type: ignore[assignment]


# a tracing exporter that blocks (a collector away, spans exported as they end): in the
# sagas whose id starts with TEST_STALLED_SPANS, the export of the idempotent step's
# enqueue span (ended by the advance that claimed that step to run it here) waits until
# another delivery claimed the step again (its attempts > 1), at most 30 s
if os.environ.get("TEST_STALLED_SPANS"):
    from tests.apps import spans as _spans

    def _claimed_again(saga_id: str) -> bool:
        return any(e.attempts > 1 for e in sw.journal.saga_and_entries(saga_id)[1])

    _spans.install_stalling(os.environ["TEST_STALLED_SPANS"], "enqueue tests.apps.cluster.idem",
                            _claimed_again)


# tracing (tests/integration/test_tracing.py): spans to a file; Celery's instrumentation
if os.environ.get("TEST_SPANS_FILE"):
    from tests.apps import spans as _spans

    _spans.install(os.environ["TEST_SPANS_FILE"])
    if os.environ.get("TEST_OTEL_CELERY") == "1":
        from opentelemetry.instrumentation.celery import CeleryInstrumentor

        CeleryInstrumentor().instrument()

