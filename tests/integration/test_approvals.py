"""Approval gates for IRREVERSIBLE tools, against real services and worker processes."""

from __future__ import annotations

import base64
import json
import threading
from typing import Any

import pytest
from sqlalchemy import update

from sagaworker import (
    ApprovalInvalid,
    ApprovalRejected,
    OutcomeResult,
    Phase,
    SagaStatus,
    Sagaworker,
)
from sagaworker._base.crypto import Placed
from sagaworker._journal.schema import entries
from sagaworker._producer.approvals import Signer
from tests.conftest import TEST_SECRET, Cluster, uid, wait_for

pytestmark = [pytest.mark.services, pytest.mark.one_broker]
T = 60


def token_for(sw: Sagaworker, saga_id: str, seq: int = 1) -> str:
    return next(p.token for p in sw.pending_approvals() if (p.saga_id, p.seq) == (saga_id, seq))


def gated(c: Cluster) -> tuple[str, Any, Any]:
    """A saga with one EXECUTED step and one gated `ship` step."""
    key = uid("g")
    saga = c.sw.begin(key)
    saga.enqueue(c.tool("step"), key, "a").result(timeout=T)
    ship = saga.enqueue(c.tool("ship"), key, "parcel-1")
    return key, saga, ship


def shipped(c: Cluster, key: str) -> int:
    return sum(1 for r in c.ledger(key) if (r.kind, r.tool) == ("effect", "ship"))


def test_gate_holds_until_approved_then_runs(cluster: Cluster) -> None:
    """A gated step is not run before approval (checked after later work ran); approve runs it."""
    key, saga, ship = gated(cluster)
    assert cluster.sw.inspect(key).status is SagaStatus.AWAITING_APPROVAL
    # later work in another saga goes through the same worker: the gate still holds after it
    other = uid("o")
    cluster.sw.begin(other).enqueue(cluster.tool("step"), other, "x").result(timeout=T)
    assert shipped(cluster, key) == 0
    assert cluster.sw.inspect(key).entries[1].phase is Phase.AWAITING_APPROVAL
    cluster.sw.approve(token_for(cluster.sw, key, 2), approver="alice")
    assert ship.result(timeout=T) == "shipped-parcel-1"
    assert shipped(cluster, key) == 1
    rec = cluster.sw.inspect(key)
    assert rec.status is SagaStatus.RUNNING
    assert rec.entries[1].approved_by == "alice" and rec.entries[1].approved_at is not None
    saga.complete()
    granted = wait_for(lambda: [e for e in cluster.events(key)
                                if e["event"] == "step_executed" and e["seq"] == 2], 10, "run")
    assert granted


def test_reject_compensates(cluster: Cluster) -> None:
    """A rejection journals REJECTED with who and why, and the saga compensates."""
    key, saga, ship = gated(cluster)
    cluster.sw.reject(token_for(cluster.sw, key, 2), approver="bob", reason="fraud check")
    with pytest.raises(ApprovalRejected, match="fraud check"):
        ship.result(timeout=T)
    res = saga.wait(timeout=T)
    assert res.status is SagaStatus.COMPENSATED
    assert [r.tool for r in cluster.ledger(key) if r.kind == "undo"] == ["a"]
    e = cluster.sw.inspect(key).entries[1]
    assert (e.phase, e.rejected_by, e.rejection_reason) == (Phase.REJECTED, "bob", "fraud check")
    assert e.compensation is None and shipped(cluster, key) == 0


def _unchanged(c: Cluster, key: str) -> None:
    e = c.sw.inspect(key).entries[1]
    assert e.phase is Phase.AWAITING_APPROVAL and e.approved_by is None
    assert c.sw.inspect(key).status is SagaStatus.AWAITING_APPROVAL


def test_bad_tokens_are_refused_and_change_nothing(cluster: Cluster) -> None:
    """Forged, tampered and other-step tokens raise ApprovalInvalid; the gate stays as it was."""
    key, _, _ = gated(cluster)
    good = token_for(cluster.sw, key, 2)
    row = cluster.sw.journal.entry_row(key, 2)
    candidates = [
        Signer("not-the-secret", 60).sign(key, 2, row.tool_name, row.args_digest,
                                         row.approval_nonce),
        Signer(TEST_SECRET, 60).sign(key, 2, "tests.apps.cluster.step", row.args_digest,
                                      row.approval_nonce),
        Signer(TEST_SECRET, 60).sign(key, 2, row.tool_name, "0" * 64, row.approval_nonce),
        Signer(TEST_SECRET, 60).sign(key, 2, row.tool_name, row.args_digest, "guessed"),
        Signer(TEST_SECRET, 60).sign(key, 1, row.tool_name, row.args_digest,
                                      row.approval_nonce),
    ]
    payload, mac = good.split(".")
    body = json.loads(base64.urlsafe_b64decode(payload + "=" * (-len(payload) % 4)))
    body["q"] = 1
    tampered = base64.urlsafe_b64encode(json.dumps(body).encode()).rstrip(b"=").decode()
    candidates.append(f"{tampered}.{mac}")
    for bad in candidates:
        with pytest.raises(ApprovalInvalid):
            cluster.sw.approve(bad, approver="mallory")
        with pytest.raises(ApprovalInvalid):
            cluster.sw.reject(bad, approver="mallory", reason="x")
        _unchanged(cluster, key)
    cluster.sw.approve(good, approver="alice")  # the real one still works


def test_expired_token_leaves_the_gate_open(cluster: Cluster) -> None:
    """An expired token is refused; pending_approvals() then hands out a fresh one."""
    key, _, ship = gated(cluster)
    row = cluster.sw.journal.entry_row(key, 2)
    stale = Signer(TEST_SECRET, -10).sign(key, 2, row.tool_name, row.args_digest,
                                           row.approval_nonce)
    with pytest.raises(ApprovalInvalid, match="expired"):
        cluster.sw.approve(stale, approver="alice")
    _unchanged(cluster, key)
    cluster.sw.approve(token_for(cluster.sw, key, 2), approver="alice")
    assert ship.result(timeout=T) == "shipped-parcel-1"


def test_token_used_twice(cluster: Cluster) -> None:
    """A token is good for one decision; reusing it raises and changes nothing."""
    key, _, ship = gated(cluster)
    token = token_for(cluster.sw, key, 2)
    cluster.sw.approve(token, approver="alice")
    with pytest.raises(ApprovalInvalid, match="already decided"):
        cluster.sw.approve(token, approver="alice")
    with pytest.raises(ApprovalInvalid):
        cluster.sw.reject(token, approver="bob", reason="late")
    assert ship.result(timeout=T) == "shipped-parcel-1"
    assert shipped(cluster, key) == 1


def test_two_concurrent_approvals_one_wins(cluster: Cluster) -> None:
    """Two approvers racing on one token: exactly one wins, the tool runs once."""
    key, _, ship = gated(cluster)
    token = token_for(cluster.sw, key, 2)
    results: list[str] = []
    barrier = threading.Barrier(4)

    def race(who: str) -> None:
        barrier.wait()
        try:
            cluster.sw.approve(token, approver=who)
            results.append("won")
        except ApprovalInvalid:
            results.append("lost")

    threads = [threading.Thread(target=race, args=(f"a{i}",)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(results) == ["lost", "lost", "lost", "won"]
    assert ship.result(timeout=T) == "shipped-parcel-1"
    assert shipped(cluster, key) == 1


def test_tampered_journal_arguments_are_caught_at_resume(cluster: Cluster,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """Arguments changed in the journal after approval FAIL the step unrun; the saga undoes."""
    key, saga, _ = gated(cluster)
    sent: list[tuple[Any, ...]] = []
    monkeypatch.setattr(cluster.sw.rt.bus, "publish_step",
                        lambda *a, **k: sent.append(a) or True)
    cluster.sw.approve(token_for(cluster.sw, key, 2), approver="alice")
    monkeypatch.undo()
    [(saga_id, seq, tool_name, args, kwargs, task_id, queue)] = sent
    with cluster.sw.journal.engine.begin() as conn:
        conn.execute(update(entries).where(entries.c.saga_id == key, entries.c.seq == 2)
                     .values(args=Placed([key, "parcel-EVIL"], (key, task_id))))
    cluster.sw.producer.publish(saga_id, seq, tool_name, args, kwargs, task_id, queue)
    res = saga.wait(timeout=T)
    assert res.status is SagaStatus.COMPENSATED
    e = cluster.sw.inspect(key).entries[1]
    assert e.phase is Phase.FAILED and "approval verification failed" in (e.error or "")
    assert shipped(cluster, key) == 0
    assert [o.result for o in res.report.outcomes] == [OutcomeResult.COMPENSATED]


@pytest.mark.parametrize("decision", ["approve", "reject"])
def test_synchronous_call_waits_for_the_decision(cluster: Cluster, decision: str) -> None:
    """s.call on a gated tool waits; approval returns its value, rejection raises into the work."""
    key = uid("sync")
    step, ship = cluster.tool("step"), cluster.tool("ship")
    seen: list[str] = []

    def decide() -> None:
        token = wait_for(lambda: next((p.token for p in cluster.sw.pending_approvals()
                                       if p.saga_id == key), None), T, "the gate")
        if decision == "approve":
            cluster.sw.approve(token, approver="alice")
        else:
            cluster.sw.reject(token, approver="bob", reason="no")

    threading.Thread(target=decide, daemon=True).start()

    def work(s: Any) -> str:
        s.call(step, key, "a")
        try:
            return str(s.call(ship, key, "p"))
        except ApprovalRejected as exc:
            seen.append(str(exc))
            raise

    res = cluster.sw.saga(key, work, timeout=T)
    if decision == "approve":
        assert res.status is SagaStatus.COMPLETED and res.value == "shipped-p"
    else:
        assert res.status is SagaStatus.COMPENSATED and seen
        assert [r.tool for r in cluster.ledger(key) if r.kind == "undo"] == ["a"]
