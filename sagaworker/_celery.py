"""Celery wiring: queues, reliability settings, internal tasks, worker signals."""

from __future__ import annotations

import os
import sys
import threading
from typing import TYPE_CHECKING, Any

import structlog
from celery import signals
from kombu import Exchange, Queue  # type: ignore[attr-defined]

from . import _redact
from ._errors import ConfigurationError
from ._logging import configure_logging, get_logger

# kombu loads the class by this path for redis:// brokers (see _redis.py). Not for
# rediss://: kombu turns on TLS by that scheme name, and a class path has no scheme
REDIS_TRANSPORT = "sagaworker._redis:Transport"
SCHEMES = ("redis",)

if TYPE_CHECKING:
    from ._core import Sagaworker

__all__ = ["DEAD_LETTER_QUEUE", "CeleryWiring"]

log = get_logger()
DEAD_LETTER_EXCHANGE = "sagaworker.dlx"
DEAD_LETTER_QUEUE = "sagaworker.dead"
_DLX_ARGS = {"x-dead-letter-exchange": DEAD_LETTER_EXCHANGE,
             "x-dead-letter-routing-key": DEAD_LETTER_QUEUE}


class CeleryWiring:
    def __init__(self, sw: Sagaworker) -> None:
        self.sw = sw
        self.app = sw.app
        self.tasks: dict[str, Any] = {}
        self._stop = threading.Event()
        self._configure()
        self._register_tasks()
        self._connect_signals()

    # -- configuration ----------------------------------------------------------

    def _configure(self) -> None:
        s, conf = self.sw.settings, self.app.conf
        if not conf.broker_url:
            conf.broker_url = s.broker_url
        opts = dict(conf.broker_transport_options or {})
        scheme = str(conf.broker_url).partition("://")[0]
        if scheme in SCHEMES and not conf.broker_transport:
            # kombu's Redis transport, with its connection-loss crash made recoverable
            conf.broker_transport = REDIS_TRANSPORT
        if str(conf.broker_url).startswith("filesystem"):
            folder = os.path.abspath(s.broker_folder)
            for sub in ("out", "processed"):
                os.makedirs(os.path.join(folder, sub), exist_ok=True)
            opts.setdefault("data_folder_in", os.path.join(folder, "out"))
            opts.setdefault("data_folder_out", os.path.join(folder, "out"))
            opts.setdefault("processed_folder", os.path.join(folder, "processed"))
            opts.setdefault("store_processed", False)
            opts.setdefault("polling_interval", 0.05)
        # Redis redelivers an unacked task after the visibility timeout (SPEC 6); amqp
        # publisher confirms make a publish return only once the broker has the message.
        opts.setdefault("visibility_timeout", int(s.redeliver_after))
        opts.setdefault("confirm_publish", True)
        conf.broker_transport_options = opts
        conf.worker_prefetch_multiplier = 1  # a lost worker holds back at most one task
        conf.task_acks_on_failure_or_timeout = True
        conf.broker_connection_retry_on_startup = True
        # Keep running tools running when the broker connection drops: their messages are
        # redelivered, and the entry's lease makes the copy leave the attempt be. Cancelling
        # them instead would turn every in-flight step into an in-doubt one.
        conf.worker_cancel_long_running_tasks_on_connection_loss = False
        default = conf.task_default_queue or "celery"
        self.queue_names = [default, s.queue]
        self._apply_queues()
        schedule = dict(conf.beat_schedule or {})
        schedule.setdefault("sagaworker-sweep", {
            "task": "sagaworker.sweep", "schedule": max(s.sweep_interval, 5.0),
            "options": {"queue": s.queue, "expires": max(s.sweep_interval, 5.0)}})
        schedule.setdefault("sagaworker-orphans", {
            "task": "sagaworker.orphans", "schedule": 60.0,
            "options": {"queue": s.queue, "expires": 60.0}})
        conf.beat_schedule = schedule

    def add_queue(self, name: str) -> None:
        if name not in self.queue_names:
            self.queue_names.append(name)
            self._apply_queues()

    def _apply_queues(self) -> None:
        # Poison messages are rejected without requeue; on RabbitMQ they dead-letter to
        # sagaworker.dead instead of vanishing (other transports ignore the arguments).
        self.app.conf.task_queues = [Queue(n, Exchange(n), routing_key=n,
                                           queue_arguments=_DLX_ARGS)
                                     for n in self.queue_names]

    # -- internal tasks ---------------------------------------------------------

    def _register_tasks(self) -> None:
        sw, app = self.sw, self.app
        common = {"acks_late": True, "reject_on_worker_lost": True, "ignore_result": True,
                  "queue": sw.settings.queue}

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

        @app.task(name="sagaworker.sweep", **common)  # type: ignore[untyped-decorator]
        def sweep() -> None:
            sw.sweeper.sweep()

        @app.task(name="sagaworker.orphans", **common)  # type: ignore[untyped-decorator]
        def orphans() -> None:
            sw.sweeper.log_orphans()

        self.tasks = {"saga_failed": saga_failed, "compensate": compensate, "sweep": sweep,
                      "orphans": orphans}

    def send(self, name: str, *args: Any, countdown: float | None = None) -> None:
        from ._producer import RETRY_POLICY

        self.tasks[name].apply_async(args=args, queue=self.sw.settings.queue,
                                     countdown=countdown, retry=True,
                                     retry_policy=RETRY_POLICY)

    # -- worker signals ---------------------------------------------------------

    def _mine(self, sender: Any) -> bool:
        app = getattr(sender, "app", None)
        return app is None or app is self.app

    def _connect_signals(self) -> None:
        uid = f"sagaworker-{id(self)}"
        signals.worker_init.connect(self._on_worker_init, weak=False, dispatch_uid=uid)
        signals.setup_logging.connect(self._on_setup_logging, weak=False, dispatch_uid=uid)
        signals.worker_process_init.connect(self._on_process_init, weak=False,
                                            dispatch_uid=uid)
        signals.worker_ready.connect(self._on_ready, weak=False, dispatch_uid=uid)
        signals.worker_shutdown.connect(self._on_shutdown, weak=False, dispatch_uid=uid)
        self._connect_redaction(uid)

    def _on_worker_init(self, sender: Any = None, **_: Any) -> None:
        if not self._mine(sender):
            return
        try:
            self.sw.validate()
        except ConfigurationError as exc:
            # Celery's signal dispatch logs and swallows receiver errors, so refuse to
            # boot the hard way: a worker must never start with an undo it cannot run.
            print(f"sagaworker: refusing to start the worker: {exc}", file=sys.stderr,
                  flush=True)
            log.critical("worker_refused", error=str(exc))
            os._exit(3)

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
                rec = self.sw.inspect(args[0])
                red = _redact.Redaction.of(self.sw)
                values = sorted({v for e in rec.entries for v in red.values(e)}, key=len,
                                reverse=True)
            else:
                return
        except Exception as exc:  # never fail a task over it
            log.warning("redaction_values_unavailable", error=type(exc).__name__)
            return
        _redact.hold(task_id, values)

    def _on_task_postrun(self, task_id: str | None = None, **_: Any) -> None:
        if task_id is not None:
            _redact.release(task_id)

    def _on_process_init(self, **_: Any) -> None:
        self.sw.dispose_engine()
        self.sw.executor.tool_raised.clear()

    def _on_ready(self, sender: Any = None, **_: Any) -> None:
        if not self._mine(sender):
            return
        self._declare_dead_letter()
        if self.sw.settings.metrics_port:
            from ._metrics import serve_metrics

            try:
                serve_metrics(self.sw, self.sw.settings.metrics_port)
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
