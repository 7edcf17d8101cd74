"""What every measurement stands on: the figures' statistics, the databases, the brokers,
a set of systems with a running worker each on one broker (``Bench``), and a round run again
when shared services stalled it."""

from __future__ import annotations

import contextlib
import statistics
import time
from collections.abc import Callable
from typing import Any

import psycopg
from sqlalchemy import text

from bench.apps import GUARDED_DDL, MINIMAL_DDL, System, counter, make_system
from bench.workers import Worker

BROKERS = {"rabbitmq": "amqp://guest:guest@127.0.0.1:5672//",
           "redis": "redis://127.0.0.1:6379/12"}
PG_ADMIN = "postgresql://root@127.0.0.1:5432/postgres"


def median(xs: list[float]) -> float:
    return float(statistics.median(xs)) if xs else float("nan")


def spread(xs: list[float]) -> float:
    """(max - min) / median of a figure's rounds: how steady it is."""
    return (max(xs) - min(xs)) / median(xs) if xs and median(xs) else 0.0


def pctl(xs: list[float], q: float) -> float:
    s = sorted(xs)
    if not s:
        return float("nan")
    return s[min(len(s) - 1, max(0, round(q * (len(s) - 1))))]


# -- databases -------------------------------------------------------------------


def create_database(name: str) -> str:
    with psycopg.connect(PG_ADMIN, autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}"')
        conn.execute(f'CREATE DATABASE "{name}"')
    return f"postgresql+psycopg://root@127.0.0.1:5432/{name}"


def drop_database(name: str) -> None:
    with psycopg.connect(PG_ADMIN, autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def prepare_schema(db_url: str, broker: str, run: str) -> None:
    """sagaworker's journal (``sw.create_schema``) and the hand-written journals' tables."""
    sw_sys = make_system("sagaworker", broker=broker, db_url=db_url, queue=f"{run}-schema")
    sw_sys.sw.create_schema()
    with sw_sys.sw.journal.engine.begin() as conn:
        conn.execute(text(MINIMAL_DDL))
        conn.execute(text(GUARDED_DDL))
    sw_sys.sw.journal.engine.dispose()


# -- a set of systems on one broker ---------------------------------------------------


class Bench:
    """Producer-side apps and one running worker per system, on one broker and database."""

    def __init__(self, run: str, broker_name: str, broker: str, db_url: str,
                 systems: tuple[str, ...]) -> None:
        self.run, self.broker_name, self.broker, self.db_url = run, broker_name, broker, db_url
        self.systems: dict[str, System] = {}
        self.workers: dict[str, Worker] = {}
        self.rss_idle: dict[str, float] = {}
        for name in systems:
            queue = f"bench-{run}-{broker_name}-{name}"
            self.systems[name] = make_system(name, broker=broker, db_url=db_url, queue=queue)
        for name, system in self.systems.items():
            self.workers[name] = Worker(name, broker=broker, db_url=db_url,
                                        queue=system.queue, app=system.app)
        for name, w in self.workers.items():
            w.wait_ready()
            time.sleep(0.5)
            self.rss_idle[name] = w.rss_mib()
        self._n = 0
        #: more workers on the same queues (bench.ceiling)
        self.extra: list[Worker] = []

    def tag(self, what: str) -> str:
        self._n += 1
        return f"{self.run}-{self.broker_name}-{what}-{self._n}"

    def rss(self) -> dict[str, float]:
        return {name: w.rss_mib() for name, w in self.workers.items()}

    def close(self) -> None:
        for w in self.workers.values():
            w.terminate()
        for w in self.workers.values():
            w.stop()
        for system in self.systems.values():
            queues = [system.queue] + ([f"{system.queue}.sw"] if system.sw else [])
            try:
                with system.app.connection_for_write() as conn:
                    chan = conn.default_channel
                    for q in queues:
                        with contextlib.suppress(Exception):  # already gone
                            chan.queue_delete(q)
            except Exception:  # cleanup only
                pass
            if system.sw is not None and system.sw.rt.journal_made:
                system.sw.journal.engine.dispose()


class Stalled(TimeoutError):
    """A round made no progress (a broker or Redis restart by someone else, say)."""


def wait_counter(key: str, n: int, timeout: float, stall: float = 20) -> None:
    r = counter()
    deadline = time.monotonic() + timeout
    last, moved = -1, time.monotonic()
    while (got := int(r.get(key) or 0)) < n:
        t = time.monotonic()
        if got != last:
            last, moved = got, t
        if t > deadline or t - moved > stall:
            raise Stalled(f"only {got} of {n} steps ran (no progress for {t - moved:.0f} s)")
        time.sleep(0.002)


RETRIES: list[str] = []


def retried(fn: Callable[[], Any], what: str, tries: int = 3) -> Any:
    """Run one round; a stalled round (shared services restarted under us) is re-run."""
    for i in range(tries):
        try:
            return fn()
        except (TimeoutError, OSError) as exc:
            RETRIES.append(f"{what}: {type(exc).__name__}: {exc}")
            if i == tries - 1:
                raise
            time.sleep(3)
    raise AssertionError("unreachable")
