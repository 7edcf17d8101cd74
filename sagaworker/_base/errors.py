"""One error hierarchy: every error sagaworker raises is a :class:`SagaworkerError`.

Messages say what to do next, not only what went wrong.
"""

from __future__ import annotations

__all__ = [
    "ApprovalInvalid",
    "ApprovalRejected",
    "BadInput",
    "ConfigurationError",
    "JournalUnavailable",
    "SagaExists",
    "SagaNotFound",
    "SagaworkerError",
    "SealedElsewhere",
    "ToolFailed",
]


class SagaworkerError(Exception):
    """Base of every sagaworker error."""


class ConfigurationError(SagaworkerError):
    """A tool, an undo or a setting is declared in a way that cannot work."""


class JournalUnavailable(ConfigurationError):
    """The journal's database cannot be reached, or its schema is missing or older than
    the code. The message names the database with every form of its password masked; a
    web app logs it and tells its clients only that the journal is unavailable."""


class ToolFailed(SagaworkerError):
    """A tool step ended FAILED (Celery gave up on it); its saga compensates."""

    def __init__(self, message: str, *, saga_id: str = "", seq: int = 0, tool: str = "") -> None:
        super().__init__(message)
        self.saga_id = saga_id
        self.seq = seq
        self.tool = tool


class ApprovalRejected(ToolFailed):
    """An approver rejected the gated step; its saga compensates."""


class FlowDiverged(SagaworkerError):
    """A flow's replay asked, at step ``seq``, for something else than its journal holds
    there (``journaled``: the journal's step; ``asked``: what the code asked for, or what
    it did instead). Raised by ``sagaworker.testing.replay``; a worker holds the saga."""

    def __init__(self, message: str, *, saga_id: str = "", flow: str = "", seq: int = 0,
                 journaled: str = "", asked: str = "") -> None:
        super().__init__(message)
        self.saga_id = saga_id
        self.flow = flow
        self.seq = seq
        self.journaled = journaled
        self.asked = asked


class SagaExists(SagaworkerError):
    """A saga with this id was already begun; pick a new id or use ``sw.get(id)``."""


class SagaNotFound(SagaworkerError):
    """No saga with this id is in the journal."""


class ApprovalInvalid(SagaworkerError):
    """An approval token is forged, expired, reused or for another step; nothing changed."""


class SealedElsewhere(SagaworkerError):
    """An encrypted journal value was found in a row or column other than the one it was
    sealed for: copied there with SQL. It is not read (not even as that row's value)."""


class BadInput(SagaworkerError, ValueError):
    """A message or a call carries input that can never succeed (not retried)."""
