"""Waiting for the journal to change: PostgreSQL ``LISTEN/NOTIFY``, else a capped backoff.

On PostgreSQL, migration ``0003`` installs triggers that ``pg_notify('sagaworker',
saga_id)`` inside the very transaction that moves an entry to an outcome or a saga to a
terminal status, so the notification goes out exactly when that change commits, and only
for a saga somebody waits on: a row in the (unlogged) ``sagaworker_waiters`` table. Every
notifying commit takes PostgreSQL's cluster-wide notify lock until it is durable, which
serializes such commits (no group commit); steps nobody waits for (the asynchronous form,
flows) never pay it. ``docs/scaling.md`` has the figures.

One listener thread per process and journal holds a dedicated connection that
``LISTEN``\\ s, and wakes the calls waiting on the notified saga (``Step.result``,
``Saga.wait``, ``sw.saga``). A waiting call registers its saga (one autocommit insert,
``synchronous_commit`` off: a registration lost in a crash costs nothing), reads the
journal, and sleeps until notified; the registration outlives the call by
:data:`KEEP_REGISTERED` seconds, so the next step of a synchronous saga finds it there.
Each call still reads the journal itself: a notification only says "look again", so a
duplicate costs one read and a lost one at most :data:`SAFETY_POLL` seconds. An outcome
whose trigger ran just before the registration committed (nobody to notify yet) commits
within moments: for :data:`REGISTER_GRACE` after a registration the calls keep polling, so
that case costs a few reads, not a safety poll.

Whenever notifications for a saga are not known to arrive (the listener starting, its
connection lost and being re-made, the triggers or the table missing because
``sagaworker db upgrade`` was not run, the registration not done yet) the calls poll with
the usual backoff (5 ms growing to 50 ms). After a reconnect every waiting call re-reads.
"""

from __future__ import annotations

import contextlib
import os
import socket
import threading
import time
import uuid
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any

from sqlalchemy import Engine

from .._observe.logging import get_logger

__all__ = ["CHANNEL", "TRIGGERS", "WAITERS", "Notifier", "Wake"]

_log = get_logger()

#: the channel the triggers notify on; the payload is the saga id
CHANNEL = "sagaworker"
#: the triggers of migration 0003 (the listener checks both exist before relying on them)
TRIGGERS = ("sagaworker_entries_notify", "sagaworker_sagas_notify")
#: the sagas somebody waits on (the triggers notify only for these)
WAITERS = "sagaworker_waiters"
#: while notified, a waiting call still reads the journal this often (a safety net)
SAFETY_POLL = 1.0
#: the backoff used otherwise (5 ms, x1.5 each time, capped at 50 ms)
FIRST_DELAY, MAX_DELAY = 0.005, 0.05
#: after a saga's registration commits, waiting calls still poll this long: an outcome
#: whose trigger ran just before it (no waiter to notify) commits within it
REGISTER_GRACE = 0.1
#: a saga stays registered this long after its last waiting call ended
KEEP_REGISTERED = 10.0
#: the listener closes its connection after this long with nobody waiting
IDLE_CLOSE = 30.0
#: how long the listener waits before retrying a lost connection or missing triggers
RETRY_AFTER = 2.0
#: a missing trigger is looked for again this often
RECHECK_TRIGGERS = 30.0
#: this often the listener refreshes its registrations and drops those of dead processes
#: (older than STALE_AFTER): also the ping that notices a silently dead connection
HOUSEKEEP_EVERY, STALE_AFTER = 600.0, 86400.0

_REGISTER = (f"INSERT INTO {WAITERS} (saga_id, waiter) SELECT unnest(%s::text[]), %s "
             "ON CONFLICT (saga_id, waiter) DO UPDATE SET since = now()")


class Wake:
    """What a waiting call sleeps on: a notification for its saga, or the timeout."""

    def __init__(self, notifier: Notifier | None, saga_id: str = "") -> None:
        self._notifier = notifier
        self._saga_id = saga_id
        self._event = threading.Event()

    @property
    def listening(self) -> bool:
        """Notifications for this saga will arrive (long sleeps are then safe)."""
        return self._notifier is not None and self._notifier.notifies(self._saga_id)

    def bind(self, notifier: Notifier, saga_id: str) -> None:
        self._notifier, self._saga_id = notifier, saga_id

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
        self.waiter = f"{socket.gethostname()[:40]}:{self._pid}:{uuid.uuid4().hex[:8]}"
        self._waiting: dict[str, set[Wake]] = {}
        #: registered sagas -> when their last waiting call ended (0.0 while one waits)
        self._registered: dict[str, float] = {}
        #: sagas registered less than REGISTER_GRACE ago -> when
        self._fresh: dict[str, float] = {}
        self._thread: threading.Thread | None = None
        self._idle_since = time.monotonic()
        self.listening = False

    def registered(self, saga_id: str) -> bool:
        """Listening, and the saga registered: a wait on it registers with no round trip."""
        with self._lock:
            return self.listening and saga_id in self._registered

    def notifies(self, saga_id: str) -> bool:
        """A notification will arrive for any later outcome of the saga: listening, the
        saga registered, and not just now (an outcome being committed may have missed it)."""
        with self._lock:
            if not (self.listening and saga_id in self._registered):
                return False
            since = self._fresh.get(saga_id)
            if since is not None and time.monotonic() - since < REGISTER_GRACE:
                return False
            self._fresh.pop(saga_id, None)
            return True

    @contextmanager
    def watch(self, saga_id: str, wake: Wake | None = None, *,
              register_here: bool = True) -> Iterator[Wake]:
        """Wake ``wake`` on the saga's notifications while in the block. A saga not
        registered yet is registered here (one round trip), or, ``register_here=False``
        (a caller that must not wait on the database), by the listener's thread."""
        if wake is None:
            wake = Wake(self, saga_id)
        else:
            wake.bind(self, saga_id)
        with self._lock:
            if self._pid != os.getpid():  # a forked child: the parent's thread is not here
                self._reset()
            self._waiting.setdefault(saga_id, set()).add(wake)
            if saga_id in self._registered:
                self._registered[saga_id] = 0.0
            register = self.listening and saga_id not in self._registered
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, daemon=True,
                                                name="sagaworker-listener")
                self._thread.start()
        if register and register_here:  # else the listener registers it
            self._register_here(saga_id)
        try:
            yield wake
        finally:
            with self._lock:
                woken = self._waiting.get(saga_id)
                if woken is not None:
                    woken.discard(wake)
                    if not woken:
                        del self._waiting[saga_id]
                        if saga_id in self._registered:
                            self._registered[saga_id] = time.monotonic()
                if not self._waiting:
                    self._idle_since = time.monotonic()

    def _register_here(self, saga_id: str) -> None:
        """Register from the waiting call's thread (a pooled connection): one round trip."""
        try:
            with self.engine.begin() as conn:
                conn.exec_driver_sql("SET LOCAL synchronous_commit TO OFF")
                conn.exec_driver_sql(_REGISTER, ([saga_id], self.waiter))
        except Exception as exc:  # the listener's loop registers it instead
            _log.debug("notify_register_failed", error=f"{type(exc).__name__}: {exc}")
            return
        with self._lock:
            if self.listening and saga_id not in self._registered:
                self._registered[saga_id] = 0.0 if saga_id in self._waiting else time.monotonic()
                self._fresh[saga_id] = time.monotonic()

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

    def _lost(self) -> None:
        with self._lock:
            self.listening = False
            self._registered.clear()  # a restarted server truncated the unlogged table
            self._fresh.clear()

    def _run(self) -> None:
        while True:
            conn = None
            try:
                conn = self._connect()
                if not _installed(conn):
                    _log.info("notify_unavailable", reason="the journal's notify triggers "
                              "are missing (run `sagaworker db upgrade`); waiting polls")
                    if self._pause(conn, RECHECK_TRIGGERS):
                        return
                    continue
                conn.execute(f"LISTEN {CHANNEL}")
                with self._lock:
                    self.listening = True
                self._housekeep(conn)
                last_housekeeping = time.monotonic()
                self._wake(None)  # what changed before LISTEN was not notified
                while True:
                    # psycopg keeps what arrives between two calls (the statements' too)
                    for note in conn.notifies(timeout=1.0):
                        self._wake(note.payload)
                    if self._idle():
                        self._unregister(conn, None)
                        self._close(conn)
                        return
                    self._sync_registrations(conn)
                    if time.monotonic() - last_housekeeping > HOUSEKEEP_EVERY:
                        self._housekeep(conn)
                        last_housekeeping = time.monotonic()
            except Exception as exc:  # a lost connection, a restart: poll, then reconnect
                self._lost()
                self._wake(None)
                if self._idle(grace=0.0):  # nobody to reconnect for
                    self._close(conn)
                    return
                _log.warning("notify_lost", error=f"{type(exc).__name__}: "
                             f"{str(exc).splitlines()[0][:200] if str(exc) else ''}",
                             retry_in_s=RETRY_AFTER)
                if self._pause(conn, RETRY_AFTER):
                    return

    def _sync_registrations(self, conn: Any) -> None:
        """Register the waited sagas not registered yet; drop those nobody waited on lately."""
        cutoff = time.monotonic() - KEEP_REGISTERED
        with self._lock:
            missing = [s for s in self._waiting if s not in self._registered]
            expired = [s for s, t in self._registered.items()
                       if t and t < cutoff and s not in self._waiting]
        if missing:
            conn.execute(_REGISTER, (missing, self.waiter))
            with self._lock:
                for s in missing:
                    if s not in self._registered:
                        self._fresh[s] = time.monotonic()
                        self._registered[s] = 0.0
            self._wake(None)  # they polled until now: read once more, then sleep
        if expired:
            self._unregister(conn, expired)

    def _unregister(self, conn: Any, saga_ids: Iterable[str] | None) -> None:
        if saga_ids is None:
            conn.execute(f"DELETE FROM {WAITERS} WHERE waiter = %s", (self.waiter,))
            with self._lock:
                self._registered.clear()
                self._fresh.clear()
            return
        ids = list(saga_ids)
        conn.execute(f"DELETE FROM {WAITERS} WHERE waiter = %s AND saga_id = ANY(%s)",
                     (self.waiter, ids))
        with self._lock:
            for s in ids:  # one waited on again meanwhile is registered anew by the loop
                self._registered.pop(s, None)
                self._fresh.pop(s, None)

    def _housekeep(self, conn: Any) -> None:
        """Refresh this process's registrations, drop dead processes' ones, register all."""
        conn.execute(f"UPDATE {WAITERS} SET since = now() WHERE waiter = %s", (self.waiter,))
        conn.execute(f"DELETE FROM {WAITERS} WHERE since < now() - make_interval(secs => %s)",
                     (STALE_AFTER,))
        self._sync_registrations(conn)

    def _pause(self, conn: Any, seconds: float) -> bool:
        """Not listening for a while; True when the thread should end (nobody waits)."""
        self._lost()
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
        # its writes are registrations: losing one in a crash costs one safety-net poll
        conn.execute("SET synchronous_commit TO OFF")
        conn.execute("SET application_name TO 'sagaworker-listener'")
        return conn

    @staticmethod
    def _close(conn: Any) -> None:
        # (a forked child never runs this thread: psycopg itself leaves a connection made
        # in another process open, so the parent's listener is not disturbed)
        if conn is not None:
            with contextlib.suppress(Exception):  # it is being thrown away
                conn.close()


def _installed(conn: Any) -> bool:
    """Migration 0003 is in: both triggers and the waiters table."""
    row = conn.execute(
        "SELECT (SELECT count(DISTINCT tgname) FROM pg_trigger "
        "        WHERE tgname = ANY(%s) AND NOT tgisinternal), "
        "       to_regclass(%s) IS NOT NULL", [list(TRIGGERS), WAITERS]).fetchone()
    return bool(row and row[0] == len(TRIGGERS) and row[1])
