"""A worker's and beat's start-up for sagaworker (Celery signals): settings applied
again before they are read, refusals in one line (exit 3), logging, redaction of what
Celery shows, the dead-letter queue (undecodable messages too), metrics, and the
sweeper's timer."""

from __future__ import annotations

import os
import signal
import sys
import threading
from typing import Any, Protocol

from celery import Celery, signals
from kombu import Exchange, Queue  # type: ignore[attr-defined]

from .._base.errors import ConfigurationError
from .._base.registry import Registry
from .._base.settings import Settings
from .._journal.readiness import keys_changed
from .._observe import process as _process
from .._observe import redact as _redact
from .._observe.logging import configure_logging, get_logger
from .._observe.records import Redaction
from .._recovery.sweeper import Sweeper
from .._runtime import Runtime
from .._worker.execution import Executor
from .celery_config import DEAD_LETTER_EXCHANGE, DEAD_LETTER_QUEUE, CeleryConfig
from .celery_consumer import DeadLetterUndecodable
from .celery_guarantees import guarantee_problems

__all__ = ["Host", "WorkerStartup"]

log = get_logger()
#: how often (seconds, at most) a running worker re-reads which keys seal the journal
KEYS_EVERY = 30.0


class Host(Protocol):
    """What start-up needs of the ``Sagaworker`` that owns it."""

    app: Celery
    rt: Runtime
    registry: Registry
    sweeper: Sweeper
    executor: Executor

    @property
    def settings(self) -> Settings: ...

    def check_ready(self) -> None: ...

    def dispose_engine(self) -> None: ...


class WorkerStartup:
    """The signal receivers of one Sagaworker's app."""

    def __init__(self, sw: Host, config: CeleryConfig) -> None:
        self.sw = sw
        self.app = sw.app
        self.config = config
        self._stop = threading.Event()
        self.connect()

    def _mine(self, sender: Any) -> bool:
        app = getattr(sender, "app", None)
        return app is None or app is self.app

    def connect(self) -> None:
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
        # a message that does not decode is dead-lettered, never acked and dropped
        self.app.steps["consumer"].add(DeadLetterUndecodable)

    def _on_app_configured(self, sender: Any = None, **_: Any) -> None:
        if sender is None or sender is self.app:
            self.config.apply_settings()

    def _on_celeryd_init(self, sender: Any = None, instance: Any = None, **_: Any) -> None:
        # A worker program, before it reads its queues (-Q) and its prefetch, and before
        # Celery's own root check on accept_content.
        if not self._mine(instance):
            return
        self.config.apply_settings()
        self._refuse_bad_settings()

    def _on_beat_init(self, sender: Any = None, **_: Any) -> None:
        if self._mine(sender):  # before the scheduler reads beat_schedule
            self.config.apply_settings()

    def _refuse(self, why: str) -> None:
        # Celery's signal dispatch logs and swallows receiver errors, so refuse to boot
        # the hard way.
        print(f"sagaworker: refusing to start the worker: {why}", file=sys.stderr,
              flush=True)
        log.critical("worker_refused", error=why)
        os._exit(3)

    def _refuse_bad_settings(self) -> None:
        problems = guarantee_problems(self.app.conf, self.sw.registry)
        if problems:
            self._refuse("\n  ".join(problems))

    def _on_worker_init(self, sender: Any = None, **_: Any) -> None:
        if not self._mine(sender):
            return
        self.config.apply_settings()
        self._refuse_bad_settings()
        try:
            # a worker must never start with an undo it cannot run, a journal it cannot
            # write, or a gate nobody can open: one line naming the fix, exit 3
            self.sw.check_ready()
            if self.sw.settings.metrics_problem:  # metrics open to the network, no token
                raise ConfigurationError(self.sw.settings.metrics_problem)
        except ConfigurationError as exc:
            self._refuse(str(exc))
        except Exception as exc:  # Celery would log and swallow it, and start anyway
            first = (str(exc).strip().splitlines() or [""])[0][:300]
            self._refuse(f"{type(exc).__name__}: {first}")
        prefetch = getattr(sender, "prefetch_multiplier", None)
        if prefetch is not None and prefetch != 1:
            # `--prefetch-multiplier N`, or a value Celery read before any signal could
            # restore ours: the consumer is not built yet, so this still takes effect
            log.warning("prefetch_multiplier_overridden", requested=prefetch, applied=1)
            sender.prefetch_multiplier = 1
        # the queues this worker consumes (`-Q`, else every queue the app declares): a
        # flow's next step of one of them may run here (eager steps); inherited by forks
        # (not under `--time-limit`/`--soft-time-limit`: a chain must not outlive the
        # limit of the delivery that carries it)
        limited = getattr(sender, "time_limit", None) or getattr(sender, "soft_time_limit",
                                                                  None)
        try:
            if not limited:
                self.sw.executor.eager.consuming = frozenset(
                    self.app.amqp.queues.consume_from)
        except Exception as exc:  # eager steps off: every step is published
            log.warning("eager_steps_off", error=f"{type(exc).__name__}: {exc}"[:200])

    def _on_setup_logging(self, **_: Any) -> None:
        s = self.sw.settings
        configure_logging(fmt=s.log_format, level=s.log_level, redact_keys=s.redact_keys)
        # Celery redirects stdout and stderr to its logger only when nobody handles this
        # signal: done here, so a tool's print() goes through the formatter (and its
        # redaction) instead of straight to the process's output
        conf = self.app.conf
        if conf.worker_redirect_stdouts:
            self.app.log.redirect_stdouts(conf.worker_redirect_stdouts_level)

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
        self.sw.executor.failures.clear()

    def _on_ready(self, sender: Any = None, **_: Any) -> None:
        if not self._mine(sender):
            return
        self._declare_dead_letter()
        if self.sw.settings.metrics_port:
            from .._worker.metrics import serve_metrics

            try:
                serve_metrics(self.sw.rt, self.sw.settings.metrics_port)
                log.info("metrics_serving", port=self.sw.settings.metrics_port,
                         addr=self.sw.settings.metrics_addr)
            except (OSError, ConfigurationError) as exc:
                log.error("metrics_port_unavailable", port=self.sw.settings.metrics_port,
                          error=str(exc))
        interval = self.sw.settings.sweep_interval
        if interval > 0:
            threading.Thread(target=self._sweep_loop, args=(interval,), daemon=True,
                             name="sagaworker-sweeper").start()
            # agents' model requests whose worker died: their runs go on within seconds
            threading.Thread(target=self._requests_loop, daemon=True,
                             name="sagaworker-requests").start()
        # the key fact on a timer of its own: a worker that sweeps nothing
        # (SAGAWORKER_SWEEP_INTERVAL=0, docs/scaling.md's tool-only workers) writes results
        # too, and must stop as well rather than write them in clear beside sealed ones
        every = min(KEYS_EVERY, 5 * interval) if interval > 0 else KEYS_EVERY
        threading.Thread(target=self._keys_loop, args=(every,), daemon=True,
                         name="sagaworker-keys").start()

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

    def _keys_loop(self, every: float) -> None:
        while not self._stop.wait(every):
            self._check_keys()

    def _requests_loop(self) -> None:
        """Every SAGAWORKER_UNIT_LEASE: agents' model requests whose worker stopped beating
        are handed on (their flows advanced again: another worker re-sends them)."""
        while not self._stop.wait(self.sw.settings.unit_lease):
            try:
                handed = self.sw.sweeper.requests()
                if handed:
                    log.info("sweep", requests=handed)
            except Exception as exc:  # a database blip must not kill the timer
                log.warning("sweep_failed", error=f"{type(exc).__name__}: {exc}")

    def _check_keys(self) -> None:
        """Encryption turned on while this worker runs without the key: it stops (a warm
        shutdown: nothing new is taken) rather than journal results in clear."""
        try:
            problem = keys_changed(self.sw.rt.journal.engine, self.sw.rt.cipher)
        except Exception:  # a database blip: checked again at the next round
            return
        if problem:
            log.critical("journal_keys_changed", error=problem)
            self._stop.set()
            os.kill(os.getpid(), signal.SIGTERM)
