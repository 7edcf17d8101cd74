"""Render bench/results.json as Markdown tables (``python -m bench.report`` re-prints)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

TARGET_VS_MINIMAL = 0.9


def _f(x: Any, nd: int = 1) -> str:
    return f"{x:.{nd}f}" if isinstance(x, int | float) else str(x)


def _table(head: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def render(r: dict[str, Any]) -> str:
    out: list[str] = []
    m, v = r.get("machine", {}), r.get("versions", {})
    out.append(f"machine: {m.get('nproc')} cores, {m.get('memory_gib')} GiB; "
               + ", ".join(f"{k} {val}" for k, val in v.items()))
    st = r.get("step_throughput", {})
    if st:
        rows = []
        for broker, res in st.items():
            s = res["systems"]
            vs_min = res.get("ratio_vs_minimal", float("nan"))
            rows.append([broker, _f(s["bare"]["steps_per_s"]), _f(s["minimal"]["steps_per_s"]),
                         _f(s["sagaworker"]["steps_per_s"]), _f(res.get("ratio_vs_bare"), 2),
                         _f(vs_min, 2),
                         "met" if vs_min >= TARGET_VS_MINIMAL else "MISSED",
                         _f(s["sagaworker"]["enqueue_per_s"]),
                         _f(s["minimal"]["enqueue_per_s"])])
        out.append("\n### 1. Step throughput (steps/s, median of rounds)\n")
        out.append(_table(["broker", "bare Celery", "minimal journal", "sagaworker",
                           "sw/bare", "sw/minimal", "target >= 0.9", "sw enqueue/s",
                           "minimal enqueue/s"], rows))
    sg = r.get("saga")
    if sg:
        rows = [[name, _f(x["sagas_per_s"]), _f(x["p50_ms"]), _f(x["p99_ms"])]
                for name, x in sg["systems"].items()]
        out.append(f"\n### 2. 3-step sequential sagas ({sg['client_threads']} client threads, "
                   f"{sg['sagas_per_round']} sagas a round)\n")
        out.append(_table(["system", "sagas/s", "p50 ms", "p99 ms"], rows))
        for k, val in sg.items():
            if k.startswith(("throughput_ratio", "flow_ratio")):
                out.append(f"\n{k}: {_f(val, 2)}")
    if "dbos_error" in r:
        out.append(f"\nDBOS could not run: {r['dbos_error']}")
    c = r.get("compensation")
    if c:
        rows = [[k, _f(val)] for k, val in c["ms_to_terminal"].items()]
        out.append("\n### 3. Compensation: saga.fail() -> terminal status (ms)\n")
        out.append(_table(["EXECUTED steps", "ms"], rows))
        out.append(f"\nper undo: {_f(c['per_undo_ms'], 2)} ms; bare Celery round trip: "
                   f"{_f(c['bare_celery_round_trip_ms'], 2)} ms; ratio "
                   f"{_f(c['per_undo_vs_round_trip'], 2)}")
    bj = r.get("big_journal")
    if bj:
        rows = []
        for size, res in bj.items():
            s = res["systems"]
            rows.append([f"{int(size):,}", f"{res['rows_before']:,}",
                         _f(s["minimal"]["steps_per_s"]), _f(s["sagaworker"]["steps_per_s"]),
                         _f(res.get("ratio_vs_minimal"), 2), _f(res["fill_seconds"])])
        out.append("\n### 4. Step throughput with a big journal (RabbitMQ)\n")
        out.append(_table(["journal rows (target)", "rows at end", "minimal steps/s",
                           "sagaworker steps/s", "sw/minimal", "fill s"], rows))
    rss = r.get("rss_mib")
    if rss:
        rows = []
        for broker, res in rss.items():
            for phase in ("idle", "after_load"):
                x = res[phase]
                rows.append([broker, phase, _f(x["bare"]), _f(x["minimal"]),
                             _f(x["sagaworker"]), _f(x["sagaworker"] / x["bare"], 2)])
        out.append("\n### 5. Worker RSS, whole tree (MiB)\n")
        out.append(_table(["broker", "when", "bare", "minimal", "sagaworker", "sw/bare"], rows))
    fo = r.get("fan_out")
    if fo:
        out.append(f"\n### 6. Fan-out of {fo['k']} steps in one saga (RabbitMQ)\n")
        out.append(_table(["form", "enqueue ms", "all EXECUTED ms"],
                          [[n, _f(fo[n]["enqueue_ms"]), _f(fo[n]["all_executed_ms"])]
                           for n in ("enqueue_many", "one_by_one")]))
        out.append(f"\nenqueue speed-up {_f(fo['enqueue_speedup'], 2)}x, end to end "
                   f"{_f(fo['end_to_end_speedup'], 2)}x")
    out.append(f"\nwall time {r.get('wall_seconds')} s")
    return "\n".join(out)


if __name__ == "__main__":
    path = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).with_name("results.json")
    print(render(json.loads(path.read_text())))
