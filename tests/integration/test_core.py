"""The core saga lifecycle against real PostgreSQL, RabbitMQ/Redis and worker processes."""

from __future__ import annotations

import contextlib
from typing import Any

import pytest

from sagaworker import (
    OutcomeResult,
    Phase,
    SagaStatus,
    SagaworkerError,
    ToolFailed,
)
from tests.conftest import Cluster, uid, wait_for

pytestmark = pytest.mark.services
T = 60


def ledger_kinds(c: Cluster, key: str) -> list[tuple[str, str]]:
    return [(r.kind, r.tool) for r in c.ledger(key)]


def test_completing_saga(cluster: Cluster) -> None:
    """A saga whose steps all succeed is COMPLETED with the work's value and no undo."""
    key = uid("k")
    step = cluster.tool("step")
    res = cluster.sw.saga(key, lambda s: [s.call(step, key, n) for n in ("a", "b", "c")],
                          timeout=T)
    assert res.status is SagaStatus.COMPLETED
    assert res.value == ["a-done", "b-done", "c-done"]
    rec = cluster.sw.inspect(key)
    assert [e.phase for e in rec.entries] == [Phase.EXECUTED] * 3
    assert all(e.executed_at is not None and e.task_id for e in rec.entries)
    assert ledger_kinds(cluster, key) == [("effect", "a"), ("effect", "b"), ("effect", "c")]
    assert rec.report.outcomes == []


@pytest.mark.parametrize("failing", [1, 2, 3])
def test_failure_at_each_step_undoes_executed_in_reverse(cluster: Cluster, failing: int) -> None:
    """Failing step k undoes exactly steps k-1..1, in reverse, and leaves k FAILED."""
    key = uid("k")
    step = cluster.tool("step")
    names = ["a", "b", "c"]

    def work(s: Any) -> None:
        for i, n in enumerate(names, start=1):
            s.call(step, key, n, fail=(i == failing))

    res = cluster.sw.saga(key, work, timeout=T)
    assert res.status is SagaStatus.COMPENSATED
    done = names[: failing - 1]
    undone = [r.tool for r in cluster.ledger(key) if r.kind == "undo"]
    assert undone == list(reversed(done))
    assert [o.seq for o in res.report.outcomes] == list(range(failing - 1, 0, -1))
    assert all(o.result is OutcomeResult.COMPENSATED for o in res.report.outcomes)
    rec = cluster.sw.inspect(key)
    assert rec.entries[failing - 1].phase is Phase.FAILED
    assert rec.entries[failing - 1].compensation is None
    assert "failed on purpose" in (rec.entries[failing - 1].error or "")


def test_failing_undo_leaves_dirty_state_and_the_chain_goes_on(cluster: Cluster) -> None:
    """An undo that always throws is tried 1+retries times, COMPENSATION_FAILED, and earlier
    undos still run; the logs carry the events alerting keys on."""
    key = uid("k")
    step, broken = cluster.tool("step"), cluster.tool("broken_undo_step")

    def work(s: Any) -> None:
        s.call(step, key, "a")
        s.call(broken, key, "b")
        s.call(step, key, "c", fail=True)

    res = cluster.sw.saga(key, work, timeout=T)
    assert res.status is SagaStatus.COMPENSATION_FAILED
    assert [(o.tool_name.rsplit(".", 1)[-1], o.result) for o in res.report.outcomes] == [
        ("broken_undo_step", OutcomeResult.COMPENSATION_FAILED),
        ("step", OutcomeResult.COMPENSATED)]
    assert [o.seq for o in res.report.dirty] == [2]
    tries = [r for r in cluster.ledger(key) if r.kind == "undo_try"]
    assert [r.detail["attempt"] for r in tries] == [1, 2, 3]
    assert len({r.detail["idempotency_key"] for r in tries}) == 1
    assert res.report.dirty[0].attempts == 3
    assert [r.tool for r in cluster.ledger(key) if r.kind == "undo"] == ["a"]

    def alert_lines() -> Any:
        ev = cluster.events(key)
        failed = [e for e in ev if e["event"] == "compensation_failed"]
        crit = [e for e in ev if e["event"] == "saga_compensation_failed"]
        return (failed, crit) if failed and crit else None

    failed, crit = wait_for(alert_lines, 10, "alert log lines")
    assert failed[0]["dirty_state"] is True and failed[0]["level"] == "error"
    assert failed[0]["attempts"] == 3 and "broken" in failed[0]["detail"]
    assert failed[0]["seq"] == 2 and failed[0]["tool"].endswith("broken_undo_step")
    assert crit[0]["level"] == "critical"
    assert crit[0]["dirty_tools"] == ["tests.apps.cluster.broken_undo_step"]
    assert {"timestamp", "level", "event", "saga_id"} <= set(failed[0])


def test_tool_without_undo_is_skipped(cluster: Cluster) -> None:
    """A tool that declares no undo is SKIPPED (a warning), not an error."""
    key = uid("k")
    lookup, step = cluster.tool("lookup"), cluster.tool("step")
    res = cluster.sw.saga(key, lambda s: (s.call(lookup, key), s.call(step, key, "x", fail=True)),
                          timeout=T)
    assert res.status is SagaStatus.COMPENSATED
    [o] = res.report.outcomes
    assert o.result is OutcomeResult.SKIPPED and o.detail == "no undo declared"
    skipped = wait_for(lambda: [e for e in cluster.events(key)
                                if e["event"] == "compensation_skipped"], 10, "skip event")
    assert skipped[0]["level"] == "warning"


def test_swallowed_tool_failure_still_compensates(cluster: Cluster) -> None:
    """The work catching ToolFailed and carrying on does not stop compensation."""
    key = uid("k")
    step = cluster.tool("step")

    def work(s: Any) -> str:
        s.call(step, key, "a")
        with contextlib.suppress(ToolFailed):
            s.call(step, key, "b", fail=True)
        return "carried on"

    res = cluster.sw.saga(key, work, timeout=T)
    assert res.status is SagaStatus.COMPENSATED
    assert [r.tool for r in cluster.ledger(key) if r.kind == "undo"] == ["a"]


def test_zero_argument_undo(cluster: Cluster) -> None:
    """An undo that takes no arguments is called with none."""
    key = uid("k")
    zero, step = cluster.tool("zero_arg_undo_step"), cluster.tool("step")
    res = cluster.sw.saga(key, lambda s: (s.call(zero, key), s.call(step, key, "x", fail=True)),
                          timeout=T)
    assert res.status is SagaStatus.COMPENSATED
    assert res.report.outcomes[0].result is OutcomeResult.COMPENSATED
    assert res.report.outcomes[0].tool_name == "tests.apps.cluster.zero_arg_undo_step"


def test_context_carries_result_attempt_reason_and_stable_key(cluster: Cluster) -> None:
    """ctx.result is the journaled result, ctx.attempt counts tries, the key never changes."""
    key = uid("k")
    flaky, step = cluster.tool("flaky_undo_step"), cluster.tool("step")
    res = cluster.sw.saga(key, lambda s: (s.call(flaky, key, "f", 2),
                                          s.call(step, key, "x", fail=True)), timeout=T)
    assert res.status is SagaStatus.COMPENSATED
    tries = [r.detail for r in cluster.ledger(key) if r.kind == "undo_try"]
    assert [t["attempt"] for t in tries] == [1, 2, 3]
    assert len({t["idempotency_key"] for t in tries}) == 1
    assert res.report.outcomes[0].attempts == 3
    entry = cluster.sw.inspect(key).entries[0]
    assert entry.compensation_attempts == 3
    assert entry.idempotency_key == tries[0]["idempotency_key"]
    undo = next(r.detail for r in cluster.ledger(key) if r.kind == "undo")
    assert undo["attempt"] == 3
    # the undo of `step` records ctx.result and ctx.reason
    key2 = uid("k")
    res2 = cluster.sw.saga(key2, lambda s: (s.call(step, key2, "a"),
                                            s.call(step, key2, "b", fail=True)), timeout=T)
    [u] = [r.detail for r in cluster.ledger(key2) if r.kind == "undo"]
    assert u["result"] == "a-done" and u["attempt"] == 1 and u["seq"] == 1
    assert "b failed on purpose" in u["reason"]
    assert res2.error and "b failed on purpose" in res2.error


def test_ten_failure_messages_on_two_workers_give_one_chain(cluster: Cluster) -> None:
    """Ten saga-failure messages handled concurrently by two workers run one chain."""
    if len(cluster.workers) < 2:
        cluster.start_worker()
    key = uid("k")
    step = cluster.tool("step")
    saga = cluster.sw.begin(key)
    for n in ("a", "b", "c", "d"):
        saga.enqueue(step, key, n).result(timeout=T)
    for _ in range(10):
        cluster.sw.send_failure(key, "ten at once")
    res = saga.wait(timeout=T)
    assert res.status is SagaStatus.COMPENSATED
    assert [r.tool for r in cluster.ledger(key) if r.kind == "undo"] == ["d", "c", "b", "a"]
    assert [r for r in cluster.ledger(key) if r.kind == "repeat"] == []  # no undo tried twice
    started = wait_for(lambda: [e for e in cluster.events(key)
                                if e["event"] == "compensation_started"], 10, "chain start")
    assert len(started) == 1 and started[0]["entries"] == 4


def test_step_executed_after_compensation_began_is_undone(cluster: Cluster) -> None:
    """A step still running when the chain began is undone once EXECUTED, and first: the
    chain waits for it, then undoes latest-EXECUTED first (late arrivals)."""
    key = uid("k")
    step = cluster.tool("step")
    saga = cluster.sw.begin(key)
    saga.enqueue(step, key, "fast").result(timeout=T)
    slow = saga.enqueue(step, key, "slow", sleep=3)
    wait_for(lambda: cluster.sw.journal.entry_row(key, slow.seq).started_at is not None,
             T, "the slow step to start")
    saga.fail("cancelled by customer")
    wait_for(lambda: cluster.sw.inspect(key).status is SagaStatus.COMPENSATING, T,
             "compensation to begin")
    assert cluster.sw.inspect(key).entries[1].phase is Phase.INTENT  # still running
    res = saga.wait(timeout=T)
    assert res.status is SagaStatus.COMPENSATED
    # latest first, the late arrival included: never the forward order
    assert [r.tool for r in cluster.ledger(key) if r.kind == "undo"] == ["slow", "fast"]
    assert [o.seq for o in res.report.outcomes] == [2, 1]
    assert res.error == "cancelled by customer"


def test_steps_not_started_are_cancelled(cluster: Cluster,
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """Once compensating, a tool task that had not started never runs (CANCELLED)."""
    key = uid("k")
    step = cluster.tool("step")
    saga = cluster.sw.begin(key)
    saga.enqueue(step, key, "a").result(timeout=T)
    held: list[tuple[Any, ...]] = []
    monkeypatch.setattr(cluster.sw.producer, "publish", lambda *a: held.append(a) or True)
    saga.enqueue(step, key, "b")  # journaled INTENT, its message held back
    monkeypatch.undo()
    saga.fail("stop")
    res = saga.wait(timeout=T)
    assert res.status is SagaStatus.COMPENSATED
    assert cluster.sw.inspect(key).entries[1].phase is Phase.CANCELLED
    cluster.sw.producer.publish(*held[0])  # the late message arrives after all
    wait_for(lambda: any(e["event"] == "step_finished" and e["seq"] == 2
                         for e in cluster.events(key)), T, "the late message to be handled")
    assert [r.tool for r in cluster.ledger(key) if r.kind == "effect"] == ["a"]
    with pytest.raises(SagaworkerError, match="COMPENSATED"):
        saga.enqueue(step, key, "c")


def test_async_form_across_handles(cluster: Cluster) -> None:
    """begin/enqueue/result/complete, sw.get in "another request", and status guards."""
    key = uid("k")
    step = cluster.tool("step")
    saga = cluster.sw.begin(key, metadata={"customer": "c-9"})
    s1 = saga.enqueue(step, key, "a")
    assert s1.seq == 1 and s1.task_id
    assert s1.result(timeout=T) == "a-done"
    again = cluster.sw.get(key)
    steps = again.enqueue_many([(step, (key, "b"), {}), (step, (key, "c"), {})])
    assert [s.seq for s in steps] == [2, 3]
    assert [s.result(timeout=T) for s in steps] == ["b-done", "c-done"]
    again.complete()
    rec = cluster.sw.inspect(key)
    assert rec.status is SagaStatus.COMPLETED and rec.metadata == {"customer": "c-9"}
    with pytest.raises(SagaworkerError, match="COMPLETED"):
        saga.enqueue(step, key, "d")
    assert any(r.saga_id == key for r in cluster.sw.sagas(status="COMPLETED"))


def test_complete_refuses_while_a_step_is_unfinished(cluster: Cluster) -> None:
    """complete() refuses while a step runs; wait()/result() time out changing nothing."""
    key = uid("k")
    step = cluster.tool("step")
    saga = cluster.sw.begin(key)
    slow = saga.enqueue(step, key, "slow", sleep=2)
    with pytest.raises(SagaworkerError, match="not EXECUTED"):
        saga.complete()
    with pytest.raises(TimeoutError):
        saga.wait(timeout=0.2)
    assert slow.result(timeout=T) == "slow-done"
    saga.complete()
    assert cluster.sw.inspect(key).status is SagaStatus.COMPLETED


def test_celery_retry_is_not_a_failure(cluster: Cluster) -> None:
    """A tool Celery retries after an exception becomes EXECUTED on a later attempt."""
    key = uid("k")
    retried = cluster.tool("retried")
    res = cluster.sw.saga(key, lambda s: s.call(retried, key, "r", 1), timeout=T)
    assert res.status is SagaStatus.COMPLETED
    e = cluster.sw.inspect(key).entries[0]
    assert e.phase is Phase.EXECUTED and e.attempts == 2 and not e.in_doubt


def test_operator_redrive_reruns_only_failed_undos(cluster: Cluster) -> None:
    """retry_compensation re-runs only the COMPENSATION_FAILED undos, with the same key."""
    key = uid("k")
    flaky, step = cluster.tool("flaky_undo_step"), cluster.tool("step")
    res = cluster.sw.saga(key, lambda s: (s.call(step, key, "a"), s.call(flaky, key, "f", 3),
                                          s.call(step, key, "x", fail=True)), timeout=T)
    assert res.status is SagaStatus.COMPENSATION_FAILED
    assert [r.tool for r in cluster.ledger(key) if r.kind == "undo"] == ["a"]
    assert cluster.sw.retry_compensation(key, actor="oncall") == [2]
    final = cluster.sw.get(key).wait(timeout=T)
    assert final.status is SagaStatus.COMPENSATED
    assert [r.tool for r in cluster.ledger(key) if r.kind == "undo"] == ["a", "f"]
    tries = [r.detail for r in cluster.ledger(key) if r.kind == "undo_try"]
    assert [t["attempt"] for t in tries] == [1, 2, 3, 4]
    assert len({t["idempotency_key"] for t in tries}) == 1
    assert cluster.sw.inspect(key).entries[1].compensation_attempts == 4


def test_worker_serves_prometheus_metrics(cluster: Cluster) -> None:
    """With SAGAWORKER_METRICS_PORT a worker serves journal metrics; scraping shows a saga."""
    import socket
    import urllib.request

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    cluster.start_worker(concurrency=1, SAGAWORKER_METRICS_PORT=str(port))
    key = uid("k")
    step, broken = cluster.tool("step"), cluster.tool("broken_undo_step")
    res = cluster.sw.saga(key, lambda s: (s.call(broken, key, "m"),
                                          s.call(step, key, "x", fail=True)), timeout=T)
    assert res.status is SagaStatus.COMPENSATION_FAILED
    body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    lines = {ln.rsplit(" ", 1)[0]: float(ln.rsplit(" ", 1)[1]) for ln in body.splitlines()
             if ln and not ln.startswith("#")}
    assert lines['sagaworker_sagas{status="COMPENSATION_FAILED"}'] >= 1
    assert lines['sagaworker_compensations_total{outcome="COMPENSATION_FAILED",'
                 'tool="tests.apps.cluster.broken_undo_step"}'] >= 1
    assert lines['sagaworker_steps{phase="FAILED",tool="tests.apps.cluster.step"}'] >= 1
    assert lines["sagaworker_compensation_duration_seconds_count"] >= 1
    assert "sagaworker_orphans" in lines
