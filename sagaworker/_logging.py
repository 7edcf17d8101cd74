"""Structured logs: one structlog chain for our events and for Celery's own lines."""

from __future__ import annotations

import logging
import sys
from collections.abc import Iterable, MutableMapping
from typing import Any

import structlog

__all__ = ["configure_logging", "get_logger", "redactor"]

REDACTED = "[REDACTED]"


def get_logger() -> Any:
    return structlog.get_logger("sagaworker")


def redactor(keys: Iterable[str]) -> Any:
    """A processor that replaces the values of the given keys, at any depth."""
    wanted = frozenset(keys)

    def scrub(value: Any) -> Any:
        if isinstance(value, dict):
            return {k: (REDACTED if k in wanted else scrub(v)) for k, v in value.items()}
        if isinstance(value, list | tuple):
            return [scrub(v) for v in value]
        return value

    def redact(_logger: Any, _method: str, event_dict: MutableMapping[str, Any]) -> Any:
        if not wanted:
            return event_dict
        for k in list(event_dict):
            event_dict[k] = REDACTED if k in wanted else scrub(event_dict[k])
        return event_dict

    return redact


def _chain(redact_keys: Iterable[str]) -> list[Any]:
    return [
        structlog.contextvars.merge_contextvars,
        structlog.stdlib.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True, key="timestamp"),
        redactor(redact_keys),
    ]


def configure_logging(*, fmt: str = "json", level: str = "INFO",
                      redact_keys: Iterable[str] = (), stream: Any = None) -> None:
    """Route structlog and stdlib logging (Celery's lines too) through one formatter."""
    keys = tuple(redact_keys)
    shared = _chain(keys)
    renderer: Any = (structlog.processors.JSONRenderer() if fmt == "json"
                     else structlog.dev.ConsoleRenderer(colors=sys.stderr.isatty()))
    structlog.configure(
        processors=[structlog.stdlib.filter_by_level, *shared,
                    structlog.processors.StackInfoRenderer(),
                    structlog.processors.format_exc_info,
                    structlog.stdlib.ProcessorFormatter.wrap_for_formatter],
        logger_factory=structlog.stdlib.LoggerFactory(),
        wrapper_class=structlog.stdlib.BoundLogger,
        cache_logger_on_first_use=False,
    )
    formatter = structlog.stdlib.ProcessorFormatter(
        foreign_pre_chain=[*shared, structlog.processors.format_exc_info],
        processors=[structlog.stdlib.ProcessorFormatter.remove_processors_meta, renderer],
    )
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.setFormatter(formatter)
    root = logging.getLogger()
    for h in list(root.handlers):
        root.removeHandler(h)
    root.addHandler(handler)
    root.setLevel(level)


def ensure_structlog() -> None:
    """In a producer, hand our events to stdlib logging unless the app configured structlog."""
    if structlog.is_configured():
        return
    structlog.configure(
        processors=[structlog.stdlib.filter_by_level, *_chain(()),
                    structlog.processors.format_exc_info,
                    structlog.processors.JSONRenderer()],
        logger_factory=structlog.stdlib.LoggerFactory(),
        wrapper_class=structlog.stdlib.BoundLogger,
    )
