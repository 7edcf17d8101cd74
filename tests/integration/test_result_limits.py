"""A result over SAGAWORKER_MAX_RESULT_BYTES, as a real worker meets it: the tool ran, so
its step is EXECUTED with the error saying why no result is journaled, and undone."""

from __future__ import annotations

import pytest

from sagaworker import OutcomeResult, Phase, SagaStatus, ToolFailed
from sagaworker.web import WebAuth, create_app
from tests.conftest import Cluster, uid

pytestmark = pytest.mark.services
T = 60
LIMIT = 64


@pytest.mark.one_broker
def test_a_worker_journals_no_result_over_the_limit(cluster: Cluster) -> None:
    """The worker reads the limit from its own environment: a result of 107 bytes is not
    journaled; ``result()`` raises ToolFailed with the error, the saga fails and the step's
    undo runs (``ctx.result`` None), and the API serves the error, no value."""
    c = cluster
    c.stop_workers()
    c.start_worker(SAGAWORKER_MAX_RESULT_BYTES=str(LIMIT))
    key, name = uid("big"), "n" * 100  # the result: "nnn...-done", 105 characters, quoted
    saga = c.sw.begin(key)
    error = (f"result is 107 bytes, over the {LIMIT}-byte limit (SAGAWORKER_MAX_RESULT_BYTES);"
             " return a reference (an id, a URL) instead of the data")
    with pytest.raises(ToolFailed) as failed:
        saga.enqueue(c.tool("step"), key, name).result(timeout=T)
    assert str(failed.value) == f"step 1 (tests.apps.cluster.step) failed: {error}"
    res = saga.wait(timeout=T)
    assert res.status is SagaStatus.COMPENSATED
    e = c.sw.inspect(key).entries[0]
    assert (e.phase, e.result, e.error) == (Phase.EXECUTED, None, error)
    assert [(o.seq, o.result) for o in res.report.outcomes] == [(1, OutcomeResult.COMPENSATED)]
    assert [(r.kind, r.detail["result"]) for r in c.ledger(key) if r.kind == "undo"] == [
        ("undo", None)]
    shown = create_app(c.sw, auth=WebAuth(anonymous_reads=True)).test_client().get(
        f"/sagas/{key}").get_json()["entries"][0]
    assert (shown["result"], shown["error"]) == (None, error)
