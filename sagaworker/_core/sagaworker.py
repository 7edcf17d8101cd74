"""``Sagaworker``: the one object an application creates. It wires the parts together."""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable
from typing import Any, TypeVar, overload

from celery import Celery

from .._base.canonical import (
    check_arguments,
    check_json,
    check_size,
    check_text,
    has_control,
    storable,
    unstorable,
)
from .._base.errors import BadInput, ConfigurationError, SagaNotFound
from .._base.registry import Registry, ToolSpec
from .._base.settings import Settings
from .._base.types import (
    ApprovalRequest,
    EntryRecord,
    Reversibility,
    SagaRecord,
    SagaResult,
    SagaStatus,
)
from .._broker.messages import CeleryBus
from .._journal.app_tx import AppTx, split_connection
from .._journal.repository import Journal
from .._journal.retention import prune
from .._machine.machine import Machine
from .._observe import tracing
from .._observe.logging import ensure_structlog, get_logger
from .._producer.approvals import Gate
from .._producer.producer import Producer
from .._producer.saga import Saga, SyncSaga, run_sync
from .._recovery.compensation import Compensator
from .._recovery.sweeper import Sweeper
from .._runtime import Runtime
from .._worker.execution import Executor, ToolTask
from .._worker.flows import Flows
from .aio_api import AsyncTwins
from .celery import CeleryWiring

__all__ = ["Sagaworker"]

F = TypeVar("F", bound=Callable[..., Any])
log = get_logger()


class Sagaworker(AsyncTwins):
    """Journaled, compensable tool tasks on a Celery app."""

    def __init__(self, app: Celery, *, database_url: str | None = None,
                 settings: Settings | None = None) -> None:
        self.app = app
        base = (settings or Settings()).model_copy(
            update={} if database_url is None else {"database_url": database_url})
        self.registry = Registry()
        self.bus = CeleryBus(app, self.registry, lambda: self.rt.settings)
        self.rt = Runtime(base, self.registry, self.bus)
        # the one place the parts are assembled, each given what it uses
        self.producer = Producer(self.rt)
        self.flows = Flows(self.rt, self.producer, app)
        self.executor = Executor(self.rt, advance=self.flows.advance)
        self.flows.heartbeat = self.executor.heartbeat  # a durable unit's lease kept fresh
        self.compensator = Compensator(self.rt, self.executor.heartbeat)
        self.gate = Gate(self.rt)
        self.sweeper = Sweeper(self.rt)
        self.wiring = CeleryWiring(self)
        #: the app's own schema steps (``on_upgrade``), run after the journal's migrations
        self.upgrade_hooks: list[Callable[[str], None]] = []
        ensure_structlog(self.settings.redact_keys, self.registry)

    # -- wiring -----------------------------------------------------------------

    @property
    def settings(self) -> Settings:
        return self.rt.settings

    @settings.setter
    def settings(self, value: Settings) -> None:
        self.rt.configure(value)

    @property
    def journal(self) -> Journal:
        return self.rt.journal

    @property
    def machine(self) -> Machine:
        """The state machine: every move of a saga, a step and an undo."""
        return self.rt.machine

    def dispose_engine(self) -> None:
        """After a fork: never share the parent's pooled connections."""
        self.rt.dispose_engine()

    def create_schema(self, database_url: str | None = None) -> None:
        """Migrate the journal (Alembic), then run the app's ``on_upgrade`` steps: what
        `sagaworker db upgrade` does."""
        from .._journal.migrate import upgrade

        url = database_url or self.settings.database_url
        upgrade(url)
        for hook in self.upgrade_hooks:
            hook(url)

    def rotate_key(self, *, batch: int = 100) -> int:
        """Re-encrypt the journal with the first of SAGAWORKER_ENCRYPTION_KEYS (what
        `sagaworker db rotate-key` does); returns how many rows were rewritten."""
        from .._journal.rotate import rotate_keys

        return rotate_keys(self.journal.engine, self.rt.cipher, batch=batch)

    def on_upgrade(self, fn: Callable[[str], None]) -> Callable[[str], None]:
        """Register ``fn(database_url)``, a schema step of the app's own (its tables): run
        after the journal's migrations by `sagaworker db upgrade` and ``create_schema()``,
        and on the throwaway journal of ``sagaworker.testing``. Make it idempotent."""
        self.upgrade_hooks.append(fn)
        return fn

    # -- declaring ----------------------------------------------------------------

    @overload
    def tool(self, fn: F, /) -> F: ...
    @overload
    def tool(self, fn: None = None, /, *, compensable_by: str | None = None,
             reversibility: Reversibility | str | None = None, name: str | None = None,
             idempotent: bool = False, **celery_task_options: Any) -> Callable[[F], F]: ...

    def tool(self, fn: F | None = None, /, *, compensable_by: str | None = None,
             reversibility: Reversibility | str | None = None, name: str | None = None,
             idempotent: bool = False, **celery_task_options: Any) -> F | Callable[[F], F]:
        """Turn a function into a journaled Celery task (options keep their Celery meaning).
        ``@sw.tool`` and ``@sw.tool()`` alike, as Celery's ``@app.task``."""
        rev = Reversibility(reversibility) if reversibility is not None else None

        def decorate(fn: F) -> F:
            task_name = name or f"{fn.__module__}.{fn.__name__}"
            spec = ToolSpec(name=task_name, fn=fn, module=fn.__module__,
                            compensable_by=compensable_by, reversibility=rev,
                            idempotent=idempotent, queue=celery_task_options.get("queue"),
                            signature=inspect.signature(fn))
            executor = self.executor

            def run(task: ToolTask, *args: Any, **kwargs: Any) -> Any:
                return executor.run(task, args, kwargs)

            run.__name__, run.__qualname__, run.__doc__ = fn.__name__, fn.__qualname__, fn.__doc__
            run.__module__ = fn.__module__
            # shared=False: Celery would otherwise hand the task to every app in the process
            task = self.app.task(bind=True, base=ToolTask, name=task_name, shared=False,
                                 sagaworker_executor=executor, sagaworker_spec=spec,
                                 **_task_options(celery_task_options))(run)
            spec.task = task
            self.registry.add_tool(spec)
            if spec.queue:
                self.wiring.add_queue(spec.queue)
            return task  # type: ignore[no-any-return]

        return decorate if fn is None else decorate(fn)

    def compensation(self, fn: F) -> F:
        """Mark ``fn`` as the undo a tool names with ``compensable_by`` (same module)."""
        self.registry.add_undo(fn)
        return fn

    def validate(self) -> None:
        """Raise ConfigurationError naming the first tool whose undo cannot work, or a flow
        that a worker could not import by its name."""
        self.registry.validate()
        self.flows.validate()

    def check_ready(self) -> None:
        """Raise ConfigurationError, in one line naming the fix, when this process cannot
        work: the journal's database cannot be reached, its schema is missing or older
        than the code, or a gated tool is declared with no usable approval secret. A
        worker runs it at start and refuses to start (exit 3)."""
        self.validate()
        _refuse(self.wiring.config.broker_problem())
        gated = sorted(name for name, spec in self.registry.tools.items() if spec.gated)
        problem = self.settings.approval_secret_problem
        if gated and problem:
            raise ConfigurationError(f"{problem} (gated tools: {', '.join(gated)})")
        self.rt.journal  # noqa: B018 - reaches the database and checks its schema
        if gated:  # the journal's approvals are made with this process's secret
            self.gate.checked_signer()

    @overload
    def flow(self, fn: F, /) -> F: ...
    @overload
    def flow(self, fn: None = None, /, *, name: str | None = None,
             on_divergence: str = "hold") -> Callable[[F], F]: ...

    def flow(self, fn: F | None = None, /, *, name: str | None = None,
             on_divergence: str = "hold") -> F | Callable[[F], F]:
        """Register a module-level flow function; returns it unchanged (``@sw.flow`` and
        ``@sw.flow()`` alike). A diverged replay holds its saga ("compensate": fails it)."""
        def decorate(f: F) -> F:
            return self.flows.add(f, name, on_divergence).fn  # type: ignore[return-value]
        return decorate if fn is None else decorate(fn)

    def start(self, saga_id: str, flow: Callable[..., Any], /, *args: Any,
              metadata: dict[str, Any] | None = None, deadline: float | None = None,
              **kwargs: Any) -> Saga:
        """Journal a flow saga and hand it to the workers; returns at once.
        ``connection=`` (a SQLAlchemy Connection or Session on the journal's database):
        journaled in the caller's transaction, handed over once it commits."""
        connection = split_connection(kwargs)
        self.ensure_valid()
        _check_id(saga_id)
        self._check_metadata(metadata)
        self._check_flow_arguments(flow, args, kwargs)
        tx = None if connection is None else AppTx(self.journal.engine, connection)
        traced = self.flows.start(saga_id, flow, args, kwargs, metadata, _deadline(deadline),
                                  tx)
        return Saga(self.rt, self.producer, saga_id, traced)

    def _check_metadata(self, metadata: dict[str, Any] | None) -> None:
        # strict: metadata shaped like kombu's type tag read back as a datetime, and every
        # listing failed on it
        check_size(check_json(metadata or {}, "saga metadata", strict=True),
                   "the saga's metadata", self.settings.max_args_bytes)

    def _check_flow_arguments(self, flow: Any, args: tuple[Any, ...],
                              kwargs: dict[str, Any]) -> None:
        """Refuse a flow's arguments that would read back as something else (a keyword
        named like the journal's encrypted-value key or kombu's type tag) before the flow
        is journaled; the flow's own start checks that they are JSON at all."""
        spec = self.flows.spec_of(flow)
        sig = inspect.signature(spec.fn)
        check_arguments(sig.replace(parameters=list(sig.parameters.values())[1:]), args,
                        kwargs, f"the arguments of flow {spec.name!r}")

    def abort(self, saga_id: str, *, reason: str, actor: str) -> None:
        """An operator fails a running saga; it compensates (event ``saga_aborted``)."""
        if not reason or not actor:
            raise BadInput("abort needs a reason and an actor (who decided), both non-empty")
        check_text(actor, "the actor")
        reason = storable(reason)
        status = self.machine.abort(saga_id, reason=reason, actor=actor)
        log.warning("saga_aborted", saga_id=saga_id, actor=actor, reason=reason,
                    status=status.value)
        self.rt.bus.send_failure(saga_id, f"aborted by {actor}: {reason}")

    def ensure_valid(self) -> None:
        if not self.registry.validated:
            self.registry.validate()
            _refuse(self.wiring.config.broker_problem())

    # -- running ---------------------------------------------------------------------

    def begin(self, saga_id: str, *, metadata: dict[str, Any] | None = None,
              deadline: float | None = None, connection: Any = None) -> Saga:
        """Journal a new RUNNING saga; SagaExists if the id is taken. ``connection=`` (a
        SQLAlchemy Connection or Session on the journal's database): in the caller's
        transaction (the saga exists once it commits, and not if it rolls back)."""
        self.ensure_valid()
        _check_id(saga_id)
        self._check_metadata(metadata)
        tx = None if connection is None else AppTx(self.journal.engine, connection)
        # traced: the saga's start span, whose context is journaled with it
        with tracing.span("saga begin", root=True, saga_id=saga_id) as s:
            self.machine.create_saga(saga_id, dict(metadata or {}),
                                     deadline=_deadline(deadline), tx=tx,
                                     trace_context=s.carrier)
        return Saga(self.rt, self.producer, saga_id, s.carrier)

    def get(self, saga_id: str) -> Saga:
        """The handle on an existing saga (in another process, say); SagaNotFound if none."""
        row = self.journal.saga_row(saga_id)
        if row is None:
            raise SagaNotFound(f"no saga {saga_id!r} in the journal")
        return Saga(self.rt, self.producer, saga_id, row.trace_context)

    def saga(self, saga_id: str, work: Callable[[SyncSaga], Any], *,
             metadata: dict[str, Any] | None = None, timeout: float = 300) -> SagaResult:
        """Run ``work`` as a saga; returns once it completed or finished compensating."""
        return run_sync(self.begin(saga_id, metadata=metadata), work, timeout)

    def inspect(self, saga_id: str) -> SagaRecord:
        return self.journal.inspect(saga_id)

    def sagas(self, status: SagaStatus | str | None = None, limit: int = 100) -> list[SagaRecord]:
        return self.journal.list_sagas(status, limit)

    def orphans(self, older_than: float | None = None) -> list[EntryRecord]:
        """INTENT entries with no outcome older than ``older_than`` seconds."""
        return self.sweeper.orphans(self.settings.orphan_after if older_than is None
                                    else older_than)

    def prune(self, older_than: float, *, include_dirty: bool = False,
              batch: int = 1000) -> int:
        """Delete terminal sagas older than ``older_than`` seconds, in batches."""
        return prune(self.journal, older_than, include_dirty=include_dirty, batch=batch)

    # -- approvals --------------------------------------------------------------------

    def pending_approvals(self) -> list[ApprovalRequest]:
        return self.gate.pending()

    def approve(self, token: str, *, approver: str) -> None:
        self.gate.decide(token, approver=approver, approve=True)

    def reject(self, token: str, *, approver: str, reason: str) -> None:
        self.gate.decide(token, approver=approver, approve=False, reason=reason)

    # -- compensation ----------------------------------------------------------------

    def retry_compensation(self, saga_id: str, *, actor: str | None = None) -> list[int]:
        """Operator re-drive: re-run only the COMPENSATION_FAILED undos (same keys)."""
        if self.journal.saga_row(saga_id) is None:
            raise SagaNotFound(f"no saga {saga_id!r} in the journal")
        seqs = self.machine.reopen_dirty(saga_id, actor)
        if seqs:
            self.rt.bus.send_compensate(saga_id)
        return seqs

    def send_failure(self, saga_id: str, reason: str) -> None:
        self.rt.bus.send_failure(saga_id, reason)


def _task_options(options: dict[str, Any]) -> dict[str, Any]:
    """A tool's Celery options as its task takes them: without ``queue``, a task attribute
    Celery 6 drops (5.7 warns); the tool's queue is journaled with each of its steps,
    whose every publish names it."""
    return {k: v for k, v in options.items() if k != "queue"}


def _refuse(problem: str | None) -> None:
    if problem:
        raise ConfigurationError(problem)


def _check_id(saga_id: Any) -> None:
    if not isinstance(saga_id, str) or not saga_id or len(saga_id) > 200:
        raise ConfigurationError("a saga id is a non-empty string of at most 200 characters")
    if has_control(saga_id):
        raise BadInput(f"saga id {saga_id!r} holds a control character (a NUL, a line "
                       "break...); use letters, digits and punctuation")
    bad = unstorable(saga_id)
    if bad is not None:
        raise BadInput(f"saga id {saga_id!r} holds {bad}; use letters, digits and "
                       "punctuation")
    if saga_id in (".", ".."):
        raise BadInput(f"saga id {saga_id!r} is a path step: no URL can name it (a browser "
                       "resolves it even when percent-encoded); pick another id")


#: the longest deadline accepted: ten years, in seconds
MAX_DEADLINE = 10 * 365 * 86400.0


def _deadline(seconds: float | None) -> float | None:
    if seconds is None:
        return None
    if (isinstance(seconds, bool) or not isinstance(seconds, int | float)
            or not math.isfinite(seconds) or not 0 < seconds <= MAX_DEADLINE):
        raise ConfigurationError(f"deadline={seconds!r}: give a number of seconds > 0 from "
                                 f"the start of the saga, at most {MAX_DEADLINE:.0f} (ten "
                                 "years), or None for no deadline")
    return float(seconds)
