"""JSON shapes of sagaworker's records: enums by value, datetimes ISO-8601, reports with
``dirty``."""

from __future__ import annotations

from typing import Any

from sagaworker import ApprovalRequest, Redaction, SagaRecord, plain

from .queries import waiting_step

__all__ = ["approval_json", "plain", "saga_json"]


def saga_json(rec: SagaRecord, redaction: Redaction | None = None) -> dict[str, Any]:
    """The saga as JSON, its redacted arguments (SAGAWORKER_REDACT) never shown."""
    rec = (redaction or Redaction.current()).record(rec)
    d: dict[str, Any] = plain(rec)
    d["terminal"] = rec.status.terminal
    d["dirty"] = bool(rec.report.dirty)
    step = waiting_step(rec)
    # the step the saga waits on (a flow's next step, a gate), as `sagaworker show --json`
    d["waiting_on"] = None if step is None else {
        "seq": step.seq, "tool_name": step.tool_name, "phase": step.phase.value}
    return d


def approval_json(req: ApprovalRequest, redaction: Redaction | None = None) -> dict[str, Any]:
    req = (redaction or Redaction.current()).approval(req)
    d: dict[str, Any] = plain(req)
    return d
