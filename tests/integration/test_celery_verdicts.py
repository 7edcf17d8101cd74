"""Celery's own verdict exceptions raised by a tool, through real workers: a step needs
an outcome, so a tool raising ``Ignore`` or ``Reject`` is journaled FAILED once (its saga
compensates) instead of being re-sent by the sweeper for ever."""

from __future__ import annotations

import pytest

from sagaworker import Phase, SagaStatus, ToolFailed
from tests.conftest import Cluster, uid, wait_for

pytestmark = pytest.mark.services
T = 60


@pytest.mark.parametrize("how", ["ignore", "reject", "requeue"])
@pytest.mark.one_broker
def test_a_tool_raising_ignore_or_reject_is_failed_once(crash_cluster: Cluster,
                                                       how: str) -> None:
    """``raise Ignore()`` / ``Reject(requeue=False|True)`` in a tool: the step is FAILED
    with the tool run once, the saga compensates step a, nothing re-sends the step."""
    c, key = crash_cluster, uid("v")
    saga = c.sw.begin(key)
    saga.enqueue(c.tool("step"), key, "a").result(timeout=T)
    step = saga.enqueue(c.tool("celery_verdict"), key, "b", how)
    with pytest.raises(ToolFailed):
        step.result(timeout=T)
    assert saga.wait(timeout=T).status is SagaStatus.COMPENSATED
    # the sweeper relays every 2 s here: a re-sent step would show as a second try
    with pytest.raises(AssertionError, match="timed out"):
        wait_for(lambda: len([r for r in c.ledger(key) if r.kind == "try"]) > 1, 6,
                 "a second try")
    assert [(r.kind, r.tool) for r in c.ledger(key)] == [
        ("effect", "a"), ("try", "b"), ("undo", "a")]
    entry = c.sw.inspect(key).entries[1]
    assert (entry.phase, entry.attempts) == (Phase.FAILED, 1)
