"""JSON shapes of sagaworker's records: enums by value, datetimes ISO-8601, reports with
``dirty``."""

from __future__ import annotations

from typing import Any

from sagaworker import ApprovalRequest, Redaction, plain
from sagaworker._observe.records import saga_json

__all__ = ["approval_json", "plain", "saga_json"]


def approval_json(req: ApprovalRequest, redaction: Redaction | None = None) -> dict[str, Any]:
    req = (redaction or Redaction.current()).approval(req)
    d: dict[str, Any] = plain(req)
    return d
