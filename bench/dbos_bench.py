"""The 3-step saga on DBOS Transact, on the same PostgreSQL (DBOS's system tables in the
same database, schema ``dbos``). DBOS runs workflows in-process: there is no broker hop.

Two forms: a direct workflow call from each client thread, and a DBOS queue
(enqueue + ``get_result``), which is the closer analogue of publishing to workers.
"""

from __future__ import annotations

from typing import Any

from dbos import DBOS, DBOSConfig, Queue

from bench.apps import work

_queue: Queue | None = None


@DBOS.step()
def bench_step(key: str) -> int:
    return work(key)


@DBOS.workflow()
def bench_saga(key: str) -> int:
    total = 0
    for _ in range(3):
        total += bench_step(key)
    return total


def launch(db_url: str) -> None:
    global _queue
    url = db_url.replace("postgresql+psycopg://", "postgresql://")
    config: DBOSConfig = {"name": "sagaworker-bench", "system_database_url": url,
                          "log_level": "WARNING"}
    DBOS(config=config)
    DBOS.launch()
    _queue = DBOS.register_queue("sagaworker_bench", worker_concurrency=2,
                                 polling_interval_sec=0.05)


def run_direct(key: str) -> int:
    return bench_saga(key)


def run_queued(key: str) -> int:
    assert _queue is not None
    handle: Any = _queue.enqueue(bench_saga, key)
    return int(handle.get_result(polling_interval_sec=0.01))


def shutdown() -> None:
    DBOS.destroy(destroy_registry=False)
