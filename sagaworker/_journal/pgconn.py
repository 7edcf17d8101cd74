"""A statement on PostgreSQL in one round trip: run in autocommit on the driver's
connection, taken from the engine's pool (``run``), for the moves' one-statement writes
(``_machine.pgfast``: no ``BEGIN`` and ``COMMIT`` round trips, no SQL built per call).

Failures keep the journal's rules: a connection error becomes SQLAlchemy's
``OperationalError`` (so ``_journal.retrying`` replays a worker's move, which is a
compare-and-set recognised by its token), the broken connection is discarded with the
pool's others (after a PostgreSQL restart they are all stale), and a statement whose
connection was lost is waited for until its server process is done with it (``settle``),
so what it did is visible before anyone looks.
"""

from __future__ import annotations

import contextlib
import time
from typing import Any, NamedTuple

import psycopg
from psycopg.pq import TransactionStatus
from sqlalchemy import Engine
from sqlalchemy.exc import DBAPIError, StatementError

from .dialect import POOLED

__all__ = ["Place", "backend_pid", "enabled", "run", "settle"]


class Place(NamedTuple):
    """The saga's nonce a statement seals values for (a journal with keys)."""

    nonce: str | None


def enabled(engine: Engine) -> bool:
    return engine.dialect.name == "postgresql" and engine.dialect.driver == "psycopg"


def run(engine: Engine, sql: str, params: dict[str, Any]) -> tuple[Any, ...] | None:
    """One statement in autocommit; its first row."""
    try:
        raw = engine.raw_connection()
    except psycopg.Error as exc:  # the pool does not translate a failed connect
        raise _translated(engine, sql, params, exc, None) from exc
    try:
        pg: psycopg.Connection[Any] = raw.driver_connection  # type: ignore[assignment]
        pid = None if raw.info.get(POOLED) else pg.info.backend_pid
        try:
            pg.autocommit = True
            row = pg.execute(sql, params).fetchone()
            pg.autocommit = False  # the pool hands out transactional connections
            return row
        except psycopg.Error as exc:
            if pg.broken or pg.info.transaction_status != TransactionStatus.IDLE:
                _discard(engine, raw, exc, stale=pg.broken)
            else:
                pg.autocommit = False  # a refused statement: the connection is fine
            raise _translated(engine, sql, params, exc, pid) from exc
        except BaseException:
            # interrupted mid-statement (a soft time limit, a gevent timeout): the
            # connection's state is unknown, so it never goes back to the pool
            if pg.info.transaction_status != TransactionStatus.IDLE or pg.autocommit:
                _discard(engine, raw, None, stale=False)
            raise
    finally:
        raw.close()


def _discard(engine: Engine, raw: Any, exc: BaseException | None, *, stale: bool) -> None:
    """Throw this connection away; after a lost connection, the pool's older ones too
    (what SQLAlchemy does on a disconnect: they are replaced lazily, at checkout)."""
    invalidate_all = getattr(engine.pool, "_invalidate", None)
    if stale and invalidate_all is not None:
        invalidate_all(raw, exc)
    else:
        raw.invalidate(exc)


def _translated(engine: Engine, sql: str, params: dict[str, Any], exc: psycopg.Error,
                pid: int | None) -> StatementError:
    # parameters hidden as on the engine: they are a tool's arguments and results
    err = DBAPIError.instance(sql, params, exc, psycopg.Error, dialect=engine.dialect,
                              connection_invalidated=isinstance(exc, psycopg.OperationalError),
                              hide_parameters=True)
    err.sagaworker_backend_pid = pid  # type: ignore[attr-defined]
    return err


_ACTIVITY = "SELECT state FROM pg_stat_activity WHERE pid = %(pid)s"
_TERMINATE = "SELECT pg_terminate_backend(%(pid)s)"


def backend_pid(conn: Any) -> int | None:
    """The PostgreSQL server process of a SQLAlchemy connection (None elsewhere, and
    behind a pooler, whose process ids are not the server's)."""
    proxied = getattr(conn, "connection", None)
    if getattr(proxied, "info", {}).get(POOLED):
        return None
    raw = getattr(proxied, "dbapi_connection", None)
    info = getattr(raw, "info", None)
    pid = getattr(info, "backend_pid", None)
    return pid if isinstance(pid, int) else None


def settle(engine: Engine, exc: BaseException, *, timeout: float = 10.0) -> None:
    """After a statement's connection was lost, wait until its server process is done
    with it, so that what it did is visible (or known not to happen).

    A statement can outlive its client: waiting on a row lock when the socket dropped, it
    may still commit later. Its backend is stopped (``pg_terminate_backend``: a statement
    waiting or running is rolled back, a COMMIT under way completes) and awaited. Raises
    TimeoutError when that backend does not go away.
    """
    pid = getattr(exc, "sagaworker_backend_pid", None)
    if pid is None:
        return
    deadline = time.monotonic() + timeout
    stopped = False
    while True:
        row = run(engine, _ACTIVITY, {"pid": pid})
        if row is None or row[0] != "active":
            return
        if not stopped:
            stopped = True
            with contextlib.suppress(DBAPIError):  # not allowed to: wait for it instead
                run(engine, _TERMINATE, {"pid": pid})
        if time.monotonic() > deadline:
            raise TimeoutError(f"PostgreSQL backend {pid} still runs a statement whose "
                               "connection was lost")
        time.sleep(0.05)
