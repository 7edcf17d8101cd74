"""Library bugs the model checker found, each reproduced in a few lines. Marked
``xfail(strict=True)``: the fix turns the test green and the mark must then go (the
model checker tolerates each one where its comment says so)."""

from __future__ import annotations

from pathlib import Path

import pytest

from sagaworker._worker.flows import replay
from tests.statemachine.world import RecordingBus, build, model_flow


@pytest.mark.xfail(strict=True, raises=ValueError,
                   reason="Producer.enqueue zips the seqs add_entries returns with "
                          "strict=True, and a stale replay gets none back")
def test_a_replay_that_finds_the_flow_moved_on_journals_nothing(tmp_path: Path) -> None:
    """Two workers advance one flow at once (two parallel steps finished together): both
    replays read the journal, one journals the next step, the other's compare-and-set on
    the last seq misses. That one must journal nothing and say nothing went wrong; it
    raises ValueError instead (the advance task fails, or the worker that journaled an
    EXECUTED logs flow_advance_failed). The same when the saga was asked to fail between
    the read and the write."""
    sw = build(f"sqlite:///{tmp_path / 'flow.db'}")
    sw.rt.bus = RecordingBus(["f-1"])
    sw.start("f-1", model_flow, 10)
    saga, rows = sw.journal.saga_and_entries("f-1")
    stale = replay(sw.rt, sw.producer, sw.flows.specs["model_flow"], saga, rows)
    assert stale.kind == "waits" and stale.ctx.new
    sw.flows.advance("f-1")  # the other worker's replay journals the first step
    sw.flows._journal_new("f-1", stale.ctx, saga.last_seq)
    assert len(sw.journal.saga_and_entries("f-1")[1]) == 1
