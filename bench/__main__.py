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

from bench import aio, harness, journal_size, producer, scaling, suites
from bench.harness import BROKERS

RESULTS = Path(__file__).resolve().parent / "results.json"
SECTIONS = ("throughput", "producer", "saga", "compensation", "fanout", "asyncio", "workers",
            "big", "check", "agents", "ceiling", "enqueue", "memory")
#: sections run as a process of their own (each its own database; DBOS's own singleton)
APART = {"check": ["bench.flows_check", "--sagas", "10000"],
         "agents": ["bench.agent_turns", "--turns", "20"],
         "ceiling": ["bench.ceiling", "--steps", "800"],
         "enqueue": ["bench.enqueue_alone", "--steps", "1000"],
         "memory": ["bench.memory", "--steps", "100000"]}
#: sections measured once, in alternating blocks of their own: no rounds
ONCE = {"bench.memory": "2000"}


def versions() -> dict[str, str]:
    out = {"python": platform.python_version()}
    for pkg in ("sagaworker", "celery", "kombu", "SQLAlchemy", "psycopg", "redis", "dbos"):
        try:
            out[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            out[pkg] = "not installed"
    with psycopg.connect(harness.PG_ADMIN) as conn:
        row = conn.execute("SHOW server_version").fetchone()
        out["postgresql"] = str(row[0]) if row else "?"
    return out


def machine() -> dict[str, Any]:
    return {"nproc": os.cpu_count(), "memory_gib": round(psutil.virtual_memory().total / 2**30, 1),
            "platform": platform.platform()}


def log(msg: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def rabbitmq_sections(results: dict[str, Any], b: harness.Bench, a: argparse.Namespace,
                      only: set[str], dbos_mod: Any) -> None:
    """The sections measured on RabbitMQ only."""
    if "producer" in only:
        log("producer: enqueue then result()")
        results["producer"] = producer.enqueue_then_result(b, a.producer_steps, a.rounds)
    if "saga" in only:
        log("saga latency")
        results["saga"] = suites.saga_latency(b, a.sagas, a.threads, a.rounds, dbos_mod)
    if "compensation" in only:
        log("compensation")
        results["compensation"] = suites.compensation(b, (1, 10, 100), a.rounds)
    if "fanout" in only:
        log("fan-out")
        results["fan_out"] = suites.fan_out(b, 100, a.rounds)
    if "asyncio" in only:
        log("asyncio: loop stalls and waits")
        results["asyncio"] = aio.run(b, a.rounds)
    if "workers" in only:  # last: it starts more workers on the queue
        log("step throughput with 1, 2, 4 workers")
        results["workers"] = scaling.workers_scaling(b, a.steps, max(3, a.rounds // 2))


def apart(argv: list[str], rounds: int, quick: bool) -> Any:
    """One benchmark module run in its own process; its JSON (or why it failed)."""
    import subprocess

    if argv[0] in ONCE:
        args = [sys.executable, "-m", argv[0], argv[1], ONCE[argv[0]] if quick else argv[2]]
    else:
        args = [sys.executable, "-m", *argv, "--rounds", str(rounds)]
        if quick:
            args = [*args[:-4], argv[1], "100" if argv[1] == "--sagas" else "3", "--rounds", "1"]
    done = subprocess.run(args, capture_output=True, text=True, timeout=3600)
    if done.returncode != 0:
        return {"error": done.stderr[-2000:]}
    return json.loads(done.stdout)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench", description=__doc__)
    p.add_argument("--steps", type=int, default=800, help="steps per throughput round")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--sagas", type=int, default=100, help="3-step sagas per latency round")
    p.add_argument("--threads", type=int, default=4, help="saga client threads")
    p.add_argument("--big", default="1000,100000,1000000",
                   help="journal sizes for the big-journal runs ('' skips them)")
    p.add_argument("--big-steps", type=int, default=400)
    p.add_argument("--brokers", default="rabbitmq,redis")
    p.add_argument("--no-dbos", action="store_true")
    p.add_argument("--keep-db", action="store_true")
    p.add_argument("--quick", action="store_true", help="tiny sizes, to check the harness")
    p.add_argument("--only", default=",".join(SECTIONS),
                   help=f"comma-separated sections to run, of: {','.join(SECTIONS)}")
    p.add_argument("--producer-steps", type=int, default=1500,
                   help="steps of the enqueue-then-result measure")
    a = p.parse_args(argv)
    if a.quick:
        a.steps, a.rounds, a.sagas, a.big, a.big_steps = 100, 1, 8, "1000", 100
        a.producer_steps = 150
    only = {x for x in a.only.split(",") if x}
    if only - set(SECTIONS):
        p.error(f"--only: unknown sections {sorted(only - set(SECTIONS))}")
    run = f"{int(time.time()) % 100000}{os.getpid() % 1000}"
    results: dict[str, Any] = {"machine": machine(), "versions": versions(), "run": run,
                               "argv": sys.argv[1:], "started": time.strftime("%FT%T%z")}
    dbos_mod: Any = None
    main_db, rows_db = f"bench_sw_{run}", f"bench_sw_{run}_rows"
    db_url = harness.create_database(main_db)
    log(f"database {main_db}")
    harness.prepare_schema(db_url, BROKERS["rabbitmq"], run)
    if not a.no_dbos and "saga" in only:
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
        brokers = [b for b in a.brokers.split(",") if b]
        if "throughput" not in only:  # the other sections run on RabbitMQ alone
            brokers = [b for b in brokers if b == "rabbitmq"]
        for bname in brokers:
            log(f"{bname}: starting workers")
            systems = ("bare", "minimal", "minimal_pf4", "guarded", "sagaworker")
            if bname == "rabbitmq" and "saga" in only:
                systems += ("sagaworker_published",)
            b = harness.Bench(run, bname, BROKERS[bname], db_url, systems)
            try:
                if "throughput" in only:
                    log(f"{bname}: step throughput")
                    results["step_throughput"][bname] = suites.step_throughput(b, a.steps,
                                                                               a.rounds)
                    results["rss_mib"][bname] = {"idle": b.rss_idle, "after_load": b.rss()}
                if bname == "rabbitmq":
                    rabbitmq_sections(results, b, a, only, dbos_mod)
            finally:
                b.close()
        sizes = tuple(int(x) for x in a.big.split(",") if x) if "big" in only else ()
        if sizes:
            rows_url = harness.create_database(rows_db)
            harness.prepare_schema(rows_url, BROKERS["rabbitmq"], run)
            log(f"big journal {sizes}")
            b = harness.Bench(run, "rows", BROKERS["rabbitmq"], rows_url,
                             ("minimal", "sagaworker"))
            try:
                results["big_journal"] = journal_size.big_journal(b, sizes, a.big_steps, a.rounds)
                log("prune, then step throughput again")
                results["after_prune"] = journal_size.after_prune(b, a.big_steps, a.rounds)
            finally:
                b.close()
    finally:
        if dbos_mod is not None:
            dbos_mod.shutdown()
        if not a.keep_db:
            for name in (main_db, rows_db):
                try:
                    harness.drop_database(name)
                except Exception as exc:
                    log(f"could not drop {name}: {exc}")
    for section, argv in APART.items():
        if section in only:
            log(f"{section}: {' '.join(argv)}")
            results[argv[0].split(".")[1]] = apart(argv, a.rounds, a.quick)
    results["wall_seconds"] = round(time.perf_counter() - t_start, 1)
    results["retried_rounds"] = harness.RETRIES
    # a run of some sections only leaves the full run's file alone
    out = RESULTS if only == set(SECTIONS) else RESULTS.with_name("results-partial.json")
    out.write_text(json.dumps(results, indent=2, default=str) + "\n")
    from bench.report import render

    print(render(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
