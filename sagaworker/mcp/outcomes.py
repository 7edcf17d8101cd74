"""Journal records as MCP results: the one place the journal is translated for a model.

A tool call answers one of four outcomes in ``structuredContent["status"]``, with text a
model reads right:

- ``EXECUTED``: the step ran; its result (redacted as everywhere);
- ``FAILED`` (``isError``): the tool failed, the saga failed with it and undoes what ran;
  the text says what was undone so far and not to retry in this saga;
- ``PENDING_APPROVAL``: the step has **not** run; an operator decides with a signed token,
  outside the conversation; check ``saga_status`` later;
- ``RUNNING``: no outcome within the wait; the step goes on; check ``saga_status``.

The last three carry their text in ``structuredContent["message"]`` too: a host that hands
the model the structured content alone (Pydantic AI does, whenever a result has one) still
tells it what was undone, or that the step has not run, and not to call it again.

A refusal (``isError``) journals nothing: the model may correct itself.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from datetime import datetime
from typing import Any

import mcp_types as types

from .._base.jsonable import plain
from .._base.types import EntryRecord, Phase, SagaRecord, SagaStatus

__all__ = ["Label", "begun", "compensations", "executed", "failed", "failing", "pending",
           "refused", "running", "saga_result", "status_of", "undone", "unknown"]

#: a journaled tool's name as the model knows it
Label = Callable[[str], str]
_FAILING = (SagaStatus.COMPENSATING, SagaStatus.COMPENSATED, SagaStatus.COMPENSATION_FAILED)
_NO_RETRY = ("Do not retry it, nor call other tools in this saga: the saga takes no more "
             "steps. To try the task again, begin a new saga (saga_begin).")


def _result(text: str, structured: dict[str, Any], *, error: bool = False,
            told: bool = False) -> types.CallToolResult:
    """The text, then the structured content as JSON; ``told``: the structured content
    holds the text as well (``message``; the JSON after the text leaves it out)."""
    data = plain(structured)
    body = json.dumps(data, default=str, ensure_ascii=False)
    return types.CallToolResult(
        content=[types.TextContent(type="text", text=f"{text}\n{body}")],
        structured_content={**data, "message": text} if told else data, is_error=error)


def refused(reason: str) -> types.CallToolResult:
    """Nothing was journaled or changed; the model may correct the call."""
    return _result(f"Refused, nothing was done: {reason}",
                   {"status": "REFUSED", "error": reason}, error=True)


def unknown(tool: str, exc: BaseException) -> types.CallToolResult:
    """The server could not finish the call (the journal unreachable, say): whether a step
    was journaled is unknown to it, and the model is told to look before calling again."""
    reason = f"the server could not finish the call ({type(exc).__name__})"
    return _result(f"{tool}: {reason}. A step may have been journaled: check saga_status "
                   "before calling it again.", {"status": "UNKNOWN", "error": reason},
                   error=True)


def begun(saga_id: str, deadline_at: datetime | None) -> types.CallToolResult:
    when = "" if deadline_at is None else (
        f" If it is not committed by {deadline_at.isoformat()}, what ran is undone.")
    return _result(f"Saga {saga_id} begun. Pass saga_id={saga_id!r} to every tool call of "
                   "this task, then saga_commit when it is done (or saga_abort to undo it)."
                   + when, {"saga_id": saga_id})


def executed(saga_id: str, seq: int, tool: str, value: Any) -> types.CallToolResult:
    return _result(f"{tool} ran (step {seq} of saga {saga_id}): EXECUTED.",
                   {"status": "EXECUTED", "saga_id": saga_id, "seq": seq, "tool": tool,
                    "result": value})


def pending(saga_id: str, seq: int, tool: str, expires_at: datetime | None
            ) -> types.CallToolResult:
    until = ("" if expires_at is None else
             f" If nobody decides by {expires_at.isoformat()} (the saga's deadline), the "
             "saga is undone.")
    return _result(
        f"{tool} has NOT run: step {seq} of saga {saga_id} waits at its approval gate "
        "(PENDING_APPROVAL). An operator decides, with a signed approval outside this "
        "conversation; neither you nor the user can approve it here. Do not call it again: "
        "check saga_status later to learn whether it ran or was rejected." + until,
        {"status": "PENDING_APPROVAL", "saga_id": saga_id, "seq": seq, "tool": tool,
         "expires_at": expires_at}, told=True)


def running(saga_id: str, seq: int, tool: str) -> types.CallToolResult:
    return _result(
        f"{tool} was handed to the workers (step {seq} of saga {saga_id}) and has no outcome "
        "yet (RUNNING). It goes on without you: do not call it again; check saga_status for "
        "its outcome.",
        {"status": "RUNNING", "saga_id": saga_id, "seq": seq, "tool": tool}, told=True)


def failed(rec: SagaRecord, seq: int, label: Label) -> types.CallToolResult:
    """Step ``seq`` FAILED (or was rejected, cancelled): what the saga undid so far."""
    entry = next(e for e in rec.entries if e.seq == seq)
    tool = label(entry.tool_name)
    error = _error_of(entry)
    undos = compensations(rec, label)
    return _result(
        f"{tool} FAILED (step {seq} of saga {rec.saga_id}): {error}. The saga failed with "
        f"it and undoes every step that ran, latest first: {_undone(undos)}. {_NO_RETRY}",
        {"status": "FAILED", "saga_id": rec.saga_id, "seq": seq, "tool": tool,
         "error": error, "saga_status": rec.status, "compensations": undos}, error=True,
        told=True)


def _error_of(e: EntryRecord) -> str:
    if e.phase is Phase.REJECTED:
        return (f"an operator ({e.rejected_by}) rejected it at its approval gate: "
                f"{e.rejection_reason or 'no reason given'}")
    if e.phase is Phase.CANCELLED:
        return "it was cancelled before it ran: its saga was already failing"
    if e.phase is Phase.AWAITING_APPROVAL:
        return "it never ran: its saga failed while it waited at its approval gate"
    return e.error or "failed"


def undone(rec: SagaRecord, label: Label) -> str:
    """What a failing saga undid so far, as a clause."""
    return _undone(compensations(rec, label))


def _undone(undos: list[dict[str, Any]]) -> str:
    if not undos:
        return "no step had run, so nothing needed undoing"
    parts = [f"{u['tool']} (step {u['seq']}) {u['phase']}" for u in undos]
    more = ("" if all(u["phase"] != "PENDING" for u in undos)
            else " (PENDING: not undone yet; saga_status shows how it ends)")
    return "; ".join(parts) + more


def failing(rec: SagaRecord) -> bool:
    """The saga was asked to fail (a failed or rejected step, an abort, a deadline)."""
    return rec.status in _FAILING or (rec.status is not SagaStatus.COMPLETED and bool(
        rec.reason)) or any(e.phase in (Phase.FAILED, Phase.REJECTED) for e in rec.entries)


def compensations(rec: SagaRecord, label: Label) -> list[dict[str, Any]]:
    """The undos of a failing saga, latest first: each EXECUTED step's outcome so far
    (COMPENSATED, SKIPPED, COMPENSATION_FAILED) or PENDING; none for a saga not failing."""
    if not failing(rec):
        return []
    ran = [e for e in rec.entries if e.phase is Phase.EXECUTED and e.tool_name]
    ran.sort(key=lambda e: (e.exec_order if e.exec_order is not None else e.seq), reverse=True)
    out = []
    for e in ran:
        item: dict[str, Any] = {"seq": e.seq, "tool": label(e.tool_name),
                                "phase": e.compensation.value if e.compensation else "PENDING"}
        if e.compensation_detail:
            item["detail"] = e.compensation_detail
        out.append(item)
    return out


def status_of(rec: SagaRecord, label: Label) -> dict[str, Any]:
    """``saga_status``'s answer: the saga, its steps and its undos."""
    steps = []
    for e in rec.entries:
        step: dict[str, Any] = {"seq": e.seq, "tool": label(e.tool_name), "phase": e.phase}
        if e.phase is Phase.EXECUTED and e.error is None:
            step["result"] = e.result
        elif e.phase in (Phase.FAILED, Phase.REJECTED, Phase.CANCELLED) or e.error:
            step["error"] = _error_of(e)
        steps.append(step)
    out: dict[str, Any] = {"saga_id": rec.saga_id, "status": rec.status, "steps": steps,
                           "compensations": compensations(rec, label)}
    if rec.reason and rec.status is not SagaStatus.COMPLETED:
        out["reason"] = rec.reason
    return out


def _status_text(rec: SagaRecord, data: dict[str, Any]) -> str:
    waiting = [s for s in data["steps"] if s["phase"] == Phase.AWAITING_APPROVAL]
    running_ = [s for s in data["steps"] if s["phase"] == Phase.INTENT]
    head = f"Saga {rec.saga_id} is {rec.status.value}"
    if rec.status is SagaStatus.COMPLETED:
        return head + ": committed, its steps' effects stand."
    if failing(rec):
        return (head + f": it failed ({rec.reason or 'no reason given'}) and undoes the steps "
                f"that ran: {_undone(data['compensations'])}. {_NO_RETRY}")
    parts = [head + "."]
    if waiting:
        parts.append("Waiting for an operator's approval (not run): " + ", ".join(
            f"{s['tool']} (step {s['seq']})" for s in waiting) + ".")
    if running_:
        parts.append("Still running: " + ", ".join(
            f"{s['tool']} (step {s['seq']})" for s in running_) + ".")
    return " ".join(parts)


def saga_result(rec: SagaRecord, label: Label, text: str | None = None, *,
                error: bool = False) -> types.CallToolResult:
    """The saga's status as a tool result (``saga_status``, ``saga_commit``,
    ``saga_abort``), with ``text`` before the status's own sentence."""
    data = status_of(rec, label)
    said = _status_text(rec, data)
    return _result(said if text is None else f"{text} {said}", data, error=error)
