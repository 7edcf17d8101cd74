"""Records as JSON-ready data: enums by value, datetimes ISO-8601, reports with ``dirty``."""

from __future__ import annotations

import dataclasses
from datetime import datetime
from enum import Enum
from typing import Any

from .types import CompensationReport

__all__ = ["plain"]


def plain(o: Any) -> Any:
    """``o`` as JSON-ready data (dataclasses become dicts, recursively)."""
    if isinstance(o, Enum):
        return o.value
    if isinstance(o, datetime):
        return o.isoformat()
    if dataclasses.is_dataclass(o) and not isinstance(o, type):
        d = {f.name: plain(getattr(o, f.name)) for f in dataclasses.fields(o)}
        if isinstance(o, CompensationReport):
            d["dirty"] = [plain(x) for x in o.dirty]
        return d
    if isinstance(o, list | tuple):
        return [plain(x) for x in o]
    if isinstance(o, dict):
        return {str(k): plain(v) for k, v in o.items()}
    return o
