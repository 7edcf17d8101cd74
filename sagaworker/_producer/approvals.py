"""The approval gate: HMAC-signed tokens bound to one step and its exact arguments."""

from __future__ import annotations

import hmac
from collections.abc import Callable, Sequence
from typing import Any, NoReturn

from sqlalchemy import or_

from .._base.canonical import args_digest, check_text, storable
from .._base.errors import ApprovalInvalid, BadInput, ConfigurationError
from .._base.types import OPEN, OPEN_VALUES, ApprovalRequest, Phase, SagaStatus
from .._journal.dialect import aware, db_now
from .._journal.raw_rows import opened, raw_select, why_unreadable
from .._journal.readiness import check_approval_secrets
from .._journal.schema import entries, sagas
from .._machine.moves_base import new_token
from .._observe import tracing
from .._observe.logging import get_logger
from .._runtime import Runtime
from .deadlines import deadline_passed
from .signer import Signer, signer_for

__all__ = ["Gate", "Signer", "signer_for"]

log = get_logger()


class Gate:
    def __init__(self, rt: Runtime) -> None:
        self.rt = rt
        self._checked: list[str] | None = None

    @property
    def signer(self) -> Signer:
        return signer_for(self.rt.settings)

    def checked_signer(self) -> Signer:
        """The signer, once the journal said its secret is the one its approvals are made
        with (asked once per secret in this process)."""
        signer = self.signer
        signer.check()
        if self._checked != signer.fingerprints:
            check_approval_secrets(self.rt.journal.engine, signer.fingerprints)
            self._checked = signer.fingerprints
        return signer

    def pending(self) -> list[ApprovalRequest]:
        """Open gates of sagas never asked to fail (a failing saga's gates are closed),
        nor past their deadline: closed at the read, not only once the sweeper has failed
        the saga (``approve`` refuses them too); nor held on a divergence (README,
        "Changing a flow")."""
        signer = self.checked_signer()
        with self.rt.journal.reader.connect() as conn:
            rows = conn.execute(raw_select(entries).join(
                sagas, sagas.c.saga_id == entries.c.saga_id).where(
                entries.c.phase == Phase.AWAITING_APPROVAL.value,
                sagas.c.status.in_(OPEN_VALUES),
                sagas.c.fail_requested_at.is_(None), sagas.c.divergence.is_(None),
                or_(sagas.c.deadline_at.is_(None), sagas.c.deadline_at > db_now()))
                .order_by(entries.c.approval_requested_at, entries.c.saga_id, entries.c.seq)
            ).all()
        return [ApprovalRequest(
            saga_id=r.saga_id, seq=r.seq, tool_name=r.tool_name, args=list(r.args),
            kwargs=dict(r.kwargs), requested_at=aware(r.approval_requested_at),  # type: ignore[arg-type]
            token=signer.sign(r.saga_id, r.seq, r.tool_name,
                              args_digest(r.args, r.kwargs), r.approval_nonce or ""))
            for r in self._readable(rows)]

    def _readable(self, rows: Sequence[Any]) -> list[Any]:
        """The gates whose arguments can be read; one that cannot (a value copied in with
        SQL, one no JSON reader takes) is logged (``saga_unreadable``) and left out, never
        offered for approval, and the others are listed. Keys that open nothing are this
        process's problem, not a row's: raised, naming the setting."""
        dialect = self.rt.journal.engine.dialect
        out = []
        for raw in rows:
            try:
                out.append(opened(raw, entries, dialect))
            except ConfigurationError:
                raise
            except Exception as exc:  # whatever the row holds, the others are listed
                log.warning("saga_unreadable", saga_id=raw.saga_id, seq=raw.seq,
                            error=why_unreadable(exc))
        return out

    def decide(self, token: str, *, approver: str, approve: bool,
               reason: str | None = None) -> tuple[str, int]:
        if not isinstance(approver, str) or not approver.strip():
            raise BadInput("approver is required: pass approver='<who decided>' (a non-empty "
                           "string, journaled and logged with the decision); nothing changed")
        check_text(approver, "the approver")
        reason = None if reason is None else storable(reason)
        signer = self.checked_signer()
        body = signer.verify(token)
        saga_id, seq = body["s"], body["q"]

        def check(saga: Any, row: Any) -> None:
            """The token against the journal, under the saga row's lock."""
            if saga is None or row is None:
                raise ApprovalInvalid(f"approval token names saga {saga_id!r} step {seq}, "
                                      "which is not in the journal; nothing changed")
            if row.phase != Phase.AWAITING_APPROVAL.value or not row.approval_nonce:
                raise ApprovalInvalid(
                    f"saga {saga_id!r} step {seq} is {row.phase}: already decided or "
                    "cancelled; this token was used or is stale, nothing changed")
            if not (hmac.compare_digest(body["n"], row.approval_nonce)
                    and body["t"] == row.tool_name
                    and hmac.compare_digest(str(body["d"]),
                                            signer.bind(args_digest(row.args, row.kwargs),
                                                        body["key"]))):
                raise ApprovalInvalid(
                    f"approval token does not match saga {saga_id!r} step {seq} (tool or "
                    "arguments differ); nothing changed. Review the step and use the token "
                    "sw.pending_approvals() gives for it")
            if saga.fail_requested_at is not None or SagaStatus(saga.status) not in OPEN:
                # Gates close once a saga was asked to fail: an IRREVERSIBLE effect never
                # happens for a failing saga (the compensation chain cancels the gate).
                raise ApprovalInvalid(
                    f"saga {saga_id!r} is {saga.status} and was asked to fail "
                    f"({saga.reason or 'no reason given'}); its gates are closed, nothing "
                    "changed")
            if approve and saga.divergence is not None:
                raise ApprovalInvalid(held_gate(saga_id))

        machine = self.rt.machine
        call = new_token()  # this decision's: its replay after a lost COMMIT knows it
        if approve:
            row = machine.approve(saga_id, seq, check=check, approver=approver, token=call,
                                  reason=reason, prove=_prover(signer, saga_id, seq, approver))
            if row is None:
                self._overdue(saga_id, seq)
        else:
            row = machine.reject(saga_id, seq, check=check, approver=approver, token=call,
                                 reason=reason)
        fields = {"saga_id": saga_id, "seq": seq, "tool": row.tool_name, "approver": approver}
        with tracing.within(row.trace_context):  # a traced publish joins the saga's trace
            if approve:
                log.info("approval_granted", **fields)
                self.rt.bus.publish_step(saga_id, seq, row.tool_name, list(row.args),
                                         dict(row.kwargs), row.task_id, row.queue)
            else:
                log.warning("approval_rejected", reason=reason, **fields)
                self.rt.bus.send_failure(saga_id, f"step {seq} ({row.tool_name}) rejected "
                                              f"by {approver}: {reason or 'rejected'}")
        return saga_id, seq

    def _overdue(self, saga_id: str, seq: int) -> NoReturn:
        deadline_passed(self.rt, saga_id,
                        f"step {seq}'s approval came after the saga's deadline")
        raise ApprovalInvalid(
            f"saga {saga_id!r} passed its deadline before step {seq} was approved; nothing "
            "was approved and the saga is failing (reason: deadline passed)")


def _prover(signer: Signer, saga_id: str, seq: int, approver: str) -> Callable[[Any], str]:
    """The approval's proof for the gated entry, journaled with it: what only the secret
    makes, which the worker checks before the gated tool runs (an approval written with
    SQL runs nothing)."""
    return lambda row: signer.prove(saga_id, seq, row.task_id, row.tool_name,
                                    args_digest(row.args, row.kwargs), row.approval_nonce,
                                    approver)


def held_gate(saga_id: str) -> str:
    """Why a gate of a saga held on a divergence is not approved."""
    return (f"saga {saga_id!r} is held: its flow's code no longer replays its journal, so "
            "nothing of it runs and its gates are closed. Deploy code that replays it (a "
            f"rollback, or s.patched(...)), then `sagaworker flows resume {saga_id}`; or "
            f"`sagaworker abort {saga_id} --reason R` to compensate. Nothing changed")
