"""Redaction: argument values named in ``SAGAWORKER_REDACT`` never leave the library.

The setting names *parameters*. A tool's positional arguments are bound to their names
through the tool's signature, so ``charge_card("4242…", 1000)`` redacts ``card`` exactly
as ``charge_card(card="4242…", amount_cents=1000)`` does. Dict values under a listed key
are redacted at any depth too. One function, :func:`redact_call`, produces the redacted
form; every exit point (log events, Celery's ``argsrepr``/``kwargsrepr``, Celery's own log
lines, the CLI, the JSON API, the dashboard) goes through it. The journal keeps the real
values: an undo needs them. ``docs/redaction.md`` lists every exit point.

Free text (an exception message, a saga's reason) cannot be redacted by name, so the
*values* of redacted parameters are scrubbed out of it: at the source for the errors the
worker journals and logs, and, while a task runs, out of every log line of its process.
"""

from __future__ import annotations

import contextlib
import inspect
import json
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from celery.utils.saferepr import saferepr

from .._base.types import ENVELOPE

__all__ = [
    "REDACTED",
    "call_reprs",
    "error_text",
    "exception_text",
    "redact_call",
    "redact_value",
    "scrub_text",
    "secret_values",
]

REDACTED = "[REDACTED]"
#: shorter values are not scrubbed out of free text (they would shred every line)
MIN_TEXT_VALUE = 3
#: Celery's own default size of an argsrepr/kwargsrepr
REPR_MAXSIZE = 1024

Signature = inspect.Signature


# -- the one function ----------------------------------------------------------------


def redact_value(value: Any, keys: Iterable[str]) -> Any:
    """``value`` with the values of listed dict keys replaced, at any depth."""
    return _walk(value, frozenset(keys), False, None)


def _walk(value: Any, keys: frozenset[str], secret: bool, sink: list[str] | None) -> Any:
    """The redacted copy of ``value``; the leaves of secret parts go to ``sink``."""
    if isinstance(value, Mapping):
        return {k: (_secret(v, keys, sink) if k in keys else _walk(v, keys, secret, sink))
                for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_walk(v, keys, secret, sink) for v in value]
    if secret:
        if sink is not None and not isinstance(value, bool) and value is not None:
            sink.extend(_as_text(value))
        return REDACTED
    if isinstance(value, str) and keys and value.lstrip().startswith(("{", "[")):
        return _json_text(value, keys, sink)
    return value


def _json_text(text: str, keys: frozenset[str], sink: list[str] | None) -> str:
    """A string holding a JSON object or array, redacted as the value it holds: the
    OpenAI Agents SDK and Pydantic AI keep a tool call's arguments as such a string, so a
    redacted parameter of a call (one refused, that no step holds to scrub it with) would
    show in clear. Written back as JSON when a key was redacted; otherwise as it is."""
    try:
        parsed = json.loads(text)
    except (ValueError, RecursionError):
        return text
    if not isinstance(parsed, dict | list):
        return text
    shown = _walk(parsed, keys, False, sink)
    return text if shown == parsed else json.dumps(shown, ensure_ascii=False)


def _as_text(value: Any) -> list[str]:
    """The ways a secret value shows in free text: its ``str`` and ``repr`` (a UUID, a
    Decimal, a datetime as f-strings and containers quote them), its ISO form (as JSON
    and logs write a datetime), a bytes value decoded and as its repr shows it."""
    if isinstance(value, str | int | float):
        return [str(value)]
    if isinstance(value, bytes | bytearray):
        raw = bytes(value)
        return [raw.decode("utf-8", "replace"), repr(raw)[2:-1]]
    out = [str(value), repr(value)]
    iso = getattr(value, "isoformat", None)
    if callable(iso):
        with contextlib.suppress(Exception):  # (an isoformat that needs arguments)
            out.append(str(iso()))
    return out


def _secret(value: Any, keys: frozenset[str], sink: list[str] | None) -> str:
    if sink is not None:
        _walk(value, keys, True, sink)
    return REDACTED


def _positional_names(signature: Signature | None, n: int) -> list[str | None] | None:
    """The parameter each of ``n`` positional arguments binds to (None: cannot tell)."""
    if signature is None:
        return None
    names: list[str | None] = []
    var: str | None = None
    for p in signature.parameters.values():
        if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD):
            names.append(p.name)
        elif p.kind is p.VAR_POSITIONAL:
            var = p.name
            break
        else:
            break
    if n > len(names) and var is None:
        return None
    return [names[i] if i < len(names) else var for i in range(n)]


def _redact(signature: Signature | None, args: Sequence[Any], kwargs: Mapping[str, Any],
            keys: Iterable[str], sink: list[str] | None
            ) -> tuple[list[Any], dict[str, Any]]:
    wanted = frozenset(keys)
    args, kwargs = list(args or ()), dict(kwargs or {})
    if not wanted:
        return args, kwargs
    envelope = kwargs.pop(ENVELOPE, None) if ENVELOPE in kwargs else _NONE
    names = _positional_names(signature, len(args))
    if names is not None and signature is not None:
        try:
            signature.bind_partial(*args, **kwargs)
        except TypeError:
            names = None  # arguments that do not fit the tool: name nothing, hide all
    if names is None:
        # no signature (an unknown task) or arguments that do not bind: a positional
        # argument cannot be named, so every one is redacted (the safe side)
        out_args: list[Any] = [REDACTED] * len(args)
    else:
        out_args = [_secret(a, wanted, sink) if name in wanted else _walk(a, wanted, False, sink)
                    for a, name in zip(args, names, strict=True)]
    out_kwargs = {k: (_secret(v, wanted, sink) if k in wanted else _walk(v, wanted, False, sink))
                  for k, v in kwargs.items()}
    if envelope is not _NONE:
        out_kwargs[ENVELOPE] = envelope
    return out_args, out_kwargs


_NONE: Any = object()


def redact_call(signature: Signature | None, args: Sequence[Any], kwargs: Mapping[str, Any],
                keys: Iterable[str]) -> tuple[list[Any], dict[str, Any]]:
    """The redacted ``(args, kwargs)`` of a call: parameters named in ``keys`` (positional
    ones bound through ``signature``) and dict values under those keys become
    ``[REDACTED]``. Without a signature, or when the arguments do not bind, every
    positional argument is redacted. sagaworker's envelope keyword is kept as it is."""
    return _redact(signature, args, kwargs, keys, None)


def secret_values(signature: Signature | None, args: Sequence[Any],
                  kwargs: Mapping[str, Any], keys: Iterable[str]) -> list[str]:
    """The values :func:`redact_call` hides by name, as text, to scrub out of free text.

    Only named values: positional arguments hidden because nothing names them are not
    secrets by name, and scrubbing all of them would shred every message. A redacted
    parameter the call left to its default value gives that default."""
    sink: list[str] = []
    if signature is None:
        _redact(None, (), kwargs, keys, sink)
    else:
        _redact(signature, args, kwargs, keys, sink)
        _defaults(signature, args, kwargs, frozenset(keys), sink)
    return _text_values(sink)


def _defaults(signature: Signature, args: Sequence[Any], kwargs: Mapping[str, Any],
              keys: frozenset[str], sink: list[str]) -> None:
    """The default values of the parameters a call left out: a tool that quotes one (its
    ``card="4111..."``) must not show it either."""
    if not keys:
        return
    try:
        bound = signature.bind_partial(*args, **{k: v for k, v in kwargs.items()
                                                 if k != ENVELOPE})
    except TypeError:
        return
    for name, p in signature.parameters.items():
        if name in bound.arguments or p.default is p.empty:
            continue
        if name in keys:
            _secret(p.default, keys, sink)
        else:
            _walk(p.default, keys, False, sink)


def _text_values(values: Iterable[str]) -> list[str]:
    out: set[str] = set()
    for v in values:
        if len(v) < MIN_TEXT_VALUE:
            continue
        out.add(v)
        quoted = repr(v)[1:-1]  # how repr() of an exception or a container shows it
        if quoted != v:
            out.add(quoted)
        dumped = json.dumps(v)[1:-1]
        if dumped != v:
            out.add(dumped)
    return sorted(out, key=len, reverse=True)


def scrub_text(text: str, values: Iterable[str]) -> str:
    """``text`` with every occurrence of the given values replaced by ``[REDACTED]``."""
    for v in values:
        if v and v in text:
            text = text.replace(v, REDACTED)
    return text


def exception_text(exc: BaseException, keys: Iterable[str], values: Iterable[str]) -> str:
    """The message of ``exc`` (its ``str``) redacted: arguments that are dicts or lists
    have the values of listed keys replaced, then the given secret values are scrubbed
    out. Only the message: a chained cause, a note or a traceback is never part of it."""
    wanted = frozenset(keys)
    try:
        if type(exc).__str__ is BaseException.__str__ and wanted:
            args = [_walk(a, wanted, False, None) if isinstance(a, Mapping | list) else a
                    for a in exc.args]
            text = "" if not args else str(args[0]) if len(args) == 1 else str(tuple(args))
        else:
            text = str(exc)
    except Exception:  # a __str__ that raises
        text = f"<unprintable {type(exc).__name__}>"
    return scrub_text(text, values)


def error_text(exc: BaseException, signature: Signature | None, args: Sequence[Any],
               kwargs: Mapping[str, Any], keys: Iterable[str]) -> str:
    """``"Type: message"`` of a tool's exception, redacted argument values scrubbed out:
    the error a worker journals and logs (``step_failed``, the saga's reason)."""
    values = secret_values(signature, args, kwargs, keys)
    return f"{type(exc).__name__}: {exception_text(exc, keys, values)}"


def call_reprs(signature: Signature | None, args: Sequence[Any], kwargs: Mapping[str, Any],
               keys: Iterable[str]) -> tuple[str, str]:
    """Celery's ``argsrepr`` and ``kwargsrepr`` of a call, redacted."""
    a, k = redact_call(signature, args, kwargs, keys)
    return saferepr(a, REPR_MAXSIZE), saferepr(k, REPR_MAXSIZE)


def _scrub_strings(value: Any, values: list[str]) -> Any:
    if isinstance(value, str):
        return scrub_text(value, values)
    if isinstance(value, dict):
        return {k: _scrub_strings(v, values) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(_scrub_strings(v, values) for v in value)
    return value
