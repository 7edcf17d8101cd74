"""The asyncio twins' machinery: no thread per waiter, and a loop that never blocks.

Two things an awaitable call needs:

- **Short blocking calls** (a journal write, a broker publish, one read) run on a small
  thread pool of the process's own (:class:`Offload`, :data:`POOL_SIZE` threads at most,
  made on first use), never on the event loop and never on the loop's default executor
  (which the application's own ``to_thread`` calls share). The caller's context variables
  go with each call (a trace, a request id).
- **Waiting** (``Step.aresult``, ``Saga.aresult``) holds no thread at all: every call
  waiting on a loop is a future in that loop's :class:`Hub`. The hub reads, in one query,
  which of the waited steps have an outcome and which waited sagas are terminal, resolves
  those futures, and sleeps until the journal says something changed: on PostgreSQL the
  process's one listener (``LISTEN/NOTIFY``, :mod:`.._journal.notify`, shared with the
  synchronous waits) wakes it through ``call_soon_threadsafe``, and it still reads every
  ``SAFETY_POLL`` seconds; on SQLite (no notifications) it reads on the synchronous
  calls' backoff (5 ms growing to 50 ms), one query for all the loop's waits. A thousand
  concurrent waits hold one listener thread and, while the hub reads, one pool thread.
"""

from __future__ import annotations

import asyncio
import contextlib
import weakref
from contextlib import AbstractContextManager
from typing import Any, TypeVar

from .._base.awaiting import POOL_SIZE, Offload, offload
from .._journal.notify import FIRST_DELAY, MAX_DELAY, SAFETY_POLL, Wake
from .._observe.logging import get_logger
from .._runtime import Runtime

__all__ = ["POOL_SIZE", "Hub", "Offload", "WaitEnded", "hub_of", "offload", "wait_for"]

_T = TypeVar("_T")
_log = get_logger()

class _LoopWake(Wake):
    """A notification for a waited saga pokes the loop's hub (from the listener thread)."""

    def __init__(self, hub: Hub) -> None:
        super().__init__(None)
        self._hub = hub

    def set(self) -> None:
        loop = self._hub.loop
        if loop is not None:
            with contextlib.suppress(RuntimeError):  # the loop was closed meanwhile
                loop.call_soon_threadsafe(self._hub.poke)


class _Watch:
    """One saga's registration for notifications, shared by the loop's waits on it."""

    def __init__(self, cm: AbstractContextManager[Wake], wake: Wake,
                 entered: asyncio.Future[Wake]) -> None:
        self.cm, self.wake, self.entered, self.count = cm, wake, entered, 0

    def leave(self, entered: asyncio.Future[Wake]) -> None:
        """Undo the registration once made (a lock and a dict: no round trip)."""
        if not entered.cancelled() and entered.exception() is None:
            self.cm.__exit__(None, None, None)


class Hub:
    """Every ``aresult`` waiting on one event loop for one journal.

    An idle hub holds its loop only weakly (no task, no future, no Event bound to it): it
    is the value of a WeakKeyDictionary keyed by that loop, so a strong reference would
    keep every finished loop (and its hub) alive for the life of the process."""

    def __init__(self, rt: Runtime, loop: asyncio.AbstractEventLoop) -> None:
        self.rt, self._loop = rt, weakref.ref(loop)
        #: the waits on a step, answered with its entry row (the hub's read brings it)
        self._steps: dict[tuple[str, int], set[asyncio.Future[Any]]] = {}
        self._sagas: dict[str, set[asyncio.Future[Any]]] = {}
        #: per waited saga: its notification registration, and how many wait on it
        self._watches: dict[str, _Watch] = {}
        self._poked = False
        self._wakeup: asyncio.Future[None] | None = None  # only while _run sleeps
        self._task: asyncio.Task[None] | None = None

    @property
    def loop(self) -> asyncio.AbstractEventLoop | None:
        return self._loop()

    def poke(self) -> None:
        self._poked = True
        if self._wakeup is not None and not self._wakeup.done():
            self._wakeup.set_result(None)

    async def wait_step(self, saga_id: str, seq: int) -> Any:
        """The step's entry row once it has an outcome (cancel it for a timeout)."""
        return await self._wait(self._steps, (saga_id, seq), saga_id)

    async def wait_saga(self, saga_id: str) -> None:
        """Returns once the saga is terminal (or not in the journal)."""
        await self._wait(self._sagas, saga_id, saga_id)

    async def _wait(self, table: dict[Any, set[asyncio.Future[Any]]], key: Any,
                    saga_id: str) -> Any:
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[Any] = loop.create_future()
        table.setdefault(key, set()).add(fut)
        try:
            watch = self._watch(saga_id)
            # a cancelled wait leaves the registration to finish, then to be undone
            await asyncio.shield(watch.entered)
            if self._task is None or self._task.done():
                self._task = loop.create_task(self._run(), name="sagaworker-aresult")
                self._task.add_done_callback(self._ran)
            self.poke()
            return await fut
        finally:
            waiting = table.get(key)
            if waiting is not None:
                waiting.discard(fut)
                if not waiting:
                    del table[key]
            self._unwatch(saga_id)

    def _watch(self, saga_id: str) -> _Watch:
        """Count one more wait on the saga; the first registers it for notifications
        (one round trip: on the pool, not the loop)."""
        watch = self._watches.get(saga_id)
        if watch is None:
            wake = _LoopWake(self)
            # registered already: a lock and a dict, on the loop, never a round trip here
            # (a registration that expired meanwhile is made again by the listener's thread)
            on_loop = self.rt.journal.registered(saga_id)
            cm = self.rt.journal.watch(saga_id, wake, register_here=not on_loop)
            if on_loop:
                entered: asyncio.Future[Wake] = asyncio.get_running_loop().create_future()
                entered.set_result(cm.__enter__())
            else:
                entered = asyncio.ensure_future(offload(cm.__enter__))
            watch = self._watches[saga_id] = _Watch(cm, wake, entered)
        watch.count += 1
        return watch

    def _unwatch(self, saga_id: str) -> None:
        watch = self._watches.get(saga_id)
        if watch is None:
            return
        watch.count -= 1
        if watch.count > 0:
            return
        del self._watches[saga_id]
        watch.entered.add_done_callback(watch.leave)  # at once if entered already

    def _listening(self) -> bool:
        return bool(self._watches) and all(w.wake.listening for w in self._watches.values())

    def _ran(self, task: asyncio.Task[None]) -> None:
        if self._task is task:
            self._task = None

    async def _run(self) -> None:
        try:
            await self._reads()
        finally:
            self._wakeup = None

    async def _reads(self) -> None:
        delay = FIRST_DELAY
        loop = asyncio.get_running_loop()
        while self._steps or self._sagas:
            self._poked = False  # before the read: a change committed after it pokes again
            steps, sagas = list(self._steps), list(self._sagas)
            try:
                done_steps, done_sagas = await offload(self.rt.journal.settled, steps, sagas)
            except Exception as exc:  # the database away: the waits keep waiting, and retry
                _log.warning("aresult_read_failed",
                             error=f"{type(exc).__name__}: {str(exc)[:200]}")
                done_steps, done_sagas = {}, set()
            for key, row in done_steps.items():
                for fut in self._steps.get(key, ()):
                    if fut.done():
                        continue
                    if isinstance(row, Exception):  # that row could not be opened
                        fut.set_exception(row)
                    else:
                        fut.set_result(row)
            for saga_id in done_sagas:
                for fut in self._sagas.get(saga_id, ()):
                    if not fut.done():
                        fut.set_result(None)
            if self._poked:
                continue
            pause = SAFETY_POLL if self._listening() else delay
            self._wakeup = loop.create_future()
            try:
                await asyncio.wait_for(self._wakeup, pause)
            except TimeoutError:
                delay = min(delay * 1.5, MAX_DELAY)
            finally:
                self._wakeup = None


_hubs: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, dict[int, Hub]] = (
    weakref.WeakKeyDictionary())


async def hub_of(rt: Runtime) -> Hub:
    """The running loop's hub for this runtime's journal (made off the loop: the first
    use of a journal connects and checks its schema)."""
    if rt.journal_made is False:
        await offload(lambda: rt.journal)
    loop = asyncio.get_running_loop()
    per_loop = _hubs.setdefault(loop, {})
    hub = per_loop.get(id(rt))
    if hub is None or hub.rt is not rt:
        hub = per_loop[id(rt)] = Hub(rt, loop)
    return hub


async def wait_for(awaitable: Any, timeout: float | None, what: str) -> Any:
    """``awaitable``'s value within ``timeout`` seconds, else the synchronous calls'
    TimeoutError."""
    try:
        async with asyncio.timeout(timeout):
            return await awaitable
    except TimeoutError:
        raise timed_out(what, timeout) from None


class WaitEnded(TimeoutError):
    """A wait's TimeoutError: ``what`` did not finish within ``timeout`` seconds."""

    what: str = ""
    timeout: float | None = None


def timed_out(what: str, timeout: float | None) -> TimeoutError:
    """A wait's TimeoutError, saying what is true: the wait ended, the work did not."""
    exc = WaitEnded(
        f"{what} did not finish within {timeout} s. Only the wait ended: the saga goes on "
        "(a queued step still runs, a running one finishes, a gate still waits). Wait "
        "again (result()/wait()), or fail the saga to have its steps undone "
        "(saga.fail(reason), or `sagaworker abort SAGA_ID --reason ...`)")
    exc.what, exc.timeout = what, timeout  # (attributes, not arguments: it pickles)
    return exc
