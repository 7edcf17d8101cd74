"""The producer side: saga handles, steps, and the synchronous form."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

from .._base.errors import (
    ApprovalRejected,
    ConfigurationError,
    SagaNotFound,
    SagaworkerError,
    ToolFailed,
)
from .._base.types import TERMINAL, Phase, SagaResult, SagaStatus
from .._journal.app_tx import AppTx, is_async_app_connection, split_connection
from .._journal.notify import FIRST_DELAY, MAX_DELAY, SAFETY_POLL, Wake
from .._observe import tracing
from .._observe.redact import exception_text, secret_values
from .._runtime import Runtime
from . import aio
from .producer import Producer

_R = TypeVar("_R")
#: the phases of a step that has no outcome yet
_PENDING = (Phase.INTENT, Phase.AWAITING_APPROVAL)

__all__ = ["Saga", "Step", "SyncSaga", "poll", "saga_secrets"]


def poll(check: Callable[[], Any], timeout: float | None, what: str,
         wake: Wake | None = None) -> Any:
    """Call ``check`` until it returns something not None.

    With a ``wake`` that is listening (PostgreSQL ``LISTEN/NOTIFY``, ``Journal.watch``)
    it sleeps until the saga changes, reading again at least every ``SAFETY_POLL``
    seconds; otherwise it backs off from 5 ms to 50 ms.
    """
    wake = wake or Wake(None)
    deadline = None if timeout is None else time.monotonic() + timeout
    delay = FIRST_DELAY
    while True:
        wake.arm()  # before the read: a change committed after it wakes the sleep below
        got = check()
        if got is not None:
            return got
        if deadline is not None and time.monotonic() >= deadline:
            raise aio.timed_out(what, timeout)
        pause = SAFETY_POLL if wake.listening else delay
        if deadline is not None:
            pause = max(0.0, min(pause, deadline - time.monotonic()))
        wake.sleep(pause)
        delay = min(delay * 1.5, MAX_DELAY)


def _no_step(saga_id: str, seq: int) -> str:
    return f"no step {seq} of saga {saga_id!r} in the journal (pruned, or another journal)"


class Step:
    """A journaled tool step; ``result()`` waits for its outcome in the journal."""

    def __init__(self, rt: Runtime, saga_id: str, seq: int, task_id: str, tool: str,
                 outcomes: dict[int, Any] | None = None) -> None:
        self.rt, self.saga_id, self.seq, self.task_id, self.tool_name = (
            rt, saga_id, seq, task_id, tool)
        #: the outcomes read so far of the saga's steps, shared by the steps one handle
        #: enqueued (an outcome is final: EXECUTED, FAILED, CANCELLED, REJECTED)
        self._outcomes: dict[int, Any] = {} if outcomes is None else outcomes

    def __repr__(self) -> str:
        return f"<Step {self.saga_id}#{self.seq} {self.tool_name}>"

    @property
    def phase(self) -> Phase:
        row = self.rt.journal.entry_row(self.saga_id, self.seq)
        return Phase(row.phase)

    async def aphase(self) -> Phase:
        """``phase``, awaitable."""
        row = await aio.offload(self.rt.journal.entry_row, self.saga_id, self.seq)
        return Phase(row.phase)

    def _what(self) -> str:
        return f"step {self.seq} ({self.tool_name}) of saga {self.saga_id!r}"

    def result(self, timeout: float | None = None) -> Any:
        """The journaled result; ToolFailed if it FAILED, ApprovalRejected if rejected."""
        def check() -> Any:
            row = self.rt.journal.entry_row(self.saga_id, self.seq)
            if row is None:
                raise SagaNotFound(_no_step(self.saga_id, self.seq))
            return row if row.phase not in (Phase.INTENT, Phase.AWAITING_APPROVAL) else None

        # one read first: a step that has its outcome registers no wait (on PostgreSQL a
        # write); the poll below reads again once its wake is armed, so nothing is missed
        row = self._read()
        if row.phase in _PENDING:
            with self.rt.journal.watch(self.saga_id) as wake:
                row = poll(check, timeout, self._what(), wake)
        return self._outcome(row)

    def _read(self) -> Any:
        """This step's entry: known from an earlier step's read of the saga, else read
        with the outcomes of the saga's later steps (one statement), kept for them."""
        known = self._outcomes.get(self.seq)
        if known is not None:
            return known
        own, rows = self.rt.journal.entry_and_outcomes(self.saga_id, self.seq)
        if own is None:
            raise SagaNotFound(_no_step(self.saga_id, self.seq))
        self._outcomes.update((r.seq, r) for r in rows if r.phase not in _PENDING)
        return own

    async def aresult(self, timeout: float | None = None) -> Any:
        """``result()``, awaitable: no thread waits (``aio``). Like ``result()`` it reads
        the journal once before it waits (``timeout=0``: that one read); with no timeout,
        on a saga this process listens for already, the hub's first read is that one."""
        row: Any = self._outcomes.get(self.seq)
        if row is None and not (timeout is None and self.rt.journal_made
                                and self.rt.journal.registered(self.saga_id)):
            row = await aio.offload(self._read)  # (a finished step registers nothing)
        if row is None or row.phase in _PENDING:  # the hub's read brings the outcome
            hub = await aio.hub_of(self.rt)
            row = await aio.wait_for(hub.wait_step(self.saga_id, self.seq), timeout,
                                     self._what())
            if row is None:
                raise SagaNotFound(_no_step(self.saga_id, self.seq))
            self._outcomes[self.seq] = row  # (an outcome is final)
        return self._outcome(row)

    def _outcome(self, row: Any) -> Any:
        phase = Phase(row.phase)
        if phase is Phase.EXECUTED and row.error is None:
            return row.result
        if phase is Phase.REJECTED:
            raise ApprovalRejected(
                f"step {self.seq} ({self.tool_name}) was rejected by {row.rejected_by}: "
                f"{row.rejection_reason}", saga_id=self.saga_id, seq=self.seq,
                tool=self.tool_name)
        if phase is Phase.CANCELLED:
            raise ToolFailed(f"step {self.seq} ({self.tool_name}) was cancelled: its saga "
                             "is compensating", saga_id=self.saga_id, seq=self.seq,
                tool=self.tool_name)
        raise ToolFailed(f"step {self.seq} ({self.tool_name}) failed: {row.error}",
                         saga_id=self.saga_id, seq=self.seq, tool=self.tool_name)


class Saga:
    """A handle on one saga; ``sw.get(id)`` gives the same handle in another process."""

    def __init__(self, rt: Runtime, producer: Producer, saga_id: str,
                 trace_context: str | None = None) -> None:
        self.rt, self.producer, self.saga_id = rt, producer, saga_id
        #: the saga's start span's context (tracing): its enqueue spans' parent
        self.trace_context = trace_context
        #: the outcomes its steps' ``result()`` read, shared by them (``Step._read``)
        self._outcomes: dict[int, Any] = {}

    def __repr__(self) -> str:
        return f"<Saga {self.saga_id}>"

    @property
    def status(self) -> SagaStatus:
        return self.rt.journal.inspect(self.saga_id).status

    def _steps(self, calls: list[tuple[Any, Any, dict[str, Any]]],
               connection: Any = None) -> list[Step]:
        tx = None if connection is None else AppTx(self.rt.journal.engine, connection)
        return [Step(self.rt, self.saga_id, seq, e.task_id, e.tool_name, self._outcomes)
                for seq, e in self.producer.enqueue(self.saga_id, calls, tx=tx,
                                                    parent=self.trace_context)]

    def enqueue(self, tool: Any, /, *args: Any, **kwargs: Any) -> Step:
        """Journal INTENT, commit, then publish the tool task. ``connection=`` (a
        SQLAlchemy Connection or Session on the journal's database): INTENT in the
        caller's transaction, published once it commits."""
        connection = split_connection(kwargs)
        return self._steps([(tool, args, kwargs)], connection)[0]

    async def aenqueue(self, tool: Any, /, *args: Any, **kwargs: Any) -> Step:
        """``enqueue``, awaitable (the journal write and the publish off the loop);
        ``connection=`` an AsyncConnection or AsyncSession."""
        connection = split_connection(kwargs)
        if connection is not None:
            return (await in_app_tx(self.rt, connection,
                                    lambda c: self._steps([(tool, args, kwargs)], c)))[0]
        return (await aio.offload(self._steps, [(tool, args, kwargs)]))[0]

    def enqueue_call(self, call_id: str, tool: Any, args: Iterable[Any] = (),
                     kwargs: dict[str, Any] | None = None) -> Step:
        """Journal one step for a caller's call id (an agent framework's tool-call id).
        The saga holding a step for that id already, that step is returned: one call id
        never journals a second step. The same id with another tool or other arguments
        is BadInput."""
        seq, task_id, name = self.producer.enqueue_call(self.saga_id, call_id, tool,
                                                        tuple(args), dict(kwargs or {}),
                                                        self.trace_context)
        return Step(self.rt, self.saga_id, seq, task_id, name, self._outcomes)

    async def aenqueue_call(self, call_id: str, tool: Any, args: Iterable[Any] = (),
                            kwargs: dict[str, Any] | None = None) -> Step:
        """``enqueue_call``, awaitable."""
        return await aio.offload(self.enqueue_call, call_id, tool, tuple(args),
                                 dict(kwargs or {}))

    def enqueue_many(
        self, calls: Iterable[tuple[Any, Iterable[Any], dict[str, Any]]], *,
        connection: Any = None,
    ) -> list[Step]:
        """Journal many independent steps in one transaction, then publish them all."""
        return self._steps([(t, tuple(a), dict(k)) for t, a, k in calls], connection)

    def complete(self) -> None:
        """RUNNING -> COMPLETED; refused while a step is unfinished, FAILED or gated."""
        self.rt.machine.complete(self.saga_id)

    def fail(self, reason: str) -> None:
        """Publish the saga-failure message (journaled first, so it is never lost)."""
        with tracing.within(self.trace_context):  # a traced publish joins the saga's trace
            self.producer.fail(self.saga_id, reason)

    async def acomplete(self) -> None:
        """``complete()``, awaitable."""
        await aio.offload(self.complete)

    async def afail(self, reason: str) -> None:
        """``fail(reason)``, awaitable."""
        await aio.offload(self.fail, reason)

    async def astatus(self) -> SagaStatus:
        """``status``, awaitable."""
        return await aio.offload(lambda: self.status)

    async def aresult(self, timeout: float | None = None) -> SagaResult:
        """``wait(timeout)``, awaitable: the SagaResult once the saga is terminal."""
        row = await aio.offload(self.rt.journal.saga_row, self.saga_id)
        if row is None or SagaStatus(row.status) not in TERMINAL:
            hub = await aio.hub_of(self.rt)
            await aio.wait_for(hub.wait_saga(self.saga_id), timeout, f"saga {self.saga_id!r}")
        return await aio.offload(self._terminal_result)

    def _terminal_result(self) -> SagaResult:
        row = self.rt.journal.saga_row(self.saga_id)
        if row is None:
            raise SagaNotFound(f"no saga {self.saga_id!r} in the journal (pruned?)")
        return self._result(row)

    def wait(self, timeout: float | None = None) -> SagaResult:
        """The SagaResult once the saga is terminal; TimeoutError otherwise."""
        def check() -> Any:
            row = self.rt.journal.saga_row(self.saga_id)
            return row if row is not None and SagaStatus(row.status) in TERMINAL else None

        with self.rt.journal.watch(self.saga_id) as wake:
            row = poll(check, timeout, f"saga {self.saga_id!r}", wake)
        return self._result(row)

    def _result(self, row: Any) -> SagaResult:
        rec = self.rt.journal.inspect(self.saga_id)
        return SagaResult(saga_id=self.saga_id, status=rec.status, value=row.result,
                          error=None if rec.status is SagaStatus.COMPLETED else rec.reason,
                          report=rec.report)


class SyncSaga:
    """What the work function of ``sw.saga`` is handed: ``s.call`` = enqueue + result."""

    def __init__(self, saga: Saga, timeout: float) -> None:
        self.saga, self.timeout = saga, timeout

    @property
    def saga_id(self) -> str:
        return self.saga.saga_id

    def call(self, tool: Any, /, *args: Any, **kwargs: Any) -> Any:
        return self.saga.enqueue(tool, *args, **kwargs).result(timeout=self.timeout)

    def enqueue(self, tool: Any, /, *args: Any, **kwargs: Any) -> Step:
        return self.saga.enqueue(tool, *args, **kwargs)


async def in_app_tx(rt: Runtime, connection: Any, call: Callable[[Any], _R]) -> _R:
    """``call`` with the sync side of the app's AsyncConnection/AsyncSession (SQLAlchemy's
    ``run_sync``: its statements go through the async driver, the loop never blocks)."""
    if not is_async_app_connection(connection):
        raise ConfigurationError(
            f"connection={connection!r}: the async calls take an AsyncConnection or "
            "AsyncSession (a Connection or Session goes to the sync calls)")
    if not rt.journal_made:
        await aio.offload(lambda: rt.journal)  # its first use connects: not on the loop
    return await connection.run_sync(call)  # type: ignore[no-any-return]


def run_sync(saga: Saga, work: Callable[[SyncSaga], Any], timeout: float) -> SagaResult:
    """Run ``work`` in a begun saga; returns once it completed or finished compensating.

    Whatever happens in the caller's process, the saga never stays RUNNING because of it:
    an exception from the work, a step that FAILED (even if the work caught ToolFailed),
    a step that does not settle in time, all fail the saga, which compensates.
    """
    rt = saga.rt
    try:
        value = work(SyncSaga(saga, timeout))
    except aio.WaitEnded as exc:  # the block's own wait ran out: the saga does not go on
        return _fail_and_wait(saga, _ran_out(exc), timeout, exc)
    except Exception as exc:
        keys = rt.settings.redact_keys
        text = exception_text(exc, keys, saga_secrets(rt, saga.saga_id) if keys else ())
        return _fail_and_wait(saga, f"{type(exc).__name__}: {text}", timeout)
    try:
        _settle(rt, saga.saga_id, timeout)
        saga.complete()
    except aio.WaitEnded as exc:
        return _fail_and_wait(saga, _ran_out(exc), timeout, exc)
    except (SagaworkerError, TimeoutError) as exc:
        # A step FAILED: its own failure message is on its way; fail() again is a no-op
        # then, and covers a refusal to complete.
        return _fail_and_wait(saga, str(exc), timeout)
    rec = rt.journal.inspect(saga.saga_id)
    return SagaResult(saga_id=saga.saga_id, status=SagaStatus.COMPLETED, value=value,
                      report=rec.report)


def saga_secrets(rt: Runtime, saga_id: str) -> list[str]:
    """The secret values of a saga's journaled steps (their redacted parameters): what a
    reason written from free text (an exception of the work or a flow) must not quote."""
    keys = rt.settings.redact_keys
    values: set[str] = set()
    for e in rt.journal.inspect(saga_id).entries:
        spec = rt.registry.tool(e.tool_name)
        values.update(secret_values(spec.signature if spec is not None else None,
                                    e.args or [], e.kwargs or {}, keys))
    return sorted(values, key=len, reverse=True)


def _ran_out(exc: aio.WaitEnded) -> str:
    """The reason journaled for a saga failed because the block's wait ran out."""
    return (f"TimeoutError: {exc.what} did not finish within {exc.timeout} s (sw.saga's "
            "timeout): sw.saga failed the saga")


def _fail_and_wait(saga: Saga, reason: str, timeout: float,
                   ended: aio.WaitEnded | None = None) -> SagaResult:
    """Fail the saga and wait for its compensation; a wait that runs out says the saga
    was failed (it does not "go on", as a plain wait's timeout says)."""
    saga.fail(reason)
    try:
        return saga.wait(timeout)
    except aio.WaitEnded:
        why = (f"{ended.what} did not finish within {ended.timeout} s" if ended is not None
               else f"the block ended with {reason}")
        raise TimeoutError(
            f"{why}, so sw.saga failed the saga: its steps are being undone, not carried on, "
            f"and that did not finish within {timeout} s either. Wait for the outcome with "
            f"sw.get({saga.saga_id!r}).wait() (or see `sagaworker show {saga.saga_id}`)"
        ) from None


def _settle(rt: Runtime, saga_id: str, timeout: float) -> None:
    """Wait for steps the work enqueued without awaiting, so complete() can decide."""
    def check() -> Any:
        rec = rt.journal.inspect(saga_id)
        if any(e.phase is Phase.FAILED for e in rec.entries):
            return True
        busy = any(e.phase in (Phase.INTENT, Phase.AWAITING_APPROVAL) for e in rec.entries)
        return None if busy else True

    with rt.journal.watch(saga_id) as wake:
        poll(check, timeout, f"the steps of saga {saga_id!r}", wake)
