"""Every SQLite-vs-PostgreSQL difference lives here, not as branches around the code."""

from __future__ import annotations

import contextlib
import os
import sqlite3
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import Engine, create_engine, event
from sqlalchemy.engine import make_url
from sqlalchemy.ext.compiler import compiles
from sqlalchemy.sql.functions import GenericFunction
from sqlalchemy.types import DateTime, Float

__all__ = ["POOLED", "READ_ONLY", "aware", "db_later", "db_now", "is_busy", "listens",
           "make_engine", "normalize_url", "private_file", "read_only", "seconds_between",
           "single_writer"]

#: execution option of connections that only read (on SQLite: no write lock, see below)
READ_ONLY = "sagaworker_read_only"


def normalize_url(url: str) -> str:
    """Point bare ``postgresql://`` URLs at psycopg 3 (the only driver we depend on)."""
    u = make_url(url)
    if u.drivername in ("postgresql", "postgres"):
        u = u.set(drivername="postgresql+psycopg")
    return u.render_as_string(hide_password=False)


def make_engine(url: str) -> Engine:
    """One engine per process, tuned for its dialect. Its errors do not quote their
    parameters (a tool's arguments, secrets among them): such errors reach log lines."""
    url = normalize_url(url)
    if url.startswith("sqlite"):
        private_file(make_url(url).database)
        engine = create_engine(url, connect_args={"timeout": 30, "check_same_thread": False},
                               hide_parameters=True)
        _sqlite_immediate_transactions(engine)
        return engine
    # No pool_pre_ping: it costs a round trip on every checkout (three per step). After a
    # PostgreSQL restart the first statement on a stale connection fails, SQLAlchemy
    # invalidates the whole pool, and the caller's transaction is replayed on a fresh one
    # (``_journal.retrying`` on the worker side, ``Journal.write`` on the producer side).
    engine = create_engine(url, pool_size=5, max_overflow=10, pool_recycle=1800,
                           hide_parameters=True)
    _pg_server_process(engine)
    return engine


#: a connection record's info: a pooler stands between this connection and PostgreSQL
POOLED = "sagaworker_pooled"


def _pg_server_process(engine: Engine) -> None:
    """Each new connection learns whether a pooler stands between it and PostgreSQL: the
    process id PostgreSQL's startup reply gave it (a pooler answers with a number of its
    own) against the server's ``pg_backend_pid()``. One round trip per connection made,
    none per checkout. The journal refuses a pooled connection at start (``readiness``):
    it finds a statement whose connection was lost by that process."""

    @event.listens_for(engine, "connect")
    def _connect(dbapi_conn: Any, rec: Any) -> None:
        with dbapi_conn.cursor() as cur:
            cur.execute("SELECT pg_backend_pid()")
            server = cur.fetchone()[0]
        dbapi_conn.rollback()  # (the driver opened a transaction for it)
        rec.info[POOLED] = server != dbapi_conn.info.backend_pid


def private_file(path: str | None) -> None:
    """A new SQLite journal is created readable by its owner only (0600): it holds the
    arguments in clear. SQLite gives its WAL and shared-memory files the same mode. An
    existing file keeps the mode it has; a folder that does not exist is reported later."""
    if not path or path == ":memory:" or path.startswith("file:"):
        return
    with contextlib.suppress(OSError):  # it exists (kept as it is), or its folder does not
        os.close(os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600))


def read_only(engine: Engine) -> Engine:
    """The same engine (same pool) for transactions that only read.

    On SQLite they open a plain (deferred) ``BEGIN``: a WAL reader, which takes no write
    lock, never waits for a writer and never makes one wait, and still reads one
    consistent snapshot for the whole transaction. Elsewhere the option changes nothing.
    A transaction on it must not write: it would take the lock late, and fail as busy
    when another writer committed since its snapshot.
    """
    return engine.execution_options(**{READ_ONLY: True})


def _sqlite_immediate_transactions(engine: Engine) -> None:
    # pysqlite opens transactions lazily and as DEFERRED, so two processes that both
    # read then write deadlock into "database is locked". BEGIN IMMEDIATE takes the
    # write lock up front (the SQLite analogue of our SELECT ... FOR UPDATE), and WAL
    # lets readers go on meanwhile. See the SQLAlchemy pysqlite "serializable" recipe.
    # Connections of ``read_only(engine)`` only read: a deferred BEGIN, no write lock.
    @event.listens_for(engine, "connect")
    def _connect(dbapi_conn: Any, _rec: Any) -> None:
        dbapi_conn.isolation_level = None
        cur = dbapi_conn.cursor()
        cur.execute("PRAGMA journal_mode=WAL")
        cur.execute("PRAGMA synchronous=NORMAL")
        cur.execute("PRAGMA foreign_keys=ON")
        cur.close()

    @event.listens_for(engine, "begin")
    def _begin(conn: Any) -> None:
        reads = conn.get_execution_options().get(READ_ONLY, False)
        conn.exec_driver_sql("BEGIN" if reads else "BEGIN IMMEDIATE")


#: SQLITE_BUSY and SQLITE_LOCKED (the primary codes; extended codes keep them in the low byte)
_SQLITE_BUSY_CODES = frozenset({5, 6})


def is_busy(exc: BaseException) -> bool:
    """Another writer held SQLite's write lock past the busy timeout (``database is locked``).

    Nothing was written by the transaction that got it, so it can be replayed.
    """
    orig = getattr(exc, "orig", exc)
    if not isinstance(orig, sqlite3.OperationalError):
        return False
    code = getattr(orig, "sqlite_errorcode", None)
    if code is not None:
        return (code & 0xFF) in _SQLITE_BUSY_CODES
    text = str(orig)
    return "database is locked" in text or "database is busy" in text


def listens(engine: Engine) -> bool:
    """PostgreSQL tells listeners when a saga changes (``LISTEN/NOTIFY``, ``_notify``)."""
    return engine.dialect.name == "postgresql"


def single_writer(engine: Engine) -> bool:
    """One writer at a time for the whole database (SQLite): long jobs leave gaps."""
    return engine.dialect.name == "sqlite"


def aware(dt: datetime | None) -> datetime | None:
    """SQLite hands back naive datetimes; every time we store is UTC."""
    if dt is None or dt.tzinfo is not None:
        return dt
    return dt.replace(tzinfo=UTC)


class seconds_between(GenericFunction[float]):
    """Seconds from the first timestamp to the second, on either dialect."""

    type = Float()
    inherit_cache = True


@compiles(seconds_between, "postgresql")
def _pg_seconds(element: Any, compiler: Any, **kw: Any) -> str:
    start, end = list(element.clauses)
    return (f"EXTRACT(EPOCH FROM ({compiler.process(end, **kw)} - "
            f"{compiler.process(start, **kw)}))")


@compiles(seconds_between, "sqlite")
def _sqlite_seconds(element: Any, compiler: Any, **kw: Any) -> str:
    start, end = list(element.clauses)
    return (f"((julianday({compiler.process(end, **kw)}) - "
            f"julianday({compiler.process(start, **kw)})) * 86400.0)")



# -- the database's clock ---------------------------------------------------------------
# Leases are measured on the database's clock, never on each host's: a worker whose clock
# runs ahead would otherwise take a live attempt for dead. On SQLite (one host by nature)
# the same expression reads the same clock every process on that host shares.
_SQLITE_TS = "strftime('%Y-%m-%d %H:%M:%f000', 'now'"


class db_now(GenericFunction[datetime]):
    """The database's current time (statement time on PostgreSQL)."""

    type = DateTime(timezone=True)
    inherit_cache = True


class db_later(GenericFunction[datetime]):
    """The database's current time plus a number of seconds (negative: earlier)."""

    type = DateTime(timezone=True)
    inherit_cache = True


@compiles(db_now, "postgresql")
def _pg_now(element: Any, compiler: Any, **kw: Any) -> str:
    return "statement_timestamp()"


@compiles(db_now, "sqlite")
def _sqlite_now(element: Any, compiler: Any, **kw: Any) -> str:
    return f"{_SQLITE_TS})"


@compiles(db_later, "postgresql")
def _pg_later(element: Any, compiler: Any, **kw: Any) -> str:
    (secs,) = list(element.clauses)
    return (f"(statement_timestamp() + make_interval(secs => "
            f"CAST({compiler.process(secs, **kw)} AS double precision)))")


@compiles(db_later, "sqlite")
def _sqlite_later(element: Any, compiler: Any, **kw: Any) -> str:
    (secs,) = list(element.clauses)
    return f"{_SQLITE_TS}, ({compiler.process(secs, **kw)}) || ' seconds')"
