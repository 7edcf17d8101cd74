"""A claim whose tool never started is released, a bounded number of times: a setup that
always fails before the tool would otherwise cycle claim, release, re-send for ever
(tests/integration/test_hardening.py drives the release through real workers)."""

from __future__ import annotations

from typing import Any

from structlog.testing import capture_logs

from sagaworker import Sagaworker
from sagaworker._journal.schema import entries
from sagaworker._worker.failures import Failures


def _claimed(sw: Sagaworker, saga_id: str) -> str:
    @sw.tool()
    def thing(x: int) -> int:
        return x

    sw.rt.bus.publish_step = lambda *a, **k: True  # type: ignore[method-assign]
    sw.begin(saga_id).enqueue(thing, 1)
    claim = sw.machine.claim_start(saga_id, 1, thing.name, token="t-1", worker="w",
                                   idempotent=False, task_id=None)
    assert claim.start.value == "run"
    return "t-1"


def _lease(sw: Sagaworker, saga_id: str) -> Any:
    with sw.journal.engine.connect() as conn:
        return conn.execute(entries.select().where(entries.c.saga_id == saga_id)).one()


def _claim(sw: Sagaworker, saga_id: str, token: str) -> None:
    claim = sw.machine.claim_start(saga_id, 1, _lease(sw, saga_id).tool_name, token=token,
                                   worker="w", idempotent=False, task_id=None)
    assert claim.start.value == "run"


def test_a_claim_stopped_before_its_tool_is_released_up_to_max_reruns(
        sqlite_sw: Sagaworker) -> None:
    """Each release is counted in the journal (whichever process makes it): after
    SAGAWORKER_MAX_RERUNS of them the next claim stopped before its tool is left to lapse
    (the step goes in doubt, paged)."""
    token = _claimed(sqlite_sw, "u-1")
    failures = Failures(sqlite_sw.rt, lambda *a, **k: None)
    events = []
    for n in range(sqlite_sw.settings.max_reruns + 1):
        if n:
            token = f"t-{n + 1}"
            _claim(sqlite_sw, "u-1", token)  # the step sent again, claimed again
        with capture_logs() as logs:
            failures.unstarted("u-1", 1, token, RuntimeError("setup"))
        events += [e["event"] for e in logs]
    assert events == ["step_released"] * sqlite_sw.settings.max_reruns + [
        "claim_not_released"]
    row = _lease(sqlite_sw, "u-1")
    assert row.lease_until is not None and row.attempt_token == token  # left to lapse
    assert row.releases == sqlite_sw.settings.max_reruns


def test_the_release_bound_counts_releases_not_celery_retries(sqlite_sw: Sagaworker) -> None:
    """A step whose tool raised and was retried by Celery (here as often as the bound
    allows releases) is still released when its next attempt stops before its tool: its
    attempts are not releases."""
    token = _claimed(sqlite_sw, "u-3")
    failures = Failures(sqlite_sw.rt, lambda *a, **k: None)
    for n in range(sqlite_sw.settings.max_reruns):  # the tool raised: Celery retries
        sqlite_sw.machine.release("u-3", 1, token, "Boom")
        token = f"r-{n + 1}"
        _claim(sqlite_sw, "u-3", token)
    assert _lease(sqlite_sw, "u-3").attempts == 1 + sqlite_sw.settings.max_reruns
    with capture_logs() as logs:
        failures.unstarted("u-3", 1, token, RuntimeError("setup"))
    assert [e["event"] for e in logs] == ["step_released"]
    row = _lease(sqlite_sw, "u-3")
    assert (row.lease_until, row.phase, row.releases) == (None, "INTENT", 1)
    assert "stopped before its tool started (RuntimeError)" in row.error


def test_a_celery_retry_of_an_unstarted_attempt_is_journaled_and_no_verdict_follows(
        sqlite_sw: Sagaworker) -> None:
    """A tool with ``autoretry_for``: the error before its tool made Celery schedule a
    retry. Its due time and count are journaled on the released entry (the sweeper
    resends it only once overdue, never beside Celery's own message); Celery giving up on
    such an attempt journals no FAILED (its tool never ran: the step is sent again)."""
    token = _claimed(sqlite_sw, "u-2")
    failed: list[Any] = []
    failures = Failures(sqlite_sw.rt, lambda *a, **k: failed.append(a))
    failures.unstarted("u-2", 1, token, RuntimeError("setup"), "celery-id-2")
    failures.retrying("celery-id-2", RuntimeError("setup"), 120.0, 1)
    row = _lease(sqlite_sw, "u-2")
    assert row.celery_retries == 1 and row.retry_due_at is not None
    assert (row.retry_due_at - row.updated_at).total_seconds() > 100
    failures.unstarted("u-2", 1, token, RuntimeError("setup"), "celery-id-2")
    spec = sqlite_sw.registry.tool(row.tool_name)
    assert spec is not None
    assert failures.gave_up("celery-id-2", spec, RuntimeError("setup"), [1], {}) is False
    assert failed == []
