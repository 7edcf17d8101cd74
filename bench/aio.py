"""The asyncio twins from an event loop's point of view (``python -m bench`` runs it;
``python -m bench.aio`` alone): how long the loop stalls, and how many threads wait.

- **Loop stall**: a 5 ms ticker runs on the loop while 100 steps are enqueued and
  awaited concurrently; the figure is the longest gap between two ticks (target under
  50 ms), for ``aenqueue``/``aresult`` beside what an app does without them: the
  synchronous calls made on the loop (``enqueue`` + ``result`` in a coroutine) and the
  same pushed to threads (``asyncio.to_thread``).
- **Waits**: 1,000 concurrent ``aresult`` calls on 1,000 journaled steps (50 sagas of 20):
  the process's peak thread count while they wait, and the seconds until every one
  returned, beside ``to_thread(step.result)`` for the same waits.
"""

from __future__ import annotations

import asyncio
import statistics
import threading
import time
from collections.abc import Awaitable, Callable
from typing import Any

from bench.harness import Bench, median

TICK = 0.005


async def _ticked(work: Callable[[], Awaitable[Any]]) -> dict[str, float]:
    """Run ``work`` while a 5 ms ticker measures the loop's gaps."""
    gaps: list[float] = []
    stop = asyncio.Event()

    async def ticker() -> None:
        last = time.perf_counter()
        while not stop.is_set():
            await asyncio.sleep(TICK)
            now = time.perf_counter()
            gaps.append(now - last - TICK)
            last = now

    tick = asyncio.ensure_future(ticker())
    await asyncio.sleep(0.05)  # the ticker runs before the work starts
    t0 = time.perf_counter()
    await work()
    seconds = time.perf_counter() - t0
    stop.set()
    await tick
    return {"max_stall_ms": max(gaps) * 1000, "p99_stall_ms": _p99(gaps) * 1000,
            "seconds": seconds}


def _p99(xs: list[float]) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(len(s) * 0.99))]


def loop_stall(b: Bench, n: int = 100) -> dict[str, dict[str, float]]:
    system = b.systems["sagaworker"]
    sw, tool = system.sw, system.tasks["noop"]
    out: dict[str, dict[str, float]] = {}

    async def async_api() -> None:
        saga = await sw.abegin(b.tag("aio"))
        steps = await asyncio.gather(*(saga.aenqueue(tool, b.tag("k")) for _ in range(n)))
        await asyncio.gather(*(s.aresult(timeout=120) for s in steps))

    async def blocking_on_loop() -> None:
        saga = sw.begin(b.tag("aio"))
        steps = [saga.enqueue(tool, b.tag("k")) for _ in range(n)]
        for s in steps:
            s.result(timeout=120)

    async def to_thread() -> None:
        saga = await asyncio.to_thread(sw.begin, b.tag("aio"))
        steps = await asyncio.gather(*(asyncio.to_thread(saga.enqueue, tool, b.tag("k"))
                                       for _ in range(n)))
        await asyncio.gather(*(asyncio.to_thread(s.result, 120) for s in steps))

    for name, work in (("async_api", async_api), ("sync_on_loop", blocking_on_loop),
                       ("to_thread", to_thread)):
        out[name] = asyncio.run(_ticked(work))
    return out


def thousand_waits(b: Bench, sagas: int = 50, per_saga: int = 20) -> dict[str, dict[str, float]]:
    """The steps are journaled with their messages held back; the waits start; then the
    messages go out, so every wait is pending while the worker runs the steps."""
    system = b.systems["sagaworker"]
    sw, tool = system.sw, system.tasks["noop"]
    out: dict[str, dict[str, float]] = {}
    for mode in ("aresult", "to_thread_result", "thread_per_wait"):
        held: list[tuple[Any, ...]] = []
        real = sw.rt.bus.publish_step
        sw.rt.bus.publish_step = lambda *a, _h=held, **k: _h.append(a) or True
        try:
            steps = [h.enqueue(tool, b.tag("k")) for h in
                     (sw.begin(b.tag("waits")) for _ in range(sagas)) for _ in range(per_saga)]
        finally:
            sw.rt.bus.publish_step = real
        base = threading.active_count()
        seconds, peak = asyncio.run(_waits(mode, steps, lambda h=held, r=real: [r(*a) for a in h]))
        out[mode] = {"waits": float(len(steps)), "threads_added": float(peak - base),
                     "seconds": seconds}
    return out


async def _waits(mode: str, steps: list[Any], release: Callable[[], Any]) -> tuple[float, int]:
    """Start a wait on each step, then ``release`` their messages: (seconds until every
    wait returned, the peak thread count meanwhile)."""
    done = asyncio.Event()
    peak = [threading.active_count()]

    async def watch() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], threading.active_count())
            await asyncio.sleep(0.01)

    w = asyncio.ensure_future(watch())
    t0 = time.perf_counter()
    pending: Awaitable[Any]
    if mode == "aresult":
        pending = asyncio.gather(*(s.aresult(timeout=300) for s in steps))
    elif mode == "to_thread_result":
        pending = asyncio.gather(*(asyncio.to_thread(s.result, 300) for s in steps))
    else:
        loop = asyncio.get_running_loop()
        futs = [loop.create_future() for _ in steps]
        for s, f in zip(steps, futs, strict=True):
            threading.Thread(target=_resolve, args=(loop, f, s), daemon=True).start()
        pending = asyncio.gather(*futs)
    await asyncio.sleep(0.2)  # every wait is waiting
    await asyncio.to_thread(release)
    await pending
    seconds = time.perf_counter() - t0
    done.set()
    await w
    return seconds, peak[0]


def _resolve(loop: asyncio.AbstractEventLoop, fut: asyncio.Future[Any], step: Any) -> None:
    value = step.result(300)
    loop.call_soon_threadsafe(fut.set_result, value)


def run(b: Bench, rounds: int) -> dict[str, Any]:
    """Interleaved rounds; each figure the median, with its spread."""
    stalls: list[dict[str, dict[str, float]]] = []
    waits: list[dict[str, dict[str, float]]] = []
    for _ in range(rounds):
        stalls.append(loop_stall(b))
        waits.append(thousand_waits(b))
    res: dict[str, Any] = {"loop_stall": {}, "waits": {}}
    for name in stalls[0]:
        res["loop_stall"][name] = {k: median([r[name][k] for r in stalls])
                                   for k in stalls[0][name]}
        res["loop_stall"][name]["max_of_rounds_ms"] = max(r[name]["max_stall_ms"]
                                                          for r in stalls)
    for name in waits[0]:
        res["waits"][name] = {k: median([r[name][k] for r in waits]) for k in waits[0][name]}
        res["waits"][name]["seconds_stdev"] = (
            statistics.pstdev([r[name]["seconds"] for r in waits]))
    return res


def render(res: dict[str, Any]) -> str:
    lines = ["| asyncio: 100 steps enqueued and awaited | longest loop stall (ms, median "
             "of rounds) | worst round (ms) | p99 stall (ms) | seconds |", "|---|---|---|---|---|"]
    for name, r in res["loop_stall"].items():
        lines.append(f"| {name} | {r['max_stall_ms']:.1f} | {r['max_of_rounds_ms']:.1f} | "
                     f"{r['p99_stall_ms']:.1f} | {r['seconds']:.2f} |")
    lines += ["", "| 1,000 concurrent waits | threads added | seconds |", "|---|---|---|"]
    for name, r in res["waits"].items():
        lines.append(f"| {name} | {r['threads_added']:.0f} | {r['seconds']:.2f} |")
    return "\n".join(lines)


def main() -> int:
    import json
    import sys

    from bench.harness import BROKERS, create_database, drop_database, prepare_schema

    run_id = f"aio{int(time.time()) % 100000}"
    db = f"bench_sw_{run_id}"
    url = create_database(db)
    prepare_schema(url, BROKERS["rabbitmq"], run_id)
    b = Bench(run_id, "rabbitmq", BROKERS["rabbitmq"], url, ("sagaworker",))
    try:
        res = run(b, int(sys.argv[1]) if len(sys.argv) > 1 else 3)
    finally:
        b.close()
        drop_database(db)
    print(json.dumps(res, indent=2))
    print(render(res))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
