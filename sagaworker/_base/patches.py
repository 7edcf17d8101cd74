"""Patch markers: the journal entries ``FlowContext.patched`` writes.

A marker is an entry with no tool and no undo, named ``patch:<change id>``: journaled
EXECUTED with its undo SKIPPED at once (nothing to undo), so no chain ever claims it and
no report lists it. Real tools are named ``module.qualname`` (or a ``name=`` without a
colon: ``registry`` refuses one), so a name never reads as a marker by mistake.
"""

from __future__ import annotations

from dataclasses import dataclass

from .canonical import has_control
from .errors import BadInput

__all__ = ["MARKER_DETAIL", "PATCH_PREFIX", "PatchMarker", "patch_id"]

PATCH_PREFIX = "patch:"
#: the compensation detail a marker is journaled with (and how a report leaves it out)
MARKER_DETAIL = "patch marker"
_MAX = 200 - len(PATCH_PREFIX)


@dataclass(frozen=True)
class PatchMarker:
    """A marker a flow's replay asks to journal (in ``FlowContext.new``, beside steps)."""

    change_id: str

    def __post_init__(self) -> None:
        cid = self.change_id
        if not isinstance(cid, str) or not cid.strip() or len(cid) > _MAX:
            raise BadInput(f"patch id {cid!r}: give a non-empty string of at most {_MAX} "
                           "characters naming the change, e.g. s.patched('add-fraud-check')")
        if has_control(cid):
            raise BadInput(f"patch id {cid!r} holds a control character; name the change "
                           "in plain text")

    @property
    def tool_name(self) -> str:
        return PATCH_PREFIX + self.change_id


def patch_id(tool_name: str) -> str | None:
    """The change id of a marker entry's name, None for a tool's step."""
    return tool_name[len(PATCH_PREFIX):] if tool_name.startswith(PATCH_PREFIX) else None
