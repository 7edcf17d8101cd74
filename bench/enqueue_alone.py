"""``python -m bench.enqueue_alone``: a producer's enqueue with no worker beside it.

sagaworker's ``saga.enqueue`` (its INTENT statement, then the confirmed publish) against
the minimal journal's INSERT + commit + confirmed publish, in alternating blocks, on
RabbitMQ and PostgreSQL, with nothing consuming the queues (they are deleted after). The
producer's own path, apart from the CPU the workers take from it on a small machine.
Prints one JSON object.

    .venv/bin/python -m bench.enqueue_alone --steps 1000 --rounds 5
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import time
from typing import Any

from bench import harness
from bench.apps import make_system, minimal_enqueue

BROKER = "amqp://guest:guest@127.0.0.1:5672//"


def _block(name: str, n: int, sw: Any, mn: Any, sagas: list[Any]) -> list[float]:
    lat = []
    for i in range(n):
        t = time.perf_counter()
        if name == "sagaworker":
            sagas[i % len(sagas)].enqueue(sw.tasks["noop"], "alone")
        else:
            minimal_enqueue(mn, "alone")
        lat.append(time.perf_counter() - t)
    return lat


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.enqueue_alone", description=__doc__)
    p.add_argument("--steps", type=int, default=1000, help="enqueues of each system a round")
    p.add_argument("--rounds", type=int, default=5)
    a = p.parse_args(argv)
    run = f"alone{os.getpid()}"
    db = harness.create_database(f"bench_sw_{run}")
    harness.prepare_schema(db, BROKER, run)
    sw = make_system("sagaworker", broker=BROKER, db_url=db, queue=f"bench-{run}-sw")
    mn = make_system("minimal", broker=BROKER, db_url=db, queue=f"bench-{run}-min")
    try:
        sagas = [sw.sw.begin(f"{run}-{i}") for i in range(max(1, a.steps // 30))]
        for name in ("sagaworker", "minimal"):  # warm-up: connections, pools, queues
            _block(name, 50, sw, mn, sagas)
        ms: dict[str, list[float]] = {"sagaworker": [], "minimal": []}
        ratios = []
        for r in range(a.rounds):
            order = ("sagaworker", "minimal") if r % 2 == 0 else ("minimal", "sagaworker")
            got = {name: statistics.mean(_block(name, a.steps, sw, mn, sagas)) * 1000
                   for name in order}
            for name, v in got.items():
                ms[name].append(round(v, 3))
            ratios.append(got["sagaworker"] / got["minimal"])
        print(json.dumps({"steps": a.steps, "enqueue_ms_mean": ms,
                          "latency_ratio_vs_minimal": round(statistics.median(ratios), 3)}))
    finally:
        for system in (sw, mn):
            with system.app.connection_for_write() as conn:
                for queue in {system.queue, f"{system.queue}.sw"}:
                    with contextlib.suppress(Exception):  # (a queue never declared)
                        conn.default_channel.queue_delete(queue)
        sw.sw.journal.engine.dispose()
        harness.drop_database(f"bench_sw_{run}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
