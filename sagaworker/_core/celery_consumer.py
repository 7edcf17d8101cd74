"""Messages a worker cannot decode are dead-lettered, never acked and dropped.

Celery acknowledges (and so deletes) a message whose body does not decode (not JSON, or
a content type the worker does not accept) and logs it once; a task message of a
refused content type is rejected, which RabbitMQ dead-letters but Redis and the
filesystem broker drop. Here both go to sagaworker's dead-letter queue, whatever the
transport: on RabbitMQ the message is rejected without requeue and the queue's
dead-letter exchange takes it (``celery_config._DLX_ARGS``); on the others a copy is
published to the dead-letter queue, then the original is acknowledged. Each is logged as
``undecodable_message`` (error) naming its queue and what to do; its body never is.
"""

from __future__ import annotations

from typing import Any

from celery import bootsteps
from celery.utils.log import get_logger as celery_logger
from kombu import Exchange, Queue  # type: ignore[attr-defined]
from kombu.exceptions import ContentDisallowed

from .._observe.logging import get_logger
from .celery_config import DEAD_LETTER_EXCHANGE, DEAD_LETTER_QUEUE

__all__ = ["DeadLetterUndecodable", "dead_letter_undecodable"]

log = get_logger()
_celery_log = celery_logger(__name__)


class DeadLetterUndecodable(bootsteps.Step):  # type: ignore[misc]
    """A consumer step: its decode-error handler (and its handler of task messages of a
    refused content type) dead-letter the message instead."""

    name = "sagaworker.dead_letter_undecodable"

    def __init__(self, parent: Any, **kwargs: Any) -> None:
        invalid = parent.on_invalid_task

        def on_invalid_task(body: Any, message: Any, exc: BaseException) -> Any:
            if isinstance(exc, ContentDisallowed):
                return dead_letter_undecodable(parent, message, exc)
            return invalid(body, message, exc)

        parent.on_decode_error = lambda message, exc: dead_letter_undecodable(
            parent, message, exc)
        parent.on_invalid_task = on_invalid_task
        super().__init__(parent, **kwargs)


def dead_letter_undecodable(consumer: Any, message: Any, exc: BaseException) -> None:
    info = message.delivery_info or {}
    queue = info.get("routing_key") or info.get("exchange") or "?"
    try:
        _dead_letter(consumer, message)
        detail = (f"moved to the dead-letter queue {DEAD_LETTER_QUEUE!r}: inspect it there, "
                  "then republish it as a JSON task message (enqueue steps with "
                  "saga.enqueue()) or delete it")
        level = log.error
    except Exception as err:  # a broker that went away: the message comes back
        detail = (f"could not be dead-lettered ({type(err).__name__}: {err}); the broker "
                  "delivers it again")
        level = log.critical
    level("undecodable_message", queue=queue, content_type=message.content_type,
          error=f"{type(exc).__name__}: {str(exc)[:200]}", detail=detail)


def _dead_letter(consumer: Any, message: Any) -> None:
    conn = consumer.connection
    if conn.transport.driver_type == "amqp":
        # the queue's dead-letter exchange (declared by sagaworker) takes it
        message.reject_log_error(_celery_log, consumer.connection_errors, requeue=False)
        return
    exchange = Exchange(DEAD_LETTER_EXCHANGE, type="direct")
    dead = Queue(DEAD_LETTER_QUEUE, exchange, routing_key=DEAD_LETTER_QUEUE)
    with consumer.app.producer_or_acquire() as producer:
        producer.publish(message.body, exchange=exchange, routing_key=DEAD_LETTER_QUEUE,
                         declare=[dead], content_type=message.content_type or "text/plain",
                         content_encoding=message.content_encoding or "binary",
                         headers=dict(message.headers or {}), retry=True)
    message.ack_log_error(_celery_log, consumer.connection_errors)
