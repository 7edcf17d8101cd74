"""Between threads and event loops: ``async def`` tools and undos run to completion on
the worker, and the awaitable calls' blocking parts run on a pool of sagaworker's own.

A worker's pool slot (a prefork child, a thread) keeps one event loop of its own
(:class:`asyncio.Runner`), so an async client cached by the tool's module (an
``httpx.AsyncClient``, a database pool) stays bound to a loop that lives on. Each run
gets the calling thread's context variables (the step's idempotency key, the
compensation context), as a synchronous tool would. Retries, time limits and leases
are the worker's as for any tool: the coroutine runs inside the same call.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import functools
import inspect
import os
import threading
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

__all__ = ["POOL_SIZE", "Offload", "offload", "settle"]

_R = TypeVar("_R")

_local = threading.local()


def settle(value: Any) -> Any:
    """``value``, or what it resolves to when it is awaitable (run on this thread's loop).

    The run ends with the coroutine: tasks it started and left running are cancelled
    (as ``asyncio.run`` does), so none of them acts after the step's outcome or its undo;
    so is the coroutine itself when a time limit's exception interrupted it (a signal).
    The loop stays, with the clients bound to it."""
    if not inspect.isawaitable(value):
        return value
    runner: asyncio.Runner | None = getattr(_local, "runner", None)
    if runner is None or getattr(_local, "pid", None) != os.getpid():
        runner = _local.runner = asyncio.Runner()
        _local.pid = os.getpid()
    coro = value if inspect.iscoroutine(value) else _wrap(value)
    try:
        return runner.run(coro, context=contextvars.copy_context())
    finally:
        _cancel_leftovers(runner)


#: how long tasks a run left behind get to unwind once cancelled
UNWIND_FOR = 5.0


def _cancel_leftovers(runner: asyncio.Runner) -> None:
    loop = runner.get_loop()
    left = [t for t in asyncio.all_tasks(loop) if not t.done()]
    if not left:
        return
    for t in left:
        t.cancel()
    try:
        loop.run_until_complete(asyncio.wait(left, timeout=UNWIND_FOR))
    except BaseException:  # interrupted again (a hard limit): the next run starts afresh
        _drop(runner)
        raise
    if any(not t.done() for t in left):  # one ignored its cancellation
        _drop(runner)


def _drop(runner: asyncio.Runner) -> None:
    _local.runner = None
    with contextlib.suppress(BaseException):  # what is left of it goes with it
        runner.close()


async def _wrap(value: Awaitable[Any]) -> Any:
    return await value


#: the most threads the awaitable calls' blocking parts use at once, per process
POOL_SIZE = 4


class Offload:
    """The process's pool for the blocking part of an awaitable call (re-made after a fork)."""

    def __init__(self, size: int = POOL_SIZE) -> None:
        self.size = size
        self._pool: ThreadPoolExecutor | None = None
        self._pid = 0
        self._lock = threading.Lock()

    def pool(self) -> ThreadPoolExecutor:
        if self._pool is None or self._pid != os.getpid():
            with self._lock:
                if self._pool is None or self._pid != os.getpid():
                    self._pool = ThreadPoolExecutor(self.size,
                                                    thread_name_prefix="sagaworker-aio")
                    self._pid = os.getpid()
        return self._pool

    async def __call__(self, fn: Callable[..., _R], /, *args: Any, **kwargs: Any) -> _R:
        loop = asyncio.get_running_loop()
        ctx = contextvars.copy_context()
        return await loop.run_in_executor(self.pool(),
                                          functools.partial(ctx.run, fn, *args, **kwargs))


#: the one pool of this process
offload = Offload()
