"""A saga's deadline passed: said once (``saga_deadline_passed``, with ``deadline_at``) by
whichever found it (the sweeper, a claim, an approval), and the failure sent."""

from __future__ import annotations

from .._journal.dialect import aware
from .._observe.logging import get_logger
from .._runtime import Runtime

__all__ = ["deadline_passed"]

log = get_logger()


def deadline_passed(rt: Runtime, saga_id: str, detail: str) -> None:
    """Log the event and send the failure of a saga whose deadline this process found
    passed (its move asked the saga to fail)."""
    row = rt.journal.saga_row(saga_id)
    at = aware(row.deadline_at) if row is not None else None
    log.warning("saga_deadline_passed", saga_id=saga_id,
                deadline_at=at.isoformat() if at is not None else None, detail=detail)
    rt.bus.send_failure(saga_id, "deadline passed")
