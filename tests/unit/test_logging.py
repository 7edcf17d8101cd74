"""Structured logs: JSON lines with the SPEC's fields; redaction is one processor."""

from __future__ import annotations

import io
import json
import logging

import structlog

from sagaworker import configure_logging
from sagaworker._observe.logging import REDACTED, redactor


def test_json_lines_carry_bound_context_and_redact() -> None:
    """Events render as one JSON object a line with timestamp, level and bound context."""
    buf = io.StringIO()
    configure_logging(fmt="json", level="INFO", redact_keys=["card"], stream=buf)
    try:
        log = structlog.get_logger("sagaworker")
        with structlog.contextvars.bound_contextvars(saga_id="s-1", seq=2, tool="t"):
            log.error("compensation_failed", dirty_state=True, detail="x", attempts=3,
                      kwargs={"card": "4242", "amount": 5})
        log.critical("saga_compensation_failed", dirty_tools=["t"])
        logging.getLogger("celery.worker").info("celery says hi")
    finally:
        logging.getLogger().handlers.clear()
    lines = [json.loads(x) for x in buf.getvalue().splitlines()]
    first = lines[0]
    assert first["event"] == "compensation_failed" and first["level"] == "error"
    assert (first["saga_id"], first["seq"], first["tool"]) == ("s-1", 2, "t")
    assert first["dirty_state"] is True and first["timestamp"].endswith("Z")
    assert first["kwargs"] == {"card": REDACTED, "amount": 5}
    assert lines[1]["level"] == "critical" and "saga_id" not in lines[1]
    assert lines[2]["event"] == "celery says hi" and lines[2]["level"] == "info"


def test_redactor_scrubs_nested_values() -> None:
    """Listed keys are replaced at any depth, other values kept."""
    out = redactor(["password"])(None, "info", {"a": [{"password": "p", "b": 1}],
                                                "password": "x"})
    assert out == {"a": [{"password": REDACTED, "b": 1}], "password": REDACTED}
