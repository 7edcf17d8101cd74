"""The sweeper and a compensation chain that waited on a long forward step (journal
logic, no worker): the chain's backoff grows only while that step runs."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from celery import Celery
from sqlalchemy import update

from sagaworker import SagaStatus, Sagaworker, Settings
from sagaworker._journal.dialect import db_later
from sagaworker._journal.schema import entries, sagas
from tests.statemachine.world import RecordingBus


@pytest.fixture
def chain_sw(tmp_path: Path) -> Iterator[tuple[Sagaworker, RecordingBus]]:
    app = Celery("chains", broker="memory://")
    sw = Sagaworker(app, settings=Settings(
        database_url=f"sqlite:///{tmp_path / 'j.db'}", broker_url="memory://",
        relay_after=5, redeliver_after=30))

    @sw.tool(compensable_by="undo")
    def long_step(n: int) -> int:
        return n

    @sw.compensation
    def undo() -> None:
        pass

    bus = RecordingBus(["c-1"])
    sw.rt.bus = bus
    yield sw, bus


def waiting_chain(sw: Sagaworker) -> None:
    """c-1 compensates while its step 1 runs; the sweeper has resent the waiting chain
    many times (its next resend an hour away), its last look long ago."""
    saga = sw.begin("c-1")
    saga.enqueue(sw.registry.tool("tests.unit.test_chain_sweeps.long_step").task, 1)
    sw.machine.claim_start("c-1", 1, "tests.unit.test_chain_sweeps.long_step", token="t1",
                           worker="w", idempotent=False, task_id=None)
    saga.fail("customer cancelled")
    sw.machine.begin_compensation("c-1", "customer cancelled", "h1")
    assert sw.inspect("c-1").status is SagaStatus.COMPENSATING
    with sw.journal.engine.begin() as conn:
        conn.execute(update(sagas).where(sagas.c.saga_id == "c-1").values(
            chain_touched_at=db_later(-7200), updated_at=db_later(-7200), resends=10,
            resend_at=db_later(3000)))
        # the step still runs: its heartbeat keeps its lease fresh
        conn.execute(update(entries).where(entries.c.saga_id == "c-1").values(
            lease_until=db_later(60)))


def test_a_chain_waiting_on_a_running_step_keeps_its_backoff(
        chain_sw: tuple[Sagaworker, RecordingBus]) -> None:
    """While the forward step runs, the waiting chain is not resent before its backoff."""
    sw, bus = chain_sw
    waiting_chain(sw)
    bus.messages.clear()
    assert sw.sweeper.sweep()["chains"] == 0
    assert bus.messages == []


def test_a_chain_whose_step_finished_is_resent_without_its_long_backoff(
        chain_sw: tuple[Sagaworker, RecordingBus]) -> None:
    """Once the step it waited on has its outcome (the message that would resume the
    chain lost), the chain is resent at the next pass, not an hour later; then on a
    short backoff again (not on every pass)."""
    sw, bus = chain_sw
    waiting_chain(sw)
    assert sw.machine.executed("c-1", 1, "t1", 1, 1.0).applied  # its compensate: lost
    bus.messages.clear()
    assert sw.sweeper.sweep()["chains"] == 1
    assert bus.messages == [("compensate", "c-1")]
    assert sw.sweeper.sweep()["chains"] == 0
