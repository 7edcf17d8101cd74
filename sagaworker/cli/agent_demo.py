"""``sagaworker demo --agent``: the example's trip agent (Pydantic AI) as a durable flow on
the embedded defaults, a scripted model unless SAGAWORKER_AGENT_MODEL names a real one.

Three trips: one whose worker is killed (SIGKILL) while the model answers its first turn
and which another worker finishes from the journal (the model's requests counted: only
the one in flight at the kill is sent again); one that waits at the voucher's gate with
every worker stopped and finishes after the signed approval; one whose declined card
cancels the hotel."""

from __future__ import annotations

import importlib
import time
from collections import Counter
from pathlib import Path
from typing import Any

from .._base.errors import ConfigurationError
from .._observe.records import Redaction
from .demo import EXAMPLE, Workers, _closing, _embedded, _example_here, _not_here
from .render import console, render_saga

__all__ = ["run_agent_demo"]

T = 120


def _say(text: str) -> None:
    console.print(f"  {text}", markup=False)


def _wait(check: Any, what: str) -> Any:
    deadline = time.monotonic() + T
    while time.monotonic() < deadline:
        got = check()
        if got:
            return got
        time.sleep(0.1)
    raise RuntimeError(f"the demo waited {T} s for {what}")


def _requests(folder: Path, guest: str) -> Counter[int]:
    log = folder / "model-requests.log"
    lines = log.read_text().splitlines() if log.exists() else []
    return Counter(int(turn) for g, _, turn in (ln.rpartition(" ") for ln in lines)
                   if g == guest)


def _gate(sw: Any, saga_id: str) -> Any:
    return next((r for r in sw.pending_approvals() if r.saga_id == saga_id), None)


def _approve(sw: Any, saga_id: str) -> None:
    req = _wait(lambda: _gate(sw, saga_id), "the voucher's gate")
    sw.approve(req.token, approver="demo-operator")
    _say(f"operator: approves step {req.seq} ({req.tool_name.rsplit('.', 1)[-1]}) with the "
         "gate's signed token")


def _show(sw: Any, res: Any) -> None:
    _say(f"{res.saga_id}: {res.status.value}" + (f", agent: {res.value}" if res.value else ""))
    render_saga(sw.inspect(res.saga_id), Redaction.of(sw))


def _killed(sw: Any, agent: Any, workers: Workers, folder: Path) -> Any:
    trip = agent.Trip("2001", "Ana", "Lisbon", 3, "card-4242", "ana@example.org")
    _say(f"guest: {trip.prompt()}")
    agent.start_trip(trip)
    _wait(lambda: _requests(folder, "Ana")[0] == 1, "the model's first turn")
    workers.kill()
    _say("the worker is killed (SIGKILL) while the model answers turn 1; a new one starts")
    workers.start()
    _approve(sw, trip.saga_id)
    res = sw.get(trip.saga_id).wait(timeout=T)
    _show(sw, res)
    sent = _requests(folder, "Ana")
    _say("model requests per turn: " + ", ".join(
        f"turn {t + 1}: {n}" for t, n in sorted(sent.items()))
        + " (turn 1 was in flight at the kill: sent again; no other turn twice)")
    return res


def _gated(sw: Any, agent: Any, workers: Workers) -> Any:
    trip = agent.Trip("2003", "Cleo", "Faro", 1, "card-5555", "cleo@example.org")
    _say(f"guest: {trip.prompt()}")
    agent.start_trip(trip)
    _wait(lambda: _gate(sw, trip.saga_id), "the voucher's gate")
    workers.stop()
    _say("the trip waits at the voucher's gate; every worker is stopped: no process runs "
         "the agent")
    _approve(sw, trip.saga_id)
    workers.start()
    _say("a worker starts and finishes the run from the journal")
    res = sw.get(trip.saga_id).wait(timeout=T)
    _show(sw, res)
    return res


def _declined(sw: Any, agent: Any) -> Any:
    trip = agent.Trip("2002", "Ben", "Porto", 2, "declined-0002", "ben@example.org")
    _say(f"guest: {trip.prompt()}")
    res = agent.start_trip(trip).wait(timeout=T)
    _show(sw, res)
    return res


def run_agent_demo(*, keep: bool = False) -> int:
    if not _example_here():
        return _not_here()
    try:
        importlib.import_module("sagaworker.agents.pydantic_ai")
    except ConfigurationError as exc:
        console.print(f"error: {exc}", markup=False)
        return 2
    demo = {"TRIP_DEMO_FOLDER": "{folder}", "TRIP_DEMO_PAUSE": "Ana",
            "SAGAWORKER_REDELIVER_AFTER": "3", "SAGAWORKER_RELAY_AFTER": "2",
            "SAGAWORKER_SWEEP_INTERVAL": "1"}
    with _embedded(keep, **demo) as (folder, tasks, workers):
        agent = importlib.import_module(f"{EXAMPLE}.agent")
        console.print(f"model: {agent.real_model() or 'scripted, offline'} "
                      "(SAGAWORKER_AGENT_MODEL names a Pydantic AI model)", markup=False)
        sw = tasks.sw
        console.rule("1. a worker killed mid-run: another finishes it from the journal")
        ok = _killed(sw, agent, workers, folder)
        console.rule("2. a trip at the voucher's gate with no process alive, approved")
        gated = _gated(sw, agent, workers)
        console.rule("3. a trip whose card is declined: the hotel is cancelled")
        bad = _declined(sw, agent)
        done = [ok, gated, bad]
        _closing(folder, keep, ", ".join(f"{r.saga_id} {r.status.value}" for r in done),
                 "sagaworker demo --agent")
        return 0 if [r.status.value for r in done] == ["COMPLETED", "COMPLETED",
                                                         "COMPENSATED"] else 1
