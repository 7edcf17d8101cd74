"""Where the step rate stops growing with workers: the machine's CPU, or the journal.

``python -m bench.ceiling [--steps 800] [--rounds 3] [--workers 1,2,4] [--per-saga 10]``
runs the step rounds of ``python -m bench`` (one producer thread enqueues independent
steps, ``per-saga`` of them in each saga) with 1, 2 and 4 sagaworker workers (``celery
worker -P prefork -c 2`` each) on one queue, twice: with the tool's work (one Redis
``INCR``) and with it removed (a tool that returns at once). While each round runs it
samples:

* **the CPU**: the share of all cores busy (and stolen by the hypervisor), context
  switches per step (psutil), and CPU milliseconds per step of each part (producer,
  workers, PostgreSQL, broker, Redis; as ``bench.costs``). A part whose own work per step
  does not change (the producer) but whose CPU per step grows with the number of
  processes is paying for the oversubscription;
* **what PostgreSQL's backends wait on**, every 10 ms (``pg_stat_activity`` of the
  bench database, active backends only): ``Lock`` is a transaction waiting for a row or
  transaction lock another one holds (contention in the journal: a hot saga row),
  ``LWLock``/``IO`` are the server's own (WAL writes and flushes, buffers), ``running`` is
  a backend on CPU or in the run queue, ``Client`` one waiting for its client;
* **write transactions/s** and per step (transaction ids assigned: exact, where
  ``pg_stat_database``'s counters lag by up to the idle backends' flush interval), and WAL
  bytes per step.

If the cores are busy throughout and the backends rarely wait on a ``Lock``, the machine
(oversubscription) is the limit, not the journal; the opposite says contention.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading
import time
from collections import Counter
from typing import Any

import psutil
import psycopg
from sqlalchemy import text

from bench import harness
from bench.apps import _engine, counter
from bench.costs import PARTS, _cpu, _pg, _procs
from bench.harness import BROKERS
from bench.workers import Worker

_SAMPLE = """
SELECT CASE WHEN wait_event_type IS NULL THEN 'running'
            WHEN wait_event_type IN ('Lock', 'LWLock', 'IO', 'Client') THEN wait_event_type
            ELSE 'other' END,
       count(*)
FROM pg_stat_activity
WHERE datname = %s AND state = 'active' AND pid <> pg_backend_pid()
GROUP BY 1
"""
WAITS = ("running", "Lock", "LWLock", "IO", "Client", "other")


class Sampler(threading.Thread):
    """Counts, every ``every`` seconds, the bench database's active backends by wait."""

    def __init__(self, dbname: str, every: float = 0.01) -> None:
        super().__init__(daemon=True)
        self.dbname, self.every = dbname, every
        self.samples = 0
        self.waits: Counter[str] = Counter()
        self.detail: Counter[str] = Counter()
        self._halt = threading.Event()

    def run(self) -> None:
        with psycopg.connect(harness.PG_ADMIN, autocommit=True) as conn:
            while not self._halt.is_set():
                for kind, n in conn.execute(_SAMPLE, (self.dbname,)).fetchall():
                    self.waits[kind] += n
                for ev, n in conn.execute(
                        "SELECT wait_event_type || ':' || wait_event, count(*) "
                        "FROM pg_stat_activity WHERE datname = %s AND state = 'active' "
                        "AND wait_event_type IN ('Lock', 'LWLock', 'IO') GROUP BY 1",
                        (self.dbname,)).fetchall():
                    self.detail[ev] += n
                self.samples += 1
                self._halt.wait(self.every)

    def stop(self) -> dict[str, Any]:
        self._halt.set()
        self.join()
        per = max(self.samples, 1)
        out: dict[str, Any] = {f"backends_{k}": self.waits[k] / per for k in WAITS}
        out["top_waits"] = {k: round(v / per, 3) for k, v in self.detail.most_common(4)}
        return out


def _xid() -> int:
    """The next transaction id: how many write transactions the server has committed or
    begun (read-only ones take none), cluster-wide."""
    with psycopg.connect(harness.PG_ADMIN, autocommit=True) as conn:
        row = conn.execute("SELECT pg_snapshot_xmax(pg_current_snapshot())::text::bigint"
                           ).fetchone()
    assert row is not None
    return int(row[0])


def one_round(b: harness.Bench, dbname: str, tool: str, n: int, per_saga: int
              ) -> dict[str, Any]:
    """``n`` steps of ``tool``, enqueued by one thread; done when all are EXECUTED."""
    system = b.systems["sagaworker"]
    key = b.tag(f"ceiling-{tool}")
    sagas = [system.sw.begin(f"{key}-{i}") for i in range(max(1, n // per_saga))]
    procs = _procs(b, "sagaworker")
    for w in b.extra:
        root = psutil.Process(w.proc.pid)
        procs["worker"] += [root, *root.children(recursive=True)]
    before = {part: _cpu(ps) for part, ps in procs.items()}
    pg0, xid0 = _pg(dbname), _xid()
    cpu0, ctx0 = psutil.cpu_times(), psutil.cpu_stats().ctx_switches
    sampler = Sampler(dbname)
    sampler.start()
    t0 = time.perf_counter()
    for i in range(n):
        sagas[i % len(sagas)].enqueue(system.tasks[tool], key)
    ids = [s.saga_id for s in sagas]
    deadline = time.monotonic() + 300
    while True:
        with _engine(system.db_url).connect() as conn:
            done = int(conn.execute(text(
                "SELECT count(*) FROM sagaworker_entries WHERE saga_id = ANY(:ids) "
                "AND phase = 'EXECUTED'"), {"ids": ids}).scalar() or 0)
        if done >= n:
            break
        if time.monotonic() > deadline:
            raise TimeoutError(f"{done} of {n} EXECUTED")
        time.sleep(0.005)
    elapsed = time.perf_counter() - t0
    waits = sampler.stop()
    cpu1, ctx1 = psutil.cpu_times(), psutil.cpu_stats().ctx_switches
    pg1, xid1 = _pg(dbname), _xid()
    counter().delete(key)
    busy = (sum(cpu1) - cpu1.idle - cpu1.iowait) - (sum(cpu0) - cpu0.idle - cpu0.iowait)
    out: dict[str, Any] = {
        "steps_per_s": n / elapsed,
        "cpu_busy_share": busy / ((sum(cpu1) - sum(cpu0)) or 1.0),
        "cpu_steal_share": (cpu1.steal - cpu0.steal) / ((sum(cpu1) - sum(cpu0)) or 1.0),
        "ctx_switches_per_step": (ctx1 - ctx0) / n,
        "write_tx_per_s": (xid1 - xid0) / elapsed,
        "write_tx_per_step": (xid1 - xid0) / n,
        "wal_bytes_per_step": (pg1["wal_bytes"] - pg0["wal_bytes"]) / n, **waits}
    after = {part: _cpu(ps) for part, ps in procs.items()}
    for part in PARTS:
        spent = sum(t - before[part].get(pid, 0.0) for pid, t in after[part].items())
        out[f"cpu_ms_{part}"] = 1000 * spent / n
    return out


def _median(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {k: statistics.median(r[k] for r in rounds)
                           for k in rounds[0] if k != "top_waits"}
    out["rounds_steps_per_s"] = [round(r["steps_per_s"], 1) for r in rounds]
    tops: Counter[str] = Counter()
    for r in rounds:
        tops.update(r["top_waits"])
    out["top_waits"] = {k: round(v / len(rounds), 3) for k, v in tops.most_common(4)}
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.ceiling", description=__doc__)
    p.add_argument("--steps", type=int, default=800)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--workers", default="1,2,4")
    p.add_argument("--per-saga", type=int, default=10)
    p.add_argument("--broker", default="rabbitmq", choices=sorted(BROKERS))
    a = p.parse_args(argv)
    run = f"ceil{os.getpid()}"
    dbname = f"bench_sw_{run}"
    db_url = harness.create_database(dbname)
    harness.prepare_schema(db_url, BROKERS["rabbitmq"], run)
    b = harness.Bench(run, a.broker, BROKERS[a.broker], db_url, ("sagaworker",))
    system = b.systems["sagaworker"]
    table: dict[str, dict[str, Any]] = {}
    try:
        for k in (int(x) for x in a.workers.split(",")):
            while len(b.extra) < k - 1:
                w = Worker("sagaworker", broker=b.broker, db_url=db_url, queue=system.queue,
                           app=system.app, nth=len(b.extra) + 1)
                w.wait_ready()
                b.extra.append(w)
            for tool in ("noop", "idle"):
                one_round(b, dbname, tool, max(50, a.steps // 10), a.per_saga)  # warm
                got = [one_round(b, dbname, tool, a.steps, a.per_saga)
                       for _ in range(a.rounds)]
                table[f"{k} workers, {'work' if tool == 'noop' else 'no work'}"] = _median(got)
    finally:
        for w in b.extra:
            w.stop()
        b.close()
        counter().close()
        harness.drop_database(dbname)
    print(json.dumps({"broker": a.broker, "steps": a.steps, "per_saga": a.per_saga,
                      "rounds": a.rounds, "rows": table}, indent=2))
    print(render(table, a), file=sys.stderr)  # (stdout: the JSON ``python -m bench`` reads)
    return 0


def render(table: dict[str, dict[str, Any]], a: Any) -> str:
    cols = ["steps_per_s", "cpu_busy_share", "cpu_steal_share", "ctx_switches_per_step",
            "backends_running", "backends_Lock",
            "backends_LWLock", "backends_IO", "backends_Client", "write_tx_per_s",
            "write_tx_per_step", "wal_bytes_per_step", "cpu_ms_worker", "cpu_ms_postgres",
            "cpu_ms_producer", "cpu_ms_broker"]
    lines = [f"{a.broker}, {a.steps} steps a round, {a.per_saga} per saga, median of "
             f"{a.rounds}", "", "| | " + " | ".join(cols) + " |",
             "|---|" + "---|" * len(cols)]
    for name, row in table.items():
        lines.append(f"| {name} | " + " | ".join(f"{row[c]:.2f}" for c in cols) + " |")
    lines.append("")
    for name, row in table.items():
        lines.append(f"{name}: top waits {row['top_waits']}; rounds {row['rounds_steps_per_s']}")
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
