"""A model checker for the journal's state machine.

Hypothesis drives the REAL moves (``sagaworker._machine.machine.Machine``, the producer, the gate,
the flows' replay, the sweeper, the executor's and the chain's reports) against a real
database through interleavings of: delivery, duplicate delivery, a lost message, a worker
dying before its claim / after it / after the effect / before the outcome commits, a
Celery retry, a lease that lapses while its attempt still runs (it finishes late),
heartbeats from live and from fenced-out attempts and undos, a lost COMMIT (the same move
replayed with the same token), ``fail``, ``abort``, a passed deadline, approve and reject
(also right after a fail), a flow advanced by two replays at once, a sweep, an operator
re-drive, a durable agent run's model requests (``agents``: answered, failed for good or
for a passing reason and retried, a worker dying or stalling while one is in flight,
another worker replaying the flow meanwhile, a call the framework cancels), leases that
race (``leases``: a model request's short lease and its failover, late heartbeats), and
a flow's code changing under its sagas (``divergence``: held, resumed).
The "world" (which effects and undos happened, which attempts run) is kept in
``world``; after every step the invariants are checked against it, the journal and the
structured events logged; at the end, with every message delivered and nothing in
flight, every saga must be terminal or completable (liveness).

Time is not real here: a lease lapses only when a rule says so, so a live attempt is
taken for a dead one only when the model means it.
"""

from __future__ import annotations

import contextlib
import itertools
import uuid
from collections import Counter
from collections.abc import MutableMapping
from typing import Any, cast

import structlog
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)
from sqlalchemy import and_, case, select, update

from sagaworker import (
    ApprovalInvalid,
    SagaStatus,
    Sagaworker,
    SagaworkerError,
)
from sagaworker._base.types import OPEN, TERMINAL, OutcomeResult, Phase
from sagaworker._base.units import is_unit
from sagaworker._journal.dialect import db_later, db_now
from sagaworker._journal.schema import entries, sagas
from sagaworker._machine.machine import Start, UndoClaim, UndoState, new_token
from sagaworker._worker.replay import replay as replay_flow
from tests.statemachine.agents import AgentMoves
from tests.statemachine.divergence import DivergenceMoves
from tests.statemachine.leases import LeaseMoves
from tests.statemachine.world import (
    EPOCH,
    MAX_RERUNS,
    MAX_RETRIES,
    MAX_SAGAS,
    PREFIX,
    RETRIES,
    TOOLS,
    Attempt,
    RecordingBus,
    Undo,
    World,
    agent_flow,
    build,
    flow_calls,
    flow_value,
    model_flow,
)

_INTENT, _EXECUTED, _AWAITING = (Phase.INTENT.value, Phase.EXECUTED.value,
                                 Phase.AWAITING_APPROVAL.value)
_FAILED_UNDO = OutcomeResult.COMPENSATION_FAILED.value


def bound(saga_id: str, seq: int | None = None, tool: str | None = None) -> Any:
    return structlog.contextvars.bound_contextvars(saga_id=saga_id, seq=seq, tool=tool)


class JournalMachine(AgentMoves, LeaseMoves, DivergenceMoves, RuleBasedStateMachine):
    """Subclassed per database (the ``URL`` class attribute)."""

    URL = ""
    _sw: Sagaworker | None = None

    def __init__(self) -> None:
        super().__init__()
        cls = type(self)
        if cls._sw is None:
            cls._sw = build(cls.URL)
        self.sw = cls._sw
        self.run = uuid.uuid4().hex[:8]
        self.sagas: list[str] = []
        self.bus = RecordingBus(self.sagas)
        self.sw.rt.bus = self.bus
        self.attempts: list[Attempt] = []
        self.undos: list[Undo] = []
        self.world = World()
        self.counter = itertools.count(1)
        self.last: tuple[Any, ...] | None = None  # the last move, to replay (lost COMMIT)
        self.replays: list[tuple[str, Any, int, int]] = []  # flow replays read, not yet written
        self._capture = contextlib.ExitStack()
        self.logs: list[MutableMapping[str, Any]] = self._capture.enter_context(
            structlog.testing.capture_logs(processors=[structlog.contextvars.merge_contextvars]))
        self.seen = 0          # events already checked
        self.snap: dict[Any, Any] = {}
        self.agent_init()
        self.divergence_init()

    # -- helpers ------------------------------------------------------------------------

    @property
    def m(self) -> Any:
        return self.sw.machine

    def saga_row(self, saga_id: str) -> Any:
        return self.sw.journal.saga_row(saga_id)

    def entry(self, saga_id: str, seq: int) -> Any:
        return self.sw.journal.entry_row(saga_id, seq)

    def lease_alive(self, saga_id: str, seq: int, column: Any) -> bool:
        with self.sw.journal.engine.connect() as conn:
            return bool(conn.execute(select(column > db_now()).where(
                entries.c.saga_id == saga_id, entries.c.seq == seq)).scalar())

    def pick(self, i: int, items: list[Any]) -> Any:
        return items[i % len(items)] if items else None

    def events(self, since: int, name: str) -> list[MutableMapping[str, Any]]:
        return [e for e in self.logs[since:] if e.get("event") == name]

    def asynchronous(self) -> list[str]:
        return [s for s in self.sagas if s not in self.world.flows]

    # -- the producer -------------------------------------------------------------------

    @initialize(first=st.lists(st.sampled_from(TOOLS), min_size=1, max_size=4),
                second=st.lists(st.sampled_from(TOOLS), min_size=0, max_size=3),
                flow=st.sampled_from(["", "model", "agent", "agent", "parallel"]))
    def two_sagas(self, first: list[str], second: list[str], flow: str) -> None:
        """Two sagas with their first steps journaled and published (steps enqueued
        together run in parallel: their EXECUTED order is the workers'), and a flow (the
        model's, or an agent's)."""
        for tools in (first, second):
            self.begin(False)
            for tool in tools:
                self.enqueue(len(self.sagas) - 1, tool)
        if flow:
            self.start_flow(False, flow != "model", flow == "parallel")

    @precondition(lambda self: len(self.sagas) < MAX_SAGAS)
    @rule(deadline=st.booleans())
    def begin(self, deadline: bool) -> None:
        saga_id = f"m-{self.run}-{len(self.sagas)}"
        self.sw.begin(saga_id, deadline=3600 if deadline else None)
        self.sagas.append(saga_id)
        if deadline:
            self.world.deadlines.add(saga_id)

    @precondition(lambda self: len(self.sagas) < MAX_SAGAS)
    @rule(deadline=st.booleans(), agent=st.booleans(), parallel=st.booleans())
    def start_flow(self, deadline: bool, agent: bool = False, parallel: bool = False) -> None:
        """A flow starts: the model's (steps, a gate), or a durable agent run's (model
        turns journaled as units, an odd ``n``; ``parallel``: its framework runs a tool
        call beside the next turn, and cancels that turn's call)."""
        saga_id = f"m-{self.run}-{len(self.sagas)}"
        n = next(self.counter) * 10 + ((3 if parallel else 1) if agent else 0)
        self.sagas.append(saga_id)
        self.world.flows[saga_id] = n
        self.sw.start(saga_id, agent_flow if agent else model_flow, n,
                      deadline=3600 if deadline else None)
        if deadline:
            self.world.deadlines.add(saga_id)

    @precondition(lambda self: self.asynchronous())
    @rule(i=st.integers(0, 3), tool=st.sampled_from(TOOLS))
    def enqueue(self, i: int, tool: str) -> None:
        saga_id = self.pick(i, self.asynchronous())
        before = self.saga_row(saga_id)
        spec = self.sw.registry.tool(PREFIX + tool)
        assert spec is not None
        try:
            self.sw.get(saga_id).enqueue(spec.task, next(self.counter))
        except SagaworkerError as exc:
            assert ("takes no new steps" in str(exc) or "is " in str(exc)
                    or saga_id in self.world.overdue), f"enqueue refused: {exc}"
            return
        assert before.fail_requested_at is None and SagaStatus(before.status) in OPEN, (
            "a step was journaled for a saga asked to fail or closed")

    @precondition(lambda self: self.sagas)
    @rule(i=st.integers(0, 3))
    def producer_fails(self, i: int) -> None:
        saga_id = self.pick(i, self.sagas)
        try:
            self.sw.get(saga_id).fail("model says fail")
        except SagaworkerError as exc:
            assert "COMPLETED" in str(exc)

    @precondition(lambda self: any(a.running for a in self.attempts))
    @rule(i=st.integers(0, 20))
    def fail_while_running(self, i: int) -> None:
        """A saga fails while one of its steps runs; its failure message is handled at once."""
        saga_id = self.pick(i, [a for a in self.attempts if a.running]).saga_id
        self.producer_fails(self.sagas.index(saga_id))
        for msg in [m for m in self.bus.messages if m[0] == "failure" and m[1] == saga_id]:
            self.bus.messages.remove(msg)
            self._handle_failure(saga_id, msg[2])

    @precondition(lambda self: self.world.executed)
    @rule(i=st.integers(0, 20))
    def fail_executed(self, i: int) -> None:
        """A saga with EXECUTED steps fails; its failure message is handled at once (its
        chain starts)."""
        saga_id = self.pick(i, sorted(self.world.executed))[0]
        self.producer_fails(self.sagas.index(saga_id))
        for msg in [m for m in self.bus.messages if m[0] == "failure" and m[1] == saga_id]:
            self.bus.messages.remove(msg)
            self._handle_failure(saga_id, msg[2])

    @precondition(lambda self: self.sagas)
    @rule(i=st.integers(0, 3))
    def operator_abort(self, i: int) -> None:
        """An operator aborts a saga: accepted only while it is open, and reported."""
        saga_id = self.pick(i, self.sagas)
        before, n = self.saga_row(saga_id), len(self.logs)
        try:
            self.sw.abort(saga_id, reason="model abort", actor="op")
        except SagaworkerError:
            assert SagaStatus(before.status) not in OPEN, "an open saga refused an abort"
            return
        assert SagaStatus(before.status) in OPEN, f"a {before.status} saga was aborted"
        assert self.saga_row(saga_id).fail_requested_at is not None, "abort asked nothing"
        assert self.events(n, "saga_aborted"), "an abort logged no saga_aborted"

    @precondition(lambda self: self.asynchronous())
    @rule(i=st.integers(0, 3))
    def producer_completes(self, i: int) -> None:
        with contextlib.suppress(SagaworkerError):
            self.sw.get(self.pick(i, self.asynchronous())).complete()

    @precondition(lambda self: any(p.saga_id in self.sagas
                                   for p in self.sw.pending_approvals()))
    @rule(approve=st.booleans(), fail_first=st.booleans(), i=st.integers(0, 5))
    def decide(self, approve: bool, fail_first: bool, i: int) -> None:
        mine = [p for p in self.sw.pending_approvals() if p.saga_id in self.sagas]
        if not mine:
            return
        req = self.pick(i, mine)
        if fail_first:  # approve (or reject) right after a fail: the gate is closed
            self.sw.get(req.saga_id).fail("failed before the decision")
        try:
            if approve:
                self.sw.approve(req.token, approver="alice")
            else:
                self.sw.reject(req.token, approver="bob", reason="no")
        except ApprovalInvalid:
            # (past its deadline, a gate may close before the sweeper's pass fails the saga)
            assert fail_first or req.saga_id in self.world.overdue, (
                "a decision on an open gate of a healthy saga was refused")
            return
        assert not fail_first, "a gate of a saga asked to fail accepted a decision"

    @precondition(lambda self: any(p.saga_id in self.sagas
                                   for p in self.sw.pending_approvals()))
    @rule(i=st.integers(0, 5))
    def approve_then_fail(self, i: int) -> None:
        """A gate is approved (its step published), then its saga is asked to fail before
        that message is delivered: the delivery must cancel the step (an IRREVERSIBLE
        effect never happens for a failing saga), whichever claim path it takes."""
        mine = [p for p in self.sw.pending_approvals() if p.saga_id in self.sagas]
        req = self.pick(i, mine)
        try:
            self.sw.approve(req.token, approver="alice")
        except ApprovalInvalid:
            assert req.saga_id in self.world.overdue, "an open gate refused its approval"
            return
        self.producer_fails(self.sagas.index(req.saga_id))
        for msg in [m for m in self.bus.messages if m[:3] == ("step", req.saga_id, req.seq)]:
            self.bus.messages.remove(msg)
            self._claim(msg[1], msg[2], msg[3], msg[4])

    @precondition(lambda self: self.world.deadlines - self.world.overdue
                  or len(self.sagas) < MAX_SAGAS)
    @rule(i=st.integers(0, 3), late=st.booleans())
    def the_deadline_passes(self, i: int, late: bool = False) -> None:
        """A saga's deadline passes (the sweeper's next pass fails it); if no saga has a
        deadline, a new one with a step enqueued. ``late``: a step message of that saga
        is delivered then, before any sweep saw the deadline pass (it must run nothing)."""
        waiting = sorted(self.world.deadlines - self.world.overdue)
        if not waiting:
            self.begin(True)
            self.enqueue(self.asynchronous().index(self.sagas[-1]), "plain")
            waiting = [self.sagas[-1]]
        saga_id = self.pick(i, waiting)
        with self.sw.journal.engine.begin() as conn:
            conn.execute(update(sagas).where(sagas.c.saga_id == saga_id)
                         .values(deadline_at=db_later(-1.0)))
        self.world.overdue.add(saga_id)
        if late:
            queued = [k for k, m in enumerate(self.bus.messages)
                      if m[0] == "step" and m[1] == saga_id]
            if queued:
                self.deliver(queued[0], False)

    # -- the broker ---------------------------------------------------------------------

    @precondition(lambda self: self.bus.messages)
    @rule(i=st.integers(0, 50), keep=st.booleans(), run=st.booleans())
    def deliver(self, i: int, keep: bool, run: bool = False) -> None:
        """Deliver one message; ``keep``: it stays queued too (a duplicate delivery);
        ``run``: a step claimed runs to its EXECUTED at once."""
        msg = self.pick(i, self.bus.messages)
        if not keep:
            self.bus.messages.remove(msg)
        kind = msg[0]
        if kind == "step":
            n = len(self.attempts)
            self._claim(msg[1], msg[2], msg[3], msg[4])
            if run and len(self.attempts) > n:
                self.finish([a for a in self.attempts if a.running].index(self.attempts[-1]),
                            "ok")
        elif kind == "failure":
            self._handle_failure(msg[1], msg[2])
        elif kind == "advance":
            with bound(msg[1]):
                self.advance_flow(msg[1])
        else:
            self._chain(msg[1])

    @precondition(lambda self: self.bus.messages)
    @rule()
    def deliver_next(self) -> None:
        """The oldest message is delivered; a step it starts runs to its EXECUTED, unless
        idempotent (those keep running: their leases lapse, they re-run, finish late)."""
        msg = self.bus.messages[0]
        self.deliver(0, False, not (msg[0] == "step" and msg[3].endswith(".idem")))

    @precondition(lambda self: self.bus.messages)
    @rule(i=st.integers(0, 50))
    def lose(self, i: int) -> None:
        self.bus.messages.pop(i % len(self.bus.messages))

    # -- flows: two replays at once -----------------------------------------------------

    @precondition(lambda self: self.world.flows)
    @rule(i=st.integers(0, 3))
    def replay_read(self, i: int) -> None:
        """A worker's replay reads the journal and finds the next steps (written later,
        after another replay may have moved the flow on)."""
        saga_id = self.pick(i, sorted(self.world.flows))
        saga, rows = self.sw.journal.saga_and_entries(saga_id)
        if SagaStatus(saga.status) not in OPEN or saga.fail_requested_at is not None:
            return
        run = replay_flow(self.sw.rt, self.sw.producer, self.sw.flows.specs[saga.flow],
                          saga, rows)
        if run.kind == "waits" and run.ctx.new:
            seen = sum(r.phase not in ("INTENT", "AWAITING_APPROVAL") for r in rows)
            self.replays.append((saga_id, run.ctx, saga.last_seq, seen))

    @precondition(lambda self: self.replays)
    @rule(i=st.integers(0, 5))
    def replay_write(self, i: int) -> None:
        """That replay journals what it found: only if nobody journaled since it read."""
        saga_id, ctx, last_seq, seen = self.replays.pop(i % len(self.replays))
        with bound(saga_id):  # (one that finds the journal moved on journals nothing)
            self.sw.flows._journal_new(saga_id, ctx, last_seq, seen)

    @precondition(lambda self: any(m[0] == "advance" for m in self.bus.messages))
    @rule(i=st.integers(0, 50), claim=st.booleans())
    def advance_eager(self, i: int, claim: bool) -> None:
        """A worker advances a flow and keeps its next step to run itself (an eager step):
        journaled, never published, and on PostgreSQL claimed by the same statement;
        ``claim``: it claims it (or runs the claim it took), else it dies right after the
        INTENT's commit (the relay must publish an unclaimed step; a claimed one's lease
        lapses and the sweeper's delivery finds it in doubt)."""
        msg = self.pick(i, [m for m in self.bus.messages if m[0] == "advance"])
        self.bus.messages.remove(msg)
        eager = self.sw.executor.eager
        eager.consuming = frozenset([cast(str, None)])  # (the model's bus routes to None)
        n = len(self.bus.messages)
        with bound(msg[1]):
            held = self.advance_flow(msg[1], hold=eager._one())
        assert len(held) <= 1, "an advance kept more than one step for its one slot"
        for seq, _ in held:
            assert not [m for m in self.bus.messages[n:] if m[:3] == ("step", msg[1], seq)], (
                "a step kept to run eagerly was published too")
        if not held:
            return
        seq, e = held[0]
        if e.claim is not None and e.claim.done:
            row = self.entry(msg[1], seq)
            assert row.attempt_token == e.claim.token and row.lease_until is not None, (
                "an eager step said claimed with its INTENT was not")
            assert not self.world.holder.get((msg[1], seq)), "a new step had a holder"
            a = Attempt(msg[1], seq, e.tool_name, e.claim.token, int(row.args[0]),
                        dead=not claim)
            self.attempts.append(a)
            self.world.holder[(msg[1], seq)] = a
        elif claim:
            self._claim(msg[1], seq, e.tool_name)

    # -- workers: forward attempts ---------------------------------------------------------

    def _handle_failure(self, saga_id: str, reason: str) -> None:
        if self.m.begin_compensation(saga_id, reason, new_token())[0]:
            self._chain(saga_id)

    def _claim(self, saga_id: str, seq: int, tool: str, retries: int = 0) -> None:
        """A delivery of a step's message, counted ``retries`` (Celery's request.retries)."""
        spec = self.sw.registry.tool(tool)
        assert spec is not None
        token = new_token()
        key = (saga_id, seq)
        before = self.entry(saga_id, seq)
        with bound(saga_id, seq, tool):
            claim = self.m.claim_start(saga_id, seq, tool, token=token, worker="model",
                                       idempotent=spec.idempotent, task_id=None,
                                       retries=retries)
            self.last = ("claim", saga_id, seq, tool, token, spec.idempotent, claim.start)
            if claim.start is not Start.RUN:
                if claim.start is Start.IN_DOUBT:  # only an attempt whose lease lapsed
                    self._lost(saga_id, seq)
                # the executor's answer: logs (step_in_doubt), failure or chain messages
                self.sw.executor._runs(claim, spec, saga_id, seq)
                if claim.start is Start.NOT_DUE:  # (Celery would have held it until then)
                    assert key in self.world.not_due or before.retry_due_at is not None, (
                        "a claim said not due a step with no retry journaled")
                    self.sw.executor.when_due(claim, spec, saga_id, seq, "", [], {}, retries)
                return
        # a Celery retry runs in turn: never a copy of an earlier one (the sweeper's
        # resend, a redelivery, while a later retry ran), never before it is due
        assert retries >= (before.celery_retries if before is not None else 0), (
            f"a claim ran a copy of an earlier Celery retry (counted {retries}, the "
            f"journal {before.celery_retries})")
        assert key not in self.world.not_due, "a step claimed before its retry was due"
        row, saga = self.entry(saga_id, seq), self.saga_row(saga_id)
        assert not [a for a in self.attempts if (a.saga_id, a.seq) == key and a.holds
                    and a.token != token], "a claim took over a lease that had not lapsed"
        assert key not in self.world.executed, "a step claimed after its EXECUTED"
        assert saga.fail_requested_at is None and SagaStatus(saga.status) in OPEN, (
            "a step claimed for a saga asked to fail")
        assert saga.divergence is None, "a step of a held saga (diverged) was claimed"
        # (a delivery after the deadline, before any sweep saw it pass, runs nothing)
        assert saga_id not in self.world.overdue, "a step claimed after its saga's deadline"
        if spec.gated:
            assert row.approved_by, "a gated step claimed without an approval"
        prev = self.world.holder.get(key)
        if prev is not None and not prev.over:  # its lease lapsed with no outcome
            assert spec.idempotent, "a non-idempotent step re-run after its worker was lost"
            self.world.reruns[key] = self.world.reruns.get(key, 0) + 1
            assert self.world.reruns[key] <= MAX_RERUNS, "an idempotent step re-run too often"
        a = Attempt(saga_id, seq, tool, token, int(row.args[0]), retries)
        self.attempts.append(a)
        self.world.holder[key] = a

    def _lost(self, saga_id: str, seq: int) -> None:
        """A step is found in doubt: none of its attempts may hold a lease still live."""
        assert not [a for a in self.attempts if (a.saga_id, a.seq) == (saga_id, seq)
                    and a.holds], "a step with a live attempt was found in doubt"

    def _effect(self, a: Attempt) -> None:
        a.effect = True
        key = (a.saga_id, a.seq)
        self.world.effects[key] = self.world.effects.get(key, 0) + 1
        if not a.tool.endswith(".idem"):  # no effect beside another attempt or after EXECUTED
            others = [b for b in self.attempts if (b.saga_id, b.seq) == key and b.running
                      and b is not a]
            assert not others, f"two attempts of {key} had effects at once"
            assert key not in self.world.executed, f"an effect of {key} after its EXECUTED"

    @precondition(lambda self: any(a.running and not a.effect for a in self.attempts))
    @rule(i=st.integers(0, 20))
    def effect(self, i: int) -> None:
        self._effect(self.pick(i, [a for a in self.attempts if a.running and not a.effect]))

    @precondition(lambda self: any(a.running for a in self.attempts))
    @rule(i=st.integers(0, 20), how=st.sampled_from(["ok", "ok", "raise", "give_up", "die"]))
    def finish(self, i: int, how: str) -> None:
        a = self.pick(i, [a for a in self.attempts if a.running])
        if how == "die":  # before or after its effect; its lease lapses later
            a.dead = True
            return
        a.over = True
        key = (a.saga_id, a.seq)
        before = self.entry(*key)
        ours = before.phase == _INTENT and before.attempt_token == a.token
        with bound(a.saga_id, a.seq, a.tool):
            if how == "ok":
                if not a.effect:
                    self._effect(a)
                out = self.m.executed(a.saga_id, a.seq, a.token, a.arg, 1.0)
                self.last = ("executed", a.saga_id, a.seq, a.token, out)
                assert out.applied == ours, (
                    "a fenced-out attempt's EXECUTED was journaled" if out.applied else
                    "the attempt holding the entry could not journal EXECUTED")
                if out.applied:
                    self.world.executed.add(key)
                    if out.status is SagaStatus.COMPENSATING:
                        self.bus.send_compensate(a.saga_id)
                    elif out.flow is not None:
                        self.bus.send_advance(a.saga_id)  # the worker advances it (or dies)
                return
            status = self.m.release(a.saga_id, a.seq, a.token, "Boom")
            after = self.entry(*key)
            if ours and before.lease_until is not None:
                assert after.lease_until is None, "the holder's release changed nothing"
            else:
                assert after.lease_until == before.lease_until, "a fenced-out release wrote"
            if status is SagaStatus.COMPENSATING:
                self.bus.send_compensate(a.saga_id)
            if how == "raise":  # Celery retries: the same message comes again, its due
                # time (at once) and count journaled first (``ToolTask.retry``)
                self.m.retry_due(a.saga_id, a.seq, a.token, 0.0, a.retries)
                self.bus.publish_step(a.saga_id, a.seq, a.tool, [], {}, "", None,
                                      retries=a.retries)
                return
            st_ = self.m.failed(a.saga_id, a.seq, a.token, "Boom")
            self.last = ("failed", a.saga_id, a.seq, a.token, st_)
            if after.phase == _INTENT and after.attempt_token == a.token:
                assert st_ is not None, "the attempt holding the entry could not FAIL it"
            else:  # (a step found in doubt keeps its attempt's token: answered as a replay)
                assert st_ is None or after.attempt_token == a.token, (
                    "a step FAILED by an attempt that did not hold it")
            self.sw.executor._after_outcome(a.saga_id, st_, "Boom")

    def _to_run(self) -> list[Attempt]:
        """The attempts running on a lease that holds; if none, a step message waiting is
        delivered first (an idempotent step's if any), its claim left running."""
        live = [a for a in self.attempts if a.running and not a.lapsed and not is_unit(a.tool)]
        steps = [k for k, m in enumerate(self.bus.messages) if m[0] == "step"]
        if not live and steps:
            idem = [k for k in steps if self.bus.messages[k][3].endswith(".idem")]
            self.deliver((idem or steps)[0], False)
        return [a for a in self.attempts if a.running and not a.lapsed and not is_unit(a.tool)]

    def _runnable(self) -> bool:
        return (any(a.running and not a.lapsed and not is_unit(a.tool) for a in self.attempts)
                or any(m[0] == "step" for m in self.bus.messages))

    @precondition(lambda self: self._runnable())
    @rule(i=st.integers(0, 20),
          then=st.sampled_from(["published", "lost", "swept", "out_of_turn"]))
    def tool_asks_retry(self, i: int, then: str) -> None:
        """A running tool (if none runs, a step delivered now) calls
        ``current_task.retry(countdown=60)`` (a delivered step's, or an eager step's
        hand-over to the broker): past ``max_retries`` Celery raises and the step fails;
        else the lease's release, the retry's due time and its count are journaled in one
        commit, then the retry's message is published, or its worker dies in between
        (``lost``; ``swept``: time passes and the sweeper sends it, with its count;
        ``out_of_turn``: its copies come out of turn)."""
        live = self._to_run()
        if not live:
            return
        a = self.pick(i, live)
        if a.retries >= MAX_RETRIES:  # Celery's MaxRetriesExceededError: the tool raised
            self.finish([x for x in self.attempts if x.running].index(a), "give_up")
            return
        key = (a.saga_id, a.seq)
        a.over = True
        before = self.entry(*key)
        ours = (before.phase == _INTENT and before.attempt_token == a.token
                and before.lease_until is not None)
        with bound(a.saga_id, a.seq, a.tool):
            status = self.m.retry_later(a.saga_id, a.seq, a.token, "Retry", 60.0,
                                        a.retries + 1)
        after = self.entry(*key)
        if not ours:
            assert (after.lease_until, after.celery_retries) == (
                before.lease_until, before.celery_retries), "a fenced-out retry wrote"
            return
        assert after.lease_until is None and after.celery_retries == a.retries + 1, (
            "a retry journaled without its count or with its lease held")
        self.world.retried[key] = self.world.retried.get(key, 0) + 1
        assert self.world.retried[key] <= MAX_RETRIES, (
            f"a tool's own retry ran past max_retries ({self.world.retried[key]})")
        self.world.not_due.add(key)
        if status is SagaStatus.COMPENSATING:
            self.bus.send_compensate(a.saga_id)
        if then == "published":
            self.bus.publish_step(a.saga_id, a.seq, a.tool, [], {}, "", None,
                                  retries=a.retries + 1, countdown=60.0)
        elif then == "swept":
            sent = len(self.bus.messages)
            self.time_passes(True)
            counts = [m[4] for m in self.bus.messages[sent:] if m[:3] == ("step", *key)]
            assert all(c == self.world.retried[key] for c in counts), (
                f"the sweeper resent a tool's retry counted {counts}, asked "
                f"{self.world.retried[key]} times")
        elif then == "out_of_turn":
            self._out_of_turn(a)

    def _out_of_turn(self, a: Attempt) -> None:
        """The messages of a step whose tool asked for a retry come out of turn: the
        retry's own (its ETA set on a host whose clock runs ahead) before it is due, which
        is sent again for then; a while later, that copy still queued (or waiting, its ETA
        past, in a busy worker), the sweeper's pass, which holds the retry back; then a
        copy of the message that ran (the sweeper's resend, a redelivery), the retry due:
        none may run the step (each run would ask for a retry of its own)."""
        key = (a.saga_id, a.seq)
        self._claim(*key, a.tool, a.retries + 1)
        self.a_while_passes()
        self._claim(*key, a.tool, a.retries)

    @precondition(lambda self: any(a.running and not a.lapsed for a in self.attempts))
    @rule(i=st.integers(0, 20), redeliver=st.booleans())
    def lapse_live(self, i: int, redeliver: bool) -> None:
        """A live attempt's lease lapses (a stalled heartbeat, a paused VM): it still runs
        and may finish late; ``redeliver``: its message comes again at once (the sweeper's
        resend, a redelivery), and that claim finds it dead."""
        a = self.pick(i, [a for a in self.attempts if a.running and not a.lapsed])
        self._lapse(a, entries.c.attempt_token, "lease_until")
        if redeliver:
            self._claim(a.saga_id, a.seq, a.tool, a.retries)

    @precondition(lambda self: self._runnable())
    @rule(i=st.integers(0, 63))
    def overtaken(self, i: int) -> None:
        """A running attempt (if none runs, a step delivered now) is overtaken: its lease
        lapses, its message comes again (an idempotent step re-runs, another is found in
        doubt), and then the late attempt finishes, or beats and then raises, gives up or
        goes on; ``again``: then its re-run is overtaken too (re-run at most
        SAGAWORKER_MAX_RERUNS times, then in doubt); ``i`` says which and how."""
        how, again, i = ("ok", "raise", "give_up", "beat")[i % 4], bool(i & 4), i >> 3
        live = self._to_run()
        if not live:
            return
        # an idempotent one first: its re-run fences it out (others are found in doubt)
        a = self.pick(i, [a for a in live if a.tool.endswith(".idem")] or live)
        self.lapse_live([x for x in self.attempts if x.running and not x.lapsed].index(a), True)
        if how != "ok":
            self.heartbeat(self.attempts.index(a), False, among=self.attempts)
        rerun = self.world.holder.get((a.saga_id, a.seq))
        if how != "beat":
            self.finish([x for x in self.attempts if x.running].index(a), how)
        if again and rerun is not None and rerun.running and not rerun.lapsed:
            self.lapse_live([x for x in self.attempts if x.running and not x.lapsed]
                            .index(rerun), True)

    @precondition(lambda self: any(a.running for a in self.attempts))
    @rule(i=st.integers(0, 20))
    def redeliver(self, i: int) -> None:
        """A running attempt's message is delivered again (a duplicate, a redelivery)."""
        a = self.pick(i, [a for a in self.attempts if a.running])
        self._claim(a.saga_id, a.seq, a.tool, a.retries)

    @precondition(lambda self: any(a.running and a.lapsed for a in self.attempts)
                  or any(u.running and u.lapsed for u in self.undos))
    @rule(i=st.integers(0, 63))
    def late(self, i: int) -> None:
        """An attempt or undo whose lease lapsed acts late (perhaps fenced out by a re-run
        or a re-claim): it finishes, raises, gives up, or beats (``i`` says which and how:
        one argument, so that the rule is drawn as often as the simple ones)."""
        how, undo, i = ("ok", "raise", "give_up", "beat")[i % 4], bool(i & 4), i >> 3
        if undo:
            undos = [u for u in self.undos if u.running and u.lapsed]
            if undos and how == "beat":
                self.heartbeat(self.undos.index(self.pick(i, undos)), True, among=self.undos)
            elif undos:
                u = self.pick(i, undos)
                self.undo_step([x for x in self.undos if x.running].index(u),
                               "ok" if how == "ok" else "raise")
            return
        late = [a for a in self.attempts if a.running and a.lapsed]
        if not late:
            return
        a = self.pick(i, late)
        if how == "beat":
            self.heartbeat(self.attempts.index(a), False, among=self.attempts)
        else:
            self.finish([x for x in self.attempts if x.running].index(a), how)

    def _lapse(self, t: Any, token_col: Any, lease: str) -> None:
        """The lease of the attempt or undo try ``t`` lapses (its token's row)."""
        with self.sw.journal.engine.begin() as conn:
            conn.execute(update(entries).where(token_col == t.token,
                                               entries.c[lease].is_not(None))
                         .values({lease: db_later(-1.0)}))
        t.lapsed = True

    @precondition(lambda self: any(u.running and not u.lapsed for u in self.undos))
    @rule(i=st.integers(0, 20), redeliver=st.booleans())
    def lapse_live_undo(self, i: int, redeliver: bool) -> None:
        """A live undo's lease lapses; ``redeliver``: a chain message comes at once."""
        u = self.pick(i, [u for u in self.undos if u.running and not u.lapsed])
        self._lapse(u, entries.c.undo_token, "comp_lease_until")
        if redeliver:
            self._chain(u.saga_id)

    @precondition(lambda self: any(u.running for u in self.undos))
    @rule(i=st.integers(0, 20))
    def redeliver_undo(self, i: int) -> None:
        """A chain message comes while one of the saga's undos runs."""
        self._chain(self.pick(i, [u for u in self.undos if u.running]).saga_id)

    @precondition(lambda self: any(a.running for a in self.attempts)
                  or any(u.running for u in self.undos))
    @rule(i=st.integers(0, 20), undo=st.booleans())
    def heartbeat(self, i: int, undo: bool, among: list[Any] | None = None) -> None:
        """A running attempt or undo beats: it keeps (or takes back) its own lease while
        its token holds the row; a fenced-out one changes nothing."""
        if among is not None:  # (``late``: that one)
            x = among[i]
        else:
            live: list[Any] = [u for u in self.undos if u.running] if undo else [
                a for a in self.attempts if a.running]
            if not live:
                return
            x = self.pick(i, live)
        before = self.entry(x.saga_id, x.seq)
        lease = before.comp_lease_until if undo else before.lease_until
        holder = before.undo_token if undo else before.attempt_token
        if lease is not None and holder != x.token:
            # time passed: the holder's lease has half its time left, so a write by this
            # fenced-out beat shows whatever the clock's resolution
            col = entries.c.comp_lease_until if undo else entries.c.lease_until
            with self.sw.journal.engine.begin() as conn:
                conn.execute(update(entries).where(
                    entries.c.saga_id == x.saga_id, entries.c.seq == x.seq, col > db_now())
                    .values({col: db_later(self.sw.settings.lease_seconds / 2)}))
            before = self.entry(x.saga_id, x.seq)
        if undo:
            col, ours = entries.c.comp_lease_until, (before.compensation is None
                                                     and before.undo_token == x.token
                                                     and before.comp_lease_until is not None)
            lease_before = before.comp_lease_until
        else:
            col, ours = entries.c.lease_until, (before.phase == _INTENT
                                                and before.attempt_token == x.token
                                                and before.lease_until is not None)
            lease_before = before.lease_until
        self.m.heartbeat([(x.saga_id, x.seq, undo, x.token)])
        after = self.entry(x.saga_id, x.seq)
        if ours:
            assert self.lease_alive(x.saga_id, x.seq, col), "a heartbeat kept no lease"
            x.lapsed = False
        else:
            now_ = after.comp_lease_until if undo else after.lease_until
            assert now_ == lease_before, "a fenced-out heartbeat wrote a lease"

    @rule(sweep=st.booleans())
    def time_passes(self, sweep: bool) -> None:
        """Time passes (and ``sweep``: the sweeper runs)."""
        self.lapse()
        if sweep:
            self.sweep()

    @precondition(lambda self: any(m[0] == "step" for m in self.bus.messages))
    @rule()
    def a_while_passes(self) -> None:
        """A while passes (past ``relay_after``, well under an hour: past every retry's
        due time) while step messages wait in their queue, and the sweeper's resending
        stages run: a step they would resend, unstarted or waiting for its Celery retry,
        is held back (it may be one of the messages, or wait in a busy worker, its ETA
        past: a copy would run it once more)."""
        past = db_later(-(self.sw.settings.relay_after + 1))
        free = and_(entries.c.saga_id.in_(self.sagas), entries.c.phase == _INTENT,
                    entries.c.lease_until.is_(None))
        with self.sw.journal.engine.begin() as conn:
            waiting = {(r.saga_id, r.seq) for r in conn.execute(
                select(entries.c.saga_id, entries.c.seq).where(free))}
            conn.execute(update(entries).where(free).values(
                resend_at=None, created_at=past, updated_at=past,
                published_at=case((entries.c.published_at.is_(None), None), else_=past),
                retry_due_at=case((entries.c.retry_due_at.is_(None), None), else_=past)))
        self.world.not_due.clear()
        queued, sent = any(m[0] == "step" for m in self.bus.messages), len(self.bus.messages)
        self.sw.sweeper._relay()
        self.sw.sweeper._retries()
        resent = [m[1:3] for m in self.bus.messages[sent:]
                  if m[0] == "step" and m[1:3] in waiting]
        assert not (queued and resent), (
            f"the sweeper resent {resent} while their queue held step messages")

    def lapse(self) -> None:
        """Time passes: dead workers' leases lapse (live ones keep beating), and every
        row of this example is old enough for the sweeper and due for a resend."""
        dead = [a.token for a in self.attempts if a.dead and not a.over]
        dead_undos = [u.token for u in self.undos if u.dead and not u.over]
        with self.sw.journal.engine.begin() as conn:
            if dead:
                conn.execute(update(entries).where(entries.c.attempt_token.in_(dead),
                                                   entries.c.lease_until.is_not(None))
                             .values(lease_until=db_later(-1.0)))
            if dead_undos:
                conn.execute(update(entries).where(entries.c.undo_token.in_(dead_undos),
                                                   entries.c.comp_lease_until.is_not(None))
                             .values(comp_lease_until=db_later(-1.0)))
            hour = db_later(-2 * EPOCH)
            conn.execute(update(sagas).where(sagas.c.saga_id.in_(self.sagas))
                         .values(chain_touched_at=hour, updated_at=hour, resend_at=None,
                                 fail_requested_at=case(
                                     (sagas.c.fail_requested_at.is_(None), None), else_=hour)))
            conn.execute(update(entries).where(entries.c.saga_id.in_(self.sagas))
                         .values(resend_at=None, created_at=hour, updated_at=hour,
                                 published_at=case((entries.c.published_at.is_(None), None),
                                                   else_=hour),
                                 retry_due_at=case((entries.c.retry_due_at.is_(None), None),
                                                   else_=hour)))
        self.world.not_due.clear()  # (every retry journaled is due now)
        for a in self.attempts:
            a.lapsed = a.lapsed or a.dead
        for u in self.undos:
            u.lapsed = u.lapsed or u.dead

    def sweep(self) -> None:
        before = {s: self.saga_row(s) for s in self.world.overdue}
        n, sent = len(self.logs), len(self.bus.messages)
        self.sw.sweeper.sweep()
        early = [m[1:3] for m in self.bus.messages[sent:]
                 if m[0] == "step" and m[1:3] in self.world.not_due]
        assert not early, f"the sweeper resent a step whose retry is not due yet: {early}"
        passed = {e.get("saga_id") for e in self.events(n, "saga_deadline_passed")}
        for saga_id, was in before.items():
            row = self.saga_row(saga_id)
            assert SagaStatus(row.status) not in OPEN or row.fail_requested_at is not None, (
                "a saga past its deadline was not failed by a sweep")
            if was.fail_requested_at is None and row.reason == "deadline passed":
                assert saga_id in passed, "a deadline failed a saga with no saga_deadline_passed"

    @precondition(lambda self: self.last is not None)
    @rule()
    def replay(self) -> None:
        """A lost COMMIT: the last move, replayed with the same token, answers the same."""
        last = self.last
        assert last is not None
        if last[0] == "claim":
            _, saga_id, seq, tool, token, idem, start = last
            if start is Start.RUN and any(a.token == token and a.holds
                                          for a in self.attempts):
                again = self.m.claim_start(saga_id, seq, tool, token=token, worker="model",
                                           idempotent=idem, task_id=None)
                assert again.start is Start.RUN, f"replayed claim answered {again.start}"
        elif last[0] == "executed":
            _, saga_id, seq, token, out = last
            again = self.m.executed(saga_id, seq, token, seq, 1.0)
            assert again.applied == out.applied
        elif last[0] == "failed":
            _, saga_id, seq, token, status = last
            assert (self.m.failed(saga_id, seq, token, "Boom") is None) == (status is None)
        self.last = None

    # -- the compensation chain ---------------------------------------------------------

    def _chain(self, saga_id: str) -> None:
        token = new_token()
        self._claimed(saga_id, self.m.claim_undo(saga_id, token), token)

    def _claimed(self, saga_id: str, state: UndoState, token: str) -> None:
        for p in state.in_doubt:
            self._lost(saga_id, p.seq)
        for r, _ in state.died:  # given up: its last try's lease lapsed
            assert not [u for u in self.undos if (u.saga_id, u.seq) == (saga_id, r.seq)
                        and u.holds], "an undo with a live try was given up"
        with bound(saga_id):
            self.sw.compensator._log_found(state)  # the chain's reports: dead steps, undos
        if state.state is UndoClaim.CLAIMED:
            row = state.row
            # no undo while a forward step holds its lease, one undo at a time, latest
            # EXECUTED first
            assert not [a for a in self.attempts if a.saga_id == saga_id and a.holds], (
                "undo claimed while a step runs")
            assert not [u for u in self.undos if u.saga_id == saga_id and u.holds
                        and u.token != token], "two undos of one saga at once"
            done = self.world.undo_order.setdefault(saga_id, [])
            if not done or done[-1] != row.exec_order:
                assert all(row.exec_order < d for d in done), (
                    f"undo out of order: {row.exec_order} after {done}")
                done.append(row.exec_order)
            tries = state.attempt - self.world.tries_before.get((saga_id, row.seq), 0)
            assert tries <= 1 + RETRIES, f"undo tried {tries} times in one drive"
            assert self.entry(saga_id, row.seq).compensation is None
            spec = self.sw.registry.tool(row.tool_name)
            assert spec is not None or is_unit(row.tool_name)
            if spec is None or spec.gated or self.sw.registry.undo_for(spec) is None:
                self._outcome(Undo(saga_id, row.seq, token, 0), OutcomeResult.SKIPPED)
                return
            self.undos.append(Undo(saga_id, row.seq, token, state.attempt))
        elif state.state is UndoClaim.FINISHED:
            assert state.status is not None
            self.world.terminal.setdefault(saga_id, state.status)
            with bound(saga_id):
                self.sw.compensator._finished(state)

    def _outcome(self, u: Undo, result: OutcomeResult) -> None:
        """Journal an undo's outcome and claim the next (what the chain does)."""
        u.over = True
        before = self.entry(u.saga_id, u.seq)
        ours = before.compensation is None and before.undo_token == u.token
        nxt = new_token()
        detail = "no undo" if result is OutcomeResult.SKIPPED else None
        recorded, st2 = self.m.record_and_claim(u.saga_id, u.seq, result, detail, u.attempt,
                                                u.token, nxt)
        assert recorded == ours, ("an undo outcome journaled by a try that did not hold it"
                                  if recorded else "the undo holding the entry was refused")
        # replayed (a lost COMMIT): the same answer, never a second outcome
        again, _ = self.m.record_and_claim(u.saga_id, u.seq, result, detail, u.attempt,
                                           u.token, nxt)
        assert again == recorded
        if recorded:
            key = (u.saga_id, u.seq)
            assert key not in self.world.recorded, "outcome journaled twice"
            self.world.recorded.add(key)
            with bound(u.saga_id, u.seq):
                self.sw.compensator._log_outcome(result, detail, u.attempt)
        self._claimed(u.saga_id, st2, nxt)

    @precondition(lambda self: any(u.running for u in self.undos))
    @rule(i=st.integers(0, 20), how=st.sampled_from(["ok", "raise", "die", "apply_die"]))
    def undo_step(self, i: int, how: str) -> None:
        u = self.pick(i, [u for u in self.undos if u.running])
        if how in ("ok", "apply_die"):
            # an undo never runs once its outcome is journaled (checked at its claim); a
            # try repeated after a crash, or a late one, is idempotent by its key
            u.applied = True
            self.world.undos.add((u.saga_id, u.seq))
        if how in ("die", "apply_die"):
            u.dead = True
            return
        if how == "raise" and u.attempt < 1 + RETRIES:
            u.over = True
            self.m.release_undo(u.saga_id, u.seq, u.token, "Boom")
            self.bus.send_compensate(u.saga_id)
            return
        self._outcome(u, OutcomeResult.COMPENSATED if how == "ok"
                      else OutcomeResult.COMPENSATION_FAILED)

    @precondition(lambda self: self.world.terminal)
    @rule(i=st.integers(0, 3))
    def redrive(self, i: int) -> None:
        saga_id = self.pick(i, sorted(self.world.terminal))
        with self.sw.journal.engine.connect() as conn:
            tries = dict(conn.execute(select(entries.c.seq, entries.c.compensation_attempts)
                                      .where(entries.c.saga_id == saga_id)).all())
        seqs = self.sw.retry_compensation(saga_id, actor="op")
        if seqs:
            self.world.terminal.pop(saga_id, None)
            for seq in seqs:  # reopened: a new drive, with its own tries
                self.world.recorded.discard((saga_id, seq))
                self.world.tries_before[(saga_id, seq)] = tries[seq]
            self.world.undo_order.get(saga_id, []).clear()

    # -- invariants -----------------------------------------------------------------------

    @invariant()
    def journal_agrees(self) -> None:
        if not self.sagas:
            return
        with self.sw.journal.engine.connect() as conn:
            rows = conn.execute(select(entries).where(entries.c.saga_id.in_(self.sagas))
                                .order_by(entries.c.saga_id, entries.c.seq)).all()
            srows = {r.saga_id: r for r in conn.execute(
                select(sagas).where(sagas.c.saga_id.in_(self.sagas))).all()}
        by_saga: dict[str, list[Any]] = {s: [] for s in self.sagas}
        for r in rows:
            by_saga[r.saga_id].append(r)
            assert r.reruns <= MAX_RERUNS, f"re-run {r.reruns} times"
            tries = r.compensation_attempts - self.world.tries_before.get((r.saga_id, r.seq), 0)
            assert tries <= 1 + RETRIES, f"undo tried {tries} times in one drive"
            if r.compensation is not None:
                assert r.phase == _EXECUTED, "an undo outcome on a step not EXECUTED"
            if r.tool_name.endswith(".ship") and r.phase == _EXECUTED:
                assert (r.saga_id, r.seq) in self.world.effects
            if r.compensation == OutcomeResult.COMPENSATED.value:
                assert (r.saga_id, r.seq) in self.world.undos, "COMPENSATED, never undone"
        self.holds_agree(srows.values())
        for saga_id, status in self.world.terminal.items():
            now_ = SagaStatus(srows[saga_id].status)
            assert now_ is status, f"terminal {saga_id} changed {status} -> {now_}"
        for saga_id, row in srows.items():
            mine = by_saga[saga_id]
            status = SagaStatus(row.status)
            if status is SagaStatus.COMPLETED:
                assert all(r.phase == _EXECUTED for r in mine), "COMPLETED with a step undone"
                assert row.fail_requested_at is None, "COMPLETED after it was asked to fail"
            if status in OPEN and row.fail_requested_at is None:
                waiting = any(r.phase == _AWAITING for r in mine)
                assert waiting == (status is SagaStatus.AWAITING_APPROVAL), (
                    f"saga {status.value} with{'' if waiting else ' no'} gate waiting")
            n = self.world.flows.get(saga_id)
            if n is not None:  # a flow journals its steps in order, none twice or skipped
                got = [(r.tool_name, list(r.args)) for r in mine]
                assert got == flow_calls(n)[:len(got)], f"flow journaled {got}"
                if status is SagaStatus.COMPLETED:
                    assert row.result == flow_value(n), f"flow completed with {row.result}"
                self.units_agree(n, mine)

    @invariant()
    def events_agree(self) -> None:
        """A dead step found in doubt logs step_in_doubt, an undo given up (or whose
        worker died on every try) compensation_failed, a dirty finish
        saga_compensation_failed: each once, exactly when the journal says so."""
        if not self.sagas:
            return
        with self.sw.journal.engine.connect() as conn:
            rows = conn.execute(select(entries.c.saga_id, entries.c.seq, entries.c.phase,
                                       entries.c.in_doubt, entries.c.compensation)
                                .where(entries.c.saga_id.in_(self.sagas))).all()
            srows = conn.execute(select(sagas.c.saga_id, sagas.c.status)
                                 .where(sagas.c.saga_id.in_(self.sagas))).all()
        snap: dict[Any, Any] = {(r.saga_id, r.seq): (r.phase, bool(r.in_doubt), r.compensation)
                                for r in rows}
        snap.update({r.saga_id: r.status for r in srows})
        new = self.logs[self.seen:]
        self.seen = len(self.logs)
        old, self.snap = self.snap, snap

        def logged(name: str) -> Counter[Any]:
            return Counter((e.get("saga_id"), e.get("seq")) if name != "saga_compensation_failed"
                           else e.get("saga_id") for e in new if e.get("event") == name)

        doubted = {k for k, v in snap.items() if isinstance(k, tuple) and v[1]
                   and not (old.get(k) or (None, False))[1]}
        dirty = {k for k, v in snap.items() if isinstance(k, tuple) and v[2] == _FAILED_UNDO
                 and (old.get(k) or (None, False, None))[2] != _FAILED_UNDO}
        failed = {k for k, v in snap.items() if isinstance(k, str)
                  and v == SagaStatus.COMPENSATION_FAILED.value
                  and old.get(k) != SagaStatus.COMPENSATION_FAILED.value}
        assert logged("step_in_doubt") == Counter(doubted), (
            f"step_in_doubt logged {dict(logged('step_in_doubt'))}, found in doubt {doubted}")
        assert logged("compensation_failed") == Counter(dirty), (
            f"compensation_failed logged {dict(logged('compensation_failed'))}, "
            f"given up {dirty}")
        assert logged("saga_compensation_failed") == Counter(failed), (
            "saga_compensation_failed not logged once for each dirty finish")
        assert not [e for e in new if e.get("event") == "flow_unknown" or (
            e.get("event") == "flow_diverged" and e.get("saga_id") not in self.diverging)], (
            "a flow whose code did not change diverged")

    # -- quiescence -----------------------------------------------------------------------

    def _finish_running(self) -> None:
        while any(a.running for a in self.attempts):
            self.finish(0, "ok")
        while any(u.running for u in self.undos):
            self.undo_step(0, "ok")

    def _drain(self) -> None:
        """No new faults: every running attempt and undo finishes, dead leases lapse, every
        message is delivered and the sweeper runs, until nothing moves."""
        self.replays.clear()  # a replay's worker is gone
        self.turns.how = "ok"  # (a request asked to fail before would fail here)
        for _ in range(30):
            self._finish_running()
            self.lapse()
            self.sweep()
            if not self.bus.messages:
                return
            while self.bus.messages:
                self.deliver(0, False)
                self._finish_running()
            self.events_agree()
        raise AssertionError("no quiescence: the sweeper re-sends work on every pass")

    def _live(self) -> None:
        """Liveness: with nothing in flight, every saga is terminal, or open, not failing
        and waiting only for a decision or for its producer to complete it."""
        for saga_id in self.sagas:
            row = self.saga_row(saga_id)
            status = SagaStatus(row.status)
            if status in TERMINAL:
                continue
            assert status in OPEN, f"{saga_id} stuck {status.value}"
            assert row.fail_requested_at is None, f"{saga_id} asked to fail, never compensated"
            _, mine = self.sw.journal.saga_and_entries(saga_id)
            phases = Counter(r.phase for r in mine)
            assert set(phases) <= {_EXECUTED, _AWAITING}, f"{saga_id} stuck with {phases}"
            assert (status is SagaStatus.AWAITING_APPROVAL) == (_AWAITING in phases), (
                f"{saga_id} {status.value} with gates {phases.get(_AWAITING, 0)}")
            if saga_id in self.world.flows:
                assert _AWAITING in phases, f"flow {saga_id} not advanced: {phases}"

    def teardown(self) -> None:
        try:
            if self.sagas:
                self._quiesce()
        finally:
            self._capture.close()

    def _quiesce(self) -> None:
        self.resume_all()
        for _ in range(4):
            self._drain()
            self._live()
            self.events_agree()
            for p in self.sw.pending_approvals():
                if p.saga_id in self.sagas:
                    self.sw.approve(p.token, approver="alice")
            self._drain()
            self._live()
            for saga_id in self.asynchronous():
                if self.saga_row(saga_id).status == SagaStatus.RUNNING.value:
                    self.sw.get(saga_id).complete()  # completable: it must not refuse
            if all(SagaStatus(self.saga_row(s).status) in TERMINAL for s in self.sagas):
                break
        stuck = {s: self.saga_row(s).status for s in self.sagas
                 if SagaStatus(self.saga_row(s).status) not in TERMINAL}
        assert not stuck, f"not terminal after quiescence: {stuck}"
        self.journal_agrees()
        self.events_agree()
