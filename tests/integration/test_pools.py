"""The core saga lifecycle on the other Celery pools: a ``-P threads`` and a ``-P solo``
worker (SPEC 6: the guarantees hold for every pool). test_core.py covers prefork on both
brokers; this is a focused subset on RabbitMQ, one worker per pool and module:
a completing saga, a failure undone in reverse, a failing undo with the chain going on,
the late-arrival order, an approval gate, and flows (the worker carries them).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from sagaworker import OutcomeResult, Phase, SagaStatus
from tests.apps.cluster import fan_out, three_steps
from tests.conftest import BROKERS, Cluster, _broker, need, new_settings, uid, wait_for

pytestmark = pytest.mark.services
T = 60
#: pool -> (concurrency, what Celery's banner says of it)
POOLS = {"threads": (2, "(thread)"), "solo": (1, "(solo)")}


class PoolCluster(Cluster):
    pool = "prefork"


@pytest.fixture(scope="module", params=sorted(POOLS))
def pool_cluster(request: pytest.FixtureRequest, pg_url: str,
                 tmp_path_factory: pytest.TempPathFactory) -> Iterator[PoolCluster]:
    """One worker of the given pool on PostgreSQL and RabbitMQ."""
    pool = request.param
    broker = BROKERS["rabbitmq"]
    need("rabbitmq", _broker(broker))
    tmp = tmp_path_factory.mktemp(f"pool-{pool}")
    c = PoolCluster(new_settings(pg_url, broker, tmp), tmp, "rabbitmq")
    c.pool = pool
    concurrency, banner = POOLS[pool]
    c.start_worker(concurrency=concurrency, pool=pool)
    # the worker really runs that pool
    assert banner in c.workers[0][1].read_text(errors="replace"), f"not a {pool} worker"
    yield c
    c.stop_workers()
    c.cleanup_queues()


def undone(c: Cluster, key: str) -> list[str]:
    return [r.tool for r in c.ledger(key) if r.kind == "undo"]


def test_completing_saga(pool_cluster: PoolCluster) -> None:
    c = pool_cluster
    key = uid("k")
    step = c.tool("step")
    res = c.sw.saga(key, lambda s: [s.call(step, key, n) for n in ("a", "b", "c")], timeout=T)
    assert res.status is SagaStatus.COMPLETED
    assert res.value == ["a-done", "b-done", "c-done"]
    assert [e.phase for e in c.sw.inspect(key).entries] == [Phase.EXECUTED] * 3
    assert [(r.kind, r.tool) for r in c.ledger(key)] == [("effect", n) for n in "abc"]
    assert res.report.outcomes == []


def test_failure_at_a_step_undoes_executed_in_reverse(pool_cluster: PoolCluster) -> None:
    c = pool_cluster
    key = uid("k")
    step = c.tool("step")

    def work(s: Any) -> None:
        for n in ("a", "b", "c"):
            s.call(step, key, n, fail=(n == "c"))

    res = c.sw.saga(key, work, timeout=T)
    assert res.status is SagaStatus.COMPENSATED
    assert undone(c, key) == ["b", "a"]
    assert [o.seq for o in res.report.outcomes] == [2, 1]
    assert all(o.result is OutcomeResult.COMPENSATED for o in res.report.outcomes)
    failed = c.sw.inspect(key).entries[2]
    assert failed.phase is Phase.FAILED and failed.compensation is None


def test_failing_undo_leaves_dirty_state_and_the_chain_goes_on(
        pool_cluster: PoolCluster) -> None:
    c = pool_cluster
    key = uid("k")
    step, broken = c.tool("step"), c.tool("broken_undo_step")

    def work(s: Any) -> None:
        s.call(step, key, "a")
        s.call(broken, key, "b")
        s.call(step, key, "c", fail=True)

    res = c.sw.saga(key, work, timeout=T)
    assert res.status is SagaStatus.COMPENSATION_FAILED
    assert [(o.tool_name.rsplit(".", 1)[-1], o.result) for o in res.report.outcomes] == [
        ("broken_undo_step", OutcomeResult.COMPENSATION_FAILED),
        ("step", OutcomeResult.COMPENSATED)]
    assert [o.seq for o in res.report.dirty] == [2]
    tries = [r for r in c.ledger(key) if r.kind == "undo_try"]
    assert [r.detail["attempt"] for r in tries] == [1, 2, 3]
    assert len({r.detail["idempotency_key"] for r in tries}) == 1
    assert undone(c, key) == ["a"]
    crit = wait_for(lambda: [e for e in c.events(key)
                             if e["event"] == "saga_compensation_failed"], 10, "alert line")
    assert crit[0]["dirty_tools"] == ["tests.apps.cluster.broken_undo_step"]


def test_step_executed_after_compensation_began_is_undone_first(
        pool_cluster: PoolCluster) -> None:
    """A step still running when the saga is failed is undone once EXECUTED, and first
    (SPEC 4, late arrivals). On solo the failure message waits behind the running step;
    the order is the same."""
    c = pool_cluster
    key = uid("k")
    step = c.tool("step")
    saga = c.sw.begin(key)
    saga.enqueue(step, key, "fast").result(timeout=T)
    slow = saga.enqueue(step, key, "slow", sleep=3)
    wait_for(lambda: c.sw.journal.entry_row(key, slow.seq).started_at is not None,
             T, "the slow step to start")
    saga.fail("cancelled by customer")
    if c.pool != "solo":  # a second slot takes the failure while the step still runs
        wait_for(lambda: c.sw.inspect(key).status is SagaStatus.COMPENSATING, T,
                 "compensation to begin")
        assert c.sw.inspect(key).entries[1].phase is Phase.INTENT
    res = saga.wait(timeout=T)
    assert res.status is SagaStatus.COMPENSATED
    assert undone(c, key) == ["slow", "fast"]
    assert [o.seq for o in res.report.outcomes] == [2, 1]
    assert res.error == "cancelled by customer"


def test_approval_gate_holds_until_approved_then_runs(pool_cluster: PoolCluster) -> None:
    c = pool_cluster
    key = uid("g")
    saga = c.sw.begin(key)
    saga.enqueue(c.tool("step"), key, "a").result(timeout=T)
    ship = saga.enqueue(c.tool("ship"), key, "parcel-1")
    assert c.sw.inspect(key).status is SagaStatus.AWAITING_APPROVAL
    # later work goes through the same worker: the gate still holds after it
    other = uid("o")
    c.sw.begin(other).enqueue(c.tool("step"), other, "x").result(timeout=T)
    assert not [r for r in c.ledger(key) if r.tool == "ship"]
    token = next(p.token for p in c.sw.pending_approvals() if (p.saga_id, p.seq) == (key, 2))
    c.sw.approve(token, approver="alice")
    assert ship.result(timeout=T) == "shipped-parcel-1"
    assert [(r.kind, r.tool) for r in c.ledger(key)] == [("effect", "a"), ("effect", "ship")]
    saga.complete()
    rec = c.sw.inspect(key)
    assert rec.status is SagaStatus.COMPLETED and rec.entries[1].approved_by == "alice"


def test_flows_complete_and_compensate(pool_cluster: PoolCluster) -> None:
    """Flows (SPEC 12) are advanced by worker tasks: a fan-out with gather completes,
    a flow failing at its last step undoes the others in reverse."""
    c = pool_cluster
    key = uid("f")
    res = c.sw.start(key, fan_out, key).wait(timeout=T)
    assert res.status is SagaStatus.COMPLETED
    assert res.value == ["x-done", "y-done", "z-done", "after-x-done-y-done-z-done-done"]
    key = uid("f")
    res = c.sw.start(key, three_steps, key, fail_at=3).wait(timeout=T)
    assert res.status is SagaStatus.COMPENSATED
    assert undone(c, key) == ["b", "a"]
