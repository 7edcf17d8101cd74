"""Journal writes in the application's own transaction (``connection=``).

``sw.begin``, ``sw.start`` and ``saga.enqueue`` given ``connection=`` (a SQLAlchemy
``Connection`` or ``Session`` on the journal's database) write the saga and its INTENT
rows with that connection, inside the caller's transaction: they commit or roll back with
the app's own rows. What must leave the process (a step's message, a flow's advance) is
held until that transaction commits, and dropped if it rolls back:

- a ``Session``: when its outermost transaction commits (``after_commit`` outside any
  savepoint), each message is sent once its row is visible from the journal's own
  connection, which is what tells a row that committed from one a rolled-back savepoint
  took back, and a session that owns its transaction from one joined to an outer
  transaction (whose COMMIT is still to come): the rows not visible yet go to the
  confirmer thread below. The outermost transaction's end drops what is left (a
  rollback). A savepoint's rollback drops nothing: its rows simply never show;
- a ``Connection``: SQLAlchemy has no event after a connection's COMMIT (its ``commit``
  event comes before it), so at ``commit`` the messages go to a confirmer thread that
  sends each once its row is visible from the journal's own connection (committed), and
  drops them if the row never shows (the COMMIT failed): a published message always has
  its row. ``rollback`` drops them;

Each session or connection gets its listeners once, however many transactions it runs.
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
import weakref
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

from sqlalchemy import URL, Connection, Engine, select
from sqlalchemy.exc import StatementError

if TYPE_CHECKING:  # the ORM is imported by an app that has a Session, never here
    from sqlalchemy.orm import Session

from .._base.awaiting import offload
from .._base.crypto import attach, cipher_for
from .._base.errors import ConfigurationError
from .._observe.logging import get_logger
from .schema import entries, sagas
from .urls import masked

__all__ = ["ON_COMMIT", "AppTx", "is_app_connection", "is_async_app_connection",
           "same_database", "split_connection"]

_T = TypeVar("_T")
_log = get_logger()
_PENDING = "sagaworker_after_commit"
_JOURNAL = "sagaworker_journal_engine"
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
        _check_same_database(engine, self.conn)
        cipher = cipher_for(engine)
        if cipher is not None and cipher_for(self.conn.engine) is None:
            attach(self.conn.engine, cipher)  # journal values sealed on the app's engine too
        if not self.conn.in_transaction():
            self.conn.begin()  # autobegin, as a statement would

    def run(self, body: Callable[[Connection], _T]) -> _T:
        """``body`` on the caller's connection, in a savepoint on PostgreSQL (a refused
        write, a taken saga id, leaves the app's transaction usable)."""
        try:
            if self.conn.dialect.name == "postgresql":
                with self.conn.begin_nested():
                    return body(self.conn)
            return body(self.conn)
        except StatementError as exc:
            # the app's engine quotes a statement's parameters in its errors; the journal's
            # are a tool's arguments (a card): hidden, as the journal's own engine hides them
            exc.hide_parameters = True
            raise

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
            target.info[_JOURNAL] = self.journal_engine
            _listen(target, self.session is not None)
        pending.append((send, saga_id, tuple(task_ids)))


def same_database(a: URL, b: URL) -> bool:
    """Whether two URLs name one database (the same file, or server and name)."""
    if a.get_backend_name() == "sqlite" and b.get_backend_name() == "sqlite":
        return (a.database or "") == (b.database or "")
    return (a.get_backend_name(), a.host or "localhost", a.port or 5432, a.database) == (
        b.get_backend_name(), b.host or "localhost", b.port or 5432, b.database)


#: what a PostgreSQL server says it is: its port, its start (to the microsecond) and the
#: database; the same for every spelling of its address (localhost, 127.0.0.1, ::1, a DNS
#: name), and never the same for two servers
_IDENTITY = ("SELECT inet_server_port(), pg_postmaster_start_time()::text, "
             "current_database()")
_identities: weakref.WeakKeyDictionary[Engine, Any] = weakref.WeakKeyDictionary()


def _identity(conn: Connection) -> Any:
    return tuple(conn.exec_driver_sql(_IDENTITY).one())


def _same_server(journal: Engine, app: Connection) -> bool:
    """Two URLs that differ may name one PostgreSQL database: ask both connections."""
    if journal.dialect.name != "postgresql" or app.dialect.name != "postgresql":
        return False
    try:
        if journal not in _identities:
            with journal.connect() as c:
                _identities[journal] = _identity(c)
        with app.begin_nested() if app.in_transaction() else app.begin():
            return bool(_identities[journal] == _identity(app))
    except Exception:  # (a server that cannot say: the URLs decide, as before)
        return False


def _check_same_database(journal: Engine, conn: Connection) -> None:
    a, b = journal.url, conn.engine.url
    if not same_database(a, b) and not _same_server(journal, conn):
        raise ConfigurationError(
            f"connection= is on {masked(b)}, the journal on "
            f"{masked(a)}: the saga can share a transaction "
            "only with the journal's own database; pass a connection to that database, or "
            "none (the saga then commits on its own)")


def _take(target: Any) -> list[tuple[Callable[[], None], str, tuple[str, ...]]]:
    return list(target.info.pop(_PENDING, None) or [])


def _listen(target: Any, session: bool) -> None:
    """The listeners of a session or connection, added once (module-level functions, so
    ``contains`` finds them): a long-lived session does not gain two per transaction."""
    from sqlalchemy import event

    hooks = ((("after_commit", _session_committed), ("after_transaction_end", _session_ended))
             if session else (("commit", _connection_committing),
                              ("rollback", _connection_rolled_back)))
    for name, fn in hooks:
        if not event.contains(target, name, fn):
            event.listen(target, name, fn)


def _session_committed(sess: Session) -> None:
    if sess.in_nested_transaction():
        return  # a savepoint released: nothing is committed yet
    held = _take(sess)
    if not held:
        return
    journal = sess.info[_JOURNAL]
    try:
        asyncio.get_running_loop()
    except RuntimeError:  # one look now (the common case: the session owned its
        # transaction, every row is committed); what does not show yet waits for an outer
        # COMMIT, or never comes
        held = _send_visible(journal, held)
    if held:  # (an AsyncSession's commit: the look never blocks its event loop)
        _confirm_later(journal, held)


def _session_ended(sess: Session, transaction: Any) -> None:
    if transaction.parent is None:  # the outermost: rolled back (a commit took them)
        _take(sess)


def _connection_committing(c: Connection) -> None:
    held = _take(c)
    if held:
        _confirm_later(c.info[_JOURNAL], held)


def _connection_rolled_back(c: Connection) -> None:
    _take(c)


def _confirm_later(journal: Engine,
                   held: list[tuple[Callable[[], None], str, tuple[str, ...]]]) -> None:
    threading.Thread(target=_confirm, args=(journal, held), daemon=True,
                     name="sagaworker-after-commit").start()


def _send_visible(journal: Engine, held: list[tuple[Callable[[], None], str, tuple[str, ...]]]
                  ) -> list[tuple[Callable[[], None], str, tuple[str, ...]]]:
    """Send each held message whose row is committed (visible here); the others."""
    rest = []
    with journal.connect() as c:
        for item in held:
            send, saga_id, task_ids = item
            q = (select(entries.c.task_id).where(entries.c.task_id.in_(task_ids))
                 if task_ids else
                 select(sagas.c.saga_id).where(sagas.c.saga_id == saga_id))
            if len(c.execute(q).all()) == max(1, len(task_ids)):
                _send(send)
            else:
                rest.append(item)
    return rest


def _confirm(journal: Engine,
             held: list[tuple[Callable[[], None], str, tuple[str, ...]]]) -> None:
    """Send each held message once its row is committed (visible here); after
    ``CONFIRM_FOR`` what never showed is dropped (rolled back), or left to the relay."""
    end, delay = time.monotonic() + CONFIRM_FOR, 0.002
    while held and time.monotonic() < end:
        try:
            held = _send_visible(journal, held)
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
