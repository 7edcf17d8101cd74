"""The journal's reads and writes for callers outside a saga's own flow: an agent's
tool call journaled once per call id, and the one read behind every waiting ``aresult``."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from sqlalchemy import select
from sqlalchemy.exc import IntegrityError

from .._base.types import TERMINAL, Phase, SagaStatus
from .schema import entries, sagas

if TYPE_CHECKING:
    from sqlalchemy import Engine

__all__ = ["CallerMoves", "NewEntry"]


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


class CallerMoves:
    """Part of ``Journal``."""

    reader: Engine

    def add_entries(self, saga_id: str, new: Sequence[NewEntry], *,
                    expect_seq: int | None = None, seen: int | None = None) -> list[int]:
        raise NotImplementedError

    def add_call(self, saga_id: str, e: NewEntry) -> tuple[Any, bool]:
        """Journal ``e`` unless the saga holds a step with its ``call_id`` already:
        ``(row, False)`` for that step, else ``(seq, True)``. Two callers racing with one
        id: the unique index lets one insert, the other reads its step."""
        assert e.call_id is not None
        found = self.call_row(saga_id, e.call_id)
        if found is not None:
            return found, False
        try:
            return self.add_entries(saga_id, [e])[0], True
        except IntegrityError:
            found = self.call_row(saga_id, e.call_id)
            if found is None:
                raise
            return found, False

    def call_row(self, saga_id: str, call_id: str) -> Any:
        with self.reader.connect() as conn:
            return conn.execute(select(entries).where(entries.c.saga_id == saga_id,
                                                      entries.c.call_id == call_id)).first()

    def settled(self, steps: Sequence[tuple[str, int]], saga_ids: Sequence[str]
                ) -> tuple[set[tuple[str, int]], set[str]]:
        """Of these steps, those with an outcome; of these sagas, the terminal ones (or
        gone): one read for every waiting ``aresult`` of a process."""
        done_steps: set[tuple[str, int]] = set()
        done_sagas: set[str] = set()
        waiting = (Phase.INTENT.value, Phase.AWAITING_APPROVAL.value)
        with self.reader.connect() as conn:
            wanted = set(steps)
            for chunk in _chunks(sorted({s for s, _ in steps}), 500):
                rows = conn.execute(select(entries.c.saga_id, entries.c.seq, entries.c.phase)
                                    .where(entries.c.saga_id.in_(chunk))).all()
                done_steps.update((r.saga_id, r.seq) for r in rows
                                  if (r.saga_id, r.seq) in wanted and r.phase not in waiting)
            for chunk in _chunks(sorted(set(saga_ids)), 500):
                found = {r.saga_id: r.status for r in conn.execute(
                    select(sagas.c.saga_id, sagas.c.status).where(sagas.c.saga_id.in_(chunk)))}
                done_sagas.update(s for s in chunk
                                  if s not in found or SagaStatus(found[s]) in TERMINAL)
        return done_steps, done_sagas



def _chunks(items: Sequence[Any], size: int) -> Iterator[Sequence[Any]]:
    for i in range(0, len(items), size):
        yield items[i:i + size]
