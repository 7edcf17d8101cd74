"""The MCP tasks extension (``io.modelcontextprotocol/tasks``), served from the journal.

A client that declared the extension on a call (2026-07-28: each request's ``_meta`` names
the client's capabilities, extensions included) gets a task where the call would answer
``PENDING_APPROVAL`` or ``RUNNING``: the call answers at once with the task's handle (a
``CreateTaskResult``: ``resultType: "task"``, ``taskId``, ``status: "working"``), and the
client polls. The task's state is the journal's, read afresh on each request:

- ``tasks/get {taskId}``: ``working`` while the step runs or waits at its gate, the
  ``statusMessage`` saying which (a gate is not ``input_required``, which asks the client
  for input to send with ``tasks/update``: nothing a client sends decides a gate, an
  operator does, with a signed token); ``completed`` once the step has its outcome, with
  ``result`` the call's result as an immediate answer gives it (EXECUTED; or FAILED,
  ``isError``, once its saga has undone what ran, so the result is final); ``cancelled``
  once ``tasks/cancel`` aborted the saga.
- ``tasks/cancel {taskId}``: aborts the saga, which compensates; a gate is closed with it,
  not rejected. A task whose step already has its outcome stays as it is. Empty result.
- ``tasks/update``: acknowledged; these tasks never ask for input.

Everything else answers as before: a client that did not declare the extension, a
2025-11-25 session (the extension cannot be declared there), a step with an outcome within
the wait.

**Task ids are persisted nowhere.** An id is ``base64url(saga_id).seq.created_ms.mac``, the
mac an HMAC (keyed from the approval secret, the one every process of the app holds) over
the caller's principal and the rest. Any server process reads the task from its id and the
journal (a restarted one, another replica), and an id cannot be forged or guessed. To
another principal the mac does not verify (nor does the saga's journaled principal
match): its id is "not found", the answer an id that never was gets.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Final

import mcp_types as types
from mcp.server.lowlevel import Server
from mcp.shared.exceptions import MCPError
from mcp.shared.inbound import MCP_NAME_HEADER, decode_header_value
from mcp_types.version import MODERN_PROTOCOL_VERSIONS
from pydantic import Field

from .._base.errors import SagaworkerError
from .._base.types import EntryRecord, Phase, SagaRecord, SagaStatus
from .._observe.logging import get_logger
from .._observe.records import Redaction
from .._producer.aio import offload
from .._producer.signer import split_secrets
from . import outcomes
from .access import Owners
from .catalogue import Catalogue

__all__ = ["TASKS", "TaskIds", "TaskRef", "Tasks", "declared"]

#: the extension's identifier, as clients declare it and servers advertise it
TASKS: Final = "io.modelcontextprotocol/tasks"
#: suggested polls: a gate waits for a person, a running step for a worker
GATE_POLL_MS, RUNNING_POLL_MS = 5000, 1000
_UNDOING = (SagaStatus.RUNNING, SagaStatus.AWAITING_APPROVAL, SagaStatus.COMPENSATING)
log = get_logger()


def declared(ctx: Any) -> bool:
    """Whether the request declares the tasks extension (2026-07-28 only: a 2025-11-25
    session cannot declare extensions, nor take a task as a call's answer)."""
    if getattr(ctx, "protocol_version", None) not in MODERN_PROTOCOL_VERSIONS:
        return False
    params = getattr(ctx, "params", None)
    meta = params.get("_meta") if isinstance(params, Mapping) else None
    caps = meta.get(types.CLIENT_CAPABILITIES_META_KEY) if isinstance(meta, Mapping) else None
    extensions = caps.get("extensions") if isinstance(caps, Mapping) else None
    return isinstance(extensions, Mapping) and isinstance(extensions.get(TASKS), Mapping)


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def _iso(ms: int) -> str:
    return datetime.fromtimestamp(ms / 1000, UTC).isoformat()


@dataclass(frozen=True)
class TaskRef:
    """What a task id names: a step of a saga, and when the task began."""

    saga_id: str
    seq: int
    created_ms: int


class TaskIds:
    """Task ids bound to a principal by an HMAC: the first secret makes them, every one
    reads them (``SAGAWORKER_APPROVAL_SECRET`` may list several while one is rotated)."""

    def __init__(self, secrets: list[str]) -> None:
        self._keys = [hmac.new(s.encode(), b"sagaworker mcp task id", hashlib.sha256).digest()
                      for s in secrets]

    @staticmethod
    def _mac(key: bytes, principal: str, body: str) -> str:
        signed = f"{principal}\x00{body}".encode()
        return _b64(hmac.new(key, signed, hashlib.sha256).digest()[:16])

    def mint(self, principal: str, ref: TaskRef) -> str:
        body = f"{_b64(ref.saga_id.encode())}.{ref.seq}.{ref.created_ms}"
        return f"{body}.{self._mac(self._keys[0], principal, body)}"

    def read(self, task_id: str, principal: str) -> TaskRef | None:
        """The task ``principal``'s id names, or None (malformed, forged, another's)."""
        parts = task_id.split(".")
        if len(task_id) > 1000 or len(parts) != 4:
            return None
        body, mac = ".".join(parts[:3]), parts[3]
        if not any(hmac.compare_digest(mac.encode(), self._mac(k, principal, body).encode())
                   for k in self._keys):
            return None
        try:
            saga_id = base64.urlsafe_b64decode(parts[0] + "=" * (-len(parts[0]) % 4)).decode()
            return TaskRef(saga_id, int(parts[1]), int(parts[2]))
        except (ValueError, binascii.Error):  # (only an id this secret made gets here)
            return None


class TaskParams(types.RequestParams):
    """``tasks/get``, ``tasks/cancel``: the task named."""

    task_id: str = Field(alias="taskId", min_length=1, max_length=1000)


class UpdateParams(TaskParams):
    """``tasks/update``: the task named and the client's answers (these tasks ask none)."""

    input_responses: dict[str, Any] = Field(default_factory=dict, alias="inputResponses")


@dataclass(frozen=True)
class State:
    """A task as the journal has it: its status, what it says, and its result if done."""

    status: str
    message: str | None = None
    result: types.CallToolResult | None = None
    poll_ms: int | None = None


def gate_text(saga_id: str, seq: int, tool: str) -> str:
    return (f"{tool} has NOT run: step {seq} of saga {saga_id} waits at its approval gate "
            "(PENDING_APPROVAL). An operator decides, with a signed approval outside this "
            "conversation; neither you nor the user can approve it here. This task completes "
            "with its outcome once it is decided.")


def running_text(saga_id: str, seq: int, tool: str) -> str:
    return (f"{tool} was handed to the workers (step {seq} of saga {saga_id}) and has no "
            "outcome yet (RUNNING). This task completes with its outcome.")


def cancel_text(seq: int, tool: str) -> str:
    """The abort's reason when ``tasks/cancel`` aborts a saga: it names the task's step."""
    return f"the client cancelled the task of step {seq} ({tool}): tasks/cancel"


class Tasks:
    """The tasks one server serves: made by :class:`~.calls.ToolCalls`, read here."""

    def __init__(self, sw: Any, catalogue: Catalogue, owners: Owners, ids: TaskIds) -> None:
        self.sw, self.catalogue, self.owners, self.ids = sw, catalogue, owners, ids
        self.redaction = Redaction.of(sw)
        days = sw.settings.retention_days  # a saga is pruned from the journal after it
        self.ttl_ms = None if days is None else days * 86_400_000
        self.caller: Callable[[], str] = lambda: "stdio"

    @classmethod
    def of(cls, sw: Any, catalogue: Catalogue, owners: Owners) -> Tasks | None:
        """The tasks of a server whose app has a usable approval secret (it keys the task
        ids), else None: calls then answer as without the extension."""
        secret = sw.settings.approval_secret
        if secret is None or sw.settings.approval_secret_problem is not None:
            return None
        return cls(sw, catalogue, owners, TaskIds(split_secrets(secret.get_secret_value())))

    def install(self, server: Server[Any], caller: Callable[[], str]) -> None:
        """Advertise the extension and serve its methods on ``server``."""
        self.caller = caller
        server.extensions[TASKS] = {}
        server.add_request_handler("tasks/get", TaskParams, self.get)
        server.add_request_handler("tasks/cancel", TaskParams, self.cancel)
        server.add_request_handler("tasks/update", UpdateParams, self.update)

    def created(self, caller: str, saga_id: str, seq: int, tool: str, *, gate: bool
                ) -> dict[str, Any]:
        """The call's answer as a task: its handle, ``working``."""
        ref = TaskRef(saga_id, seq, int(time.time() * 1000))
        task_id = self.ids.mint(caller, ref)
        state = (State("working", gate_text(saga_id, seq, tool), poll_ms=GATE_POLL_MS) if gate
                 else State("working", running_text(saga_id, seq, tool),
                            poll_ms=RUNNING_POLL_MS))
        log.info("mcp_task_created", saga_id=saga_id, seq=seq, principal=caller,
                 gate=gate)
        return {"resultType": "task", **self._task(task_id, ref, state, None)}

    async def get(self, ctx: Any, params: TaskParams) -> dict[str, Any]:
        caller = self._check(ctx, params.task_id)
        ref, rec, entry = await self._find(params.task_id, caller)
        state = self.state(rec, entry, caller)
        out = {"resultType": "complete", **self._task(params.task_id, ref, state, rec)}
        if state.result is not None:
            out["result"] = state.result.model_dump(by_alias=True, mode="json",
                                                    exclude_none=True)
        return out

    async def cancel(self, ctx: Any, params: TaskParams) -> dict[str, Any]:
        """Aborts the saga (it compensates) unless the step has its outcome already or
        the saga is failing anyway: then the task stays as it is."""
        caller = self._check(ctx, params.task_id)
        ref, rec, entry = await self._find(params.task_id, caller)
        if self.state(rec, entry, caller).status == "working" and not outcomes.failing(rec):
            reason = cancel_text(ref.seq, self.catalogue.label(entry.tool_name))
            try:
                await offload(lambda: self.sw.abort(ref.saga_id, reason=reason,
                                                    actor=f"mcp:{caller}"))
            except SagaworkerError as exc:  # closed meanwhile: tasks/get tells how it ended
                log.info("mcp_task_cancel_moot", saga_id=ref.saga_id, seq=ref.seq,
                         error=type(exc).__name__)
            else:
                log.info("mcp_task_cancelled", saga_id=ref.saga_id, seq=ref.seq,
                         principal=caller)
        return {}

    async def update(self, ctx: Any, params: UpdateParams) -> dict[str, Any]:
        """Acknowledged, changing nothing: these tasks ask for no input (the extension
        ignores answers to requests a task has not made)."""
        await self._find(params.task_id, self._check(ctx, params.task_id))
        return {}

    def _check(self, ctx: Any, task_id: str) -> str:
        """The caller of a tasks/* request, once it passes the extension's checks."""
        if getattr(ctx, "protocol_version", None) not in MODERN_PROTOCOL_VERSIONS:
            raise MCPError(code=types.METHOD_NOT_FOUND, message="Method not found")
        if not declared(ctx):
            raise MCPError(
                code=types.MISSING_REQUIRED_CLIENT_CAPABILITY,
                message=f"this request needs the tasks extension ({TASKS}); the client did "
                        "not declare it for this request",
                data={"requiredCapabilities": {"extensions": {TASKS: {}}}})
        headers = getattr(getattr(ctx, "request", None), "headers", None)
        named = None if headers is None else headers.get(MCP_NAME_HEADER)
        if named is not None and decode_header_value(named) != task_id:
            raise MCPError(code=types.HEADER_MISMATCH, message=(
                f"{MCP_NAME_HEADER} header does not match the request body's 'taskId'"))
        return self.caller()

    async def _find(self, task_id: str, caller: str
                    ) -> tuple[TaskRef, SagaRecord, EntryRecord]:
        """The caller's task, its saga and its step, as the journal has them (redacted);
        an id that is not the caller's is told as one that never was."""
        ref = self.ids.read(task_id, caller)
        if ref is not None:
            try:
                await self.owners.open(ref.saga_id, caller)
                rec = self.redaction.record(await self.sw.ainspect(ref.saga_id))
            except SagaworkerError:  # another's saga, or pruned from the journal
                rec = None
            entry = None if rec is None else next(
                (e for e in rec.entries if e.seq == ref.seq), None)
            if rec is not None and entry is not None:
                return ref, rec, entry
        raise MCPError(code=types.INVALID_PARAMS, message=f"Task {task_id} not found")

    def state(self, rec: SagaRecord, entry: EntryRecord, caller: str) -> State:
        """The task of step ``entry`` from the journal. A cancellation wins (as the
        extension has it); an outcome completes the task with the call's answer; a failure
        completes it once the saga has undone what ran (its result final)."""
        tool, seq = self.catalogue.label(entry.tool_name), entry.seq
        if rec.reason == f"aborted by mcp:{caller}: {cancel_text(seq, tool)}":
            ran = ("it ran, and is undone with them" if entry.phase is Phase.EXECUTED
                   else "it never ran")
            return State("cancelled", (
                f"Cancelled: saga {rec.saga_id} was aborted (tasks/cancel) and undoes every "
                f"step that ran, latest first: {outcomes.undone(rec, self.catalogue.label)}. "
                f"{tool} (step {seq}): {ran}."))
        if entry.phase is Phase.EXECUTED:
            return State("completed", result=outcomes.executed(rec.saga_id, seq, tool,
                                                               entry.result))
        if entry.phase in (Phase.FAILED, Phase.REJECTED, Phase.CANCELLED) or (
                outcomes.failing(rec)):
            if entry.phase is Phase.INTENT or rec.status in _UNDOING:
                what = {Phase.INTENT: "is still running", Phase.FAILED: "failed",
                        Phase.REJECTED: "was rejected"}.get(entry.phase, "did not run")
                return State("working", (
                    f"Saga {rec.saga_id} failed: {tool} (step {seq}) {what}, and the saga "
                    "undoes the steps that ran. This task completes once they are undone."),
                    poll_ms=RUNNING_POLL_MS)
            return State("completed", result=outcomes.failed(rec, seq, self.catalogue.label))
        if entry.phase is Phase.AWAITING_APPROVAL:
            return State("working", gate_text(rec.saga_id, seq, tool), poll_ms=GATE_POLL_MS)
        return State("working", running_text(rec.saga_id, seq, tool), poll_ms=RUNNING_POLL_MS)

    def _task(self, task_id: str, ref: TaskRef, state: State, rec: SagaRecord | None
              ) -> dict[str, Any]:
        """The task's fields as the extension names them (``ttlMs`` null: kept as long as
        the journal keeps its saga)."""
        updated = ref.created_ms if rec is None else max(
            ref.created_ms, int(rec.updated_at.timestamp() * 1000))
        out: dict[str, Any] = {"taskId": task_id, "status": state.status,
                               "createdAt": _iso(ref.created_ms),
                               "lastUpdatedAt": _iso(updated), "ttlMs": self.ttl_ms}
        if state.message is not None:
            out["statusMessage"] = state.message
        if state.poll_ms is not None:
            out["pollIntervalMs"] = state.poll_ms
        return out
