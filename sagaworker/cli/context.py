"""The command line's context: the app module (never guessed), its Sagaworker on
``--database-url`` when given, errors as one line, and sagaworker's log lines (quiet
unless ``-v``)."""

from __future__ import annotations

import importlib
import logging
import os
import sys
from typing import Any

import click
from pydantic import ValidationError

from .._base.errors import ConfigurationError
from .._base.settings import Settings
from .._observe.visible import visible

__all__ = ["NO_APP", "Ctx", "Group", "app_name", "load", "log_lines", "one_line", "pass_ctx",
           "use_database"]


NO_APP = ("no app given: name the module holding your Celery app and its Sagaworker with "
          "-A MODULE (as for `celery -A`) or SAGAWORKER_APP=MODULE")


def app_name(app_module: str | None) -> str:
    """The app module (-A, else SAGAWORKER_APP); never a guess."""
    name = app_module or Settings().app
    if not name:
        raise click.UsageError(NO_APP)
    return name


def load(app_module: str | None) -> Any:
    """Find the Sagaworker in the app module (-A, else SAGAWORKER_APP)."""
    from .._core.sagaworker import Sagaworker

    name = app_name(app_module)
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        mod = importlib.import_module(name)
    except Exception as exc:
        raise click.UsageError(
            f"cannot load the app module {name!r} ({type(exc).__name__}: {one_line(exc)}); "
            "name the "
            "module holding your Celery app and its Sagaworker with -A MODULE or "
            "SAGAWORKER_APP, or pass --database-url for `db upgrade`") from exc
    sw = next((v for v in vars(mod).values() if isinstance(v, Sagaworker)), None)
    if sw is None:
        raise click.UsageError(f"module {name!r} holds no Sagaworker instance; pass -A "
                               "MODULE or set SAGAWORKER_APP to the module that creates it")
    try:
        # what a worker imports too (the app's `include=` and `imports`, autodiscovered
        # tasks): the flows and tools declared there, whose parameters redaction needs
        sw.app.loader.import_default_modules()
    except Exception as exc:
        raise click.UsageError(
            f"cannot load a module the Celery app of {name!r} names in include= or "
            f"imports ({type(exc).__name__}: {one_line(exc)}); a worker would fail on it "
            "too: fix it or remove it from the app's configuration") from exc
    return sw


def use_database(sw: Any, database_url: str) -> None:
    """Point a loaded Sagaworker at another journal database (--database-url)."""
    if database_url == sw.settings.database_url:
        return
    sw.settings = sw.settings.model_copy(update={"database_url": database_url})
    sw.rt.reset_engine()  # the app module may already have opened its own journal


class Ctx:
    def __init__(self, app: str | None, database_url: str | None) -> None:
        self.app = app
        self.database_url = database_url
        self._sw: Any = None

    @property
    def sw(self) -> Any:
        """The app's Sagaworker, on --database-url when given."""
        if self._sw is None:
            sw = load(self.app)
            if self.database_url:
                use_database(sw, self.database_url)
            self._sw = sw
        return self._sw


pass_ctx = click.make_pass_decorator(Ctx)


class Group(click.Group):
    """A setting that cannot work (a key that does not decrypt the journal, say) is an
    error line naming it and exit 1, not a traceback."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except (ConfigurationError, ValidationError) as exc:
            click.echo(f"error: {one_line(exc)}", err=True)
            sys.exit(1)


def one_line(exc: BaseException) -> str:
    """An error as one line: a settings error names each variable and what is wrong."""
    if isinstance(exc, ValidationError):
        return "; ".join(f"SAGAWORKER_{'.'.join(map(str, e['loc'])).upper()}: {e['msg']}"
                         for e in exc.errors())
    return visible(" ".join(str(exc).split()))


#: commands that set up logging of their own (a worker's, a web server's, the demo's)
OWN_LOGGING = frozenset({"worker", "web", "demo"})


def log_lines(verbose: bool) -> None:
    """One rule for every command: sagaworker's log lines (``approval_granted``,
    ``approval_rejected``, ``saga_aborted``...) are printed on stderr, as JSON, only with
    ``-v``; otherwise the command's own line says what it did (Python's last-resort
    handler would print the warnings among them and not the others)."""
    root = logging.getLogger()
    if verbose:
        handler = logging.StreamHandler(sys.stderr)
        handler.setLevel(logging.INFO)
        root.addHandler(handler)
        root.setLevel(min(root.level or logging.INFO, logging.INFO))
    elif not root.handlers:
        root.addHandler(logging.NullHandler())
