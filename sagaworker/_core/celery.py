"""Celery wiring: queues, reliability settings, internal tasks, worker signals.

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

A worker refuses to start (a message on stderr naming the setting, exit code 3) when a
setting the app chose would break a guarantee:

- **a pickle serializer** in ``task_serializer``, ``result_serializer``,
  ``accept_content`` or ``result_accept_content`` (or a tool's ``serializer=``): a worker
  that accepts pickle runs whatever code a message carries, before sagaworker sees the
  message, so the bad-input guarantee (a poison message is journaled and dead-lettered)
  and the journal's JSON arguments no longer describe what ran.
- **``worker_cancel_long_running_tasks_on_connection_loss = True``**: every tool running
  when the broker connection drops would be cancelled mid-effect, turning each in-flight
  step into an in-doubt one instead of letting it finish and journal its
  outcome while the lease keeps the redelivered copy away.
- **early acks on a tool task**: ``sw.tool(acks_late=False)`` or
  ``reject_on_worker_lost=False``. A tool message acknowledged before the tool ran, or
  not requeued when its worker dies, is lost with the worker (late acks,
  requeued when a worker is lost).

Not refused: ``task_acks_late = False`` (and the other ``task_acks_*`` defaults) only
reach the app's own tasks. Tool tasks and sagaworker's internal tasks set ``acks_late``
and ``reject_on_worker_lost`` on the task itself, which Celery's configuration never
overrides.
"""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Mapping
from typing import Any, Protocol

import structlog
from celery import Celery, signals
from kombu import Exchange, Queue  # type: ignore[attr-defined]

from .._base.errors import ConfigurationError
from .._base.registry import Registry
from .._base.settings import Settings
from .._journal.retention import prune
from .._journal.runtime import Runtime
from .._observe import process as _process
from .._observe import redact as _redact
from .._observe.logging import configure_logging, get_logger
from .._observe.records import Redaction
from .._recovery.compensation import Compensator
from .._recovery.sweeper import Sweeper
from .._worker.execution import Executor
from .._worker.flows import Flows

# kombu loads the class by this path for redis:// brokers (see _redis.py). Not for
# rediss://: kombu turns on TLS by that scheme name, and a class path has no scheme
REDIS_TRANSPORT = "sagaworker._broker.redis:Transport"
#: kombu's filesystem transport, writing each message atomically (``_fsbroker``)
FILESYSTEM_TRANSPORT = "sagaworker._broker.fsbroker:Transport"
SCHEMES = ("redis",)

__all__ = ["DEAD_LETTER_QUEUE", "CeleryWiring", "Host"]


class Host(Protocol):
    """What the wiring needs of the ``Sagaworker`` that owns it."""

    app: Celery
    rt: Runtime
    registry: Registry
    compensator: Compensator
    flows: Flows
    sweeper: Sweeper
    executor: Executor

    @property
    def settings(self) -> Settings: ...

    def validate(self) -> None: ...

    def check_ready(self) -> None: ...

    def dispose_engine(self) -> None: ...

log = get_logger()
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
_SERIALIZER_SETTINGS = ("task_serializer", "result_serializer", "accept_content",
                        "result_accept_content")
_PICKLE = ("pickle", "application/x-python-serialize")


def _pickles(value: Any) -> bool:
    values = [value] if isinstance(value, str) else list(value or ())
    return any(str(v).strip().lower() in _PICKLE for v in values)


class CeleryWiring:
    def __init__(self, sw: Host) -> None:
        self.sw = sw
        self.app = sw.app
        self.tasks: dict[str, Any] = {}
        self._stop = threading.Event()
        self._tool_queues: list[str] = []
        self._made: dict[str, Queue] = {}  # the queue declarations sagaworker made
        self._route: dict[str, Any] = {"sagaworker.*": {"queue": sw.settings.queue}}
        self.apply_settings()
        self._register_tasks()
        self._connect_signals()

    # -- configuration ----------------------------------------------------------

    @property
    def queue_names(self) -> list[str]:
        """The queues sagaworker adds: the default queue, its own, the tools' queues."""
        default = self.app.conf.task_default_queue or "celery"
        return list(dict.fromkeys([default, self.sw.settings.queue, *self._tool_queues]))

    def apply_settings(self) -> None:
        """Apply (again) sagaworker's settings to the app's configuration; idempotent."""
        s, conf = self.sw.settings, self.app.conf
        for key, value in _DEFAULTS.items():
            if not conf.value_set_for(key):
                conf[key] = value
        if not conf.broker_url:
            conf.broker_url = s.broker_url
        opts = dict(conf.broker_transport_options or {})
        scheme = str(conf.broker_url).partition("://")[0]
        if scheme in SCHEMES and not conf.broker_transport:
            # kombu's Redis transport, with its connection-loss crash made recoverable
            conf.broker_transport = REDIS_TRANSPORT
        if str(conf.broker_url).startswith("filesystem"):
            if not conf.broker_transport:
                conf.broker_transport = FILESYSTEM_TRANSPORT
            folder = os.path.abspath(s.broker_folder)
            for sub in ("out", "processed", "control"):
                os.makedirs(os.path.join(folder, sub), exist_ok=True)
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
        s, conf = self.sw.settings, self.app.conf
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

    def guarantee_problems(self) -> list[str]:
        """What in the app's settings would break a guarantee (see the module docstring)."""
        conf, problems = self.app.conf, []
        for key in _SERIALIZER_SETTINGS:
            value = conf.get(key)
            if _pickles(value):
                fix = "['json']" if key.endswith("accept_content") else "'json'"
                problems.append(f"{key}={value!r} allows pickle, and a pickled message runs "
                                f"code before sagaworker can check it; set {key} = {fix}")
        if conf.get("worker_cancel_long_running_tasks_on_connection_loss"):
            problems.append(
                "worker_cancel_long_running_tasks_on_connection_loss=True cancels running "
                "tools when the broker connection drops, leaving their effects in doubt; "
                "remove it or set it to False")
        for spec in self.sw.registry.tools.values():
            task = spec.task
            if task is None:
                continue
            serializer = getattr(task, "serializer", None)
            if _pickles(serializer) and not _pickles(conf.get("task_serializer")):
                problems.append(f"tool {spec.name!r} has serializer={serializer!r}; drop "
                                "that option from its @sw.tool(...) (tool messages are JSON)")
            for attr in ("acks_late", "reject_on_worker_lost"):
                if getattr(task, attr, True) is False:
                    problems.append(
                        f"tool {spec.name!r} sets {attr}=False: its message would be lost "
                        f"with a worker that dies while running it; drop {attr}=False from "
                        "its @sw.tool(...) options")
        return problems

    # -- internal tasks ---------------------------------------------------------

    def _register_tasks(self) -> None:
        sw, app = self.sw, self.app
        # shared=False: Celery would otherwise hand these tasks, bound to this
        # Sagaworker, to every other app finalized in the process
        common = {"acks_late": True, "reject_on_worker_lost": True, "ignore_result": True,
                  "queue": sw.settings.queue, "shared": False}

        def context(task: Any) -> Any:
            return structlog.contextvars.bound_contextvars(task_id=task.request.id,
                                                           worker=task.request.hostname)

        @app.task(name="sagaworker.saga_failed", bind=True, **common)  # type: ignore[untyped-decorator]
        def saga_failed(self: Any, saga_id: str, reason: str | None = None) -> None:
            with context(self):
                sw.compensator.handle_failure(saga_id, reason)

        @app.task(name="sagaworker.compensate", bind=True, **common)  # type: ignore[untyped-decorator]
        def compensate(self: Any, saga_id: str) -> None:
            with context(self):
                sw.compensator.run_chain(saga_id)

        @app.task(name="sagaworker.advance", bind=True, **common)  # type: ignore[untyped-decorator]
        def advance(self: Any, saga_id: str) -> None:
            with context(self):
                sw.flows.advance(saga_id)

        @app.task(name="sagaworker.sweep", **common)  # type: ignore[untyped-decorator]
        def sweep() -> None:
            sw.sweeper.sweep()

        @app.task(name="sagaworker.orphans", **common)  # type: ignore[untyped-decorator]
        def orphans() -> None:
            sw.sweeper.log_orphans()

        @app.task(name="sagaworker.prune", **common)  # type: ignore[untyped-decorator]
        def prune_journal() -> int:
            days = sw.settings.retention_days
            return 0 if not days else prune(sw.rt.journal, days * 86400.0)

        self.tasks = {"saga_failed": saga_failed, "compensate": compensate, "sweep": sweep,
                      "orphans": orphans, "advance": advance, "prune": prune_journal}

    # -- worker signals ---------------------------------------------------------

    def _mine(self, sender: Any) -> bool:
        app = getattr(sender, "app", None)
        return app is None or app is self.app

    def _connect_signals(self) -> None:
        uid = f"sagaworker-{id(self)}"
        # the app's own signals: the configuration was (re)loaded, the app finalized
        self.app.on_after_configure.connect(self._on_app_configured, weak=False,
                                            dispatch_uid=uid)
        self.app.on_after_finalize.connect(self._on_app_configured, weak=False,
                                           dispatch_uid=uid)
        signals.celeryd_init.connect(self._on_celeryd_init, weak=False, dispatch_uid=uid)
        signals.beat_init.connect(self._on_beat_init, weak=False, dispatch_uid=uid)
        signals.worker_init.connect(self._on_worker_init, weak=False, dispatch_uid=uid)
        signals.setup_logging.connect(self._on_setup_logging, weak=False, dispatch_uid=uid)
        signals.worker_process_init.connect(self._on_process_init, weak=False,
                                            dispatch_uid=uid)
        signals.worker_ready.connect(self._on_ready, weak=False, dispatch_uid=uid)
        signals.worker_shutdown.connect(self._on_shutdown, weak=False, dispatch_uid=uid)
        self._connect_redaction(uid)

    def _on_app_configured(self, sender: Any = None, **_: Any) -> None:
        if sender is None or sender is self.app:
            self.apply_settings()

    def _on_celeryd_init(self, sender: Any = None, instance: Any = None, **_: Any) -> None:
        # A worker program, before it reads its queues (-Q) and its prefetch, and before
        # Celery's own root check on accept_content.
        if not self._mine(instance):
            return
        self.apply_settings()
        self._refuse_bad_settings()

    def _on_beat_init(self, sender: Any = None, **_: Any) -> None:
        if self._mine(sender):  # before the scheduler reads beat_schedule
            self.apply_settings()

    def _refuse(self, why: str) -> None:
        # Celery's signal dispatch logs and swallows receiver errors, so refuse to boot
        # the hard way.
        print(f"sagaworker: refusing to start the worker: {why}", file=sys.stderr,
              flush=True)
        log.critical("worker_refused", error=why)
        os._exit(3)

    def _refuse_bad_settings(self) -> None:
        problems = self.guarantee_problems()
        if problems:
            self._refuse("\n  ".join(problems))

    def _on_worker_init(self, sender: Any = None, **_: Any) -> None:
        if not self._mine(sender):
            return
        self.apply_settings()
        self._refuse_bad_settings()
        try:
            # a worker must never start with an undo it cannot run, a journal it cannot
            # write, or a gate nobody can open: one line naming the fix, exit 3
            self.sw.check_ready()
        except ConfigurationError as exc:
            self._refuse(str(exc))
        prefetch = getattr(sender, "prefetch_multiplier", None)
        if prefetch is not None and prefetch != 1:
            # `--prefetch-multiplier N`, or a value Celery read before any signal could
            # restore ours: the consumer is not built yet, so this still takes effect
            log.warning("prefetch_multiplier_overridden", requested=prefetch, applied=1)
            sender.prefetch_multiplier = 1

    def _on_setup_logging(self, **_: Any) -> None:
        s = self.sw.settings
        configure_logging(fmt=s.log_format, level=s.log_level, redact_keys=s.redact_keys)

    def _connect_redaction(self, uid: str) -> None:
        """Redaction beyond the log formatter (SAGAWORKER_REDACT, docs/redaction.md):
        every publish of a tool message (a retry, a relay) carries the redacted
        ``argsrepr``/``kwargsrepr``; while a tool or an undo chain runs, the secret values
        of its arguments are scrubbed out of every log line of the process."""
        signals.before_task_publish.connect(self._on_before_publish, weak=False,
                                            dispatch_uid=uid)
        signals.task_prerun.connect(self._on_task_prerun, weak=False, dispatch_uid=uid)
        signals.task_postrun.connect(self._on_task_postrun, weak=False, dispatch_uid=uid)

    def _on_before_publish(self, sender: Any = None, body: Any = None,
                           headers: Any = None, **_: Any) -> None:
        keys = self.sw.settings.redact_keys
        spec = self.sw.registry.tool(sender) if isinstance(sender, str) else None
        if not keys or spec is None or not isinstance(headers, dict):
            return
        if isinstance(body, list | tuple) and len(body) == 3:  # task protocol 2
            headers["argsrepr"], headers["kwargsrepr"] = _redact.call_reprs(
                spec.signature, body[0] or (), body[1] or {}, keys)

    def _on_task_prerun(self, task_id: str | None = None, task: Any = None,
                        args: Any = None, kwargs: Any = None, **_: Any) -> None:
        keys = self.sw.settings.redact_keys
        if not keys or task_id is None or getattr(task, "app", None) is not self.app:
            return
        try:
            spec = getattr(task, "sagaworker_spec", None)
            if spec is not None:
                values = _redact.secret_values(spec.signature, args or (), kwargs or {}, keys)
            elif task.name in ("sagaworker.saga_failed", "sagaworker.compensate") and args:
                # the undos of this saga see its arguments: their errors may quote them
                rec = self.sw.rt.journal.inspect(args[0])
                red = Redaction.of(self.sw)
                values = sorted({v for e in rec.entries for v in red.values(e)}, key=len,
                                reverse=True)
            else:
                return
        except Exception as exc:  # never fail a task over it
            log.warning("redaction_values_unavailable", error=type(exc).__name__)
            return
        _process.hold(task_id, values)

    def _on_task_postrun(self, task_id: str | None = None, **_: Any) -> None:
        if task_id is not None:
            _process.release(task_id)

    def _on_process_init(self, **_: Any) -> None:
        self.sw.dispose_engine()
        self.sw.executor.raised.clear()

    def _on_ready(self, sender: Any = None, **_: Any) -> None:
        if not self._mine(sender):
            return
        self._declare_dead_letter()
        if self.sw.settings.metrics_port:
            from .._worker.metrics import serve_metrics

            try:
                serve_metrics(self.sw.rt, self.sw.settings.metrics_port)
                log.info("metrics_serving", port=self.sw.settings.metrics_port)
            except OSError as exc:
                log.error("metrics_port_unavailable", port=self.sw.settings.metrics_port,
                          error=str(exc))
        interval = self.sw.settings.sweep_interval
        if interval > 0:
            threading.Thread(target=self._sweep_loop, args=(interval,), daemon=True,
                             name="sagaworker-sweeper").start()

    def _on_shutdown(self, **_: Any) -> None:
        self._stop.set()

    def _declare_dead_letter(self) -> None:
        try:
            with self.app.connection_for_write() as conn:
                if conn.transport.driver_type != "amqp":
                    return
                chan = conn.default_channel
                Exchange(DEAD_LETTER_EXCHANGE, type="direct", channel=chan).declare()
                Queue(DEAD_LETTER_QUEUE, Exchange(DEAD_LETTER_EXCHANGE, type="direct"),
                      routing_key=DEAD_LETTER_QUEUE, channel=chan).declare()
        except Exception as exc:  # never block a worker's boot on it
            log.warning("dead_letter_declare_failed", error=str(exc))

    def _sweep_loop(self, interval: float) -> None:
        while not self._stop.wait(interval):
            try:
                self.sw.sweeper.sweep()
            except Exception as exc:  # a database blip must not kill the timer
                log.warning("sweep_failed", error=f"{type(exc).__name__}: {exc}")
