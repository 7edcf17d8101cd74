"""Retention: ``sw.prune`` and ``sagaworker db prune`` delete finished sagas in batches.

Each batch is its own short transaction (``prune_batch``), so the journal's hot
rows are never locked for long; on SQLite, whose one writer every producer and worker
shares, the prune also leaves a gap between batches for them.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import Connection, delete, exists, select

from .._base.types import SagaStatus
from .._observe.logging import get_logger
from .dialect import db_later, single_writer
from .repository import Journal
from .schema import audit, entries, sagas

__all__ = ["DEFAULT_BATCH", "parse_age", "prune"]

_log = get_logger()

DEFAULT_BATCH = 1000
_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}
_AGE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([smhdw]?)\s*$", re.IGNORECASE)


@dataclass(frozen=True)
class PruneBatch:
    """What one prune transaction deleted: sagas, and rows of every table together."""

    sagas: int
    rows: int
    more: bool = False


def parse_age(text: str) -> float:
    """``30d``, ``12h``, ``90m``, ``45s``, ``2w`` or bare seconds, to seconds."""
    m = _AGE.match(text)
    if not m:
        raise ValueError(f"{text!r} is not an age: write a number with an optional unit, "
                         "s, m, h, d or w (30d, 12h, 90m, 3600)")
    return float(m.group(1)) * _UNITS[(m.group(2) or "s").lower()]


def prune(journal: Journal, older_than: float, *, include_dirty: bool = False,
          batch: int = DEFAULT_BATCH) -> int:
    """Delete terminal sagas finished more than ``older_than`` seconds ago; returns how many.

    Never a COMPENSATION_FAILED saga nor one with an in-doubt entry unless
    ``include_dirty`` (an operator still has to look at those).
    """
    if older_than < 0:
        raise ValueError(f"older_than must be >= 0 seconds, not {older_than}")
    if batch < 1:
        raise ValueError(f"batch must be >= 1, not {batch}")
    cutoff = db_later(-older_than)
    gap = single_writer(journal.engine)
    total_sagas = total_rows = 0
    started = time.monotonic()
    while True:
        t = time.monotonic()
        got = prune_batch(journal, cutoff, include_dirty=include_dirty, batch=batch)
        total_sagas += got.sagas
        total_rows += got.rows
        if not got.more:
            break
        if gap:  # let the writers waiting on SQLite's lock in before the next batch
            time.sleep(min(0.2, max(0.01, time.monotonic() - t)))
    elapsed = time.monotonic() - started
    _log.info("pruned", sagas=total_sagas, rows=total_rows, older_than_s=older_than,
              include_dirty=include_dirty, seconds=round(elapsed, 3))
    return total_sagas


def prune_batch(journal: Journal, cutoff: datetime | Any, *, include_dirty: bool,
            batch: int) -> PruneBatch:
    """Delete up to ``batch`` terminal sagas last changed before ``cutoff``, with their
    entries and audit rows, in one short transaction.

    Kept unless ``include_dirty``: COMPENSATION_FAILED sagas and sagas with an in-doubt
    entry. The saga rows are locked first (``FOR UPDATE SKIP LOCKED`` on PostgreSQL, so
    a saga someone is writing is left for the next run; SQLite's one writer serializes
    anyway).
    """
    done = [SagaStatus.COMPLETED.value, SagaStatus.COMPENSATED.value]
    if include_dirty:
        done.append(SagaStatus.COMPENSATION_FAILED.value)
    clean = [] if include_dirty else [~exists().where(
        entries.c.saga_id == sagas.c.saga_id, entries.c.in_doubt.is_(True))]

    def body(conn: Connection) -> PruneBatch:
        # one status at a time, oldest first: each query is a range of the index
        # (status, finished_at) read in its order and stopped at the batch's size (with
        # "status IN (...)" or an OR, PostgreSQL read and sorted every terminal saga
        # for each batch). finished_at is set by every move to a terminal status; a
        # terminal saga without one predates it (migration 0004 fills those in)
        ids: list[str] = []
        for status in done:
            for finished in (sagas.c.finished_at < cutoff, sagas.c.finished_at.is_(None)):
                if len(ids) < batch:
                    ids += conn.execute(
                        select(sagas.c.saga_id)
                        .where(sagas.c.status == status, finished,
                               sagas.c.updated_at < cutoff, *clean)
                        .order_by(sagas.c.finished_at).limit(batch - len(ids))
                        .with_for_update(skip_locked=True)).scalars()
        if not ids:
            return PruneBatch(0, 0)
        # the saga rows are locked (every transition locks its saga row first), so
        # none of them changes before this commits
        n_audit = conn.execute(delete(audit).where(audit.c.saga_id.in_(ids))).rowcount
        n_entries = conn.execute(delete(entries).where(entries.c.saga_id.in_(ids))).rowcount
        n_sagas = conn.execute(delete(sagas).where(sagas.c.saga_id.in_(ids))).rowcount
        return PruneBatch(n_sagas, n_sagas + n_entries + n_audit, more=len(ids) == batch)

    return journal.write(body)
