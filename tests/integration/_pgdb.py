"""A PostgreSQL database of a test's own (these tests delete rows and drop triggers)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from tests.conftest import _pg, db_name, need

ADMIN = "host=127.0.0.1 port=5432 user=root dbname=postgres"


@contextmanager
def fresh_database(prefix: str) -> Iterator[str]:
    """Create a database, migrate it with Alembic (``db upgrade``), drop it afterwards."""
    need("PostgreSQL", _pg)
    import psycopg

    from sagaworker._journal.migrate import upgrade

    name = db_name(prefix)
    with psycopg.connect(ADMIN, autocommit=True) as c:
        c.execute(f'CREATE DATABASE "{name}"')
    try:
        url = f"postgresql+psycopg://root@127.0.0.1:5432/{name}"
        upgrade(url)
        yield url
    finally:
        with psycopg.connect(ADMIN, autocommit=True) as c:
            c.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def execute(url: str, sql: str, *params: object) -> None:
    """One statement committed on a connection of its own (another process's write)."""
    import psycopg

    with psycopg.connect(url.replace("postgresql+psycopg", "postgresql"),
                         autocommit=True) as c:
        c.execute(sql, params or None)  # type: ignore[arg-type]
