"""The outbox relay and a queue backlog, on real brokers (no worker consumes here).

A step not started ``relay_after`` seconds after its INTENT is either lost or waiting in
its queue behind others. Resending the waiting ones multiplied a backlog (found while
profiling issue 13: 1,714 resends for 1,000 steps queued behind one slow worker), so the
relay leaves alone the steps of a queue that holds messages, and resends them once it
has drained.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from datetime import timedelta

import pytest
from celery import Celery
from sqlalchemy import update

from sagaworker import Sagaworker, Settings
from sagaworker._journal import now
from sagaworker._schema import entries
from tests.conftest import BROKERS, _broker, need, uid

pytestmark = pytest.mark.services


@pytest.fixture(params=["rabbitmq", "redis"])
def backlog(request: pytest.FixtureRequest, pg_url: str) -> Iterator[tuple[Sagaworker, str]]:
    broker = BROKERS[request.param]
    need(request.param, _broker(broker))
    queue = uid("backlog")
    sw = Sagaworker(Celery(f"relay-{request.param}", broker=broker), settings=Settings(
        database_url=pg_url, broker_url=broker, queue=f"{queue}.sw", relay_after=1))

    @sw.tool(queue=queue)
    def slow_step(n: int) -> int:
        return n

    yield sw, queue
    with sw.app.connection_for_write() as conn:
        for q in (queue, f"{queue}.sw"):
            with contextlib.suppress(Exception):  # never declared (Redis: no empty list)
                conn.default_channel.queue_delete(q)
    sw.journal.engine.dispose()


def depth(sw: Sagaworker, queue: str) -> int:
    return sw.rt.bus.ready({queue}).get(queue, 0)


def age(sw: Sagaworker, saga_id: str) -> None:
    """The INTENTs were journaled a minute ago (older than relay_after), no sleep."""
    with sw.journal.engine.begin() as conn:
        conn.execute(update(entries).where(entries.c.saga_id == saga_id)
                     .values(created_at=now() - timedelta(seconds=60)))


def test_steps_waiting_in_their_queue_are_not_resent(backlog: tuple[Sagaworker, str]) -> None:
    sw, queue = backlog
    saga_id = uid("waiting")
    saga = sw.begin(saga_id)
    tool = sw.registry.tool(next(iter(sw.registry.tools)))
    assert tool is not None
    saga.enqueue_many([(tool.task, (i,), {}) for i in range(10)])
    assert depth(sw, queue) == 10
    age(sw, saga_id)
    assert sw.sweeper.sweep()["relayed"] == 0
    assert depth(sw, queue) == 10, "steps waiting in their queue were sent a second time"
    # the messages are lost (a purge, a Redis restart): the queue is empty, the relay acts
    with sw.app.connection_for_write() as conn:
        conn.default_channel.queue_purge(queue)
    assert depth(sw, queue) == 0
    assert sw.sweeper.sweep()["relayed"] == 10
    assert depth(sw, queue) == 10
