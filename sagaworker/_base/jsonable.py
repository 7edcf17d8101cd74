"""Records as JSON-ready data for people and HTTP clients: enums by value, datetimes,
dates and times ISO-8601, Decimals and UUIDs as text, bytes as UTF-8 text (base64 when not
text), reports with ``dirty``."""

from __future__ import annotations

import base64
import dataclasses
from datetime import date, datetime, time
from decimal import Decimal
from enum import Enum
from typing import Any
from uuid import UUID

from .types import CompensationReport

__all__ = ["plain"]


def plain(o: Any) -> Any:
    """``o`` as JSON-ready data (dataclasses become dicts, recursively)."""
    if isinstance(o, Enum):
        return o.value
    if isinstance(o, datetime | date | time):
        return o.isoformat()
    if isinstance(o, Decimal | UUID):
        return str(o)
    if isinstance(o, bytes):
        try:
            return o.decode("utf-8")
        except UnicodeDecodeError:
            return base64.b64encode(o).decode("ascii")
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
