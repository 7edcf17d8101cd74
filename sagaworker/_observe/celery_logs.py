"""Redaction at Celery's edges: the worker request `celery inspect` and Flower show, and
Celery's own log lines (unknown or invalid tasks print the message body)."""

from __future__ import annotations

import ast
import json
import logging
import re
from collections.abc import Mapping
from typing import Any

from celery.utils.saferepr import saferepr
from celery.worker.request import Request

from .process import (
    active_values,
    redact_keys,
    signature_of,
)
from .redact import (
    REDACTED,
    REPR_MAXSIZE,
    _redact,
    _scrub_strings,
    _text_values,
    _walk,
    redact_call,
    redact_value,
    scrub_text,
)

__all__ = ["CELERY_LOGGERS", "RedactedRequest", "RedactingFilter", "exc_text_processor",
           "install_celery_filters", "install_filter"]

# -- Celery: what `celery inspect` and Flower's worker pages show ----------------------


class RedactedRequest(Request):  # type: ignore[misc]
    """A tool task's worker request: ``celery inspect active/reserved/scheduled`` (and so
    Flower) show the redacted ``argsrepr``/``kwargsrepr``, never the real arguments."""

    def info(self, safe: bool = False) -> dict[str, Any]:
        info: dict[str, Any] = super().info(safe=True)
        return info


# -- Celery's own log lines ------------------------------------------------------------

#: the loggers whose records can carry a message body or a task's arguments
CELERY_LOGGERS = ("celery.worker.consumer.consumer", "celery.worker.strategy",
                  "celery.worker.request", "celery.worker.control", "celery.app.trace",
                  "celery.pool", "celery.concurrency.asynpool", "celery.redirected")
_DUMP = re.compile(r"^(?P<repr>.*) \((?P<size>\d+)b\)$", re.DOTALL)
_REPORT_BODY = re.compile(r"^body: .*?(?=\n\{content_type)", re.DOTALL)


class RedactingFilter(logging.Filter):
    """Scrubs log records that carry a message body or a task's arguments.

    - Celery's unknown-task, invalid-task, undecodable and unknown-format errors print
      the message body (and headers with ``argsrepr``): the body of a task nothing here
      knows has no signature to bind, so its positional arguments are all redacted and its
      keyword arguments by name; a body that cannot be parsed is withheld whole.
    - The DEBUG ``TaskPool: Apply`` line prints the raw body: its arguments are withheld.
    - Celery's trace lines (received, succeeded, failed, retry) carry ``args``/``kwargs``
      in their context: redacted by name, through the tool's signature when it is known.
    - Any other line, and tracebacks, lose the secret values of the tasks running in this
      process (a tool's exception text that quotes its card number, say).
    """

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            _scrub_record(record)
        except Exception:  # never let a secret through because scrubbing broke
            record.msg, record.args = "log line withheld: sagaworker redaction failed", None
            record.exc_info, record.exc_text = None, None
        return True


def install_filter(target: logging.Logger | logging.Handler) -> None:
    if not any(isinstance(f, RedactingFilter) for f in target.filters):
        target.addFilter(RedactingFilter())


def install_celery_filters() -> None:
    for name in CELERY_LOGGERS:
        install_filter(logging.getLogger(name))


def _scrub_record(record: logging.LogRecord) -> None:
    if not isinstance(record.msg, str):
        return  # a structlog event dict: our processors redacted it
    keys = redact_keys()
    values = active_values()
    if not keys and not values:
        return
    if keys:
        _known_formats(record, keys)
    if values:
        message = record.getMessage()
        scrubbed = scrub_text(message, values)
        if scrubbed != message:
            record.msg, record.args = scrubbed, None
        data = getattr(record, "data", None)
        if isinstance(data, dict):
            record.data = _scrub_strings(data, values)
        _scrub_exc(record, values)


def _scrub_exc(record: logging.LogRecord, values: list[str]) -> None:
    """A traceback that quotes a value is replaced by its scrubbed text (``exc_text``,
    which stdlib formatters print and ``exc_text_processor`` hands to structlog)."""
    if record.exc_info and record.exc_info[1] is not None:
        text = logging.Formatter().formatException(record.exc_info)
        clean = scrub_text(text, values)
        if clean != text:
            record.exc_info, record.exc_text = None, clean
    if record.exc_text:
        record.exc_text = scrub_text(record.exc_text, values)


def exc_text_processor(_logger: Any, _method: str, event_dict: Any) -> Any:
    """structlog foreign pre-chain step: a record's scrubbed traceback as ``exception``."""
    record = event_dict.get("_record")
    text = getattr(record, "exc_text", None)
    if text and "exc_info" not in event_dict and "exception" not in event_dict:
        event_dict["exception"] = text
    return event_dict


def _known_formats(record: logging.LogRecord, keys: frozenset[str]) -> None:
    from celery.worker.consumer import consumer as c

    msg, args = record.msg, record.args
    if isinstance(args, tuple):
        if msg in (c.UNKNOWN_TASK_ERROR, c.INVALID_TASK_ERROR) and len(args) >= 2:
            sink: list[str] = []
            body = _body_dump(args[1], keys, sink)
            rest = args[2:]
            if msg == c.UNKNOWN_TASK_ERROR and rest:
                rest = (_headers(rest[0], keys), *rest[1:])
            # the body's secret values (every positional one: nothing names them) are
            # scrubbed out of the rest of this record too: the error, the traceback
            values = _text_values(sink)
            record.args = (scrub_text(str(args[0]), values), body, *rest)
            if values:
                _scrub_exc(record, values)
        elif msg == c.MESSAGE_DECODE_ERROR and len(args) >= 5:
            record.args = (*args[:3], _headers(args[3], keys), _withheld(args[4]), *args[5:])
        elif msg == c.UNKNOWN_FORMAT and len(args) == 1 and isinstance(args[0], str):
            record.args = (_REPORT_BODY.sub(lambda _m: f"body: {REDACTED}", args[0]),)
        elif msg.startswith("TaskPool: Apply") and len(args) == 3:
            record.args = (args[0], REDACTED, REDACTED)
    elif isinstance(args, Mapping) and ("args" in args or "kwargs" in args):
        ctx = dict(args)
        sig = signature_of(str(ctx.get("name", "")))
        a, k = _parse_repr(ctx.get("args"), list), _parse_repr(ctx.get("kwargs"), dict)
        ra, rk = redact_call(sig, a if a is not None else [], k if k is not None else {}, keys)
        ctx["args"] = saferepr(ra, REPR_MAXSIZE) if a is not None else REDACTED
        ctx["kwargs"] = saferepr(rk, REPR_MAXSIZE) if k is not None else REDACTED
        record.args = ctx
        if isinstance(getattr(record, "data", None), dict):
            record.data = ctx


def _parse_repr(value: Any, kind: type) -> Any:
    """A repr'd list/dict back as data, or None when it cannot be read (truncated, say)."""
    if isinstance(value, kind):
        return value
    if value is None or value == "":
        return kind()
    if not isinstance(value, str):
        return None
    try:
        out = ast.literal_eval(value)
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
        return None
    if kind is list and isinstance(out, tuple):
        out = list(out)
    return out if isinstance(out, kind) else None


def _withheld(dump: Any) -> str:
    m = _DUMP.match(dump) if isinstance(dump, str) else None
    size = f" ({m.group('size')}b)" if m else ""
    return f"{REDACTED} message body withheld{size}"


def _body_dump(dump: Any, keys: frozenset[str], sink: list[str]) -> str:
    """Celery's ``dump_body`` of a message, its arguments redacted (an unknown task's
    positional arguments all of them: nothing names them)."""
    m = _DUMP.match(dump) if isinstance(dump, str) else None
    if m is None:
        return _withheld(dump)
    try:
        raw = ast.literal_eval(m.group("repr"))
        body = json.loads(raw) if isinstance(raw, bytes | str) else raw
    except Exception:
        return _withheld(dump)
    if isinstance(body, list | tuple) and len(body) == 3 and isinstance(body[0], list | tuple) \
            and isinstance(body[1], dict):
        args, kwargs = _unknown_call(body[0], body[1], keys, sink)
        shown: Any = [args, kwargs, redact_value(body[2], keys)]
    elif isinstance(body, dict) and ("args" in body or "kwargs" in body):  # protocol 1
        args, kwargs = _unknown_call(body.get("args") or [], body.get("kwargs") or {}, keys,
                                     sink)
        shown = {**redact_value(body, keys), "args": args, "kwargs": kwargs}
    else:
        return _withheld(dump)
    return f"{json.dumps(shown, default=str)!r} ({m.group('size')}b)"


def _unknown_call(args: Any, kwargs: Any, keys: frozenset[str],
                  sink: list[str]) -> tuple[list[Any], dict[str, Any]]:
    """An unknown task's call redacted: every positional argument, keywords by name."""
    for a in args if isinstance(args, list | tuple) else ():
        _walk(a, keys, True, sink)
    return _redact(None, args if isinstance(args, list | tuple) else [], kwargs
                   if isinstance(kwargs, dict) else {}, keys, sink)


def _headers(headers: Any, keys: frozenset[str]) -> Any:
    if isinstance(headers, str):
        parsed = _parse_repr(headers, dict)
        return REDACTED if parsed is None else repr(_headers(parsed, keys))
    if not isinstance(headers, Mapping):
        return headers
    out = dict(headers)
    sig = signature_of(str(out.get("task", "")))
    a = _parse_repr(out.get("argsrepr"), list)
    k = _parse_repr(out.get("kwargsrepr"), dict)
    ra, rk = redact_call(sig, a or [], k or {}, keys)
    if "argsrepr" in out:
        out["argsrepr"] = saferepr(ra, REPR_MAXSIZE) if a is not None else REDACTED
    if "kwargsrepr" in out:
        out["kwargsrepr"] = saferepr(rk, REPR_MAXSIZE) if k is not None else REDACTED
    return out
