"""The outbox relay and a queue backlog, on real brokers (no worker consumes here).

A step not started ``relay_after`` seconds after its INTENT is either lost or waiting in
its queue behind others. Resending the waiting ones multiplied a backlog (found while
profiling: 1,714 resends for 1,000 steps queued behind one slow worker), so the
relay leaves alone the steps of a queue that holds messages, and resends them once it
has drained.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from datetime import timedelta

import pytest
from celery import Celery
from sqlalchemy import delete, insert, or_, select, update

from sagaworker import Sagaworker, Settings
from sagaworker._base.crypto import Placed
from sagaworker._journal.repository import now
from sagaworker._journal.schema import entries, sagas
from tests.conftest import BROKERS, _broker, need, uid

pytestmark = pytest.mark.services


#: the prefixes of the sagas this module journals
_MINE = ("waiting", "aaa-crowd", "aaa-waiting", "zzz-lost")


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
    with sw.journal.engine.begin() as conn:  # the next test's sweep starts without them
        conn.execute(delete(sagas).where(or_(*[sagas.c.saga_id.like(f"{p}-%")
                                              for p in _MINE])))
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


def resends(sw: Sagaworker, saga_id: str) -> list[int]:
    """How many times the relay sent each step of the saga again (the journal's count:
    the sweep is global, other tests' leftovers are no concern of this one)."""
    with sw.journal.engine.connect() as conn:
        return list(conn.execute(select(entries.c.resends).where(entries.c.saga_id == saga_id)
                                 .order_by(entries.c.seq)).scalars())


def crowd(sw: Sagaworker, n: int) -> None:
    """``n`` steps of ``n`` other queues, unstarted and on their resend backoff, with keys
    sorting first: what a long-lived journal holds (CI's relay test ran after 400 others
    and its queue was left out of the ones the relay asked about)."""
    if not n:
        return
    t = now() - timedelta(seconds=60)
    tag = uid("aaa-crowd")
    with sw.journal.engine.begin() as conn:
        conn.execute(insert(sagas), [
            {"saga_id": f"{tag}-{i:04d}", "status": "RUNNING", "created_at": t,
             "updated_at": t, "last_seq": 1, "exec_counter": 0,
             "metadata": Placed({}, (f"{tag}-{i:04d}",))} for i in range(n)])
        conn.execute(insert(entries), [
            {"saga_id": f"{tag}-{i:04d}", "seq": 1, "tool_name": f"elsewhere.tool_{i}",
             "phase": "INTENT", "args": Placed([], (f"{tag}-{i:04d}", None)),
             "kwargs": Placed({}, (f"{tag}-{i:04d}", None)), "args_digest": "0" * 64,
             "queue": f"{tag}-q{i}", "created_at": t, "updated_at": t,
             "resend_at": now() + timedelta(hours=1), "resends": 1} for i in range(n)])


@pytest.mark.parametrize("crowded", [0, 600], ids=["alone", "crowded-journal"])
def test_steps_waiting_in_their_queue_are_not_resent(backlog: tuple[Sagaworker, str],
                                                     crowded: int) -> None:
    sw, queue = backlog
    crowd(sw, crowded)
    saga_id = uid("waiting")
    saga = sw.begin(saga_id)
    tool = sw.registry.tool(next(iter(sw.registry.tools)))
    assert tool is not None
    saga.enqueue_many([(tool.task, (i,), {}) for i in range(10)])
    assert depth(sw, queue) == 10
    age(sw, saga_id)
    sw.sweeper.sweep()
    assert resends(sw, saga_id) == [0] * 10, "steps waiting in their queue were resent"
    assert depth(sw, queue) == 10, "steps waiting in their queue were sent a second time"
    # the messages are lost (a purge, a Redis restart): the queue is empty, the relay acts
    with sw.app.connection_for_write() as conn:
        conn.default_channel.queue_purge(queue)
    assert depth(sw, queue) == 0
    sw.sweeper.sweep()
    assert resends(sw, saga_id) == [1] * 10
    assert depth(sw, queue) == 10


def test_a_lost_step_behind_a_backlogged_batch_is_relayed(
        backlog: tuple[Sagaworker, str], monkeypatch: pytest.MonkeyPatch) -> None:
    """A batch (cut to 5 rows here) all of a backlogged queue does not hold back a lost
    step of another queue whose key sorts after them: the busy queue's rows are set aside
    and the batch taken again."""
    monkeypatch.setattr("sagaworker._recovery.sweeper._BATCH", 5)
    sw, queue = backlog
    waiting = uid("aaa-waiting")
    tool = sw.registry.tool(next(iter(sw.registry.tools)))
    assert tool is not None
    sw.begin(waiting).enqueue_many([(tool.task, (i,), {}) for i in range(10)])
    age(sw, waiting)
    lost, elsewhere = uid("zzz-lost"), uid("elsewhere")
    t = now() - timedelta(seconds=60)
    with sw.journal.engine.begin() as conn:  # journaled, its publish lost
        conn.execute(insert(sagas).values(saga_id=lost, status="RUNNING", created_at=t,
                                          updated_at=t, last_seq=1, exec_counter=0,
                                          metadata=Placed({}, (lost,))))
        conn.execute(insert(entries).values(
            saga_id=lost, seq=1, tool_name=tool.name, phase="INTENT",
            args=Placed([7], (lost, None)), kwargs=Placed({}, (lost, None)),
            args_digest="0" * 64, queue=elsewhere, created_at=t, updated_at=t))
    try:
        sw.sweeper.sweep()
        assert resends(sw, waiting) == [0] * 10
        assert depth(sw, queue) == 10
        assert resends(sw, lost) == [1], "the lost step was held back by the busy batch"
        assert depth(sw, elsewhere) == 1
    finally:
        with sw.app.connection_for_write() as conn, contextlib.suppress(Exception):
            conn.default_channel.queue_delete(elsewhere)
