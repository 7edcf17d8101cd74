"""Whether a delivered step's arguments are the ones its journal holds, before its tool runs."""

from __future__ import annotations

from typing import Any

from .._base.canonical import args_digest
from .._base.errors import SealedElsewhere
from .._base.registry import ToolSpec
from .._journal.raw_rows import opened
from .._journal.runtime import Runtime
from .._journal.schema import entries

__all__ = ["verify"]


def verify(rt: Runtime, spec: ToolSpec, row: Any, args: Any, kwargs: Any) -> str | None:
    """Why the step must not run with these arguments (the journal's claimed ``row``
    disagrees, or the tool's signature refuses them), or None."""
    try:
        sent = args_digest(list(args), kwargs)
    except (TypeError, ValueError) as exc:
        return f"arguments are not JSON: {exc}"
    if spec.gated:
        # recomputed from the journal's arguments: an edit after approval must show
        refused = ("approval verification failed: the arguments no longer match the "
                   "approved step; not run. Start a new saga with the intended arguments")
        if not row.approved_by or sent != row.approved_digest:
            return refused
        try:  # (a claim reads them as stored)
            row = opened(row, entries, rt.journal.engine.dialect, ("args", "kwargs"))
        except SealedElsewhere as exc:
            return f"approval verification failed: {exc}; not run"
        if row.approved_digest != args_digest(row.args or [], row.kwargs or {}):
            return refused
    elif sent != row.args_digest:  # the digest journaled with the INTENT
        return "the message's arguments do not match the journal; not run"
    if spec.signature is not None:
        try:
            spec.signature.bind(*args, **kwargs)
        except TypeError as exc:
            return f"malformed arguments for {spec.name}: {exc}"
    return None
