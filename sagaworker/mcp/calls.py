"""A tool call: one journaled step of the saga it names, and the outcome the wait saw.

The server journals and publishes the step (the workers run it, as always), then waits
up to ``wait`` seconds on the journal for its outcome, sending progress notifications
while it waits when the client asked for them. What it answers is ``outcomes``'.

- A refusal journals nothing: arguments that do not fit the tool (or cannot be journaled),
  a saga that is unknown, closed, or another principal's.
- ``_meta["dev.sagaworker/call_id"]``: one call id, one step (``enqueue_call``): a retried
  call answers the journaled step's outcome and journals nothing.
- A cancelled request or a closed transport cancels nothing: the step's journal write and
  publish finish (shielded), and the step goes on; ``saga_status`` shows its outcome.
- A client that declared the tasks extension gets a task (``tasks``) where the answer would
  be PENDING_APPROVAL or RUNNING.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any

import anyio
import mcp_types as types

from .._base.errors import SagaworkerError, ToolFailed
from .._base.types import Phase, SagaRecord
from .._observe.logging import get_logger
from .._observe.records import Redaction
from .._producer.aio import offload
from .._producer.saga import Saga, Step
from . import outcomes
from .access import Owners
from .catalogue import SAGA_ID, Catalogue, McpTool
from .tasks import Tasks, declared

__all__ = ["CALL_ID", "PROGRESS_EVERY", "ToolCalls"]

#: the ``_meta`` key of a call's id: one call id, one step of the saga
CALL_ID = "dev.sagaworker/call_id"
#: seconds between two progress notifications while a call waits
PROGRESS_EVERY = 1.0
log = get_logger()


class ToolCalls:
    """Calls of the app's tools, each a step of the saga it names."""

    def __init__(self, sw: Any, catalogue: Catalogue, owners: Owners, wait: float,
                 tasks: Tasks | None = None) -> None:
        self.sw, self.catalogue, self.owners, self.wait = sw, catalogue, owners, wait
        self.redaction = Redaction.of(sw)
        #: the tasks extension, when the server serves it
        self.tasks = tasks

    async def call(self, ctx: Any, tool: McpTool, arguments: dict[str, Any],
                   meta: dict[str, Any] | None, caller: str
                   ) -> types.CallToolResult | dict[str, Any]:
        given = dict(arguments)
        saga_id = given.pop(SAGA_ID, None)
        if not isinstance(saga_id, str) or not saga_id:
            return outcomes.refused(f"{tool.name} needs saga_id, a string: the saga_id "
                                    "saga_begin returned")
        call_id = (meta or {}).get(CALL_ID)
        if call_id is not None and (not isinstance(call_id, str) or not call_id):
            return outcomes.refused(f"_meta[{CALL_ID!r}] must be a non-empty string")
        started = time.monotonic()
        try:
            args, kwargs = tool.arguments(given)
            saga = await self.owners.open(saga_id, caller)
            # shielded: a cancelled request never leaves a journaled step unpublished (the
            # relay would publish it, later); the step is the journal's from here on
            with anyio.CancelScope(shield=True):
                step = await self._journal(saga, tool, call_id, args, kwargs)
        except SagaworkerError as exc:  # nothing was journaled: the model may correct it
            return outcomes.refused(str(exc))
        return await self.outcome(ctx, saga, tool, step, started + self.wait, caller)

    async def _journal(self, saga: Saga, tool: McpTool, call_id: str | None,
                       args: list[Any], kwargs: dict[str, Any]) -> Step:
        if call_id is not None:
            return await saga.aenqueue_call(call_id, tool.spec.name, args, kwargs)
        # enqueue_many: the tool's own keywords, none taken for the call's options
        return (await offload(saga.enqueue_many, [(tool.spec.name, args, kwargs)]))[0]

    async def outcome(self, ctx: Any, saga: Saga, tool: McpTool, step: Step,
                      deadline: float, caller: str) -> types.CallToolResult | dict[str, Any]:
        """What the step came to within the wait (one of the four outcomes), or a task
        instead of PENDING_APPROVAL or RUNNING for a client that declared the extension."""
        tasks = self.tasks if self.tasks is not None and declared(ctx) else None
        if tool.spec.gated and await step.aphase() is Phase.AWAITING_APPROVAL:
            if tasks is not None:
                return tasks.created(caller, saga.saga_id, step.seq, tool.name, gate=True)
            rec = await self.sw.ainspect(saga.saga_id)
            return outcomes.pending(saga.saga_id, step.seq, tool.name, rec.deadline_at)
        try:
            value = await self._wait(ctx, step, tool, deadline)
        except ToolFailed:
            return outcomes.failed(await self._settled(saga, deadline), step.seq,
                                   self.catalogue.label)
        except TimeoutError:
            if tasks is not None:
                return tasks.created(caller, saga.saga_id, step.seq, tool.name, gate=False)
            return outcomes.running(saga.saga_id, step.seq, tool.name)
        if self.redaction.keys:  # the result as people see it: read back, redacted
            rec = self.redaction.record(await self.sw.ainspect(saga.saga_id))
            value = next(e.result for e in rec.entries if e.seq == step.seq)
        return outcomes.executed(saga.saga_id, step.seq, tool.name, value)

    async def _wait(self, ctx: Any, step: Step, tool: McpTool, deadline: float) -> Any:
        """The step's result within the wait (``ToolFailed``, ``TimeoutError``), with a
        progress notification every ``PROGRESS_EVERY`` seconds (none unless asked)."""
        waiting = asyncio.ensure_future(step.aresult(None))
        begun = time.monotonic()
        try:
            while True:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError
                done, _ = await asyncio.wait({waiting}, timeout=min(left, PROGRESS_EVERY))
                if done:
                    return waiting.result()
                await _progress(ctx, time.monotonic() - begun, self.wait,
                                f"step {step.seq} ({tool.name}) has no outcome yet")
        finally:
            if not waiting.done():
                waiting.cancel()  # only the wait: the step goes on

    async def _settled(self, saga: Saga, deadline: float) -> SagaRecord:
        """The failed saga as far as its compensation got within the wait (redacted)."""
        left = deadline - time.monotonic()
        if left > 0:
            with contextlib.suppress(TimeoutError):  # as far as it got: the saga goes on
                await saga.aresult(left)
        return self.redaction.record(await self.sw.ainspect(saga.saga_id))


async def _progress(ctx: Any, done: float, total: float, message: str) -> None:
    """A progress notification, when the caller asked for them (the SDK sends none
    otherwise); a client gone meanwhile changes nothing for the step."""
    try:
        await ctx.session.report_progress(round(done, 3), total, message)
    except Exception as exc:  # the transport closed: the wait goes on, the step too
        log.debug("mcp_progress_unsent", error=type(exc).__name__)
