"""A tool's own ``current_task.retry()`` through real workers: the retry's due time and
count are journaled, whichever way it is asked (a delivered step, an eager one), so the
sweeper never re-sends a step whose retry is scheduled and ``max_retries`` holds."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from sqlalchemy import insert, select

from sagaworker import Phase, SagaStatus, ToolFailed
from sagaworker._journal.schema import entries
from tests.apps.cluster import engine, forget, ledger, retried_later_flow
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
)

pytestmark = pytest.mark.services
T = 60


def tries(c: Cluster, key: str, name: str = "b") -> list[Any]:
    return [r for r in c.ledger(key) if r.kind == "try" and r.tool == name]


@pytest.mark.one_broker
def test_a_tools_own_retry_with_a_countdown_runs_max_retries_plus_one(
        crash_cluster: Cluster) -> None:
    """``current_task.retry(countdown=6)`` with ``max_retries=1``: two runs, the second
    one no sooner than the countdown and as Celery's first retry; the sweeper (relaying
    every 2 s here) never sends the step while its retry is scheduled."""
    c, key = crash_cluster, uid("r")
    saga = c.sw.begin(key)
    step = saga.enqueue(c.tool("retries_later"), key, "b", 5, 6.0)
    with pytest.raises(ToolFailed):
        step.result(timeout=T)
    assert saga.wait(timeout=T).status is SagaStatus.COMPENSATED
    got = tries(c, key)
    assert [r.detail["retries"] for r in got] == [0, 1]
    assert (got[1].at - got[0].at).total_seconds() >= 5.9
    assert not [e for e in c.events(key) if e["event"] == "step_retry_resent"]
    entry = c.sw.inspect(key).entries[0]
    assert (entry.phase, entry.attempts) == (Phase.FAILED, 2)


@pytest.mark.one_broker
def test_a_tools_own_retry_without_a_countdown_is_not_resent_early(
        crash_cluster: Cluster) -> None:
    """``current_task.retry()`` with no countdown waits Celery's default delay (180 s):
    in the meantime nothing runs the step again, the journal holds the due time."""
    c, key = crash_cluster, uid("r")
    saga = c.sw.begin(key)
    saga.enqueue(c.tool("retries_later"), key, "b", 5, None)
    wait_for(lambda: tries(c, key), 20, "the first try")
    # the old sweeper resent it after 2x relay_after (4 s here): give it twice that
    with pytest.raises(AssertionError, match="timed out"):
        wait_for(lambda: len(tries(c, key)) > 1, 8, "a second try")
    assert len(tries(c, key)) == 1
    saga.fail("test over")
    assert saga.wait(timeout=T).status is SagaStatus.COMPENSATED


def test_an_eager_steps_retry_keeps_its_countdown(crash_cluster: Cluster) -> None:
    """An eager step asking for ``retry(countdown=4)`` is handed to the broker with that
    countdown, as Celery's first retry: b runs twice, 4 s apart, and the flow completes."""
    c, key = crash_cluster, uid("r")
    res = c.sw.start(key, retried_later_flow, key, 1, 4.0).wait(timeout=T)
    assert res.status is SagaStatus.COMPLETED, res.error
    got = tries(c, key)
    assert [r.detail["retries"] for r in got] == [0, 1]
    assert (got[1].at - got[0].at).total_seconds() >= 3.9
    assert [(e.seq, e.phase, e.attempts) for e in c.sw.inspect(key).entries] == [
        (1, Phase.EXECUTED, 1), (2, Phase.EXECUTED, 2), (3, Phase.EXECUTED, 1)]


def test_an_eager_steps_retries_stop_at_max_retries(crash_cluster: Cluster) -> None:
    """An eager step asking again and again (``max_retries=1``, countdown 3 s) runs twice,
    then FAILED: the sweeper never adds a try while the retry is scheduled."""
    c, key = crash_cluster, uid("r")
    res = c.sw.start(key, retried_later_flow, key, 5, 3.0).wait(timeout=T)
    assert res.status is SagaStatus.COMPENSATED, res.error
    assert [r.detail["retries"] for r in tries(c, key)] == [0, 1]
    assert c.sw.inspect(key).entries[1].phase is Phase.FAILED


@pytest.fixture(params=sorted(BROKERS))
def busy(request: pytest.FixtureRequest,
         tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    """One worker of two processes on a journal database of its own (no other cluster's
    sweeper sees its rows), its sweeper resending a lost retry 2 s after it was due; Redis
    redelivers nothing the worker holds during a test (visibility timeout 60 s)."""
    import psycopg

    from sagaworker._journal.migrate import upgrade

    need("PostgreSQL", _pg)
    broker = BROKERS[request.param]
    need(request.param, _broker(broker))
    name = db_name("sw_busy")
    with psycopg.connect("host=127.0.0.1 user=root dbname=postgres", autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    url = f"postgresql+psycopg://root@127.0.0.1:5432/{name}"
    upgrade(url)
    tmp = tmp_path_factory.mktemp(f"busy-{request.param}")
    c = Cluster(new_settings(url, broker, tmp, redeliver_after=60, relay_after=2,
                             sweep_interval=1), tmp, request.param)
    try:
        c.start_worker(concurrency=2)
        yield c
    finally:
        c.close()
        c.sw.dispose_engine()
        forget(url)
        with psycopg.connect("host=127.0.0.1 user=root dbname=postgres",
                             autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def named(c: Cluster, key: str, event: str) -> list[dict[str, Any]]:
    return [e for e in c.events(key) if e["event"] == event]


def go(c: Cluster, key: str, name: str) -> None:
    """Free the worker process ``holds_a_process`` ``name`` holds."""
    with engine(c.settings.database_url).begin() as conn:
        conn.execute(insert(ledger).values(key=key, kind="go", tool=name, detail={}))


@pytest.mark.one_broker
def test_a_retry_its_busy_worker_delays_past_its_due_time_runs_once(busy: Cluster) -> None:
    """A tool asking for ``retry(countdown=3)`` on every try (Celery allows it 3 tries)
    while both processes of its worker are busy: its retry's ETA copy waits in the worker
    past its due time, the sweeper resends it once (2 s after it was due) and then holds
    back while that copy waits in the queue. A process frees: the ETA copy runs and asks
    again; the sweeper's copy, of the earlier retry, comes next and is refused. Three
    tries, as Celery allows (there were 5 here, 7 in the review's run)."""
    c, key = busy, uid("busy")
    saga = c.sw.begin(key)
    step = saga.enqueue(c.tool("retries_every_time"), key, "b", 3.0)
    wait_for(lambda: tries(c, key), T, "the first try")
    # both processes taken before the retry is due
    blockers = c.sw.begin(uid("blockers"))
    for name in ("h1", "h2"):
        blockers.enqueue(c.tool("holds_a_process"), key, name, 90.0)
    wait_for(lambda: tries(c, key, "h1") and tries(c, key, "h2"), T, "both processes busy")
    with c.sw.journal.engine.connect() as conn:
        due = conn.execute(select(entries.c.retry_due_at).where(
            entries.c.saga_id == key)).scalar_one()
    busy_from = max(tries(c, key, "h1")[0].at, tries(c, key, "h2")[0].at)
    assert busy_from < due, "the worker was free when its retry came due"
    # the fault hits: the sweeper resends the retry while its ETA copy waits; then, on
    # its backoff (2 s, 4 s), resends it again or holds back while that copy is queued
    wait_for(lambda: named(c, key, "step_retry_resent"), T, "the sweeper's resend")
    wait_for(lambda: len(named(c, key, "step_retry_resent")) > 2
             or [e for e in c.events() if e["event"] == "retry_deferred"], T,
             "the sweeper's next passes over the retry")
    go(c, key, "h1")  # one process frees: the ETA copy (waiting in the worker) runs first
    wait_for(lambda: len(tries(c, key)) > 1, T, "the first retry")
    go(c, key, "h2")
    with pytest.raises(ToolFailed):
        step.result(timeout=T)
    assert saga.wait(timeout=T).status is SagaStatus.COMPENSATED
    got = tries(c, key)
    assert [r.detail["retries"] for r in got] == [0, 1, 2]
    # the first retry ran late: after its due time and the sweeper's resend
    assert got[1].at > busy_from and (got[1].at - due).total_seconds() > 2
    assert len(named(c, key, "step_retry_resent")) == 1
    # the sweeper's copy (counted 1) came after the ETA copy's run, which asked again
    assert [e["event"] for e in c.events(key) if e["event"] in (
        "step_superseded", "step_busy", "step_not_due")] == ["step_superseded"]
    [entry] = c.sw.inspect(key).entries
    assert (entry.phase, entry.attempts) == (Phase.FAILED, 3)
    wait_for(lambda: [e.phase for e in c.sw.inspect(blockers.saga_id).entries] == [
        Phase.EXECUTED] * 2, T, "the blockers' outcomes")
    blockers.complete()
