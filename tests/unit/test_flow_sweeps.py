"""The sweeper's part in flows, deadlines and idle sagas (journal logic, no worker)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from celery import Celery
from sqlalchemy import update
from structlog.testing import capture_logs

from sagaworker import FlowContext, Reversibility, SagaStatus, Sagaworker, Settings
from sagaworker._journal.dialect import db_later
from sagaworker._journal.schema import entries, sagas
from tests.statemachine.model import RecordingBus


class FlowBus(RecordingBus):
    def __init__(self, sagas: list[str]) -> None:
        super().__init__(sagas)
        self.advances: list[str] = []

    def send_advance(self, saga_id: str, *, countdown: float | None = None) -> None:
        self.advances.append(saga_id)


def gate_first(s: FlowContext, n: int) -> list[Any]:
    """A gate enqueued first, then two steps awaited one after the other."""
    g = s.enqueue("tests.unit.test_flow_sweeps.ship", n)
    a = s.call("tests.unit.test_flow_sweeps.plain", n)
    b = s.call("tests.unit.test_flow_sweeps.plain", n + 1)
    return [a, b, *s.gather(g)]


@pytest.fixture
def flow_sw(tmp_path: Path) -> Iterator[tuple[Sagaworker, FlowBus]]:
    app = Celery("flows", broker="memory://")
    sw = Sagaworker(app, settings=Settings(
        database_url=f"sqlite:///{tmp_path / 'j.db'}", broker_url="memory://",
        approval_secret="s" * 40, relay_after=30, idle_after=60))

    @sw.tool()
    def plain(n: int) -> int:
        return n

    @sw.tool(reversibility=Reversibility.IRREVERSIBLE)
    def ship(n: int) -> int:
        return n

    sw.flow()(gate_first)
    bus = FlowBus(["f-1", "a-1"])
    sw.rt.bus = bus
    yield sw, bus


def age(sw: Sagaworker, saga_id: str, seconds: float) -> None:
    """Time passes for one saga: every timestamp the sweeper reads moves back."""
    with sw.journal.engine.begin() as conn:
        conn.execute(update(sagas).where(sagas.c.saga_id == saga_id).values(
            updated_at=db_later(-seconds), created_at=db_later(-seconds)))
        conn.execute(update(entries).where(entries.c.saga_id == saga_id).values(
            updated_at=db_later(-seconds), created_at=db_later(-seconds)))


def run_step(sw: Sagaworker, saga_id: str, seq: int, tool: str, result: Any) -> None:
    sw.machine.claim_start(saga_id, seq, tool, token=f"t{seq}", worker="w",
                           idempotent=False, task_id=None)
    assert sw.machine.executed(saga_id, seq, f"t{seq}", result, 1.0).applied


def test_lost_advance_is_resent_while_a_gate_waits(flow_sw: tuple[Sagaworker, FlowBus]) -> None:
    """A step's outcome whose advance was lost is found although another step of the flow
    waits at its gate (the saga is AWAITING_APPROVAL)."""
    sw, bus = flow_sw
    sw.start("f-1", gate_first, 1)
    sw.flows.advance("f-1")  # journals the gate and step a
    rec = sw.inspect("f-1")
    assert rec.status is SagaStatus.AWAITING_APPROVAL and len(rec.entries) == 2
    run_step(sw, "f-1", 2, "tests.unit.test_flow_sweeps.plain", 1)  # its worker then dies
    bus.advances.clear()
    age(sw, "f-1", 120)
    sw.sweeper.sweep()
    assert bus.advances == ["f-1"]
    sw.flows.advance("f-1")
    assert [e.tool_name.rsplit(".", 1)[1] for e in sw.inspect("f-1").entries] == [
        "ship", "plain", "plain"]
    bus.advances.clear()
    sw.sweeper.sweep()  # advanced since that outcome: nothing to resend
    assert bus.advances == []


def test_deadline_and_idle(flow_sw: tuple[Sagaworker, FlowBus]) -> None:
    """A saga past its deadline is failed once (saga_deadline_passed); an undriven
    asynchronous saga is reported once per idle spell (saga_idle)."""
    sw, bus = flow_sw
    saga = sw.begin("a-1", deadline=3600)
    saga.enqueue(sw.registry.tool("tests.unit.test_flow_sweeps.plain").task, 5)
    run_step(sw, "a-1", 1, "tests.unit.test_flow_sweeps.plain", 5)
    age(sw, "a-1", 120)
    with capture_logs() as logs:
        sw.sweeper.sweep()
        sw.sweeper.sweep()
    assert [e["event"] for e in logs if e["event"] == "saga_idle"] == ["saga_idle"]
    with sw.journal.engine.begin() as conn:
        conn.execute(update(sagas).where(sagas.c.saga_id == "a-1")
                     .values(deadline_at=db_later(-1.0)))
    with capture_logs() as logs:
        sw.sweeper.sweep()
        sw.sweeper.sweep()
    assert [e["event"] for e in logs if e["event"] == "saga_deadline_passed"] == [
        "saga_deadline_passed"]
    assert sw.inspect("a-1").reason == "deadline passed"
    assert ("failure", "a-1", "deadline passed") in bus.messages


def leaky(s: FlowContext, order: str, card: str) -> None:
    """A flow whose own error quotes its card."""
    raise ValueError(f"order {order}: card {card} refused")


def test_a_flow_error_journals_no_redacted_value(tmp_path: Path) -> None:
    """The reason a raising flow fails with (journaled, logged) loses the values of its
    redacted parameters; the journal keeps the flow's real arguments."""
    card = "4242-4242-4242-4242"
    sw = Sagaworker(Celery("leak", broker="memory://"), settings=Settings(
        database_url=f"sqlite:///{tmp_path / 'j.db'}", broker_url="memory://", redact="card"))
    sw.flow()(leaky)
    sw.rt.bus = FlowBus(["l-1"])
    sw.start("l-1", leaky, "o-1", card)
    with capture_logs() as logs:
        sw.flows.advance("l-1")
    rec = sw.inspect("l-1")
    assert rec.reason == "the flow raised ValueError: order o-1: card [REDACTED] refused"
    assert rec.flow_args == ["o-1", card]
    assert card not in repr(logs)


#: what the flow below does on its next replay ("ask": the step; "raise": a new version
#: of its code raises before asking for the step its first run journaled)
REPLAY = {"then": "ask"}


def changed(s: FlowContext, n: int) -> int:
    if REPLAY["then"] == "raise":
        raise RuntimeError("a new deploy's code raises here")
    return int(s.call("tests.unit.test_flow_sweeps.plain", n))


def test_a_replay_that_raises_before_asking_for_a_journaled_step_diverged(
        flow_sw: tuple[Sagaworker, FlowBus]) -> None:
    """A replay that raises before it has asked for every step the journal holds fails
    the saga with `flow diverged at step N` and `flow_diverged`, not as the flow's own
    error."""
    sw, _ = flow_sw
    sw.flow(on_divergence="compensate")(changed)
    REPLAY["then"] = "ask"
    sw.start("ch-1", changed, 7)
    sw.flows.advance("ch-1")  # journals step 1
    assert [e.seq for e in sw.inspect("ch-1").entries] == [1]
    REPLAY["then"] = "raise"
    with capture_logs() as logs:
        sw.flows.advance("ch-1")
    rec = sw.inspect("ch-1")
    assert (rec.reason or "").startswith("flow diverged at step 1: the journal holds "
                                         "tests.unit.test_flow_sweeps.plain(7)")
    assert "raised RuntimeError before asking for it" in (rec.reason or "")
    assert [e["event"] for e in logs if e["event"] == "flow_diverged"] == ["flow_diverged"]
