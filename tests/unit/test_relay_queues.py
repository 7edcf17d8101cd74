"""The outbox relay's choice of rows when a queue is backlogged (the SQL, on SQLite; the
brokers' side is tests/integration/test_relay_backlog.py)."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
from sqlalchemy import update
from structlog.testing import capture_logs

from sagaworker import Sagaworker
from sagaworker._journal.repository import now
from sagaworker._journal.schema import entries


def test_a_step_journaled_without_a_queue_is_not_held_back_by_its_tools_busy_queue(
        sqlite_sw: Sagaworker, monkeypatch: pytest.MonkeyPatch) -> None:
    """A tool given a queue in a later deploy: its old step (queue NULL, routed by the app)
    is relayed though the new queue is busy. Compared with "=", the NULL queue made the
    whole condition NULL and the step was set aside with the busy queue's."""
    @sqlite_sw.tool(queue="busy")
    def lookup(x: int) -> int:
        return x

    sent: list[tuple[str, int]] = []
    monkeypatch.setattr(sqlite_sw.producer, "publish", lambda *a: False)  # publishes lost
    saga = sqlite_sw.begin("relay-q")
    saga.enqueue(lookup, 1)
    saga.enqueue(lookup, 2)
    with sqlite_sw.journal.engine.begin() as conn:
        conn.execute(update(entries).values(created_at=now() - timedelta(seconds=60)))
        conn.execute(update(entries).where(entries.c.seq == 1).values(queue=None))
    bus = sqlite_sw.rt.bus
    monkeypatch.setattr(bus, "ready", lambda queues: {q: 3 for q in queues if q == "busy"})

    def publish(saga_id: str, seq: int, *a: Any, **k: Any) -> bool:
        sent.append((saga_id, seq))
        return True

    monkeypatch.setattr(bus, "publish_step", publish)
    sqlite_sw.sweeper.sweep()
    assert sent == [("relay-q", 1)]


def relay_world(sw: Sagaworker, monkeypatch: pytest.MonkeyPatch, blocks: int,
                ) -> tuple[list[tuple[str, int]], list[set[str]]]:
    """``blocks`` tools all routed to the queue "busy" (its messages waiting), five lost
    steps each in sagas a00..; then one lost step of a tool of the empty queue "empty", in
    saga zz (its key sorts last). The batch is cut to 5 rows: each block fills one."""
    monkeypatch.setattr("sagaworker._recovery.resends._BATCH", 5)
    monkeypatch.setattr(sw.producer, "publish", lambda *a: False)  # publishes lost
    tools = []
    for i in range(blocks):
        def step(x: int) -> int:
            return x
        tools.append(sw.tool(queue="busy", name=f"busy.t{i:02d}")(step))
    def lone_step(x: int) -> int:
        return x
    lone = sw.tool(queue="empty", name="empty.t")(lone_step)
    for i, t in enumerate(tools):
        sw.begin(f"a{i:02d}").enqueue_many([(t, (n,), {}) for n in range(5)])
    sw.begin("zz").enqueue(lone, 1)
    with sw.journal.engine.begin() as conn:
        conn.execute(update(entries).values(created_at=now() - timedelta(seconds=60)))
    sent: list[tuple[str, int]] = []
    asked: list[set[str]] = []

    def ready(queues: set[str]) -> dict[str, int]:
        asked.append(set(queues))
        return {q: 5 for q in queues if q == "busy"}

    def publish(saga_id: str, seq: int, *a: Any, **k: Any) -> bool:
        sent.append((saga_id, seq))
        return True

    monkeypatch.setattr(sw.rt.bus, "ready", ready)
    monkeypatch.setattr(sw.rt.bus, "publish_step", publish)
    return sent, asked


def test_many_tools_of_one_busy_queue_cost_one_question_and_hold_back_no_lost_step(
        sqlite_sw: Sagaworker, monkeypatch: pytest.MonkeyPatch) -> None:
    """Nine blocks of one busy queue, each filling a batch: the broker is asked about
    "busy" once, none of its steps is resent, and the lost step behind them goes out in
    the same pass (each pair once cost a question and a round: past eight rounds the
    busy queue's steps were resent and the lost one held back)."""
    sent, asked = relay_world(sqlite_sw, monkeypatch, blocks=9)
    sqlite_sw.sweeper.sweep()
    assert sent == [("zz", 1)]
    assert asked == [{"busy"}, {"empty"}]


def test_past_the_rounds_no_step_of_an_unasked_queue_is_resent(
        sqlite_sw: Sagaworker, monkeypatch: pytest.MonkeyPatch) -> None:
    """The rounds run out before the batch's queues are all known: the rows of queues not
    asked about wait for the next pass rather than being resent unasked."""
    monkeypatch.setattr("sagaworker._recovery.sweeper._ASK_ROUNDS", 3)
    sent, asked = relay_world(sqlite_sw, monkeypatch, blocks=4)
    sqlite_sw.sweeper.sweep()
    assert sent == []
    assert asked == [{"busy"}], "the relay read no lost step: the test proves nothing"
    # with rounds enough, the same pass reaches the step of the queue nobody asked about
    monkeypatch.setattr("sagaworker._recovery.sweeper._ASK_ROUNDS", 16)
    sqlite_sw.sweeper.sweep()
    assert sent == [("zz", 1)]


def test_a_step_started_since_the_relay_read_it_is_not_taken(
        sqlite_sw: Sagaworker, monkeypatch: pytest.MonkeyPatch) -> None:
    """Between the relay's read and its compare-and-set a worker claims the step (the
    claim resets the resend count): the relay must not take it and send a duplicate."""
    sent, _ = relay_world(sqlite_sw, monkeypatch, blocks=0)
    sweeper = sqlite_sw.sweeper
    real_due = sweeper.resends.due
    read: list[int] = []

    def due_then_started(*a: Any) -> list[Any]:
        rows = real_due(*a)
        read.append(len(rows))
        with sqlite_sw.journal.engine.begin() as conn:  # what the worker's claim writes
            conn.execute(update(entries).values(started_at=now(), resends=0, resend_at=None))
        return rows

    monkeypatch.setattr(sweeper.resends, "due", due_then_started)
    assert sweeper._relay() == 0
    assert read[0] == 1, "the relay did not read the step as lost: the test proves nothing"
    assert sent == []


def test_a_retry_claimed_since_the_sweeper_read_it_is_not_resent(
        sqlite_sw: Sagaworker, monkeypatch: pytest.MonkeyPatch) -> None:
    """An attempt that raised waits for its Celery retry message; the sweeper reads it as
    lost, then the retry arrives and a worker claims it (a lease) before the sweeper's
    take: the take re-checks the row and sends nothing."""
    sent, _ = relay_world(sqlite_sw, monkeypatch, blocks=0)
    old = now() - timedelta(seconds=60)
    with sqlite_sw.journal.engine.begin() as conn:  # raised, its retry message not yet seen
        conn.execute(update(entries).values(started_at=old, updated_at=old, lease_until=None))
    sweeper = sqlite_sw.sweeper
    real_due = sweeper.resends.due
    read: list[int] = []

    def due_then_claimed(*a: Any) -> list[Any]:
        rows = real_due(*a)
        read.append(len(rows))
        with sqlite_sw.journal.engine.begin() as conn:  # the retry's claim
            conn.execute(update(entries).values(lease_until=now() + timedelta(seconds=30),
                                                resends=0, resend_at=None))
        return rows

    monkeypatch.setattr(sweeper.resends, "due", due_then_claimed)
    assert sweeper._retries() == 0
    assert read == [1], "the sweeper did not read the attempt as lost: the test proves nothing"
    assert sent == []


def test_a_lost_retry_is_not_resent_while_its_queue_holds_messages(
        sqlite_sw: Sagaworker, monkeypatch: pytest.MonkeyPatch) -> None:
    """A tool's own retry (its count journaled) overdue by a minute: while its queue holds
    messages it may be one of them (or wait, its ETA past, in a busy worker), and a copy
    would run the step once more; so the sweeper holds it back, as the relay does, and
    resends it, with its count, once the queue is empty."""
    @sqlite_sw.tool(queue="busy")
    def charge(x: int) -> int:
        return x

    monkeypatch.setattr(sqlite_sw.producer, "publish", lambda *a: False)  # never sent
    sqlite_sw.begin("retry-q").enqueue(charge, 1)
    m = sqlite_sw.machine
    assert m.claim_start("retry-q", 1, charge.name, token="t0", worker="w", idempotent=False,
                         task_id="c1", retries=0).start.value == "run"
    m.retry_later("retry-q", 1, "t0", "Retry", 0.0, 1)
    with sqlite_sw.journal.engine.begin() as conn:  # due a minute ago
        conn.execute(update(entries).values(retry_due_at=now() - timedelta(seconds=60)))
    bus = sqlite_sw.rt.bus
    waiting = {"busy": 2}
    monkeypatch.setattr(bus, "ready", lambda queues: {q: waiting[q] for q in queues
                                                      if q in waiting})
    sent: list[tuple[str, int, int]] = []

    def publish(saga_id: str, seq: int, *a: Any, **k: Any) -> bool:
        sent.append((saga_id, seq, k["retries"]))
        return True

    monkeypatch.setattr(bus, "publish_step", publish)
    with capture_logs() as logs:
        assert sqlite_sw.sweeper.sweep()["retries"] == 0
    assert sent == []
    assert [(e["event"], e["queues"]) for e in logs if e["event"].endswith("_deferred")] == [
        ("retry_deferred", ["busy"])]
    waiting["busy"] = 0  # drained: the retry was lost
    assert sqlite_sw.sweeper.sweep()["retries"] == 1
    assert sent == [("retry-q", 1, 1)]
