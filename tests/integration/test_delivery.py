"""At-least-once delivery turned into once-only effects: redelivery, crashes, lost messages."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import uuid
from collections import Counter
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from typing import Any

import pytest
from kombu import Connection, Exchange, Queue

from sagaworker import OutcomeResult, Phase, SagaStatus, ToolFailed
from sagaworker._core.celery import DEAD_LETTER_QUEUE
from sagaworker._worker.execution import ENVELOPE
from tests.conftest import ROOT, Cluster, uid, wait_for, worker_env

pytestmark = pytest.mark.services
T = 60


def effects(c: Cluster, key: str, name: str) -> int:
    return sum(1 for r in c.ledger(key) if (r.kind, r.tool) == ("effect", name))


def republish(c: Cluster, saga_id: str, seq: int) -> None:
    row = c.sw.journal.entry_row(saga_id, seq)
    assert c.sw.producer.publish(saga_id, seq, row.tool_name, list(row.args), dict(row.kwargs),
                                 row.task_id, row.queue)


def test_redelivered_executed_step_is_not_run_again(crash_cluster: Cluster) -> None:
    """A second delivery of an EXECUTED step leaves the journaled result standing."""
    c = crash_cluster
    key = uid("k")
    saga = c.sw.begin(key)
    step = saga.enqueue(c.tool("step"), key, "a")
    assert step.result(timeout=T) == "a-done"
    for _ in range(3):
        republish(c, key, 1)
    wait_for(lambda: len([e for e in c.events(key) if e["event"] == "step_done"]) == 3, T,
             "the duplicates to be handled")
    assert effects(c, key, "a") == 1
    assert c.sw.inspect(key).entries[0].attempts == 1


def test_duplicate_delivery_while_running_is_left_be(crash_cluster: Cluster) -> None:
    """Two deliveries of one entry never run the tool at the same time."""
    c = crash_cluster
    key = uid("k")
    saga = c.sw.begin(key)
    step = saga.enqueue(c.tool("step"), key, "slow", sleep=2)
    wait_for(lambda: c.sw.journal.entry_row(key, 1).started_at is not None, T, "start")
    republish(c, key, 1)
    assert step.result(timeout=T) == "slow-done"
    wait_for(lambda: any(e["event"] == "step_busy" for e in c.events(key)), T, "busy")
    assert effects(c, key, "slow") == 1


def _kill_running_child(c: Cluster, key: str, seq: int) -> None:
    row = wait_for(lambda: (r := c.sw.journal.entry_row(key, seq)).started_at and r, T,
                   "the attempt to start")
    pid = int(row.worker.rpartition("|")[2])
    os.kill(pid, signal.SIGKILL)


def test_pool_child_killed_mid_tool_is_in_doubt(crash_cluster: Cluster) -> None:
    """A non-idempotent step whose process died is FAILED in doubt, not undone, reported."""
    c = crash_cluster
    key = uid("k")
    saga = c.sw.begin(key)
    saga.enqueue(c.tool("step"), key, "a").result(timeout=T)
    saga.enqueue(c.tool("step"), key, "doomed", sleep=30)
    _kill_running_child(c, key, 2)
    res = saga.wait(timeout=T)
    assert res.status is SagaStatus.COMPENSATED
    e = c.sw.inspect(key).entries[1]
    assert e.phase is Phase.FAILED and e.in_doubt and e.compensation is None
    assert [d.seq for d in res.report.in_doubt] == [2]
    assert [o.seq for o in res.report.outcomes] == [1]
    assert effects(c, key, "doomed") == 0
    ev = wait_for(lambda: [x for x in c.events(key) if x["event"] == "step_in_doubt"], 10,
                  "the in-doubt event")
    assert ev[0]["level"] == "error" and ev[0]["attempts"] == 1


@pytest.mark.one_broker
def test_idempotent_step_is_run_again_with_the_same_key(crash_cluster: Cluster) -> None:
    """An idempotent step whose process died runs again and reaches EXECUTED."""
    c = crash_cluster
    key = uid("k")
    saga = c.sw.begin(key)
    step = saga.enqueue(c.tool("idem"), key, "i", sleep=3)
    # kill inside the tool body: the attempt is journaled as started before the body
    # writes its "try" row, so killing on started_at alone can land before that row
    wait_for(lambda: [r for r in c.ledger(key) if r.kind == "try"], T, "the first try")
    _kill_running_child(c, key, 1)
    assert step.result(timeout=T) == "i"
    e = c.sw.inspect(key).entries[0]
    assert e.phase is Phase.EXECUTED and e.attempts == 2 and not e.in_doubt
    tries = [r for r in c.ledger(key) if r.kind == "try"]
    assert len(tries) == 2


def test_producer_killed_between_intent_and_publish(crash_cluster: Cluster) -> None:
    """The outbox relay publishes an INTENT its producer never published."""
    c = crash_cluster
    key = uid("k")
    env = worker_env(c.settings, c.default_queue)
    proc = subprocess.run([sys.executable, "-m", "tests.apps.producer_crash", key, key], env=env,
                          cwd=ROOT, timeout=60)
    assert proc.returncode == 17
    assert c.sw.inspect(key).entries[0].phase is Phase.INTENT
    wait_for(lambda: c.sw.inspect(key).entries[0].phase is Phase.EXECUTED, T, "the relay")
    assert effects(c, key, "orphaned") == 1
    assert any(e["event"] == "step_relayed" for e in c.events(key))


def test_lost_failure_message_is_sent_again(crash_cluster: Cluster) -> None:
    """A failure journaled but never delivered is found by the sweeper and compensated."""
    c = crash_cluster
    key = uid("k")
    saga = c.sw.begin(key)
    saga.enqueue(c.tool("step"), key, "a").result(timeout=T)
    c.sw.machine.request_failure(key, "message lost on purpose")  # no message is sent
    res = saga.wait(timeout=T)
    assert res.status is SagaStatus.COMPENSATED
    assert res.error == "message lost on purpose"


def test_stalled_chain_resumes_from_the_journal(crash_cluster: Cluster) -> None:
    """A chain whose message was lost after the compare-and-set resumes and skips nothing."""
    c = crash_cluster
    key = uid("k")
    saga = c.sw.begin(key)
    for n in ("a", "b", "c"):
        saga.enqueue(c.tool("step"), key, n).result(timeout=T)
    won, n, _ = c.sw.machine.begin_compensation(key, "worker died holding the chain", "tok")
    assert won and n == 3  # COMPENSATING, but no chain message exists
    res = saga.wait(timeout=T)
    assert res.status is SagaStatus.COMPENSATED
    assert [r.tool for r in c.ledger(key) if r.kind == "undo"] == ["c", "b", "a"]
    assert [r for r in c.ledger(key) if r.kind == "repeat"] == []


@pytest.mark.one_broker
def test_undo_longer_than_its_lease_runs_once(crash_cluster: Cluster) -> None:
    """An undo taking 3x the lease (4 s) keeps its lease by heartbeat: the sweeper, which
    looks for stalled chains every second, never starts a second try beside it."""
    c = crash_cluster
    key = uid("k")
    saga = c.sw.begin(key)
    saga.enqueue(c.tool("slow_undo_step"), key, "long", 12.0).result(timeout=T)
    saga.fail("slow undo")
    res = saga.wait(timeout=T)
    assert res.status is SagaStatus.COMPENSATED
    assert [(r.kind, r.detail["attempt"]) for r in c.ledger(key) if r.kind != "effect"] == [
        ("undo", 1)]
    assert c.sw.inspect(key).entries[0].compensation_attempts == 1
    assert not [e for e in c.events(key) if e["event"] == "compensation_resumed"]


def test_undo_killed_before_its_outcome_committed_is_tried_again(
        crash_cluster: Cluster) -> None:
    """The undo ran, its process died before COMPENSATED committed. The undo is
    tried again (attempt 2, the same idempotency key), so it must be idempotent; the
    outcome is journaled once."""
    c = crash_cluster
    key = uid("k")
    saga = c.sw.begin(key)
    saga.enqueue(c.tool("slow_undo_step"), key, "u", 60.0).result(timeout=T)
    saga.fail("kill the undo")
    wait_for(lambda: any(r.kind == "undo" for r in c.ledger(key)), T, "the undo to apply")
    row = c.sw.journal.entry_row(key, 1)
    os.kill(int(row.comp_worker.rpartition("|")[2]), signal.SIGKILL)
    res = saga.wait(timeout=T)
    assert res.status is SagaStatus.COMPENSATED
    tries = [(r.kind, r.detail["attempt"], r.detail.get("idem"))
             for r in c.ledger(key) if r.kind != "effect"]
    assert [t[:2] for t in tries] == [("undo", 1), ("repeat", 2)]
    assert tries[1][2] == c.ledger(key)[1].idem  # the same key both times
    e = c.sw.inspect(key).entries[0]
    assert e.compensation is OutcomeResult.COMPENSATED and e.compensation_attempts == 2
    assert [o.attempts for o in res.report.outcomes] == [2]


def test_an_unjournalable_result_is_executed_and_undone(crash_cluster: Cluster) -> None:
    """A result that is not JSON had its effect: the step is EXECUTED with result null and
    the error naming the type, result() raises ToolFailed, the saga fails with that reason
    and the step's undo runs (ctx.result None) before the earlier step's."""
    c = crash_cluster
    key = uid("k")
    saga = c.sw.begin(key)
    saga.enqueue(c.tool("step"), key, "a").result(timeout=T)
    step = saga.enqueue(c.tool("returns_object"), key)
    with pytest.raises(ToolFailed, match=r"result is not JSON: tests\.apps\.cluster\.NotJson"):
        step.result(timeout=T)
    res = saga.wait(timeout=T)
    assert res.status is SagaStatus.COMPENSATED
    e = c.sw.inspect(key).entries[1]
    assert (e.phase, e.in_doubt, e.result) == (Phase.EXECUTED, False, None)
    assert e.error == "result is not JSON: tests.apps.cluster.NotJson"
    assert "result is not JSON: tests.apps.cluster.NotJson" in (c.sw.inspect(key).reason or "")
    assert [(o.seq, o.result) for o in res.report.outcomes] == [
        (2, OutcomeResult.COMPENSATED), (1, OutcomeResult.COMPENSATED)]
    undo = [r for r in c.ledger(key) if r.kind == "undo" and r.tool == "returns_object"]
    assert [(r.detail["result"], r.detail["args"]) for r in undo] == [(None, [key])]
    assert not [ev for ev in c.events(key) if "lost" in str(ev.get("detail", ""))]


def test_celerys_json_types_travel_through_the_journal(crash_cluster: Cluster) -> None:
    """datetime, Decimal and UUID arguments reach the tool as themselves, and its result
    comes back from the journal as kombu decodes it; the journal shows them the same."""
    c = crash_cluster
    key = uid("k")
    when = datetime(2026, 12, 4, 9, 30, tzinfo=UTC)
    ref = uuid.uuid4()
    saga = c.sw.begin(key, metadata={"placed_at": when})
    got = saga.enqueue(c.tool("typed_values"), key, when, Decimal("10.05"), ref=ref
                       ).result(timeout=T)
    assert got == {"next_day": when + timedelta(days=1), "double": Decimal("20.10"),
                   "ref": ref}
    assert [r.detail["types"] for r in c.ledger(key)] == [["datetime", "Decimal", "UUID"]]
    rec = c.sw.inspect(key)
    assert rec.metadata == {"placed_at": when}
    assert (rec.entries[0].args, rec.entries[0].kwargs) == ([key, when, Decimal("10.05")],
                                                            {"ref": ref})
    saga.complete()


def test_poison_messages_are_dead_lettered_and_the_worker_serves_on(
        crash_cluster: Cluster) -> None:
    """Malformed envelopes and unknown sagas are rejected (dead-lettered on RabbitMQ)."""
    c = crash_cluster
    task = c.tool("step")
    bad = [{ENVELOPE: "garbage"}, {ENVELOPE: {"saga_id": "no-such-saga", "seq": 1}},
           {ENVELOPE: {"saga_id": 5, "seq": "x"}}]
    sent = {task.apply_async(args=["k", "x"], kwargs=kw, queue=c.default_queue).id
            for kw in bad}
    wait_for(lambda: sum(1 for e in c.events() if e["event"] in ("bad_message",
                                                                   "unknown_step")) >= 3,
             T, "the poison messages to be refused")
    if c.broker == "rabbitmq":
        # (the queue is shared: messages of other tests wait there too, undecodable ones
        # included, so they are read raw)
        assert len(dead_letters(c, lambda h: h.get("task") == "tests.apps.cluster.step"
                                and h.get("id") in sent, len(bad))) == len(bad)
    key = uid("k")
    assert c.sw.saga(key, lambda s: s.call(task, key, "after"), timeout=T).status \
        is SagaStatus.COMPLETED


BROKEN = {"not-json": (b'{"card": "4111", broken', "application/json", False),
          "foreign-type": (b"card: 4111", "application/x-yaml", False),
          "task-not-json": (b'[[], {"a": 1}, broken', "application/json", True),
          "task-foreign-type": (b"- []\n- {}\n", "application/x-yaml", True)}


def dead_letters(c: Cluster, mine: Callable[[dict[str, Any]], Any], want: int) -> list[str]:
    """The ``kind`` headers of this test's messages (``mine`` of their headers) in
    sagaworker's dead-letter queue, taken off it (with whatever else waits there) as raw
    messages: their bodies may not decode."""
    got: list[str] = []
    with Connection(c.settings.broker_url) as conn:
        q = Queue(DEAD_LETTER_QUEUE, Exchange("sagaworker.dlx", type="direct"),
                  routing_key=DEAD_LETTER_QUEUE)(conn.channel())
        q.declare()

        def take() -> bool:
            while (m := q.get(no_ack=True)) is not None:
                if mine(m.headers or {}):
                    got.append(m.headers.get("kind", ""))
            return len(got) >= want

        wait_for(take, T, "the dead letters")
    return got


def test_undecodable_messages_are_dead_lettered_and_logged(crash_cluster: Cluster) -> None:
    """Messages on sagaworker's queue whose body is not JSON or not of an accepted
    content type (with and without a task header) are never acked and dropped: each
    is dead-lettered, an error line names the queue, and the worker serves on."""
    c = crash_cluster
    probe = uid("probe")
    with Connection(c.settings.broker_url) as conn:
        producer = conn.Producer()
        for kind, (body, ctype, as_task) in BROKEN.items():
            headers = {"probe": probe, "kind": kind}
            if as_task:
                headers.update(task="sagaworker.compensate", id=str(uuid.uuid4()),
                               lang="py", argsrepr="", kwargsrepr="")
            producer.publish(body, routing_key=c.settings.queue, exchange="",
                             content_type=ctype, content_encoding="utf-8", headers=headers)
    wait_for(lambda: sum(1 for e in c.events() if e.get("event") == "undecodable_message"
                         and e.get("queue") == c.settings.queue) >= len(BROKEN), T,
             "an error line for each undecodable message")
    lines = [e for e in c.events() if e.get("event") == "undecodable_message"]
    assert all(e["level"] == "error" and DEAD_LETTER_QUEUE in e["detail"] for e in lines)
    assert "4111" not in " ".join(str(e) for e in lines)
    # each kind once (the order the broker dead-letters them in is not promised)
    assert Counter(dead_letters(c, lambda h: h.get("probe") == probe, len(BROKEN))) == \
        Counter(BROKEN.keys())
    key = uid("k")
    assert c.sw.saga(key, lambda s: s.call(c.tool("step"), key, "after"), timeout=T).status \
        is SagaStatus.COMPLETED


def test_a_saga_failed_message_with_a_bad_saga_id_is_dead_lettered(
        crash_cluster: Cluster) -> None:
    """``sagaworker.saga_failed`` (and the chain's and the advance's messages) carrying a
    saga id that is not one (an int, a NUL), no arguments at all or more than it takes is
    refused with an error line and dead-lettered on RabbitMQ, not acked and lost; the
    worker serves on."""
    c = crash_cluster
    probe = uid("probe")
    bad = [("sagaworker.saga_failed", [123, "x"]), ("sagaworker.compensate", [None]),
           ("sagaworker.advance", ["a\x00b"]), ("sagaworker.saga_failed", ["ok-id", 7]),
           ("sagaworker.saga_failed", []), ("sagaworker.compensate", []),
           ("sagaworker.advance", ["ok-id", "extra"])]
    sent = {c.app.send_task(name, args=args, queue=c.settings.queue,
                            headers={"probe": probe}).id for name, args in bad}
    wait_for(lambda: sum(1 for e in c.events() if e["event"] == "bad_message"
                         and "dead-lettered" in e.get("error", "")) >= len(bad),
             T, "the malformed messages to be refused")
    if c.broker == "rabbitmq":
        assert len(dead_letters(c, lambda h: h.get("id") in sent, len(bad))) == len(bad)
    key = uid("k")
    assert c.sw.saga(key, lambda s: s.call(c.tool("step"), key, "after"), timeout=T).status \
        is SagaStatus.COMPLETED
