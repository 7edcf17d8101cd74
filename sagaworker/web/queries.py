"""What the web app asks the journal beyond ``sw.inspect``/``sw.sagas``: idle sagas and the
step an open saga waits on."""

from __future__ import annotations

from typing import Any

from sqlalchemy import select

from sagaworker import Phase, SagaNotFound, SagaRecord, SagaStatus
from sagaworker._journal.raw_rows import why_unreadable
from sagaworker._journal.schema import entries, sagas
from sagaworker._observe.logging import get_logger

__all__ = ["diverged_sagas", "idle_sagas"]

log = get_logger()


def idle_sagas(sw: Any, limit: int = 50) -> list[SagaRecord]:
    """RUNNING sagas of the asynchronous form the sweeper reported idle (``saga_idle``,
    SAGAWORKER_IDLE_AFTER) and nobody has moved since: their producer is gone and their
    effects are live. Oldest report first."""
    busy = select(entries.c.saga_id).where(
        entries.c.saga_id == sagas.c.saga_id,
        entries.c.phase.in_([Phase.INTENT.value, Phase.AWAITING_APPROVAL.value])
        | (entries.c.updated_at > sagas.c.idle_reported_at))
    query = (select(sagas.c.saga_id)
             .where(sagas.c.flow.is_(None), sagas.c.status == SagaStatus.RUNNING.value,
                    sagas.c.fail_requested_at.is_(None), sagas.c.idle_reported_at.is_not(None),
                    sagas.c.idle_reported_at >= sagas.c.updated_at, ~busy.exists())
             .order_by(sagas.c.idle_reported_at).limit(limit))
    return _records(sw, query)


def diverged_sagas(sw: Any, limit: int = 50) -> list[SagaRecord]:
    """Flows held because their replay diverged from the journal (held), oldest first:
    their effects are live and nothing moves them until a fixed deploy and ``flows
    resume``, an abort or their deadline."""
    query = (select(sagas.c.saga_id)
             .where(sagas.c.flow.is_not(None), sagas.c.divergence.is_not(None),
                    sagas.c.status.in_([SagaStatus.RUNNING.value,
                                        SagaStatus.AWAITING_APPROVAL.value]),
                    sagas.c.fail_requested_at.is_(None))
             .order_by(sagas.c.updated_at).limit(limit))
    return _records(sw, query)


def _records(sw: Any, query: Any) -> list[SagaRecord]:
    with sw.journal.engine.connect() as conn:
        ids = [r.saga_id for r in conn.execute(query)]
    out = []
    for saga_id in ids:
        try:
            out.append(sw.inspect(saga_id))
        except SagaNotFound:  # pruned meanwhile
            continue
        except Exception as exc:  # one saga no key opens never fails the page
            log.warning("saga_unreadable", saga_id=saga_id, error=why_unreadable(exc))
    return out

