"""Structured logs: one structlog chain for our events and for Celery's own lines.

Redaction (``_redact.py``) does not depend on who configured logging: sagaworker's own
logger redacts its events before any processor sees them (an app that configured
structlog itself gets them redacted too), the chain built here redacts again, and a
``logging.Filter`` on Celery's loggers (and on the handler this module installs) scrubs
the Celery lines that carry a message body or a task's arguments.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Iterable, MutableMapping
from typing import Any

import structlog

from . import process as _process
from . import redact as _redact
from .celery_logs import (
    RedactingFilter,
    exc_text_processor,
    install_celery_filters,
    install_filter,
)
from .redact import REDACTED
from .tracing import add_trace_ids

__all__ = ["REDACTED", "RedactingFilter", "configure_logging", "get_logger", "redactor"]

_LOG_METHODS = frozenset({"debug", "info", "warning", "warn", "error", "critical",
                          "exception", "fatal", "msg", "log"})


class _RedactingLogger:
    """sagaworker's logger: event fields are redacted before structlog sees them."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._inner, name)
        if name in _LOG_METHODS:
            def call(*args: Any, **kw: Any) -> Any:
                return attr(*args, **_clean(kw))

            return call
        if name in ("bind", "new"):
            return lambda **kw: _RedactingLogger(attr(**_clean(kw)))
        return attr


def _clean(kw: dict[str, Any]) -> dict[str, Any]:
    keys = _process.redact_keys()
    if keys:
        kw = {k: (v if k in _KEEP else REDACTED if k in keys else _redact.redact_value(v, keys))
              for k, v in kw.items()}
    out: dict[str, Any] = _process.scrub_active(kw)
    return out


#: stdlib logging keywords, never event fields
_KEEP = frozenset({"exc_info", "stack_info", "stacklevel"})


def get_logger() -> Any:
    return _RedactingLogger(structlog.get_logger("sagaworker"))


def redactor(keys: Iterable[str]) -> Any:
    """A processor that replaces the values of the given keys, at any depth, and scrubs
    the secret values of the tasks running in this process out of every string."""
    wanted = frozenset(keys)

    def redact(_logger: Any, _method: str, event_dict: MutableMapping[str, Any]) -> Any:
        keys = wanted | _process.redact_keys()
        if keys:
            for k in list(event_dict):
                if k.startswith("_"):
                    continue  # structlog's and ProcessorFormatter's own entries
                event_dict[k] = (REDACTED if k in keys
                                 else _redact.redact_value(event_dict[k], keys))
        return scrub_values(_logger, _method, event_dict)

    return redact


def scrub_values(_logger: Any, _method: str, event_dict: MutableMapping[str, Any]) -> Any:
    """The secret values of running tasks scrubbed out of every field (tracebacks too)."""
    values = _process.active_values()
    if values:
        for k in list(event_dict):
            if not k.startswith("_"):
                event_dict[k] = _redact._scrub_strings(event_dict[k], values)
    return event_dict


def _chain(redact_keys: Iterable[str]) -> list[Any]:
    return [
        structlog.contextvars.merge_contextvars,
        add_trace_ids,  # the current span's ids (OpenTelemetry, when it is configured)
        structlog.stdlib.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True, key="timestamp"),
        redactor(redact_keys),
    ]


def configure_logging(*, fmt: str = "json", level: str = "INFO",
                      redact_keys: Iterable[str] = (), stream: Any = None) -> None:
    """Route structlog and stdlib logging (Celery's lines too) through one formatter."""
    keys = tuple(redact_keys)
    _process.register(keys)
    shared = _chain(keys)
    renderer: Any = (structlog.processors.JSONRenderer() if fmt == "json"
                     else structlog.dev.ConsoleRenderer(colors=sys.stderr.isatty()))
    structlog.configure(
        processors=[structlog.stdlib.filter_by_level, *shared,
                    structlog.processors.StackInfoRenderer(),
                    structlog.processors.format_exc_info,
                    scrub_values,
                    structlog.stdlib.ProcessorFormatter.wrap_for_formatter],
        logger_factory=structlog.stdlib.LoggerFactory(),
        wrapper_class=structlog.stdlib.BoundLogger,
        cache_logger_on_first_use=False,
    )
    formatter = structlog.stdlib.ProcessorFormatter(
        foreign_pre_chain=[*shared, structlog.processors.format_exc_info,
                           exc_text_processor, scrub_values],
        processors=[structlog.stdlib.ProcessorFormatter.remove_processors_meta, renderer],
    )
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.setFormatter(formatter)
    install_filter(handler)
    install_celery_filters()
    root = logging.getLogger()
    for h in list(root.handlers):
        root.removeHandler(h)
    root.addHandler(handler)
    root.setLevel(level)


def ensure_structlog(redact_keys: Iterable[str] = (), tools: Any = None) -> None:
    """In a producer: register the redact keys (and the tools' signatures) with the log
    filters, filter Celery's loggers, and hand our events to stdlib logging unless the app
    configured structlog (our logger redacts its events either way)."""
    keys = tuple(redact_keys)
    _process.register(keys, tools)
    install_celery_filters()
    if structlog.is_configured():
        return
    structlog.configure(
        processors=[structlog.stdlib.filter_by_level, *_chain(keys),
                    structlog.processors.format_exc_info,
                    scrub_values,
                    structlog.processors.JSONRenderer()],
        logger_factory=structlog.stdlib.LoggerFactory(),
        wrapper_class=structlog.stdlib.BoundLogger,
    )
