"""Library bugs the model checker found, each reproduced in a few lines, kept fixed."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from sagaworker._worker.replay import replay
from tests.statemachine.world import RecordingBus, build, model_flow


def test_a_replay_that_finds_the_flow_moved_on_journals_nothing(tmp_path: Path) -> None:
    """Two workers advance one flow at once (two parallel steps finished together): both
    replays read the journal, one journals the next step, the other's compare-and-set on
    the last seq misses. That one journals nothing and says nothing went wrong (it raised
    ValueError: the advance task failed, or the worker that journaled an EXECUTED logged
    flow_advance_failed). The same when the saga was asked to fail between the read and
    the write."""
    sw = build(f"sqlite:///{tmp_path / 'flow.db'}")
    sw.rt.bus = RecordingBus(["f-1"])
    sw.start("f-1", model_flow, 10)
    saga, rows = sw.journal.saga_and_entries("f-1")
    stale = replay(sw.rt, sw.producer, sw.flows.specs["model_flow"], saga, rows)
    assert stale.kind == "waits" and stale.ctx.new
    sw.flows.advance("f-1")  # the other worker's replay journals the first step
    sw.flows._journal_new("f-1", stale.ctx, saga.last_seq, 0)
    assert len(sw.journal.saga_and_entries("f-1")[1]) == 1


def test_a_late_attempt_found_in_doubt_is_not_told_it_failed_the_step(tmp_path: Path) -> None:
    """A claim found an attempt's worker lost and journaled the step in doubt (keeping the
    attempt's token); the attempt was only late, and now journals its failure. That is
    not its own replay: it is told it no longer holds the step (None), so it logs no
    step_failed and sends no second failure."""
    from sqlalchemy import update

    from sagaworker._journal.dialect import db_later
    from sagaworker._journal.schema import entries
    from sagaworker._machine.machine import Start

    sw = build(f"sqlite:///{tmp_path / 'late.db'}")
    sw.rt.bus = RecordingBus(["s-1"])
    tool = next(name for name in sw.registry.tools if name.endswith(".plain"))
    sw.begin("s-1").enqueue(tool, 1)
    assert sw.machine.claim_start("s-1", 1, tool, token="late", worker="w", idempotent=False,
                                  task_id=None).start is Start.RUN
    with sw.journal.engine.begin() as conn:
        conn.execute(update(entries).values(lease_until=db_later(-1)))
    assert sw.machine.claim_start("s-1", 1, tool, token="next", worker="w",
                                  idempotent=False, task_id=None).start is Start.IN_DOUBT
    assert sw.machine.failed("s-1", 1, "late", "boom") is None


def test_a_model_request_whose_worker_died_on_every_run_is_paged(tmp_path: Path) -> None:
    """A durable unit (an agent's model request) whose worker died on its first run and on
    its re-run is journaled in doubt by the next replay's claim: that replay logs
    step_in_doubt (the page) and sends the saga's failure, as a tool's delivery does. It
    said nothing and sent nothing: the saga waited, failing, for the sweeper."""
    from tests.statemachine.model import JournalMachine

    machine: Any = type("Doubt", (JournalMachine,),
                        {"URL": f"sqlite:///{tmp_path / 'unit.db'}", "_sw": None})
    m = machine()
    m.start_flow(False, True)
    saga_id = m.sagas[0]
    m.bus.messages.clear()
    for _ in range(2):  # the first run and its one re-run (max_reruns=1) die mid-request
        m.agent_turn(0, "die")
        m.lapse()
    n = len(m.logs)
    m.agent_turn(0, "ok")
    row = m.sw.journal.entry_row(saga_id, 1)
    assert (row.phase, bool(row.in_doubt)) == ("FAILED", True)
    assert [e["event"] for e in m.logs[n:] if e["event"] == "step_in_doubt"] == ["step_in_doubt"]
    assert [msg[:2] for msg in m.bus.messages] == [("failure", saga_id)]
    assert len(m.turns.sent[(saga_id, 1)]) == 2  # no third request
    m.teardown()
