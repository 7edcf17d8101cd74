"""``python -m bench.memory``: does a worker's memory grow with the work it has done?

One worker tree (``celery worker -P prefork -c 2``) per system, bare Celery and sagaworker,
on one broker and one PostgreSQL database of the run's own; both run the same steps in
alternating blocks (``bench.suites.step_round``: one producer, independent steps, sagaworker's
spread over sagas of 10). The RSS of each whole tree (main process and pool children) is
read after the first 1,000 steps (the tree warm: imports done, pools and connections open)
and at each checkpoint up to ``--steps`` (100,000 by default). The figure is RSS at the end
over RSS after 1,000 steps, for each system; the target is that sagaworker's stays within
1.05 (its memory does not grow with the work), reported beside bare Celery's.

    .venv/bin/python -m bench.memory --steps 100000 --brokers rabbitmq,redis
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from functools import partial
from typing import Any

from bench import harness
from bench.harness import BROKERS, Bench, create_database, drop_database, prepare_schema, retried
from bench.suites import step_round

SYSTEMS = ("bare", "sagaworker")
BLOCK = 2_000  # steps a system runs before the other's turn
FIRST = 1_000  # the warm checkpoint: RSS after this many steps is the base


def _checkpoints(total: int) -> list[int]:
    marks = [FIRST, 10_000, 25_000, 50_000, total]
    return sorted({m for m in marks if m <= total})


def grow(b: Bench, total: int) -> dict[str, Any]:
    """Run ``total`` steps on each system in alternating blocks; RSS at each checkpoint."""
    done = dict.fromkeys(SYSTEMS, 0)
    rss: dict[str, dict[int, float]] = {name: {} for name in SYSTEMS}
    rates: dict[str, list[float]] = {name: [] for name in SYSTEMS}
    marks = _checkpoints(total)
    while any(done[name] < total for name in SYSTEMS):
        for name in SYSTEMS:
            if done[name] >= total:
                continue
            nxt = next(m for m in marks if m > done[name])
            n = min(BLOCK, nxt - done[name])
            r = retried(partial(step_round, b, name, n), f"{name} block")
            rates[name].append(r["steps_per_s"])
            done[name] += n
            if done[name] in marks:
                time.sleep(0.5)  # the pool's children back at rest
                rss[name][done[name]] = round(b.workers[name].rss_mib(), 1)
    out: dict[str, Any] = {"steps": total, "block": BLOCK, "systems": {}}
    for name in SYSTEMS:
        base, last = rss[name][FIRST], rss[name][total]
        out["systems"][name] = {"rss_mib": sorted(rss[name].items()),
                                "growth": round(last / base, 4),
                                "steps_per_s": round(harness.median(rates[name]), 1)}
    return out


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m bench.memory", description=__doc__)
    p.add_argument("--steps", type=int, default=100_000)
    p.add_argument("--brokers", default="rabbitmq,redis")
    a = p.parse_args()
    if a.steps < FIRST:
        p.error(f"--steps must be at least {FIRST} (the warm checkpoint)")
    brokers = [x for x in a.brokers.split(",") if x]
    if set(brokers) - set(BROKERS):
        p.error(f"--brokers: unknown {sorted(set(brokers) - set(BROKERS))}, of: "
                f"{','.join(BROKERS)}")
    run = f"mem{os.getpid()}"
    db = f"bench_sw_{run}"
    results: dict[str, Any] = {}
    try:
        db_url = create_database(db)
        prepare_schema(db_url, BROKERS["rabbitmq"], run)
        for bname in brokers:
            b = Bench(run, bname, BROKERS[bname], db_url, SYSTEMS)
            try:
                results[bname] = grow(b, a.steps)
            finally:
                b.close()
            print(json.dumps({bname: results[bname]}), file=sys.stderr, flush=True)
    finally:
        drop_database(db)
    print(json.dumps(results))


if __name__ == "__main__":
    main()
