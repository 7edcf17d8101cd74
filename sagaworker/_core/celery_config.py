"""The app's Celery configuration, merged with what sagaworker needs.

sagaworker's Celery settings hold however the app is configured. Celery apps
are configured in any order: ``app.config_from_object()`` before or after
``Sagaworker(app)`` (Celery reads that object lazily and, once configured, *replaces*
the whole configuration with it), ``app.conf.update()`` at any time. So the settings are
applied (idempotently) when ``Sagaworker(app)`` is created, and again on every signal
that follows a change: ``app.on_after_configure`` (each time Celery (re)loads the
configuration), ``app.on_after_finalize``, ``celeryd_init`` (a worker program, before it
reads its queues and prefetch), ``worker_init`` and ``beat_init`` (before the beat
scheduler reads ``beat_schedule``).

Each setting is one of three kinds:

- **ours** (set every time): ``worker_prefetch_multiplier = 1``. A lost worker then holds
  back at most one task per process; the guarantees make prefetch sagaworker's choice. A
  worker started with ``--prefetch-multiplier N`` is brought back to 1 at ``worker_init``
  (with a warning), since Celery reads that flag from the configuration before any
  signal could restore it.
- **merged**: ``task_queues`` (the app's queues are kept; the default queue, the
  ``sagaworker`` queue and every tool's ``queue`` are added unless the app declares a
  queue of that name itself), ``task_routes`` (a route for ``sagaworker.*`` tasks is
  appended after the app's) and ``beat_schedule`` (sagaworker's two entries, three with
  ``SAGAWORKER_RETENTION_DAYS``, are added unless the app has entries of those names).
  ``broker_transport_options`` gets the Redis visibility timeout and publisher confirms
  unless the app set them.
- **defaults** (set only while nobody else set them): ``broker_url``,
  ``task_acks_on_failure_or_timeout = True``, ``broker_connection_retry_on_startup =
  True``, ``worker_cancel_long_running_tasks_on_connection_loss = False``.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from typing import Any

from celery import Celery
from kombu import Exchange, Queue  # type: ignore[attr-defined]

from .._base.settings import Settings

__all__ = ["DEAD_LETTER_EXCHANGE", "DEAD_LETTER_QUEUE", "FILESYSTEM_TRANSPORT", "REDIS_TRANSPORT",
           "CeleryConfig"]

# kombu loads the class by this path for redis:// brokers (see _redis.py). Not for
# rediss://: kombu turns on TLS by that scheme name, and a class path has no scheme
REDIS_TRANSPORT = "sagaworker._broker.redis:Transport"
#: kombu's filesystem transport, writing each message atomically (``_fsbroker``)
FILESYSTEM_TRANSPORT = "sagaworker._broker.fsbroker:Transport"
SCHEMES = ("redis",)

DEAD_LETTER_EXCHANGE = "sagaworker.dlx"
DEAD_LETTER_QUEUE = "sagaworker.dead"
_DLX_ARGS = {"x-dead-letter-exchange": DEAD_LETTER_EXCHANGE,
             "x-dead-letter-routing-key": DEAD_LETTER_QUEUE}
#: settings sagaworker sets only while neither the app nor its config object set them
_DEFAULTS = {"task_acks_on_failure_or_timeout": True,
             "broker_connection_retry_on_startup": True,
             # Keep running tools running when the broker connection drops: their messages
             # are redelivered, and the entry's lease makes the copy leave the attempt be.
             # Cancelling them instead would turn every in-flight step into an in-doubt one.
             "worker_cancel_long_running_tasks_on_connection_loss": False}


class CeleryConfig:
    """sagaworker's settings on the app's configuration: applied again (idempotently)
    whenever Celery may have replaced them."""

    def __init__(self, app: Celery, settings: Callable[[], Settings]) -> None:
        self.app = app
        self.settings = settings
        self._tool_queues: list[str] = []
        self._made: dict[str, Queue] = {}  # the queue declarations sagaworker made
        self._route: dict[str, Any] = {"sagaworker.*": {"queue": settings().queue}}
        #: the broker URL sagaworker put on an app that had none (the embedded default)
        self.defaulted_broker: str | None = None

    @property
    def queue_names(self) -> list[str]:
        """The queues sagaworker adds: the default queue, its own, the tools' queues."""
        default = self.app.conf.task_default_queue or "celery"
        return list(dict.fromkeys([default, self.settings().queue, *self._tool_queues]))

    def apply_settings(self) -> None:
        """Apply (again) sagaworker's settings to the app's configuration; idempotent."""
        s, conf = self.settings(), self.app.conf
        for key, value in _DEFAULTS.items():
            if not conf.value_set_for(key):
                conf[key] = value
        if not conf.broker_url:
            conf.broker_url = self.defaulted_broker = s.broker_url
        opts = dict(conf.broker_transport_options or {})
        scheme = str(conf.broker_url).partition("://")[0]
        if scheme in SCHEMES and not conf.broker_transport:
            # kombu's Redis transport, with its connection-loss crash made recoverable
            conf.broker_transport = REDIS_TRANSPORT
        if str(conf.broker_url).startswith("filesystem"):
            if not conf.broker_transport:
                conf.broker_transport = FILESYSTEM_TRANSPORT
            folder = os.path.abspath(s.broker_folder)
            for sub in ("", "out", "processed", "control"):
                # the owner's only (0700): the messages carry the arguments in clear
                os.makedirs(os.path.join(folder, sub), mode=0o700, exist_ok=True)
            opts.setdefault("data_folder_in", os.path.join(folder, "out"))
            opts.setdefault("data_folder_out", os.path.join(folder, "out"))
            opts.setdefault("processed_folder", os.path.join(folder, "processed"))
            # kombu's exchange tables, else a ./control folder wherever the process runs
            opts.setdefault("control_folder", os.path.join(folder, "control"))
            opts.setdefault("store_processed", False)
            opts.setdefault("polling_interval", 0.05)
        # Redis redelivers an unacked task after the visibility timeout; amqp
        # publisher confirms make a publish return only once the broker has the message.
        opts.setdefault("visibility_timeout", int(s.redeliver_after))
        opts.setdefault("confirm_publish", True)
        if opts != conf.broker_transport_options:
            conf.broker_transport_options = opts
        conf.worker_prefetch_multiplier = 1  # a lost worker holds back at most one task
        self._apply_queues()
        self._apply_routes()
        self._apply_beat_schedule()

    def broker_problem(self) -> str | None:
        """Why this process must not run on the broker it has: the embedded one (kombu's
        filesystem transport, no server), taken by default beside a database that is not
        the embedded SQLite journal. Its messages would sit in a folder of this host that
        no worker elsewhere reads, with nothing said."""
        s = self.settings()
        if (self.defaulted_broker is None or "broker_url" in s.model_fields_set
                or str(self.app.conf.broker_url) != self.defaulted_broker
                or s.database_url.startswith("sqlite")):
            return None
        return ("no broker is configured beside the database journal: set "
                "SAGAWORKER_BROKER_URL (amqp://... for RabbitMQ, redis://... for Redis) or "
                "the Celery app's broker_url; the embedded broker serves the embedded SQLite "
                "journal only")

    def add_queue(self, name: str) -> None:
        if name not in self._tool_queues:
            self._tool_queues.append(name)
            self._apply_queues()

    def _queue(self, name: str) -> Queue:
        # Poison messages are rejected without requeue; on RabbitMQ they dead-letter to
        # sagaworker.dead instead of vanishing (other transports ignore the arguments).
        if name not in self._made:
            self._made[name] = Queue(name, Exchange(name), routing_key=name,
                                     queue_arguments=_DLX_ARGS)
        return self._made[name]

    def _apply_queues(self) -> None:
        conf = self.app.conf
        current = conf.task_queues
        mine = {id(q) for q in self._made.values()}
        wanted = self.queue_names
        merged: Any
        if isinstance(current, Mapping):  # {name: Queue or {options}}
            merged = {k: v for k, v in current.items() if id(v) not in mine}
            merged.update({n: self._queue(n) for n in wanted if n not in merged})
        else:  # a list or tuple of Queue
            merged = [q for q in (current or ()) if id(q) not in mine]
            names = {q.name for q in merged}
            merged += [self._queue(n) for n in wanted if n not in names]
        conf.task_queues = merged
        self._sync_amqp_queues(merged)

    def _sync_amqp_queues(self, declared: Any) -> None:
        """Celery caches ``app.amqp.queues`` on first use: add what it is missing."""
        amqp = vars(self.app).get("amqp")
        table = vars(amqp).get("queues") if amqp is not None else None
        if table is None:
            return
        items = declared.items() if isinstance(declared, Mapping) else (
            (q.name, q) for q in declared)
        for name, q in items:
            if name in table:
                continue  # already routed (and maybe deselected with -X: left so)
            queue = q if isinstance(q, Queue) else table.add_compat(name, **q)
            if table._consume_from is None:  # no -Q: consume every declared queue
                table.select_add(queue)
            else:  # -Q chose what this worker consumes: only route to it
                table.add(queue)

    def _apply_routes(self) -> None:
        conf = self.app.conf
        current = conf.task_routes
        merged: Any
        if current is None:
            merged = (self._route,)
        elif isinstance(current, Mapping):
            if all(k in current for k in self._route):
                return
            merged = (current, self._route)
        elif isinstance(current, list | tuple):
            if any(r is self._route for r in current):
                return
            merged = (*current, self._route)
        else:  # one router: a function or its dotted name
            merged = (current, self._route)
        conf.task_routes = merged

    def _apply_beat_schedule(self) -> None:
        s, conf = self.settings(), self.app.conf
        ours = {
            "sagaworker-sweep": {
                "task": "sagaworker.sweep", "schedule": max(s.sweep_interval, 5.0),
                "options": {"queue": s.queue, "expires": max(s.sweep_interval, 5.0)}},
            "sagaworker-orphans": {
                "task": "sagaworker.orphans", "schedule": 60.0,
                "options": {"queue": s.queue, "expires": 60.0}},
        }
        if s.retention_days:
            ours["sagaworker-retention"] = {
                "task": "sagaworker.prune", "schedule": 86400.0,
                "options": {"queue": s.queue, "expires": 3600.0}}
        current = conf.beat_schedule or {}
        if all(k in current for k in ours):
            return
        conf.beat_schedule = {**current, **{k: v for k, v in ours.items() if k not in current}}
