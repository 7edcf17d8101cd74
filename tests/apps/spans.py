"""Spans to a file: what the tracing tests read, from the workers and the test process.

One JSON object a line (name, kind, trace_id, span_id, parent_id, links, attributes,
status, pid), appended with one write each, so that several processes can share a file.
The provider is switchable: the test process can set a global tracer provider only once,
and the tests of other modules must not be traced.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Sequence
from typing import Any

from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor, SpanExporter, SpanExportResult


def _hex(value: int | None, width: int) -> str | None:
    return None if value is None else f"{value:0{width}x}"


class FileExporter(SpanExporter):
    """Appends each finished span to the file named by ``path`` (read at each export)."""

    def __init__(self, path: str | None = None) -> None:
        self.path = path

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        if not self.path:
            return SpanExportResult.SUCCESS
        for s in spans:
            ctx = s.get_span_context()
            assert ctx is not None
            line = json.dumps({
                "name": s.name, "kind": s.kind.name,
                "trace_id": _hex(ctx.trace_id, 32), "span_id": _hex(ctx.span_id, 16),
                "parent_id": _hex(s.parent.span_id if s.parent else None, 16),
                "links": [{"trace_id": _hex(lk.context.trace_id, 32),
                           "span_id": _hex(lk.context.span_id, 16)} for lk in s.links],
                "attributes": dict(s.attributes or {}),
                "status": s.status.status_code.name, "pid": os.getpid(),
            }, default=str) + "\n"
            fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            try:
                os.write(fd, line.encode())
            finally:
                os.close(fd)
        return SpanExportResult.SUCCESS


def install(path: str) -> None:
    """A worker's tracing: the SDK's provider, each span written to ``path`` as it ends."""
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(FileExporter(path)))
    trace.set_tracer_provider(provider)


class _Switch(trace.TracerProvider):
    """The test process's global provider: the SDK's while a test module traces, a no-op
    provider's tracers otherwise."""

    def __init__(self) -> None:
        self.exporter = FileExporter()
        self.sdk = TracerProvider()
        self.sdk.add_span_processor(SimpleSpanProcessor(self.exporter))
        self.on = False

    def get_tracer(self, name: str, *args: Any, **kwargs: Any) -> trace.Tracer:
        return _SwitchTracer(self, self.sdk.get_tracer(name, *args, **kwargs))


class _SwitchTracer(trace.Tracer):
    def __init__(self, switch: _Switch, sdk: trace.Tracer) -> None:
        self.switch, self.sdk = switch, sdk

    def start_span(self, *args: Any, **kwargs: Any) -> trace.Span:
        if self.switch.on:
            return self.sdk.start_span(*args, **kwargs)
        return trace.NoOpTracer().start_span(*args, **kwargs)

    def start_as_current_span(self, *args: Any, **kwargs: Any) -> Any:
        if self.switch.on:
            return self.sdk.start_as_current_span(*args, **kwargs)
        return trace.NoOpTracer().start_as_current_span(*args, **kwargs)


def switch() -> _Switch:
    """The test process's switchable provider, set as the global one on first use."""
    current = trace.get_tracer_provider()
    if isinstance(current, _Switch):
        return current
    made = _Switch()
    trace.set_tracer_provider(made)
    assert trace.get_tracer_provider() is made, "another tracer provider was set first"
    return made


def read(path: str) -> list[dict[str, Any]]:
    """The spans written to ``path``, in the order they ended."""
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


class StallingExporter(SpanExporter):
    """An exporter that blocks (a collector away): the export of a span named ``name`` of
    a saga whose id starts with ``prefix`` waits until ``until(saga_id)``, at most 30 s."""

    def __init__(self, prefix: str, name: str, until: Callable[[str], bool]) -> None:
        self.prefix, self.name, self.until = prefix, name, until

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        for s in spans:
            saga_id = str((s.attributes or {}).get("sagaworker.saga_id", ""))
            if s.name == self.name and saga_id.startswith(self.prefix):
                deadline = time.monotonic() + 30
                while time.monotonic() < deadline and not self.until(saga_id):
                    time.sleep(0.1)
        return SpanExportResult.SUCCESS


def install_stalling(prefix: str, name: str, until: Callable[[str], bool]) -> None:
    """A worker's tracing through a ``StallingExporter`` (spans exported as they end)."""
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(StallingExporter(prefix, name, until)))
    trace.set_tracer_provider(provider)
