"""A journal entry or a call as a divergence names it: redacted (SAGAWORKER_REDACT)."""

from __future__ import annotations

from typing import Any

from .._base.patches import patch_id
from .._observe.redact import redact_call
from .._runtime import Runtime

__all__ = ["describe", "show_call"]


def describe(rt: Runtime, row: Any) -> str:
    """A journal entry as a divergence names it: its tool and arguments, or its patch."""
    change = patch_id(row.tool_name)
    if change is not None:
        return f"patch marker {change!r}"
    return f"{row.tool_name}{show_call(rt, row.tool_name, row.args, row.kwargs)}"


def show_call(rt: Runtime, tool: str, args: Any, kwargs: Any) -> str:
    """A call as people read it in a reason or a log line: redacted (SAGAWORKER_REDACT)."""
    spec = rt.registry.tool(tool)
    args, kwargs = redact_call(spec.signature if spec is not None else None, args or [],
                               kwargs or {}, rt.settings.redact_keys)
    parts = [repr(a) for a in (args or [])] + [f"{k}={v!r}" for k, v in (kwargs or {}).items()]
    text = f"({', '.join(parts)})"
    return text if len(text) <= 200 else text[:197] + "...)"
