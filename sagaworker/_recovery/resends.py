"""Taking rows on a backoff: of many sweepers one resends a row, and not on every pass.

Each row the sweeper would resend is taken with a compare-and-set on its ``resends``
count and put on a backoff (``resend_at``, doubling from ``SAGAWORKER_RELAY_AFTER`` up to
an hour, or a shorter cap), so a long queue is not multiplied by duplicates.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import Table, or_, update

from .._journal.dialect import db_later, db_now
from .._journal.raw_rows import raw_select
from .._journal.schema import entries, sagas
from .._runtime import Runtime

__all__ = ["MAX_BACKOFF", "Resends"]

_BATCH = 500
MAX_BACKOFF = 3600.0



class Resends:
    """The rows of a table that the sweeper may resend now, each taken once."""

    def __init__(self, rt: Runtime) -> None:
        self.rt = rt

    def take(self, table: Table, keys: list[Any], where: Any, still: Any = None, *,
              cap: float = MAX_BACKOFF) -> list[Any]:
        """The rows matching ``where`` whose resend is due, each taken by one sweeper if it
        still matches ``still`` (by default ``where``: a row that moved on between the read
        and the take, a step claimed, a chain touched, is not sent again). ``cap``: the
        longest backoff; a resend scheduled further out than that is due now."""
        return self.claim(table, keys, self.due(table, keys, where, cap),
                           where if still is None else still, cap)

    @staticmethod
    def resend_due(table: Table, cap: float = MAX_BACKOFF) -> Any:
        due = or_(table.c.resend_at.is_(None), table.c.resend_at < db_now())
        return due if cap >= MAX_BACKOFF else or_(due, table.c.resend_at > db_later(cap))

    def due(self, table: Table, keys: list[Any], where: Any,
             cap: float = MAX_BACKOFF) -> list[Any]:
        """Up to a batch of rows matching ``where`` whose resend is due, not yet taken."""
        with self.rt.journal.engine.connect() as conn:
            # a stable order (oldest key first): a resend pass is reproducible, and a long
            # backlog is worked through rather than sampled by the heap's order
            return list(conn.execute(raw_select(table).where(where,
                                                             self.resend_due(table, cap))
                                     .order_by(*[table.c[k] for k in keys])
                                     .limit(_BATCH)).all())

    def claim(self, table: Table, keys: list[Any], found: list[Any], still: Any,
               cap: float = MAX_BACKOFF) -> list[Any]:
        """Each row of ``found`` whose resend is still due and that still matches ``still``,
        taken with a compare-and-set (of many sweepers one takes it) and put on its
        backoff."""
        base = self.rt.settings.relay_after
        due = self.resend_due(table, cap)
        taken = []
        for r in found:
            delay = min(base * 2 ** min(r.resends, 12), cap)
            with self.rt.journal.engine.begin() as conn:
                got = conn.execute(
                    update(table)
                    .where(*[table.c[k] == getattr(r, k) for k in keys], due,
                           table.c.resends == r.resends, still)
                    .values(resend_at=db_later(delay), resends=table.c.resends + 1)).rowcount
            if got:
                taken.append(r)
        return taken

    def sagas(self, where: Any, *, cap: float = MAX_BACKOFF) -> list[Any]:
        return self.take(sagas, ["saga_id"], where, cap=cap)

    def entries(self, where: Any, still: Any = None) -> list[Any]:
        return self.take(entries, ["saga_id", "seq"], where, still)

    def ago(self, seconds: float) -> Any:
        return db_later(-seconds)
