"""Adversarial review of the asyncio twins and call ids, on a real
PostgreSQL journal, no workers: each test states the behaviour the contract asks for and
fails on the defect it names."""

from __future__ import annotations

import asyncio
import gc
import threading
import time
import weakref
from collections.abc import Iterator
from typing import Any

import pytest
from celery import Celery

from sagaworker import ApprovalRejected, Reversibility, Sagaworker, Settings, ToolFailed
from sagaworker._producer import aio
from tests.conftest import UNIT_SECRET, uid
from tests.integration._pgdb import execute, fresh_database

pytestmark = pytest.mark.services


@pytest.fixture(scope="module")
def url() -> Iterator[str]:
    with fresh_database("sw_review") as u:
        yield u


def make(url: str) -> tuple[Sagaworker, Any, Any]:
    """A producer whose steps are journaled, never published (another connection plays
    the worker by writing outcomes); ``thing`` plain, ``ship`` behind an approval gate."""
    sw = Sagaworker(Celery(uid("rev"), broker="memory://"),
                    settings=Settings(database_url=url, broker_url="memory://",
                                      approval_secret=UNIT_SECRET))

    @sw.tool()
    def thing(x: int) -> int:
        return x

    @sw.tool(reversibility=Reversibility.IRREVERSIBLE)
    def ship(order: str) -> str:
        """Ship an order (cannot be unshipped)."""
        return order

    sw.rt.bus.publish_step = lambda *a, **k: True  # type: ignore[method-assign]
    sw.rt.bus.send = lambda *a, **k: True  # type: ignore[method-assign]
    return sw, thing, ship


def executed(url: str, saga_id: str, seq: int, value: int) -> None:
    execute(url, "UPDATE sagaworker_entries SET phase = 'EXECUTED', result = to_jsonb(%s::int) "
            "WHERE saga_id = %s AND seq = %s", value, saga_id, seq)


# -- aresult(0): "the same semantics" as result(0) ----------------------------------------


@pytest.mark.parametrize("timeout", [0, 0.001])
def test_aresult_with_a_short_timeout_returns_a_settled_steps_value(url: str,
                                                                   timeout: float) -> None:
    """result(timeout) reads first and returns an outcome that is already journaled,
    whatever the timeout; aresult(timeout) must too (the same semantics as result()). It raises
    TimeoutError instead: the timeout covers the hub's registration and first read, and
    ``asyncio.timeout(0)`` cancels the wait at its first suspension, before any read."""
    sw, thing, _ = make(url)
    saga = sw.begin(uid("z"))
    step = saga.enqueue(thing, 7)
    executed(url, saga.saga_id, step.seq, 70)
    assert step.result(timeout=timeout) == 70  # the synchronous twin

    async def main() -> Any:
        return await step.aresult(timeout)

    try:
        assert asyncio.run(main()) == 70
    finally:
        sw.journal.engine.dispose()


@pytest.mark.parametrize("timeout", [0, 0.001])
def test_aresult_with_a_short_timeout_on_a_saga_listened_for_returns_its_value(
        url: str, timeout: float) -> None:
    """The same on a saga this process listens for already (a step of it was awaited a
    moment ago, as an agent's earlier tool call is): the read before the wait is skipped
    only when no timeout is given, so a settled step's value still comes back."""
    sw, thing, _ = make(url)
    saga = sw.begin(uid("zr"))
    first, second = saga.enqueue(thing, 1), saga.enqueue(thing, 2)

    async def main() -> Any:
        waiting = asyncio.ensure_future(first.aresult(30))
        await asyncio.sleep(0.3)  # the hub waits on the saga: registered
        await asyncio.to_thread(executed, url, saga.saga_id, first.seq, 10)
        assert await waiting == 10
        assert sw.journal.registered(saga.saga_id), "the saga is not listened for"
        await asyncio.to_thread(executed, url, saga.saga_id, second.seq, 20)
        return await second.aresult(timeout)

    try:
        assert asyncio.run(main()) == 20
    finally:
        sw.journal.engine.dispose()


@pytest.mark.parametrize("outcome", ["rejected", "failed"])
def test_agent_pending_raises_what_result_raises(url: str, outcome: str) -> None:
    """AgentTools.pending on a gated call whose step was rejected (or approved, then
    FAILED): "A rejected gate raises ApprovalRejected (a ToolFailed)", and the agents contract wants
    the run ended with ToolFailed in its cause chain. pending() gets that by calling
    ``step.aresult(0)`` ("raises what result() raises for it"), which raises TimeoutError
    (see above): the adapter sees a timeout, with no ToolFailed in its chain."""
    from sagaworker.agents._core import AgentTools

    sw, _, ship = make(url)
    saga = sw.begin(uid("g"))
    tools = AgentTools(saga, [ship])
    tool = next(iter(tools))

    async def main() -> None:
        assert await tools.pending(tool, "call_1", [], {"order": "o-1"}) is True
        token = next(p.token for p in await sw.apending_approvals()
                     if p.saga_id == saga.saga_id)
        if outcome == "rejected":
            await sw.areject(token, approver="ops@example.com", reason="not today")
            expected: Any = pytest.raises(ApprovalRejected, match="not today")
        else:
            await sw.aapprove(token, approver="ops@example.com")
            await asyncio.to_thread(
                execute, url, "UPDATE sagaworker_entries SET phase = 'FAILED', "
                "error = 'Boom: no' WHERE saga_id = %s", saga.saga_id)
            expected = pytest.raises(ToolFailed, match="Boom: no")
        with expected:
            await tools.pending(tool, "call_1", [], {"order": "o-1"})

    try:
        asyncio.run(main())
    finally:
        sw.journal.engine.dispose()


# -- a wait cancelled while it registers ---------------------------------------------------


def _notified_sagas(sw: Sagaworker) -> set[str]:
    n = sw.journal._notifier
    if n is None:
        return set()
    with n._lock:
        return set(n._waiting)


def _slow_registration(sw: Sagaworker, monkeypatch: pytest.MonkeyPatch, url: str) -> None:
    """The listener listening, and the registration's round trip (``_register_here``,
    run inside the watch's enter on the pool thread) taking 300 ms: a remote database,
    or one under load. Registrations are dropped 0.5 s after their last wait."""
    from sagaworker._journal import notify

    monkeypatch.setattr(notify, "KEEP_REGISTERED", 0.5)
    warm = sw.begin(uid("warm"))
    step = warm.enqueue(sw.registry.tool(f"{__name__}.thing").task, 0)

    async def warm_up() -> Any:  # a wait on a step not settled yet starts the listener
        waiting = asyncio.ensure_future(step.aresult(10))
        await asyncio.sleep(0.1)
        await asyncio.to_thread(executed, url, warm.saga_id, step.seq, 0)
        return await waiting

    assert asyncio.run(warm_up()) == 0  # the listener runs, and listens
    deadline = time.monotonic() + 10
    while not (sw.journal._notifier and sw.journal._notifier.listening):
        assert time.monotonic() < deadline
        time.sleep(0.02)
    notifier = sw.journal._notifier
    real = notifier._register_here

    def slow(saga_id: str) -> None:
        time.sleep(0.3)
        real(saga_id)

    monkeypatch.setattr(notifier, "_register_here", slow)


def _registered_rows(url: str, saga_id: str) -> int:
    import psycopg

    with psycopg.connect(url.replace("postgresql+psycopg", "postgresql")) as c:
        row = c.execute("SELECT count(*) FROM sagaworker_waiters WHERE saga_id = %s",
                        [saga_id]).fetchone()
        return int(row[0]) if row else 0


@pytest.mark.parametrize("how", ["timeout", "cancelled"])
def test_a_wait_cancelled_while_registering_leaves_no_registration(
        url: str, how: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """HOLDS (kept as a regression test). A wait cancelled (its timeout, or a client
    gone: Starlette cancels the request's task) while the hub enters its notification
    watch on the pool thread: the hub forgets the watch and nobody exits the entered
    context manager, yet nothing leaks, only because CPython closes the generator-based
    ``Notifier.watch`` (running its ``finally``) when its last reference goes. Nothing in
    the hub releases it explicitly."""
    sw, thing, _ = make(url)
    _slow_registration(sw, monkeypatch, url)
    saga = sw.begin(uid("w"))
    step = saga.enqueue(thing, 1)

    async def main() -> None:
        if how == "timeout":
            with pytest.raises(TimeoutError):
                await step.aresult(0.05)
        else:
            task = asyncio.ensure_future(step.aresult(30))
            await asyncio.sleep(0.05)  # it is registering on the pool thread
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
        hub = await aio.hub_of(sw.rt)
        assert (hub._steps, hub._watches) == ({}, {})  # the hub thinks it is clean

    try:
        asyncio.run(main())
        time.sleep(2.0)  # the enter has finished; KEEP_REGISTERED (0.5 s) has passed
        assert saga.saga_id not in _notified_sagas(sw), (
            "the cancelled wait's wake is still in the listener's table")
        assert _registered_rows(url, saga.saga_id) == 0, (
            "the saga is still registered in sagaworker_waiters")
    finally:
        sw.journal.engine.dispose()


def test_two_waits_one_cancelled_while_registering_keep_the_count(
        url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two waits on one saga X, the first (a) cancelled while its watch is entering: the
    hub pops X's watch (``_watch``'s ``except``) although the second (b) had counted on it
    (count 2 -> gone). b keeps waiting with no wake registered for X, while another
    wait on the loop (saga Y) makes the hub sleep the 1 s safety poll: X's notification
    arrives and wakes nobody, and b's outcome is seen up to SAFETY_POLL late instead of
    at once. (b's exit later releases whatever watch X then has: a third wait's.)"""
    sw, thing, _ = make(url)
    _slow_registration(sw, monkeypatch, url)
    y, x = sw.begin(uid("y")), sw.begin(uid("x"))
    on_y = y.enqueue(thing, 0)
    first, second = x.enqueue(thing, 1), x.enqueue(thing, 2)
    reads = [0]
    real = sw.journal.settled

    def counted(*a: Any) -> Any:
        got = real(*a)
        reads[0] += 1
        return got

    monkeypatch.setattr(sw.journal, "settled", counted)

    async def main() -> float:
        keep = asyncio.ensure_future(on_y.aresult(30))  # the loop waits on Y as well
        await asyncio.sleep(0.5)  # Y registered: the hub now sleeps the safety poll
        a = asyncio.ensure_future(first.aresult(30))
        await asyncio.sleep(0.05)  # a is entering X's watch (its round trip: 300 ms)
        b = asyncio.ensure_future(second.aresult(30))
        await asyncio.sleep(0.01)  # b counted on it
        a.cancel()
        with pytest.raises(asyncio.CancelledError):
            await a
        await asyncio.sleep(0.5)  # a's entering is over
        n = reads[0]
        while reads[0] == n:  # right after a read of the hub: it now sleeps up to 1 s
            await asyncio.sleep(0.005)
        t0 = time.monotonic()
        await asyncio.to_thread(executed, url, x.saga_id, second.seq, 20)
        assert await b == 20
        took = time.monotonic() - t0
        keep.cancel()
        return took

    try:
        took = asyncio.run(main())
        assert took < 0.8, f"b saw its outcome {took:.2f} s after the commit (notified: ms)"
    finally:
        sw.journal.engine.dispose()


# -- the per-loop hubs --------------------------------------------------------------------


def test_a_finished_event_loop_is_not_kept_alive_by_its_hub(url: str) -> None:
    """``_hubs`` is a WeakKeyDictionary keyed by the loop; its value (the Hub) must not hold
    the loop strongly (its loop, its task, an Event bound to the loop), or the key can
    never die: every ``asyncio.run`` that waited on a step would leave its closed loop, hub
    and runtime behind for the life of the process (a Celery task or a CLI calling
    asyncio.run each time; the worker's settle() making a new Runner after a time limit).
    The step stays pending, so each run really waits on its loop's hub (a settled step
    is answered by the first read, with no hub). A pool thread may still hold the last
    loop for a moment after its call returned: the check waits for the collection, and a
    real leak never clears."""
    sw, thing, _ = make(url)
    saga = sw.begin(uid("l"))
    step = saga.enqueue(thing, 3)
    loops: list[weakref.ref[asyncio.AbstractEventLoop]] = []

    async def main() -> None:
        loops.append(weakref.ref(asyncio.get_running_loop()))
        with pytest.raises(TimeoutError):
            await step.aresult(0.2)
        assert aio._hubs.get(asyncio.get_running_loop()), "the wait did not use a hub"

    def alive() -> int:
        gc.collect()
        return sum(r() is not None for r in loops)

    try:
        for _ in range(4):
            asyncio.run(main())
        deadline = time.monotonic() + 10
        while alive() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert alive() == 0, f"{alive()} closed loops kept alive by aio._hubs"
        assert len(aio._hubs) == 0
    finally:
        sw.journal.engine.dispose()


# -- a step that is not (or no longer) in the journal --------------------------------------


def test_aresult_on_a_pruned_saga_raises_instead_of_waiting_forever(url: str) -> None:
    """A step handle whose saga was pruned (retention), or a seq the saga never had:
    Saga.aresult says SagaNotFound ("pruned?"), but Step.aresult waits for an entry that
    can never appear (``settled`` only reports rows it finds): with timeout=None it never
    returns (here: it times out after 3 s). It should raise at once, as Saga.aresult does.
    (The synchronous result() raises AttributeError on the missing row.)"""
    from sagaworker import SagaNotFound, SagaworkerError
    from sagaworker._producer.saga import Step

    sw, thing, _ = make(url)
    saga = sw.begin(uid("p"))
    step = saga.enqueue(thing, 4)
    executed(url, saga.saga_id, step.seq, 40)
    saga.complete()
    time.sleep(0.05)
    assert sw.prune(older_than=0) >= 1  # retention removed the finished saga
    beyond = Step(sw.rt, saga.saga_id, 9, step.task_id, step.tool_name)  # no such seq

    async def main() -> None:
        with pytest.raises(SagaNotFound):
            await saga.aresult(5)  # the saga's twin: at once
        for handle in (step, beyond):
            t0 = time.monotonic()
            with pytest.raises((SagaNotFound, SagaworkerError)):
                await handle.aresult(3)
            assert time.monotonic() - t0 < 1

    try:
        asyncio.run(main())
    finally:
        sw.journal.engine.dispose()


# -- things that hold (kept as regression tests) -------------------------------------------


def test_two_loops_in_two_threads_share_the_listener(url: str) -> None:
    """Two threads, each running asyncio.run, wait on the same saga's steps: both are woken
    by the one listener, and nothing stays registered afterwards."""
    sw, thing, _ = make(url)
    saga = sw.begin(uid("t"))
    steps = [saga.enqueue(thing, i) for i in range(2)]
    got: dict[int, Any] = {}
    errors: list[BaseException] = []

    def run(i: int) -> None:
        try:
            got[i] = asyncio.run(steps[i].aresult(20))
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and not (
            sw.journal._notifier and sw.journal._notifier.notifies(saga.saga_id)
            and len(sw.journal._notifier._waiting.get(saga.saga_id, ())) == 2):
        time.sleep(0.02)
    t0 = time.monotonic()
    execute(url, "UPDATE sagaworker_entries SET phase = 'EXECUTED', result = to_jsonb(seq) "
            "WHERE saga_id = %s", saga.saga_id)
    for t in threads:
        t.join(20)
    try:
        assert not errors, errors
        assert got == {0: 1, 1: 2}
        assert time.monotonic() - t0 < 0.9  # notified, not the 1 s safety poll
        assert saga.saga_id not in _notified_sagas(sw)
    finally:
        sw.journal.engine.dispose()


def test_a_failed_step_raises_toolfailed_through_aresult(url: str) -> None:
    sw, thing, _ = make(url)
    saga = sw.begin(uid("f"))
    step = saga.enqueue(thing, 5)
    execute(url, "UPDATE sagaworker_entries SET phase = 'FAILED', error = 'Boom: x' "
            "WHERE saga_id = %s", saga.saga_id)
    try:
        with pytest.raises(ToolFailed, match="Boom: x"):
            asyncio.run(step.aresult(5))
    finally:
        sw.journal.engine.dispose()
