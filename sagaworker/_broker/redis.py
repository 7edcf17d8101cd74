"""kombu's Redis transport, with one crash on connection loss turned into a connection error.

When Redis goes away while a worker holds unacknowledged messages, Celery's consumer
collects the broken connection (which detaches the transport: ``transport.client = None``)
and then closes it. Closing a channel that was not closed yet restores its unacked
messages, and building the Redis pool for that dereferences the detached client:
``AttributeError: 'NoneType' object has no attribute 'hostname'``. That is neither a
connection nor a channel error, so it escapes ``ignore_errors`` and Celery stops the worker
("Unrecoverable error") instead of reconnecting. Seen in the fault suite (Celery 5.7.0,
kombu 5.7.0); the same trace is kombu issue #582.

Raising a Redis ``ConnectionError`` there instead lets Celery do what it does for every
other lost connection: log it and reconnect. Nothing is lost by not restoring here: Redis
is unreachable anyway, and the messages come back by the visibility timeout, or, if Redis
lost them, by the outbox relay.
"""

from __future__ import annotations

from typing import Any

from kombu.transport import redis as kombu_redis
from redis.exceptions import ConnectionError as RedisConnectionError


class Channel(kombu_redis.Channel):
    def _connparams(self, asynchronous: bool = False) -> Any:
        if self.connection.client is None:
            raise RedisConnectionError(
                "the broker connection was closed after it was lost; Celery reconnects")
        return super()._connparams(asynchronous=asynchronous)  # type: ignore[no-untyped-call]


class Transport(kombu_redis.Transport):
    Channel = Channel
