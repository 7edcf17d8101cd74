"""The fault suite: at least 100 concurrent sagas per scenario, faults injected, the ledger
checked afterwards: every saga terminal, every effect EXECUTED (undone exactly once when its
saga compensated) or reported in doubt, no effect and no undo twice.

`make test` runs it at 100 sagas, some scenarios on one broker each; `make faults` at 400,
every scenario on both brokers (FAULT_SCALE=large).
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
from sqlalchemy import select

from sagaworker._journal.schema import entries
from tests.conftest import BROKERS, ROOT, Cluster, _broker, need, new_settings, worker_env
from tests.faults import services
from tests.faults._load import Figures, every, run_load, save

pytestmark = pytest.mark.services


def both_or(broker: str) -> list[str]:
    """Both brokers under ``make faults``; one in ``make test`` (which must stay under its
    budget): each broker still takes some of these faults there."""
    return ["rabbitmq", "redis"] if os.environ.get("FAULT_SCALE") == "large" else [broker]


def assert_clean(f: Figures) -> None:
    assert f.problems == [], "\n".join(f.problems[:20])
    assert f.effects_lost == 0 and f.effects_duplicated == 0 and f.undos_duplicated == 0
    assert f.completed + f.compensated + f.compensation_failed == f.sagas


def make_cluster(broker: str, pg_url: str, tmp: Path, workers: int = 1,
                 **env: str) -> Cluster:
    url = BROKERS[broker]
    need(broker, _broker(url))
    c = Cluster(new_settings(pg_url, url, tmp, redeliver_after=4, relay_after=2,
                             sweep_interval=1), tmp, broker)
    for _ in range(workers):
        c.start_worker(concurrency=4, **env)
    return c


@pytest.fixture
def fault_cluster(request: pytest.FixtureRequest, pg_url: str,
                  tmp_path: Path) -> Iterator[Cluster]:
    c = make_cluster(request.param, pg_url, tmp_path)
    yield c
    c.close()


def restart_worker(c: Cluster, i: int = 0, extra: tuple[str, ...] = (), **env: str) -> None:
    """SIGKILL a worker's whole process group, then start a fresh one in its place."""
    proc, log = c.workers[i]
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(10)
    from sagaworker.cli.demo import start_worker

    new = start_worker("tests.apps.cluster", worker_env(c.settings, c.default_queue, **env), log,
                       concurrency=4, extra=(*extra, "-n", f"r{uuid.uuid4().hex[:4]}@%h"))
    c.workers[i] = (new, log)


@pytest.mark.parametrize("fault_cluster", both_or("redis"), indirect=True)
def test_worker_sigkilled_repeatedly(fault_cluster: Cluster) -> None:
    """Whole worker (process group) SIGKILLed three times and restarted mid-load."""
    f = run_load(fault_cluster, "worker-sigkill",
                 inject=lambda stop: every(stop, 3.0, 3, lambda: restart_worker(fault_cluster)))
    assert f.faults >= 1
    assert_clean(f)


@pytest.mark.parametrize("fault_cluster", both_or("rabbitmq"), indirect=True)
def test_flows_survive_worker_sigkills(fault_cluster: Cluster) -> None:
    """Flows started and left to the workers, whose whole worker is SIGKILLed 3 times and
    restarted mid-load: every saga terminal, no effect lost or run twice, no undo twice."""
    f = run_load(fault_cluster, "flow-worker-sigkill", flows=True,
                 inject=lambda stop: every(stop, 3.0, 3, lambda: restart_worker(fault_cluster)))
    assert f.faults >= 1
    assert_clean(f)


@pytest.mark.parametrize("fault_cluster", ["rabbitmq"], indirect=True)
def test_pool_child_sigkilled_mid_tool(fault_cluster: Cluster) -> None:
    """Pool children SIGKILLed while running tools: in doubt at worst, never twice."""
    def kill_child() -> None:
        # the child that holds a running attempt (the journal names its pid), else any
        kids = psutil.Process(fault_cluster.workers[0][0].pid).children(recursive=True)
        pids = {k.pid for k in kids}
        with fault_cluster.sw.journal.engine.connect() as conn:
            running = [int(w.rpartition("|")[2]) for w in conn.execute(
                select(entries.c.worker).where(entries.c.phase == "INTENT",
                                               entries.c.lease_until.is_not(None))).scalars()
                       if w and w.rpartition("|")[2].isdigit()]
        targets = [p for p in running if p in pids]
        if targets:
            os.kill(random.choice(targets), signal.SIGKILL)
        elif kids:
            random.choice(kids).kill()

    f = run_load(fault_cluster, "child-sigkill",
                 inject=lambda stop: every(stop, 1.0, 6, kill_child))
    assert f.faults >= 1
    assert f.interrupted >= 1, "no kill interrupted a running tool"
    assert_clean(f)


@pytest.mark.parametrize("fault_cluster", both_or("rabbitmq"), indirect=True)
def test_broker_restarted_mid_run(fault_cluster: Cluster) -> None:
    """The broker is stopped and started again mid-run (Redis loses every message)."""
    restart = services.RESTART[fault_cluster.broker]
    try:
        f = run_load(fault_cluster, "broker-restart",
                     inject=lambda stop: every(stop, 0, 1, restart, first=2.0))
    finally:
        services.start_rabbitmq()
        services.start_redis()
    assert f.faults == 1
    assert_clean(f)


@pytest.mark.parametrize("fault_cluster", ["redis"], indirect=True)
def test_postgres_restarted_mid_run(fault_cluster: Cluster) -> None:
    """PostgreSQL is stopped and started again mid-run; workers and producers ride it out."""
    try:
        f = run_load(fault_cluster, "postgres-restart",
                     inject=lambda stop: every(stop, 0, 1, services.restart_postgres,
                                               first=2.0))
    finally:
        services.start_postgres()
    assert f.faults == 1
    assert_clean(f)


@pytest.mark.parametrize("fault_cluster", ["rabbitmq"], indirect=True)
def test_producer_killed_between_intent_and_publish(fault_cluster: Cluster) -> None:
    """Producers die after the INTENT commit and before the publish; the relay sends them."""
    c = fault_cluster
    orphaned = [f"crash-{uuid.uuid4().hex[:8]}-{i}" for i in range(20)]

    def crash(stop: threading.Event) -> int:
        proc = subprocess.run([sys.executable, "-m", "tests.apps.producer_crash", "--many",
                               *orphaned], env=worker_env(c.settings, c.default_queue),
                              cwd=ROOT, timeout=120)
        assert proc.returncode == 17
        for sid in orphaned:  # a later web request carries the saga on
            s = c.sw.get(sid)
            s.enqueue(c.sw.registry.tool("tests.apps.cluster.step").task, sid, "s1b")
        return len(orphaned)

    f = run_load(c, "producer-crash", inject=crash)
    assert_clean(f)
    from tests.faults._load import check, wait_for

    def done() -> bool:
        for sid in orphaned:
            rec = c.sw.inspect(sid)
            if any(e.phase.value == "INTENT" for e in rec.entries):
                return False
        return True

    wait_for(done, 120, "the relay to publish every orphaned INTENT")
    for sid in orphaned:
        c.sw.get(sid).complete()
    g = check(c, "producer-crash-orphans", orphaned, len(orphaned))
    assert_clean(g)
    assert g.completed == len(orphaned)


@pytest.mark.parametrize("broker", both_or("redis"))
def test_compensation_worker_killed_mid_chain(broker: str, pg_url: str,
                                              tmp_path: Path) -> None:
    """The worker running the chains (-Q sagaworker) is SIGKILLed mid-chain and restarted."""
    c = make_cluster(broker, pg_url, tmp_path)  # tools
    from sagaworker.cli.demo import start_worker

    env = {"TEST_UNDO_SLEEP": "0.2"}
    log = tmp_path / "comp.log"
    comp = start_worker("tests.apps.cluster", worker_env(c.settings, c.default_queue, **env), log,
                        concurrency=4, extra=("-Q", c.settings.queue, "-n", "comp@%h"))
    c.workers.append((comp, log))
    try:
        f = run_load(c, "compensation-worker-kill",
                     inject=lambda stop: every(stop, 2.5, 3,
                                               lambda: restart_worker(
                                                   c, 1, ("-Q", c.settings.queue), **env),
                                               first=3.0))
        assert f.faults >= 1 and f.compensated > 0
        assert_clean(f)
    finally:
        c.close()


@pytest.mark.parametrize("fault_cluster", ["redis"], indirect=True)
def test_ten_duplicate_failure_messages(fault_cluster: Cluster) -> None:
    """Ten failure messages per failing saga: one chain each, every undo once."""
    f = run_load(fault_cluster, "duplicate-failures", inject=lambda stop: 0,
                 duplicate_failures=10)
    assert_clean(f)
    starts: dict[str, int] = {}
    for e in fault_cluster.events():
        if e["event"] == "compensation_started":
            starts[e["saga_id"]] = starts.get(e["saga_id"], 0) + 1
    assert starts and set(starts.values()) == {1}
    f.faults = len(starts) * 10
    save(f)


@pytest.mark.parametrize("fault_cluster", both_or("rabbitmq"), indirect=True)
def test_duplicate_tool_deliveries(fault_cluster: Cluster) -> None:
    """Every tool message published three times: every effect still happens once."""
    f = run_load(fault_cluster, "duplicate-deliveries", inject=lambda stop: 0,
                 duplicate_deliveries=True)
    assert_clean(f)
    f.faults = 2 * f.steps  # two extra deliveries of every step
    save(f)



@pytest.mark.parametrize("fault_cluster", ["redis"], indirect=True)
def test_worker_outlives_redis_down_with_unacked_messages(fault_cluster: Cluster) -> None:
    """Redis goes away while the worker holds unacknowledged messages and stays down past
    the worker's first reconnect: the worker process keeps running and reconnects, and the
    steps it held still reach EXECUTED (the relay republishes what Redis lost)."""
    from sagaworker import Phase
    from tests.conftest import uid, wait_for

    c = fault_cluster
    proc = c.workers[0][0]
    key = uid("k")
    saga = c.sw.begin(key)
    steps = [saga.enqueue(c.tool("step"), key, f"s{i}", sleep=3) for i in range(4)]
    wait_for(lambda: all(c.sw.journal.entry_row(key, s.seq).started_at for s in steps), 30,
             "four steps running, their messages unacknowledged")
    try:
        services.restart_redis(down_for=6)
    finally:
        services.start_redis()
    for s in steps:
        assert s.result(timeout=60).endswith("-done")
    assert proc.poll() is None, f"the worker exited with {proc.returncode}"
    assert all(e.phase is Phase.EXECUTED for e in c.sw.inspect(key).entries)
