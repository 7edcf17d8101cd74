"""The saga tools: ``saga_begin``, ``saga_status``, ``saga_commit``, ``saga_abort``.

The 2026-07-28 protocol has no sessions: a saga is an explicit handle the model passes to
every call. ``saga_begin`` makes one with an unguessable id, bound to the caller's
principal; the others answer for the caller's own sagas only. None of them decides a
gate: an operator does, with a signed token (the CLI, the dashboard, ``sw.approve``).
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import time
from typing import Any

import mcp_types as types
from pydantic import BaseModel, ValidationError

from .._base.errors import SagaworkerError, ToolFailed
from .._base.types import OPEN, Phase, SagaRecord, SagaStatus
from .._observe.logging import get_logger
from .._observe.records import Redaction
from .._producer.aio import offload
from .._producer.saga import Saga, Step
from . import outcomes
from .access import PRINCIPAL, Owners
from .catalogue import Abort, Begin, Catalogue, SagaRef, refusal_text

__all__ = ["SagaTools"]

log = get_logger()
#: metadata keys of a saga begun through MCP, beside ``mcp_principal``
CLIENT, PURPOSE = "mcp_client", "purpose"


def _parsed(model: type[BaseModel], arguments: dict[str, Any]) -> Any:
    try:
        return model.model_validate(arguments)
    except ValidationError as exc:
        raise _Refused(f"arguments do not fit: {refusal_text(exc)}") from None


class _Refused(Exception):
    pass


def client_name(ctx: Any) -> str:
    """The MCP client's name as it introduced itself (printable, at most 200 chars)."""
    params = getattr(ctx.session, "client_params", None)
    info = getattr(params, "client_info", None)
    name = getattr(info, "name", None) or "unknown"
    return "".join(ch for ch in str(name) if ch.isprintable())[:200] or "unknown"


class SagaTools:
    """The saga tools' calls, for the caller's own sagas."""

    def __init__(self, sw: Any, catalogue: Catalogue, owners: Owners, wait: float) -> None:
        self.sw, self.catalogue, self.owners, self.wait = sw, catalogue, owners, wait
        self.redaction = Redaction.of(sw)
        self.handlers = {"saga_begin": self.begin, "saga_status": self.status,
                         "saga_commit": self.commit, "saga_abort": self.abort}

    async def call(self, ctx: Any, name: str, arguments: dict[str, Any], caller: str
                   ) -> types.CallToolResult:
        try:
            return await self.handlers[name](ctx, arguments, caller)
        except _Refused as exc:
            return outcomes.refused(str(exc))
        except SagaworkerError as exc:  # unknown or another's saga, a move refused
            return outcomes.refused(str(exc))

    async def _record(self, saga_id: str) -> SagaRecord:
        return self.redaction.record(await self.sw.ainspect(saga_id))

    def _answer(self, rec: SagaRecord, text: str | None = None, *, error: bool = False
                ) -> types.CallToolResult:
        return outcomes.saga_result(rec, self.catalogue.label, text, error=error)

    async def begin(self, ctx: Any, arguments: dict[str, Any], caller: str
                    ) -> types.CallToolResult:
        args = _parsed(Begin, arguments)
        saga_id = f"mcp-{secrets.token_urlsafe(18)}"  # unguessable: a handle, not a name
        client = client_name(ctx)
        metadata = {PURPOSE: args.purpose, CLIENT: client, PRINCIPAL: caller}
        saga = await self.sw.abegin(saga_id, metadata=metadata, deadline=args.deadline_s)
        self.owners.remember(saga, caller)
        log.info("mcp_saga_begun", saga_id=saga_id, principal=caller, client=client)
        deadline_at = None
        if args.deadline_s is not None:
            deadline_at = (await self.sw.ainspect(saga_id)).deadline_at
        return outcomes.begun(saga_id, deadline_at)

    async def status(self, ctx: Any, arguments: dict[str, Any], caller: str
                     ) -> types.CallToolResult:
        args = _parsed(SagaRef, arguments)
        await self.owners.open(args.saga_id, caller)
        return self._answer(await self._record(args.saga_id))

    async def commit(self, ctx: Any, arguments: dict[str, Any], caller: str
                     ) -> types.CallToolResult:
        """Completes the saga once each step has its outcome, waiting for running steps
        within the wait; otherwise answers why it is not committed."""
        args = _parsed(SagaRef, arguments)
        saga = await self.owners.open(args.saga_id, caller)
        deadline = time.monotonic() + self.wait
        while True:
            rec = await self.sw.ainspect(saga.saga_id)
            if rec.status is SagaStatus.COMPLETED:
                return self._answer(self.redaction.record(rec), "Committed.")
            if rec.status not in OPEN or rec.reason or any(
                    e.phase not in (Phase.EXECUTED, Phase.INTENT, Phase.AWAITING_APPROVAL)
                    for e in rec.entries):
                return self._answer(self.redaction.record(rec), "Not committed: the saga "
                                    "failed, so its steps are undone.", error=True)
            if any(e.phase is Phase.AWAITING_APPROVAL for e in rec.entries):
                return self._answer(self.redaction.record(rec), (
                    "Not committed yet: a step waits for an operator's approval. Call "
                    "saga_commit again once saga_status shows it decided."))
            busy = [e for e in rec.entries if e.phase is Phase.INTENT]
            if busy:
                if not await self._settle(saga, busy, deadline):
                    return self._answer(await self._record(saga.saga_id), (
                        "Not committed yet: steps are still running. Call saga_commit "
                        "again later."))
                continue
            try:
                await saga.acomplete()
            except SagaworkerError as exc:  # a step failed meanwhile: the next read says so
                if time.monotonic() >= deadline:
                    return self._answer(await self._record(saga.saga_id),
                                        f"Not committed: {exc}.", error=True)
                await asyncio.sleep(0.05)
                continue
            log.info("mcp_saga_committed", saga_id=saga.saga_id, principal=caller)

    async def _settle(self, saga: Saga, busy: list[Any], deadline: float) -> bool:
        """Wait for the running steps' outcomes within the wait; False when time ran out."""
        for e in busy:
            step = Step(self.sw.rt, saga.saga_id, e.seq, e.task_id or "", e.tool_name)
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            try:
                await step.aresult(left)
            except ToolFailed:
                return True  # the saga fails with it: the next read answers that
            except TimeoutError:
                return False
        return True

    async def abort(self, ctx: Any, arguments: dict[str, Any], caller: str
                    ) -> types.CallToolResult:
        """Fails the saga, which compensates; answers its undos as far as the wait saw."""
        args = _parsed(Abort, arguments)
        saga = await self.owners.open(args.saga_id, caller)
        await offload(lambda: self.sw.abort(saga.saga_id, reason=args.reason,
                                            actor=f"mcp:{caller}"))
        with contextlib.suppress(TimeoutError):  # as far as it got: the saga goes on
            await saga.aresult(self.wait)
        return self._answer(await self._record(saga.saga_id), "Aborted.")
