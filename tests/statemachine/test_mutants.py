"""The model checker catches what it claims: guard mutations (``mutants.py``), each
applied to a copy of the library, make it fail. ``make test`` runs the quick ones at the
mutants' budget and checks every mutant still applies to the source; ``make mutants``
runs them all."""

from __future__ import annotations

import os

import pytest

from tests.statemachine.mutants import MUTANTS, Mutant, drift, run

#: the mutants ``make test`` runs, one or two for each part of the journal (``make mutants``
#: runs them all: a make test that must stay under 25 minutes cannot hold their ~10-57 s
#: each)
QUICK = ("claim-failing-pg", "lease-takeover", "undo-order", "undo-while-running",
         "enqueue-failing", "died-unreported", "unit-claim-ignored")
#: the budget of ``make mutants`` (the same examples, so the same verdicts)
EXAMPLES, STEPS = 400, 50


def test_every_mutant_still_applies_to_the_source() -> None:
    """A snippet no longer in the source (the code moved on) is loud, not a silent pass."""
    assert [p for m in MUTANTS for p in drift(m)] == []
    assert set(QUICK) <= {m.name for m in MUTANTS}
    assert len({m.name for m in MUTANTS}) == len(MUTANTS)


def _param(m: Mutant) -> object:
    marks = [pytest.mark.services] if m.database == "postgresql" else []
    return pytest.param(m, id=m.name, marks=marks)


@pytest.mark.parametrize("mutant", [_param(m) for m in MUTANTS if m.name in QUICK])
def test_the_model_checker_catches(mutant: Mutant) -> None:
    outcome = run(mutant, examples=EXAMPLES, steps=STEPS)
    if outcome.verdict == "skipped" and os.environ.get("CI") != "true":
        pytest.skip(outcome.detail)  # (locally only: CI has every service)
    assert outcome.verdict == "killed", f"{mutant.name} ({mutant.what}): {outcome.detail}"
