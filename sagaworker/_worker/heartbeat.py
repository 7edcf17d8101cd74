"""The heartbeat: keeps the leases of running attempts and undos fresh."""

from __future__ import annotations

import os
import threading
import time

from .._journal.machine import Held
from .._journal.runtime import Runtime
from .._observe.logging import get_logger

__all__ = ["Heartbeat"]

log = get_logger()


class Heartbeat:
    """Keeps the leases of running attempts and undos fresh, so a long tool or undo is
    never taken for dead (and never run a second time beside itself).

    One daemon thread per process, started on first use and again after a fork (prefork
    children inherit no threads). Each lease is held by its token: a beat for an attempt
    that has released or been fenced out matches nothing.
    """

    def __init__(self, rt: Runtime) -> None:
        self.rt = rt
        self.held: set[Held] = set()
        self.lock = threading.Lock()
        self.pid = 0

    def hold(self, item: Held) -> None:
        with self.lock:
            self.held.add(item)
            if self.pid != os.getpid():
                self.pid = os.getpid()
                threading.Thread(target=self._beat, daemon=True,
                                 name="sagaworker-heartbeat").start()

    def drop(self, item: Held) -> None:
        with self.lock:
            self.held.discard(item)

    def _beat(self) -> None:
        me = os.getpid()
        while self.pid == me:
            time.sleep(max(self.rt.settings.lease_seconds / 3, 0.2))
            with self.lock:
                held = sorted(self.held)
            if held:
                try:
                    self.rt.machine.heartbeat(held)
                except Exception as exc:  # the next beat tries again
                    log.warning("heartbeat_failed", error=str(exc)[:200])
