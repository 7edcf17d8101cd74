"""A tool's own ``current_task.retry()`` through real workers: the retry's due time and
count are journaled, whichever way it is asked (a delivered step, an eager one), so the
sweeper never re-sends a step whose retry is scheduled and ``max_retries`` holds."""

from __future__ import annotations

from typing import Any

import pytest

from sagaworker import Phase, SagaStatus, ToolFailed
from tests.apps.cluster import retried_later_flow
from tests.conftest import Cluster, uid, wait_for

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
