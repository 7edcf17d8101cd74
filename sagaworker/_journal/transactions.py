"""The journal's transactions: a whole one retried on a lost connection (``retrying``),
and a write replayed when it failed before COMMIT and answered from the data when only
its COMMIT's reply was lost (``write``)."""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from typing import ParamSpec, TypeVar

from sqlalchemy import Connection, Engine
from sqlalchemy.exc import InterfaceError, OperationalError

from .._observe.logging import get_logger
from . import pgconn
from .dialect import is_busy

__all__ = ["BUSY_RETRY_SECONDS", "DB_RETRY_SECONDS", "retrying", "write"]

_log = get_logger()
_T = TypeVar("_T")
_P = ParamSpec("_P")
#: how long a worker-side transaction is retried while the database is unreachable
DB_RETRY_SECONDS = 60.0
#: how long a producer write is replayed while SQLite stays busy (after its busy timeout)
BUSY_RETRY_SECONDS = 5.0


def retrying(fn: Callable[_P, _T]) -> Callable[_P, _T]:
    """Retry one whole transaction on a lost connection (a PostgreSQL restart, a failover).

    Safe because every transition is a compare-and-set: replaying one whose commit was
    in fact applied changes nothing.
    """

    @functools.wraps(fn)
    def wrapper(*args: _P.args, **kwargs: _P.kwargs) -> _T:
        deadline = time.monotonic() + DB_RETRY_SECONDS
        delay = 0.1
        while True:
            try:
                return fn(*args, **kwargs)
            except (OperationalError, InterfaceError) as exc:
                if time.monotonic() + delay > deadline:
                    raise
                _log.warning("database_retry", error=str(exc).splitlines()[0][:200],
                             retry_in_s=delay)
                time.sleep(delay)
                delay = min(delay * 2, 2.0)

    return wrapper



def write(engine: Engine, body: Callable[[Connection], _T],
          landed: Callable[[], _T | None] | None = None) -> _T:
    """Run ``body`` in a write transaction, replayed when it failed before COMMIT.

    Replayed: a lost connection (once), and a busy SQLite (``database is locked``:
    another writer held the lock past the busy timeout) on a short backoff, for at
    most :data:`BUSY_RETRY_SECONDS`. Nothing was written in either case. A failure
    *during* COMMIT is never replayed (an insert whose commit landed would journal a
    step twice): once the server is done with the transaction (``pgconn.settle``),
    ``landed`` tells from the data whether it committed, and then what it wrote is the
    answer, as if the reply had come; otherwise the error propagates.
    """
    lost_replayed = False
    busy_until: float | None = None
    delay = 0.01
    while True:
        committing, pid = False, None
        try:
            with engine.connect() as conn:
                trans = conn.begin()  # BEGIN IMMEDIATE on SQLite: may itself be busy
                try:
                    value = body(conn)
                except BaseException:
                    trans.rollback()
                    raise
                committing = True
                pid = pgconn.backend_pid(conn)
                trans.commit()
                return value
        except (OperationalError, InterfaceError) as exc:
            if committing:
                if landed is None:
                    raise
                setattr(exc, "sagaworker_backend_pid", pid)  # noqa: B010 (for settle)
                pgconn.settle(engine, exc)
                found = landed()
                if found is None:
                    raise
                _log.warning("database_commit_reply_lost", detail="the transaction "
                             "committed (its rows are in the journal): answered from them")
                return found
            if is_busy(exc):
                t = time.monotonic()
                busy_until = t + BUSY_RETRY_SECONDS if busy_until is None else busy_until
                if t + delay > busy_until:
                    raise
                _log.info("database_busy", retry_in_s=round(delay, 3))
                time.sleep(delay)
                delay = min(delay * 2, 0.5)
                continue
            if lost_replayed:
                raise
            lost_replayed = True
