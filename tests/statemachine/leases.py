"""The model checker's moves on leases that race: a model request's short lease (its
failover), and heartbeats that come late, after a release or a takeover's read.

An agent's model request in flight is held on SAGAWORKER_UNIT_LEASE (``world.UNIT_LEASE``),
shorter than a tool step's lease, and its worker's heartbeat (``world.Beats``) renews it;
every worker's requests timer (``Sweeper.requests``) hands on the requests whose lease
lapsed (their flows advanced again), and the next replay takes them over. The moves: the
unit lease passes (dead workers' requests lapse, a tool step keeps its lease) and the
timer hands them on to another worker; a request in flight while its lease passes (its
live worker beats in time: nobody takes it), then passes again with its worker stalled,
whose heartbeat comes late, right after a takeover read its lapsed claim (on PostgreSQL
between that read and the takeover's compare-and-set; SQLite serializes writers, so
there just before the read): the takeover must not land, the stalled worker keeps its
claim; an undo try overtaken by the chain's retry, whose late heartbeat and outcome carry
a stale token; and an undo that raised with tries left, whose worker's heartbeat read
what it holds before the release and beats right after it: the released try holds no
lease, its retry is claimed at once.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any
from unittest import mock

from hypothesis import strategies as st
from hypothesis.stateful import precondition, rule
from sqlalchemy import select

from sagaworker._base.units import is_unit
from sagaworker._journal.dialect import db_now
from sagaworker._journal.schema import entries
from sagaworker._machine import step_moves
from sagaworker._machine.machine import UndoClaim, new_token
from tests.statemachine.world import MAX_SAGAS, RETRIES, UNIT, UNIT_LEASE, Attempt, Undo

Held = tuple[str, int, bool, str]


@contextlib.contextmanager
def raced(token: str, late: Callable[[], None]) -> Iterator[list[bool]]:
    """A claim that reads the entry ``token`` holds runs ``late`` right after its read,
    before it writes (a heartbeat between a takeover's read and its compare-and-set)."""
    real, fired = step_moves._settled, []

    def settled(row: Any, *args: Any) -> Any:
        if row.attempt_token == token and not fired:
            fired.append(True)
            late()
        return real(row, *args)

    with mock.patch.object(step_moves, "_settled", settled):
        yield fired


class LeaseMoves:
    """Mixed into the journal machine (``model.JournalMachine``)."""

    sw: Any
    bus: Any
    sagas: list[str]
    world: Any
    attempts: list[Attempt]
    undos: list[Undo]
    beats: Any

    pick: Callable[[int, list[Any]], Any]
    entry: Callable[[str, int], Any]
    saga_row: Callable[[str], Any]
    deliver: Callable[..., None]
    _lapse: Callable[[Any, Any, str], None]
    _other_worker: Callable[[str], None]  # (``agents``)
    _claimed: Callable[[str, Any, str], None]
    lapse_live_undo: Callable[..., None]
    heartbeat: Callable[..., None]
    fail_executed: Callable[[int], None]
    enqueue: Callable[[int, str], None]
    begin: Callable[[bool], None]
    asynchronous: Callable[[], list[str]]
    undo_step: Callable[..., None]

    # -- a model request's short lease ----------------------------------------------------

    def _lapsed_requests(self) -> set[str]:
        """The sagas with a model request whose claim's lease lapsed."""
        with self.sw.journal.engine.connect() as conn:
            return set(conn.execute(select(entries.c.saga_id).where(
                entries.c.saga_id.in_(self.sagas), entries.c.tool_name == UNIT,
                entries.c.phase == "INTENT", entries.c.lease_until < db_now())).scalars())

    def _requests_timer(self) -> list[str]:
        """Every worker's requests timer: the flows of model requests whose lease lapsed
        are handed on (advanced again); never one whose lease holds, never a tool step."""
        sent = len(self.bus.messages)
        self.sw.sweeper.requests()
        new = self.bus.messages[sent:]
        assert all(m[0] == "advance" for m in new), f"the requests timer sent {new}"
        handed = [m[1] for m in new]
        assert set(handed) <= self._lapsed_requests(), (
            f"the requests timer handed on a model request whose lease holds ({handed})")
        return handed

    @precondition(lambda self: any(a.dead and not a.over and not a.lapsed and is_unit(a.tool)
                                   for a in self.attempts))
    @rule()
    def unit_lease_passes(self) -> None:
        """SAGAWORKER_UNIT_LEASE passes (well within a tool step's lease): the requests of
        dead workers lapse (a tool step keeps its lease), every worker's requests timer
        hands them on, and the replays their advances start take them over."""
        dead = [a for a in self.attempts
                if a.dead and not a.over and not a.lapsed and is_unit(a.tool)]
        for a in dead:
            self._lapse(a, entries.c.attempt_token, "lease_until")
        rows = [(a, self.entry(a.saga_id, a.seq)) for a in dead]
        due = {a.saga_id for a, r in rows  # (still its claim; not handed on already)
               if r.phase == "INTENT" and r.attempt_token == a.token and r.resend_at is None}
        handed = self._requests_timer()
        assert due <= set(handed), (
            f"a dead worker's model request was not handed on after its lease: {due}")
        for msg in [("advance", s, None) for s in handed]:
            if msg in self.bus.messages:  # (another worker replays each)
                self.deliver(self.bus.messages.index(msg), False)

    def in_flight_lease(self, req: Any, key: tuple[str, int]) -> None:
        """While ``req`` is in flight, its short lease passes twice. The first time its
        worker beats it in time: the requests timer leaves it be. Then the worker stalls:
        its lease lapses, the timer hands it on, and its heartbeat comes late, right after
        the takeover's read (just before it on SQLite), so the takeover must not land."""
        item: Held = (key[0], key[1], False, req.token)
        assert self.beats.held.get(item) == UNIT_LEASE, (
            "a model request in flight is not held on SAGAWORKER_UNIT_LEASE")
        self._beat(req, item)
        assert key[0] not in self._requests_timer(), (
            "a live worker's model request was handed on")
        self._lapse(req, entries.c.attempt_token, "lease_until")
        handed = self._requests_timer()
        for saga_id in handed:  # (this saga's advance: run by the other worker below)
            if saga_id == key[0]:
                self.bus.messages.remove(("advance", saga_id, None))
        if self.sw.journal.engine.dialect.name != "postgresql":
            self._beat(req, item)  # (SQLite: a claim's read and write are one writer's)
            self._other_worker(key[0])
            return
        with raced(req.token, lambda: self._beat(req, item)) as fired:
            self._other_worker(key[0])
        if not fired:  # no takeover read it: its late beat lands after that replay
            self._beat(req, item)

    def _beat(self, req: Any, item: Held) -> None:
        """The request's worker beats: the claim is its own again if no one took it."""
        self.sw.machine.heartbeat([item], lease=UNIT_LEASE)
        with self.sw.journal.engine.connect() as conn:
            row = conn.execute(select(entries.c.attempt_token,
                                      (entries.c.lease_until > db_now()).label("alive"))
                               .where(entries.c.saga_id == item[0],
                                      entries.c.seq == item[1])).first()
        if row is not None and row.attempt_token == req.token and row.alive:
            req.lapsed = False

    # -- an undo try's late writes ----------------------------------------------------------

    def _undone_before(self, saga_id: str, seq: int) -> bool:
        """Whether an EXECUTED step of the saga without an undo outcome was executed before
        step ``seq``: once that step's undo has its outcome, the chain claims another."""
        _, rows = self.sw.journal.saga_and_entries(saga_id)
        left = sorted((r for r in rows if r.phase == "EXECUTED" and r.compensation is None),
                      key=lambda r: r.exec_order)
        return bool(left) and left[0].seq != seq

    def _two_then_fail(self) -> None:
        """A new saga runs two steps, the latest with an undo, and fails: its chain claims
        that step's undo first (the other still waits for its outcome)."""
        self.begin(False)
        saga_id = self.sagas[-1]
        for tool in ("lookup", "plain"):
            sent = len(self.bus.messages)
            self.enqueue(self.asynchronous().index(saga_id), tool)
            if self.bus.messages[sent:] and self.bus.messages[-1][:2] == ("step", saga_id):
                self.deliver(len(self.bus.messages) - 1, False, True)
        keys = [k for k, key in enumerate(sorted(self.world.executed)) if key[0] == saga_id]
        if keys:
            self.fail_executed(keys[0])

    @precondition(lambda self: any(u.running and not u.lapsed for u in self.undos)
                  or len(self.sagas) < MAX_SAGAS)
    @rule(i=st.integers(0, 20))
    def undo_overtaken(self, i: int) -> None:
        """A running undo try (if none runs, a new saga runs two steps and fails: its
        chain claims the latest's undo) is overtaken: its lease lapses (a stalled
        worker), the chain's message comes again and claims the undo anew (a try with a
        token of its own), then the late try beats and finishes: its heartbeat, its
        outcome and the next undo's claim, asked with its stale token (on PostgreSQL the
        last two in one call of ``sagaworker_undo_next``), change nothing; the new try's
        outcome stands."""
        if not any(u.running and not u.lapsed for u in self.undos):
            self._two_then_fail()
        live = [u for u in self.undos if u.running and not u.lapsed]
        if not live:
            return
        # (one with another undo after it: a stale outcome would also claim that one)
        u = self.pick(i, [u for u in live if self._undone_before(u.saga_id, u.seq)] or live)
        self.lapse_live_undo([x for x in self.undos if x.running and not x.lapsed].index(u),
                             True)
        self.heartbeat(self.undos.index(u), True, among=self.undos)
        self.undo_step([x for x in self.undos if x.running].index(u), "ok")

    @precondition(lambda self: any(u.running and u.attempt < 1 + RETRIES for u in self.undos))
    @rule(i=st.integers(0, 20))
    def undo_released_then_beats(self, i: int) -> None:
        """An undo raises with tries left: its try is released (its lease cleared, its
        token kept), and its worker's heartbeat, which read what it holds just before the
        release, beats right after it. The released try holds no lease, and its retry
        (the chain's message) is claimed at once, not found busy."""
        u = self.pick(i, [u for u in self.undos if u.running and u.attempt < 1 + RETRIES])
        before = self.entry(u.saga_id, u.seq)
        ours = (before.compensation is None and before.undo_token == u.token
                and before.comp_lease_until is not None)
        u.over = True
        self.sw.machine.release_undo(u.saga_id, u.seq, u.token, "Boom")
        self.sw.machine.heartbeat([(u.saga_id, u.seq, True, u.token)])
        if ours:
            assert self.entry(u.saga_id, u.seq).comp_lease_until is None, (
                "a released undo try's late heartbeat took its lease back")
        token = new_token()
        state = self.sw.machine.claim_undo(u.saga_id, token)
        if ours:
            assert state.state is not UndoClaim.BUSY, (
                "the retry of a released undo try was found busy (its lease held)")
        self._claimed(u.saga_id, state, token)
