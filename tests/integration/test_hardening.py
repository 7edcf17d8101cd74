"""Regression tests for the state machine's defects (docs/reliability.md), through real
worker processes.

Each test drives a real `celery worker` on PostgreSQL and RabbitMQ or Redis, and reads what
really happened from the oracle ledger the test tools write (tests/apps/cluster.py). A fault test
first proves the fault hit (a try row written before the crash, a message really purged,
a message really delivered twice), then checks the guarantee.

Tests that crash-loop a worker on a broken implementation get a journal database of their
own (`lone`): a saga left COMPENSATING there cannot reach the sweepers of other tests.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import threading
import uuid
from collections.abc import Iterator
from typing import Any

import psutil
import pytest
import structlog
from kombu import Connection

from sagaworker import (
    ApprovalInvalid,
    OutcomeResult,
    Phase,
    SagaStatus,
    Sagaworker,
    SagaworkerError,
)
from tests.apps.cluster import forget
from tests.conftest import (
    BROKERS,
    Cluster,
    _broker,
    _pg,
    db_name,
    need,
    new_settings,
    uid,
    wait_for,
    worker_env,
)

pytestmark = pytest.mark.services
T = 60
SLOW = 120  # crash scenarios: every try costs a worker death and a lease


# -- helpers ----------------------------------------------------------------------------

def kinds(c: Cluster, key: str, *wanted: str) -> list[tuple[str, str]]:
    """The ledger rows of one test key as (kind, tool), in the order they were written."""
    return [(r.kind, r.tool) for r in c.ledger(key) if not wanted or r.kind in wanted]


def rows_of(c: Cluster, key: str, kind: str) -> list[Any]:
    return [r for r in c.ledger(key) if r.kind == kind]


def token_for(sw: Sagaworker, saga_id: str, seq: int) -> str:
    return next(p.token for p in sw.pending_approvals() if (p.saga_id, p.seq) == (saga_id, seq))


def pending(sw: Sagaworker, saga_id: str) -> list[int]:
    return [p.seq for p in sw.pending_approvals() if p.saga_id == saga_id]


def start_worker(c: Cluster, extra: tuple[str, ...] = (), concurrency: int = 2,
                 **env: str) -> subprocess.Popen[bytes]:
    """Cluster.start_worker, with extra `celery worker` arguments (a pool, say)."""
    from sagaworker.cli.demo import start_worker as start

    log = c.tmp / f"worker{len(c.workers) + 1}.log"
    proc = start("tests.apps.cluster", worker_env(c.settings, c.default_queue, **env), log,
                 concurrency=concurrency,
                 extra=(*extra, "-n", f"h{len(c.workers) + 1}-{uuid.uuid4().hex[:4]}@%h"))
    c.workers.append((proc, log))
    return proc


def kill_worker(proc: subprocess.Popen[bytes]) -> None:
    """SIGKILL a worker's whole process group (its pool children too)."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(10)


def log_text(c: Cluster) -> str:
    return "".join(log.read_text(errors="replace") for _, log in c.workers)


def received(c: Cluster, task_id: str) -> int:
    """How many times Celery logged receiving this task id (deliveries to a worker)."""
    return len(re.findall(re.escape(f"[{task_id}] received"), log_text(c)))


def handled(c: Cluster, task_id: str) -> int:
    """How many deliveries of this task id Celery logged as done, one way or another."""
    return len(re.findall(re.escape(f"[{task_id}] ") + r"(succeeded|raised|ignored|retry|rejected)",
                          log_text(c)))


def terminal(c: Cluster, key: str) -> bool:
    return c.sw.inspect(key).status.terminal


@pytest.fixture(params=sorted(BROKERS))
def lone(request: pytest.FixtureRequest,
         tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    """A cluster on a journal database of its own, with short leases (4 s) and a fast
    sweeper, and no worker yet: the test starts the workers it needs."""
    import psycopg

    from sagaworker._journal.migrate import upgrade

    need("PostgreSQL", _pg)
    broker = BROKERS[request.param]
    need(request.param, _broker(broker))
    name = db_name("sw_hard")
    with psycopg.connect("host=127.0.0.1 user=root dbname=postgres", autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    url = f"postgresql+psycopg://root@127.0.0.1:5432/{name}"
    upgrade(url)
    tmp = tmp_path_factory.mktemp(f"lone-{request.param}")
    c = Cluster(new_settings(url, broker, tmp, redeliver_after=4, relay_after=2,
                             sweep_interval=1), tmp, request.param)
    try:
        yield c
    finally:
        for proc, _ in c.workers:
            kill_worker(proc)
        c.cleanup_queues()
        c.sw.dispose_engine()
        forget(url)
        with psycopg.connect("host=127.0.0.1 user=root dbname=postgres",
                             autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


# -- 1. late arrivals: latest first, one undo at a time -----------------------------------

@pytest.mark.one_broker
def test_late_arrival_is_undone_first_and_undos_never_overlap(cluster: Cluster) -> None:
    """A step still running when the saga fails is undone before every earlier step, and
    the earlier step's undo starts only after it ended (one undo at a time)."""
    c = cluster
    key = uid("late")
    paced = c.tool("paced")
    saga = c.sw.begin(key)
    # a's undo takes 4 s: long enough that an undo of b started beside it would show
    saga.enqueue(paced, key, "a", undo_pause=4.0).result(timeout=T)
    b = saga.enqueue(paced, key, "b", sleep=3.0, undo_pause=0.5)
    wait_for(lambda: ("try", "b") in kinds(c, key), T, "step b to start")
    saga.fail("cancelled while b ran")
    res = saga.wait(timeout=T)
    assert b.result(timeout=T) == "b"  # b really was a late arrival: it reached EXECUTED
    assert ("effect", "b") in kinds(c, key)
    assert res.status is SagaStatus.COMPENSATED
    assert kinds(c, key, "undo_start", "undo") == [
        ("undo_start", "b"), ("undo", "b"), ("undo_start", "a"), ("undo", "a")]
    assert [o.seq for o in res.report.outcomes] == [2, 1]
    assert [o.result for o in res.report.outcomes] == [OutcomeResult.COMPENSATED] * 2


# -- 2. an undo that kills its worker every time ----------------------------------------

@pytest.mark.one_broker
def test_undo_that_kills_its_worker_ends_compensation_failed(lone: Cluster) -> None:
    """An undo whose worker dies on every try is tried 1 + retries times (a death counts
    as a try), ends COMPENSATION_FAILED saying the worker died, the chain goes on, and
    `compensation_failed` is logged for alerting."""
    c = lone
    c.start_worker()
    key = uid("deadly")
    saga = c.sw.begin(key)
    saga.enqueue(c.tool("step"), key, "a").result(timeout=T)
    saga.enqueue(c.tool("deadly_undo_step"), key, "b").result(timeout=T)
    saga.fail("undo b kills its worker")
    tries = 1 + c.settings.compensation_retries  # 3 with the fixture's 2 retries
    wait_for(lambda: terminal(c, key) or len(rows_of(c, key, "undo_try")) > tries, SLOW,
             "the saga to end (or the undo to be tried once too often)")
    assert [r.detail["attempt"] for r in rows_of(c, key, "undo_try")] == list(
        range(1, tries + 1))
    res = saga.wait(timeout=SLOW)
    assert res.status is SagaStatus.COMPENSATION_FAILED
    # every try of b really began (its row) and died; then a's undo still ran
    assert kinds(c, key, "undo_try", "undo") == [("undo_try", "b")] * tries + [("undo", "a")]
    assert [(o.seq, o.result) for o in res.report.outcomes] == [
        (2, OutcomeResult.COMPENSATION_FAILED), (1, OutcomeResult.COMPENSATED)]
    dirty = res.report.dirty[0]
    assert dirty.attempts == tries
    assert re.search(r"died|lost|killed", dirty.detail or "", re.I), dirty.detail
    e = c.sw.inspect(key).entries[1]
    assert e.compensation is OutcomeResult.COMPENSATION_FAILED
    assert e.compensation_attempts == tries
    failed = wait_for(lambda: [x for x in c.events(key) if x["event"] == "compensation_failed"],
                      10, "the compensation_failed line")
    assert len(failed) == 1
    assert failed[0]["dirty_state"] is True and failed[0]["level"] == "error"
    assert failed[0]["seq"] == 2 and failed[0]["attempts"] == tries


# -- 3. an idempotent step whose attempt kills its worker every time ----------------------

@pytest.mark.one_broker
def test_idempotent_step_that_kills_its_worker_is_rerun_at_most_max_reruns(
        lone: Cluster) -> None:
    """An idempotent step whose attempt dies every time is re-run at most
    SAGAWORKER_MAX_RERUNS times, then ends FAILED in doubt and the saga compensates."""
    c = lone
    max_reruns = 2
    c.start_worker(SAGAWORKER_MAX_RERUNS=str(max_reruns))
    key = uid("idemdie")
    saga = c.sw.begin(key)
    saga.enqueue(c.tool("step"), key, "a").result(timeout=T)
    saga.enqueue(c.tool("idem_kills_worker"), key, "i")
    wait_for(lambda: terminal(c, key) or len(rows_of(c, key, "try")) > 1 + max_reruns, SLOW,
             "the saga to end (or the step to be run once too often)")
    tries = len(rows_of(c, key, "try"))
    assert tries == 1 + max_reruns, f"the step ran {tries} times"
    res = saga.wait(timeout=SLOW)
    assert res.status is SagaStatus.COMPENSATED
    e = c.sw.inspect(key).entries[1]
    assert e.phase is Phase.FAILED and e.in_doubt and e.compensation is None
    assert e.attempts == 1 + max_reruns
    assert [d.seq for d in res.report.in_doubt] == [2]
    assert kinds(c, key) == [("effect", "a")] + [("try", "i")] * (1 + max_reruns) + [
        ("undo", "a")]


# -- 4. approve right after fail ----------------------------------------------------------

def gated(c: Cluster) -> tuple[str, Any, Any]:
    """A saga with one EXECUTED step and a gated IRREVERSIBLE `ship` step (seq 2)."""
    key = uid("gate")
    saga = c.sw.begin(key)
    saga.enqueue(c.tool("step"), key, "a").result(timeout=T)
    ship = saga.enqueue(c.tool("ship"), key, "parcel")
    return key, saga, ship


def _never_shipped(c: Cluster, sagas: list[tuple[str, Any, Any]]) -> None:
    for key, saga, _ in sagas:
        res = saga.wait(timeout=T)
        assert res.status is SagaStatus.COMPENSATED, key
        assert ("effect", "ship") not in kinds(c, key), f"{key} shipped for a failing saga"
        assert c.sw.inspect(key).entries[1].phase is Phase.CANCELLED
        assert kinds(c, key, "undo") == [("undo", "a")]


def test_approve_right_after_fail_is_refused(cluster: Cluster) -> None:
    """Approving a gate right after its saga was asked to fail raises ApprovalInvalid, the
    gate is no longer offered, the IRREVERSIBLE step never runs (ten sagas over)."""
    c = cluster
    sagas = [gated(c) for _ in range(10)]
    for key, saga, _ in sagas:
        token = token_for(c.sw, key, 2)
        saga.fail("order cancelled")
        with pytest.raises(ApprovalInvalid):
            c.sw.approve(token, approver="alice")
        assert pending(c.sw, key) == []
    _never_shipped(c, sagas)


def _race(c: Cluster, saga: Any, token: str) -> list[BaseException]:
    """saga.fail() and sw.approve() released together from two threads; unexpected errors."""
    barrier = threading.Barrier(2)
    errors: list[BaseException] = []

    def approve() -> None:
        barrier.wait()
        try:
            c.sw.approve(token, approver="alice")
        except ApprovalInvalid:
            pass  # fail() landed first: refused, as it must be
        except BaseException as exc:
            errors.append(exc)

    t = threading.Thread(target=approve)
    t.start()
    barrier.wait()
    saga.fail("order cancelled")
    t.join(T)
    return errors


def test_fail_and_approve_raced_never_ship(cluster: Cluster) -> None:
    """fail() and approve() at the same moment from two threads: whichever lands first,
    the IRREVERSIBLE step of a saga asked to fail never runs."""
    c = cluster
    sagas = [gated(c) for _ in range(10)]
    for key, saga, _ in sagas:
        assert _race(c, saga, token_for(c.sw, key, 2)) == []
    _never_shipped(c, sagas)


# -- 5. a Celery retry whose message is lost ----------------------------------------------

def _drop_retry_message(c: Cluster, task_id: str) -> int:
    """Remove the dead worker's pending retry message from the broker; how many went."""
    if c.broker == "rabbitmq":
        with Connection(c.settings.broker_url, connect_timeout=3) as conn:
            return int(conn.channel().queue_purge(c.default_queue) or 0)
    import redis

    r = redis.Redis.from_url(c.settings.broker_url)
    gone = 0
    for item in r.lrange(c.default_queue, 0, -1):
        if task_id.encode() in item:
            gone += int(r.lrem(c.default_queue, 0, item))
    for tag, value in r.hscan_iter("unacked"):  # held by the killed worker, unacked
        if task_id.encode() in value:
            gone += int(r.hdel("unacked", tag))
            r.zrem("unacked_index", tag)
    return gone


@pytest.mark.one_broker
def test_lost_celery_retry_message_is_sent_again(lone: Cluster) -> None:
    """A step waiting for a Celery retry whose message is lost (worker SIGKILLed, message
    purged) is sent again by the sweeper and reaches EXECUTED."""
    c = lone
    proc = c.start_worker()
    key = uid("retry")
    saga = c.sw.begin(key)
    step = saga.enqueue(c.tool("retried_later"), key, "r", 1)
    wait_for(lambda: ("try", "r") in kinds(c, key), T, "the first attempt")
    # Celery logs the retry once it re-published the task with its 3 s countdown
    wait_for(lambda: re.search(re.escape(f"[{step.task_id}] retry"), log_text(c)), 10,
             "the retry to be scheduled")
    kill_worker(proc)
    assert kinds(c, key) == [("try", "r")]  # the retry had not run yet
    dropped = [0]

    def drop() -> bool:
        dropped[0] += _drop_retry_message(c, step.task_id)
        return dropped[0] >= 1

    wait_for(drop, 15, "the retry message to be purged from the broker")
    c.start_worker()
    wait_for(lambda: c.sw.inspect(key).entries[0].phase is Phase.EXECUTED, T,
             "the step whose retry message was lost to reach EXECUTED")
    assert step.result(timeout=T) == "r"
    assert kinds(c, key) == [("try", "r"), ("try", "r"), ("effect", "r")]


def test_a_claim_whose_tool_never_started_is_released_not_doubted(lone: Cluster) -> None:
    """An attempt stopped between its claim and its tool's call (here: its span cannot be
    made) releases its claim: the step is sent again and runs once, its worker alive all
    along; never in doubt (the tool is not idempotent: a lapsed claim would fail the saga
    as "its worker was lost"). Delivered, and run eagerly by a flow's worker."""
    c = lone
    c.start_worker(concurrency=1, TEST_FAIL_BEFORE_TOOL="unstarted")
    key = uid("unstarted")
    saga = c.sw.begin(key)
    step = saga.enqueue(c.tool("step"), key, "a")
    assert step.result(timeout=T) == "a-done"
    wait_for(lambda: any(e.get("event") == "step_released" for e in c.events(key)), T,
             "the released claim's log line")  # the fault hit: before the tool
    [e] = c.sw.inspect(key).entries
    assert (e.phase, e.attempts, e.in_doubt) == (Phase.EXECUTED, 2, False)
    assert kinds(c, key) == [("effect", "a")]
    saga.complete()
    assert c.sw.inspect(key).status is SagaStatus.COMPLETED


def test_an_eager_claim_whose_tool_never_started_is_released_not_doubted(
        lone: Cluster) -> None:
    """The same for a flow's step that the worker which journaled the step before it runs
    at once (claimed with its INTENT, no message): released, sent again, run once."""
    from tests.apps.cluster import load_flow

    c = lone
    c.start_worker(concurrency=1, TEST_FAIL_BEFORE_TOOL="unstarted", TEST_FAIL_AT="2")
    key = uid("unstarted-flow")
    c.sw.start(key, load_flow, key)
    assert c.sw.get(key).wait(timeout=T).value == ["s1-done", "s2-done", "s3-done"]
    released = [e for e in c.events(key) if e.get("event") == "step_released"]
    interrupted = [e for e in c.events(key) if e.get("event") == "eager_step_interrupted"]
    assert [e.get("seq") for e in released + interrupted] == [2, 2]  # the fault hit, eager
    e = c.sw.inspect(key).entries
    assert [(x.seq, x.attempts, x.in_doubt) for x in e] == [(1, 1, False), (2, 2, False),
                                                            (3, 1, False)]
    assert kinds(c, key) == [("effect", "s1"), ("effect", "s2"), ("effect", "s3")]


@pytest.mark.one_broker
def test_the_release_bound_counts_releases_not_celery_retries(lone: Cluster) -> None:
    """A step Celery retried SAGAWORKER_MAX_RERUNS times (2 here: its tool raised twice)
    whose next attempt stops before its tool (its span cannot be made) is released and
    sent again, and runs: the bound counts the releases of claims stopped before their
    tool (one here), not the step's attempts. Never in doubt, never compensated: its tool
    never started."""
    c = lone
    c.start_worker(concurrency=1, TEST_FAIL_BEFORE_TOOL="released", TEST_FAIL_AT="3",
                   SAGAWORKER_MAX_RERUNS="2")
    key = uid("released")
    saga = c.sw.begin(key)
    step = saga.enqueue(c.tool("retried"), key, "b", 2)  # raises on its first two tries
    wait_for(lambda: [e for e in c.events(key) if e.get("event") in (
        "step_released", "claim_not_released")], T, "the third attempt to stop before its tool")
    assert step.result(timeout=T) == "b"
    assert [e["event"] for e in c.events(key) if e.get("event") in (
        "step_released", "claim_not_released", "step_in_doubt")] == ["step_released"]
    [e] = c.sw.inspect(key).entries
    assert (e.phase, e.attempts, e.in_doubt) == (Phase.EXECUTED, 4, False)
    assert kinds(c, key) == [("try", "b"), ("try", "b"), ("try", "b"), ("effect", "b")]
    saga.complete()
    assert c.sw.inspect(key).status is SagaStatus.COMPLETED


# -- 6. a redelivery to a threads-pool worker while the tool runs --------------------------

def _force_redelivery(c: Cluster, proc: subprocess.Popen[bytes], task_id: str) -> None:
    """Make the broker deliver the running task again to the same worker process."""
    if c.broker == "rabbitmq":
        # close this worker's own AMQP connections (not other users' of the broker): its
        # unacked message is requeued and redelivered once the worker reconnects
        ports = {conn.laddr.port for conn in psutil.Process(proc.pid).net_connections("tcp")
                 if conn.raddr and conn.raddr.port == 5672}
        assert ports, "the worker holds no AMQP connection"
        out = subprocess.run(["rabbitmqctl", "-q", "list_connections", "pid", "peer_port"],
                             capture_output=True, text=True, timeout=30, check=True).stdout
        pids = [fields[0] for fields in (line.split("\t") for line in out.splitlines())
                if len(fields) == 2 and fields[1].strip().isdigit()
                and int(fields[1]) in ports]
        assert pids, f"no broker connection on ports {ports}"
        for pid in pids:
            subprocess.run(["rabbitmqctl", "-q", "close_connection", pid, "test"],
                           capture_output=True, timeout=30, check=True)
        return
    # Redis: what its visibility timeout does to a task running longer than it, now
    import redis

    r = redis.Redis.from_url(c.settings.broker_url)
    with Connection(c.settings.broker_url, transport=c.app.conf.broker_transport,
                    transport_options=dict(c.app.conf.broker_transport_options)) as conn:
        qos = conn.default_channel.qos
        tags = [tag for tag, value in r.hscan_iter("unacked") if task_id.encode() in value]
        assert tags, "the running task is not held unacked"
        for tag in tags:
            qos.restore_by_tag(tag.decode(), r)


def test_redelivery_to_a_threads_worker_while_the_tool_runs(lone: Cluster) -> None:
    """A task redelivered to the same `-P threads` worker process while its tool runs is
    left be: the effect happens once and the step is EXECUTED."""
    c = lone
    proc = start_worker(c, ("-P", "threads"), concurrency=4)
    assert "(thread)" in log_text(c)
    key = uid("threads")
    saga = c.sw.begin(key)
    step = saga.enqueue(c.tool("paced"), key, "slow", sleep=8.0)
    wait_for(lambda: ("try", "slow") in kinds(c, key), T, "the tool to start")
    _force_redelivery(c, proc, step.task_id)
    # the fault hit: the same task reached the same worker again while the tool ran
    wait_for(lambda: received(c, step.task_id) >= 2, 30, "the redelivery")
    assert ("effect", "slow") not in kinds(c, key)
    assert step.result(timeout=T) == "slow"
    assert c.sw.inspect(key).entries[0].phase is Phase.EXECUTED
    wait_for(lambda: handled(c, step.task_id) >= 2, T, "both deliveries to be done")
    assert kinds(c, key, "try", "effect") == [("try", "slow"), ("effect", "slow")]
    saga.complete()


# -- 7. approval events and a required approver -------------------------------------------

def test_approval_events_carry_the_approver(cluster: Cluster) -> None:
    """approval_requested is logged when a gate is journaled; approval_granted and
    approval_rejected are logged where the decision is made, with the approver."""
    c = cluster
    with structlog.testing.capture_logs() as logs:
        key, saga, ship = gated(c)
        c.sw.approve(token_for(c.sw, key, 2), approver="alice")
        other, _, _ = gated(c)
        c.sw.reject(token_for(c.sw, other, 2), approver="bob", reason="fraud check")
    approval = [(e["event"], e.get("saga_id"), e.get("seq"), e.get("approver"), e["log_level"])
                for e in logs if str(e.get("event", "")).startswith("approval_")]
    assert approval == [
        ("approval_requested", key, 2, None, "info"),
        ("approval_granted", key, 2, "alice", "info"),
        ("approval_requested", other, 2, None, "info"),
        ("approval_rejected", other, 2, "bob", "warning"),
    ]
    assert all(e.get("tool") == "tests.apps.cluster.ship" for e in logs
               if str(e.get("event", "")).startswith("approval_"))
    assert ship.result(timeout=T) == "shipped-parcel"
    saga.complete()


def test_empty_approver_is_refused_and_changes_nothing(cluster: Cluster) -> None:
    """approve/reject with an empty approver raise and leave the gate pending."""
    c = cluster
    key, _, ship = gated(c)
    token = token_for(c.sw, key, 2)
    with pytest.raises((ValueError, SagaworkerError)):
        c.sw.approve(token, approver="")
    with pytest.raises((ValueError, SagaworkerError)):
        c.sw.reject(token, approver="", reason="no one")
    assert pending(c.sw, key) == [2]
    e = c.sw.inspect(key).entries[1]
    assert e.phase is Phase.AWAITING_APPROVAL and e.approved_by is None
    assert c.sw.inspect(key).status is SagaStatus.AWAITING_APPROVAL
    c.sw.approve(token, approver="alice")  # the gate still works with a real approver
    assert ship.result(timeout=T) == "shipped-parcel"


# -- 8. sw.saga never leaves a saga RUNNING ---------------------------------------------

def test_sync_saga_whose_settling_times_out_still_ends(cluster: Cluster) -> None:
    """sw.saga whose unawaited step outlives the timeout never leaves the saga RUNNING:
    the caller gets TimeoutError (the step still runs when the timeout passes), the saga
    fails, and the step is undone once it reaches EXECUTED."""
    c = cluster
    key = uid("settle")
    paced = c.tool("paced")

    def work(s: Any) -> str:
        s.enqueue(paced, key, "late", sleep=5.0)  # never awaited
        # the step is running when the work returns: settling cannot end in 1 s
        wait_for(lambda: c.sw.inspect(key).entries[0].attempts == 1, T, "the step to start")
        return "returned before the step finished"

    with pytest.raises(TimeoutError):
        c.sw.saga(key, work, timeout=1)
    assert c.sw.inspect(key).entries[0].executed_at is None  # it was still running
    wait_for(lambda: ("effect", "late") in kinds(c, key), T, "the step to finish")
    try:
        wait_for(lambda: terminal(c, key), 30, "the saga to end")
    except AssertionError:
        raise AssertionError(f"saga {key} never ended: it is still "
                             f"{c.sw.inspect(key).status} 30 s after its step finished") from None
    rec = c.sw.inspect(key)
    assert rec.status is SagaStatus.COMPENSATED
    assert kinds(c, key, "undo") == [("undo", "late")]


# -- 9. EntryRecord.saga_id ----------------------------------------------------------------

def test_entry_records_carry_their_saga_id(cluster: Cluster) -> None:
    """Every EntryRecord names its saga: sw.orphans() says which saga needs eyes."""
    c = cluster
    key = uid("orphan")
    saga = c.sw.begin(key)
    step = saga.enqueue(c.tool("paced"), key, "o", sleep=2.0)
    wait_for(lambda: ("try", "o") in kinds(c, key), T, "the step to start")
    mine = [(e.saga_id, e.seq) for e in c.sw.orphans(older_than=0) if e.saga_id == key]
    assert mine == [(key, 1)]
    assert [e.saga_id for e in c.sw.inspect(key).entries] == [key]
    assert step.result(timeout=T) == "o"
    saga.complete()
