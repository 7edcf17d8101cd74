"""A flow held because its replay diverged from its journal: held, not compensated.

A held saga stays RUNNING (or AWAITING_APPROVAL) with nothing more journaled or run; the
saga's row says what the replay found (``divergence``) and when a replay last found it
(``diverged_at``: the sweeper replays it again every SAGAWORKER_DIVERGED_RETRY seconds).
Compare-and-sets on the saga's journal position: a replay that read less never holds a
saga another worker moved on; the sweeper's retry finding the same divergence changes
only the time.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import Connection, select, update

from .._base.types import OPEN_VALUES
from .._journal.dialect import db_now
from .._journal.repository import Journal
from .._journal.schema import sagas

__all__ = ["held", "release", "resume_held"]


def _open(saga_id: str) -> list[Any]:
    return [sagas.c.saga_id == saga_id, sagas.c.status.in_(OPEN_VALUES),
            sagas.c.fail_requested_at.is_(None)]


def held(journal: Journal, saga_id: str, detail: str, last_seq: int) -> bool:
    """Hold the flow on ``detail`` (or record that a replay found it again), if its journal
    is still the one that replay read (``last_seq``): a replay that read less never holds
    a saga another worker moved on. True if recorded."""
    def body(conn: Connection) -> bool:
        return bool(conn.execute(update(sagas).where(*_open(saga_id),
                                                     sagas.c.last_seq == last_seq)
                                 .values(divergence=detail, diverged_at=db_now())).rowcount)

    # replayed after a lost COMMIT only when nothing was written: the same values again
    return journal.write(body, lambda: True if _holds(journal, saga_id, detail) else None)


def _holds(journal: Journal, saga_id: str, detail: str) -> bool:
    with journal.engine.connect() as conn:
        return conn.execute(select(sagas.c.divergence)
                            .where(sagas.c.saga_id == saga_id)).scalar() == detail


def release(journal: Journal, saga_id: str) -> bool:
    """The flow replays again without diverging: no longer held. True if it was."""
    def body(conn: Connection) -> bool:
        return bool(conn.execute(update(sagas).where(
            sagas.c.saga_id == saga_id, sagas.c.divergence.is_not(None))
            .values(divergence=None, diverged_at=None)).rowcount)

    return journal.write(body)


def resume_held(journal: Journal, saga_id: str) -> Any:
    """The saga's row (None if there is no such saga), for ``flows resume``: its time is
    reset so the sweeper does not replay it again at once beside the resume's own."""
    with journal.engine.begin() as conn:
        conn.execute(update(sagas).where(*_open(saga_id), sagas.c.divergence.is_not(None))
                     .values(diverged_at=db_now()))
        return conn.execute(select(sagas.c.saga_id, sagas.c.status, sagas.c.flow,
                                   sagas.c.divergence, sagas.c.fail_requested_at)
                            .where(sagas.c.saga_id == saga_id)).first()
