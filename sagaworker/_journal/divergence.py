"""A flow held because its replay diverged from its journal: held, not compensated.

A held saga stays RUNNING (or AWAITING_APPROVAL) with nothing more journaled or run; the
saga's row says what the replay found (``divergence``) and when a replay last found it
(``diverged_at``: the sweeper replays it again every SAGAWORKER_DIVERGED_RETRY seconds).
Idempotent compare-and-sets: a second worker, a replayed COMMIT or the sweeper's retry
finding the same divergence changes only the time, and only one of them logs it.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import Connection, or_, select, update

from .._base.types import OPEN_VALUES
from .dialect import db_now
from .repository import Journal
from .schema import sagas

__all__ = ["held", "release", "resume_held"]


def _open(saga_id: str) -> list[Any]:
    return [sagas.c.saga_id == saga_id, sagas.c.status.in_(OPEN_VALUES),
            sagas.c.fail_requested_at.is_(None)]


def held(journal: Journal, saga_id: str, detail: str) -> bool:
    """Hold the flow on ``detail``; True when that is news (no divergence, or another one,
    was recorded): the caller logs ``flow_diverged`` then, and only then."""
    def body(conn: Connection) -> bool:
        news = conn.execute(update(sagas).where(
            *_open(saga_id), or_(sagas.c.divergence.is_(None), sagas.c.divergence != detail))
            .values(divergence=detail, diverged_at=db_now())).rowcount
        if not news:
            conn.execute(update(sagas).where(*_open(saga_id), sagas.c.divergence == detail)
                         .values(diverged_at=db_now()))
        return bool(news)

    def landed() -> bool | None:
        # a COMMIT whose reply was lost: if the row holds ``detail`` now, it is logged (a
        # page twice rather than never: the sweeper's next replay would find it no news)
        with journal.engine.connect() as conn:
            now_held = conn.execute(select(sagas.c.divergence)
                                    .where(sagas.c.saga_id == saga_id)).scalar()
        return True if now_held == detail else None

    return journal.write(body, landed)


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
