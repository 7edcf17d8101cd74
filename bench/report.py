"""Render bench/results.json as Markdown tables (``python -m bench.report`` re-prints)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

#: steps/s over the hand-written journal that keeps the same guarantee (three commits)
TARGET_VS_GUARDED = 1.0
#: a worker tree's RSS after 100,000 steps over its RSS after 1,000 (``bench.memory``)
TARGET_GROWTH = 1.05


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
            pf4 = s.get("minimal_pf4", {}).get("steps_per_s", float("nan"))
            guarded = s.get("guarded", {}).get("steps_per_s", float("nan"))
            rows.append([broker, _f(s["bare"]["steps_per_s"]), _f(s["minimal"]["steps_per_s"]),
                         _f(pf4), _f(guarded), _f(s["sagaworker"]["steps_per_s"]),
                         _f(res.get("ratio_vs_bare"), 2), _f(vs_min, 2),
                         _f(res.get("ratio_vs_minimal_pf4", float("nan")), 2),
                         _f(res.get("ratio_vs_guarded", float("nan")), 2),
                         "met" if res.get("ratio_vs_guarded", 0) >= TARGET_VS_GUARDED
                         else "MISSED",
                         _f(s["sagaworker"]["enqueue_per_s"]),
                         _f(s["minimal"]["enqueue_per_s"])])
        out.append("\n### 1. Step throughput (steps/s, median of rounds)\n")
        out.append(_table(["broker", "bare Celery", "minimal journal",
                           "minimal, prefetch 4", "same-guarantee journal", "sagaworker",
                           "sw/bare", "sw/minimal", "sw/minimal prefetch 4",
                           "sw/same-guarantee", f"sw/same-guarantee target >= {TARGET_VS_GUARDED}",
                           "sw enqueue/s", "minimal enqueue/s"], rows))
    sg = r.get("saga")
    if sg:
        rows = [[name, _f(x["sagas_per_s"]), _f(x["p50_ms"]), _f(x["p99_ms"])]
                for name, x in sg["systems"].items()]
        out.append(f"\n### 2. 3-step sequential sagas ({sg['client_threads']} client threads, "
                   f"{sg['sagas_per_round']} sagas a round)\n")
        out.append(_table(["system", "sagas/s", "p50 ms", "p99 ms"], rows))
        for k, val in sg.items():
            if k.startswith(("throughput_ratio", "flow_", "sync_")):
                out.append(f"\n{k}: {_f(val, 2)}")
    pr = r.get("producer")
    if pr:
        rows = [[name, _f(x["steps_per_s"]), _f(x["enqueue_s"], 2), _f(x["results_s"], 2),
                 _f(x["enqueue_ms_mean"], 2), _f(x["enqueue_ms_p50"], 2)]
                for name, x in pr["systems"].items()]
        out.append(f"\n### Producer: enqueue {pr['steps']} steps over {pr['sagas']} sagas, "
                   "then result() on each (one thread)\n")
        out.append(_table(["system", "steps/s", "enqueue s", "results s", "enqueue ms mean",
                           "enqueue ms p50"], rows))
        out.append(f"\nsw/minimal {_f(pr['ratio_vs_minimal'], 2)}; sw/same-guarantee "
                   f"{_f(pr.get('ratio_vs_guarded', float('nan')), 2)}; enqueue latency "
                   f"sw/minimal {_f(pr['enqueue_latency_vs_minimal'], 2)}")
        for name, xs in pr.get("rounds_steps_per_s", {}).items():
            out.append(f"\n{name} rounds (steps/s): {', '.join(_f(x) for x in xs)}")
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
    ap = r.get("after_prune")
    if ap:
        s = ap["systems"]
        out.append(f"\nafter `sw.prune(12 h)`: {ap['sagas_deleted']:,} sagas, "
                   f"{ap['entries_before'] - ap['entries_after']:,} entries deleted in "
                   f"{_f(ap['prune_seconds'])} s ({_f(ap['prune_entries_per_s'], 0)} entries/s); "
                   f"then {_f(s['sagaworker']['steps_per_s'])} sagaworker steps/s, "
                   f"{_f(s['minimal']['steps_per_s'])} minimal (sw/minimal "
                   f"{_f(ap.get('ratio_vs_minimal'), 2)})")
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
    out.extend(_memory(r))
    fo = r.get("fan_out")
    if fo:
        out.append(f"\n### 6. Fan-out of {fo['k']} steps in one saga (RabbitMQ)\n")
        out.append(_table(["form", "enqueue ms", "all EXECUTED ms"],
                          [[n, _f(fo[n]["enqueue_ms"]), _f(fo[n]["all_executed_ms"])]
                           for n in ("enqueue_many", "one_by_one")]))
        out.append(f"\nenqueue speed-up {_f(fo['enqueue_speedup'], 2)}x, end to end "
                   f"{_f(fo['end_to_end_speedup'], 2)}x")
    wk = r.get("workers")
    if wk:
        out.append(f"\n### Step throughput by workers (RabbitMQ, {wk['n']} steps a round)\n")
        out.append(_table(["workers (-c 2 each)", "steps/s", "vs 1 worker"],
                          [[k, _f(v["steps_per_s"]), _f(wk.get("speedup", {}).get(k), 2)]
                           for k, v in wk["workers"].items()]))
    if r.get("asyncio"):
        from bench.aio import render as render_aio

        out.append("\n### asyncio\n")
        out.append(render_aio(r["asyncio"]))
    targets = target_rows(r)
    if targets:
        out.append("\n### Targets (ratios within this run)\n")
        out.append(_table(["figure", "value", "target", ""], targets))
    out.append(f"\nwall time {r.get('wall_seconds')} s")
    fc = r.get("flows_check")
    if isinstance(fc, dict) and "seconds_median" in fc:
        out.append(f"flows check of {fc['sagas']} sagas in flight: "
                   + ", ".join(f"{k} {v} s" for k, v in fc["seconds_median"].items())
                   + f" (check/read {fc['check_over_read']})")
    at = r.get("agent_turns")
    if isinstance(at, dict) and "ms_per_turn" in at:
        out.append(f"durable agent turn, {at['turns']} turns: ms/turn "
                   + ", ".join(f"{k} {v}" for k, v in at["ms_per_turn"].items())
                   + f"; added sagaworker/DBOS {at.get('sagaworker_over_dbos_per_turn')}"
                   + f"; replay ms {at['replay_ms_with_turns_journaled']}")
    ea = r.get("enqueue_alone")
    if isinstance(ea, dict) and "latency_ratio_vs_minimal" in ea:
        out.append("producer enqueue with no worker beside it, ms (rounds): "
                   + "; ".join(f"{k} {v}" for k, v in ea["enqueue_ms_mean"].items())
                   + f"; sw/minimal {ea['latency_ratio_vs_minimal']}")
    ce = r.get("ceiling")
    if isinstance(ce, dict) and "rows" in ce:
        out.append(f"\n### Where the step rate stops ({ce['broker']}, {ce['per_saga']} steps "
                   "a saga; bench.ceiling)\n")
        out.append(_table(
            ["set-up", "steps/s", "cores busy", "backends waiting on a Lock",
             "ctx switches/step", "producer CPU ms/step", "write tx/step"],
            [[k, f"{v['steps_per_s']:.0f}", f"{v['cpu_busy_share']:.2f}",
              f"{v['backends_Lock']:.3f}", f"{v['ctx_switches_per_step']:.1f}",
              f"{v['cpu_ms_producer']:.2f}", f"{v['write_tx_per_step']:.2f}"]
             for k, v in ce["rows"].items()]))
    return "\n".join(out)


def _memory(r: dict[str, Any]) -> list[str]:
    """``bench.memory``: each worker tree's RSS at each checkpoint, and its growth."""
    rows = []
    for broker, res in r.get("memory", {}).items():
        if isinstance(res, dict) and "systems" in res:
            for name, x in res["systems"].items():
                marks = ", ".join(f"{int(n):,}: {_f(mib)}" for n, mib in x["rss_mib"])
                rows.append([broker, name, marks, _f(x["growth"], 3), _f(x["steps_per_s"])])
    if not rows:
        return []
    return ["\n### 5b. Worker RSS as the work grows, whole tree (MiB after N steps)\n",
            _table(["broker", "system", "RSS after N steps", "last / after 1,000",
                    "steps/s"], rows)]


def target_rows(r: dict[str, Any]) -> list[list[str]]:
    """The targets table: each figure, its target, met or missed."""
    rows: list[tuple[str, float, str, bool]] = []
    for broker, res in r.get("memory", {}).items():
        if not isinstance(res, dict) or "systems" not in res:
            continue  # (the section failed: its error is in the results file)
        for name in ("sagaworker", "bare"):
            x = res["systems"][name]["growth"]
            rows.append((f"worker RSS after {res['steps']:,} steps / after 1,000 ({broker}, "
                         f"{name})", x, f"<= {TARGET_GROWTH}", x <= TARGET_GROWTH))
    c = r.get("compensation")
    if c:
        x = c["per_undo_vs_round_trip"]
        rows.append(("per-undo cost / bare round trip", x, "<= 2", x <= 2))
    for broker, res in r.get("step_throughput", {}).items():
        x = res.get("ratio_vs_guarded")
        if x is not None:
            rows.append((f"steps/s / same-guarantee journal ({broker})", x,
                         f">= {TARGET_VS_GUARDED}", x >= TARGET_VS_GUARDED))
    pr = r.get("producer")
    if pr and "ratio_vs_guarded" in pr:
        x = pr["ratio_vs_guarded"]
        rows.append(("enqueue-then-result() steps/s / same-guarantee journal", x,
                     f">= {TARGET_VS_GUARDED}", x >= TARGET_VS_GUARDED))
    if pr:
        x = pr["enqueue_latency_vs_minimal"]
        rows.append(("producer enqueue latency / minimal INSERT+publish", x, "<= 1.05",
                     x <= 1.05))
    sg = r.get("saga", {})
    if "flow_ratio_vs_sync" in sg:
        x = sg["flow_ratio_vs_sync"]
        rows.append(("3-step flows/s / synchronous form", x, ">= 1.5", x >= 1.5))
    if "flow_ratio_vs_dbos_direct" in sg:
        x = sg["flow_ratio_vs_dbos_direct"]
        rows.append(("3-step flows/s / DBOS called in-process", x, ">= 1.0", x >= 1.0))
    if "flow_spread" in sg:
        x = sg["flow_spread"]
        rows.append(("3-step flows/s spread across rounds (max-min)/median", x, "< 0.15",
                     x < 0.15))
    at = r.get("agent_turns")
    if isinstance(at, dict) and at.get("sagaworker_over_dbos_per_turn") is not None:
        x = at["sagaworker_over_dbos_per_turn"]
        rows.append(("durable agent turn, added ms / DBOS's", x, "<= 1.0", x <= 1.0))
    bj = r.get("big_journal", {})
    if len(bj) >= 2:
        sizes = sorted(bj, key=int)
        lo, hi = bj[sizes[0]], bj[sizes[-1]]
        x = hi["systems"]["sagaworker"]["steps_per_s"] / lo["systems"]["sagaworker"]["steps_per_s"]
        rows.append((f"throughput at {int(sizes[-1]):,} rows / at {int(sizes[0]):,}", x,
                     ">= 0.9", x >= 0.9))
    return [[name, _f(x, 2), t, "met" if ok else "MISSED"] for name, x, t, ok in rows]


if __name__ == "__main__":
    path = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).with_name("results.json")
    print(render(json.loads(path.read_text())))
