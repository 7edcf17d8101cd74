"""``python -m bench.mcp_latency``: what a tool call through ``sagaworker mcp`` adds.

One saga step of the bench's ``noop`` tool (one Redis INCR), run by one ``celery worker``
(prefork, -c 2) on PostgreSQL and RabbitMQ, its own database ``bench_sw_mcp<pid>``,
measured three ways in alternating blocks within one run:

- ``direct``: ``saga.enqueue(noop, key).result()`` in this process (the floor);
- ``stdio``: ``tools/call`` of ``noop`` through a ``sagaworker -A bench.mcp_app mcp``
  process spawned by the MCP SDK's client (what a desktop host does);
- ``http``: the same through ``sagaworker mcp --http 127.0.0.1:PORT`` (Streamable HTTP);
- ``stdio_threads``: ``stdio`` with the pipes served by the MCP SDK's own ``stdio_server``
  (a thread for each line read and each write), as before ``sagaworker.mcp.pipes``.

It prints one JSON object: each way's median and p95 latency (ms) and the median added
latency of each MCP transport over ``direct``.

    .venv/bin/python -m bench.mcp_latency --calls 200 --rounds 3
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from typing import Any

import anyio
from mcp import Client, StdioServerParameters
from mcp.client.stdio import stdio_client

from bench import harness
from bench.apps import make_system
from bench.workers import LOG_DIR, ROOT, Worker

BROKER = "amqp://guest:guest@127.0.0.1:5672//"
Call = Callable[[int], Awaitable[None]]


def _env(db: str, queue: str) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT), "BENCH_SYSTEM": "sagaworker",
            "BENCH_BROKER": BROKER, "BENCH_DB": db, "BENCH_QUEUE": queue,
            "SAGAWORKER_LOG_LEVEL": "WARNING"}


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def _timed(call: Call, n: int, start: int) -> list[float]:
    out = []
    for i in range(n):
        t = time.perf_counter()
        await call(start + i)
        out.append((time.perf_counter() - t) * 1000)
    return out


async def _session(client: Client) -> Call:
    begun = await client.call_tool("saga_begin", {"purpose": "bench"})
    saga_id = begun.structured_content["saga_id"]

    async def call(i: int) -> None:
        r = await client.call_tool("noop", {"saga_id": saga_id, "key": f"mcp-{i}"})
        if r.structured_content["status"] != "EXECUTED":
            raise RuntimeError(r.content)

    return call


#: the server as ``stdio``, but on the SDK's threaded stdio (pipes taken as unpollable)
THREADED = ("import sys; import sagaworker.mcp.pipes as pipes; "
            "pipes.pollable = lambda fd: False; from sagaworker.cli import main; "
            "main(sys.argv[1:])")


async def _floors(client: Client) -> dict[str, Call]:
    """What a call costs before sagaworker's step: ``tools/list`` (the transport and the
    SDK's request handling; ``ping`` left the protocol in 2026-07-28) and ``saga_status``
    (a tool call that reads the journal once)."""
    begun = await client.call_tool("saga_begin", {"purpose": "bench"})
    saga_id = begun.structured_content["saga_id"]

    async def listed(i: int) -> None:
        await client.list_tools()

    async def status(i: int) -> None:
        r = await client.call_tool("saga_status", {"saga_id": saga_id})
        if r.is_error:
            raise RuntimeError(r.content)

    return {"stdio_list": listed, "stdio_status": status}


def _direct(system: Any) -> Call:
    saga = system.sw.begin(f"bench-mcp-direct-{os.getpid()}")
    noop = system.tasks["noop"]

    def one(i: int) -> None:
        saga.enqueue(noop, f"direct-{i}").result(timeout=30)

    async def call(i: int) -> None:
        await anyio.to_thread.run_sync(one, i)

    return call


async def _measure(system: Any, db: str, queue: str, calls: int, rounds: int
                   ) -> dict[str, list[float]]:
    from mcp.client.streamable_http import streamable_http_client

    port = _port()
    env = _env(db, queue)
    cmd = [sys.executable, "-m", "sagaworker.cli", "-A", "bench.mcp_app", "mcp"]
    log = (LOG_DIR / f"mcp-http-{port}.log").open("wb")
    http_proc = subprocess.Popen([*cmd, "--http", f"127.0.0.1:{port}"], cwd=ROOT, env=env,
                                 stdout=log, stderr=subprocess.STDOUT)
    try:
        for _ in range(600):
            with contextlib.suppress(OSError), socket.create_connection(
                    ("127.0.0.1", port), timeout=0.2):
                break
            await anyio.sleep(0.1)
        params = StdioServerParameters(command=cmd[0], args=cmd[1:], env=env, cwd=str(ROOT))
        threaded = StdioServerParameters(command=cmd[0], args=["-c", THREADED, *cmd[3:]],
                                         env=env, cwd=str(ROOT))
        with (LOG_DIR / "mcp-stdio.log").open("a") as errlog:
            async with Client(stdio_client(params, errlog=errlog)) as stdio, \
                    Client(stdio_client(threaded, errlog=errlog)) as old, \
                    Client(streamable_http_client(f"http://127.0.0.1:{port}/mcp")) as http:
                ways = {"direct": _direct(system), "stdio": await _session(stdio),
                        "stdio_threads": await _session(old),
                        "http": await _session(http), **await _floors(stdio)}
                for call in ways.values():  # warm-up: connections, pools, queues
                    await _timed(call, 20, 0)
                got: dict[str, list[float]] = {name: [] for name in ways}
                for r in range(rounds):
                    order = list(ways) if r % 2 == 0 else list(reversed(ways))
                    for name in order:
                        got[name] += await _timed(ways[name], calls, (r + 1) * 100_000)
                return got
    finally:
        http_proc.terminate()
        http_proc.wait(20)
        log.close()


def _p95(xs: list[float]) -> float:
    return sorted(xs)[int(len(xs) * 0.95) - 1]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.mcp_latency", description=__doc__)
    p.add_argument("--calls", type=int, default=200, help="calls of each way a round")
    p.add_argument("--rounds", type=int, default=3)
    a = p.parse_args(argv)
    run = f"mcp{os.getpid()}"
    db = harness.create_database(f"bench_sw_{run}")
    harness.prepare_schema(db, BROKER, run)
    queue = f"bench-{run}"
    system = make_system("sagaworker", broker=BROKER, db_url=db, queue=queue)
    worker = Worker("sagaworker", broker=BROKER, db_url=db, queue=queue, app=system.app)
    try:
        worker.wait_ready()
        got = anyio.run(_measure, system, db, queue, a.calls, a.rounds)
        median = {k: round(statistics.median(v), 3) for k, v in got.items()}
        print(json.dumps({
            "calls": a.calls, "rounds": a.rounds, "median_ms": median,
            "p95_ms": {k: round(_p95(v), 3) for k, v in got.items()},
            "added_median_ms": {k: round(median[k] - median["direct"], 3)
                                for k in ("stdio", "stdio_threads", "http")}}))
    finally:
        worker.stop()
        with system.app.connection_for_write() as conn:
            for name in (queue, f"{queue}.sw"):
                with contextlib.suppress(Exception):  # (a queue never declared)
                    conn.default_channel.queue_delete(name)
        system.sw.journal.engine.dispose()
        harness.drop_database(f"bench_sw_{run}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
