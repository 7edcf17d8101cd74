"""The three systems under test, each a Celery app built the same way in the producer
(the bench process) and in its ``celery worker`` subprocess.

* ``bare``: plain Celery no-op tasks, Celery defaults (early ack, prefetch 4, no confirms).
* ``minimal``: a hand-written minimal journal: one INTENT insert committed before the
  publish (publisher confirms on), one EXECUTED update committed by the worker; the same
  Celery reliability settings sagaworker applies (late acks, prefetch 1).
* ``guarded``: a hand-written journal that keeps sagaworker's guarantee for a tool that is
  not idempotent (never run twice): the INTENT insert committed before the publish, a
  claim committed before the tool runs (``UPDATE ... SET phase = 'CLAIMED', attempts =
  attempts + 1 WHERE id = :id AND phase = 'INTENT' RETURNING id``: no row back means the
  step was claimed before, and it is not run again), then the EXECUTED update: three
  commits, the Celery settings of ``minimal``.
* ``sagaworker``: the library under test.

Every task body does the same "work": one Redis INCR on a counter the producer watches,
so all systems are timed the same way.
"""

from __future__ import annotations

import os
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import redis
from celery import Celery
from sqlalchemy import Engine, create_engine, text

SYSTEMS = ("bare", "minimal", "minimal_pf4", "guarded", "sagaworker", "sagaworker_published")
COUNTER_REDIS = "redis://127.0.0.1:6379/13"

_local: dict[str, Any] = {}
_lock = threading.Lock()


def counter() -> redis.Redis:
    """One Redis client per process (made after the fork)."""
    key = f"redis-{os.getpid()}"
    client = _local.get(key)
    if client is None:
        client = redis.Redis.from_url(COUNTER_REDIS)
        _local[key] = client
    return client


def _engine(url: str) -> Engine:
    key = f"engine-{os.getpid()}-{url}"
    eng = _local.get(key)
    if eng is None:
        with _lock:
            eng = _local.get(key)
            if eng is None:
                eng = create_engine(url, pool_size=5, max_overflow=10)
                _local[key] = eng
    return eng


def work(key: str) -> int:
    """The tool's effect: one Redis INCR (the producer polls the counter)."""
    return int(counter().incr(key))


def stamp(key: str) -> None:
    """Round-trip probe: the worker writes the time it ran the task."""
    counter().set(key, repr(time.time()))


MINIMAL_DDL = """
CREATE TABLE IF NOT EXISTS bench_minimal (
    id uuid PRIMARY KEY,
    phase varchar(16) NOT NULL,
    tool varchar(200) NOT NULL,
    args jsonb NOT NULL,
    result jsonb,
    created_at timestamptz NOT NULL DEFAULT now(),
    executed_at timestamptz
)
"""


GUARDED_DDL = """
CREATE TABLE IF NOT EXISTS bench_guarded (
    id uuid PRIMARY KEY,
    phase varchar(16) NOT NULL,
    tool varchar(200) NOT NULL,
    args jsonb NOT NULL,
    attempts integer NOT NULL DEFAULT 0,
    result jsonb,
    created_at timestamptz NOT NULL DEFAULT now(),
    executed_at timestamptz
)
"""


@dataclass
class System:
    name: str
    app: Celery
    queue: str
    tasks: dict[str, Any] = field(default_factory=dict)
    sw: Any = None
    db_url: str = ""

    def enqueue(self, key: str, saga: Any = None) -> None:
        """One step of this system, from the producer's side."""
        if self.name == "bare":
            self.tasks["noop"].apply_async(args=[key])
        elif self.name.startswith("minimal") or self.name == "guarded":
            minimal_enqueue(self, key)
        else:
            saga.enqueue(self.tasks["noop"], key)


def journal_table(system: System) -> str:
    """The hand-written journal's table of ``system`` (minimal or guarded)."""
    return "bench_guarded" if system.name == "guarded" else "bench_minimal"


def minimal_enqueue(system: System, key: str) -> str:
    """One step of a hand-written journal: its INTENT committed, then its publish."""
    jid = str(uuid.uuid4())
    with _engine(system.db_url).begin() as conn:
        conn.execute(text(f"INSERT INTO {journal_table(system)} (id, phase, tool, args) "
                          "VALUES (:id, 'INTENT', 'noop', CAST(:args AS jsonb))"),
                     {"id": jid, "args": f'["{key}"]'})
    system.tasks["noop"].apply_async(args=[jid, key], task_id=jid)
    return jid


def make_system(name: str, *, broker: str, db_url: str, queue: str) -> System:
    """Build one system's Celery app; ``queue`` is unique per run (no collisions)."""
    app = Celery(f"bench_{name}", broker=broker)
    app.conf.update(task_default_queue=queue, task_serializer="json",
                    accept_content=["json"], result_backend=None, task_ignore_result=True,
                    worker_send_task_events=False, broker_connection_retry_on_startup=True,
                    worker_hijack_root_logger=False)
    system = System(name=name, app=app, queue=queue, db_url=db_url)
    if name == "bare":
        @app.task(name="bench.bare.noop")  # type: ignore[untyped-decorator]
        def bare_noop(key: str) -> int:
            return work(key)

        @app.task(name="bench.bare.undo")  # type: ignore[untyped-decorator]
        def bare_undo(key: str) -> int:
            return work(key)

        @app.task(name="bench.bare.stamp")  # type: ignore[untyped-decorator]
        def bare_stamp(key: str) -> None:
            stamp(key)

        system.tasks = {"noop": bare_noop, "undo": bare_undo, "stamp": bare_stamp}
    elif name.startswith("minimal"):
        # minimal: prefetch 1 (what sagaworker sets); minimal_pf4: Celery's default (4)
        app.conf.update(broker_transport_options={"confirm_publish": True,
                                                  "visibility_timeout": 60},
                        worker_prefetch_multiplier=4 if name == "minimal_pf4" else 1,
                        task_acks_late=True,
                        task_reject_on_worker_lost=True)

        @app.task(name=f"bench.{name}.noop")  # type: ignore[untyped-decorator]
        def minimal_noop(jid: str, key: str) -> None:
            value = work(key)
            with _engine(db_url).begin() as conn:
                conn.execute(text("UPDATE bench_minimal SET phase = 'EXECUTED', "
                                  "result = CAST(:r AS jsonb), executed_at = now() "
                                  "WHERE id = :id AND phase = 'INTENT'"),
                             {"id": jid, "r": str(value)})

        system.tasks = {"noop": minimal_noop}
    elif name == "guarded":
        app.conf.update(broker_transport_options={"confirm_publish": True,
                                                  "visibility_timeout": 60},
                        worker_prefetch_multiplier=1, task_acks_late=True,
                        task_reject_on_worker_lost=True)

        @app.task(name="bench.guarded.noop")  # type: ignore[untyped-decorator]
        def guarded_noop(jid: str, key: str) -> None:
            with _engine(db_url).begin() as conn:  # the claim, committed before the tool
                claimed = conn.execute(text(
                    "UPDATE bench_guarded SET phase = 'CLAIMED', attempts = attempts + 1 "
                    "WHERE id = :id AND phase = 'INTENT' RETURNING id"), {"id": jid}).first()
            if claimed is None:  # claimed before: never run twice
                return
            value = work(key)
            with _engine(db_url).begin() as conn:
                conn.execute(text("UPDATE bench_guarded SET phase = 'EXECUTED', "
                                  "result = CAST(:r AS jsonb), executed_at = now() "
                                  "WHERE id = :id AND phase = 'CLAIMED'"),
                             {"id": jid, "r": str(value)})

        system.tasks = {"noop": guarded_noop}
    elif name.startswith("sagaworker"):
        from sagaworker import Sagaworker, Settings

        # sagaworker_published: eager flow steps off (every step crosses the broker)
        settings = Settings(database_url=db_url, broker_url=broker, queue=f"{queue}.sw",
                            eager_steps=name == "sagaworker")
        sw = Sagaworker(app, settings=settings)
        system.sw = sw
        system.tasks = _sagaworker_tools(sw)
    else:
        raise ValueError(f"unknown system {name!r}; one of {SYSTEMS}")
    return system


def bench_flow(s: Any, key: str) -> int:
    """The 3-step saga as a flow: the workers carry it, nobody waits on a step."""
    return sum(int(s.call("bench.sw.noop", key)) for _ in range(3))


def _sagaworker_tools(sw: Any) -> dict[str, Any]:
    sw.flow(name="bench.flow3")(bench_flow)

    @sw.tool(name="bench.sw.noop")  # type: ignore[untyped-decorator]
    def noop(key: str) -> int:
        return work(key)

    @sw.tool(name="bench.sw.idle")  # type: ignore[untyped-decorator]
    def idle(key: str) -> None:
        """A tool whose work is removed (``bench.ceiling``): it returns at once."""
        return None

    @sw.tool(name="bench.sw.reserve", compensable_by="release")  # type: ignore[untyped-decorator]
    def reserve(key: str) -> int:
        return work(key)

    @sw.compensation  # type: ignore[untyped-decorator]
    def release() -> None:
        return None

    return {"noop": noop, "idle": idle, "reserve": reserve}
