"""The measurements. Every figure is taken for both systems in the same run, on the same
PostgreSQL and broker, in interleaved rounds; the report quotes medians and ratios."""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime
from functools import partial
from typing import Any

from sqlalchemy import text

from bench.apps import System, counter, journal_table, minimal_enqueue
from bench.harness import Bench, median, pctl, retried, spread, wait_counter

# -- 1. step throughput ------------------------------------------------------------------


def step_round(b: Bench, name: str, n: int, *, per_saga: int = 10) -> dict[str, float]:
    """Enqueue ``n`` independent steps as fast as one producer can; time until all ran.

    sagaworker steps are spread round-robin over n/per_saga sagas begun beforehand
    (untimed). Done means: counter reached n and, for the journals, n rows EXECUTED.
    """
    system = b.systems[name]
    key = b.tag(f"steps-{name}")
    counter().delete(key)
    sagas: list[Any] = []
    if name == "sagaworker":
        sagas = [system.sw.begin(f"{key}-{i}") for i in range(max(1, n // per_saga))]
    ids: list[str] = []
    t0 = time.perf_counter()
    for i in range(n):
        if name.startswith("minimal") or name == "guarded":
            ids.append(minimal_enqueue(system, key))
        else:
            system.enqueue(key, sagas[i % len(sagas)] if sagas else None)
    t_pub = time.perf_counter() - t0
    wait_counter(key, n, timeout=300)
    if name.startswith("minimal") or name == "guarded":
        _wait_sql(system, f"SELECT count(*) FROM {journal_table(system)} WHERE id = "
                  "ANY(CAST(:ids AS uuid[])) AND phase = 'EXECUTED'", {"ids": ids}, n)
    elif name == "sagaworker":
        _wait_sql(system, "SELECT count(*) FROM sagaworker_entries WHERE saga_id = ANY(:ids) "
                  "AND phase = 'EXECUTED'", {"ids": [s.saga_id for s in sagas]}, n)
    elapsed = time.perf_counter() - t0
    counter().delete(key)
    return {"steps_per_s": n / elapsed, "enqueue_per_s": n / t_pub, "seconds": elapsed}


def _wait_sql(system: System, sql: str, params: dict[str, Any], n: int) -> None:
    from bench.apps import _engine

    deadline = time.monotonic() + 60
    while True:
        with _engine(system.db_url).connect() as conn:
            got = int(conn.execute(text(sql), params).scalar() or 0)
        if got >= n:
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"{got} of {n} journaled EXECUTED")
        time.sleep(0.005)


def step_throughput(b: Bench, n: int, rounds: int) -> dict[str, Any]:
    names = [name for name in b.systems if name != "sagaworker_published"]  # (flows only)
    for name in names:  # warm-up: connections, pools, queues
        retried(partial(step_round, b, name, max(20, n // 20)), f"warm {name}")
    per: dict[str, list[dict[str, float]]] = {name: [] for name in names}
    for r in range(rounds):
        order = names[r % len(names):] + names[:r % len(names)]  # rotate who goes first
        for name in order:
            per[name].append(retried(partial(step_round, b, name, n),
                                     f"{b.broker_name} steps {name}"))
    out: dict[str, Any] = {"n": n, "rounds": rounds, "systems": {}}
    for name, rs in per.items():
        out["systems"][name] = {
            "steps_per_s": median([x["steps_per_s"] for x in rs]),
            "enqueue_per_s": median([x["enqueue_per_s"] for x in rs]),
            "rounds_steps_per_s": [round(x["steps_per_s"], 1) for x in rs]}
    sw_rounds = [x["steps_per_s"] for x in per.get("sagaworker", [])]
    for base in ("bare", "minimal", "minimal_pf4", "guarded"):
        if base in per and sw_rounds:
            ratios = [s / m["steps_per_s"] for s, m in zip(sw_rounds, per[base], strict=True)]
            out[f"ratio_vs_{base}"] = median(ratios)
    return out


# -- 2. saga throughput and latency ------------------------------------------------------


def _run_clients(fn: Callable[[int], None], m: int, threads: int) -> dict[str, float]:
    def one(i: int) -> float:
        t = time.perf_counter()
        fn(i)
        return time.perf_counter() - t

    t0 = time.perf_counter()
    with ThreadPoolExecutor(threads) as ex:
        lats = list(ex.map(one, range(m)))
    total = time.perf_counter() - t0
    ms = [x * 1000 for x in lats]
    return {"sagas_per_s": m / total, "p50_ms": pctl(ms, 0.5), "p99_ms": pctl(ms, 0.99)}


def saga_round_sagaworker(b: Bench, m: int, threads: int) -> dict[str, float]:
    system = b.systems["sagaworker"]
    sw, noop = system.sw, system.tasks["noop"]
    key = b.tag("saga3")

    def saga3(i: int) -> None:
        saga = sw.begin(f"{key}-{i}")
        for _ in range(3):
            saga.enqueue(noop, key).result(timeout=60)
        saga.complete()

    return _run_clients(saga3, m, threads)


def saga_round_flow(b: Bench, m: int, threads: int, system: str = "sagaworker"
                    ) -> dict[str, float]:
    """3-step flows as a web app runs them: started (the caller returns at once), carried
    by the workers. Throughput: m flows from the first start to the last completion;
    latency: each saga's created_at -> finished_at in the journal."""
    from sqlalchemy import select

    from bench.apps import bench_flow
    from sagaworker._journal.schema import sagas

    sw = b.systems[system].sw
    key = b.tag("flow3")
    ids = [f"{key}-{i}" for i in range(m)]
    t0 = time.perf_counter()
    with ThreadPoolExecutor(threads) as ex:
        list(ex.map(lambda sid: sw.start(sid, bench_flow, key), ids))
    q = select(sagas.c.status, sagas.c.created_at, sagas.c.finished_at).where(
        sagas.c.saga_id.in_(ids))
    deadline = time.monotonic() + 120
    while True:
        with sw.journal.engine.connect() as conn:
            rows = conn.execute(q).all()
        if sum(r.status == "COMPLETED" for r in rows) == m:
            break
        if time.monotonic() > deadline:
            raise TimeoutError(f"{m} flows did not complete in 120 s")
        time.sleep(0.01)
    total = time.perf_counter() - t0
    ms = [(r.finished_at - r.created_at).total_seconds() * 1000 for r in rows]
    return {"sagas_per_s": m / total, "p50_ms": pctl(ms, 0.5), "p99_ms": pctl(ms, 0.99)}


def _ignore_index(fn: Callable[[str], Any], key: str, _i: int) -> None:
    fn(key)


def saga_latency(b: Bench, m: int, threads: int, rounds: int,
                 dbos_mod: Any) -> dict[str, Any]:
    runs: dict[str, list[dict[str, float]]] = {"sagaworker": [], "flow": []}
    published = "sagaworker_published" in b.systems
    if published:
        runs["flow_published"] = []
    if dbos_mod is not None:
        runs["dbos_direct"], runs["dbos_queue"] = [], []
    saga_round_sagaworker(b, max(4, m // 10), threads)  # warm-up
    saga_round_flow(b, max(4, m // 10), threads)
    if published:
        saga_round_flow(b, max(4, m // 10), threads, "sagaworker_published")
    if dbos_mod is not None:
        for fn in (dbos_mod.run_direct, dbos_mod.run_queued):
            _run_clients(partial(_ignore_index, fn, "warm"), 4, threads)
    key = f"{b.run}-dbos"
    forms: dict[str, Callable[[], dict[str, float]]] = {
        "sagaworker": lambda: retried(lambda: saga_round_sagaworker(b, m, threads),
                                      "saga sagaworker"),
        "flow": lambda: retried(lambda: saga_round_flow(b, m, threads), "saga flow")}
    if published:
        forms["flow_published"] = lambda: retried(
            lambda: saga_round_flow(b, m, threads, "sagaworker_published"),
            "saga flow, eager steps off")
    if dbos_mod is not None:
        forms["dbos_direct"] = lambda: _run_clients(lambda i: dbos_mod.run_direct(key), m,
                                                    threads)
        forms["dbos_queue"] = lambda: _run_clients(lambda i: dbos_mod.run_queued(key), m,
                                                   threads)
    names = list(forms)
    for r in range(rounds):  # the order rotated each round: no form always goes first
        for name in names[r % len(names):] + names[:r % len(names)]:
            runs[name].append(forms[name]())
    counter().delete(key)
    out: dict[str, Any] = {"sagas_per_round": m, "client_threads": threads, "systems": {}}
    for name, rs in runs.items():
        out["systems"][name] = {k: median([x[k] for x in rs])
                                for k in ("sagas_per_s", "p50_ms", "p99_ms")}
    for base in ("dbos_direct", "dbos_queue"):
        if base in runs:
            out[f"throughput_ratio_vs_{base}"] = median(
                [s["sagas_per_s"] / d["sagas_per_s"]
                 for s, d in zip(runs["sagaworker"], runs[base], strict=True)])
            for name in ("flow", "flow_published"):
                if name in runs:
                    out[f"{name}_ratio_vs_{base}"] = median(
                        [s["sagas_per_s"] / d["sagas_per_s"]
                         for s, d in zip(runs[name], runs[base], strict=True)])
    for name in ("flow", "flow_published"):
        if name in runs:
            out[f"{name}_ratio_vs_sync"] = median(
                [f["sagas_per_s"] / s["sagas_per_s"]
                 for f, s in zip(runs[name], runs["sagaworker"], strict=True)])
            out[f"{name}_spread"] = spread([r["sagas_per_s"] for r in runs[name]])
    out["sync_spread"] = spread([r["sagas_per_s"] for r in runs["sagaworker"]])
    out["rounds"] = {name: [round(r["sagas_per_s"], 1) for r in rs] for name, rs in runs.items()}
    return out


# -- 3. compensation ------------------------------------------------------------------


def bare_round_trip_ms(b: Bench, tries: int) -> float:
    """Publish a bare Celery task, time until the worker ran it (worker's own clock)."""
    stamp_task = b.systems["bare"].tasks["stamp"]
    r = counter()
    out = []
    for i in range(tries):
        key = b.tag(f"rt{i}")
        t0 = time.time()
        stamp_task.apply_async(args=[key])
        deadline = time.monotonic() + 30
        while (v := r.get(key)) is None:
            if time.monotonic() > deadline:
                raise TimeoutError("bare round trip")
            time.sleep(0.0005)
        out.append((float(v) - t0) * 1000)
        r.delete(key)
    return median(out)


def compensation_round(b: Bench, k: int) -> float:
    """ms from ``saga.fail()`` to the saga's terminal status (journaled ``finished_at``)."""
    system = b.systems["sagaworker"]
    sw, reserve = system.sw, system.tasks["reserve"]
    key = b.tag(f"comp{k}")
    saga = sw.begin(key)
    steps = saga.enqueue_many([(reserve, (key,), {})] * k)
    for s in steps:
        s.result(timeout=120)
    t0 = datetime.now(UTC)
    saga.fail("bench")
    deadline = time.monotonic() + 120
    with sw.journal.engine.connect() as conn:
        while True:
            row = conn.execute(text("SELECT status, finished_at FROM sagaworker_sagas "
                                    "WHERE saga_id = :s"), {"s": key}).first()
            conn.rollback()
            if row is not None and row.finished_at is not None:
                break
            if time.monotonic() > deadline:
                raise TimeoutError(f"compensation of {k} steps did not finish")
            time.sleep(0.002)
    if row.status != "COMPENSATED":
        raise RuntimeError(f"saga {key} ended {row.status}")
    counter().delete(key)
    return float((row.finished_at - t0).total_seconds() * 1000)


def compensation(b: Bench, sizes: tuple[int, ...], rounds: int) -> dict[str, Any]:
    compensation_round(b, 2)  # warm-up
    per: dict[int, list[float]] = {k: [] for k in sizes}
    for _ in range(rounds):
        for k in sizes:
            per[k].append(retried(partial(compensation_round, b, k), f"compensation {k}"))
    rt = bare_round_trip_ms(b, 20)
    med = {k: median(v) for k, v in per.items()}
    lo, hi = min(sizes), max(sizes)
    per_undo = (med[hi] - med[lo]) / (hi - lo)
    return {"ms_to_terminal": {str(k): v for k, v in med.items()},
            "rounds_ms": {str(k): [round(x, 1) for x in v] for k, v in per.items()},
            "per_undo_ms": per_undo, "bare_celery_round_trip_ms": rt,
            "per_undo_vs_round_trip": per_undo / rt if rt else float("nan")}


# -- 6. fan-out ----------------------------------------------------------------------------


def fan_out(b: Bench, k: int, rounds: int) -> dict[str, Any]:
    system = b.systems["sagaworker"]
    sw, noop = system.sw, system.tasks["noop"]

    def once(many: bool) -> dict[str, float]:
        key = b.tag("fan")
        counter().delete(key)
        saga = sw.begin(key)
        t0 = time.perf_counter()
        if many:
            saga.enqueue_many([(noop, (key,), {})] * k)
        else:
            for _ in range(k):
                saga.enqueue(noop, key)
        t_pub = time.perf_counter() - t0
        wait_counter(key, k, 120)
        _wait_sql(system, "SELECT count(*) FROM sagaworker_entries WHERE saga_id = :s "
                  "AND phase = 'EXECUTED'", {"s": key}, k)
        total = time.perf_counter() - t0
        counter().delete(key)
        return {"enqueue_ms": t_pub * 1000, "all_executed_ms": total * 1000}

    once(True)
    once(False)
    res: dict[str, list[dict[str, float]]] = {"enqueue_many": [], "one_by_one": []}
    for _ in range(rounds):
        res["enqueue_many"].append(retried(lambda: once(True), "fan-out many"))
        res["one_by_one"].append(retried(lambda: once(False), "fan-out one by one"))
    out: dict[str, Any] = {"k": k}
    for name, rs in res.items():
        out[name] = {m: median([x[m] for x in rs]) for m in ("enqueue_ms", "all_executed_ms")}
    out["enqueue_speedup"] = median([o["enqueue_ms"] / m["enqueue_ms"] for m, o in
                                     zip(res["enqueue_many"], res["one_by_one"], strict=True)])
    out["end_to_end_speedup"] = median(
        [o["all_executed_ms"] / m["all_executed_ms"]
         for m, o in zip(res["enqueue_many"], res["one_by_one"], strict=True)])
    return out
