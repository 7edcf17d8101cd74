"""Rows fetched with their user-data columns as stored, opened one row at a time.

Listings and the sweeper read many rows in one statement. Had SQLAlchemy opened (decrypted,
decoded) every JSON value while fetching, one row no key opens, or one journaled before a
poison key was refused, failed the whole statement: every listing, every sweeper pass, on
every worker. Fetched as stored, each row is opened on its own, and one that cannot be is
reported and skipped while the others go on.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass
from datetime import datetime
from types import SimpleNamespace
from typing import Any

from sqlalchemy import JSON, Select, Table, select
from sqlalchemy.dialects.postgresql import JSONB
from sqlalchemy.engine import Dialect
from sqlalchemy.sql import type_coerce

from .._base.crypto import SealedElsewhere, SealedJSON, place_columns
from .._base.errors import SagaworkerError

__all__ = ["UnreadableSaga", "opened", "opened_unless_elsewhere", "raw_columns", "raw_select",
           "why_unreadable"]

#: the stored JSON as it is (as ``rotate`` reads it): opened later, row by row
_RAW = JSON().with_variant(JSONB(), "postgresql")


@dataclass(frozen=True)
class UnreadableSaga:
    """A saga a listing skipped: what it could read of it (no user data), and why not."""

    saga_id: str
    status: str
    created_at: datetime | None
    error: str


def raw_columns(table: Table) -> list[Any]:
    """``table``'s columns, its sealed ones fetched as stored (``opened`` opens them), and
    the place columns they name that it lacks (an entry's saga's nonce)."""
    derived = sorted({n for c in table.c if isinstance(c.type, SealedJSON)
                      for n in c.type.place if n not in table.c})
    return [*(type_coerce(c, _RAW).label(c.name) if isinstance(c.type, SealedJSON) else c
              for c in table.c),
            *(col.label(n) for n, col in zip(derived, place_columns(table, derived),
                                             strict=True))]


def raw_select(table: Table) -> Select[Any]:
    """``select(table)`` with its sealed columns fetched as stored (``opened`` opens them)."""
    return select(*raw_columns(table))


def opened(row: Any, table: Table, dialect: Dialect,
           only: Collection[str] | None = None) -> SimpleNamespace:
    """A row of ``raw_select`` as a plain read gives it, its sealed columns (those named in
    ``only``, if given) opened for the row's place; raises what that read would raise."""
    values = dict(row._mapping)
    for c in table.c:
        if (isinstance(c.type, SealedJSON) and c.name in values
                and (only is None or c.name in only)):
            at = [values.get(name) for name in c.type.place]
            values[c.name] = c.type.open_at(values[c.name], dialect, at)
    return SimpleNamespace(**values)


def opened_unless_elsewhere(row: Any, table: Table, dialect: Dialect) -> SimpleNamespace:
    """``opened``, except that a row holding a value sealed for another place (copied there
    with SQL) comes back with its sealed columns None and ``unreadable`` saying why (else
    ``unreadable`` is None): the caller decides without those values, never with them."""
    try:
        got = opened(row, table, dialect)
        got.unreadable = None
    except SealedElsewhere as exc:
        got = SimpleNamespace(**dict(row._mapping))
        for c in table.c:
            if isinstance(c.type, SealedJSON):
                setattr(got, c.name, None)
        got.unreadable = str(exc)
    return got


def why_unreadable(exc: BaseException) -> str:
    """Why a row cannot be read, for a log line or a listing: sagaworker's own message (it
    names the setting to fix), of any other error only its type (its text may quote the
    stored value, a secret among them)."""
    if isinstance(exc, SagaworkerError):
        return str(exc)
    return f"{type(exc).__name__}: a stored value cannot be decoded"
