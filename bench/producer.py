"""What a producer pays, measured as a user calls it: one thread enqueues N steps over N/30
sagas (``saga.enqueue``, each call timed), then calls ``step.result()`` on each in order;
the hand-written journals (``minimal``: two commits; ``guarded``: three, a claim before
the tool, sagaworker's guarantee) enqueue the same way (INSERT+commit+confirmed publish
per step), then poll one ``count(*)`` until every row is EXECUTED, as a hand-written
journal would (it never reads its steps back one by one)."""

from __future__ import annotations

import time
from typing import Any

from sqlalchemy import text

from bench.apps import _engine, counter, journal_table, minimal_enqueue

__all__ = ["enqueue_then_result"]


def _sagaworker(b: Any, n: int, per_saga: int) -> dict[str, float]:
    system = b.systems["sagaworker"]
    sw, noop = system.sw, system.tasks["noop"]
    key = b.tag("etr")
    sagas = [sw.begin(f"{key}-{i}") for i in range(max(1, n // per_saga))]
    lat: list[float] = []
    steps = []
    t0 = time.perf_counter()
    for i in range(n):
        t = time.perf_counter()
        steps.append(sagas[i % len(sagas)].enqueue(noop, key))
        lat.append(time.perf_counter() - t)
    t1 = time.perf_counter()
    for s in steps:
        s.result(timeout=120)
    t2 = time.perf_counter()
    counter().delete(key)
    return _figures(n, t0, t1, t2, lat)


def _minimal(b: Any, n: int, name: str = "minimal") -> dict[str, float]:
    system = b.systems[name]
    key = b.tag(f"etr-{name}")
    lat: list[float] = []
    ids = []
    t0 = time.perf_counter()
    for _ in range(n):
        t = time.perf_counter()
        ids.append(minimal_enqueue(system, key))
        lat.append(time.perf_counter() - t)
    t1 = time.perf_counter()
    q = text(f"SELECT count(*) FROM {journal_table(system)} WHERE id = "
             "ANY(CAST(:ids AS uuid[])) AND phase = 'EXECUTED'")
    eng = _engine(system.db_url)
    delay = 0.005
    while True:
        with eng.connect() as conn:
            if conn.execute(q, {"ids": ids}).scalar_one() >= len(ids):
                break
        time.sleep(delay)
        delay = min(delay * 2, 0.05)
    t2 = time.perf_counter()
    counter().delete(key)
    return _figures(n, t0, t1, t2, lat)


def _figures(n: int, t0: float, t1: float, t2: float, lat: list[float]) -> dict[str, float]:
    lat = sorted(lat)
    return {"steps_per_s": n / (t2 - t0), "enqueue_s": t1 - t0, "results_s": t2 - t1,
            "enqueue_ms_p50": lat[len(lat) // 2] * 1000,
            "enqueue_ms_mean": sum(lat) / len(lat) * 1000}


def enqueue_then_result(b: Any, n: int, rounds: int, per_saga: int = 30) -> dict[str, Any]:
    """Every form in rotating order each round; ratios are medians of per-round ratios."""
    from bench.harness import median, retried

    names = ["sagaworker", *(x for x in ("minimal", "guarded") if x in b.systems)]
    runs: dict[str, list[dict[str, float]]] = {name: [] for name in names}

    def one(name: str, steps: int) -> dict[str, float]:
        return _sagaworker(b, steps, per_saga) if name == "sagaworker" else \
            _minimal(b, steps, name)

    for name in names:  # warm-up
        one(name, max(30, n // 10))
    for r in range(rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            runs[name].append(retried(lambda name=name: one(name, n),  # type: ignore[misc]
                                      f"enqueue then result ({name})"))
    out: dict[str, Any] = {"steps": n, "sagas": max(1, n // per_saga), "systems": {
        name: {k: median([x[k] for x in rs]) for k in rs[0]} for name, rs in runs.items()}}
    out["rounds_steps_per_s"] = {name: [round(x["steps_per_s"], 1) for x in rs]
                                 for name, rs in runs.items()}
    for base in names[1:]:
        pairs = list(zip(runs["sagaworker"], runs[base], strict=True))
        out[f"ratio_vs_{base}"] = median([s["steps_per_s"] / m["steps_per_s"]
                                          for s, m in pairs])
        out[f"enqueue_latency_vs_{base}"] = median(
            [s["enqueue_ms_mean"] / m["enqueue_ms_mean"] for s, m in pairs])
    return out
