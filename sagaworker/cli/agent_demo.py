"""``sagaworker demo --agent``: the example's trip agent (Pydantic AI) on the embedded
defaults, a scripted model unless SAGAWORKER_AGENT_MODEL names a real one."""

from __future__ import annotations

import asyncio
import importlib
from typing import Any

from .._base.errors import ConfigurationError
from .._observe.records import Redaction
from .demo import EXAMPLE, _closing, _embedded, _example_here, _not_here
from .render import console, render_saga

__all__ = ["run_agent_demo"]


def _say(text: str) -> None:
    console.print(f"  {text}", markup=False)


class _Operator:
    """Plays the person at the voucher's gate: first approves in the agent framework's
    own terms only (a DeferredToolResults approval, no signed token), which leaves the
    gate pending; asked again, approves with the gate's signed token."""

    def __init__(self, sw: Any) -> None:
        self.sw = sw
        self.asked = 0

    async def __call__(self, saga_id: str, requests: Any) -> None:
        self.asked += 1
        if self.asked == 1:
            _say("operator: approves in the agent's own terms only (DeferredToolResults, "
                 "no signed token)")
            return
        _say("still pending: the journal holds no signed approval")
        for req in await self.sw.apending_approvals():
            if req.saga_id == saga_id:
                await self.sw.aapprove(req.token, approver="demo-operator")
                _say(f"operator: approves step {req.seq} "
                     f"({req.tool_name.rsplit('.', 1)[-1]}) with the gate's signed token")


async def _book(sw: Any, agent: Any, trip: Any) -> Any:
    """One trip: the agent's run(s) as they go, then the journal and its tool-call ids."""
    _say(f"guest: {trip.prompt()}")
    result = await agent.book_trip(trip, _Operator(sw), say=_say)
    rec = await sw.ainspect(trip.saga_id)
    render_saga(rec, Redaction.of(sw))
    console.print("tool-call ids: " + ", ".join(
        f"#{e.seq} {e.tool_name.rsplit('.', 1)[-1]} = {e.call_id}" for e in rec.entries),
        markup=False)
    return result


async def _trips(sw: Any, agent: Any) -> list[Any]:
    console.rule("1. a trip that completes: the voucher mailed once approved with its "
                 "signed token")
    ok = await _book(sw, agent, agent.Trip("2001", "Ana", "Lisbon", 3, "card-4242",
                                           "ana@example.org"))
    console.rule("2. a trip whose card is declined: the run ends, the hotel is cancelled")
    bad = await _book(sw, agent, agent.Trip("2002", "Ben", "Porto", 2, "declined-0002",
                                            "ben@example.org"))
    return [ok, bad]


def run_agent_demo(*, keep: bool = False) -> int:
    if not _example_here():
        return _not_here()
    try:
        importlib.import_module("sagaworker.agents.pydantic_ai")
    except ConfigurationError as exc:
        console.print(f"error: {exc}", markup=False)
        return 2
    with _embedded(keep) as (folder, tasks):
        agent = importlib.import_module(f"{EXAMPLE}.agent")
        console.print(f"model: {agent.real_model() or 'scripted, offline'} "
                      "(SAGAWORKER_AGENT_MODEL names a Pydantic AI model)", markup=False)
        ok, bad = asyncio.run(_trips(tasks.sw, agent))
        _closing(folder, keep, f"{ok.saga_id} {ok.status.value}, {bad.saga_id} "
                               f"{bad.status.value}")
        return 0 if ok.status.value == "COMPLETED" and bad.status.value == "COMPENSATED" else 1
