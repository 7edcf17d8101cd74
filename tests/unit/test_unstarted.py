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


def test_a_claim_stopped_before_its_tool_is_released_up_to_max_reruns(
        sqlite_sw: Sagaworker) -> None:
    token = _claimed(sqlite_sw, "u-1")
    failures = Failures(sqlite_sw.rt, lambda *a, **k: None)
    last = 1 + sqlite_sw.settings.max_reruns
    with capture_logs() as logs:
        failures.unstarted("u-1", 1, token, RuntimeError("setup"), last)
    assert _lease(sqlite_sw, "u-1").lease_until is not None  # left to lapse: doubt, paged
    assert [e["event"] for e in logs] == ["claim_not_released"]
    with capture_logs() as logs:
        failures.unstarted("u-1", 1, token, RuntimeError("setup"), last - 1)
    row = _lease(sqlite_sw, "u-1")
    assert (row.lease_until, row.phase) == (None, "INTENT")
    assert "stopped before its tool started (RuntimeError)" in row.error
    assert [e["event"] for e in logs] == ["step_released"]


def test_a_celery_retry_of_an_unstarted_attempt_is_journaled_and_no_verdict_follows(
        sqlite_sw: Sagaworker) -> None:
    """A tool with ``autoretry_for``: the error before its tool made Celery schedule a
    retry. Its due time and count are journaled on the released entry (the sweeper
    resends it only once overdue, never beside Celery's own message); Celery giving up on
    such an attempt journals no FAILED (its tool never ran: the step is sent again)."""
    token = _claimed(sqlite_sw, "u-2")
    failed: list[Any] = []
    failures = Failures(sqlite_sw.rt, lambda *a, **k: failed.append(a))
    failures.unstarted("u-2", 1, token, RuntimeError("setup"), 1, "celery-id-2")
    failures.retrying("celery-id-2", RuntimeError("setup"), 120.0, 1)
    row = _lease(sqlite_sw, "u-2")
    assert row.celery_retries == 1 and row.retry_due_at is not None
    assert (row.retry_due_at - row.updated_at).total_seconds() > 100
    failures.unstarted("u-2", 1, token, RuntimeError("setup"), 1, "celery-id-2")
    spec = sqlite_sw.registry.tool(row.tool_name)
    assert spec is not None
    assert failures.gave_up("celery-id-2", spec, RuntimeError("setup"), [1], {}) is False
    assert failed == []
