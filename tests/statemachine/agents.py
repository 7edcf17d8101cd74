"""The model checker's moves for durable agent runs: model requests journaled as units.

An agent flow (``world.agent_flow``) asks its model twice with a tool call between; each
request is a durable unit the replaying worker journals (INTENT, claimed by it), sends and
journals (EXECUTED). The moves: a request answered, one whose worker dies while it is in
flight, one the model provider fails for good, one it fails for a passing reason (a 503:
retried, counted on the request's step, its next try due in the provider's Retry-After,
the run failed once its tries are spent), one whose call the framework cancels while it
is under way (``world.agent_flow`` run side by side with a tool call: its outcome is
journaled all the same, and never asked again), one in flight while another worker
replays the same flow, one whose lease lapses while it is in flight (a stalled worker:
another worker takes it over and it answers late), one in flight while its short lease
passes (its worker's heartbeat keeps it), then its worker stalls and its heartbeat
revives its claim while a takeover reads it (``leases``), and a lost COMMIT on its
EXECUTED. Checked at every request and after every step: a journaled response is never
asked for again, no request is sent beside another live one of the same step, within the
re-runs and retries allowed; no replay journals past a request in flight; a response is
journaled once, as the model gave it; each retry is counted on its step; no claim is
left held by a replay that went on.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

from hypothesis import strategies as st
from hypothesis.stateful import precondition, rule
from sqlalchemy import update

from sagaworker import SagaStatus
from sagaworker._base.types import OPEN, Phase
from sagaworker._base.units import is_unit
from sagaworker._journal.dialect import db_later
from sagaworker._journal.schema import entries
from tests.statemachine.world import (
    MAX_RERUNS,
    MODEL_TRIES,
    TURN_SEQ,
    UNIT,
    Attempt,
    Beats,
    Died,
    Model,
    Overloaded,
    answer,
)

_EXECUTED, _FAILED = Phase.EXECUTED.value, Phase.FAILED.value
HOW = ("ok", "die", "fail", "passing", "overlap", "overtaken", "failover", "lost_commit")
#: how a turn's request goes: as HOW, or "spent": the provider stays overloaded
TURN = (*HOW, "spent")


@dataclass
class Request:
    """One model request sent (a unit's try): the claim's token it was sent under."""

    token: str
    lapsed: bool = False
    over: bool = False
    worker: Attempt | None = None  # a dead worker's: its lease lapses with the model's time

    @property
    def in_flight(self) -> bool:
        """Its claim's lease has not lapsed and it has no answer: nobody may send it again."""
        dead = self.worker is not None and self.worker.lapsed
        return not (self.over or self.lapsed or dead)


class Broken(Died):
    """A check of the model's failed inside a request: raised past the library's own
    ``except Exception`` (which would journal it as the model provider's error)."""


@dataclass
class Turns:
    """What the model saw: the requests sent for each unit (saga, seq)."""

    sent: dict[tuple[str, int], list[Request]] = field(default_factory=dict)
    #: how the next request is met (``model_will``, ``agent_turn``), then "ok"
    how: str = "ok"
    #: the request answered last: (saga, seq, token) for a lost COMMIT's replay
    answered: tuple[str, int, str] | None = None
    #: passing failures retried, by unit: each counted on its step
    retried: dict[tuple[str, int], int] = field(default_factory=dict)
    #: units whose last try failed for a passing reason: their run must fail
    spent: list[tuple[str, int]] = field(default_factory=list)
    #: a check that failed inside a request (a cancelled call's unit may swallow it)
    failure: str | None = None


class AgentMoves:
    """Mixed into the journal machine (``model.JournalMachine``)."""

    sw: Any
    bus: Any
    sagas: list[str]
    world: Any
    attempts: list[Attempt]
    last: Any

    def agent_init(self) -> None:
        self.turns = Turns()
        Model.ask = self._asked
        self.beats = self.sw.flows.heartbeat = Beats()

    deliver: Callable[..., None]
    lease_alive: Callable[[str, int, Any], bool]
    in_flight_lease: Callable[..., None]  # (``leases``)

    def agents(self) -> list[str]:
        return [s for s, n in sorted(self.world.flows.items()) if n % 2]

    # -- the model's side: each request, checked and answered ---------------------------

    def _asked(self, saga_id: str, n: int, turn: int) -> int:
        try:
            return self._answer(saga_id, n, turn)
        except AssertionError as exc:
            self.turns.failure = self.turns.failure or str(exc)
            raise Broken(str(exc)) from exc

    def _answer(self, saga_id: str, n: int, turn: int) -> int:
        key = (saga_id, TURN_SEQ[turn])
        row = self.sw.journal.entry_row(*key)
        assert row is not None and row.tool_name == UNIT, f"a request for no unit: {key}"
        assert row.phase == Phase.INTENT.value, (
            f"a model request sent for a unit {row.phase} (its response journaled)")
        assert row.lease_until is not None, "a model request sent with no claim held"
        tries = self.turns.sent.setdefault(key, [])
        assert not [t for t in tries if t.in_flight], (
            "a model request sent while another one of the same step was in flight")
        retried = self.turns.retried.get(key, 0)
        assert len(tries) < 1 + MAX_RERUNS + retried, (
            f"a model request sent {len(tries) + 1} times ({retried} retries)")
        _, mine = self.sw.journal.saga_and_entries(saga_id)
        assert max(r.seq for r in mine) == key[1], (
            "a model request sent while the flow journaled past it")
        req = Request(row.attempt_token)
        tries.append(req)
        how, self.turns.how = self.turns.how, "ok"
        if how == "die":  # its worker is gone; the claim's lease lapses later
            req.worker = Attempt(saga_id, key[1], UNIT, req.token, 0, dead=True)
            self.attempts.append(req.worker)
            raise Died()
        if how == "fail":
            req.over = True
            raise RuntimeError("the model provider refused the request")
        if how == "passing":  # retried while tries are left (this one is try row.attempts)
            req.over = True
            if row.attempts < MODEL_TRIES:
                self.turns.retried[key] = retried + 1
            else:
                self.turns.spent.append(key)
            raise Overloaded("the model provider is overloaded (503)")
        if how == "failover":  # its short lease passes while it is in flight (twice)
            self.in_flight_lease(req, key)
        if how == "overtaken":  # stalled: its lease lapses and another worker takes over
            with self.sw.journal.engine.begin() as conn:
                conn.execute(update(entries).where(entries.c.attempt_token == req.token,
                                                   entries.c.lease_until.is_not(None))
                             .values(lease_until=db_later(-1.0)))
            req.lapsed = True
        if how in ("overlap", "overtaken"):  # another worker replays the flow meanwhile
            self._other_worker(saga_id)
        req.over = True
        if how == "lost_commit":
            self.turns.answered = (saga_id, key[1], req.token)
        return answer(n, turn)

    def _other_worker(self, saga_id: str) -> None:
        """Another worker's replay of the same flow, while this request is in flight."""
        errors: list[BaseException] = []

        def run() -> None:
            try:
                self.sw.flows.advance(saga_id)
            except BaseException as exc:  # (an assertion in the model's own checks)
                errors.append(exc)

        t = threading.Thread(target=run)
        t.start()
        t.join()
        if errors:
            raise errors[0]

    def advance_flow(self, saga_id: str, hold: Any = None) -> list[Any]:
        """A worker advances a flow; a model request it sends may kill it (``Died``)."""
        retried = dict(self.turns.retried)
        try:
            kept = self.sw.flows.advance(saga_id, hold=hold)
        except Broken as exc:
            raise AssertionError(str(exc)) from exc
        except Died:
            kept = []
        assert self.turns.failure is None, self.turns.failure
        self._retried_or_spent(retried)
        return kept

    def _retried_or_spent(self, before: dict[tuple[str, int], int]) -> None:
        """A passing failure with tries left releases its claim and schedules the flow's
        next advance for when the retry is due (no thread waits it out); spent, it fails
        the run."""
        for key, n in self.turns.retried.items():
            if n == before.get(key, 0):
                continue
            row = self.sw.journal.entry_row(*key)
            assert row.phase == Phase.INTENT.value and row.lease_until is None, (
                f"a retried model request kept its claim ({row.phase})")
            assert ("advance", key[0], Overloaded.retry_after) in self.bus.messages, (
                "a retried model request's next advance was not scheduled for its try")
        while self.turns.spent:
            key = self.turns.spent.pop()
            row, saga = self.sw.journal.entry_row(*key), self.sw.journal.saga_row(key[0])
            assert row.phase == _FAILED and row.error.endswith(f" of {MODEL_TRIES})"), (
                f"a model request whose tries were spent is {row.phase}: {row.error}")
            assert saga.fail_requested_at is not None or SagaStatus(saga.status) not in OPEN, (
                "a model request whose tries were spent did not fail its run")

    # -- the move ------------------------------------------------------------------------

    @precondition(lambda self: self.agents())
    @rule(how=st.sampled_from(HOW))
    def model_will(self, how: str) -> None:
        """The next model request, whichever worker sends it, goes ``how``."""
        self.turns.how = how

    def live_agents(self) -> list[str]:
        return [s for s in self.agents()
                if SagaStatus(self.sw.journal.saga_row(s).status) in OPEN]

    @precondition(lambda self: self.live_agents())
    @rule(i=st.integers(0, 3), how=st.sampled_from(TURN))
    def agent_turn(self, i: int, how: str) -> None:
        """A worker advances an agent run (its advance message, a duplicate, the sweeper's)
        after the tool its model asked for ran, and its next model request goes ``how``
        ("spent": the provider stays overloaded, every try of it fails once due)."""
        live = self.live_agents()
        saga_id = live[i % len(live)]
        steps = [k for k, m in enumerate(self.bus.messages) if m[:2] == ("step", saga_id)]
        if steps:  # the tool its model asked for runs first (the turn after it is asked)
            self.deliver(steps[0], False, True)
        self.turns.how, self.turns.answered = ("passing" if how == "spent" else how), None
        self.advance_flow(saga_id)
        if how == "spent":
            self._overloaded(saga_id)
        answered = self.turns.answered
        if answered is not None:  # its EXECUTED's COMMIT reply was lost: the move again
            row = self.sw.journal.entry_row(answered[0], answered[1])
            applied = row.phase == _EXECUTED and row.attempt_token == answered[2]
            self.last = ("executed", *answered, SimpleNamespace(applied=applied))

    @precondition(lambda self: self.live_agents())
    @rule(i=st.integers(0, 3), how=st.sampled_from(["passing", "spent", "failover"]))
    def request_in_trouble(self, i: int, how: str) -> None:
        """An agent run's next model request meets an overloaded provider (a 503 with a
        Retry-After: "passing", retried once due while its tries last; "spent": it stays
        overloaded until they are spent, and the run fails), or is in flight while its
        short lease passes ("failover": its worker beats in time, then stalls: its late
        beat comes right after a takeover read its claim; ``leases``). The turn as
        ``agent_turn``."""
        self.agent_turn(i, how)

    def _overloaded(self, saga_id: str) -> None:
        """The provider stays overloaded: the request's retry comes due (its scheduled
        advance delivered then) and fails again, until its tries are spent."""
        for _ in range(MODEL_TRIES):
            due = ("advance", saga_id, Overloaded.retry_after)
            if due not in self.bus.messages:
                break
            self.bus.messages.remove(due)
            with self.sw.journal.engine.begin() as conn:
                conn.execute(update(entries).where(
                    entries.c.saga_id == saga_id, entries.c.tool_name == UNIT,
                    entries.c.phase == Phase.INTENT.value, entries.c.retry_due_at.is_not(None))
                    .values(retry_due_at=db_later(-1.0)))
            self.turns.how = "passing"
            self.advance_flow(saga_id)
        self.turns.how = "ok"

    # -- the invariant (called by journal_agrees for each flow) --------------------------

    def units_agree(self, n: int, rows: list[Any]) -> None:
        """Nothing is journaled past a unit without its response; a response is the
        model's answer, journaled by a try that sent a request; each retry of a model
        request is counted on its step; between moves, a unit's claim is held only by a
        request whose worker died (a replay runs each unit it claims to its outcome, one
        whose call was cancelled included)."""
        assert self.turns.failure is None, self.turns.failure
        dead = {t.token for sent in self.turns.sent.values() for t in sent
                if t.worker is not None}
        for i, r in enumerate(rows):
            if not is_unit(r.tool_name):
                continue
            if r.phase == Phase.INTENT.value and r.lease_until is not None \
                    and r.attempt_token not in dead:
                assert not self.lease_alive(r.saga_id, r.seq, entries.c.lease_until), (
                    f"model request {r.seq} is claimed by a replay that left it unfinished")
            assert r.celery_retries == self.turns.retried.get((r.saga_id, r.seq), 0), (
                f"a model request retried {self.turns.retried.get((r.saga_id, r.seq), 0)} "
                f"times counts {r.celery_retries} on its step")
            if r.phase != _EXECUTED:
                assert i == len(rows) - 1, (
                    f"the flow journaled past model request {r.seq} ({r.phase})")
                continue
            turn = TURN_SEQ.index(r.seq)
            assert r.result == answer(n, turn), f"model request {r.seq} journaled {r.result}"
            sent = self.turns.sent.get((r.saga_id, r.seq), [])
            assert r.attempt_token in [t.token for t in sent], (
                "a response journaled by a try that sent no request")
