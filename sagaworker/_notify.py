"""Waiting for the journal to change: PostgreSQL ``LISTEN/NOTIFY``, else a capped backoff.

On PostgreSQL, migration ``0003`` installs triggers that ``pg_notify('sagaworker',
saga_id)`` in the very transaction that moves an entry to an outcome or a saga to a
terminal status, so the notification is sent exactly when the change commits. One
listener thread per process and database holds one dedicated connection that
``LISTEN``\\ s, and wakes the calls waiting on that saga (``Step.result``, ``Saga.wait``,
``sw.saga``). Each call still reads the journal itself: a notification only says "look
again", so a duplicate or a stray one costs one read and a lost one costs at most
:data:`SAFETY_POLL` seconds.

Whenever the listener is not known to be up (starting, its connection lost and being
re-made, the triggers missing because ``sagaworker db upgrade`` was not run) the calls
poll with today's backoff (5 ms growing to 50 ms). After a reconnect every waiting call
is woken once, since notifications sent meanwhile were lost.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from sqlalchemy import Engine

from ._logging import get_logger

__all__ = ["CHANNEL", "TRIGGERS", "Notifier", "Wake"]

_log = get_logger()

#: the channel the triggers notify on; the payload is the saga id
CHANNEL = "sagaworker"
#: the triggers of migration 0003 (the listener checks both exist before relying on them)
TRIGGERS = ("sagaworker_entries_notify", "sagaworker_sagas_notify")
#: while listening, a waiting call still reads the journal this often (a safety net)
SAFETY_POLL = 1.0
#: the backoff used while not listening (today's: 5 ms, x1.5 each time, capped at 50 ms)
FIRST_DELAY, MAX_DELAY = 0.005, 0.05
#: the listener closes its connection after this long with nobody waiting
IDLE_CLOSE = 30.0
#: how long the listener waits before retrying a lost connection or missing triggers
RETRY_AFTER = 2.0
#: a missing trigger is looked for again this often
RECHECK_TRIGGERS = 30.0
#: the listener pings its connection this often (a silently dead one is then noticed)
PING_EVERY = 30.0


class Wake:
    """What a waiting call sleeps on: a notification for its saga, or the timeout."""

    def __init__(self, notifier: Notifier | None) -> None:
        self._notifier = notifier
        self._event = threading.Event()

    @property
    def listening(self) -> bool:
        """Notifications for this saga will arrive (long sleeps are then safe)."""
        return self._notifier is not None and self._notifier.listening

    def arm(self) -> None:
        """Called before each read of the journal: a notification after it is not missed."""
        self._event.clear()

    def sleep(self, seconds: float) -> None:
        if seconds <= 0:
            return
        if self._notifier is None:
            time.sleep(seconds)
        else:
            self._event.wait(seconds)

    def set(self) -> None:
        self._event.set()


class Notifier:
    """The process's listener on one PostgreSQL journal (made by ``Journal.watch``)."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self._lock = threading.Lock()
        self._reset()

    def _reset(self) -> None:
        self._pid = os.getpid()
        self._waiting: dict[str, set[Wake]] = {}
        self._thread: threading.Thread | None = None
        self._idle_since = time.monotonic()
        self.listening = False

    @contextmanager
    def watch(self, saga_id: str) -> Iterator[Wake]:
        wake = Wake(self)
        with self._lock:
            if self._pid != os.getpid():  # a forked child: the parent's thread is not here
                self._reset()
            self._waiting.setdefault(saga_id, set()).add(wake)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, daemon=True,
                                                name="sagaworker-listener")
                self._thread.start()
        try:
            yield wake
        finally:
            with self._lock:
                woken = self._waiting.get(saga_id)
                if woken is not None:
                    woken.discard(wake)
                    if not woken:
                        del self._waiting[saga_id]
                if not self._waiting:
                    self._idle_since = time.monotonic()

    # -- the listener thread ------------------------------------------------------------

    def _wake(self, saga_id: str | None) -> None:
        with self._lock:
            if saga_id is None:
                wakes = [w for ws in self._waiting.values() for w in ws]
            else:
                wakes = list(self._waiting.get(saga_id, ()))
        for w in wakes:
            w.set()

    def _idle(self, grace: float = IDLE_CLOSE) -> bool:
        """Nobody waits since ``grace`` seconds: the thread ends (and says so under the lock)."""
        with self._lock:
            if self._waiting or time.monotonic() - self._idle_since < grace:
                return False
            self._thread = None
            self.listening = False
            return True

    def _run(self) -> None:
        while True:
            conn = None
            try:
                conn = self._connect()
                if not _has_triggers(conn):
                    _log.info("notify_unavailable", reason="the journal's notify triggers "
                              "are missing (run `sagaworker db upgrade`); waiting polls")
                    if self._pause(conn, RECHECK_TRIGGERS):
                        return
                    continue
                conn.execute(f"LISTEN {CHANNEL}")
                self.listening = True
                self._wake(None)  # what changed before LISTEN was not notified
                last_ping = time.monotonic()
                while True:
                    # psycopg keeps what arrives between two calls (the ping's included)
                    for note in conn.notifies(timeout=1.0):
                        self._wake(note.payload)
                    if self._idle():
                        self._close(conn)
                        return
                    if time.monotonic() - last_ping > PING_EVERY:
                        conn.execute("SELECT 1")
                        last_ping = time.monotonic()
            except Exception as exc:  # a lost connection, a restart: poll, then reconnect
                self.listening = False
                self._wake(None)
                if self._idle(grace=0.0):  # nobody to reconnect for
                    self._close(conn)
                    return
                _log.warning("notify_lost", error=f"{type(exc).__name__}: "
                             f"{str(exc).splitlines()[0][:200] if str(exc) else ''}",
                             retry_in_s=RETRY_AFTER)
                if self._pause(conn, RETRY_AFTER):
                    return

    def _pause(self, conn: Any, seconds: float) -> bool:
        """Not listening for a while; True when the thread should end (nobody waits)."""
        self.listening = False
        self._close(conn)
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            if self._idle():
                return True
            time.sleep(min(0.5, max(0.0, end - time.monotonic())))
        return self._idle()

    def _connect(self) -> Any:
        """A connection of its own (the engine's connect arguments), detached from the pool."""
        raw = self.engine.raw_connection()
        conn = raw.driver_connection
        raw.detach()
        if conn is None:
            raise RuntimeError("the engine gave no driver connection")
        conn.rollback()
        conn.autocommit = True
        return conn

    @staticmethod
    def _close(conn: Any) -> None:
        # (a forked child never runs this thread: psycopg itself leaves a connection made
        # in another process open, so the parent's listener is not disturbed)
        if conn is not None:
            with contextlib.suppress(Exception):  # it is being thrown away
                conn.close()


def _has_triggers(conn: Any) -> bool:
    row = conn.execute("SELECT count(DISTINCT tgname) FROM pg_trigger "
                       "WHERE tgname = ANY(%s) AND NOT tgisinternal", [list(TRIGGERS)]).fetchone()
    return bool(row and row[0] == len(TRIGGERS))
