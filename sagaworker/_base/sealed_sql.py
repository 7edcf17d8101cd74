"""The SQL side of the journal's sealed columns (``crypto.SealedJSON``): which engines hold
a cipher, and the expressions a read adds beside a stored value.

A sealed value is read beside its row's place (``Located``), so that a token copied into
another row is refused. A process with keys reads a clear value beside its place too, so
that a saga whose values are all sealed refuses one written there with SQL. Place columns
a table lacks are made from its own (``derive_place``: an entry's saga's nonce), and only
where the engine holds a cipher (``keyed_only``): a process without keys reads what it
always did, at the cost it always had. Compiled statements differ with and without a
cipher: ``crypto.attach`` forgets an engine's compiled statements when that changes.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from typing import Any

from sqlalchemy import ColumnElement
from sqlalchemy.engine import Dialect
from sqlalchemy.ext.compiler import compiles
from sqlalchemy.sql.compiler import SQLCompiler
from sqlalchemy.sql.functions import FunctionElement

from .canonical import RESERVED_KEY

__all__ = ["AT", "CLEAR", "MARKER", "Located", "derive_place", "derived_places", "keyed_only",
           "place_columns", "registered", "registry"]

#: the one key of the JSON object an encrypted value is stored as (reserved)
MARKER = RESERVED_KEY
#: the key SQL adds beside ``MARKER`` when it reads a sealed value: the row's place
AT = "$sagaworker_at"
#: the key SQL puts a clear value under, beside ``AT``, when a process with keys reads it
CLEAR = "$sagaworker_clear"

#: each engine's cipher, by its dialect (one per engine): ``crypto.attach`` keeps it
registry: weakref.WeakKeyDictionary[Dialect, Any] = weakref.WeakKeyDictionary()
#: place columns a table lacks, made from its own (an entry's saga's nonce: ``schema``)
derived_places: dict[str, Callable[[Any], ColumnElement[Any]]] = {}


def registered(dialect: Dialect) -> Any:
    """The cipher attached to the engine of ``dialect`` (None: none)."""
    return registry.get(dialect)


def derive_place(name: str, make: Callable[[Any], ColumnElement[Any]]) -> None:
    """Place column ``name``, where a table lacks it, is ``make(table)``."""
    derived_places[name] = make


def place_columns(table: Any, names: Sequence[str]) -> list[ColumnElement[Any]]:
    """The columns of ``table`` (a table, alias or subquery) a place names."""
    return [table.c[n] if n in table.c else derived_places[n](table) for n in names]


class _KeyedOnly(FunctionElement[Any]):
    """An expression read only where the engine has a cipher (NULL elsewhere)."""

    name = "sagaworker_keyed_only"
    inherit_cache = True


def keyed_only(expr: ColumnElement[Any]) -> ColumnElement[Any]:
    return _KeyedOnly(expr)


@compiles(_KeyedOnly)
def _keyed_only(element: _KeyedOnly, compiler: SQLCompiler, **kw: Any) -> str:
    if registered(compiler.dialect) is None:
        return "NULL"
    return str(compiler.process(next(iter(element.clauses)), **kw))


class Located(FunctionElement[Any]):
    """``column`` with ``{AT: [place values]}`` added when it holds a sealed value (and,
    with a cipher, a clear value as ``{CLEAR: value, AT: [...]}``)."""

    name = "sagaworker_located"
    inherit_cache = True


@compiles(Located, "postgresql")
def _located_pg(element: Located, compiler: SQLCompiler, **kw: Any) -> str:
    col, *place = [compiler.process(c, **kw) for c in element.clauses]
    at = f"jsonb_build_array({', '.join(place)})"
    clear = (f"WHEN jsonb_typeof({col}) <> 'null' THEN jsonb_build_object('{CLEAR}', "
             f"{col}, '{AT}', {at}) " if registered(compiler.dialect) is not None else "")
    return (f"CASE WHEN jsonb_typeof({col}) = 'object' AND ({col}) ? '{MARKER}' "
            f"THEN ({col}) || jsonb_build_object('{AT}', {at}) {clear}ELSE {col} END")


@compiles(Located)
def _located(element: Located, compiler: SQLCompiler, **kw: Any) -> str:
    col, *place = [compiler.process(c, **kw) for c in element.clauses]
    # (text that is not JSON at all reads as it is: its row alone fails, in Python)
    key, at = f"'$.\"{MARKER}\"'", f"'$.\"{AT}\"'"
    where = f"json_array({', '.join(place)})"
    clear = (f"WHEN json_type({col}) <> 'null' THEN json_object('{CLEAR}', json({col}), "
             f"'{AT}', {where}) " if registered(compiler.dialect) is not None else "")
    return (f"CASE WHEN NOT json_valid({col}) THEN {col} WHEN json_type({col}) = 'object' "
            f"AND json_type({col}, {key}) IS NOT NULL "
            f"THEN json_set({col}, {at}, {where}) {clear}ELSE {col} END")
