"""``async def`` flows through real workers on PostgreSQL and a real broker: replayed on
an event loop, with the same journal, parallel steps, gates and compensation as sync ones."""

from __future__ import annotations

import pytest

from sagaworker import Phase, SagaStatus
from tests.apps.cluster import async_steps
from tests.conftest import Cluster, uid, wait_for

pytestmark = [pytest.mark.services, pytest.mark.one_broker]
T = 60


def effects(c: Cluster, key: str) -> list[str]:
    return [r.tool for r in c.ledger(key) if r.kind == "effect"]


def test_an_async_flow_runs_its_steps_in_order_and_in_parallel(cluster: Cluster) -> None:
    key = uid("af")
    res = cluster.sw.start(key, async_steps, key).wait(timeout=T)
    assert res.status is SagaStatus.COMPLETED
    assert res.value == ["a-done", "b-done", "c-done", "d-done", "e-done"]
    rec = cluster.sw.inspect(key)
    assert [(e.seq, e.args[1]) for e in rec.entries] == [
        (1, "a"), (2, "b"), (3, "c"), (4, "d"), (5, "e")]
    assert effects(cluster, key)[0] == "a" and set(effects(cluster, key)) == {
        "a", "b", "c", "d", "e"}


@pytest.mark.parametrize("fail_at", [2, 4])
def test_a_failing_step_of_an_async_flow_compensates(cluster: Cluster, fail_at: int) -> None:
    key = uid("af")
    res = cluster.sw.start(key, async_steps, key, fail_at=fail_at).wait(timeout=T)
    assert res.status is SagaStatus.COMPENSATED
    undone = [r.tool for r in cluster.ledger(key) if r.kind == "undo"]
    # every EXECUTED step undone, latest first (the order they were journaled EXECUTED)
    executed = sorted((e for e in cluster.sw.inspect(key).entries
                       if e.phase is Phase.EXECUTED), key=lambda e: e.exec_order or 0)
    assert undone == [e.args[1] for e in reversed(executed)]
    assert "a" in undone


def test_an_async_flow_waits_at_a_gate_with_no_process_and_resumes(cluster: Cluster) -> None:
    key = uid("af")
    saga = cluster.sw.start(key, async_steps, key, parcel="p-9")
    req = wait_for(lambda: next((p for p in cluster.sw.pending_approvals()
                                 if p.saga_id == key), None), T, "the gate")
    cluster.stop_workers()  # nothing runs the flow while it waits
    cluster.start_worker()
    cluster.sw.approve(req.token, approver="alice")
    res = saga.wait(timeout=T)
    assert res.status is SagaStatus.COMPLETED and res.value[-1] == "shipped-p-9"
