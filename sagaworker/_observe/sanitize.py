"""What Celery is handed when a task raises: a fresh exception built from redacted text.

Celery shows a task's exception far beyond sagaworker's log lines: the ``task-failed``
and ``task-retried`` events (Flower, ``celery events``) carry its ``repr`` and its
traceback, and a traceback prints a chained cause, ``__notes__`` and whatever a custom
``__str__`` returns. So Celery never holds the exception a task raised: the task's body
raises a copy whose only argument is the redacted message (``exception_text``), of a
class with the same name that derives from the original (``autoretry_for``, ``throws``
and ``except`` clauses still match it), with the plain ``str``/``repr`` of an exception,
no cause, no context and no notes. A retry's ``Retry`` is rebuilt around such a copy.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

from celery.exceptions import Ignore, Reject, Retry

from .redact import exception_text, scrub_text

__all__ = ["celery_safe", "is_sanitized", "sanitized", "sanitized_retry"]

T = TypeVar("T")
_MARK = "__sagaworker_sanitized__"
_classes: dict[Any, type[Exception]] = {}


def _rebuild(module: str, qualname: str, text: str) -> Exception:
    """Unpickling (a prefork child hands its failure to the worker): the same copy."""
    orig: Any = None
    try:
        orig = importlib.import_module(module)
        for part in qualname.split("."):
            orig = getattr(orig, part)
    except Exception:
        orig = None
    if not (isinstance(orig, type) and issubclass(orig, Exception)):
        return _fresh(_plain(module, qualname), text)
    return _fresh(_clean_class(orig), text)


def _reduce(self: Exception) -> tuple[Any, ...]:
    cls = type(self)
    return _rebuild, (cls.__module__, cls.__qualname__, str(self.args[0] if self.args else ""))


def _namespace(module: str, qualname: str) -> dict[str, Any]:
    return {"__module__": module, "__qualname__": qualname, _MARK: True,
            "__str__": BaseException.__str__, "__repr__": BaseException.__repr__,
            "__reduce__": _reduce}


def _plain(module: str, qualname: str) -> type[Exception]:
    key = (module, qualname)
    if key not in _classes:
        _classes[key] = type(qualname.rpartition(".")[2], (Exception,),
                             _namespace(module, qualname))
    return _classes[key]


def _clean_class(orig: type[Exception]) -> type[Exception]:
    if orig.__dict__.get(_MARK):
        return orig
    if orig not in _classes:
        try:
            _classes[orig] = type(orig.__name__, (orig,),
                                  _namespace(orig.__module__, orig.__qualname__))
        except Exception:  # a class that cannot be derived from (a metaclass, say)
            _classes[orig] = _plain(orig.__module__, orig.__qualname__)
    return _classes[orig]


def _fresh(cls: type[Exception], text: str) -> Exception:
    try:
        new = cls.__new__(cls, text)  # never __init__: it may store what it was given
        if not isinstance(new, cls):
            raise TypeError(cls)
        vars(new).clear()
        new.args = (text,)
        return new
    except Exception:
        plain = _plain(cls.__module__, cls.__qualname__)
        return plain(text) if cls is not plain else Exception(text)


def is_sanitized(exc: BaseException) -> bool:
    return bool(getattr(type(exc), _MARK, False))


def sanitized(exc: BaseException, keys: Iterable[str], values: Iterable[str]) -> Exception:
    """A fresh copy of ``exc`` for Celery (see the module docstring)."""
    text = exception_text(exc, keys, values)
    if isinstance(exc, Exception):
        return _fresh(_clean_class(type(exc)), text)
    return _fresh(_plain(type(exc).__module__, type(exc).__qualname__), text)


def sanitized_retry(retry: Retry, keys: Iterable[str], values: Iterable[str]) -> Retry:
    """``retry`` rebuilt around a sanitized exception (its text says ``Retry in Ns:`` and
    the exception's ``repr``)."""
    values = list(values)
    exc = retry.exc
    clean = sanitized(exc, keys, values) if isinstance(exc, BaseException) else None
    message = scrub_text(str(retry.message), values) if retry.message else None
    return Retry(message, clean, retry.when, is_eager=retry.is_eager, sig=retry.sig)


def celery_safe(call: Callable[[], T], keys: Iterable[str],
                values: Callable[[], Iterable[str]]) -> T:
    """``call()``; an exception leaves as a sanitized copy, raised outside the handler
    (so it has no ``__context__``). Celery's ``Ignore`` and ``Reject`` pass as they are:
    sagaworker raises them with texts of its own."""
    failure: Exception
    try:
        return call()
    except (Ignore, Reject):
        raise
    except Retry as exc:
        failure = sanitized_retry(exc, keys, values())
    except Exception as exc:
        failure = sanitized(exc, keys, values())
    raise failure
