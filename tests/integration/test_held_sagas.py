"""A saga held on a divergence (README, "Changing a flow") runs nothing, on SQLite (the
SQLAlchemy claim) and PostgreSQL (the one-statement claim of ``_machine.pgfast``) alike:
its gate is not offered nor approved, a claim of any of its steps (approved, or not gated)
is refused and changes nothing, and the sweeper sends none of its steps until the hold is
released.
(tests/integration/test_flow_versions.py does it through real workers.)"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import update

from sagaworker import ApprovalInvalid, FlowContext, Phase, Reversibility, Sagaworker
from sagaworker._journal.dialect import db_later
from sagaworker._journal.schema import entries
from tests.integration.test_clocks import ON_BOTH, Bus, journal_only, new_id

_M = "tests.integration.test_held_sagas"
PLAIN, SHIP = f"{_M}.plain", f"{_M}.ship"
#: the code the flow runs (a deploy changes it between replays)
CODE = {"v": "1"}


def plain(n: int) -> int:
    return n


def ship(n: int) -> int:
    return n


def held_flow(s: FlowContext, n: int) -> list[Any]:
    """1: plain(n) and the gated ship(n) side by side. 2: another first step (a replay
    diverges at step 1)."""
    first = n + 100 if CODE["v"] == "2" else n
    return s.gather(s.enqueue(PLAIN, first), s.enqueue(SHIP, n))


@pytest.fixture(params=ON_BOTH)
def sw(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Sagaworker]:
    CODE["v"] = "1"
    sw = journal_only(request, tmp_path, relay_after=0.2)
    sw.tool()(plain)
    sw.tool(reversibility=Reversibility.IRREVERSIBLE)(ship)
    sw.flow()(held_flow)
    yield sw
    sw.rt.journal.engine.dispose()


def gate(sw: Sagaworker, saga_id: str) -> Any:
    return next((p for p in sw.pending_approvals() if p.saga_id == saga_id), None)


def at_gate(sw: Sagaworker) -> tuple[str, Any]:
    """A saga of ``held_flow`` with plain(1) journaled and ship(1) at its gate."""
    saga_id = new_id()
    sw.start(saga_id, held_flow, 1)
    sw.flows.advance(saga_id)
    return saga_id, gate(sw, saga_id)


def hold(sw: Sagaworker, saga_id: str) -> None:
    """A replay of code 2 holds the saga."""
    CODE["v"] = "2"
    sw.flows.advance(saga_id)
    CODE["v"] = "1"
    assert (sw.inspect(saga_id).diverged or "").startswith("flow diverged at step 1")


def claim(sw: Sagaworker, saga_id: str, seq: int) -> str:
    """What a delivery of step ``seq`` is told (``Start``'s value)."""
    tool = (PLAIN, SHIP)[seq - 1]
    return sw.machine.claim_start(saga_id, seq, tool, token=new_id(), worker="w",
                                  idempotent=False, task_id=None).start.value


def steps(sw: Sagaworker, saga_id: str) -> list[tuple[int, Phase, int, Any]]:
    """Each step's phase, attempts and start (None: no claim ever took it)."""
    rows = [sw.journal.entry_row(saga_id, e.seq) for e in sw.inspect(saga_id).entries]
    return [(r.seq, Phase(r.phase), r.attempts, r.started_at) for r in rows]


def relayed(sw: Sagaworker, saga_id: str) -> list[tuple[Any, ...]]:
    """The steps of the saga the sweeper sends (once their publish is long past)."""
    with sw.journal.engine.begin() as conn:
        conn.execute(update(entries).where(entries.c.saga_id == saga_id)
                     .values(published_at=db_later(-60), created_at=db_later(-60)))
    bus: Bus = sw.rt.bus  # type: ignore[assignment]
    bus.sent.clear()
    sw.sweeper.sweep()
    return [m for m in bus.sent if m[0] == "step" and m[1] == saga_id]


def test_a_held_sagas_gate_is_not_offered_nor_approved_and_its_steps_not_claimed(
        sw: Sagaworker) -> None:
    saga_id, before = at_gate(sw)
    assert before is not None and before.seq == 2
    hold(sw, saga_id)
    assert gate(sw, saga_id) is None
    with pytest.raises(ApprovalInvalid) as refused:
        sw.approve(before.token, approver="alice")
    assert "`sagaworker flows resume " + saga_id + "`" in str(refused.value)
    assert "`sagaworker abort " + saga_id + " --reason R`" in str(refused.value)
    assert claim(sw, saga_id, 1) == "held"
    assert steps(sw, saga_id) == [(1, Phase.INTENT, 0, None),
                                  (2, Phase.AWAITING_APPROVAL, 0, None)]
    assert relayed(sw, saga_id) == []
    # a rejection is still taken (it compensates, as an abort does)
    sw.reject(before.token, approver="alice", reason="no")
    assert [e.phase for e in sw.inspect(saga_id).entries] == [Phase.INTENT, Phase.REJECTED]


def test_a_step_approved_before_the_hold_is_not_run_until_the_hold_is_released(
        sw: Sagaworker) -> None:
    saga_id, before = at_gate(sw)
    sw.approve(before.token, approver="alice")
    hold(sw, saga_id)
    assert [claim(sw, saga_id, seq) for seq in (1, 2)] == ["held", "held"]
    assert steps(sw, saga_id) == [(1, Phase.INTENT, 0, None), (2, Phase.INTENT, 0, None)]
    assert relayed(sw, saga_id) == []
    sw.flows.advance(saga_id)  # code 1 again: released
    assert sw.inspect(saga_id).diverged is None
    assert relayed(sw, saga_id) == [("step", saga_id, 1), ("step", saga_id, 2)]
    assert [claim(sw, saga_id, seq) for seq in (1, 2)] == ["run", "run"]


def test_an_aborted_held_sagas_approved_step_is_cancelled(sw: Sagaworker) -> None:
    """The failure wins over the hold: an abort compensates a held saga, and its approved
    step is CANCELLED, never left waiting for a resume."""
    saga_id, before = at_gate(sw)
    sw.approve(before.token, approver="alice")
    hold(sw, saga_id)
    sw.abort(saga_id, reason="gave up", actor="ops")
    assert [claim(sw, saga_id, seq) for seq in (1, 2)] == ["cancelled", "cancelled"]
