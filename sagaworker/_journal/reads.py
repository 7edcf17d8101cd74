"""The journal's reads: a saga, its entries, lists for the dashboard and the sweeper, the
one read behind every waiting ``aresult``."""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

from sqlalchemy import bindparam, or_, select, tuple_

from .._base.canonical import unstorable
from .._base.errors import BadInput, SagaNotFound
from .._base.types import TERMINAL, Phase, SagaRecord, SagaStatus
from .._observe.logging import get_logger
from .dialect import aware, db_later
from .raw_rows import UnreadableSaga, opened, raw_select, why_unreadable
from .rows import to_saga_record
from .schema import entries, sagas

if TYPE_CHECKING:
    from sqlalchemy import Engine

__all__ = ["Claiming", "JournalReads", "NewEntry", "lookup_id"]

_log = get_logger()


@dataclass
class Claiming:
    """An eager step's claim, taken by the statement that journals its INTENT where the
    journal can (PostgreSQL): ``done`` says it was; ``at``: no later than it was taken
    (the monotonic clock), for a run that starts long after to check its lease first."""

    token: str
    worker: str
    lease: float
    done: bool = False
    at: float = field(default_factory=time.monotonic)


@dataclass(frozen=True)
class NewEntry:
    tool_name: str
    args: list[Any]
    kwargs: dict[str, Any]
    args_digest: str
    queue: str | None
    task_id: str
    gated: bool
    approval_nonce: str | None = None
    call_id: str | None = None  # the caller's id for it (an agent's tool-call id)
    trace_context: str | None = None  # its enqueue span's (tracing), journaled with it
    #: not published: the worker that journaled it runs it itself (an eager flow step)
    held: bool = False
    #: a flow's patch marker (``FlowContext.patched``): journaled EXECUTED, undo SKIPPED, no message
    marker: bool = False
    claim: Claiming | None = field(default=None, compare=False, hash=False)


#: a saga and its entries, one statement (built once: SQLAlchemy's cache key of a
#: statement this wide costs more than the read)
_JOINED = (select(*[c.label(f"saga_{c.name}") for c in sagas.c], *entries.c)
           .select_from(sagas.outerjoin(entries, entries.c.saga_id == sagas.c.saga_id))
           .where(sagas.c.saga_id == bindparam("saga_id")).order_by(entries.c.seq))


_ENTRY = select(entries).where(entries.c.saga_id == bindparam("saga_id"),
                               entries.c.seq == bindparam("seq"))

#: how many later outcomes one ``entry_and_outcomes`` read brings at most
NEAR = 64
#: a step's entry and the saga's entries from it on that have an outcome
_NEAR = (select(entries).where(
    entries.c.saga_id == bindparam("saga_id"), entries.c.seq >= bindparam("seq"),
    or_(entries.c.seq == bindparam("seq"),
        entries.c.phase.not_in([Phase.INTENT.value, Phase.AWAITING_APPROVAL.value])))
    .order_by(entries.c.seq).limit(NEAR))


#: the entries waited on, as stored (``settled``; built once, as ``_JOINED``)
_WAITED = raw_select(entries).where(
    tuple_(entries.c.saga_id, entries.c.seq).in_(bindparam("keys", expanding=True)))


class JournalReads:
    """Part of ``Journal``: its reads."""

    reader: Engine

    def saga_row(self, saga_id: str) -> Any:
        lookup_id(saga_id)
        with self.reader.connect() as conn:
            return conn.execute(select(sagas).where(sagas.c.saga_id == saga_id)).first()

    def saga_and_entries(self, saga_id: str) -> tuple[Any, list[Any]]:
        """One read: the saga row and its entries in seq order (on PostgreSQL one
        statement in autocommit: one snapshot, one round trip)."""
        if self.reader.dialect.name == "postgresql":
            return self._saga_and_entries_joined(saga_id)
        with self.reader.connect() as conn:
            saga = conn.execute(select(sagas).where(sagas.c.saga_id == saga_id)).first()
            if saga is None:
                return None, []
            return saga, list(conn.execute(select(entries).where(entries.c.saga_id == saga_id)
                                           .order_by(entries.c.seq)).all())

    def _saga_and_entries_joined(self, saga_id: str) -> tuple[Any, list[Any]]:
        with self.reader.connect() as conn:
            conn.execution_options(isolation_level="AUTOCOMMIT")
            rows = conn.execute(_JOINED, {"saga_id": saga_id}).all()
        if not rows:
            return None, []
        first = rows[0]._mapping
        saga = SimpleNamespace(**{c.name: first[f"saga_{c.name}"] for c in sagas.c})
        return saga, [r for r in rows if r.seq is not None]

    def entry_row(self, saga_id: str, seq: int) -> Any:
        """One entry (one statement: autocommit on PostgreSQL, one round trip)."""
        with self.reader.connect() as conn:
            if self.reader.dialect.name == "postgresql":
                conn.execution_options(isolation_level="AUTOCOMMIT")
            return conn.execute(_ENTRY, {"saga_id": saga_id, "seq": seq}).first()

    def entry_and_outcomes(self, saga_id: str, seq: int) -> tuple[Any, list[Any]]:
        """Entry ``seq`` (None when there is none) and the entries of the same saga from it
        on that have an outcome (at most ``NEAR``), in one statement: an outcome is final,
        so a producer that waits on its steps in turn reads once per saga, not per step."""
        with self.reader.connect() as conn:
            if self.reader.dialect.name == "postgresql":
                conn.execution_options(isolation_level="AUTOCOMMIT")
            rows = conn.execute(_NEAR, {"saga_id": saga_id, "seq": seq}).all()
        return (rows[0] if rows and rows[0].seq == seq else None), list(rows)

    def inspect(self, saga_id: str) -> SagaRecord:
        lookup_id(saga_id)
        with self.reader.connect() as conn:
            saga = conn.execute(select(sagas).where(sagas.c.saga_id == saga_id)).first()
            if saga is None:
                raise SagaNotFound(f"no saga {saga_id!r} in the journal; check the id "
                                   "(sw.sagas() lists recent ones)")
            rows = conn.execute(select(entries).where(entries.c.saga_id == saga_id)
                                .order_by(entries.c.seq)).all()
        return to_saga_record(saga, rows)

    def list_sagas(self, status: SagaStatus | str | None, limit: int) -> list[SagaRecord]:
        return self.scan_sagas(status, limit)[0]

    def scan_sagas(self, status: SagaStatus | str | None, limit: int
                   ) -> tuple[list[SagaRecord], list[UnreadableSaga]]:
        """The newest sagas as records, and those it could not read (logged
        ``saga_unreadable``): one saga no key opens never fails the listing."""
        with self.reader.connect() as conn:
            q = raw_select(sagas).order_by(sagas.c.created_at.desc(), sagas.c.saga_id.desc())
            if status is not None:
                q = q.where(sagas.c.status == _status(status).value)
            rows = conn.execute(q.limit(limit)).all()
            ids = [r.saga_id for r in rows]
            ents = conn.execute(raw_select(entries).where(entries.c.saga_id.in_(ids))
                                .order_by(entries.c.saga_id, entries.c.seq)).all() if ids else []
        by: dict[str, list[Any]] = {}
        for e in ents:
            by.setdefault(e.saga_id, []).append(e)
        dialect = self.reader.dialect
        records: list[SagaRecord] = []
        unreadable: list[UnreadableSaga] = []
        for r in rows:
            try:
                records.append(to_saga_record(
                    opened(r, sagas, dialect),
                    [opened(e, entries, dialect) for e in by.get(r.saga_id, [])]))
            except Exception as exc:  # whatever the row holds, the others are listed
                why = why_unreadable(exc)
                _log.warning("saga_unreadable", saga_id=r.saga_id, status=r.status, error=why)
                unreadable.append(UnreadableSaga(r.saga_id, r.status, aware(r.created_at),
                                                 why))
        return records, unreadable

    def orphans(self, older_than: float) -> list[Any]:
        """INTENT rows older than ``older_than`` s, user data as stored (``raw_rows``)."""
        cutoff = db_later(-older_than)
        with self.reader.connect() as conn:
            return list(conn.execute(
                raw_select(entries).where(entries.c.phase == Phase.INTENT.value,
                                          entries.c.created_at < cutoff)
                .order_by(entries.c.created_at)).all())

    def stale(self, query: Any) -> list[Any]:
        with self.reader.connect() as conn:
            return list(conn.execute(query).all())



    def call_row(self, saga_id: str, call_id: str) -> Any:
        with self.reader.connect() as conn:
            return conn.execute(select(entries).where(entries.c.saga_id == saga_id,
                                                      entries.c.call_id == call_id)).first()

    def settled(self, steps: Sequence[tuple[str, int]], saga_ids: Sequence[str]
                ) -> tuple[dict[tuple[str, int], Any], set[str]]:
        """Of these steps, the entry rows of those with an outcome (None for a step not
        in the journal: pruned, or never there; the exception opening it raised, for a row
        no key opens); of these sagas, the terminal ones (or gone): one read for every
        waiting ``aresult`` of a process. It reads the steps waited on, not every entry of
        their sagas (a long saga's wait costs what a short one's does), as stored, and
        opens each row with an outcome on its own: the row is that wait's answer, and
        one that cannot be opened is that wait's error alone."""
        done_steps: dict[tuple[str, int], Any] = {}
        done_sagas: set[str] = set()
        waiting = (Phase.INTENT.value, Phase.AWAITING_APPROVAL.value)
        with self.reader.connect() as conn:
            if self.reader.dialect.name == "postgresql":  # (no BEGIN, no ROLLBACK)
                conn.execution_options(isolation_level="AUTOCOMMIT")
            wanted = set(steps)
            for chunk in _chunks(sorted(wanted), 500):
                read = {(r.saga_id, r.seq): r for r in conn.execute(
                    _WAITED, {"keys": list(chunk)}).all()}
                for key in chunk:
                    raw = read.get(key)
                    if raw is None or raw.phase not in waiting:
                        done_steps[key] = None if raw is None else _opened(raw, conn.dialect)
            for ids in _chunks(sorted(set(saga_ids)), 500):
                found = {r.saga_id: r.status for r in conn.execute(
                    select(sagas.c.saga_id, sagas.c.status).where(sagas.c.saga_id.in_(ids)))}
                done_sagas.update(s for s in ids
                                  if s not in found or SagaStatus(found[s]) in TERMINAL)
        return done_steps, done_sagas


def _opened(raw: Any, dialect: Any) -> Any:
    """A waited entry opened, or the exception opening it raised (its wait's answer)."""
    try:
        return opened(raw, entries, dialect)
    except Exception as exc:  # a value sealed elsewhere, a key missing: this wait's error
        return exc


def _chunks(items: Sequence[Any], size: int) -> Iterator[Sequence[Any]]:
    for i in range(0, len(items), size):
        yield items[i:i + size]


def lookup_id(saga_id: Any) -> None:
    """A saga id looked up: BadInput naming it when no saga can have it (the database
    would answer a NUL or a lone surrogate with a raw error)."""
    if not isinstance(saga_id, str):
        raise BadInput(f"saga id {saga_id!r} is a {type(saga_id).__name__}: a saga id is a "
                       "string")
    bad = unstorable(saga_id)
    if bad is not None:
        raise BadInput(f"saga id {saga_id!r} holds {bad}: no saga has such an id; check it")


def _status(status: SagaStatus | str) -> SagaStatus:
    try:
        return SagaStatus(status)
    except ValueError:
        raise BadInput(f"status {status!r} is not a saga status; use one of "
                       f"{', '.join(s.value for s in SagaStatus)}") from None
