"""sagaworker: compensable tool tasks on Celery."""

from __future__ import annotations

from ._base.errors import (
    ApprovalInvalid,
    ApprovalRejected,
    BadInput,
    ConfigurationError,
    FlowDiverged,
    SagaExists,
    SagaNotFound,
    SagaworkerError,
    SealedElsewhere,
    ToolFailed,
)
from ._base.jsonable import plain
from ._base.settings import Settings
from ._base.types import (
    ApprovalRequest,
    CompensationContext,
    CompensationReport,
    EntryRecord,
    Outcome,
    OutcomeResult,
    Phase,
    Reversibility,
    SagaRecord,
    SagaResult,
    SagaStatus,
)
from ._core.sagaworker import Sagaworker
from ._journal.dialect import make_engine
from ._observe.logging import configure_logging
from ._observe.records import Redaction
from ._observe.redact import REDACTED as REDACTED
from ._observe.redact import redact_call
from ._producer.saga import Saga, Step, SyncSaga
from ._worker.execution import current_idempotency_key
from ._worker.flows import FlowContext

__all__ = [
    "ApprovalInvalid",
    "ApprovalRejected",
    "ApprovalRequest",
    "BadInput",
    "CompensationContext",
    "CompensationReport",
    "ConfigurationError",
    "EntryRecord",
    "FlowContext",
    "FlowDiverged",
    "Outcome",
    "OutcomeResult",
    "Phase",
    "Redaction",
    "Reversibility",
    "Saga",
    "SagaExists",
    "SagaNotFound",
    "SagaRecord",
    "SagaResult",
    "SagaStatus",
    "Sagaworker",
    "SagaworkerError",
    "SealedElsewhere",
    "Settings",
    "Step",
    "SyncSaga",
    "ToolFailed",
    "configure_logging",
    "current_idempotency_key",
    "make_engine",
    "plain",
    "redact_call",
]
__version__ = "0.1.0"
