"""What the parts of sagaworker share: settings, the registry, the journal, the state
machine and the message bus. ``_core`` assembles one; every part is handed it, so no part
imports another's owner (no import circles).

Neither the store nor a move: it makes the journal (``_journal``) and the machine over it
(``_machine``), so it stands on a floor of its own above both, and below every part it is
handed to (the producer, the worker, recovery)."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any, Protocol

from ._base.crypto import Cipher, attach, cipher_of
from ._base.errors import ConfigurationError, JournalUnavailable
from ._base.registry import Registry
from ._base.settings import Settings
from ._journal.dialect import make_engine
from ._journal.readiness import check_journal, check_keys, unreachable
from ._journal.repository import Journal
from ._journal.urls import masked, scrubbed
from ._machine.machine import Machine

__all__ = ["Bus", "Runtime"]


class Bus(Protocol):
    """The messages sagaworker sends (implemented on Celery by ``_messages.CeleryBus``)."""

    def publish_step(self, saga_id: str, seq: int, tool: str, args: list[Any],
                     kwargs: dict[str, Any], task_id: str, queue: str | None, *,
                     retries: int = 0, countdown: float | None = None) -> bool: ...

    def send_failure(self, saga_id: str, reason: str) -> None: ...

    def send_compensate(self, saga_id: str, *, countdown: float | None = None) -> None: ...

    def send_advance(self, saga_id: str, *, countdown: float | None = None) -> None: ...

    def queue_of(self, tool: str, queue: str | None) -> str | None: ...

    def ready(self, queues: set[str]) -> dict[str, int]: ...


class Runtime:
    """The shared parts; the journal's engine is made on first use (after a fork too)."""

    def __init__(self, settings: Settings, registry: Registry, bus: Bus) -> None:
        self.settings = settings
        self.registry = registry
        self.bus = bus
        #: SAGAWORKER_ENCRYPTION_KEYS (None: the journal is written in clear); attached to
        #: this runtime's engine only, so several Sagaworkers in a process keep their keys
        self.cipher: Cipher | None = cipher_of(settings.encryption_keys)
        self._engine: Any = None
        self._journal: Journal | None = None
        self._machine: Machine | None = None
        self._lock = threading.Lock()

    @property
    def journal_made(self) -> bool:
        """The journal is made (its first use, which connects, is behind)."""
        return self._journal is not None

    @property
    def journal(self) -> Journal:
        if self._journal is None:
            with self._lock:
                if self._journal is None:
                    url = self.settings.database_url
                    try:
                        engine = make_engine(url)
                    except Exception as exc:  # not a URL, or no driver for it
                        raise JournalUnavailable(
                            f"SAGAWORKER_DATABASE_URL {masked(url)} is not a database URL "
                            f"SQLAlchemy can use ({type(exc).__name__}: "
                            f"{scrubbed(str(exc), url)}); write it as "
                            "postgresql+psycopg://USER@HOST/DB or sqlite:///PATH") from None
                    journal = Journal(engine)
                    sqlite = engine.dialect.name == "sqlite"
                    try:
                        if sqlite:
                            # the embedded default sets itself up; real databases
                            # migrate with `sagaworker db upgrade`
                            journal.create_all()
                        # a mistake is named now, in one line, never as a raw SQL
                        # error in the middle of a request; checked again next time
                        check_journal(engine, url, made_here=sqlite)
                        check_keys(engine, self.cipher)
                    except ConfigurationError:
                        engine.dispose()
                        raise
                    except Exception as exc:  # a folder that does not exist, say
                        engine.dispose()
                        raise unreachable(url, exc) from None
                    attach(engine, self.cipher)
                    self._engine = engine
                    self._machine = Machine(journal, self.settings)
                    self._journal = journal
        return self._journal

    @property
    def machine(self) -> Machine:
        self.journal  # noqa: B018 - makes the engine
        assert self._machine is not None
        return self._machine

    def configure(self, settings: Settings) -> None:
        """New settings for every part (the machine reads its leases and caps from them)."""
        self.settings = settings
        self.cipher = cipher_of(settings.encryption_keys)
        if self._engine is not None:
            attach(self._engine, self.cipher)
        if self._machine is not None:
            self._machine.settings = settings

    def use(self, journal: Journal, settings: Settings | None = None) -> None:
        """Point at another journal (the testing harness's in-memory one)."""
        with self._lock:
            if settings is not None:
                self.settings = settings
                self.cipher = cipher_of(settings.encryption_keys)
            self._engine, self._journal = journal.engine, journal
            attach(self._engine, self.cipher)
            self._machine = Machine(journal, self.settings)

    @contextlib.contextmanager
    def borrowed(self, journal: Journal, settings: Settings, bus: Bus) -> Iterator[None]:
        """Point at another journal, settings and bus for a while (the testing harness's
        throwaway journal); everything is as it was afterwards."""
        with self._lock:
            saved = (self._engine, self._journal, self._machine, self.settings, self.bus)
        self.use(journal, settings)
        self.bus = bus
        try:
            yield
        finally:
            with self._lock:
                (self._engine, self._journal, self._machine, self.settings,
                 self.bus) = saved

    def reset_engine(self) -> None:
        """Forget the journal's engine: the next use makes one from the settings."""
        with self._lock:
            if self._engine is not None:
                self._engine.dispose()
            self._engine = self._journal = self._machine = None

    def dispose_engine(self) -> None:
        """After a fork: never share the parent's pooled connections."""
        if self._engine is not None:
            self._engine.dispose(close=False)
