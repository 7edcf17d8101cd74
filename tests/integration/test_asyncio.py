"""The asyncio twins through real worker processes, and their waits on
PostgreSQL's notifications: no thread per waiter, the loop never blocked."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import pytest

from sagaworker import BadInput, OutcomeResult, Phase, SagaStatus, ToolFailed
from sagaworker._journal.rows import idempotency_key
from sagaworker._producer.aio import POOL_SIZE
from tests.conftest import Cluster, uid
from tests.integration._pgdb import execute
from tests.integration.test_notify import make_sw, notify_url  # noqa: F401 - a fixture

pytestmark = [pytest.mark.services, pytest.mark.one_broker]
T = 60


def kinds(c: Cluster, key: str) -> list[tuple[str, str]]:
    return [(r.kind, r.tool) for r in c.ledger(key)]


def test_async_twins_run_a_saga_with_async_tools(cluster: Cluster) -> None:
    """abegin, aenqueue, aresult, acomplete, aresult on the saga: the async def tool ran to
    completion on the worker's loop, with its step's idempotency key in context."""
    key = uid("a")
    astep = cluster.tool("astep")

    async def main() -> tuple[list[Any], Any, Any]:
        saga = await cluster.sw.abegin(key, metadata={"via": "asyncio"})
        values = []
        for n in ("a", "b"):  # one after the other: the ledger's order is theirs
            values.append(await (await saga.aenqueue(astep, key, n, pause=0.05)).aresult(T))
        await saga.acomplete()
        return list(values), await saga.aresult(timeout=T), await cluster.sw.ainspect(key)

    values, res, rec = asyncio.run(main())
    assert [v["name"] for v in values] == ["a", "b"]
    assert all(v["loop"] for v in values)
    assert [v["key"] for v in values] == [idempotency_key(key, 1, "execute"),
                                          idempotency_key(key, 2, "execute")]
    assert res.status is SagaStatus.COMPLETED
    assert [e.phase for e in rec.entries] == [Phase.EXECUTED, Phase.EXECUTED]
    assert kinds(cluster, key) == [("effect", "a"), ("effect", "b")]


def test_a_failing_async_tool_compensates_through_an_async_undo(cluster: Cluster) -> None:
    """The failing async tool's aresult raises ToolFailed; the saga compensates the
    EXECUTED async step with its async undo, which sees its compensation context."""
    key = uid("af")
    astep = cluster.tool("astep")

    async def main() -> Any:
        saga = await cluster.sw.abegin(key)
        first = await saga.aenqueue(astep, key, "a")
        await first.aresult(timeout=T)
        failing = await saga.aenqueue(astep, key, "b", fail=True)
        with pytest.raises(ToolFailed, match="b failed on purpose"):
            await failing.aresult(timeout=T)
        return await saga.aresult(timeout=T)

    res = asyncio.run(main())
    assert res.status is SagaStatus.COMPENSATED
    assert [(o.seq, o.result) for o in res.report.outcomes] == [(1, OutcomeResult.COMPENSATED)]
    rows = cluster.ledger(key)
    assert [(r.kind, r.tool) for r in rows] == [("effect", "a"), ("undo", "a")]
    assert rows[1].detail["current"] == idempotency_key(key, 1, "compensate")


def test_aresult_times_out_as_result_does(cluster: Cluster) -> None:
    """A step waiting at its gate: aresult(timeout) raises the same TimeoutError result()
    raises, and changes nothing; afail then compensates the saga."""
    key = uid("at")
    gated = cluster.tool("ship")

    async def main() -> Any:
        saga = await cluster.sw.abegin(key)
        step = await saga.aenqueue(gated, key, "p-1")
        with pytest.raises(TimeoutError, match=r"did not finish within 0.3 s. Only the wait ended"):
            await step.aresult(timeout=0.3)
        assert await step.aphase() is Phase.AWAITING_APPROVAL
        await saga.afail("the user gave up")
        return await saga.aresult(timeout=T)

    res = asyncio.run(main())
    assert res.status is SagaStatus.COMPENSATED
    assert "the user gave up" in (res.error or "")


def test_aapprove_releases_the_gate(cluster: Cluster) -> None:
    """apending_approvals hands out the signed token; aapprove lets the step run."""
    key = uid("aa")
    gated = cluster.tool("ship")

    async def main() -> Any:
        saga = await cluster.sw.abegin(key)
        step = await saga.aenqueue(gated, key, "p-1")
        pending = [p for p in await cluster.sw.apending_approvals() if p.saga_id == key]
        assert len(pending) == 1
        await cluster.sw.aapprove(pending[0].token, approver="ops@example.com")
        value = await step.aresult(timeout=T)
        await saga.acomplete()
        return value, await saga.aresult(timeout=T)

    value, res = asyncio.run(main())
    assert value is not None
    assert res.status is SagaStatus.COMPLETED


def test_a_thousand_waits_hold_no_thread_each(notify_url: str) -> None:  # noqa: F811
    """1,000 concurrent aresult waits on journaled steps: the process holds at most the
    listener and the pool's threads meanwhile, and every wait returns once another
    connection commits the outcomes (woken by the notifications)."""
    sw, thing = make_sw(notify_url)
    sagas = [sw.begin(uid("k")) for _ in range(50)]
    steps = [s.enqueue(thing, i) for s in sagas for i in range(20)]
    before = threading.active_count()
    peak = [0]

    async def main() -> list[Any]:
        waits = [asyncio.ensure_future(s.aresult(timeout=T)) for s in steps]

        async def outcomes() -> None:
            while not all(sw.journal._notifier and sw.journal._notifier.notifies(s.saga_id)
                          for s in sagas):
                peak[0] = max(peak[0], threading.active_count())
                await asyncio.sleep(0.05)
            peak[0] = max(peak[0], threading.active_count())
            await asyncio.to_thread(
                execute, notify_url, "UPDATE sagaworker_entries SET phase = 'EXECUTED', "
                "result = to_jsonb(seq * 10) WHERE saga_id = ANY(%s)",
                [s.saga_id for s in sagas])

        values, _ = await asyncio.gather(asyncio.gather(*waits), outcomes())
        return list(values)

    values = asyncio.run(main())
    assert values == [(i + 1) * 10 for _ in sagas for i in range(20)]
    # the listener, the asyncio.to_thread above, and the sagaworker pool at most
    assert peak[0] - before <= POOL_SIZE + 2, (before, peak[0])
    sw.journal.engine.dispose()


def test_enqueue_call_journals_one_step_per_call_id(notify_url: str) -> None:  # noqa: F811
    """The same call id again returns the first step (no second entry); with other
    arguments it is BadInput; racing callers with one id journal one step."""
    sw, thing = make_sw(notify_url)
    saga = sw.begin(uid("c"))
    first = saga.enqueue_call("call_1", thing, [1])
    again = saga.enqueue_call("call_1", thing, [1])
    assert (again.seq, again.task_id) == (first.seq, first.task_id)
    with pytest.raises(BadInput, match="call id 'call_1' already journaled step 1"):
        saga.enqueue_call("call_1", thing, [2])

    async def race() -> list[Any]:
        return list(await asyncio.gather(*(saga.aenqueue_call("call_2", thing, [7])
                                           for _ in range(8))))

    raced = asyncio.run(race())
    assert {s.seq for s in raced} == {2}
    rec = sw.inspect(saga.saga_id)
    assert [(e.seq, e.call_id) for e in rec.entries] == [(1, "call_1"), (2, "call_2")]
    sw.journal.engine.dispose()


def test_astart_runs_a_flow_and_aresult_awaits_it(cluster: Cluster) -> None:
    """astart journals the flow and returns at once; the workers carry it; aresult gives
    its value."""
    from tests.apps.cluster import three_steps

    key = uid("afl")

    async def main() -> Any:
        saga = await cluster.sw.astart(key, three_steps, key)
        return await saga.aresult(timeout=T)

    res = asyncio.run(main())
    assert res.status is SagaStatus.COMPLETED
    assert res.value == {"a": "a-done", "b": "b-done", "c": "c-done"}
    assert kinds(cluster, key) == [("effect", "a"), ("effect", "b"), ("effect", "c")]
