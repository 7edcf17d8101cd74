"""Producer-side rules on a SQLite journal with kombu's memory transport (no worker)."""

from __future__ import annotations

import pytest
from structlog.testing import capture_logs

from sagaworker import (
    BadInput,
    Phase,
    SagaExists,
    SagaNotFound,
    SagaStatus,
    Sagaworker,
    SagaworkerError,
)


def tools(sw: Sagaworker) -> tuple[object, object]:
    @sw.tool(compensable_by="undo")
    def reserve(sku: str, quantity: int) -> str:
        return sku

    @sw.compensation
    def undo() -> None:
        pass

    @sw.tool(reversibility="IRREVERSIBLE")
    def ship(order: str) -> str:
        return order

    return reserve, ship


def test_begin_twice_raises_saga_exists(sqlite_sw: Sagaworker) -> None:
    """A saga id is taken once; the error says what to do."""
    sqlite_sw.begin("o-1")
    with pytest.raises(SagaExists, match=r"sw\.get"):
        sqlite_sw.begin("o-1")


def test_unknown_saga(sqlite_sw: Sagaworker) -> None:
    """inspect/get of an unknown id raise SagaNotFound."""
    with pytest.raises(SagaNotFound):
        sqlite_sw.inspect("nope")
    with pytest.raises(SagaNotFound):
        sqlite_sw.get("nope")


def test_intent_is_journaled_before_publish(sqlite_sw: Sagaworker) -> None:
    """enqueue commits INTENT (with args and a task id) and logs step_intent."""
    reserve, _ = tools(sqlite_sw)
    saga = sqlite_sw.begin("o-2")
    with capture_logs() as logs:
        step = saga.enqueue(reserve, "sku-1", 2)
    e = sqlite_sw.inspect("o-2").entries[0]
    assert (e.seq, e.phase, e.args, e.task_id) == (1, Phase.INTENT, ["sku-1", 2], step.task_id)
    assert [ev["event"] for ev in logs] == ["step_intent"]
    assert logs[0]["saga_id"] == "o-2" and logs[0]["seq"] == 1


@pytest.mark.parametrize(("args", "kwargs", "match"), [
    ((object(), 1), {}, "not JSON"),
    (("sku",), {}, "malformed arguments"),
    (("sku", 1, 2), {}, "malformed arguments"),
    (("x" * 300_000, 1), {}, "byte limit"),
    (("sku", float("nan")), {}, "not JSON"),
])
def test_bad_input_is_refused_and_nothing_is_journaled(sqlite_sw: Sagaworker, args: tuple,
                                                      kwargs: dict, match: str) -> None:
    """Non-JSON, malformed or oversized arguments raise BadInput; the saga stays clean."""
    reserve, _ = tools(sqlite_sw)
    saga = sqlite_sw.begin("o-3")
    with pytest.raises(BadInput, match=match):
        saga.enqueue(reserve, *args, **kwargs)
    assert sqlite_sw.inspect("o-3").entries == []


def test_not_a_tool(sqlite_sw: Sagaworker) -> None:
    """Enqueueing a plain function says to decorate it."""
    saga = sqlite_sw.begin("o-4")
    with pytest.raises(SagaworkerError, match=r"@sw\.tool"):
        saga.enqueue(print, "x")


def test_gated_step_is_not_published_and_awaits(sqlite_sw: Sagaworker) -> None:
    """An IRREVERSIBLE step is journaled AWAITING_APPROVAL and the saga shows it."""
    _, ship = tools(sqlite_sw)
    saga = sqlite_sw.begin("o-5")
    saga.enqueue(ship, "order-5")
    rec = sqlite_sw.inspect("o-5")
    assert rec.status is SagaStatus.AWAITING_APPROVAL
    assert rec.entries[0].phase is Phase.AWAITING_APPROVAL
    [req] = sqlite_sw.pending_approvals()
    assert (req.saga_id, req.seq, req.args) == ("o-5", 1, ["order-5"])
    with pytest.raises(SagaworkerError, match=r"AWAITING_APPROVAL"):
        saga.complete()


def test_a_gate_past_its_sagas_deadline_is_not_pending(sqlite_sw: Sagaworker) -> None:
    """Once a saga's deadline has passed its gates are closed at the read: no sweeper pass
    needed for ``pending_approvals()`` to stop handing out their tokens."""
    from sqlalchemy import update

    from sagaworker._journal.schema import sagas

    _, ship = tools(sqlite_sw)
    sqlite_sw.begin("o-late", deadline=3600).enqueue(ship, "order-7")
    sqlite_sw.begin("o-open", deadline=3600).enqueue(ship, "order-8")
    assert [r.saga_id for r in sqlite_sw.pending_approvals()] == ["o-late", "o-open"]
    with sqlite_sw.journal.engine.begin() as conn:  # the deadline passes (no sweeper runs)
        conn.execute(update(sagas).where(sagas.c.saga_id == "o-late").values(
            deadline_at=sagas.c.created_at))
    assert [r.saga_id for r in sqlite_sw.pending_approvals()] == ["o-open"]


def test_a_result_timeout_says_the_step_still_runs_and_what_to_do(
        sqlite_sw: Sagaworker) -> None:
    """``result(timeout)`` passing says what is true (the step is still queued and will
    run) and what to do (wait again, or fail the saga), sync and async alike."""
    import asyncio

    reserve, _ = tools(sqlite_sw)
    saga = sqlite_sw.begin("o-t")
    step = saga.enqueue(reserve, "sku", 1)
    with pytest.raises(TimeoutError, match=r"Only the wait ended.*saga\.fail") as sync:
        step.result(timeout=0.01)
    with pytest.raises(TimeoutError, match=r"Only the wait ended.*saga\.fail"):
        asyncio.run(step.aresult(timeout=0.01))
    assert "nothing was changed" not in str(sync.value)
    assert sqlite_sw.inspect("o-t").entries[0].phase is Phase.INTENT


def test_fail_is_journaled_and_blocks_new_steps(sqlite_sw: Sagaworker) -> None:
    """saga.fail journals the request first (a lost message is found again)."""
    reserve, _ = tools(sqlite_sw)
    saga = sqlite_sw.begin("o-6")
    saga.fail("customer cancelled")
    row = sqlite_sw.journal.saga_row("o-6")
    assert row.fail_requested_at is not None and row.reason == "customer cancelled"
    with pytest.raises(SagaworkerError, match="failing"):
        saga.enqueue(reserve, "sku", 1)
    with pytest.raises(SagaworkerError):
        saga.complete()


def test_sagas_newest_first(sqlite_sw: Sagaworker) -> None:
    """sw.sagas lists newest first and filters by status."""
    for i in range(3):
        sqlite_sw.begin(f"n-{i}")
    sqlite_sw.get("n-1").complete()
    assert [r.saga_id for r in sqlite_sw.sagas()] == ["n-2", "n-1", "n-0"]
    assert [r.saga_id for r in sqlite_sw.sagas(status=SagaStatus.COMPLETED)] == ["n-1"]
    assert len(sqlite_sw.sagas(limit=2)) == 2


def test_fail_after_complete_is_refused(sqlite_sw: Sagaworker) -> None:
    """A COMPLETED saga cannot be failed: the error says to begin a correcting saga."""
    saga = sqlite_sw.begin("o-7")
    saga.complete()
    with pytest.raises(SagaworkerError, match="COMPLETED"):
        saga.fail("too late")
    assert sqlite_sw.inspect("o-7").status is SagaStatus.COMPLETED


def test_a_saga_block_whose_wait_ran_out_says_the_saga_was_failed(
        sqlite_sw: Sagaworker) -> None:
    """``sw.saga(..., timeout=)``: a step that did not finish in time raised into the
    block, so sw.saga failed the saga, which compensates. Neither the error nor the
    journaled reason says "the saga goes on": both say the saga was failed, and the
    error says how to wait for its compensation."""
    reserve, _ = tools(sqlite_sw)  # no worker: the step never runs
    with pytest.raises(TimeoutError) as got:
        sqlite_sw.saga("o-late", lambda s: s.call(reserve, "sku", 1), timeout=0.05)
    step = "step 1 (tests.unit.test_producer.reserve) of saga 'o-late'"
    assert str(got.value) == (
        f"{step} did not finish within 0.05 s, so sw.saga failed the saga: its steps are "
        "being undone, not carried on, and that did not finish within 0.05 s either. Wait "
        "for the outcome with sw.get('o-late').wait() (or see `sagaworker show o-late`)")
    rec = sqlite_sw.inspect("o-late")
    assert (rec.status, rec.reason) == (
        SagaStatus.RUNNING,
        f"TimeoutError: {step} did not finish within 0.05 s (sw.saga's timeout): "
        "sw.saga failed the saga")
    assert sqlite_sw.journal.saga_row("o-late").fail_requested_at is not None
