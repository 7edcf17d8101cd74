"""The embedded SQLite journal sets itself up, and keeps up with the code.

A real database migrates with ``sagaworker db upgrade`` (a release step). The embedded
journal (the default ``sqlite:///sagaworker.db``) has no release step: the first process
makes its tables and stamps them with the code's revision, so that a later release finds
it older and says to run ``sagaworker db upgrade`` (which then works), as for any other
journal. A journal made by a release before the stamp (tables, no revision: ``db
upgrade`` could not start on it) gets the columns it lacks and the stamp.
"""

from __future__ import annotations

from sqlalchemy import Connection, Engine, inspect, text

from .._base.errors import ConfigurationError
from .readiness import VERSION_TABLE, _revisions
from .schema import metadata

__all__ = ["set_up"]


def set_up(engine: Engine) -> None:
    """Make or complete the embedded journal on ``engine`` (a stamped one is left to the
    schema check: an older revision is refused, naming ``db upgrade``)."""
    head = _revisions()[0]
    with engine.connect() as conn:
        if inspect(conn).has_table(VERSION_TABLE):
            return
    # one transaction (BEGIN IMMEDIATE): of processes starting together, one sets it up
    with engine.begin() as conn:
        metadata.create_all(conn)
        _add_missing_columns(conn)
        for table in metadata.sorted_tables:  # create_all skips an existing table's indexes
            for index in table.indexes:
                index.create(conn, checkfirst=True)
        conn.execute(text(f"CREATE TABLE IF NOT EXISTS {VERSION_TABLE} (version_num "
                          f"VARCHAR(32) NOT NULL, CONSTRAINT {VERSION_TABLE}_pkc "
                          "PRIMARY KEY (version_num))"))
        conn.execute(text(f"INSERT INTO {VERSION_TABLE} (version_num) SELECT :head "
                          f"WHERE NOT EXISTS (SELECT 1 FROM {VERSION_TABLE})"), {"head": head})


def _add_missing_columns(conn: Connection) -> None:
    """Columns a journal made before its revision was stamped lacks (each nullable, with
    no default: added as they are)."""
    insp = inspect(conn)
    for table in metadata.sorted_tables:
        have = {c["name"] for c in insp.get_columns(table.name)}
        for col in table.columns:
            if col.name in have:
                continue
            if not col.nullable or col.server_default is not None:
                raise ConfigurationError(
                    f"the embedded journal lacks column {table.name}.{col.name}, which cannot "
                    "be added in place: run `sagaworker -A MODULE db upgrade`, or start "
                    "with a new journal file")
            kind = col.type.compile(dialect=conn.dialect)
            conn.execute(text(f'ALTER TABLE {table.name} ADD COLUMN "{col.name}" {kind}'))
