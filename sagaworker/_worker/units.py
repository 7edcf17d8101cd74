"""A flow replay's durable units (``_base.units``) at work: claimed, run to their outcome
whatever befalls the call that asked for them, journaled, and answered with the value as
the journal holds it.

A framework cancels a call when a sibling of its parallel calls suspends or fails the
replay; a unit cancelled with its claim held would run again once the lease lapsed (or
be doubted). So the asking call may be cancelled, the unit's own task is not, and the
flow's run ends only once every unit it started has journaled its outcome (``drained``).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any

import structlog

from .._base.canonical import unheld_result
from .._base.errors import ToolFailed
from .._base.types import Phase
from .._base.units import MODEL_REQUEST, Unit, unit_kind
from .._machine.moves_base import Start, new_token, worker_label
from .._observe.logging import get_logger
from .._observe.process import scrub_active
from .._producer.producer import Producer
from .claims import after_outcome, not_run
from .model_retries import next_try_in, provider_error
from .signals import _Suspend

__all__ = ["Units"]

log = get_logger()


class Units:
    """The durable units one replay of a flow runs."""

    def __init__(self, saga_id: str, producer: Producer,
                 journaled: Callable[[ToolFailed], ToolFailed]) -> None:
        self.saga_id, self.producer = saga_id, producer
        #: marks a failure as the journal's (the replay's own bookkeeping)
        self.journaled = journaled
        #: the worker's heartbeat: a running unit's claim is kept fresh
        self.heartbeat: Any = None
        #: the units whose bodies run now
        self.inflight: set[asyncio.Future[Any]] = set()

    async def run(self, row: Any, op: Unit, body: Callable[[], Awaitable[Any]],
                  claimed: str | None, idempotent: bool, tries: int | None = None) -> Any:
        """Claim the unit at ``row`` (unless its journaling claimed it: ``claimed``) and
        run ``body`` to its journaled outcome. ``idempotent``: an attempt whose worker was
        lost may run again (a model request); else that attempt is in doubt. ``tries``: a
        model request's tries in all when it fails for a passing reason (None: one)."""
        rt = self.producer.rt
        claim = getattr(row, "claim", None) if claimed else None
        attempt = 1
        if claim is not None and claim.done:
            token = claim.token
        else:
            token = new_token()
            # a retried request's claim is refused before its journaled retry is due
            got = rt.machine.claim_start(self.saga_id, row.seq, op.tool_name, token=token,
                                         worker=worker_label(), idempotent=idempotent,
                                         task_id=None,
                                         retries=getattr(row, "celery_retries", None) or 0)
            with structlog.contextvars.bound_contextvars(seq=row.seq, tool=op.tool_name):
                if not not_run(rt, got, self.saga_id, row.seq, op.tool_name):
                    if got.start is Start.NOT_DUE:  # the flow goes on once it is due
                        rt.bus.send_advance(self.saga_id,
                                            countdown=max(float(got.row.due_in or 0), 0.0))
                    raise _Suspend()  # run by another replay, or decided (said and sent)
            attempt = got.attempt
        task = asyncio.ensure_future(self._settle(row, op, body, token, attempt, tries))
        self.inflight.add(task)
        task.add_done_callback(self.inflight.discard)
        return await asyncio.shield(task)

    async def _settle(self, row: Any, op: Unit, body: Callable[[], Awaitable[Any]],
                      token: str, attempt: int, tries: int | None) -> Any:
        rt = self.producer.rt
        started = time.monotonic()
        held = (self.saga_id, row.seq, False, token)
        if self.heartbeat is not None:  # a model request on a short lease: a killed
            # worker's run is soon resumed (re-sent); a function tool keeps a tool's lease
            self.heartbeat.hold(held, lease=rt.settings.unit_lease
                                if unit_kind(op.tool_name) == MODEL_REQUEST else None)
        try:
            payload = await body()
        except Exception as exc:
            error = scrub_active(provider_error(exc))
            wait = next_try_in(exc, attempt) if tries is not None and attempt < tries else None
            if wait is not None:
                self._retry(row, op, token, attempt, error, wait)
            if tries is not None and attempt > 1:
                error = f"{error} (try {attempt} of {tries})"
            if rt.machine.failed(self.saga_id, row.seq, token, error) is not None:
                rt.bus.send_failure(self.saga_id, f"step {row.seq} ({op.tool_name}) failed: "
                                                  f"{error}")
            raise self.journaled(ToolFailed(
                f"step {row.seq} ({op.tool_name}) FAILED: {error}", saga_id=self.saga_id,
                seq=row.seq, tool=op.tool_name)) from exc
        finally:
            if self.heartbeat is not None:
                self.heartbeat.drop(held)
        # its effect happened: a value the journal cannot hold (NaN, or a model's answer
        # over SAGAWORKER_MAX_RESULT_BYTES) still makes the unit EXECUTED, with the error
        # saying why no result is journaled, and fails the saga
        unheld = unheld_result(payload, rt.settings.max_result_bytes)
        reason = f"step {row.seq} ({op.tool_name}) failed: {unheld}"
        done = rt.machine.executed(self.saga_id, row.seq, token,
                                   None if unheld else payload,
                                   (time.monotonic() - started) * 1000, error=unheld,
                                   fail_reason=reason)
        if not done.applied:  # fenced: another attempt holds it now (this one stalled)
            log.warning("unit_outcome_fenced", seq=row.seq, tool=op.tool_name,
                        detail="its claim lapsed and another worker took it over: this "
                               "answer is dropped, the journal's stands")
            raise _Suspend()
        if unheld is not None:
            log.warning("step_failed", seq=row.seq, tool=op.tool_name, error=unheld,
                        executed=True)
            after_outcome(rt, self.saga_id, done.status, reason)
            raise self.journaled(ToolFailed(reason, saga_id=self.saga_id, seq=row.seq,
                                            tool=op.tool_name))
        # the value as the journal holds it (PostgreSQL's jsonb orders an object's keys its
        # own way): this run goes on with what every replay will read, not the body's own
        journaled = rt.journal.entry_row(self.saga_id, row.seq)
        value = journaled.result if journaled is not None else payload
        row.phase, row.result, row.error = Phase.EXECUTED.value, value, None
        return value

    def _retry(self, row: Any, op: Unit, token: str, attempt: int, error: str,
               wait: float) -> None:
        """A model request failed for a passing reason: released, its next try due in
        ``wait`` seconds (journaled with its count), and the flow's next advance sent for
        then: no thread waits out the backoff. Lost in between, the sweeper sends it."""
        rt = self.producer.rt
        rt.machine.retry_later(self.saga_id, row.seq, token, error, wait,
                               retries=(getattr(row, "celery_retries", None) or 0) + 1)
        log.warning("model_request_retry", seq=row.seq, tool=op.tool_name, attempts=attempt,
                    retry_in_s=round(wait, 3), error=error)
        rt.bus.send_advance(self.saga_id, countdown=wait)
        raise _Suspend()

    async def drained(self, flow: Awaitable[Any]) -> Any:
        """The flow's run, ended only once every unit it started has journaled its outcome
        (one a framework stopped waiting for included)."""
        try:
            return await flow
        finally:
            while self.inflight:
                await asyncio.gather(*list(self.inflight), return_exceptions=True)
