"""Durable flows on real PostgreSQL, RabbitMQ/Redis and worker processes."""

from __future__ import annotations

from typing import Any

import pytest
from sqlalchemy import update

from sagaworker import ApprovalInvalid, OutcomeResult, Phase, SagaStatus
from sagaworker._journal.schema import entries
from tests.apps.cluster import (
    catches_failure,
    fan_out,
    gated_flow,
    raises_its_own,
    strict_steps,
    three_steps,
)
from tests.conftest import Cluster, uid, wait_for

pytestmark = [pytest.mark.services, pytest.mark.one_broker]
T = 60


def kinds(c: Cluster, key: str) -> list[tuple[str, str]]:
    return [(r.kind, r.tool) for r in c.ledger(key)]


def test_flow_runs_to_completion_with_no_caller_waiting(cluster: Cluster) -> None:
    """sw.start returns at once; the workers carry the flow; its value is journaled."""
    key = uid("f")
    saga = cluster.sw.start(key, three_steps, key, metadata={"customer": "c-1"})
    assert cluster.sw.inspect(key).flow == "tests.apps.cluster.three_steps"
    res = saga.wait(timeout=T)
    assert res.status is SagaStatus.COMPLETED
    assert res.value == {"a": "a-done", "b": "b-done", "c": "c-done"}
    assert kinds(cluster, key) == [("effect", "a"), ("effect", "b"), ("effect", "c")]
    rec = cluster.sw.inspect(key)
    assert [e.phase for e in rec.entries] == [Phase.EXECUTED] * 3
    assert rec.flow_args == [key] and rec.flow_kwargs == {}


@pytest.mark.parametrize("fail_at", [1, 2, 3])
def test_failing_step_ends_the_flow_and_compensates(cluster: Cluster, fail_at: int) -> None:
    """A FAILED step fails the saga at once; what ran is undone in reverse."""
    key = uid("f")
    res = cluster.sw.start(key, three_steps, key, fail_at=fail_at).wait(timeout=T)
    assert res.status is SagaStatus.COMPENSATED
    done = ["a", "b", "c"][: fail_at - 1]
    assert [r.tool for r in cluster.ledger(key) if r.kind == "undo"] == done[::-1]
    assert len(cluster.sw.inspect(key).entries) == fail_at  # never a step past the failure


def test_enqueued_steps_run_together_and_gather_in_order(cluster: Cluster) -> None:
    """enqueue/gather: three steps journaled together, results in the handles' order."""
    key = uid("f")
    res = cluster.sw.start(key, fan_out, key).wait(timeout=T)
    assert res.status is SagaStatus.COMPLETED
    assert res.value == ["x-done", "y-done", "z-done", "after-x-done-y-done-z-done-done"]
    assert [e.seq for e in cluster.sw.inspect(key).entries] == [1, 2, 3, 4]


def test_catching_tool_failed_changes_nothing(cluster: Cluster) -> None:
    """A flow that catches ToolFailed still compensates; the step after is never run."""
    key = uid("f")
    res = cluster.sw.start(key, catches_failure, key).wait(timeout=T)
    assert res.status is SagaStatus.COMPENSATED
    assert ("effect", "never") not in kinds(cluster, key)
    assert [r.tool for r in cluster.ledger(key) if r.kind == "undo"] == ["a"]


@pytest.mark.parametrize("rejected", [False, True], ids=["ToolFailed", "ApprovalRejected"])
def test_a_flow_raising_tool_failed_of_its_own_fails_and_compensates(
        cluster: Cluster, rejected: bool) -> None:
    """A flow that raises ``ToolFailed``/``ApprovalRejected`` itself (no step of its journal
    failed) fails its saga as any other raise: step a is undone, the reason is its text."""
    key = uid("f")
    res = cluster.sw.start(key, raises_its_own, key, rejected).wait(timeout=T)
    assert res.status is SagaStatus.COMPENSATED
    assert "no stock in any warehouse" in (res.error or "")
    assert [(r.kind, r.tool) for r in cluster.ledger(key)] == [("effect", "a"), ("undo", "a")]


@pytest.mark.parametrize("decision", ["approve", "reject"])
def test_gate_inside_a_flow_waits_with_no_thread(cluster: Cluster, decision: str) -> None:
    """The gated step waits in AWAITING_APPROVAL; approve moves the flow on, reject fails it."""
    key = uid("f")
    saga = cluster.sw.start(key, gated_flow, key, "p-1")
    req = wait_for(lambda: next((p for p in cluster.sw.pending_approvals()
                                 if p.saga_id == key), None), T, "the gate")
    assert cluster.sw.inspect(key).status is SagaStatus.AWAITING_APPROVAL
    if decision == "approve":
        cluster.sw.approve(req.token, approver="alice")
        res = saga.wait(timeout=T)
        assert res.status is SagaStatus.COMPLETED and res.value == "shipped-p-1"
    else:
        cluster.sw.reject(req.token, approver="bob", reason="no stock")
        res = saga.wait(timeout=T)
        assert res.status is SagaStatus.COMPENSATED
        assert ("effect", "ship") not in kinds(cluster, key)
        assert [r.tool for r in cluster.ledger(key) if r.kind == "undo"] == ["a"]


def test_abort_fails_a_waiting_flow(cluster: Cluster) -> None:
    """sw.abort: the gate closes, what ran is undone, the event names the actor."""
    key = uid("f")
    saga = cluster.sw.start(key, gated_flow, key, "p-2")
    req = wait_for(lambda: next((p for p in cluster.sw.pending_approvals()
                                 if p.saga_id == key), None), T, "the gate")
    cluster.sw.abort(key, reason="customer left", actor="ops-1")
    with pytest.raises(ApprovalInvalid):
        cluster.sw.approve(req.token, approver="alice")
    res = saga.wait(timeout=T)
    assert res.status is SagaStatus.COMPENSATED
    assert res.error == "aborted by ops-1: customer left"
    assert cluster.sw.inspect(key).entries[1].phase is Phase.CANCELLED
    assert ("effect", "ship") not in kinds(cluster, key)


def test_deadline_fails_the_flow(cluster: Cluster) -> None:
    """Past its deadline the sweeper fails the saga; the gate is CANCELLED, a is undone."""
    key = uid("f")
    saga = cluster.sw.start(key, gated_flow, key, "p-3", deadline=2)
    res = saga.wait(timeout=T)
    assert res.status is SagaStatus.COMPENSATED and res.error == "deadline passed"
    assert [e.phase for e in cluster.sw.inspect(key).entries] == [Phase.EXECUTED,
                                                                  Phase.CANCELLED]
    ev = wait_for(lambda: [e for e in cluster.events(key)
                           if e["event"] == "saga_deadline_passed"], 10, "the event")
    assert ev[0]["level"] == "warning" and ev[0]["deadline_at"]


def test_replay_that_diverges_fails_a_saga_declared_to_compensate(cluster: Cluster) -> None:
    """A replay asking for other arguments than the journal holds: flow_diverged, and a
    flow declared ``on_divergence="compensate"`` is undone (the default holds it:
    test_flow_versions.py)."""
    key = uid("f")
    saga = cluster.sw.start(key, strict_steps, key, sleep=3)
    wait_for(lambda: len(cluster.sw.inspect(key).entries) == 2, T, "step b to start")
    with cluster.sw.journal.engine.begin() as conn:  # the flow's code "changed" under it
        conn.execute(update(entries).where(entries.c.saga_id == key, entries.c.seq == 1)
                     .values(args_digest="0" * 64))
    res = saga.wait(timeout=T)
    assert res.status is SagaStatus.COMPENSATED
    assert (res.error or "").startswith("flow diverged at step 1: the journal holds")
    assert [o.result for o in res.report.outcomes] == [OutcomeResult.COMPENSATED] * 2
    wait_for(lambda: any(e["event"] == "flow_diverged" for e in cluster.events(key)), 10,
             "flow_diverged")


def test_lost_advance_is_sent_again_by_the_sweeper(cluster: Cluster,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """The first advance message is lost: the sweeper finds the flow and sends it again."""
    key = uid("f")
    lost: list[Any] = []
    monkeypatch.setattr(cluster.sw.rt.bus, "send_advance", lambda saga_id: lost.append(saga_id))
    saga = cluster.sw.start(key, three_steps, key)
    monkeypatch.undo()
    assert lost == [key]
    res = saga.wait(timeout=T)
    assert res.status is SagaStatus.COMPLETED
