"""JSON shapes of sagaworker's records: enums by value, datetimes ISO-8601, reports with
``dirty``."""

from __future__ import annotations

from typing import Any

from sagaworker import ApprovalRequest, Redaction, plain
from sagaworker._journal.raw_rows import UnreadableSaga
from sagaworker._observe.records import saga_json

__all__ = ["approval_json", "plain", "saga_json", "unreadable_json"]


def approval_json(req: ApprovalRequest, redaction: Redaction | None = None) -> dict[str, Any]:
    req = (redaction or Redaction.current()).approval(req)
    d: dict[str, Any] = plain(req)
    return d


def unreadable_json(u: UnreadableSaga) -> dict[str, Any]:
    """A saga a listing could not read: its id, status, creation and why (no user data)."""
    return {"saga_id": u.saga_id, "status": u.status,
            "created_at": None if u.created_at is None else u.created_at.isoformat(),
            "error": u.error}
