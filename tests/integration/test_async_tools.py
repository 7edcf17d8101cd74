"""``async def`` tools at their edges, on real `celery worker` processes: the worker runs
each to completion on an event loop, with retries, time limits and leases as for any tool."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from sagaworker import Phase, SagaStatus, ToolFailed
from sagaworker._journal.rows import idempotency_key
from tests.conftest import BROKERS, Cluster, _broker, need, new_settings, uid

pytestmark = pytest.mark.services
T = 60


def _one(pg_url: str, tmp: Path, pool: str, concurrency: int) -> Iterator[Cluster]:
    need("rabbitmq", _broker(BROKERS["rabbitmq"]))
    c = Cluster(new_settings(pg_url, BROKERS["rabbitmq"], tmp), tmp, "rabbitmq")
    c.start_worker(concurrency=concurrency, pool=pool)
    yield c
    c.close()


@pytest.fixture(scope="module")
def one_slot(pg_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    """One prefork child: every task runs on the same pool slot (the same kept loop)."""
    yield from _one(pg_url, tmp_path_factory.mktemp(f"slot-{uuid.uuid4().hex[:4]}"),
                    "prefork", 1)


def kinds(c: Cluster, key: str) -> list[tuple[str, str]]:
    return [(r.kind, r.tool) for r in c.ledger(key)]


def test_a_background_task_of_an_async_tool_never_runs_after_its_undo(one_slot: Cluster
                                                                       ) -> None:
    """An async tool leaves a task behind (fire-and-forget, 0.3 s later). The slot's
    loop is kept between tasks but only runs inside ``Runner.run``: the task is frozen
    when the tool returns, and resumes inside whatever async tool runs next on that slot.
    Here the saga is compensated first, then an unrelated saga's async step runs on the
    slot: the first step's leftover task applies its effect after the first step's undo,
    inside the other saga's step, under the first step's idempotency key. asyncio.run
    would have cancelled it when the tool returned; a worker must not let one step's
    effects escape into another step's run (and after its own compensation)."""
    c = one_slot
    key, other = uid("bg"), uid("bg2")

    async def main() -> Any:
        saga = await c.sw.abegin(key)
        await (await saga.aenqueue(c.tool("abg"), key, "a", 0.3)).aresult(T)
        await asyncio.sleep(1.0)  # the leftover task's 0.3 s have long passed
        await saga.afail("the user gave up")
        res = await saga.aresult(T)
        s2 = await c.sw.abegin(other)  # another saga's async step on the same slot
        await (await s2.aenqueue(c.tool("astep"), other, "x", pause=1.0)).aresult(T)
        await s2.acomplete()
        return res

    res = asyncio.run(main())
    assert res.status is SagaStatus.COMPENSATED
    time.sleep(0.5)
    rows = c.ledger(key)
    seen = [(r.kind, r.tool) for r in rows]
    late = [r for r in rows if r.kind == "late"]
    if late:  # it ran with the first step's key, outside its step
        assert late[0].detail == {"idem": idempotency_key(key, 1, "execute")}
    # it either ran while its own step ran (before the undo), or never ran
    assert seen in ([("effect", "a"), ("late", "a"), ("undo", "a")],
                    [("effect", "a"), ("undo", "a")]), seen


def test_an_async_tool_over_its_soft_time_limit_is_unwound_and_the_slot_works_after(
        one_slot: Cluster) -> None:
    """SoftTimeLimitExceeded arrives by signal while the coroutine awaits: the step FAILS,
    the saga compensates, the coroutine's finally runs, and the next async tool on the
    same slot (a fresh loop) runs normally."""
    c = one_slot
    key = uid("tl")

    async def main() -> Any:
        saga = await c.sw.abegin(key)
        step = await saga.aenqueue(c.tool("aslow"), key, "slow", 5.0)
        with pytest.raises(ToolFailed, match=r"SoftTimeLimitExceeded|time limit"):
            await step.aresult(T)
        res = await saga.aresult(T)
        s2 = await c.sw.abegin(uid("tl2"))
        value = await (await s2.aenqueue(c.tool("astep"), key, "next")).aresult(T)
        return res, value

    res, value = asyncio.run(main())
    assert res.status is SagaStatus.COMPENSATED
    assert value["name"] == "next" and value["loop"]
    assert ("cleanup", "slow") in kinds(c, key)
    assert ("effect", "slow") not in kinds(c, key)


def test_an_async_tool_is_retried_by_autoretry_for(one_slot: Cluster) -> None:
    c = one_slot
    key = uid("ar")

    async def main() -> Any:
        saga = await c.sw.abegin(key)
        value = await (await saga.aenqueue(c.tool("aretried"), key, "r", 2)).aresult(T)
        await saga.acomplete()
        return value, await c.sw.ainspect(key)

    value, rec = asyncio.run(main())
    assert value == "r-done"
    assert rec.entries[0].phase is Phase.EXECUTED
    assert kinds(c, key) == [("attempt", "r")] * 3 + [("effect", "r")]


def test_a_sync_tool_returning_a_coroutine_has_it_awaited(one_slot: Cluster) -> None:
    c = one_slot
    key = uid("sc")

    async def main() -> Any:
        saga = await c.sw.abegin(key)
        return await (await saga.aenqueue(c.tool("sync_returns_coro"), key, "s")).aresult(T)

    assert asyncio.run(main()) == "s-done"
    rows = c.ledger(key)
    assert [(r.kind, r.tool) for r in rows] == [("effect", "s")]
    assert rows[0].detail == {"idem": idempotency_key(key, 1, "execute")}


def test_async_tools_on_a_threads_pool(pg_url: str,
                                       tmp_path_factory: pytest.TempPathFactory) -> None:
    """-P threads: every pool thread keeps its own loop; four async steps at once."""
    for c in _one(pg_url, tmp_path_factory.mktemp("threads"), "threads", 4):
        key = uid("th")

        async def main(c: Cluster = c, key: str = key) -> Any:
            saga = await c.sw.abegin(key)
            steps = [await saga.aenqueue(c.tool("astep"), key, f"n{i}", pause=0.3)
                     for i in range(4)]
            values = await asyncio.gather(*(s.aresult(T) for s in steps))
            await saga.acomplete()
            return values

        values = asyncio.run(main())
        assert [v["name"] for v in values] == ["n0", "n1", "n2", "n3"]
        assert [v["key"] for v in values] == [idempotency_key(key, i + 1, "execute")
                                              for i in range(4)]


def test_a_failing_async_tool_does_not_kill_the_slots_cached_clients(one_slot: Cluster
                                                                      ) -> None:
    """README: "one loop per slot, kept between tasks, so a client the module caches
    stays bound to a live loop". An async tool fails the ordinary way (one call of an
    asyncio.gather raises while its sibling still runs): settle() sees a pending task
    after the exception and closes the slot's loop, as it does for a time limit's
    signal. Every later async tool on that slot using the module's cached client (here
    redis.asyncio; httpx.AsyncClient and asyncpg pools alike) now fails with
    "Event loop is closed": the step FAILS and its saga compensates for no fault of
    its own, and so does every later one on that slot until the worker restarts."""
    c = one_slot
    key = uid("cc")
    tool = c.tool("acached")

    async def run(name: str, fail: bool = False) -> Any:
        saga = await c.sw.abegin(uid("cc"))
        step = await saga.aenqueue(tool, key, name, fail)
        try:
            return await step.aresult(T)
        except ToolFailed as exc:
            return exc

    async def main() -> list[Any]:
        return [await run("first"), await run("second"), await run("fails", True),
                await run("after")]

    first, second, fails, after = asyncio.run(main())
    assert (first, second) == (1, 2)  # the cached client works across tasks
    assert isinstance(fails, ToolFailed) and "failed on purpose" in str(fails)
    assert after == 4, f"the next async tool on the slot: {after!r}"
