"""A model checker for the journal's state machine.

Hypothesis drives the REAL moves (``sagaworker._journal.machine.Machine``, the producer, the gate,
the sweeper) against a real database through interleavings of: delivery, duplicate
delivery, a lost message, a worker dying before its claim / after it / after the effect /
before the outcome commits, a Celery retry, a lost COMMIT (the same move replayed with the
same token), ``fail``, approve and reject (also right after a fail), a sweep, a lease
lapse, an operator re-drive. The "world" (which effects and undos happened, which
attempts are running) is kept here; after every step the invariants are checked against
it and the journal.

Time is not real here: a lease lapses only when a rule says so (for attempts whose
worker died), so a live attempt is never mistaken for a dead one by the clock.
"""

from __future__ import annotations

import contextlib
import itertools
import uuid
from dataclasses import dataclass, field
from typing import Any

from celery import Celery
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)
from sqlalchemy import case, select, update

from sagaworker import (
    ApprovalInvalid,
    Reversibility,
    SagaStatus,
    Sagaworker,
    SagaworkerError,
    Settings,
)
from sagaworker._base.types import TERMINAL, OutcomeResult, Phase
from sagaworker._journal.dialect import db_later
from sagaworker._journal.machine import Start, UndoClaim, UndoState, new_token
from sagaworker._journal.schema import entries, sagas

MAX_RERUNS = 2
#: the model's clock: the sweeper sees a row as old only once ``lapse`` moved it back by
#: more than this, never because real time passed (a slow example on PostgreSQL passed the
#: sweeper's 10 s failure cut-off and made the run nondeterministic)
EPOCH = 10 * 365 * 86400.0
RETRIES = 1  # SAGAWORKER_COMPENSATION_RETRIES: 1 + 1 tries per undo
TOOLS = ("plain", "idem", "ship", "lookup")


class RecordingBus:
    """The broker: every message sagaworker sends, kept for the model to deliver."""

    def __init__(self, sagas: list[str]) -> None:
        self.messages: list[tuple[Any, ...]] = []
        self.sagas = sagas  # the examples share a database: only this one's messages

    def publish_step(self, saga_id: str, seq: int, tool: str, args: list[Any],
                     kwargs: dict[str, Any], task_id: str, queue: str | None, *,
                     retries: int = 0) -> bool:
        if saga_id in self.sagas:
            self.messages.append(("step", saga_id, seq, tool))
        return True

    def send_failure(self, saga_id: str, reason: str) -> None:
        if saga_id in self.sagas:
            self.messages.append(("failure", saga_id, reason))

    def send_compensate(self, saga_id: str, *, countdown: float | None = None) -> None:
        if saga_id in self.sagas:
            self.messages.append(("compensate", saga_id))

    def send_advance(self, saga_id: str) -> None:
        pass  # the model has no flows

    def queue_of(self, tool: str, queue: str | None) -> str | None:
        return None  # one list for every queue: the relay's backlog check does not apply

    def ready(self, queues: set[str]) -> dict[str, int]:
        return {}


def build(url: str) -> Sagaworker:
    app = Celery("model", broker="memory://")
    sw = Sagaworker(app, settings=Settings(
        database_url=url, broker_url="memory://", approval_secret="model-secret-" + "x" * 32,
        max_reruns=MAX_RERUNS, compensation_retries=RETRIES, relay_after=300,
        redeliver_after=600))

    @sw.tool(compensable_by="undo_plain")
    def plain(n: int) -> int:
        return n

    @sw.compensation
    def undo_plain() -> None:
        pass

    @sw.tool(compensable_by="undo_plain", idempotent=True)
    def idem(n: int) -> int:
        return n

    @sw.tool(reversibility=Reversibility.IRREVERSIBLE)
    def ship(n: int) -> int:
        return n

    @sw.tool()
    def lookup(n: int) -> int:
        return n

    sw.validate()
    sw.sweeper._ago = lambda seconds: db_later(-(seconds + EPOCH))  # type: ignore[method-assign]
    return sw


@dataclass
class Attempt:
    saga_id: str
    seq: int
    tool: str
    token: str
    effect: bool = False
    dead: bool = False


@dataclass
class Undo:
    saga_id: str
    seq: int
    token: str
    attempt: int
    applied: bool = False
    dead: bool = False


@dataclass
class World:
    effects: dict[tuple[str, int], int] = field(default_factory=dict)
    #: undos applied, by their idempotency key (a retry after a crash changes nothing)
    undos: set[tuple[str, int]] = field(default_factory=set)
    undo_order: dict[str, list[int]] = field(default_factory=dict)   # exec_order undone
    terminal: dict[str, SagaStatus] = field(default_factory=dict)
    executed_applied: set[tuple[str, int]] = field(default_factory=set)
    recorded: set[tuple[str, int]] = field(default_factory=set)


class JournalMachine(RuleBasedStateMachine):
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

    # -- helpers ------------------------------------------------------------------------

    @property
    def m(self) -> Any:
        return self.sw.machine

    def saga_row(self, saga_id: str) -> Any:
        return self.sw.journal.saga_row(saga_id)

    def entry(self, saga_id: str, seq: int) -> Any:
        return self.sw.journal.entry_row(saga_id, seq)

    def live_attempts(self, saga_id: str, seq: int | None = None) -> list[Attempt]:
        return [a for a in self.attempts if a.saga_id == saga_id and not a.dead
                and (seq is None or a.seq == seq)]

    def tool_name(self, short: str) -> str:
        return f"tests.statemachine.model.{short}"

    # -- the producer -------------------------------------------------------------------

    @initialize(first=st.lists(st.sampled_from(TOOLS), min_size=1, max_size=4),
                second=st.lists(st.sampled_from(TOOLS), min_size=0, max_size=3))
    def two_sagas(self, first: list[str], second: list[str]) -> None:
        """Two sagas with their first steps journaled and published (steps enqueued
        together run in parallel: their EXECUTED order is the workers')."""
        for tools in (first, second):
            self.begin()
            for tool in tools:
                self.enqueue(len(self.sagas) - 1, tool)

    @precondition(lambda self: len(self.sagas) < 3)
    @rule()
    def begin(self) -> None:
        saga_id = f"m-{self.run}-{len(self.sagas)}"
        self.sw.begin(saga_id)
        self.sagas.append(saga_id)

    @precondition(lambda self: self.sagas)
    @rule(i=st.integers(0, 2), tool=st.sampled_from(TOOLS))
    def enqueue(self, i: int, tool: str) -> None:
        saga_id = self.sagas[i % len(self.sagas)]
        try:
            self.sw.get(saga_id).enqueue(self.sw.registry.tool(self.tool_name(tool)).task,
                                         next(self.counter))
        except SagaworkerError as exc:
            assert "takes no new steps" in str(exc) or "is " in str(exc)

    @precondition(lambda self: self.sagas)
    @rule(i=st.integers(0, 2))
    def fail(self, i: int) -> None:
        saga_id = self.sagas[i % len(self.sagas)]
        try:
            self.sw.get(saga_id).fail("model says fail")
        except SagaworkerError as exc:
            assert "COMPLETED" in str(exc)

    @precondition(lambda self: any(not a.dead for a in self.attempts))
    @rule(i=st.integers(0, 20))
    def fail_while_running(self, i: int) -> None:
        """A saga fails while one of its steps runs; its failure message is handled at once."""
        live = [a for a in self.attempts if not a.dead]
        saga_id = live[i % len(live)].saga_id
        self.fail(self.sagas.index(saga_id))
        for msg in [m for m in self.bus.messages if m[0] == "failure" and m[1] == saga_id]:
            self.bus.messages.remove(msg)
            if self.m.begin_compensation(saga_id, msg[2], new_token())[0]:
                self._chain(saga_id)

    @precondition(lambda self: self.sagas)
    @rule(i=st.integers(0, 2))
    def complete(self, i: int) -> None:
        with contextlib.suppress(SagaworkerError):
            self.sw.get(self.sagas[i % len(self.sagas)]).complete()

    @rule(approve=st.booleans(), fail_first=st.booleans(), i=st.integers(0, 5))
    def decide(self, approve: bool, fail_first: bool, i: int) -> None:
        pending = self.sw.pending_approvals()
        mine = [p for p in pending if p.saga_id in self.sagas]
        if not mine:
            return
        req = mine[i % len(mine)]
        if fail_first:  # approve (or reject) right after a fail: the gate is closed
            self.sw.get(req.saga_id).fail("failed before the decision")
        try:
            if approve:
                self.sw.approve(req.token, approver="alice")
            else:
                self.sw.reject(req.token, approver="bob", reason="no")
        except ApprovalInvalid:
            assert fail_first, "a decision on an open gate of a healthy saga was refused"
            return
        assert not fail_first, "a gate of a saga asked to fail accepted a decision"

    # -- the broker ---------------------------------------------------------------------

    @precondition(lambda self: self.bus.messages)
    @rule(i=st.integers(0, 50), keep=st.booleans())
    def deliver(self, i: int, keep: bool) -> None:
        """Deliver one message; ``keep``: it stays queued too (a duplicate delivery)."""
        msg = self.bus.messages[i % len(self.bus.messages)]
        if not keep:
            self.bus.messages.remove(msg)
        kind = msg[0]
        if kind == "step":
            self._claim(msg[1], msg[2], msg[3])
        elif kind == "failure":
            won, _, _ = self.m.begin_compensation(msg[1], msg[2], new_token())
            if won:
                self._chain(msg[1])
        else:
            self._chain(msg[1])

    @precondition(lambda self: self.bus.messages)
    @rule()
    def deliver_oldest(self) -> None:
        self.deliver(0, False)

    @precondition(lambda self: any(not a.dead for a in self.attempts))
    @rule(i=st.integers(0, 20))
    def succeed(self, i: int) -> None:
        live = [a for a in self.attempts if not a.dead]
        self.finish(self.attempts.index(live[i % len(live)]), "ok")

    @precondition(lambda self: self.bus.messages)
    @rule(i=st.integers(0, 50))
    def lose(self, i: int) -> None:
        self.bus.messages.pop(i % len(self.bus.messages))

    # -- workers: forward attempts ---------------------------------------------------------

    def _claim(self, saga_id: str, seq: int, tool: str) -> None:
        spec = self.sw.registry.tool(tool)
        assert spec is not None
        token = new_token()
        claim = self.m.claim_start(saga_id, seq, tool, token=token, worker="model",
                                   idempotent=spec.idempotent, task_id=None)
        self.last = ("claim", saga_id, seq, tool, token, spec.idempotent, claim.start)
        if claim.start is Start.RUN:
            # invariant 4: no two attempts of one entry at once
            assert not self.live_attempts(saga_id, seq), "two attempts of one entry at once"
            saga = self.saga_row(saga_id)
            if spec.gated:  # invariant 3: no IRREVERSIBLE effect for a saga asked to fail
                assert saga.fail_requested_at is None, "gated step claimed for a failing saga"
            self.attempts.append(Attempt(saga_id, seq, tool, token))
        elif claim.start is Start.IN_DOUBT:
            self.bus.messages.append(("failure", saga_id, "in doubt"))

    @precondition(lambda self: self.attempts)
    @rule(i=st.integers(0, 20))
    def effect(self, i: int) -> None:
        a = self.attempts[i % len(self.attempts)]
        if a.dead or a.effect:
            return
        a.effect = True
        key = (a.saga_id, a.seq)
        self.world.effects[key] = self.world.effects.get(key, 0) + 1
        if not a.tool.endswith(".idem"):  # invariant 4: no effect twice
            assert self.world.effects[key] == 1, f"effect of {key} happened twice"

    @precondition(lambda self: self.attempts)
    @rule(i=st.integers(0, 20), how=st.sampled_from(["ok", "raise", "give_up", "die"]))
    def finish(self, i: int, how: str) -> None:
        a = self.attempts[i % len(self.attempts)]
        if a.dead:
            return
        self.attempts.remove(a)
        if how == "ok":
            if not a.effect:
                self.effect_of(a)
            out = self.m.executed(a.saga_id, a.seq, a.token, a.seq, 1.0)
            self.last = ("executed", a.saga_id, a.seq, a.token, out)
            if out.applied:
                assert (a.saga_id, a.seq) not in self.world.executed_applied, "EXECUTED twice"
                self.world.executed_applied.add((a.saga_id, a.seq))
                if out.status is SagaStatus.COMPENSATING:
                    self.bus.messages.append(("compensate", a.saga_id))
        elif how in ("raise", "give_up"):
            status = self.m.release(a.saga_id, a.seq, a.token, "Boom")
            if status is SagaStatus.COMPENSATING:
                self.bus.messages.append(("compensate", a.saga_id))
            if how == "raise":  # Celery retries: the same message comes again
                self.bus.messages.append(("step", a.saga_id, a.seq, a.tool))
            else:
                st_ = self.m.failed(a.saga_id, a.seq, a.token, "Boom")
                self.last = ("failed", a.saga_id, a.seq, a.token, st_)
                if st_ in (SagaStatus.RUNNING, SagaStatus.AWAITING_APPROVAL):
                    self.bus.messages.append(("failure", a.saga_id, "Boom"))
                elif st_ is SagaStatus.COMPENSATING:
                    self.bus.messages.append(("compensate", a.saga_id))
        else:  # the worker dies (before or after its effect); its lease lapses later
            a.dead = True
            self.attempts.append(a)

    def effect_of(self, a: Attempt) -> None:
        a.effect = True
        key = (a.saga_id, a.seq)
        self.world.effects[key] = self.world.effects.get(key, 0) + 1
        if not a.tool.endswith(".idem"):
            assert self.world.effects[key] == 1, f"effect of {key} happened twice"

    @rule()
    def lapse(self) -> None:
        """Time passes: dead workers' leases lapse (live ones keep beating), and every
        row of this example is old enough for the sweeper and due for a resend."""
        dead = [a.token for a in self.attempts if a.dead]
        dead_undos = [u.token for u in self.undos if u.dead]
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
        self.attempts = [a for a in self.attempts if not a.dead]
        self.undos = [u for u in self.undos if not u.dead]

    @rule()
    def sweep(self) -> None:
        self.sw.sweeper.sweep()

    @precondition(lambda self: self.last is not None)
    @rule()
    def replay(self) -> None:
        """A lost COMMIT: the last move, replayed with the same token, answers the same."""
        last = self.last
        assert last is not None
        if last[0] == "claim":
            _, saga_id, seq, tool, token, idem, start = last
            if start is Start.RUN and any(a.token == token for a in self.attempts):
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
        if state.state is UndoClaim.CLAIMED:
            row = state.row
            # invariant 1: no undo while a forward step runs, one undo at a time,
            # latest EXECUTED first
            assert not self.live_attempts(saga_id), "undo claimed while a step runs"
            others = [u for u in self.undos if u.saga_id == saga_id and not u.dead
                      and u.token != token]
            assert not others, "two undos of one saga at once"
            done = self.world.undo_order.setdefault(saga_id, [])
            if not done or done[-1] != row.exec_order:
                assert all(row.exec_order < d for d in done), (
                    f"undo out of order: {row.exec_order} after {done}")
                done.append(row.exec_order)
            # invariant 5: caps
            assert state.attempt <= 1 + RETRIES, f"undo tried {state.attempt} times"
            assert self.entry(saga_id, row.seq).compensation is None
            spec = self.sw.registry.tool(row.tool_name)
            assert spec is not None
            if spec.gated or self.sw.registry.undo_for(spec) is None:
                nxt = new_token()
                recorded, st2 = self.m.record_and_claim(saga_id, row.seq,
                                                        OutcomeResult.SKIPPED, "no undo", 0,
                                                        token, nxt)
                self._note_record(saga_id, row.seq, recorded)
                self._claimed(saga_id, st2, nxt)
                return
            self.undos.append(Undo(saga_id, row.seq, token, state.attempt))
        elif state.state is UndoClaim.FINISHED:
            self.world.terminal.setdefault(saga_id, state.status)  # type: ignore[arg-type]

    def _note_record(self, saga_id: str, seq: int, recorded: bool) -> None:
        if recorded:  # invariant 2: an outcome is journaled once
            assert (saga_id, seq) not in self.world.recorded, "outcome journaled twice"
            self.world.recorded.add((saga_id, seq))

    @precondition(lambda self: self.undos)
    @rule(i=st.integers(0, 20), how=st.sampled_from(["ok", "raise", "die", "apply_die"]))
    def undo_step(self, i: int, how: str) -> None:
        u = self.undos[i % len(self.undos)]
        if u.dead:
            return
        if how in ("ok", "apply_die"):
            # invariant 2: an undo never runs once its outcome is journaled (checked at
            # its claim); a try repeated after a crash is idempotent by its key
            u.applied = True
            self.world.undos.add((u.saga_id, u.seq))
        if how in ("die", "apply_die"):
            u.dead = True
            return
        self.undos.remove(u)
        tries = 1 + RETRIES
        if how == "raise" and u.attempt < tries:
            self.m.release_undo(u.saga_id, u.seq, u.token, "Boom")
            self.bus.messages.append(("compensate", u.saga_id))
            return
        result = OutcomeResult.COMPENSATED if how == "ok" else OutcomeResult.COMPENSATION_FAILED
        nxt = new_token()
        recorded, st2 = self.m.record_and_claim(u.saga_id, u.seq, result, None, u.attempt,
                                                u.token, nxt)
        # replayed (a lost COMMIT): the same answer, never a second outcome
        again, _ = self.m.record_and_claim(u.saga_id, u.seq, result, None, u.attempt,
                                           u.token, nxt)
        assert again == recorded
        self._note_record(u.saga_id, u.seq, recorded)
        self._claimed(u.saga_id, st2, nxt)

    @precondition(lambda self: self.sagas)
    @rule(i=st.integers(0, 2))
    def redrive(self, i: int) -> None:
        saga_id = self.sagas[i % len(self.sagas)]
        if self.sw.retry_compensation(saga_id, actor="op"):
            self.world.terminal.pop(saga_id, None)
            for key in [k for k in self.world.recorded if k[0] == saga_id]:
                if self.entry(*key).compensation is None:
                    self.world.recorded.discard(key)
            order = self.world.undo_order.get(saga_id, [])
            order.clear()

    # -- invariants -----------------------------------------------------------------------

    @invariant()
    def journal_agrees(self) -> None:
        if not self.sagas:
            return
        with self.sw.journal.engine.connect() as conn:
            rows = conn.execute(select(entries).where(entries.c.saga_id.in_(self.sagas))).all()
            srows = {r.saga_id: r for r in conn.execute(
                select(sagas).where(sagas.c.saga_id.in_(self.sagas))).all()}
        for r in rows:
            assert r.reruns <= MAX_RERUNS, f"re-run {r.reruns} times"
            assert r.compensation_attempts <= 1 + RETRIES
            if r.compensation is not None:
                assert r.phase == Phase.EXECUTED.value, "an undo outcome on a step not EXECUTED"
            if r.tool_name.endswith(".ship") and r.phase == Phase.EXECUTED.value:
                assert (r.saga_id, r.seq) in self.world.effects
        for saga_id, status in self.world.terminal.items():
            now = SagaStatus(srows[saga_id].status)
            assert now is status, f"terminal {saga_id} changed {status} -> {now}"
        for r in rows:  # an undo reported COMPENSATED really ran
            if r.compensation == OutcomeResult.COMPENSATED.value:
                assert (r.saga_id, r.seq) in self.world.undos, "COMPENSATED, never undone"

    def teardown(self) -> None:
        """Quiescence: no new faults, messages delivered, leases lapse, sweeps run; every
        saga ends terminal."""
        for _ in range(60):
            for a in list(self.attempts):
                if not a.dead:
                    self.finish(self.attempts.index(a), "ok")
            for u in list(self.undos):
                if not u.dead and u in self.undos:
                    self.undo_step(self.undos.index(u), "ok")
            self.lapse()
            self.sweep()
            while self.bus.messages:
                self.deliver(0, False)
                for a in list(self.attempts):
                    if not a.dead and a in self.attempts:
                        self.finish(self.attempts.index(a), "ok")
                for u in list(self.undos):
                    if not u.dead and u in self.undos:
                        self.undo_step(self.undos.index(u), "ok")
            open_ = [s for s in self.sagas
                     if SagaStatus(self.saga_row(s).status) not in TERMINAL]
            if not open_:
                break
            for s in open_:
                row = self.saga_row(s)
                if SagaStatus(row.status) in (SagaStatus.RUNNING, SagaStatus.AWAITING_APPROVAL):
                    for p in self.sw.pending_approvals():
                        if p.saga_id == s:
                            self.sw.approve(p.token, approver="alice")
                    try:
                        self.sw.get(s).complete()
                    except SagaworkerError:
                        self.sw.get(s).fail("quiescence")
        stuck = {s: self.saga_row(s).status for s in self.sagas
                 if SagaStatus(self.saga_row(s).status) not in TERMINAL}
        assert not stuck, f"not terminal after quiescence: {stuck}"
        self.journal_agrees()
