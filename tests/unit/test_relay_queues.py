"""The outbox relay's choice of rows when a queue is backlogged (the SQL, on SQLite; the
brokers' side is tests/integration/test_relay_backlog.py)."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
from sqlalchemy import update

from sagaworker import Sagaworker
from sagaworker._journal import now
from sagaworker._schema import entries


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
