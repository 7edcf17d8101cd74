"""Eager flow steps on real PostgreSQL, RabbitMQ/Redis and worker processes: the worker
that advances a flow runs its next step itself, journaled and crash-safe as any step."""

from __future__ import annotations

import os
import signal
from typing import Any

import pytest

from sagaworker import Phase, SagaStatus
from tests.apps.cluster import (
    asks_who,
    idem_flow,
    retried_by_hand_flow,
    retried_flow,
    three_steps,
)
from tests.conftest import Cluster, uid, wait_for

pytestmark = [pytest.mark.services, pytest.mark.one_broker]
T = 60


def executed(c: Cluster, key: str) -> list[tuple[int, bool]]:
    """(seq, run eagerly) of each step_executed line of the saga, in the order logged."""
    return [(e["seq"], bool(e.get("eager"))) for e in c.events(key)
            if e["event"] == "step_executed"]


def executed_lines(c: Cluster, key: str, n: int) -> list[tuple[int, bool]]:
    """``executed`` once the workers logged ``n`` lines."""
    def got() -> list[tuple[int, bool]] | None:
        lines = executed(c, key)
        return lines if len(lines) >= n else None

    return list(wait_for(got, 10, f"{n} step_executed lines"))


def test_flow_steps_run_on_the_worker_that_advanced_the_flow(cluster: Cluster) -> None:
    """Every step of a 3-step flow runs eagerly, journaled like any step (INTENT, one
    claim, EXECUTED), in order."""
    key = uid("e")
    res = cluster.sw.start(key, three_steps, key).wait(timeout=T)
    assert res.status is SagaStatus.COMPLETED
    assert [(r.kind, r.tool) for r in cluster.ledger(key)] == [
        ("effect", "a"), ("effect", "b"), ("effect", "c")]
    rec = cluster.sw.inspect(key)
    assert [(e.seq, e.phase, e.attempts) for e in rec.entries] == [
        (1, Phase.EXECUTED, 1), (2, Phase.EXECUTED, 1), (3, Phase.EXECUTED, 1)]
    got = executed_lines(cluster, key, 3)
    assert got == [(1, True), (2, True), (3, True)]
    intents = [e for e in cluster.events(key) if e["event"] == "step_intent"]
    assert [(e["seq"], e.get("eager")) for e in intents] == [(1, True), (2, True), (3, True)]


def test_a_tool_celery_retries_is_published_not_run_eagerly(cluster: Cluster) -> None:
    """A tool with Celery retries keeps them: its step goes through the broker (and is
    retried there); the steps around it still run eagerly."""
    key = uid("e")
    res = cluster.sw.start(key, retried_flow, key).wait(timeout=T)
    assert res.status is SagaStatus.COMPLETED, res.error
    assert res.value == ["a-done", "b", "c-done"]
    assert [(r.kind, r.tool) for r in cluster.ledger(key) if r.kind != "try"] == [
        ("effect", "a"), ("effect", "b"), ("effect", "c")]
    assert cluster.sw.inspect(key).entries[1].attempts == 2
    got = executed_lines(cluster, key, 3)
    assert got == [(1, True), (2, False), (3, True)]


def test_eager_steps_can_be_turned_off(cluster: Cluster) -> None:
    """SAGAWORKER_EAGER_STEPS=false: every step of a flow is published."""
    cluster.stop_workers()
    try:
        cluster.start_worker(SAGAWORKER_EAGER_STEPS="false")
        key = uid("e")
        res = cluster.sw.start(key, three_steps, key).wait(timeout=T)
        assert res.status is SagaStatus.COMPLETED
        got = executed_lines(cluster, key, 3)
        assert got == [(1, False), (2, False), (3, False)]
    finally:
        cluster.stop_workers()
        cluster.start_worker()


def _kill_eager_step(c: Cluster, key: str, seq: int) -> dict[str, Any]:
    """SIGKILL the pool process running step ``seq`` eagerly, once its tool started."""
    wait_for(lambda: [r for r in c.ledger(key) if r.kind == "try"], T, "the tool to start")
    intent = [e for e in c.events(key) if e["event"] == "step_intent" and e["seq"] == seq]
    assert intent and intent[0].get("eager"), "the step was not run eagerly"
    row = c.sw.journal.entry_row(key, seq)
    os.kill(int(row.worker.rpartition("|")[2]), signal.SIGKILL)
    return intent[0]


def test_killed_during_an_eager_idempotent_step_it_runs_again(crash_cluster: Cluster) -> None:
    """The pool process dies inside an eager step: its lease lapses, the sweeper delivers
    it, the idempotent tool runs again; the flow goes on and completes, nothing twice."""
    c = crash_cluster
    key = uid("e")
    saga = c.sw.start(key, idem_flow, key, sleep=3)
    _kill_eager_step(c, key, 2)
    # (its carrying delivery, step a's, comes back too: its claim finds a EXECUTED)
    # the fault hit: b started and had no effect when its process died
    assert [(r.kind, r.tool) for r in c.ledger(key)] == [("effect", "a"), ("try", "b")]
    res = saga.wait(timeout=T)
    assert res.status is SagaStatus.COMPLETED, res.error
    assert [(r.kind, r.tool) for r in c.ledger(key)] == [
        ("effect", "a"), ("try", "b"), ("try", "b"), ("effect", "b"), ("effect", "c")]
    rec = c.sw.inspect(key)
    assert [(e.phase, e.attempts) for e in rec.entries] == [
        (Phase.EXECUTED, 1), (Phase.EXECUTED, 2), (Phase.EXECUTED, 1)]


def test_killed_during_an_eager_step_it_is_in_doubt(crash_cluster: Cluster) -> None:
    """A non-idempotent eager step whose process died is FAILED in doubt, as a delivered
    one would be: what ran before it is undone, the step itself is reported."""
    c = crash_cluster
    key = uid("e")
    saga = c.sw.start(key, three_steps, key, sleep=30)
    wait_for(lambda: c.sw.journal.entry_row(key, 2) is not None
             and c.sw.journal.entry_row(key, 2).started_at is not None, T, "b to start")
    intent = [e for e in c.events(key) if e["event"] == "step_intent" and e["seq"] == 2]
    assert intent and intent[0].get("eager")
    os.kill(int(c.sw.journal.entry_row(key, 2).worker.rpartition("|")[2]), signal.SIGKILL)
    res = saga.wait(timeout=T)
    assert res.status is SagaStatus.COMPENSATED
    e = c.sw.inspect(key).entries[1]
    assert e.phase is Phase.FAILED and e.in_doubt
    assert [(r.kind, r.tool) for r in c.ledger(key)] == [("effect", "a"), ("undo", "a")]


def test_a_worker_with_a_time_limit_publishes_every_step(cluster: Cluster) -> None:
    """`celery worker --time-limit`: a chain of eager steps could outlive the limit of
    the delivery that carries it, so that worker runs none."""
    cluster.stop_workers()
    try:
        cluster.start_worker(args=("--time-limit", "120"))
        key = uid("e")
        res = cluster.sw.start(key, three_steps, key).wait(timeout=T)
        assert res.status is SagaStatus.COMPLETED
        assert executed_lines(cluster, key, 3) == [(1, False), (2, False), (3, False)]
    finally:
        cluster.stop_workers()
        cluster.start_worker()


def test_an_eager_step_sees_its_own_celery_request(cluster: Cluster) -> None:
    """``celery.current_task`` inside an eager step is the step's task with its own id and
    arguments, as for a delivered message, not the task whose delivery carried it."""
    key = uid("e")
    res = cluster.sw.start(key, asks_who, key).wait(timeout=T)
    assert res.status is SagaStatus.COMPLETED, res.error
    entry = cluster.sw.inspect(key).entries[1]
    assert executed_lines(cluster, key, 2) == [(1, True), (2, True)]
    (row,) = [r for r in cluster.ledger(key) if r.tool == "whoami"]
    assert (row.detail["task_id"], row.detail["args"]) == (entry.task_id, [key])
    assert res.value == entry.task_id


def test_an_eager_step_that_asks_for_a_retry_is_retried_through_the_broker(
        cluster: Cluster) -> None:
    """A tool calling ``current_task.retry()`` itself (nothing on its decorator says so)
    is retried as from a delivered message, not failed: the step is handed to the broker,
    where Celery's retries apply; the flow completes."""
    key = uid("e")
    res = cluster.sw.start(key, retried_by_hand_flow, key).wait(timeout=T)
    assert res.status is SagaStatus.COMPLETED, res.error
    assert res.value == ["a-done", "b", "c-done"]
    assert [(r.kind, r.tool) for r in cluster.ledger(key)] == [
        ("effect", "a"), ("try", "b"), ("try", "b"), ("effect", "b"), ("effect", "c")]
    assert [(e.seq, e.phase, e.attempts) for e in cluster.sw.inspect(key).entries] == [
        (1, Phase.EXECUTED, 1), (2, Phase.EXECUTED, 2), (3, Phase.EXECUTED, 1)]
    assert executed_lines(cluster, key, 3) == [(1, True), (2, False), (3, True)]


def test_an_eager_retry_counts_against_the_tools_max_retries(cluster: Cluster) -> None:
    """The hand-over to the broker is the tool's first retry: with ``max_retries=1`` a
    second ask fails the step after two tries, as for a delivered message."""
    key = uid("e")
    res = cluster.sw.start(key, retried_by_hand_flow, key, 2).wait(timeout=T)
    assert res.status is SagaStatus.COMPENSATED, res.error
    assert [(r.kind, r.tool) for r in cluster.ledger(key) if r.tool == "b"] == [
        ("try", "b"), ("try", "b")]
    assert cluster.sw.inspect(key).entries[1].phase is Phase.FAILED


def test_an_eager_claim_that_lapsed_while_its_advance_stalled_is_not_run_again(
        crash_cluster: Cluster) -> None:
    """The advance that claimed step b with its INTENT (to run it here) stalls past b's
    lease (a tracing exporter blocking on its enqueue span): the sweeper delivers b and
    another process runs it. When the stalled advance goes on, it finds its claim taken
    and does not run b a second time."""
    c = crash_cluster
    prefix = uid("stall")
    c.stop_workers()
    try:
        c.start_worker(TEST_STALLED_SPANS=prefix)
        key = uid(prefix)
        res = c.sw.start(key, idem_flow, key).wait(timeout=T)
        assert res.status is SagaStatus.COMPLETED, res.error
        assert [(r.kind, r.tool) for r in c.ledger(key)] == [
            ("effect", "a"), ("try", "b"), ("effect", "b"), ("effect", "c")]
        # the fault hit: the claim taken with b's INTENT lapsed, and was found taken (the
        # stalled advance says so once its export returns: maybe after the saga completed)
        lost = wait_for(lambda: [e for e in c.events(key) if e["event"] == "eager_claim_lost"],
                        T, "eager_claim_lost logged")
        assert [e["seq"] for e in lost] == [2]
        rec = c.sw.inspect(key)
        assert [(e.seq, e.phase, e.attempts) for e in rec.entries] == [
            (1, Phase.EXECUTED, 1), (2, Phase.EXECUTED, 2), (3, Phase.EXECUTED, 1)]
    finally:
        c.stop_workers()
        c.start_worker()
