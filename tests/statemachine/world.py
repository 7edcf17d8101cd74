"""What the model checker keeps beside the journal: the broker, the application (tools, a
flow), and the world (which attempts and undos run, which effects happened)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

from celery import Celery
from pydantic import SecretStr

from sagaworker import FlowContext, Reversibility, SagaStatus, Sagaworker, Settings
from sagaworker._journal.dialect import db_later
from tests.conftest import TEST_SECRET

MAX_RERUNS = 1  # one re-run of an idempotent step whose attempt was lost
#: the model's clock: the sweeper sees a row as old only once ``lapse`` moved it back by
#: more than this, never because real time passed (a slow example on PostgreSQL passed the
#: sweeper's 10 s failure cut-off and made the run nondeterministic)
EPOCH = 10 * 365 * 86400.0
RETRIES = 1  # SAGAWORKER_COMPENSATION_RETRIES: 1 + 1 tries per undo
MAX_RETRIES = 1  # the tools' Celery max_retries: a tool's own retry() asked once at most
MODEL_TRIES = 2  # SAGAWORKER_MODEL_RETRIES: a model request's tries in all
MAX_SAGAS = 4  # in one example
#: SAGAWORKER_UNIT_LEASE: shorter than a tool step's lease (``redeliver_after``), long in
#: real time (a lease lapses when the model says: ``leases``)
UNIT_LEASE = 300.0
TOOLS = ("plain", "idem", "ship", "lookup")
PREFIX = "tests.statemachine.world."
PLAIN, IDEM, SHIP, LOOKUP = (PREFIX + t for t in TOOLS)
QUEUE = "model"  # the broker queue of every step message


class Code:
    """The flows' code as the workers run it now: a saga in ``changed`` is replayed by code
    a deploy changed, which asks for another first step than its journal holds."""

    changed: set[str] = set()


def model_flow(s: FlowContext, n: int) -> dict[str, int]:
    """The flow the model runs: a step, two in parallel, a gated one (each tool returns its
    argument, so what the flow asks for is known in advance: ``flow_calls``)."""
    if s.saga_id in Code.changed:
        s.call(LOOKUP, n)  # (diverges: its journal holds PLAIN there)
    a = s.call(PLAIN, n)
    b, c = s.gather(s.enqueue(IDEM, a + 1), s.enqueue(LOOKUP, a + 2))
    d = s.call(SHIP, b + c)
    return {"a": a, "b": b, "c": c, "d": d}


class Died(BaseException):
    """The worker running a model request dies (nothing of the replay's runs after it)."""


class Model:
    """The model an agent flow asks: ``ask`` is each request sent (set by the machine, which
    checks and answers it); its answer for turn ``turn`` of flow ``n`` is ``n + 5 + turn``."""

    ask: Any = None


REQUEST = "agent__model.request"  # (a model request's unit: its lease, its retries)
UNIT = "unit:" + REQUEST


class Overloaded(Exception):
    """The model provider's passing error: a 503 that asks to be tried again in a minute."""

    status_code = 503
    retry_after = 60.0


async def _request(saga_id: str, n: int, turn: int) -> Any:
    await asyncio.sleep(0)  # (the request is under way: a cancel of its call lands here)
    return Model.ask(saga_id, n, turn)


async def agent_flow(s: FlowContext, n: int) -> dict[str, int]:
    """The durable agent run the model checks: a model turn, the tool it asks for, another
    turn (each turn a durable unit journaled by the replay that sends it). For ``n`` ending
    in 3 the framework runs the tool's call and the next turn side by side in a task
    group: the tool's step has no outcome on the first run, so the group cancels the
    turn's call while its request is under way (its unit is shielded: it runs on)."""
    if s.saga_id in Code.changed:
        await s.unit("changed__model.request", lambda: _request(s.saga_id, n, 0))
    first = await s.unit(REQUEST, lambda: _request(s.saga_id, n, 0))
    if n % 10 == 3:
        async with asyncio.TaskGroup() as group:
            call = group.create_task(s.call(PLAIN, first))
            turn = group.create_task(s.unit(REQUEST, lambda: _request(s.saga_id, n, 1)))
        tool, second = call.result(), turn.result()
    else:
        tool = await s.call(PLAIN, first)
        second = await s.unit(REQUEST, lambda: _request(s.saga_id, n, 1))
    return {"first": first, "tool": tool, "second": second}


def answer(n: int, turn: int) -> int:
    return n + 5 + turn


#: the seq of each turn's unit in ``agent_flow``'s journal
TURN_SEQ = (1, 3)


def flow_calls(n: int) -> list[tuple[str, list[Any]]]:
    """Every step ``model_flow(n)`` (``agent_flow`` for an odd n) journals, in order."""
    if n % 2:
        return [(UNIT, []), (PLAIN, [answer(n, 0)]), (UNIT, [])]
    return [(PLAIN, [n]), (IDEM, [n + 1]), (LOOKUP, [n + 2]), (SHIP, [2 * n + 3])]


def flow_value(n: int) -> dict[str, int]:
    if n % 2:
        return {"first": answer(n, 0), "tool": answer(n, 0), "second": answer(n, 1)}
    return {"a": n, "b": n + 1, "c": n + 2, "d": 2 * n + 3}


class RecordingBus:
    """The broker: every message sagaworker sends, kept for the model to deliver."""

    def __init__(self, sagas: list[str]) -> None:
        self.messages: list[tuple[Any, ...]] = []
        self.sagas = sagas  # the examples share a database: only this one's messages

    def publish_step(self, saga_id: str, seq: int, tool: str, args: list[Any],
                     kwargs: dict[str, Any], task_id: str, queue: str | None, *,
                     retries: int = 0, countdown: float | None = None) -> bool:
        if saga_id in self.sagas:  # (with the Celery retry count it carries)
            self.messages.append(("step", saga_id, seq, tool, retries))
        return True

    def send_failure(self, saga_id: str, reason: str) -> None:
        if saga_id in self.sagas:
            self.messages.append(("failure", saga_id, reason))

    def send_compensate(self, saga_id: str, *, countdown: float | None = None) -> None:
        if saga_id in self.sagas:
            self.messages.append(("compensate", saga_id))

    def send_advance(self, saga_id: str, *, countdown: float | None = None) -> None:
        if saga_id in self.sagas:  # (with the countdown it is scheduled for)
            self.messages.append(("advance", saga_id, countdown))

    def queue_of(self, tool: str, queue: str | None) -> str | None:
        return QUEUE  # one list for every step, whatever its tool

    def ready(self, queues: set[str]) -> dict[str, int]:
        """The step messages waiting (the sweeper holds back while there are any)."""
        return {QUEUE: sum(m[0] == "step" for m in self.messages)} if QUEUE in queues else {}


def build(url: str) -> Sagaworker:
    app = Celery("model", broker="memory://")
    sw = Sagaworker(app, settings=Settings(
        database_url=url, broker_url="memory://",
        approval_secret=SecretStr(TEST_SECRET), max_reruns=MAX_RERUNS,
        compensation_retries=RETRIES, relay_after=300,
        redeliver_after=600, model_retries=MODEL_TRIES, unit_lease=UNIT_LEASE))

    @sw.tool(compensable_by="undo_plain")
    def plain(n: int) -> int:
        return n

    @sw.compensation
    def undo_plain() -> None:
        pass

    @sw.tool(compensable_by="undo_plain", idempotent=True)
    def idem(n: int) -> int:
        return n

    @sw.tool(reversibility=Reversibility.IRREVERSIBLE)
    def ship(n: int) -> int:
        return n

    @sw.tool()
    def lookup(n: int) -> int:
        return n

    sw.flow(name="model_flow")(model_flow)
    sw.flow(name="agent_flow")(agent_flow)
    sw.validate()
    sw.flows.heartbeat = None  # the model's (``Beats``): a unit's lease lapses when it says
    sw.sweeper._ago = lambda seconds: db_later(-(seconds + EPOCH))  # type: ignore[method-assign]
    return sw


class Beats:
    """A worker's heartbeat as the model keeps it: what it holds and on which lease; it
    beats only when a move says so (a live worker's, while its lease would lapse)."""

    def __init__(self) -> None:
        self.held: dict[tuple[str, int, bool, str], float | None] = {}

    def hold(self, item: tuple[str, int, bool, str], *, lease: float | None = None) -> None:
        self.held[item] = lease

    def drop(self, item: tuple[str, int, bool, str]) -> None:
        self.held.pop(item, None)


class _Try:
    """What an attempt and an undo try share: a lease that lapses, a worker that dies."""

    dead: bool
    lapsed: bool
    over: bool

    @property
    def holds(self) -> bool:
        """It holds a lease that has not lapsed (dead or not): nobody may take over."""
        return not self.over and not self.lapsed

    @property
    def running(self) -> bool:
        return not self.over and not self.dead


@dataclass
class Attempt(_Try):
    """A forward attempt a worker runs (or ran)."""

    saga_id: str
    seq: int
    tool: str
    token: str
    arg: int
    retries: int = 0       # the Celery retry count of the message it runs
    effect: bool = False
    dead: bool = False     # its worker died: it does nothing more
    lapsed: bool = False   # its lease lapsed; a live one still runs (it finishes late)
    over: bool = False     # it ended: an outcome (journaled or fenced out), or it raised


@dataclass
class Undo(_Try):
    """One try of an undo a chain runs (or ran)."""

    saga_id: str
    seq: int
    token: str
    attempt: int
    applied: bool = False
    dead: bool = False
    lapsed: bool = False
    over: bool = False


@dataclass
class World:
    effects: dict[tuple[str, int], int] = field(default_factory=dict)
    #: undos applied, by their idempotency key (a retry after a crash changes nothing)
    undos: set[tuple[str, int]] = field(default_factory=set)
    undo_order: dict[str, list[int]] = field(default_factory=dict)   # exec_order undone
    terminal: dict[str, SagaStatus] = field(default_factory=dict)
    executed: set[tuple[str, int]] = field(default_factory=set)
    recorded: set[tuple[str, int]] = field(default_factory=set)
    #: the token of the attempt that holds each entry (the last one claimed)
    holder: dict[tuple[str, int], Attempt] = field(default_factory=dict)
    reruns: dict[tuple[str, int], int] = field(default_factory=dict)
    #: retries a tool asked for itself (current_task.retry), journaled
    retried: dict[tuple[str, int], int] = field(default_factory=dict)
    #: steps whose retry is journaled and not yet due (due once the model's time passes)
    not_due: set[tuple[str, int]] = field(default_factory=set)
    #: an undo's tries before the last re-drive (each drive has its own cap)
    tries_before: dict[tuple[str, int], int] = field(default_factory=dict)
    flows: dict[str, int] = field(default_factory=dict)          # flow saga -> its n
    deadlines: set[str] = field(default_factory=set)             # sagas with a deadline
    overdue: set[str] = field(default_factory=set)               # ... that passed
