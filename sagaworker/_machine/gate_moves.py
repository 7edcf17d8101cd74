"""The approval gate's moves: approve or reject a gated step, once, with the token checked
under the saga row's lock; a deadline that passed refuses the approval."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from sqlalchemy import select

from .._base import digests
from .._base.crypto import cipher_for
from .._base.types import Phase, SagaStatus
from .._journal.dialect import db_now
from .._journal.repository import retrying
from .._journal.schema import entries
from .lifecycle import move, performs
from .moves_base import MoveBase

__all__ = ["GateMoves"]


class GateMoves(MoveBase):
    """The moves of an approval gate."""

    def _gate(self, conn: Any, saga_id: str, seq: int, token: str,
              check: Callable[[Any, Any], None]) -> tuple[Any, Any, bool]:
        """The saga (locked), the gated entry, and whether this decision (``token``) was
        journaled already (replayed after a lost COMMIT reply: the check is not made
        again, the entry is no longer waiting), once ``check`` (the token's) passed."""
        saga = self.j.lock_saga(conn, saga_id)
        row = self.j.entry(conn, saga_id, seq, opening=True)  # the token's digest, the publish
        if row is not None and (row.decided_by == token or saga.fail_token == token):
            return saga, row, True  # (or our own refusal: the deadline had passed)
        check(saga, row)
        return saga, row, False

    @retrying
    @performs("step", "approve")
    @performs("saga", "decided")
    def approve(self, saga_id: str, seq: int, *, check: Callable[[Any, Any], None],
                approver: str, token: str, reason: str | None,
                prove: Callable[[Any], str]) -> Any:
        """Moves ``approve`` (and ``decided`` once no other gate waits): the entry, or None
        when the saga's deadline had passed (on the database's clock): nothing is
        approved, the saga is asked to fail. ``prove``: the approval's proof for the
        entry (``Signer.prove``: only the approval secret makes one), journaled with it."""
        with self.j.engine.begin() as conn:
            saga, row, replay = self._gate(conn, saga_id, seq, token, check)
            if saga.fail_token == token:
                return None  # our own deadline refusal, replayed
            if replay:
                return row
            if self._overdue(conn, saga):
                self._request_failure(conn, saga, "deadline passed", token)
                return None
            t = db_now()
            # published_at: the relay counts from the approval, not the original INTENT
            self.j.set_entry(conn, saga_id, seq, phase=move("step", "approve").target,
                             approved_by=approver, approved_at=t,
                             approved_digest=digests.digest(cipher_for(self.j.engine),
                                                            row.args or [], row.kwargs or {}),
                             approval_proof=prove(row), approval_nonce=None,
                             published_at=t, decided_by=token)
            others = conn.execute(select(entries.c.seq).where(
                entries.c.saga_id == saga_id,
                entries.c.phase == Phase.AWAITING_APPROVAL.value)).first()
            if others is None and saga.status == SagaStatus.AWAITING_APPROVAL.value:
                self.j.touch(conn, saga_id, status=move("saga", "decided").target)
            self.j.audit(conn, saga_id, seq, "approve", approver, reason)
            return row

    @retrying
    @performs("step", "reject")
    def reject(self, saga_id: str, seq: int, *, check: Callable[[Any, Any], None],
               approver: str, token: str, reason: str | None) -> Any:
        """Move ``reject``: the entry REJECTED and the saga asked to fail; the entry."""
        with self.j.engine.begin() as conn:
            _, row, replay = self._gate(conn, saga_id, seq, token, check)
            if replay:
                return row
            t = db_now()
            why = reason or "rejected"
            self.j.set_entry(conn, saga_id, seq, phase=move("step", "reject").target,
                             rejected_by=approver, rejected_at=t, rejection_reason=why,
                             approval_nonce=None, error=f"rejected by {approver}: {why}",
                             decided_by=token)
            self.j.touch(conn, saga_id, fail_requested_at=t,
                         reason=f"step {seq} ({row.tool_name}) rejected by {approver}: {why}")
            self.j.audit(conn, saga_id, seq, "reject", approver, reason)
            return row
