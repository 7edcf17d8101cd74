"""Whether a delivered step's arguments are the ones its journal holds, before its tool runs."""

from __future__ import annotations

from typing import Any

from .._base import digests
from .._base.canonical import args_digest
from .._base.errors import ConfigurationError, SealedElsewhere
from .._base.registry import ToolSpec
from .._journal.raw_rows import opened
from .._journal.schema import entries
from .._producer.signer import signer_for
from .._runtime import Runtime

__all__ = ["verify"]

_FORGED = ("approval verification failed: the journal holds no approval made with "
           "SAGAWORKER_APPROVAL_SECRET for this step (written there with SQL?); not run")


def verify(rt: Runtime, spec: ToolSpec, row: Any, args: Any, kwargs: Any) -> str | None:
    """Why the step must not run with these arguments (the journal's claimed ``row``
    disagrees, or the tool's signature refuses them), or None. The journal's digests are
    keyed when its values are sealed: an unkeyed one (written with SQL to match other
    arguments) matches only in a saga journaled without a key, before ``db rotate-key``."""
    try:
        sent = args_digest(list(args), kwargs)
    except (TypeError, ValueError) as exc:
        return f"arguments are not JSON: {exc}"
    cipher = rt.cipher
    clear_ok = cipher is None or cipher.legacy(getattr(row, "place_nonce", None))
    if spec.gated:
        # recomputed from the journal's arguments: an edit after approval must show
        refused = ("approval verification failed: the arguments no longer match the "
                   "approved step; not run. Start a new saga with the intended arguments")
        if not row.approved_by or not digests.matches(cipher, row.approved_digest, args,
                                                      kwargs, clear_ok=clear_ok):
            return refused
        try:  # (a claim reads them as stored)
            row = opened(row, entries, rt.journal.engine.dialect, ("args", "kwargs"))
        except SealedElsewhere as exc:
            return f"approval verification failed: {exc}; not run"
        if args_digest(row.args or [], row.kwargs or {}) != sent:
            return refused
        if not _proven(rt, row, sent):
            return _FORGED
    elif not digests.matches(cipher, row.args_digest, list(args), kwargs,
                             clear_ok=clear_ok):  # the digest journaled with the INTENT
        return "the message's arguments do not match the journal; not run"
    if spec.signature is not None:
        try:
            spec.signature.bind(*args, **kwargs)
        except TypeError as exc:
            return f"malformed arguments for {spec.name}: {exc}"
    return None


def _proven(rt: Runtime, row: Any, digest: str) -> bool:
    """The journal's proof of the approval (``approval_proof``) was made with the approval
    secret, for this step, these arguments and its approver: only the secret makes one, so
    an approval written with SQL (phase, approver and digest set by hand) runs nothing."""
    try:
        return signer_for(rt.settings).proven(row.approval_proof, row.saga_id, row.seq,
                                              row.task_id, row.tool_name, digest,
                                              row.approved_by)
    except ConfigurationError:  # no secret here, or one too short: nothing is proven
        return False
