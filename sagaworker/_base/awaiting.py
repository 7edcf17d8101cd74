"""``async def`` tools and undos run to completion on the worker.

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
import inspect
import os
import threading
from collections.abc import Awaitable
from typing import Any

__all__ = ["settle"]

_local = threading.local()


def settle(value: Any) -> Any:
    """``value``, or what it resolves to when it is awaitable (run on this thread's loop)."""
    if not inspect.isawaitable(value):
        return value
    runner: asyncio.Runner | None = getattr(_local, "runner", None)
    if runner is None or getattr(_local, "pid", None) != os.getpid():
        runner = _local.runner = asyncio.Runner()
        _local.pid = os.getpid()
    coro = value if inspect.iscoroutine(value) else _wrap(value)
    try:
        return runner.run(coro, context=contextvars.copy_context())
    except BaseException:
        # a time limit's exception arrives from a signal, with the task still pending:
        # the next run starts on a loop with nothing of this one left
        if any(not t.done() for t in asyncio.all_tasks(runner.get_loop())):
            _local.runner = None
            with contextlib.suppress(BaseException):  # the loop is dropped either way
                runner.close()
        raise


async def _wrap(value: Awaitable[Any]) -> Any:
    return await value
