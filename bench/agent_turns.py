"""``python -m bench.agent_turns``: what a durable turn of a Pydantic AI agent costs.

One process, about a minute, on its own PostgreSQL database ``bench_turns_<run>``. A
scripted model of zero latency (``FunctionModel``) asks for a tool ``--turns`` times, then
answers; the tool does nothing. The same agent runs, side by side, ``--rounds`` times each:

- ``plain``: no durability (the floor: Pydantic AI's own cost);
- ``sagaworker``: ``Durability(sw)`` inside an ``async def`` flow advanced in this process
  (every model request and every tool call a journaled durable unit: no broker hop, as
  DBOS runs its steps in the workflow's process);
- ``dbos``: ``DBOSDurability`` inside a DBOS workflow on the same PostgreSQL (each model
  request a DBOS step; the tool a ``@DBOS.step``).

It reports each one's median time per turn, the added cost of a durable turn (durable
minus plain) and its ratio sagaworker / DBOS, and the cost of a worker's replay of a
journal that already holds 1, 10 and 20 turns (what a resumed run pays before it goes on).

    .venv/bin/python -m bench.agent_turns --turns 20 --rounds 5
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
import uuid
from typing import Any

import psycopg

from sagaworker import FlowContext, Sagaworker, Settings
from sagaworker._journal.migrate import upgrade

ADMIN = "host=127.0.0.1 port=5432 user=root dbname=postgres"
TURNS = {"n": 20}


def model_fn(messages: list[Any], info: Any) -> Any:
    from pydantic_ai.messages import ModelResponse, TextPart, ToolCallPart

    turn = sum(isinstance(m, ModelResponse) for m in messages)
    if turn < TURNS["n"]:
        return ModelResponse(parts=[ToolCallPart("noop", {"i": turn},
                                                 tool_call_id=f"c{turn}")])
    return ModelResponse(parts=[TextPart("done")])


def noop(i: int) -> int:
    """Do nothing with a number."""
    return i


class _NoBroker:
    """The bench advances flows itself: nothing is sent (a flow of durable units only)."""

    def send_advance(self, saga_id: str) -> None:
        return None

    def __getattr__(self, name: str) -> Any:
        raise AssertionError(f"the bench's flows send nothing ({name})")


def agents(sw: Sagaworker) -> dict[str, Any]:
    from pydantic_ai import Agent
    from pydantic_ai.models.function import FunctionModel
    from pydantic_ai.toolsets import FunctionToolset

    from sagaworker.agents.pydantic_ai import Durability

    def new(name: str, caps: list[Any], tool: Any) -> Any:
        return Agent(FunctionModel(model_fn), name=name, capabilities=caps,
                     toolsets=[FunctionToolset([tool], id="bench-tools")])

    return {"plain": new("plain", [], noop), "sagaworker": new("swturns", [Durability(sw)],
                                                               noop)}


AGENTS: dict[str, Any] = {}


async def sw_flow(s: FlowContext) -> str:
    return str((await AGENTS["sagaworker"].run("go")).output)


def dbos_runner(url: str) -> Any:
    """A DBOS workflow running the agent with DBOSDurability, launched on ``url``."""
    from dbos import DBOS, DBOSConfig
    from pydantic_ai import Agent, Tool
    from pydantic_ai.durable_exec.dbos import DBOSDurability
    from pydantic_ai.models.function import FunctionModel
    from pydantic_ai.toolsets import FunctionToolset

    config: DBOSConfig = {"name": "sagaworker-bench-turns", "system_database_url": url,
                          "log_level": "WARNING"}
    DBOS(config=config)
    noop_step = DBOS.step(name="noop")(noop)

    def dbos_noop(i: int) -> int:
        """Do nothing with a number."""
        return int(noop_step(i))

    agent = Agent(FunctionModel(model_fn), name="dbosturns", capabilities=[DBOSDurability()],
                  toolsets=[FunctionToolset([Tool(dbos_noop, name="noop")], id="bench-tools")])

    @DBOS.workflow()
    async def dbos_trip() -> str:
        return str((await agent.run("go")).output)

    DBOS.launch()
    return dbos_trip


def timed_async(fn: Any) -> float:
    t = time.perf_counter()
    asyncio.run(fn())
    return time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--turns", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--no-dbos", action="store_true")
    a = ap.parse_args()
    TURNS["n"] = a.turns
    name = f"bench_turns_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(ADMIN, autocommit=True) as c:
        c.execute(f'CREATE DATABASE "{name}"')
    url = f"postgresql://root@127.0.0.1:5432/{name}"
    sw: Sagaworker | None = None
    try:
        upgrade(url)
        from celery import Celery

        sw = Sagaworker(Celery("bench_turns"), settings=Settings(
            database_url=url, broker_url="memory://"))
        sw.tool()(noop)  # (registered: the flow's own tools; the agent's noop is a unit)
        sw.flow()(sw_flow)
        sw.rt.bus = _NoBroker()  # type: ignore[assignment]
        AGENTS.update(agents(sw))
        dbos_trip = None if a.no_dbos else dbos_runner(url)

        def run_sw() -> float:
            saga_id = f"t-{uuid.uuid4().hex[:10]}"
            t = time.perf_counter()
            sw.start(saga_id, sw_flow)
            sw.flows.advance(saga_id)
            took = time.perf_counter() - t
            assert sw.inspect(saga_id).status.value == "COMPLETED"
            return took

        runs: dict[str, list[float]] = {"plain": [], "sagaworker": []}
        if dbos_trip is not None:
            runs["dbos"] = []
        for _ in range(a.rounds + 1):  # the first round warms every path up: dropped
            runs["plain"].append(timed_async(lambda: AGENTS["plain"].run("go")))
            runs["sagaworker"].append(run_sw())
            if dbos_trip is not None:
                runs["dbos"].append(timed_async(dbos_trip))
        med = {k: statistics.median(v[1:]) for k, v in runs.items()}
        per = {k: v / (a.turns + 1) * 1000 for k, v in med.items()}  # ms per model turn
        added = {k: per[k] - per["plain"] for k in per if k != "plain"}
        out: dict[str, Any] = {
            "turns": a.turns, "rounds": a.rounds,
            "run_seconds_median": {k: round(v, 4) for k, v in med.items()},
            "run_seconds_spread": {k: [round(min(v[1:]), 4), round(max(v[1:]), 4)]
                                   for k, v in runs.items()},
            "ms_per_turn": {k: round(v, 3) for k, v in per.items()},
            "added_ms_per_durable_turn": {k: round(v, 3) for k, v in added.items()},
        }
        if "dbos" in added:
            out["sagaworker_over_dbos_per_turn"] = round(added["sagaworker"] / added["dbos"], 2)
        out["replay_ms_with_turns_journaled"] = replay_costs(sw, a.turns, a.rounds)
        print(json.dumps(out, indent=2))
    finally:
        if not a.no_dbos:
            try:
                from dbos import DBOS

                DBOS.destroy(destroy_registry=True)
            except Exception:
                pass
        if sw is not None:
            sw.rt.reset_engine()
        with psycopg.connect(ADMIN, autocommit=True) as c:
            c.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def replay_costs(sw: Sagaworker, turns: int, rounds: int) -> dict[str, float]:
    """A read-only replay (what a resumed worker runs first) of journals holding 1, 10 and
    ``turns`` turns: the journal of a completed run cut at that turn."""
    from sagaworker._worker.replay import replay

    saga_id = f"r-{uuid.uuid4().hex[:10]}"
    sw.start(saga_id, sw_flow)
    sw.flows.advance(saga_id)
    saga, rows = sw.journal.saga_and_entries(saga_id)
    spec = sw.flows.specs[saga.flow]
    out = {}
    for k in sorted({1, min(10, turns), turns}):
        cut = rows[: 2 * k - 1]  # turn k's request, after k - 1 requests and tool calls
        times = []
        for _ in range(rounds):
            t = time.perf_counter()
            replay(sw.rt, sw.producer, spec, saga, list(cut))
            times.append(time.perf_counter() - t)
        out[f"turn_{k}"] = round(statistics.median(times) * 1000, 3)
    return out


if __name__ == "__main__":  # the flows' names are their module's: bench.agent_turns
    from bench.agent_turns import main as main_of_the_module

    main_of_the_module()
