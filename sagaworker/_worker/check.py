"""Before a deploy: which sagas in flight would the flows of this code diverge on?

Every flow saga in flight (RUNNING or AWAITING_APPROVAL, not failing) is replayed against
its journal with the flows this process registered (the code about to ship), as a worker
would, but read-only: no tool runs, nothing is published, no row is written, so it works
on a read replica. The journal is read in pages (sagas by id, their entries in one query),
so ten thousand sagas cost a few dozen queries.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import asdict, dataclass
from typing import Any

from sqlalchemy import select

from .._base.errors import FlowDiverged, SagaworkerError
from .._base.patches import PatchMarker
from .._base.types import OPEN_VALUES
from .._journal.raw_rows import why_unreadable
from .._journal.schema import entries, sagas
from .replay import FlowSpec, Replay, replay

#: ``sw`` below is a Sagaworker (a floor above this one: not imported here)
Sagaworker = Any

__all__ = ["Finding", "check_flows", "check_one", "replay_saga"]

_PAGE = 500


@dataclass(frozen=True)
class Finding:
    """A saga the code would not carry on: ``kind`` is ``diverged`` (``seq``,
    ``journaled``, ``asked``), ``raises`` (the flow raises: the saga would compensate),
    ``unknown`` (no flow of that name in this code) or ``unreadable``."""

    saga_id: str
    flow: str
    kind: str
    detail: str
    seq: int | None = None
    journaled: str | None = None
    asked: str | None = None

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    def line(self) -> str:
        where = f" at step {self.seq}" if self.seq is not None else ""
        return f"{self.saga_id}\t{self.flow}\t{self.kind}{where}\t{self.detail}"


def replay_saga(sw: Sagaworker, spec: FlowSpec, saga: Any, rows: list[Any]) -> Replay:
    """One replay, writing nothing (``replay`` only reads the registry)."""
    return replay(sw.rt, sw.producer, spec, saga, rows)


def check_one(sw: Sagaworker, saga: Any, rows: list[Any]) -> Finding | None:
    """What the flows of ``sw`` would do with this saga, if it is a problem."""
    spec = sw.flows.specs.get(saga.flow)
    if spec is None:
        return Finding(saga.saga_id, saga.flow, "unknown",
                       f"this code has no flow named {saga.flow!r}: a worker would log "
                       "flow_unknown and leave the saga where it is")
    run = replay_saga(sw, spec, saga, rows)
    if run.kind == "diverged":
        d = run.divergence
        return Finding(saga.saga_id, saga.flow, "diverged", run.detail,
                       seq=d.seq if d else None, journaled=d.journaled if d else None,
                       asked=d.asked if d else None)
    if run.kind == "raised" and not run.ctx.from_journal(run.error):
        return Finding(saga.saga_id, saga.flow, "raises",
                       f"the flow raises {type(run.error).__name__}: {run.error}; its saga "
                       "would fail and compensate")
    return None


def check_flows(sw: Sagaworker, flow: str | None = None) -> Iterator[Finding | int]:
    """Every flow saga in flight, checked; yields each finding, then how many were
    checked. Read from the journal's reader (a replica where one is configured). A saga
    whose row cannot be read (another key, a damaged value) is an ``unreadable`` finding,
    never the end of the check."""
    after, checked = "", 0
    while True:
        q = (select(sagas.c.saga_id).where(sagas.c.flow.is_not(None),
                                           sagas.c.status.in_(OPEN_VALUES),
                                           sagas.c.fail_requested_at.is_(None),
                                           sagas.c.saga_id > after)
             .order_by(sagas.c.saga_id).limit(_PAGE))
        if flow is not None:
            q = q.where(sagas.c.flow == flow)
        with sw.journal.reader.connect() as conn:
            ids = list(conn.execute(q).scalars())
        if not ids:
            break
        for saga_id, got in _page(sw, ids):
            checked += 1
            if isinstance(got, BaseException):
                yield Finding(saga_id, _flow_of(sw, saga_id), "unreadable", why_unreadable(got))
                continue
            found = check_one(sw, *got)
            if found is not None:
                yield found
        after = ids[-1]
    yield checked


def _page(sw: Sagaworker, ids: list[str]) -> Iterator[tuple[str, Any]]:
    """Each saga of ``ids`` with its entries: one read for the page; read one by one
    (each error apart) when the page holds a row that cannot be read."""
    try:
        with sw.journal.reader.connect() as conn:
            page = conn.execute(select(sagas).where(sagas.c.saga_id.in_(ids))
                                .order_by(sagas.c.saga_id)).all()
            found: dict[str, list[Any]] = {s.saga_id: [] for s in page}
            for r in conn.execute(select(entries).where(entries.c.saga_id.in_(ids))
                                  .order_by(entries.c.saga_id, entries.c.seq)):
                found[r.saga_id].append(r)
    except (SagaworkerError, ValueError, TypeError):
        for saga_id in ids:
            try:
                saga, rows = sw.journal.saga_and_entries(saga_id)
            except (SagaworkerError, ValueError, TypeError) as exc:
                yield saga_id, exc
                continue
            if saga is not None:
                yield saga_id, (saga, rows)
        return
    for saga in page:
        yield saga.saga_id, (saga, found[saga.saga_id])


def _flow_of(sw: Sagaworker, saga_id: str) -> str:
    with sw.journal.reader.connect() as conn:
        return str(conn.execute(select(sagas.c.flow).where(sagas.c.saga_id == saga_id))
                   .scalar() or "?")


def diverged_error(f: Finding) -> FlowDiverged:
    return FlowDiverged(f.detail, saga_id=f.saga_id, flow=f.flow, seq=f.seq or 0,
                        journaled=f.journaled or "", asked=f.asked or "")


def new_names(sw: Sagaworker, new: list[Any]) -> str:
    """What a replay asked to journal next, as people read it."""
    return ", ".join(t.tool_name if isinstance(t, PatchMarker) else sw.producer.resolve(t).name
                     for t, _, _ in new)
