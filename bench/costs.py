"""The per-step cost sheet: what one step costs each part of the machine, per system.

``python -m bench.costs [--steps 1000] [--rounds 3] [--broker rabbitmq]`` runs step rounds
of the minimal journal and of sagaworker (the step-throughput setup of ``python -m bench``)
and reports, per step and as medians of the rounds:

* CPU milliseconds (user + system) of the producer (this process), the worker tree,
  PostgreSQL's backends, the broker and Redis (psutil, before/after the round);
* PostgreSQL commits, rows inserted/updated/fetched and WAL bytes (``pg_stat_database``,
  ``pg_current_wal_lsn``);
* log bytes the worker wrote.

The CPU figures are what explains the throughput ratio on a shared 2-core machine: the
producer, the workers, PostgreSQL and the broker all draw on the same cores.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import psutil
import psycopg

from bench import harness, suites
from bench.apps import counter
from bench.harness import BROKERS

#: RabbitMQ's processes (the worker's own command line names the broker too: not those)
_ERLANG = ("/usr/lib/erlang", "erl_child_setup", "inet_gethost", "epmd")
PARTS = ("producer", "worker", "postgres", "broker", "redis")


def _procs(b: harness.Bench, name: str) -> dict[str, list[psutil.Process]]:
    root = psutil.Process(b.workers[name].proc.pid)
    out: dict[str, list[psutil.Process]] = {
        "producer": [psutil.Process(os.getpid())],
        "worker": [root, *root.children(recursive=True)],
        "postgres": [], "broker": [], "redis": []}
    for p in psutil.process_iter(["name", "cmdline"]):
        cmd = " ".join(p.info["cmdline"] or [])
        if p.info["name"] == "postgres" or cmd.startswith("postgres"):
            out["postgres"].append(p)
        elif "beam.smp" in (p.info["name"] or "") or cmd.startswith(_ERLANG):
            out["broker"].append(p)
        elif (p.info["name"] or "").startswith("redis-server"):
            out["redis" if b.broker_name != "redis" else "broker"].append(p)
    return out


def _cpu(procs: list[psutil.Process]) -> dict[int, float]:
    got = {}
    for p in procs:
        try:
            t = p.cpu_times()
            got[p.pid] = t.user + t.system
        except psutil.Error:
            pass
    return got


def _pg(dbname: str) -> dict[str, int]:
    with psycopg.connect(harness.PG_ADMIN, autocommit=True) as conn:
        row = conn.execute(
            "SELECT xact_commit, tup_inserted, tup_updated, tup_fetched, tup_returned, "
            "pg_current_wal_lsn() - '0/0'::pg_lsn FROM pg_stat_database WHERE datname = %s",
            (dbname,)).fetchone()
    assert row is not None
    keys = ("commits", "inserted", "updated", "fetched", "returned", "wal_bytes")
    return dict(zip(keys, (int(x) for x in row), strict=True))


def measure(b: harness.Bench, dbname: str, name: str, n: int,
            per_saga: int = 10) -> dict[str, float]:
    """One round of ``n`` steps of ``name``; costs per step."""
    # the children of the postgres postmaster come and go: list them fresh, after a settle
    time.sleep(0.7)  # pg_stat_database is updated at most every 500 ms
    procs = _procs(b, name)
    before = {part: _cpu(ps) for part, ps in procs.items()}
    pg0 = _pg(dbname)
    log0 = b.workers[name].log_path.stat().st_size
    res = suites.step_round(b, name, n, per_saga=per_saga)
    time.sleep(0.7)
    pg1 = _pg(dbname)
    out: dict[str, float] = {"steps_per_s": res["steps_per_s"]}
    procs_after = _procs(b, name)
    for part in PARTS:
        after = _cpu(procs_after[part])
        # processes that existed before count their delta; new ones (a backend) all of it
        spent = sum(t - before[part].get(pid, 0.0) for pid, t in after.items())
        out[f"cpu_ms_{part}"] = 1000 * spent / n
    out["cpu_ms_total"] = sum(out[f"cpu_ms_{p}"] for p in PARTS)
    for k in pg0:
        out[f"pg_{k}"] = (pg1[k] - pg0[k]) / n
    out["log_bytes"] = (b.workers[name].log_path.stat().st_size - log0) / n
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.costs", description=__doc__)
    p.add_argument("--steps", type=int, default=1000)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--broker", default="rabbitmq", choices=sorted(BROKERS))
    p.add_argument("--per-saga", type=int, default=10,
                   help="sagaworker steps per saga (the round's steps over n/per-saga sagas)")
    p.add_argument("--json", action="store_true")
    a = p.parse_args(argv)
    run = f"costs{os.getpid()}"
    dbname = f"bench_sw_{run}"
    db_url = harness.create_database(dbname)
    harness.prepare_schema(db_url, BROKERS["rabbitmq"], run)
    if os.environ.get("COSTS_SQL"):  # an experiment on the schema (DDL), before the run
        with psycopg.connect(db_url.replace("+psycopg", ""), autocommit=True) as conn:
            conn.execute(os.environ["COSTS_SQL"])
    b = harness.Bench(run, a.broker, BROKERS[a.broker], db_url, ("minimal", "sagaworker"))
    per: dict[str, list[dict[str, float]]] = {"minimal": [], "sagaworker": []}
    try:
        for name in per:
            suites.step_round(b, name, 100)  # warm-up
        for r in range(a.rounds):
            order = list(per) if r % 2 == 0 else list(reversed(per))
            for name in order:
                per[name].append(measure(b, dbname, name, a.steps, a.per_saga))
    finally:
        b.close()
        counter().close()
        harness.drop_database(dbname)
    table = {name: {k: statistics.median(x[k] for x in rs) for k in rs[0]}
             for name, rs in per.items()}
    if a.json:
        print(json.dumps(table, indent=2))
        return 0
    keys = list(table["minimal"])
    print(f"| per step ({a.broker}, {a.steps} steps, median of {a.rounds}) | minimal | "
          "sagaworker | sw - minimal |")
    print("|---|---|---|---|")
    for k in keys:
        m, s = table["minimal"][k], table["sagaworker"][k]
        print(f"| {k} | {m:.2f} | {s:.2f} | {s - m:+.2f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
