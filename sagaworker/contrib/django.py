"""Sagas in Django's own transaction: ``transaction.atomic()`` on Django's connection.

    from django.db import transaction
    from sagaworker.contrib.django import start

    with transaction.atomic():
        order = Order.objects.create(...)
        start(sw, f"order-{order.pk}", place_order, order.pk)

``begin``, ``start``, ``enqueue`` and ``enqueue_many`` write the saga and its INTENT rows
with Django's own connection, in a savepoint inside the open ``atomic()`` block: they
commit or roll back with the app's rows. What must leave the process (a step's message, a
flow's advance) goes to ``transaction.on_commit``: sent after the COMMIT, dropped if the
block (or an inner ``atomic()`` around the call) rolls back. A process that dies between
the COMMIT and the send leaves INTENT rows without a message: the outbox relay sends them
(``SAGAWORKER_RELAY_AFTER``) and the sweeper advances the flow.

Outside ``atomic()`` there is no transaction to share (Django commits each statement on
its own): the calls refuse, as they do on a Django database other than the journal's.
PostgreSQL only (psycopg 3, Django's default driver when it is installed).

``settings_from_django()`` reads the ``SAGAWORKER_*`` Django settings (the names of the
environment variables) and puts the journal in the Django database unless
``SAGAWORKER_DATABASE_URL`` says otherwise; ``sagaworker db upgrade`` creates its tables
there, beside ``manage.py migrate``.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import Any

from pydantic import ValidationError
from sqlalchemy import URL, Connection, Engine, create_engine
from sqlalchemy.dialects import registry
from sqlalchemy.dialects.postgresql.psycopg import PGDialect_psycopg
from sqlalchemy.pool import NullPool

from .._base.errors import ConfigurationError
from .._base.settings import Settings
from .._core.sagaworker import Sagaworker
from .._journal.app_tx import ON_COMMIT, same_database
from .._journal.urls import masked
from .._producer.saga import Saga, Step

try:
    from django.conf import settings as django_settings
    from django.core.exceptions import ImproperlyConfigured
    from django.db import DEFAULT_DB_ALIAS, connections, transaction
    from django.utils.connection import ConnectionDoesNotExist
except ImportError as exc:
    raise ConfigurationError(
        f"sagaworker.contrib.django needs Django ({exc}); install the extra: "
        "pip install 'sagaworker[django]'") from None

__all__ = ["begin", "enqueue", "enqueue_many", "settings_from_django", "start"]

#: Django's own connection options, not libpq's: left out of the journal's URL
_DJANGO_OPTIONS = frozenset({"assume_role", "context", "cursor_factory", "isolation_level",
                             "pool", "prepare_threshold", "server_side_binding"})
_DRIVER = "sagaworker_django"


class DjangoConnectionDialect(PGDialect_psycopg):
    """psycopg's dialect on the connection Django holds: the transaction is Django's (no
    COMMIT or ROLLBACK goes out from here, only the journal's savepoint), the connection
    is Django's to close, and nothing is attached to it (no notice handler)."""

    supports_statement_cache = True  # psycopg's statements, compiled as psycopg's dialect

    def do_commit(self, dbapi_connection: Any) -> None:
        pass

    def do_rollback(self, dbapi_connection: Any) -> None:
        pass  # the journal's savepoint rolls back with ROLLBACK TO, not this

    def do_close(self, dbapi_connection: Any) -> None:
        pass

    def do_terminate(self, dbapi_connection: Any) -> None:
        pass

    def on_connect(self) -> None:
        return None


registry.register(f"postgresql.{_DRIVER}", __name__, "DjangoConnectionDialect")


# -- the Django database and the settings ------------------------------------------------

def _settings_dict(using: str) -> dict[str, Any]:
    try:
        wrapper = connections[using]
    except ImproperlyConfigured as exc:
        raise ConfigurationError(
            f"Django's settings are not configured ({exc}); set DJANGO_SETTINGS_MODULE (as "
            "manage.py does) before building the Sagaworker") from None
    except ConnectionDoesNotExist:
        raise ConfigurationError(f"no Django database {using!r} in DATABASES; pass using= "
                                 "the alias of the database that holds your rows") from None
    if wrapper.vendor != "postgresql":
        raise ConfigurationError(
            f"the Django database {using!r} is {wrapper.vendor}: sagaworker.contrib.django "
            "works with PostgreSQL only. Elsewhere, give the journal its own "
            "SAGAWORKER_DATABASE_URL and call sw.begin / sw.start (the saga then commits on "
            "its own)")
    from django.db.backends.postgresql.psycopg_any import is_psycopg3

    if not is_psycopg3:
        raise ConfigurationError(
            f"the Django database {using!r} runs on psycopg2; sagaworker.contrib.django "
            "shares a psycopg 3 connection: uninstall psycopg2 (Django then uses psycopg 3)")
    return dict(wrapper.settings_dict)


def _url(using: str) -> URL:
    """The SQLAlchemy URL of a Django database (its libpq options as the query)."""
    db = _settings_dict(using)
    options = {k: str(v) for k, v in (db.get("OPTIONS") or {}).items()
               if k not in _DJANGO_OPTIONS and isinstance(v, str | int)}
    return URL.create("postgresql+psycopg", username=db.get("USER") or None,
                      password=db.get("PASSWORD") or None, host=db.get("HOST") or None,
                      port=int(db["PORT"]) if db.get("PORT") else None,
                      database=db.get("NAME") or None, query=options)


def settings_from_django(using: str = DEFAULT_DB_ALIAS) -> Settings:
    """sagaworker's settings for a Django project: each ``SAGAWORKER_*`` Django setting
    (the names of the environment variables), then the environment; the journal in the
    Django database ``using`` unless ``SAGAWORKER_DATABASE_URL`` (a Django setting or a
    variable) names another. A ``SAGAWORKER_*`` setting sagaworker does not know is an
    error (a typo would otherwise be ignored)."""
    try:
        names = [n for n in dir(django_settings) if n.startswith("SAGAWORKER_")]
    except ImproperlyConfigured as exc:
        raise ConfigurationError(
            f"Django's settings are not configured ({exc}); set DJANGO_SETTINGS_MODULE (as "
            "manage.py does) before building the Sagaworker") from None
    given: dict[str, Any] = {}
    for name in sorted(names):
        field = name.removeprefix("SAGAWORKER_").lower()
        if field not in Settings.model_fields:
            known = ", ".join(f"SAGAWORKER_{f.upper()}" for f in sorted(Settings.model_fields))
            raise ConfigurationError(f"Django setting {name} is no sagaworker setting; the "
                                     f"settings are: {known}")
        given[field] = getattr(django_settings, name)
    try:
        settings = Settings(**given)
        if "database_url" not in settings.model_fields_set:
            url = _url(using).render_as_string(hide_password=False)
            settings = Settings(**given, database_url=url)
    except ValidationError as exc:
        problems = "; ".join(f"SAGAWORKER_{'_'.join(map(str, e['loc'])).upper()}: {e['msg']}"
                             for e in exc.errors())
        raise ConfigurationError(f"sagaworker settings (Django settings, then the "
                                 f"environment): {problems}") from None
    return settings


# -- Django's connection, as SQLAlchemy sees it ---------------------------------------------

_engines: dict[tuple[str, str], Engine] = {}
_lock = threading.Lock()


def _engine(using: str, url: URL) -> Engine:
    """An engine whose every connection is the one Django holds in this thread for
    ``using`` (a pool that keeps nothing, resets nothing, closes nothing)."""
    key = (using, url.render_as_string(hide_password=False))
    with _lock:
        engine = _engines.get(key)
        if engine is None:
            engine = _engines[key] = _make_engine(using, url)
    return engine


def _make_engine(using: str, url: URL) -> Engine:
    import psycopg

    # SQLAlchemy's first look at the server (its version, its settings) rolls back what it
    # read in (psycopg's dialect calls the connection's rollback() itself, past do_rollback):
    # on a connection of its own, never on Django's
    first = [psycopg.connect(**connections[using].get_connection_params())]
    own = first[0]

    def creator() -> Any:
        return first.pop() if first else connections[using].connection

    engine = create_engine(url.set(drivername=f"postgresql+{_DRIVER}"), creator=creator,
                           poolclass=NullPool, pool_reset_on_return=None, hide_parameters=True)
    try:
        engine.connect().close()
    finally:
        own.close()
    return engine


def _on_commit(using: str, send: Callable[[], None]) -> None:
    transaction.on_commit(send, using=using)  # send logs and swallows its own errors


@contextmanager
def _connection(journal: Engine, using: str, alone: str) -> Iterator[Connection]:
    """Django's connection for ``using``, inside its open ``atomic()`` block (``alone``:
    the call that makes a saga commit on its own, for the errors)."""
    call = alone.partition(".")[2]
    url = _url(using)
    if not same_database(journal.url, url):
        raise ConfigurationError(
            f"{call}(): the Django database {using!r} is "
            f"{masked(url)}, the journal is on "
            f"{masked(journal.url)}: a saga shares Django's "
            "transaction only in the journal's database. Build the Sagaworker with "
            f"settings=settings_from_django({using!r}) (the journal in the Django database; "
            f"`sagaworker db upgrade` creates its tables), or call {alone}() for a saga that "
            "commits on its own")
    wrapper = connections[using]
    if not wrapper.in_atomic_block:
        raise ConfigurationError(
            f"{call}() outside transaction.atomic(using={using!r}): there is no transaction "
            "to share (Django commits each statement on its own). Call it inside the "
            f"atomic() block that writes your rows, or call {alone}() for a saga that "
            "commits on its own")
    wrapper.validate_no_broken_transaction()  # Django's own error, as for any query
    wrapper.ensure_connection()
    with _engine(using, url).connect() as conn:
        conn.info[ON_COMMIT] = functools.partial(_on_commit, using)
        yield conn


# -- the calls -------------------------------------------------------------------------------

def begin(sw: Sagaworker, saga_id: str, *, metadata: dict[str, Any] | None = None,
          deadline: float | None = None, using: str = DEFAULT_DB_ALIAS) -> Saga:
    """``sw.begin`` in Django's open ``atomic()`` block on ``using``: the saga exists once
    that transaction commits, and not if it rolls back."""
    with _connection(sw.journal.engine, using, "sw.begin") as conn:
        return sw.begin(saga_id, metadata=metadata, deadline=deadline, connection=conn)


def start(sw: Sagaworker, saga_id: str, flow: Callable[..., Any], /, *args: Any,
          metadata: dict[str, Any] | None = None, deadline: float | None = None,
          using: str = DEFAULT_DB_ALIAS, **kwargs: Any) -> Saga:
    """``sw.start`` in Django's open ``atomic()`` block on ``using``: the flow is journaled
    with the app's rows and handed to the workers on ``transaction.on_commit``."""
    with _connection(sw.journal.engine, using, "sw.start") as conn:
        return sw.start(saga_id, flow, *args, metadata=metadata, deadline=deadline,
                        connection=conn, **kwargs)


def enqueue(saga: Saga, tool: Any, /, *args: Any, using: str = DEFAULT_DB_ALIAS,
            **kwargs: Any) -> Step:
    """``saga.enqueue`` in Django's open ``atomic()`` block on ``using``: INTENT with the
    app's rows, the task published on ``transaction.on_commit``."""
    with _connection(saga.rt.journal.engine, using, "saga.enqueue") as conn:
        return saga.enqueue(tool, *args, connection=conn, **kwargs)


def enqueue_many(saga: Saga, calls: Iterable[tuple[Any, Iterable[Any], dict[str, Any]]], *,
                 using: str = DEFAULT_DB_ALIAS) -> list[Step]:
    """``saga.enqueue_many`` in Django's open ``atomic()`` block on ``using``."""
    with _connection(saga.rt.journal.engine, using, "saga.enqueue_many") as conn:
        return saga.enqueue_many(calls, connection=conn)
