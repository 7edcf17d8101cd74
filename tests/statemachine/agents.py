"""The model checker's moves for durable agent runs: model requests journaled as units.

An agent flow (``world.agent_flow``) asks its model twice with a tool call between; each
request is a durable unit the replaying worker journals (INTENT, claimed by it), sends and
journals (EXECUTED). The moves: a request answered, one whose worker dies while it is in
flight, one the model provider fails, one in flight while another worker replays the same
flow, one whose lease lapses while it is in flight (a stalled worker: another worker
takes it over and it answers late), and a lost COMMIT on its EXECUTED. Checked at every
request and after every step: a journaled response is never asked for again, no request
is sent beside another live one of the same step, within the re-runs allowed; no replay
journals past a request in flight; a response is journaled once, as the model gave it.
"""

from __future__ import annotations

import threading
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
    TURN_SEQ,
    UNIT,
    Attempt,
    Died,
    Model,
    answer,
)

_EXECUTED = Phase.EXECUTED.value
HOW = ("ok", "die", "fail", "overlap", "overtaken", "lost_commit")


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

    def deliver(self, i: int, keep: bool, run: bool = False) -> None: ...

    def agents(self) -> list[str]:
        return [s for s, n in sorted(self.world.flows.items()) if n % 2]

    # -- the model's side: each request, checked and answered ---------------------------

    def _asked(self, saga_id: str, n: int, turn: int) -> int:
        try:
            return self._answer(saga_id, n, turn)
        except AssertionError as exc:
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
        assert len(tries) < 1 + MAX_RERUNS, f"a model request sent {len(tries) + 1} times"
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
            raise RuntimeError("the model provider answered 500")
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
        try:
            return self.sw.flows.advance(saga_id, hold=hold)
        except Broken as exc:
            raise AssertionError(str(exc)) from exc
        except Died:
            return []

    # -- the move ------------------------------------------------------------------------

    @precondition(lambda self: self.agents())
    @rule(how=st.sampled_from(HOW))
    def model_will(self, how: str) -> None:
        """The next model request, whichever worker sends it, goes ``how``."""
        self.turns.how = how

    @precondition(lambda self: [s for s in self.agents()
                                if SagaStatus(self.sw.journal.saga_row(s).status) in OPEN])
    @rule(i=st.integers(0, 3), how=st.sampled_from(HOW))
    def agent_turn(self, i: int, how: str) -> None:
        """A worker advances an agent run (its advance message, a duplicate, the sweeper's)
        after the tool its model asked for ran, and its next model request goes ``how``."""
        live = [s for s in self.agents()
                if SagaStatus(self.sw.journal.saga_row(s).status) in OPEN]
        saga_id = live[i % len(live)]
        steps = [k for k, m in enumerate(self.bus.messages) if m[:2] == ("step", saga_id)]
        if steps:  # the tool its model asked for runs first (the turn after it is asked)
            self.deliver(steps[0], False, True)
        self.turns.how, self.turns.answered = how, None
        self.advance_flow(saga_id)
        answered = self.turns.answered
        if answered is not None:  # its EXECUTED's COMMIT reply was lost: the move again
            row = self.sw.journal.entry_row(answered[0], answered[1])
            applied = row.phase == _EXECUTED and row.attempt_token == answered[2]
            self.last = ("executed", *answered, SimpleNamespace(applied=applied))

    # -- the invariant (called by journal_agrees for each flow) --------------------------

    def units_agree(self, n: int, rows: list[Any]) -> None:
        """Nothing is journaled past a unit without its response; a response is the
        model's answer, journaled by a try that sent a request."""
        for i, r in enumerate(rows):
            if not is_unit(r.tool_name):
                continue
            if r.phase != _EXECUTED:
                assert i == len(rows) - 1, (
                    f"the flow journaled past model request {r.seq} ({r.phase})")
                continue
            turn = TURN_SEQ.index(r.seq)
            assert r.result == answer(n, turn), f"model request {r.seq} journaled {r.result}"
            sent = self.turns.sent.get((r.saga_id, r.seq), [])
            assert r.attempt_token in [t.token for t in sent], (
                "a response journaled by a try that sent no request")
