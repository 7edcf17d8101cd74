"""``async def`` flows in-process (the real journal and replay on SQLite, no worker): the
toolkit's compensation check, task groups, and a divergence held as for sync flows."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest
from celery import Celery

from sagaworker import FlowContext, SagaStatus, Sagaworker, Settings
from sagaworker.testing import check_compensation
from tests.unit.test_flow_sweeps import FlowBus, run_step

PLAIN = "tests.unit.test_async_flows.plain"
CODE = {"v": "1"}


def plain(n: int) -> int:
    return n


def unplain() -> None:
    return None


async def fanned(s: FlowContext, n: int) -> list[int]:
    """A step, then two at once in a task group (as agent frameworks run tools), then one."""
    first = await s.call(PLAIN, n)
    async with asyncio.TaskGroup() as tg:
        a = tg.create_task(s.call(PLAIN, n + 1))
        b = tg.create_task(s.call(PLAIN, n + 2))
    last = await s.call(PLAIN, a.result() + b.result())
    return [first, a.result(), b.result(), last]


async def changing(s: FlowContext, n: int) -> int:
    return int(await s.call(PLAIN, n + (100 if CODE["v"] == "2" else 0)))


async def raising(s: FlowContext, n: int) -> None:
    await s.call(PLAIN, n)
    raise ValueError("no stock")


@pytest.fixture
def sw(tmp_path: Path) -> Iterator[Sagaworker]:
    CODE["v"] = "1"
    sw = Sagaworker(Celery("async-flows", broker="memory://"), settings=Settings(
        database_url=f"sqlite:///{tmp_path / 'j.db'}", broker_url="memory://"))
    sw.compensation(unplain)
    sw.tool(compensable_by="unplain")(plain)
    for f in (fanned, changing, raising):
        sw.flow()(f)
    yield sw


def test_an_async_flow_with_a_task_group_compensates_every_step_in_reverse(
        sw: Sagaworker) -> None:
    """Each step failed in turn, and lost in turn: what ran is undone latest first."""
    cases = check_compensation(sw, fanned, 1, crash=True)
    assert [c.seq for c in cases] == [1, 2, 3, 4, 1, 2, 3, 4]


def test_a_task_group_waits_on_both_of_its_steps(sw: Sagaworker) -> None:
    sw.rt.bus = FlowBus([])
    sw.start("g-1", fanned, 1)
    sw.flows.advance("g-1")
    run_step(sw, "g-1", 1, PLAIN, 1)
    sw.flows.advance("g-1")  # both steps of the group journaled together
    assert [e.args for e in sw.inspect("g-1").entries] == [[1], [2], [3]]
    run_step(sw, "g-1", 2, PLAIN, 2)
    sw.flows.advance("g-1")  # one of the two has an outcome: still waiting
    assert len(sw.inspect("g-1").entries) == 3
    run_step(sw, "g-1", 3, PLAIN, 3)
    sw.flows.advance("g-1")
    assert [e.args for e in sw.inspect("g-1").entries][-1] == [5]


def test_an_async_flow_that_diverges_is_held(sw: Sagaworker) -> None:
    sw.rt.bus = FlowBus([])
    sw.start("c-1", changing, 1)
    sw.flows.advance("c-1")
    CODE["v"] = "2"
    sw.flows.advance("c-1")
    rec = sw.inspect("c-1")
    assert rec.status is SagaStatus.RUNNING
    assert (rec.diverged or "").startswith("flow diverged at step 1")


def test_an_async_flow_that_raises_fails_its_saga(sw: Sagaworker) -> None:
    sw.rt.bus = FlowBus([])
    sw.start("r-1", raising, 1)
    sw.flows.advance("r-1")
    run_step(sw, "r-1", 1, PLAIN, 1)
    sw.flows.advance("r-1")
    assert sw.inspect("r-1").reason == "the flow raised ValueError: no stock"

