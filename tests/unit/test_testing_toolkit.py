"""sagaworker.testing on the example order saga, and on a saga with a broken undo order."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
from celery import Celery

from sagaworker import CompensationContext, FlowContext, SagaStatus, Sagaworker
from sagaworker.testing import check_compensation

_clock = itertools.count()


def fan_flow(s: FlowContext, sku: str) -> list[str]:
    """Two steps at once, gathered, then one that uses their results."""
    got = s.gather(s.enqueue(f"{__name__}.hold", sku), s.enqueue(f"{__name__}.hold", "x"))
    return [*got, s.call(f"{__name__}.note", "+".join(got))]


def clock_flow(s: FlowContext, sku: str) -> str:
    """Asks for its second step with a value read outside the journal: not deterministic."""
    s.call(f"{__name__}.hold", sku)
    return str(s.call(f"{__name__}.note", f"at-{next(_clock)}"))


def _flow_sw(tmp_path: Path) -> Sagaworker:
    sw = Sagaworker(Celery("tkf", broker="memory://"),
                    database_url=f"sqlite:///{tmp_path / 'j.db'}")

    @sw.tool(compensable_by="release")
    def hold(sku: str) -> str:
        return f"hold-{sku}"

    @sw.compensation
    def release(ctx: CompensationContext) -> None:
        pass

    @sw.tool()
    def note(text: str) -> str:
        return text

    sw.flow()(fan_flow)
    sw.flow()(clock_flow)
    return sw


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


def test_example_order_flow_compensates_every_step_in_reverse() -> None:
    """The example's flow, run through sw.start in-process: each step fails and crashes in
    turn, undos run in reverse, and every replay after a step matches the journal."""
    from tasks import sw
    from tasks.orders import place_order

    cases = check_compensation(sw, place_order, "t-2", "sku-1", 1, "card-1", 100, crash=True)
    assert len(cases) == 8
    assert [c.tool.rsplit(".", 1)[-1] for c in cases[:4]] == [
        "reserve_inventory", "quote_shipping", "charge_card", "dispatch_order"]
    assert cases[3].undos_run == ["tasks.payment.refund_card",
                                  "tasks.inventory.release_inventory"]
    assert cases[6].crashed and cases[6].result.report.in_doubt[0].seq == 3
    assert all(c.result.status is SagaStatus.COMPENSATED for c in cases)
    # the arguments may also be given as args=/kwargs=
    assert len(check_compensation(sw, place_order, args=("t-3", "sku-1", 1),
                                  kwargs={"card": "card-1", "amount_cents": 100})) == 4


def test_toolkit_runs_a_flow_with_parallel_steps(tmp_path: Path) -> None:
    """enqueue/gather steps fail in turn like the others; the replays find nothing wrong."""
    sw = _flow_sw(tmp_path)
    cases = check_compensation(sw, fan_flow, "sku-9", crash=True)
    assert [c.tool.rsplit(".", 1)[-1] for c in cases[:3]] == ["hold", "hold", "note"]
    assert cases[2].undos_run == [f"{__name__}.release"] * 2


def test_toolkit_flags_a_flow_that_is_not_deterministic(tmp_path: Path) -> None:
    """A flow whose next step depends on something outside the journal fails the check
    with what the replays asked for; a work function is refused arguments."""
    sw = _flow_sw(tmp_path)
    with pytest.raises(AssertionError, match="clock_flow is not deterministic"):
        check_compensation(sw, clock_flow, "sku-1")
    with pytest.raises(TypeError, match="no registered flow"):
        check_compensation(sw, lambda s: None, "sku-1")


def test_toolkit_leaves_no_folder_behind(tmp_path: Path, monkeypatch: pytest.MonkeyPatch
                                         ) -> None:
    """Each check's throwaway journal is removed when the check ends."""
    import tempfile

    scratch = tmp_path / "tmp"
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    sw = _flow_sw(tmp_path)
    assert check_compensation(sw, fan_flow, "sku-9")
    assert list(scratch.iterdir()) == []
