"""The example's "outside world": stock holds, card charges and shipments in SQL tables.

A real app would call an inventory service and a payment API; the example keeps its
effects in the journal's database so the demo can show them being undone.
"""

from __future__ import annotations

import uuid
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import Column, DateTime, Integer, MetaData, String, Table, insert, select, update

from sagaworker import make_engine

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

_engines: dict[str, Any] = {}


def engine() -> Any:
    from ._app import sw

    url = sw.settings.database_url
    if url not in _engines:
        _engines[url] = make_engine(url)
        metadata.create_all(_engines[url])
    return _engines[url]


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:10]}"


def write(stmt: Any) -> None:
    with engine().begin() as conn:
        conn.execute(stmt)


def read(stmt: Any) -> list[Any]:
    with engine().connect() as conn:
        return list(conn.execute(stmt).all())


def now() -> datetime:
    return datetime.now(UTC)


__all__ = ["charges", "holds", "insert", "new_id", "now", "read", "select", "shipments",
           "update", "write"]
