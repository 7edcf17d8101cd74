"""Orphans: INTENT entries with no outcome past a threshold are listed and logged."""

from __future__ import annotations

import time

from structlog.testing import capture_logs

from sagaworker import Phase, Sagaworker


def test_orphans_listed_and_logged(sqlite_sw: Sagaworker) -> None:
    """sw.orphans lists old INTENT entries; the beat task logs orphan_intent with age_s."""
    @sqlite_sw.tool()
    def lookup(x: int) -> int:
        return x

    sqlite_sw.producer.publish = lambda *a: False  # type: ignore[method-assign]
    saga = sqlite_sw.begin("orph-1")
    saga.enqueue(lookup, 1)
    assert sqlite_sw.orphans(older_than=3600) == []
    time.sleep(0.05)
    [o] = sqlite_sw.orphans(older_than=0.01)
    assert (o.seq, o.phase, o.tool_name) == (1, Phase.INTENT, lookup.name)
    sqlite_sw.settings = sqlite_sw.settings.model_copy(update={"orphan_after": 0.01})
    with capture_logs() as logs:
        assert sqlite_sw.sweeper.log_orphans() == 1
    [ev] = logs
    assert ev["event"] == "orphan_intent" and ev["log_level"] == "error"
    assert ev["saga_id"] == "orph-1" and ev["age_s"] >= 0
