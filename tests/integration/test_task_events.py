"""Celery's task events (what Flower and ``celery events`` show) against a real worker
started with ``-E`` on RabbitMQ and PostgreSQL, with SAGAWORKER_REDACT=card in the worker
and the producer, and ``task_send_sent_event`` on in both.

An event receiver on the same broker captures every event while tools fail with the
card in every shape an exception can carry it: a dict argument, a chained cause, a
custom ``__str__``, a note, a Celery retry (``autoretry_for`` and ``Task.retry(exc=...)``),
and a parameter's default value. The card is in none of the ``task-sent``,
``task-received``, ``task-failed`` or ``task-retried`` events, nor in the worker's log,
nor in the journaled errors and reasons.
"""

from __future__ import annotations

import json
import threading
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from sagaworker import REDACTED, SagaStatus
from tests.conftest import BROKERS, Cluster, _broker, need, new_settings, uid, wait_for

pytestmark = pytest.mark.services
T = 60
SHAPES = ("plain", "dict", "cause", "str", "note")
RETRY_SHAPES = ("plain", "dict", "self")


class EventCluster(Cluster):
    events_seen: list[dict[str, Any]]


def secret() -> str:
    return "4" + str(uuid.uuid4().int)[:15]


@pytest.fixture(scope="module")
def ev_cluster(pg_url: str, tmp_path_factory: pytest.TempPathFactory
               ) -> Iterator[EventCluster]:
    """A prefork worker with task events (-E) and an event receiver in this process."""
    from celery.events import EventReceiver

    broker = BROKERS["rabbitmq"]
    need("rabbitmq", _broker(broker))
    tmp = tmp_path_factory.mktemp("events")
    c = EventCluster(new_settings(pg_url, broker, tmp, redact="card"), tmp, "rabbitmq")
    c.app.conf.task_send_sent_event = True
    c.events_seen = []
    lock = threading.Lock()

    def seen(event: dict[str, Any]) -> None:
        with lock:
            c.events_seen.append(event)

    conn = c.app.connection_for_read()
    receiver = EventReceiver(conn, handlers={"*": seen}, app=c.app)
    thread = threading.Thread(target=receiver.capture,
                              kwargs={"limit": None, "timeout": None, "wakeup": False},
                              daemon=True)
    thread.start()
    try:
        c.start_worker(args=("-E",), SAGAWORKER_REDACT="card", TEST_SENT_EVENTS="1")
        wait_for(lambda: any(e.get("type") == "worker-heartbeat" for e in c.events_seen),
                 T, "the event receiver to see the worker")
        yield c
    finally:
        receiver.should_stop = True
        thread.join(10)
        conn.release()
        c.close()


def worker_log(c: Cluster) -> str:
    return "".join(log.read_text(errors="replace") for _, log in c.workers)


def task_events(c: EventCluster, ids: set[str]) -> list[dict[str, Any]]:
    return [e for e in list(c.events_seen) if e.get("uuid") in ids]


def finished(c: EventCluster, ids: set[str]) -> bool:
    failed = {e["uuid"] for e in task_events(c, ids) if e["type"] == "task-failed"}
    return failed == ids


def leaks(events: list[dict[str, Any]], value: str) -> list[str]:
    return sorted({f"{e['type']}.{k}" for e in events for k, v in e.items()
                   if value in json.dumps(v, default=str)})


def run_failing(c: EventCluster, tool: str, shape: str, card: str,
                by_position: bool) -> tuple[str, set[str]]:
    task = c.tool(tool)
    key = uid("k")

    def work(s: Any) -> None:
        if by_position:
            s.call(task, key, card, shape)
        else:
            s.call(task, key=key, card=card, shape=shape)

    res = c.sw.saga(key, work, timeout=T)
    assert res.status is SagaStatus.COMPENSATED, res
    return key, {e.task_id for e in c.sw.inspect(key).entries if e.task_id}


def test_no_secret_in_task_events_whatever_the_exception_carries(
        ev_cluster: EventCluster) -> None:
    """Each exception shape and each retry path, the card by position and by keyword:
    the events of those tasks are all there (sent, received, retried, failed) and none
    holds the card; nor does the worker log or the journal's error texts."""
    c = ev_cluster
    cases = [("leaky", shape) for shape in SHAPES] + [
        ("leaky_retried", shape) for shape in RETRY_SHAPES]
    ran: list[tuple[str, str, str, set[str]]] = []
    for n, (tool, shape) in enumerate(cases):
        card = secret()
        key, ids = run_failing(c, tool, shape, card, by_position=n % 2 == 0)
        rec = c.sw.inspect(key)
        assert card not in f"{rec.reason} {[e.error for e in rec.entries]}", (tool, shape)
        ran.append((tool, shape, card, ids))
    all_ids = {t for *_, ids in ran for t in ids}
    wait_for(lambda: finished(c, all_ids), T, "a task-failed event for every tool task")
    events = task_events(c, all_ids)
    kinds = {e["type"] for e in events}
    assert {"task-sent", "task-received", "task-failed", "task-retried"} <= kinds
    retried = {e["uuid"] for e in events if e["type"] == "task-retried"}
    assert len(retried) == len(RETRY_SHAPES)
    text = worker_log(c)
    problems = [f"{tool} {shape}: the card is in {where}" for tool, shape, card, _ in ran
                for where in [*leaks(events, card), *(["the worker log"] if card in text
                                                      else [])]]
    assert problems == [], "\n".join(problems)
    for e in events:
        if e["type"] in ("task-sent", "task-received"):
            assert REDACTED in e["args"] + e["kwargs"], e
    for e in events:
        if e["type"] == "task-failed":
            assert "Boom" in e["exception"] or "CardError" in e["exception"], e
    failed = next(e for e in events if e["type"] == "task-failed"
                  and e["uuid"] in ran[0][3])
    assert f"card {REDACTED} declined" in failed["exception"]


def test_a_default_value_is_redacted_where_arguments_show(ev_cluster: EventCluster) -> None:
    """``charge_default(key, card=DEFAULT_CARD)`` called without its card fails quoting
    it: the card is not in the journaled error or reason, the events or the worker log."""
    from tests.apps.cluster import DEFAULT_CARD

    c = ev_cluster
    task = c.tool("charge_default")
    key = uid("k")
    res = c.sw.saga(key, lambda s: s.call(task, key, fail=True), timeout=T)
    assert res.status is SagaStatus.COMPENSATED
    rec = c.sw.inspect(key)
    ids = {e.task_id for e in rec.entries if e.task_id}
    wait_for(lambda: finished(c, ids), T, "the task-failed event")
    assert rec.entries[0].error == f"Boom: card {REDACTED} declined"
    assert DEFAULT_CARD not in (rec.reason or "")
    assert leaks(task_events(c, ids), DEFAULT_CARD) == []
    wait_for(lambda: '"event": "saga_compensated"' in worker_log(c), T, "the chain")
    assert DEFAULT_CARD not in worker_log(c)
