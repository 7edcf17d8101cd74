"""The heartbeat: keeps the leases of running attempts and undos fresh."""

from __future__ import annotations

import os
import threading
import time

from .._machine.machine import Held
from .._observe.logging import get_logger
from .._runtime import Runtime

__all__ = ["Heartbeat"]

log = get_logger()


class Heartbeat:
    """Keeps the leases of running attempts and undos fresh, so a long tool or undo is
    never taken for dead (and never run a second time beside itself).

    One daemon thread per process, started on first use and again after a fork (prefork
    children inherit no threads). Each lease is held by its token: a beat for an attempt
    that has released or been fenced out matches nothing. An item held with a ``lease``
    of its own (an agent's model request: SAGAWORKER_UNIT_LEASE) is beaten three times a
    lease, the others three times SAGAWORKER_REDELIVER_AFTER.
    """

    def __init__(self, rt: Runtime) -> None:
        self.rt = rt
        self.held: set[Held] = set()
        #: items held on a lease of their own: its length
        self.short: dict[Held, float] = {}
        self.lock = threading.Lock()
        self.wake = threading.Event()
        self.pid = 0

    def hold(self, item: Held, *, lease: float | None = None) -> None:
        with self.lock:
            if lease is None:
                self.held.add(item)
            else:
                self.short[item] = lease
                self.wake.set()  # (the thread may sleep a long lease's third)
            if self.pid != os.getpid():
                self.pid = os.getpid()
                threading.Thread(target=self._beat, daemon=True,
                                 name="sagaworker-heartbeat").start()

    def drop(self, item: Held) -> None:
        with self.lock:
            self.held.discard(item)
            self.short.pop(item, None)

    def _beat(self) -> None:
        me = os.getpid()
        long_lease = self.rt.settings.lease_seconds
        last = time.monotonic()
        while self.pid == me:
            with self.lock:
                shortest = min(self.short.values(), default=long_lease)
            self.wake.wait(max(min(shortest, long_lease) / 3, 0.2))
            self.wake.clear()
            with self.lock:
                short = sorted(self.short.items())
                held = sorted(self.held) if time.monotonic() - last >= max(
                    long_lease / 3, 0.2) else []
            if held:
                last = time.monotonic()
            try:
                if held:
                    self.rt.machine.heartbeat(held)
                for item, lease in short:
                    self.rt.machine.heartbeat([item], lease=lease)
            except Exception as exc:  # the next beat tries again
                log.warning("heartbeat_failed", error=str(exc)[:200])
