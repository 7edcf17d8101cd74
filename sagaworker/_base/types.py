"""The public value types: enums and the records the journal hands out."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime
from enum import StrEnum
from typing import Any

__all__ = [
    "ApprovalRequest",
    "CompensationContext",
    "CompensationReport",
    "EntryRecord",
    "Outcome",
    "OutcomeResult",
    "Phase",
    "Reversibility",
    "SagaRecord",
    "SagaResult",
    "SagaStatus",
]


class Reversibility(StrEnum):
    """How a tool's effect can be taken back."""

    REVERSIBLE = "REVERSIBLE"
    COMPENSATABLE = "COMPENSATABLE"
    IRREVERSIBLE = "IRREVERSIBLE"


class Phase(StrEnum):
    """Where a journal entry (one tool step) stands."""

    INTENT = "INTENT"
    AWAITING_APPROVAL = "AWAITING_APPROVAL"
    EXECUTED = "EXECUTED"
    FAILED = "FAILED"
    REJECTED = "REJECTED"
    CANCELLED = "CANCELLED"


class SagaStatus(StrEnum):
    """Where a saga stands. COMPLETED, COMPENSATED and COMPENSATION_FAILED are terminal."""

    RUNNING = "RUNNING"
    AWAITING_APPROVAL = "AWAITING_APPROVAL"
    COMPLETED = "COMPLETED"
    COMPENSATING = "COMPENSATING"
    COMPENSATED = "COMPENSATED"
    COMPENSATION_FAILED = "COMPENSATION_FAILED"

    @property
    def terminal(self) -> bool:
        return self in TERMINAL


TERMINAL = frozenset(
    {SagaStatus.COMPLETED, SagaStatus.COMPENSATED, SagaStatus.COMPENSATION_FAILED}
)
OPEN = frozenset({SagaStatus.RUNNING, SagaStatus.AWAITING_APPROVAL})
#: the same, as the journal stores them (for SQL)
OPEN_VALUES = (SagaStatus.RUNNING.value, SagaStatus.AWAITING_APPROVAL.value)
#: the reserved keyword that carries (saga_id, seq) inside a tool message
ENVELOPE = "__sagaworker__"


class OutcomeResult(StrEnum):
    """What one undo came to."""

    COMPENSATED = "COMPENSATED"
    SKIPPED = "SKIPPED"
    COMPENSATION_FAILED = "COMPENSATION_FAILED"


@dataclass(frozen=True)
class CompensationContext:
    """What an undo is told about the step it takes back."""

    saga_id: str
    seq: int
    tool_name: str
    args: list[Any]
    kwargs: dict[str, Any]
    result: Any
    reason: str | None
    attempt: int
    idempotency_key: str


@dataclass(frozen=True)
class Outcome:
    """One journaled undo outcome."""

    seq: int
    tool_name: str
    result: OutcomeResult
    detail: str | None
    attempts: int


@dataclass(frozen=True)
class CompensationReport:
    """Outcomes in the order the undos ran, plus what is left dirty or in doubt."""

    outcomes: list[Outcome] = field(default_factory=list)
    in_doubt: list[EntryRecord] = field(default_factory=list)

    @property
    def dirty(self) -> list[Outcome]:
        return [o for o in self.outcomes if o.result is OutcomeResult.COMPENSATION_FAILED]


@dataclass(frozen=True)
class EntryRecord:
    """One journal entry: a tool step and, once compensated, its undo's outcome."""

    saga_id: str
    seq: int
    tool_name: str
    phase: Phase
    args: list[Any]
    kwargs: dict[str, Any]
    result: Any
    error: str | None
    task_id: str | None
    attempts: int
    executed_at: datetime | None
    compensation: OutcomeResult | None
    compensation_detail: str | None
    compensation_attempts: int
    in_doubt: bool
    queue: str | None = None
    idempotency_key: str = ""
    approved_by: str | None = None
    approved_at: datetime | None = None
    rejected_by: str | None = None
    rejected_at: datetime | None = None
    rejection_reason: str | None = None
    compensated_at: datetime | None = None
    exec_order: int | None = None
    #: the caller's id for the step (an agent framework's tool-call id), if it gave one
    call_id: str | None = None


@dataclass(frozen=True)
class SagaRecord:
    """A saga as the journal has it."""

    saga_id: str
    status: SagaStatus
    reason: str | None
    metadata: dict[str, Any]
    created_at: datetime
    updated_at: datetime
    entries: list[EntryRecord]
    report: CompensationReport
    flow: str | None = None
    deadline_at: datetime | None = None
    flow_args: list[Any] | None = None
    flow_kwargs: dict[str, Any] | None = None
    #: a flow held because its replay diverged from the journal (held): what it found
    diverged: str | None = None


@dataclass(frozen=True)
class SagaResult:
    """What a saga came to once terminal."""

    saga_id: str
    status: SagaStatus
    value: Any = None
    error: str | None = None
    report: CompensationReport = field(default_factory=CompensationReport)


@dataclass(frozen=True)
class ApprovalRequest:
    """A gated IRREVERSIBLE step waiting for a human decision."""

    saga_id: str
    seq: int
    tool_name: str
    args: list[Any]
    kwargs: dict[str, Any]
    requested_at: datetime
    token: str
