"""The model checker's moves on a flow's code changing under its sagas: divergence, the
hold, and ``flows resume``.

A deploy changes a flow's code under a running saga (``world.Code``: the changed code asks
for another first step than the saga's journal holds), so its next replay diverges: the
saga is held, not compensated. The moves: a worker replays a saga under changed code
(held: it journals nothing and runs nothing, flow_diverged is logged once per divergence,
the saga stays open with its effects live, and its open gate is neither offered nor
approved with a token an approver got before the hold); a replay under changed code
reads the journal, and before it holds the saga the code is rolled back and another
worker's replay moves the flow on (that stale hold must not land); and ``sagaworker
flows resume``, after a rollback or not, which replays a held saga with the code the
workers run now (released and moved on once its code replays the journal). At every
step: a saga is held only where its code diverged, none is ever failed (compensated) for
a divergence, and no step of a held saga is claimed (``model``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, MutableMapping
from typing import Any

import structlog
from hypothesis import strategies as st
from hypothesis.stateful import precondition, rule

from sagaworker import ApprovalInvalid, SagaStatus
from sagaworker._base.types import OPEN, Phase
from sagaworker._machine.divergence import resume_held
from sagaworker._worker.replay import replay as replay_flow
from tests.statemachine.world import Code

_PENDING = (Phase.INTENT.value, Phase.AWAITING_APPROVAL.value)


def _open(row: Any) -> bool:
    return row is not None and SagaStatus(row.status) in OPEN and row.fail_requested_at is None


class DivergenceMoves:
    """Mixed into the journal machine (``model.JournalMachine``)."""

    sw: Any
    bus: Any
    sagas: list[str]
    world: Any
    logs: list[MutableMapping[str, Any]]

    pick: Callable[[int, list[Any]], Any]
    saga_row: Callable[[str], Any]
    events: Callable[[int, str], list[MutableMapping[str, Any]]]
    deliver: Callable[..., None]

    def divergence_init(self) -> None:
        Code.changed = set()
        #: the sagas whose code the model changed (the only ones that may be held)
        self.diverging: set[str] = set()

    def _replayable(self) -> list[str]:
        """Open flow sagas with a journaled step (changed code diverges at the first); a
        flow not replayed yet is first advanced (its first step journaled by the code it
        started with)."""
        out = []
        for saga_id in sorted(self.world.flows):
            saga, rows = self.sw.journal.saga_and_entries(saga_id)
            if _open(saga) and not rows and saga_id not in Code.changed:
                self._replay(saga_id)
                saga, rows = self.sw.journal.saga_and_entries(saga_id)
            if _open(saga) and rows:
                out.append(saga_id)
        return out

    def _replay(self, saga_id: str) -> None:
        """A worker replays the flow (its advance message, or the one ``flows resume``
        sends)."""
        queued = [k for k, m in enumerate(self.bus.messages) if m[:2] == ("advance", saga_id)]
        if queued:
            self.deliver(queued[0], False)
        else:
            self.bus.send_advance(saga_id)
            self.deliver(len(self.bus.messages) - 1, False)

    @precondition(lambda self: self.world.flows)
    @rule(i=st.integers(0, 3), stale=st.booleans())
    def code_changes(self, i: int, stale: bool) -> None:
        """A deploy changes a running flow saga's code and a worker replays it: the replay
        diverges at its first step, and the saga is held, not compensated: nothing is
        journaled or run, flow_diverged is logged once for that divergence, the saga stays
        open; its open gate is no longer offered, and a token handed out before the hold
        is refused, naming ``flows resume``. ``stale``: the deploy is rolled back while
        that replay runs (``stale_hold``)."""
        if stale:
            self.stale_hold(i)
            return
        candidates = self._replayable()
        if not candidates:
            return
        saga_id = self.pick(i, candidates)
        tokens = [p.token for p in self.sw.pending_approvals() if p.saga_id == saga_id]
        Code.changed.add(saga_id)
        self.diverging.add(saga_id)
        before, n = self.saga_row(saga_id), len(self.logs)
        self._replay(saga_id)
        after = self.saga_row(saga_id)
        assert after.last_seq == before.last_seq, "a replay that diverged journaled a step"
        assert after.fail_requested_at is None and after.status == before.status, (
            f"a divergence moved its saga: {before.status} -> {after.status} ({after.reason})")
        assert after.divergence is not None, "a saga whose replay diverged was not held"
        logged = len(self.events(n, "flow_diverged"))
        assert logged == (after.divergence != before.divergence), (
            f"flow_diverged logged {logged} times for "
            f"{'a new' if after.divergence != before.divergence else 'the same'} divergence")
        assert not [p for p in self.sw.pending_approvals() if p.saga_id == saga_id], (
            "a held saga's gate was offered")
        for token in tokens:
            try:
                self.sw.approve(token, approver="alice")
            except ApprovalInvalid as exc:
                assert "flows resume" in str(exc) or saga_id in self.world.overdue, str(exc)
            else:
                raise AssertionError("a held saga's gate was approved")

    @precondition(lambda self: self.diverging)
    @rule(i=st.integers(0, 3), rollback=st.booleans())
    def flows_resume(self, i: int, rollback: bool) -> None:
        """``sagaworker flows resume SAGA_ID`` (``rollback``: after the deploy that changed
        the saga's code was rolled back or fixed): a held saga is replayed again with the
        code the workers run now: released and moved on if that code replays its
        journal, still held (flow_diverged not logged again) if not; a saga that is
        failing or finished is refused (nothing sent)."""
        saga_id = self.pick(i, sorted(self.diverging))
        if rollback:
            Code.changed.discard(saga_id)
        row = resume_held(self.sw.journal, saga_id)
        if not _open(row):
            return  # (the command says so and exits 1)
        n = len(self.logs)
        self._replay(saga_id)
        after = self.saga_row(saga_id)
        if row.divergence is None or not _open(after):
            return
        if saga_id in Code.changed:
            assert after.divergence == row.divergence, "a resumed saga's divergence changed"
            assert not self.events(n, "flow_diverged"), (
                "flow_diverged logged again for the same divergence")
        else:
            assert after.divergence is None, (
                "a resumed saga whose code replays its journal stayed held")

    def stale_hold(self, i: int) -> None:
        """A worker's replay under changed code reads the journal and diverges; before it
        holds the saga, the deploy is rolled back and another worker's replay moves the
        flow on (the advance its last outcome sent). The late hold must not land on a
        journal that moved on since its read (a compare-and-set on the last seq); where
        nothing moved, it does."""
        candidates = [s for s in self._replayable() if s not in Code.changed]
        candidates = [s for s in candidates if self._moves_on(s)] or candidates
        if not candidates:
            return
        saga_id = self.pick(i, candidates)
        steps = [k for k, m in enumerate(self.bus.messages) if m[:2] == ("step", saga_id)]
        if steps and not self._moves_on(saga_id):
            self.deliver(steps[0], False, True)  # the step it waits on runs to its outcome
        saga, rows = self.sw.journal.saga_and_entries(saga_id)
        if not _open(saga):
            return
        if saga.divergence is not None:
            return
        spec = self.sw.flows.specs[saga.flow]
        Code.changed.add(saga_id)
        self.diverging.add(saga_id)
        try:
            stale = replay_flow(self.sw.rt, self.sw.producer, spec, saga, rows)
        finally:
            Code.changed.discard(saga_id)  # rolled back
        assert stale.kind == "diverged", f"changed code replayed as {stale.kind}"
        self._replay(saga_id)
        now = self.saga_row(saga_id)
        seen = sum(r.phase not in _PENDING for r in rows)
        with structlog.contextvars.bound_contextvars(saga_id=saga_id):
            self.sw.flows._diverged(spec, saga, stale, seen)
        after = self.saga_row(saga_id)
        if now.last_seq != saga.last_seq:
            assert after.divergence == now.divergence, (
                "a replay that read an older journal position held a saga another replay "
                "moved on")
        elif _open(now):
            assert after.divergence is not None, "a diverged replay did not hold its saga"

    def _moves_on(self, saga_id: str) -> bool:
        """A replay now would journal the flow's next steps (read without writing)."""
        saga, rows = self.sw.journal.saga_and_entries(saga_id)
        run = replay_flow(self.sw.rt, self.sw.producer, self.sw.flows.specs[saga.flow], saga,
                          rows)
        return saga.divergence is None and run.kind == "waits" and bool(run.ctx.new)

    def holds_agree(self, rows: Iterable[Any]) -> None:
        """A saga is held only where its code diverged; none is failed for a divergence
        (its flow holds: ``on_divergence`` by default)."""
        for r in rows:
            if r.divergence is not None:
                assert r.saga_id in self.diverging, f"{r.saga_id} held with no divergence"
            assert not (r.reason or "").startswith("flow diverged"), (
                f"a saga failed for a divergence: {r.reason}")

    def resume_all(self) -> None:
        """Every deploy rolled back, and ``flows resume`` sent for each held saga."""
        Code.changed.clear()
        for saga_id in sorted(self.diverging):
            row = resume_held(self.sw.journal, saga_id)
            if _open(row) and row.divergence is not None:
                self.bus.send_advance(saga_id)
