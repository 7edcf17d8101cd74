"""How step throughput grows with workers on this machine: the same one-producer step
rounds with 1, 2 and 4 sagaworker workers (``celery worker -P prefork -c 2`` each) on
the same queue. On 2 cores the workers share the CPU with PostgreSQL, the broker and the
producer: the figure shows where the machine, not the worker count, is the limit."""

from __future__ import annotations

from typing import Any

from bench.workers import Worker

__all__ = ["workers_scaling"]


def workers_scaling(b: Any, n: int, rounds: int, counts: tuple[int, ...] = (1, 2, 4)
                    ) -> dict[str, Any]:
    from bench.harness import median, retried
    from bench.suites import step_round

    system = b.systems["sagaworker"]
    extra: list[Worker] = []
    out: dict[str, Any] = {"n": n, "rounds": rounds, "workers": {}}
    try:
        for k in counts:
            while len(extra) < k - 1:
                w = Worker("sagaworker", broker=b.broker, db_url=b.db_url,
                           queue=system.queue, app=system.app, nth=len(extra) + 1)
                w.wait_ready()
                extra.append(w)
            retried(lambda: step_round(b, "sagaworker", max(20, n // 10)), "warm workers")
            got = [retried(lambda: step_round(b, "sagaworker", n), f"{k} workers")
                   for _ in range(rounds)]
            out["workers"][str(k)] = {
                "steps_per_s": median([x["steps_per_s"] for x in got]),
                "rounds_steps_per_s": [round(x["steps_per_s"], 1) for x in got]}
    finally:
        for w in extra:
            w.stop()
    one = out["workers"].get("1", {}).get("steps_per_s")
    if one:
        out["speedup"] = {k: v["steps_per_s"] / one for k, v in out["workers"].items()}
    return out
