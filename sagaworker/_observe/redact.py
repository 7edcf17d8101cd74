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

import ast
import dataclasses
import inspect
import json
import logging
import re
import threading
import weakref
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from celery.utils.saferepr import saferepr
from celery.worker.request import Request

from .._base.types import ApprovalRequest, EntryRecord, SagaRecord, SagaResult

__all__ = [
    "REDACTED",
    "RedactedRequest",
    "RedactingFilter",
    "Redaction",
    "error_text",
    "redact_call",
    "redact_value",
    "scrub_text",
    "secret_values",
]

REDACTED = "[REDACTED]"
#: the reserved keyword carrying (saga_id, seq) in a tool message (see _execution.py)
ENVELOPE = "__sagaworker__"
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
        if sink is not None and not isinstance(value, bool) and isinstance(value, str | int
                                                                            | float):
            sink.append(str(value))
        return REDACTED
    return value


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
    secrets by name, and scrubbing all of them would shred every message."""
    sink: list[str] = []
    if signature is None:
        _redact(None, (), kwargs, keys, sink)
    else:
        _redact(signature, args, kwargs, keys, sink)
    return _text_values(sink)


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


def error_text(exc: BaseException, signature: Signature | None, args: Sequence[Any],
               kwargs: Mapping[str, Any], keys: Iterable[str]) -> str:
    """``"Type: message"`` of a tool's exception, redacted argument values scrubbed out:
    the error a worker journals and logs (``step_failed``, the saga's reason)."""
    return scrub_text(f"{type(exc).__name__}: {exc}", secret_values(signature, args, kwargs,
                                                                     keys))


def call_reprs(signature: Signature | None, args: Sequence[Any], kwargs: Mapping[str, Any],
               keys: Iterable[str]) -> tuple[str, str]:
    """Celery's ``argsrepr`` and ``kwargsrepr`` of a call, redacted."""
    a, k = redact_call(signature, args, kwargs, keys)
    return saferepr(a, REPR_MAXSIZE), saferepr(k, REPR_MAXSIZE)


# -- what this process knows: keys, tool signatures, values of running tasks -----------

_lock = threading.Lock()
_keys: set[str] = set()
_lookups: list[weakref.ref[Any]] = []
_active: dict[str, list[str]] = {}


def register(keys: Iterable[str], tools: Any = None) -> None:
    """Add redact keys (and a registry whose ``tool(name)`` gives ``.signature``) to what
    this process's log filters and renderers redact by."""
    with _lock:
        _keys.update(keys)
        if tools is not None and not any(r() is tools for r in _lookups):
            _lookups[:] = [r for r in _lookups if r() is not None]
            _lookups.append(weakref.ref(tools))


def redact_keys() -> frozenset[str]:
    return frozenset(_keys)


def signature_of(tool: str) -> Signature | None:
    for ref in list(_lookups):
        reg = ref()
        spec = reg.tool(tool) if reg is not None else None
        if spec is not None and getattr(spec, "signature", None) is not None:
            sig: Signature = spec.signature
            return sig
    return None


def hold(task_id: str, values: list[str]) -> None:
    """While a task runs: its secret values are scrubbed from every log line."""
    if values:
        with _lock:
            _active[task_id] = values


def release(task_id: str) -> None:
    with _lock:
        _active.pop(task_id, None)


def active_values() -> list[str]:
    if not _active:
        return []
    with _lock:
        merged = {v for vs in _active.values() for v in vs}
    return sorted(merged, key=len, reverse=True)


def scrub_active(value: Any) -> Any:
    """``value`` with the running tasks' secret values scrubbed out of every string."""
    values = active_values()
    return _scrub_strings(value, values) if values else value


def _scrub_strings(value: Any, values: list[str]) -> Any:
    if isinstance(value, str):
        return scrub_text(value, values)
    if isinstance(value, dict):
        return {k: _scrub_strings(v, values) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(_scrub_strings(v, values) for v in value)
    return value


# -- records for people: the CLI, the JSON API, the dashboard ----------------------------


@dataclasses.dataclass(frozen=True)
class Redaction:
    """Redacts journal records for display. The journal itself keeps the real values."""

    keys: frozenset[str]
    lookup: Callable[[str], Signature | None] = signature_of
    #: a flow's signature without its FlowContext (None: its positional arguments are all
    #: redacted, the safe side)
    flow_lookup: Callable[[str], Signature | None] = lambda name: None

    @classmethod
    def of(cls, sw: Any) -> Redaction:
        """The redaction of one ``Sagaworker``: its keys, its tools' and flows' signatures."""
        registry = sw.registry

        def lookup(name: str) -> Signature | None:
            spec = registry.tool(name)
            return spec.signature if spec is not None else signature_of(name)

        def flow_lookup(name: str) -> Signature | None:
            spec = getattr(sw, "flows", None) and sw.flows.specs.get(name)
            if not spec:
                return None
            try:
                sig = inspect.signature(spec.fn)
            except (TypeError, ValueError):
                return None
            return sig.replace(parameters=list(sig.parameters.values())[1:])

        return cls(frozenset(sw.settings.redact_keys), lookup, flow_lookup)

    @classmethod
    def current(cls) -> Redaction:
        """What this process was configured with (every ``Sagaworker`` it built)."""
        return cls(redact_keys())

    def values(self, e: EntryRecord | ApprovalRequest) -> list[str]:
        return secret_values(self.lookup(e.tool_name), e.args or [], e.kwargs or {},
                             self.keys)

    def entry(self, e: EntryRecord, values: list[str] | None = None) -> EntryRecord:
        if not self.keys:
            return e
        vals = self.values(e) if values is None else values
        args, kwargs = redact_call(self.lookup(e.tool_name), e.args or [], e.kwargs or {},
                                   self.keys)
        return dataclasses.replace(
            e, args=args, kwargs=kwargs,
            result=_scrub_strings(redact_value(e.result, self.keys), vals),
            error=_text(e.error, vals), compensation_detail=_text(e.compensation_detail, vals),
            rejection_reason=_text(e.rejection_reason, vals))

    def record(self, rec: SagaRecord) -> SagaRecord:
        if not self.keys:
            return rec
        flow_args, flow_kwargs = rec.flow_args, rec.flow_kwargs
        flow_vals: list[str] = []
        if rec.flow is not None and (flow_args or flow_kwargs):
            sig = self.flow_lookup(rec.flow)
            flow_vals = secret_values(sig, flow_args or [], flow_kwargs or {}, self.keys)
            new_args, new_kwargs = redact_call(sig, flow_args or [], flow_kwargs or {},
                                               self.keys)
            flow_args = new_args if flow_args is not None else None
            flow_kwargs = new_kwargs if flow_kwargs is not None else None
        vals = _merge([flow_vals, *(self.values(e) for e in rec.entries)])
        report = dataclasses.replace(
            rec.report,
            outcomes=[dataclasses.replace(o, detail=_text(o.detail, vals))
                      for o in rec.report.outcomes],
            in_doubt=[self.entry(e, vals) for e in rec.report.in_doubt])
        return dataclasses.replace(rec, reason=_text(rec.reason, vals),
                                   flow_args=flow_args, flow_kwargs=flow_kwargs,
                                   metadata=redact_value(rec.metadata, self.keys),
                                   entries=[self.entry(e, vals) for e in rec.entries],
                                   report=report)

    def approval(self, a: ApprovalRequest) -> ApprovalRequest:
        if not self.keys:
            return a
        args, kwargs = redact_call(self.lookup(a.tool_name), a.args, a.kwargs, self.keys)
        return dataclasses.replace(a, args=args, kwargs=kwargs)

    def any(self, o: Any) -> Any:
        """Records (or lists of them) redacted; anything else as it is."""
        if isinstance(o, list | tuple):
            return [self.any(x) for x in o]
        if isinstance(o, SagaRecord):
            return self.record(o)
        if isinstance(o, EntryRecord):
            return self.entry(o)
        if isinstance(o, ApprovalRequest):
            return self.approval(o)
        if isinstance(o, SagaResult) and self.keys:
            return dataclasses.replace(o, value=redact_value(o.value, self.keys))
        return o


def _text(s: str | None, values: list[str]) -> str | None:
    return s if s is None else scrub_text(s, values)


def _merge(groups: Iterable[list[str]]) -> list[str]:
    return sorted({v for g in groups for v in g}, key=len, reverse=True)


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
