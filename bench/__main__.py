"""``python -m bench``: every measurement side by side, a table, and bench/results.json."""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from importlib import metadata
from pathlib import Path
from typing import Any

import psutil
import psycopg

from bench import aio, suites

BROKERS = {"rabbitmq": "amqp://guest:guest@127.0.0.1:5672//",
           "redis": "redis://127.0.0.1:6379/12"}
RESULTS = Path(__file__).resolve().parent / "results.json"


def versions() -> dict[str, str]:
    out = {"python": platform.python_version()}
    for pkg in ("sagaworker", "celery", "kombu", "SQLAlchemy", "psycopg", "redis", "dbos"):
        try:
            out[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            out[pkg] = "not installed"
    with psycopg.connect(suites.PG_ADMIN) as conn:
        row = conn.execute("SHOW server_version").fetchone()
        out["postgresql"] = str(row[0]) if row else "?"
    return out


def machine() -> dict[str, Any]:
    return {"nproc": os.cpu_count(), "memory_gib": round(psutil.virtual_memory().total / 2**30, 1),
            "platform": platform.platform()}


def log(msg: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench", description=__doc__)
    p.add_argument("--steps", type=int, default=800, help="steps per throughput round")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--sagas", type=int, default=40, help="3-step sagas per latency round")
    p.add_argument("--threads", type=int, default=4, help="saga client threads")
    p.add_argument("--big", default="1000,100000,1000000",
                   help="journal sizes for the big-journal runs ('' skips them)")
    p.add_argument("--big-steps", type=int, default=400)
    p.add_argument("--brokers", default="rabbitmq,redis")
    p.add_argument("--no-dbos", action="store_true")
    p.add_argument("--keep-db", action="store_true")
    p.add_argument("--quick", action="store_true", help="tiny sizes, to check the harness")
    a = p.parse_args(argv)
    if a.quick:
        a.steps, a.rounds, a.sagas, a.big, a.big_steps = 100, 1, 8, "1000", 100
    run = f"{int(time.time()) % 100000}{os.getpid() % 1000}"
    results: dict[str, Any] = {"machine": machine(), "versions": versions(), "run": run,
                               "argv": sys.argv[1:], "started": time.strftime("%FT%T%z")}
    dbos_mod: Any = None
    main_db, rows_db = f"bench_sw_{run}", f"bench_sw_{run}_rows"
    db_url = suites.create_database(main_db)
    log(f"database {main_db}")
    suites.prepare_schema(db_url, BROKERS["rabbitmq"], run)
    if not a.no_dbos:
        try:
            from bench import dbos_bench

            dbos_bench.launch(db_url)
            dbos_mod = dbos_bench
        except Exception as exc:  # report it, measure the rest
            results["dbos_error"] = f"{type(exc).__name__}: {exc}"
            log(f"DBOS unavailable: {exc}")
    t_start = time.perf_counter()
    try:
        results["step_throughput"], results["rss_mib"] = {}, {}
        for bname in [b for b in a.brokers.split(",") if b]:
            log(f"{bname}: starting workers")
            b = suites.Bench(run, bname, BROKERS[bname], db_url,
                             ("bare", "minimal", "minimal_pf4", "sagaworker"))
            try:
                log(f"{bname}: step throughput")
                results["step_throughput"][bname] = suites.step_throughput(b, a.steps, a.rounds)
                results["rss_mib"][bname] = {"idle": b.rss_idle, "after_load": b.rss()}
                if bname == "rabbitmq":
                    log("saga latency")
                    results["saga"] = suites.saga_latency(b, a.sagas, a.threads, a.rounds,
                                                          dbos_mod)
                    log("compensation")
                    results["compensation"] = suites.compensation(b, (1, 10, 100), a.rounds)
                    log("fan-out")
                    results["fan_out"] = suites.fan_out(b, 100, a.rounds)
                    log("asyncio: loop stalls and waits")
                    results["asyncio"] = aio.run(b, a.rounds)
            finally:
                b.close()
        sizes = tuple(int(x) for x in a.big.split(",") if x)
        if sizes:
            rows_url = suites.create_database(rows_db)
            suites.prepare_schema(rows_url, BROKERS["rabbitmq"], run)
            log(f"big journal {sizes}")
            b = suites.Bench(run, "rows", BROKERS["rabbitmq"], rows_url,
                             ("minimal", "sagaworker"))
            try:
                results["big_journal"] = suites.big_journal(b, sizes, a.big_steps, a.rounds)
                log("prune, then step throughput again")
                results["after_prune"] = suites.after_prune(b, a.big_steps, a.rounds)
            finally:
                b.close()
    finally:
        if dbos_mod is not None:
            dbos_mod.shutdown()
        if not a.keep_db:
            for name in (main_db, rows_db):
                try:
                    suites.drop_database(name)
                except Exception as exc:
                    log(f"could not drop {name}: {exc}")
    results["wall_seconds"] = round(time.perf_counter() - t_start, 1)
    results["retried_rounds"] = suites.RETRIES
    RESULTS.write_text(json.dumps(results, indent=2, default=str) + "\n")
    from bench.report import render

    print(render(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
