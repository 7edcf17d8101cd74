"""sagaworker.testing on the example order saga, and on a saga with a broken undo order."""

from __future__ import annotations

from pathlib import Path

import pytest
from celery import Celery

from sagaworker import CompensationContext, SagaStatus, Sagaworker
from sagaworker.testing import check_compensation


def test_example_order_saga_compensates_every_step_in_reverse() -> None:
    """Each of the order saga's steps fails (and crashes) in turn; undos run in reverse."""
    from tasks import sw
    from tasks.orders import order_work

    cases = check_compensation(sw, order_work("t-1", "sku-1", 1, "card-1", 100), crash=True)
    assert len(cases) == 8  # 4 steps, failed and crashed
    last = cases[3]
    assert last.tool == "tasks.shipping.dispatch_order" and not last.crashed
    assert last.undos_run == ["tasks.payment.refund_card", "tasks.inventory.release_inventory"]
    crashed_charge = cases[6]
    assert crashed_charge.crashed and crashed_charge.result.report.in_doubt[0].seq == 3
    assert crashed_charge.result.status is SagaStatus.COMPENSATED


def test_toolkit_flags_an_undo_that_always_throws(tmp_path: Path) -> None:
    """An undo that throws on every try fails the check, naming the step and the error."""
    sw = Sagaworker(Celery("tk", broker="memory://"),
                    database_url=f"sqlite:///{tmp_path / 'j.db'}")

    @sw.tool(compensable_by="undo_a")
    def a() -> str:
        return "a"

    @sw.compensation
    def undo_a(ctx: CompensationContext) -> None:
        raise RuntimeError("refund API down")

    @sw.tool()
    def b() -> str:
        return "b"

    def work(s: object) -> None:
        s.call(a)  # type: ignore[attr-defined]
        s.call(b)  # type: ignore[attr-defined]

    with pytest.raises(AssertionError, match="refund API down"):
        check_compensation(sw, work)
    cases = check_compensation(sw, work, allow_dirty=True)
    assert cases[1].result.status is SagaStatus.COMPENSATION_FAILED
    assert cases[1].undos_run == [f"{__name__}.undo_a"]
    assert cases[1].result.report.dirty[0].attempts == 4  # 1 + 3 retries
