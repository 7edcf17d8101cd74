"""sagaworker: compensable tool tasks on Celery."""

from __future__ import annotations

from ._core import Sagaworker
from ._dialect import make_engine
from ._errors import (
    ApprovalInvalid,
    ApprovalRejected,
    BadInput,
    ConfigurationError,
    SagaExists,
    SagaNotFound,
    SagaworkerError,
    ToolFailed,
)
from ._execution import current_idempotency_key
from ._flows import FlowContext
from ._jsonable import plain
from ._logging import configure_logging
from ._redact import REDACTED as REDACTED
from ._redact import Redaction, redact_call
from ._saga import Saga, Step, SyncSaga
from ._settings import Settings
from ._types import (
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
