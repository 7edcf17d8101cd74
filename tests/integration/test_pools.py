"""The core saga lifecycle on the other Celery pools: a ``-P threads`` and a ``-P solo``
worker (the guarantees hold for every pool). test_core.py covers prefork on both brokers;
here, on RabbitMQ, one worker per pool and module: test_core's completing saga, failure
undone in reverse and failing undo (the same functions, with this module's ``cluster``),
and the late-arrival order, an approval gate and flows as each pool runs them.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from sagaworker import Phase, SagaStatus
from tests.apps.cluster import fan_out, three_steps
from tests.conftest import BROKERS, Cluster, _broker, need, new_settings, uid, wait_for
from tests.integration import test_core as core

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
    c.close()


@pytest.fixture(scope="module")
def cluster(pool_cluster: PoolCluster) -> PoolCluster:
    """The core tests below, written once in test_core.py, run on each pool's worker."""
    return pool_cluster


# test_core's lifecycle tests, collected here again with the pools' ``cluster``
test_completing_saga = core.test_completing_saga
test_failure_at_each_step_undoes_executed_in_reverse = (
    core.test_failure_at_each_step_undoes_executed_in_reverse)
test_failing_undo_leaves_dirty_state_and_the_chain_goes_on = (
    core.test_failing_undo_leaves_dirty_state_and_the_chain_goes_on)


def undone(c: Cluster, key: str) -> list[str]:
    return [r.tool for r in c.ledger(key) if r.kind == "undo"]


def test_step_executed_after_compensation_began_is_undone_first(
        pool_cluster: PoolCluster) -> None:
    """A step still running when the saga is failed is undone once EXECUTED, and first
    (late arrivals). On solo the failure message waits behind the running step;
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
    """Flows are advanced by worker tasks: a fan-out with gather completes,
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
