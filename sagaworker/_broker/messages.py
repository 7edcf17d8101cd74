"""The message bus on Celery: tool messages (with their envelope) and sagaworker's own."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

from celery import Celery
from kombu.exceptions import OperationalError as KombuOperationalError

from .._base.registry import Registry
from .._base.settings import Settings
from .._base.types import ENVELOPE
from .._observe.logging import get_logger
from .._observe.redact import call_reprs

__all__ = ["RETRY_POLICY", "CeleryBus"]

log = get_logger()


#: kombu publish retry policy: ride out a broker restart instead of failing the step
RETRY_POLICY = {"max_retries": 5, "interval_start": 0.2, "interval_step": 0.5,
                "interval_max": 2.0}


class CeleryBus:
    """Publishes through the app; a refused publish is left to the outbox relay."""

    def __init__(self, app: Celery, registry: Registry,
                 settings: Callable[[], Settings]) -> None:
        self.app, self.registry, self.settings = app, registry, settings
        self._errors: tuple[type[BaseException], ...] | None = None

    @property
    def broker_errors(self) -> tuple[type[BaseException], ...]:
        """What a broker that is down or refusing raises: a publish deferred to the relay
        or the sweeper. Anything else (an encoding error, a tool run eagerly) raises."""
        if self._errors is None:
            errors: tuple[type[BaseException], ...] = (OSError, KombuOperationalError)
            try:
                conn = self.app.connection_for_write()
                errors += (*conn.connection_errors, *conn.channel_errors)
                conn.release()
            except Exception:  # a transport that cannot say: the common ones only
                pass
            self._errors = errors
        return self._errors

    def publish_step(self, saga_id: str, seq: int, tool: str, args: list[Any],
                     kwargs: dict[str, Any], task_id: str, queue: str | None, *,
                     retries: int = 0, countdown: float | None = None) -> bool:
        """Publish one tool message; on a refusal the outbox relay sends it later.
        ``retries``/``countdown``: a Celery retry's count and delay (journaled first)."""
        spec = self.registry.tool(tool)
        if spec is None:
            return False
        options: dict[str, Any] = {"task_id": task_id, "retry": True,
                                   "retry_policy": RETRY_POLICY}
        if queue:
            options["queue"] = queue
        if retries:
            options["retries"] = retries  # a resent Celery retry keeps its count
        if countdown:
            options["countdown"] = countdown
        try:
            real = {**kwargs, ENVELOPE: {"saga_id": saga_id, "seq": seq}}
            # Celery's task events, Flower and `celery inspect` show these, never the real
            # arguments (SAGAWORKER_REDACT, docs/redaction.md)
            argsrepr, kwargsrepr = call_reprs(spec.signature, args, real,
                                              self.settings().redact_keys)
            spec.task.apply_async(args=list(args), kwargs=real, argsrepr=argsrepr,
                                  kwargsrepr=kwargsrepr, **options)
        except self.broker_errors as exc:  # the broker refused or is down: the relay resends
            log.warning("publish_deferred", saga_id=saga_id, seq=seq, tool=tool,
                        task_id=task_id, error=f"{type(exc).__name__}: {exc}",
                        detail="journaled; the outbox relay publishes it once the broker "
                               "is back")
            return False
        return True

    def queue_of(self, tool: str, queue: str | None) -> str | None:
        """The queue a tool message goes to (its own, or the app's routing)."""
        try:
            routed = self.app.amqp.router.route({"queue": queue} if queue else {}, tool, (), {})
            q = routed.get("queue")
            return q if isinstance(q, str) or q is None else str(q.name)
        except Exception:  # routing the app decides at publish time: unknown here
            return None

    def ready(self, queues: set[str]) -> dict[str, int]:
        """Messages waiting in each queue, as the broker counts them (a passive declare:
        RabbitMQ's ready count, a Redis list's length); a queue it cannot tell is left
        out."""
        counts: dict[str, int] = {}
        try:
            with self.app.connection_for_write() as conn:
                conn.ensure_connection(max_retries=1)
                for q in sorted(queues):
                    chan = conn.channel()  # a failed passive declare closes its channel
                    try:
                        counts[q] = int(chan.queue_declare(queue=q, passive=True)
                                        .message_count)
                    except Exception:  # no such queue yet, or the transport cannot say
                        pass
                    finally:
                        with contextlib.suppress(Exception):
                            chan.close()
        except Exception as exc:
            log.info("queue_depth_unknown", error=f"{type(exc).__name__}: {exc}"[:200])
        return counts

    def send(self, name: str, *args: Any, countdown: float | None = None) -> bool:
        """Send one of sagaworker's own messages. Everything it asks for is journaled
        first, so a broker that is down fails nobody: the sweeper sends it again from the
        journal (a failure request, a stalled chain, a flow not advanced)."""
        try:
            # the task object, not send_task: the app's own routing and eager mode apply
            self.app.tasks[f"sagaworker.{name}"].apply_async(
                args=args, queue=self.settings().queue, countdown=countdown, retry=True,
                retry_policy=RETRY_POLICY)
        except self.broker_errors as exc:
            log.warning("publish_deferred", saga_id=args[0] if args else None,
                        message=f"sagaworker.{name}", error=f"{type(exc).__name__}: {exc}",
                        detail="journaled; the sweeper sends it once the broker is back")
            return False
        return True

    def send_failure(self, saga_id: str, reason: str) -> None:
        self.send("saga_failed", saga_id, reason)

    def send_compensate(self, saga_id: str, *, countdown: float | None = None) -> None:
        self.send("compensate", saga_id, countdown=countdown)

    def send_advance(self, saga_id: str, *, countdown: float | None = None) -> None:
        self.send("advance", saga_id, countdown=countdown)
