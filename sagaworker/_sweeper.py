"""The sweeper: finds from the journal what a lost message left behind and sends it again.

Run by Celery beat (``sagaworker.sweep``) and by every worker on a timer. Re-sending is
always safe: every handler is a compare-and-set against the journal.
"""

from __future__ import annotations

from datetime import timedelta
from typing import TYPE_CHECKING

import structlog
from sqlalchemy import func, select, update

from ._dialect import aware
from ._journal import _entry, now
from ._logging import get_logger
from ._schema import entries, sagas
from ._types import OPEN, EntryRecord, Phase, SagaStatus

if TYPE_CHECKING:
    from ._core import Sagaworker

__all__ = ["Sweeper"]

log = get_logger()
_BATCH = 500


class Sweeper:
    def __init__(self, sw: Sagaworker) -> None:
        self.sw = sw

    def orphans(self, older_than: float) -> list[EntryRecord]:
        return [_entry(r) for r in self.sw.journal.orphans(older_than)]

    def log_orphans(self) -> int:
        rows = self.sw.journal.orphans(self.sw.settings.orphan_after)
        t = now()
        for r in rows:
            log.error("orphan_intent", saga_id=r.saga_id, seq=r.seq, tool=r.tool_name,
                      task_id=r.task_id, age_s=round((t - aware(r.created_at)).total_seconds(), 1))  # type: ignore[operator]
        return len(rows)

    def sweep(self) -> dict[str, int]:
        """One pass; returns how many of each kind of work it sent again."""
        counts = {"failures": self._failures(), "chains": self._chains(),
                  "relayed": self._relay(), "in_doubt": self._in_doubt()}
        if any(counts.values()):
            log.info("sweep", **counts)
        return counts

    def _failures(self) -> int:
        """Sagas asked to fail whose failure message never got handled."""
        cutoff = now() - timedelta(seconds=min(self.sw.settings.relay_after, 10.0))
        rows = self.sw.journal.stale(
            select(sagas.c.saga_id, sagas.c.reason)
            .where(sagas.c.status.in_([s.value for s in OPEN]),
                   sagas.c.fail_requested_at.is_not(None),
                   sagas.c.fail_requested_at < cutoff).limit(_BATCH))
        for r in rows:
            self.sw.send_failure(r.saga_id, r.reason or "saga failed")
        return len(rows)

    def _chains(self) -> int:
        """Compensation chains that stopped moving (their worker died, a message lost)."""
        cutoff = now() - timedelta(seconds=self.sw.settings.lease_seconds)
        rows = self.sw.journal.stale(
            select(sagas.c.saga_id)
            .where(sagas.c.status == SagaStatus.COMPENSATING.value,
                   func.coalesce(sagas.c.chain_touched_at, sagas.c.updated_at) < cutoff)
            .limit(_BATCH))
        for r in rows:
            with structlog.contextvars.bound_contextvars(saga_id=r.saga_id):
                log.warning("compensation_resumed")
            self.sw.send_compensate(r.saga_id)
        return len(rows)

    def _relay(self) -> int:
        """The outbox relay: INTENT journaled but never started (publish lost or refused)."""
        t = now()
        cutoff = t - timedelta(seconds=self.sw.settings.relay_after)
        eng = self.sw.journal.engine
        with eng.begin() as conn:
            # SKIP LOCKED: two sweepers on PostgreSQL never relay the same row together.
            rows = conn.execute(
                select(entries)
                .join(sagas, sagas.c.saga_id == entries.c.saga_id)
                .where(entries.c.phase == Phase.INTENT.value, entries.c.started_at.is_(None),
                       func.coalesce(entries.c.published_at, entries.c.created_at) < cutoff,
                       sagas.c.status.in_([s.value for s in OPEN]))
                .limit(_BATCH).with_for_update(skip_locked=True, of=entries)).all()
            for r in rows:
                conn.execute(update(entries).where(entries.c.saga_id == r.saga_id,
                                                   entries.c.seq == r.seq)
                             .values(published_at=t))
        for r in rows:
            log.warning("step_relayed", saga_id=r.saga_id, seq=r.seq, tool=r.tool_name,
                        task_id=r.task_id)
            self.sw.producer.publish(r.saga_id, r.seq, r.tool_name, list(r.args),
                                     dict(r.kwargs), r.task_id, r.queue)
        return len(rows)

    def _in_doubt(self) -> int:
        """Started attempts whose lease lapsed with no outcome: re-deliver to decide."""
        t = now()
        rows = self.sw.journal.stale(
            select(entries).where(entries.c.phase == Phase.INTENT.value,
                                  entries.c.lease_until.is_not(None),
                                  entries.c.lease_until < t).limit(_BATCH))
        for r in rows:
            self.sw.producer.publish(r.saga_id, r.seq, r.tool_name, list(r.args),
                                     dict(r.kwargs), r.task_id, r.queue)
        return len(rows)

