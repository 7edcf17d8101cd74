"""Logging for the example app's web process and scripts (workers configure themselves)."""

from __future__ import annotations

from sagaworker import Settings, configure_logging


def setup() -> None:
    s = Settings()
    configure_logging(fmt=s.log_format, level=s.log_level, redact_keys=s.redact_keys)
