"""sagaworker's Redis transport (sagaworker/_redis.py) against a real Redis.

Celery's consumer, on a lost connection, first collects it (which detaches the transport)
and then closes it. With kombu's own transport, closing a channel that still holds an
unacked message then raises AttributeError, which stops the worker. These tests drive that
same sequence on a real connection.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest
from celery import Celery
from kombu import Connection, Queue

from sagaworker import Sagaworker
from sagaworker._core.celery import REDIS_TRANSPORT
from tests.conftest import BROKERS, _broker, need, uid

pytestmark = pytest.mark.services


@pytest.fixture
def queue() -> Iterator[Queue]:
    need("redis", _broker(BROKERS["redis"]))
    q = Queue(uid("transport"))
    yield q
    with Connection(BROKERS["redis"]) as conn:
        q.bind(conn.default_channel).delete()


def _hold_unacked(conn: Connection, queue: Queue) -> Any:
    """Publish one message and receive it without acknowledging it."""
    with conn.Producer() as producer:
        producer.publish({"n": 1}, routing_key=queue.name, declare=[queue])
    got: list[Any] = []
    conn.Consumer(queue, callbacks=[lambda body, message: got.append(message)]).consume()
    conn.drain_events(timeout=5)
    assert len(got) == 1
    return got[0]


def _collect_then_close(conn: Connection) -> None:
    conn._do_close_transport()  # how Connection.collect() ends
    conn.close()


def test_kombus_transport_crashes_on_close_after_collect(queue: Queue) -> None:
    """The failure the transport exists for, on kombu's stock transport (if kombu fixes
    it, this test fails and _redis.py can go)."""
    conn = Connection(BROKERS["redis"])
    _hold_unacked(conn, queue)
    with pytest.raises(AttributeError, match="hostname"):
        _collect_then_close(conn)


def test_close_after_collect_is_a_connection_error_and_loses_nothing(queue: Queue) -> None:
    """With sagaworker's transport the close goes through, and the unacked message is
    still in Redis: it comes back once its visibility timeout has passed."""
    opts = {"visibility_timeout": 1}
    conn = Connection(BROKERS["redis"], transport=REDIS_TRANSPORT, transport_options=opts)
    _hold_unacked(conn, queue)
    _collect_then_close(conn)  # no exception

    with Connection(BROKERS["redis"], transport=REDIS_TRANSPORT,
                    transport_options=opts) as again:
        channel = again.default_channel
        deadline = time.monotonic() + 15
        message = None
        while message is None and time.monotonic() < deadline:
            channel.qos.restore_visible(num=10)
            message = queue.bind(channel).get()
            if message is None:
                time.sleep(0.2)
        assert message is not None, "the unacked message was lost"
        assert message.payload == {"n": 1}
        message.ack()


def test_redis_brokers_get_the_transport_unless_one_is_set() -> None:
    sw = Sagaworker(Celery("t", broker=BROKERS["redis"]), database_url="sqlite://")
    assert sw.app.conf.broker_transport == REDIS_TRANSPORT
    own = Celery("t", broker=BROKERS["redis"])
    own.conf.broker_transport = "redis"
    assert Sagaworker(own, database_url="sqlite://").app.conf.broker_transport == "redis"
    amqp = Sagaworker(Celery("t", broker=BROKERS["rabbitmq"]),
                      database_url="sqlite://")
    assert amqp.app.conf.broker_transport is None
    tls = Sagaworker(Celery("t", broker="rediss://127.0.0.1:6380/0"), database_url="sqlite://")
    assert tls.app.conf.broker_transport is None  # kombu's own, which turns TLS on
