"""The example's "outside world": stock holds, card charges and shipments in SQL tables.

A real app would call an inventory service and a payment API; the example keeps its
effects in the journal's database so the demo can show them being undone.

Its tables are created by the release step, `sagaworker db upgrade` (the Procfile's
``release`` line), through ``sw.on_upgrade``: never by the first tool call, where two
prefork children would race to create them on a fresh database.
"""

from __future__ import annotations

import uuid
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import (
    Column,
    DateTime,
    Integer,
    MetaData,
    String,
    Table,
    insert,
    select,
    text,
    update,
)
from sqlalchemy.exc import DBAPIError

from sagaworker import make_engine

from ._app import sw

metadata = MetaData()
holds = Table("example_holds", metadata,
              Column("id", String(40), primary_key=True), Column("sku", String(80)),
              Column("quantity", Integer), Column("state", String(20)),
              Column("at", DateTime(timezone=True)))
charges = Table("example_charges", metadata,
                Column("id", String(40), primary_key=True), Column("card", String(80)),
                Column("amount_cents", Integer), Column("state", String(20)),
                Column("refund_key", String(64), unique=True),
                Column("at", DateTime(timezone=True)))
shipments = Table("example_shipments", metadata,
                  Column("id", String(40), primary_key=True), Column("order_id", String(80)),
                  Column("at", DateTime(timezone=True)))
# the trip agent's (tasks/agent.py): hotel rooms booked, and the vouchers mailed (its outbox)
bookings = Table("example_bookings", metadata,
                 Column("id", String(40), primary_key=True), Column("guest", String(80)),
                 Column("city", String(80)), Column("nights", Integer),
                 Column("state", String(20)), Column("at", DateTime(timezone=True)))
vouchers = Table("example_vouchers", metadata,
                 Column("id", String(40), primary_key=True), Column("email", String(200)),
                 Column("booking", String(40)), Column("at", DateTime(timezone=True)))

_engines: dict[str, Any] = {}


@sw.on_upgrade
def create_tables(database_url: str) -> None:
    """The example's migration step (idempotent; on PostgreSQL two releases that run at
    once take turns on an advisory lock instead of racing)."""
    eng = make_engine(database_url)
    try:
        with eng.begin() as conn:
            if conn.dialect.name == "postgresql":
                conn.execute(text("SELECT pg_advisory_xact_lock(hashtext('example_tables'))"))
            metadata.create_all(conn)
    finally:
        eng.dispose()


class TablesMissing(RuntimeError):
    """The release step did not run on this database."""


def engine() -> Any:
    url = sw.settings.database_url
    if url not in _engines:
        _engines[url] = make_engine(url)
    return _engines[url]


def _missing(exc: DBAPIError) -> TablesMissing | None:
    text_ = str(exc.orig).lower()
    if "example_" in text_ and ("no such table" in text_ or "does not exist" in text_):
        return TablesMissing("the example's tables are missing from its database: run the "
                             "release step, `sagaworker db upgrade`")
    return None


def write(stmt: Any) -> None:
    try:
        with engine().begin() as conn:
            conn.execute(stmt)
    except DBAPIError as exc:
        missing = _missing(exc)
        if missing is None:
            raise
        raise missing from exc


def read(stmt: Any) -> list[Any]:
    try:
        with engine().connect() as conn:
            return list(conn.execute(stmt).all())
    except DBAPIError as exc:
        missing = _missing(exc)
        if missing is None:
            raise
        raise missing from exc


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:10]}"


def now() -> datetime:
    return datetime.now(UTC)


__all__ = ["TablesMissing", "bookings", "charges", "create_tables", "holds", "insert", "new_id",
           "now", "read", "select", "shipments", "update", "vouchers", "write"]
