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

from .._base.canonical import not_json
from .._base.errors import ToolFailed
from .._base.types import Phase
from .._base.units import Unit
from .._journal.moves_base import new_token, worker_label
from .._observe.logging import get_logger
from .._producer.producer import Producer
from .claims import after_outcome, not_run
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
                  claimed: str | None, idempotent: bool) -> Any:
        """Claim the unit at ``row`` (unless its journaling claimed it: ``claimed``) and
        run ``body`` to its journaled outcome. ``idempotent``: an attempt whose worker was
        lost may run again (a model request); else that attempt is in doubt."""
        rt = self.producer.rt
        claim = getattr(row, "claim", None) if claimed else None
        if claim is not None and claim.done:
            token = claim.token
        else:
            token = new_token()
            got = rt.machine.claim_start(self.saga_id, row.seq, op.tool_name, token=token,
                                         worker=worker_label(), idempotent=idempotent,
                                         task_id=None)
            with structlog.contextvars.bound_contextvars(seq=row.seq, tool=op.tool_name):
                if not not_run(rt, got, self.saga_id, row.seq, op.tool_name):
                    raise _Suspend()  # run by another replay, or decided (said and sent)
        task = asyncio.ensure_future(self._settle(row, op, body, token))
        self.inflight.add(task)
        task.add_done_callback(self.inflight.discard)
        return await asyncio.shield(task)

    async def _settle(self, row: Any, op: Unit, body: Callable[[], Awaitable[Any]],
                      token: str) -> Any:
        rt = self.producer.rt
        started = time.monotonic()
        held = (self.saga_id, row.seq, False, token)
        if self.heartbeat is not None:
            self.heartbeat.hold(held)
        try:
            payload = await body()
        except Exception as exc:
            error = f"{type(exc).__name__}: {exc}"
            if rt.machine.failed(self.saga_id, row.seq, token, error) is not None:
                rt.bus.send_failure(self.saga_id, f"step {row.seq} ({op.tool_name}) failed: "
                                                  f"{error}")
            raise self.journaled(ToolFailed(
                f"step {row.seq} ({op.tool_name}) FAILED: {error}", saga_id=self.saga_id,
                seq=row.seq, tool=op.tool_name)) from exc
        finally:
            if self.heartbeat is not None:
                self.heartbeat.drop(held)
        # its effect happened: a value the journal cannot hold (NaN) still makes the unit
        # EXECUTED, with the error saying why no result is journaled, and fails the saga
        bad = not_json(payload)
        unheld = None if bad is None else f"result is not JSON: {bad}"
        reason = f"step {row.seq} ({op.tool_name}) failed: {unheld}"
        done = rt.machine.executed(self.saga_id, row.seq, token,
                                   None if unheld else payload,
                                   (time.monotonic() - started) * 1000, error=unheld,
                                   fail_reason=reason)
        if not done.applied:
            raise _Suspend()  # fenced: another attempt holds it now
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

    async def drained(self, flow: Awaitable[Any]) -> Any:
        """The flow's run, ended only once every unit it started has journaled its outcome
        (one a framework stopped waiting for included)."""
        try:
            return await flow
        finally:
            while self.inflight:
                await asyncio.gather(*list(self.inflight), return_exceptions=True)
