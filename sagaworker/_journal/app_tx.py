"""Journal writes in the application's own transaction (``connection=``).

``sw.begin``, ``sw.start`` and ``saga.enqueue`` given ``connection=`` (a SQLAlchemy
``Connection`` or ``Session`` on the journal's database) write the saga and its INTENT
rows with that connection, inside the caller's transaction: they commit or roll back with
the app's own rows. What must leave the process (a step's message, a flow's advance) is
held until that transaction commits, and dropped if it rolls back:

- a ``Session``: its ``after_commit`` event sends them; ``after_rollback`` drops them;
- a ``Connection``: SQLAlchemy has no event after a connection's COMMIT (its ``commit``
  event comes before it), so at ``commit`` the messages go to a confirmer thread that
  sends each once its row is visible from the journal's own connection (committed), and
  drops them if the row never shows (the COMMIT failed): a published message always has
  its row. ``rollback`` drops them;
- a ``Connection`` whose transaction a framework owns (``info[ON_COMMIT]``, set by
  ``sagaworker.contrib.django``): each message goes to that framework's own hook (Django's
  ``transaction.on_commit``), which runs it after the COMMIT and forgets it on a rollback.

A process that dies between the COMMIT and the sending leaves INTENT rows without a
message: the outbox relay sends them (``SAGAWORKER_RELAY_AFTER``), as for any publish the
broker refused; a flow never advanced is re-advanced by the sweeper.
"""

from __future__ import annotations

import asyncio
import functools
import sys
import threading
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

from sqlalchemy import URL, Connection, Engine, select

if TYPE_CHECKING:  # the ORM is imported by an app that has a Session, never here
    from sqlalchemy.orm import Session

from .._base.awaiting import offload
from .._base.crypto import attach, cipher_for
from .._base.errors import ConfigurationError
from .._observe.logging import get_logger
from .schema import entries, sagas

__all__ = ["ON_COMMIT", "AppTx", "is_app_connection", "is_async_app_connection",
           "same_database", "split_connection"]

_T = TypeVar("_T")
_log = get_logger()
_PENDING = "sagaworker_after_commit"
#: how long the confirmer looks for a committed row before leaving it to the relay
CONFIRM_FOR = 10.0
#: in a Connection's ``info``: ``hook(send)`` runs ``send`` after the COMMIT of a
#: transaction a framework owns (SQLAlchemy neither begins nor ends it, so its events
#: never fire), and never if it rolls back
ON_COMMIT = "sagaworker_on_commit"


def is_app_connection(value: Any) -> bool:
    """A SQLAlchemy connection or session (a tool's argument is JSON, never one of these)."""
    return isinstance(value, Connection) or _is_session(value)


def _is_session(value: Any) -> bool:
    """A SQLAlchemy ORM ``Session`` (the ORM imported only if the app uses it: a worker
    never pays for it)."""
    orm = sys.modules.get("sqlalchemy.orm")
    return orm is not None and isinstance(value, orm.Session)


def is_async_app_connection(value: Any) -> bool:
    """A SQLAlchemy ``AsyncConnection`` or ``AsyncSession`` (its module imported only if
    the app uses it)."""
    return type(value).__module__.startswith("sqlalchemy.ext.asyncio") and hasattr(
        value, "run_sync")


def split_connection(kwargs: dict[str, Any]) -> Any:
    """Take ``connection=`` out of a call's keyword arguments when it is the app's
    transaction (a tool's or a flow's own ``connection`` argument, JSON, stays)."""
    value = kwargs.get("connection")
    if is_app_connection(value) or is_async_app_connection(value):
        return kwargs.pop("connection")
    return None


class AppTx:
    """The caller's transaction, as the journal writes in it."""

    def __init__(self, engine: Engine, connection: Connection | Session) -> None:
        if not is_app_connection(connection):
            raise ConfigurationError(
                f"connection={connection!r}: give a SQLAlchemy Connection or Session on the "
                "journal's database (an AsyncConnection or AsyncSession to the async calls)")
        self.journal_engine = engine
        self.session: Session | None = None
        if isinstance(connection, Connection):
            self.conn = connection
        else:
            self.session = connection
            self.conn = connection.connection()
        _check_same_database(engine, self.conn.engine)
        cipher = cipher_for(engine)
        if cipher is not None and cipher_for(self.conn.engine) is None:
            attach(self.conn.engine, cipher)  # journal values sealed on the app's engine too
        if not self.conn.in_transaction():
            self.conn.begin()  # autobegin, as a statement would

    def run(self, body: Callable[[Connection], _T]) -> _T:
        """``body`` on the caller's connection, in a savepoint on PostgreSQL (a refused
        write, a taken saga id, leaves the app's transaction usable)."""
        if self.conn.dialect.name == "postgresql":
            with self.conn.begin_nested():
                return body(self.conn)
        return body(self.conn)

    def after_commit(self, send: Callable[[], None], *, saga_id: str,
                     task_ids: Sequence[str] = ()) -> None:
        """``send`` once the caller's transaction committed, never if it rolled back."""
        hook = self.conn.info.get(ON_COMMIT)
        if hook is not None:
            hook(functools.partial(_send, send))
            return
        target: Any = self.session if self.session is not None else self.conn
        pending: list[tuple[Callable[[], None], str, tuple[str, ...]]] | None = (
            target.info.get(_PENDING))
        if pending is None:
            pending = target.info[_PENDING] = []
            if self.session is not None:
                _on_session(self.session)
            else:
                _on_connection(self.conn, self.journal_engine)
        pending.append((send, saga_id, tuple(task_ids)))


def same_database(a: URL, b: URL) -> bool:
    """Whether two URLs name one database (the same file, or server and name)."""
    if a.get_backend_name() == "sqlite" and b.get_backend_name() == "sqlite":
        return (a.database or "") == (b.database or "")
    return (a.get_backend_name(), a.host or "localhost", a.port or 5432, a.database) == (
        b.get_backend_name(), b.host or "localhost", b.port or 5432, b.database)


def _check_same_database(journal: Engine, app: Engine) -> None:
    a, b = journal.url, app.url
    if not same_database(a, b):
        raise ConfigurationError(
            f"connection= is on {b.render_as_string(hide_password=True)}, the journal on "
            f"{a.render_as_string(hide_password=True)}: the saga can share a transaction "
            "only with the journal's own database; pass a connection to that database, or "
            "none (the saga then commits on its own)")


def _take(target: Any) -> list[tuple[Callable[[], None], str, tuple[str, ...]]]:
    return list(target.info.pop(_PENDING, None) or [])


def _on_session(session: Session) -> None:
    from sqlalchemy import event

    def committed(sess: Session) -> None:
        for send, _saga, _ids in _take(sess):
            _send(send)

    def rolled_back(sess: Session) -> None:
        _take(sess)

    event.listen(session, "after_commit", committed)
    event.listen(session, "after_rollback", rolled_back)


def _on_connection(conn: Connection, journal: Engine) -> None:
    from sqlalchemy import event

    def committing(c: Connection) -> None:
        held = _take(c)
        if held:
            threading.Thread(target=_confirm, args=(journal, held), daemon=True,
                             name="sagaworker-after-commit").start()

    def rolled_back(c: Connection) -> None:
        _take(c)

    event.listen(conn, "commit", committing)
    event.listen(conn, "rollback", rolled_back)


def _confirm(journal: Engine,
             held: list[tuple[Callable[[], None], str, tuple[str, ...]]]) -> None:
    """Send each held message once its row is committed (visible here)."""
    end, delay = time.monotonic() + CONFIRM_FOR, 0.002
    while held and time.monotonic() < end:
        try:
            with journal.connect() as c:
                rest = []
                for item in held:
                    send, saga_id, task_ids = item
                    q = (select(entries.c.task_id).where(entries.c.task_id.in_(task_ids))
                         if task_ids else
                         select(sagas.c.saga_id).where(sagas.c.saga_id == saga_id))
                    if len(c.execute(q).all()) == max(1, len(task_ids)):
                        send()
                    else:
                        rest.append(item)
                held = rest
        except Exception as exc:  # the relay sends what is left
            _log.warning("after_commit_failed", error=f"{type(exc).__name__}: {exc}")
            return
        if held:
            time.sleep(delay)
            delay = min(delay * 2, 0.1)


def _send(send: Callable[[], None]) -> None:
    """Send now; from an event loop (an ``AsyncSession``'s commit), on sagaworker's pool."""
    try:
        loop = asyncio.get_running_loop()
    except RuntimeError:
        loop = None
    try:
        if loop is None:
            send()
        else:
            loop.run_in_executor(offload.pool(), send)
    except Exception as exc:  # the relay sends it
        _log.warning("after_commit_failed", error=f"{type(exc).__name__}: {exc}")
