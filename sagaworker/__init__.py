"""sagaworker: compensable tool tasks on Celery."""

from __future__ import annotations

from ._core import Sagaworker
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
from ._logging import configure_logging
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
    "Outcome",
    "OutcomeResult",
    "Phase",
    "Reversibility",
    "SagaExists",
    "SagaNotFound",
    "SagaRecord",
    "SagaResult",
    "SagaStatus",
    "Sagaworker",
    "SagaworkerError",
    "Settings",
    "ToolFailed",
    "configure_logging",
    "current_idempotency_key",
]
__version__ = "0.1.0"
