"""Journal rows as the records the public API returns (``SagaRecord``, ``EntryRecord``,
``CompensationReport``), and the idempotency key each entry carries forever."""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from typing import Any

from .._base.patches import patch_id
from .._base.types import (
    OPEN,
    CompensationReport,
    EntryRecord,
    Outcome,
    OutcomeResult,
    Phase,
    SagaRecord,
    SagaStatus,
)
from .dialect import aware

__all__ = ["entry_record", "idempotency_key", "report_of", "to_saga_record"]

_NS = uuid.UUID("5a6a0000-0000-4000-8000-5a6a776f726b")

def idempotency_key(saga_id: str, seq: int, purpose: str) -> str:
    """Stable for one entry and purpose ("execute" or "compensate"), forever."""
    return str(uuid.uuid5(_NS, f"{saga_id}\x00{seq}\x00{purpose}"))


def entry_record(row: Any) -> EntryRecord:
    return EntryRecord(
        saga_id=row.saga_id, seq=row.seq, tool_name=row.tool_name, phase=Phase(row.phase),
        args=list(row.args or []), kwargs=dict(row.kwargs or {}), result=row.result,
        error=row.error, task_id=row.task_id, attempts=row.attempts,
        executed_at=aware(row.executed_at),
        compensation=OutcomeResult(row.compensation) if row.compensation else None,
        compensation_detail=row.compensation_detail,
        compensation_attempts=row.compensation_attempts, in_doubt=bool(row.in_doubt),
        queue=row.queue, idempotency_key=idempotency_key(row.saga_id, row.seq, "compensate"),
        approved_by=row.approved_by, approved_at=aware(row.approved_at),
        rejected_by=row.rejected_by, rejected_at=aware(row.rejected_at),
        rejection_reason=row.rejection_reason, compensated_at=aware(row.compensated_at),
        exec_order=row.exec_order, call_id=row.call_id,
    )


def to_saga_record(saga: Any, rows: Sequence[Any]) -> SagaRecord:
    recs = [entry_record(r) for r in rows]
    return SagaRecord(
        saga_id=saga.saga_id, status=SagaStatus(saga.status), reason=saga.reason,
        metadata=dict(saga.metadata or {}), created_at=aware(saga.created_at),  # type: ignore[arg-type]
        updated_at=aware(saga.updated_at), entries=recs,  # type: ignore[arg-type]
        report=report_of(rows, recs), flow=saga.flow, deadline_at=aware(saga.deadline_at),
        flow_args=None if saga.flow is None else list(saga.flow_args or []),
        flow_kwargs=None if saga.flow is None else dict(saga.flow_kwargs or {}),
        # held only while open and not failing (an abort or a deadline ends the hold)
        diverged=(saga.divergence if SagaStatus(saga.status) in OPEN
                  and saga.fail_requested_at is None else None),
    )


def report_of(rows: Sequence[Any], recs: Sequence[EntryRecord]) -> CompensationReport:
    done = sorted(((r.comp_order or 0, rec) for r, rec in zip(rows, recs, strict=True)
                   if rec.compensation is not None and patch_id(rec.tool_name) is None),
                  key=lambda p: p[0])  # (a patch marker has nothing undone: not listed)
    return CompensationReport(
        outcomes=[Outcome(seq=rec.seq, tool_name=rec.tool_name, result=rec.compensation,
                          detail=rec.compensation_detail, attempts=rec.compensation_attempts)
                  for _, rec in done if rec.compensation is not None],
        in_doubt=[rec for rec in recs if rec.in_doubt],
    )
