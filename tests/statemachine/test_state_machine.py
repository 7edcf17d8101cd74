"""The state machine, model-checked: every interleaving keeps the guarantees.

`make test` runs a fixed, derandomized budget; `make fuzz` a long random one
(SAGAWORKER_FUZZ_EXAMPLES, SAGAWORKER_FUZZ_STEPS). Shrinking is off (a failure reports at
once, with its steps and a blob to reproduce it); SAGAWORKER_FUZZ_SHRINK=1 turns it on.
`make mutants` runs the model against copies of the library with a guard broken
(``mutants.py``).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import structlog
from hypothesis import HealthCheck, Phase, settings

from tests.statemachine.model import JournalMachine

FUZZ = os.environ.get("SAGAWORKER_FUZZ") == "1"
EXAMPLES = int(os.environ.get("SAGAWORKER_FUZZ_EXAMPLES", "2000" if FUZZ else "90"))
STEPS = int(os.environ.get("SAGAWORKER_FUZZ_STEPS", "60" if FUZZ else "35"))
SHRINK = os.environ.get("SAGAWORKER_FUZZ_SHRINK") == "1"


def budget(examples: int) -> Any:
    phases = [Phase.explicit, Phase.reuse, Phase.generate, *([Phase.shrink] if SHRINK else [])]
    return settings(max_examples=examples, stateful_step_count=STEPS, deadline=None,
                    derandomize=not FUZZ, database=None, print_blob=True, phases=phases,
                    suppress_health_check=list(HealthCheck))


def test_state_machine_on_sqlite(tmp_path: Path) -> None:
    """Interleavings of deliveries, crashes, late attempts, heartbeats, retries, fails,
    aborts, deadlines, decisions, flow replays, sweeps and replays keep every invariant on
    the embedded SQLite journal, and end live."""
    machine: Any = type("SqliteJournal", (JournalMachine,),
                   {"URL": f"sqlite:///{tmp_path / 'model.db'}", "_sw": None})
    machine.TestCase.settings = budget(EXAMPLES)
    with structlog.testing.capture_logs():
        machine.TestCase().runTest()


@pytest.mark.services
def test_state_machine_on_postgresql(pg_url: str) -> None:
    """The same interleavings keep every invariant on PostgreSQL (its fast path included)."""
    machine: Any = type("PgJournal", (JournalMachine,), {"URL": pg_url, "_sw": None})
    machine.TestCase.settings = budget(max(EXAMPLES // 3, 10))
    with structlog.testing.capture_logs():
        machine.TestCase().runTest()
