"""What this process knows for redaction: the keys every Sagaworker in it was given, the
tools' signatures, and the secret values of the tasks running now (scrubbed out of every
log line while they run)."""

from __future__ import annotations

import threading
import weakref
from collections.abc import Iterable
from typing import Any

from .redact import (
    Signature,
    _scrub_strings,
)

__all__ = ["active_values", "hold", "redact_keys", "register", "release", "scrub_active",
           "signature_of"]

# -- what this process knows: keys, tool signatures, values of running tasks -----------

_lock = threading.Lock()
_keys: set[str] = set()
_lookups: list[weakref.ref[Any]] = []
_active: dict[str, list[str]] = {}


def register(keys: Iterable[str], tools: Any = None) -> None:
    """Add redact keys (and a registry whose ``tool(name)`` gives ``.signature``) to what
    this process's log filters and renderers redact by."""
    with _lock:
        _keys.update(keys)
        if tools is not None and not any(r() is tools for r in _lookups):
            _lookups[:] = [r for r in _lookups if r() is not None]
            _lookups.append(weakref.ref(tools))


def redact_keys() -> frozenset[str]:
    return frozenset(_keys)


def signature_of(tool: str) -> Signature | None:
    for ref in list(_lookups):
        reg = ref()
        spec = reg.tool(tool) if reg is not None else None
        if spec is not None and getattr(spec, "signature", None) is not None:
            sig: Signature = spec.signature
            return sig
    return None


def hold(task_id: str, values: list[str]) -> None:
    """While a task runs: its secret values are scrubbed from every log line."""
    if values:
        with _lock:
            _active[task_id] = values


def release(task_id: str) -> None:
    with _lock:
        _active.pop(task_id, None)


def active_values() -> list[str]:
    if not _active:
        return []
    with _lock:
        merged = {v for vs in _active.values() for v in vs}
    return sorted(merged, key=len, reverse=True)


def scrub_active(value: Any) -> Any:
    """``value`` with the running tasks' secret values scrubbed out of every string."""
    values = active_values()
    return _scrub_strings(value, values) if values else value




