"""Step claims racing on PostgreSQL row locks (no worker: the journal's own transitions)."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from datetime import timedelta

import pytest
from celery import Celery
from sqlalchemy import update

from sagaworker import Sagaworker
from sagaworker._journal.repository import now
from sagaworker._journal.schema import entries
from sagaworker._machine.machine import Start
from tests.conftest import uid, wait_for

pytestmark = pytest.mark.services


@pytest.fixture
def pg_sw(pg_url: str) -> Iterator[Sagaworker]:
    sw = Sagaworker(Celery("claims", broker="memory://"), database_url=pg_url)

    @sw.tool(idempotent=True)
    def idem(x: int) -> int:
        return x

    sw.rt.bus.publish_step = lambda *a, **k: True  # type: ignore[method-assign]
    yield sw
    sw.journal.engine.dispose()


def _waiting_on_locks(sw: Sagaworker) -> int:
    """Sessions of the journal's database that wait for a row lock now."""
    with sw.journal.engine.connect() as conn:
        return int(conn.exec_driver_sql(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
            "AND wait_event_type = 'Lock'").scalar() or 0)


@pytest.mark.parametrize("lapsed", [False, True])
def test_deliveries_queued_on_the_saga_lock_claim_once(pg_sw: Sagaworker, lapsed: bool) -> None:
    """Deliveries released together from the saga row lock: exactly one runs the tool."""
    saga_id = uid("claim")
    saga = pg_sw.begin(saga_id)
    saga.enqueue(pg_sw.registry.tool(next(iter(pg_sw.registry.tools))).task, 1)
    if lapsed:  # an earlier attempt died: its lease lapsed with no outcome
        with pg_sw.journal.engine.begin() as conn:
            conn.execute(update(entries).where(entries.c.saga_id == saga_id).values(
                attempts=1, started_at=now(), lease_until=now() - timedelta(seconds=5),
                worker="elsewhere|1", attempt_token="dead"))
    results: list[Start] = []
    hold = pg_sw.journal.engine.connect()
    trans = hold.begin()
    pg_sw.journal.lock_saga(hold, saga_id)  # every claimer below queues behind this lock

    def claim(i: int) -> None:
        c = pg_sw.machine.claim_start(saga_id, 1, "tests.integration.test_claims.idem",
                                      token=f"tok{i}", worker=f"w|{i}", idempotent=True,
                                      task_id=f"t{i}")
        results.append(c.start)

    threads = [threading.Thread(target=claim, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    # the race needs every claimer queued on the lock (or done by the one-statement path,
    # which takes no saga lock) before the lock goes
    wait_for(lambda: _waiting_on_locks(pg_sw) + len(results) >= len(threads), 30,
             "every claimer to queue on the saga row's lock")
    trans.commit()
    hold.close()
    for t in threads:
        t.join(30)
    # the order the threads got the lock in is the database's: count, not order
    assert sorted(r.value for r in results) == ["busy", "busy", "busy", "run"]
    assert pg_sw.journal.entry_row(saga_id, 1).attempts == (2 if lapsed else 1)


def test_the_one_statement_claim_refuses_a_retry_out_of_turn_as_the_locked_one(
        pg_sw: Sagaworker) -> None:
    """On PostgreSQL (its one-statement claim, ``_pgfast``): a copy of an earlier Celery
    retry never runs the step, a dead attempt's step is not re-run by one, and a retry
    delivered before it is due is refused with the time left, as on SQLite
    (tests/unit/test_retry_claims.py)."""
    from tests.unit import test_retry_claims as turns

    charge, quote = turns.tools(pg_sw)
    turns.copies_of_earlier_retries_never_run(pg_sw, charge)
    turns.a_dead_attempts_step_is_not_rerun_by_an_earlier_retrys_copy(pg_sw, quote)
    turns.a_retry_delivered_early_waits_for_its_due_time(pg_sw, charge)
