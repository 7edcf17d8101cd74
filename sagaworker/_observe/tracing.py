"""Tracing (OpenTelemetry, the extra ``sagaworker[otel]``): one trace follows a saga.

Nothing here imports OpenTelemetry. A tracer provider can only be set through
``opentelemetry.trace``, so while that module is not loaded (the extra is not installed,
or the application set up no tracing) every function below is a no-op costing a dict
look-up, and no trace column is written. Once the application has set a provider
(``opentelemetry.trace.set_tracer_provider``, the SDK's), sagaworker traces through the
API's global one; the API's default proxy and its no-op provider trace nothing.

The context travels in the journal, not in message headers: a step's message may be sent
again by the relay or the sweeper, from a process that never saw the producer's context.
The saga's start span is journaled with the saga; each step's enqueue span (PRODUCER)
with its entry, and every run of the step (``step <tool>``, CONSUMER) is its child; the
run that journals the outcome writes its own context beside it, and the undo
(``compensate <tool>``) is a child of the saga's span with a link to that run. Beside
``opentelemetry-instrumentation-celery`` the step's span stays the enqueue span's child
(its ``run/<task>`` span hangs from its ``apply_async/<task>`` span, which hangs from the
span that published: the enqueue span, or the journaled one a resend publishes under).
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

__all__ = ["NO_SPAN", "Spanned", "add_trace_ids", "enqueue_spans", "finish_parked", "park",
           "resumed", "span", "step_span", "within"]

_PREFIX = "sagaworker."
#: (provider, tracer): the tracer is made again only when the global provider changes
_cache: list[Any] = [None, None]


def _tracer() -> Any:
    """sagaworker's tracer on the global provider; None while there is none to trace to."""
    trace = sys.modules.get("opentelemetry.trace")
    if trace is None:
        return None
    provider = trace.get_tracer_provider()
    if provider is not _cache[0]:
        off = isinstance(provider, trace.ProxyTracerProvider | trace.NoOpTracerProvider)
        _cache[:] = [provider, None if off else provider.get_tracer("sagaworker")]
    return _cache[1]


def _carrier(span: Any) -> str | None:
    """A span's context as journaled: W3C trace context, as JSON text."""
    ctx = span.get_span_context()
    if not ctx.is_valid:  # a no-op tracer's span: nothing to carry
        return None
    out = {"traceparent": f"00-{ctx.trace_id:032x}-{ctx.span_id:016x}-"
                          f"{int(ctx.trace_flags):02x}"}
    if ctx.trace_state:
        out["tracestate"] = ctx.trace_state.to_header()
    return json.dumps(out, separators=(",", ":"))


def _context(carrier: str | None) -> Any:
    """The OpenTelemetry context of a journaled carrier (None: none, or unreadable)."""
    if not carrier:
        return None
    try:
        fields = json.loads(carrier)
    except ValueError:
        return None
    from opentelemetry.context import Context
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    ctx = TraceContextTextMapPropagator().extract(fields, context=Context())
    trace = sys.modules["opentelemetry.trace"]
    return ctx if trace.get_current_span(ctx).get_span_context().is_valid else None


def _start(tracer: Any, name: str, kind: str, parent: str | None, link: str | None,
           attrs: dict[str, Any], start_ns: int | None = None, *, root: bool = False) -> Any:
    """A started span: the child of the journaled ``parent`` (of the current context when
    there is none), linked to the journaled ``link``. ``root``: the first span of a trace
    of its own, linked to the caller's current span (a saga outlives the request that
    began it, and a caller's ``traceparent`` must not choose the saga's trace)."""
    trace = sys.modules["opentelemetry.trace"]
    links = None
    linked = _context(link)
    if linked is not None:
        links = [trace.Link(trace.get_current_span(linked).get_span_context())]
    context = _context(parent)
    if root:
        from opentelemetry.context import Context

        caller = trace.get_current_span().get_span_context()
        if caller.is_valid:
            links = [*(links or []), trace.Link(caller)]
        context = Context()
    return tracer.start_span(
        name, context=context, kind=getattr(trace.SpanKind, kind),
        attributes={_PREFIX + k: v for k, v in attrs.items() if v is not None},
        links=links, start_time=start_ns)


class Spanned:
    """One of sagaworker's spans, or none (tracing off): the context to journal, the
    outcome, and making it current."""

    __slots__ = ("carrier", "span")

    def __init__(self, span: Any) -> None:
        self.span = span
        self.carrier = None if span is None else _carrier(span)

    def set(self, key: str, value: Any) -> None:
        if self.span is not None:
            self.span.set_attribute(_PREFIX + key, value)

    def outcome(self, outcome: str, error: str | None = None) -> None:
        """``sagaworker.outcome``; an ``error`` makes the span's status ERROR."""
        if self.span is None:
            return
        self.span.set_attribute(_PREFIX + "outcome", outcome)
        if error is not None:
            from opentelemetry.trace import Status, StatusCode

            self.span.set_status(Status(StatusCode.ERROR, error[:500]))

    def fail(self, exc: BaseException, text: str | None = None) -> None:
        """What was raised inside the span: an ``exception`` event and the ERROR status.
        Its message only as ``text`` gives it (redacted: an exception's own text, or its
        traceback's, may quote a secret argument or a statement's parameters)."""
        if self.span is None:
            return
        from opentelemetry.trace import Status, StatusCode

        kind = type(exc)
        attrs = {"exception.type": f"{kind.__module__}.{kind.__qualname__}"}
        if text is not None:
            attrs["exception.message"] = text
        self.span.add_event("exception", attrs)
        self.span.set_status(Status(StatusCode.ERROR, (text or kind.__name__)[:500]))

    @contextmanager
    def current(self) -> Iterator[None]:
        """The span as the current one (log lines carry its ids), never ended here."""
        if self.span is None:
            yield
            return
        trace = sys.modules["opentelemetry.trace"]
        with trace.use_span(self.span, end_on_exit=False, record_exception=False,
                            set_status_on_exception=False):
            yield

    def end(self) -> None:
        if self.span is not None:
            self.span.end()


NO_SPAN = Spanned(None)


@contextmanager
def span(name: str, *, parent: str | None = None, link: str | None = None,
         kind: str = "INTERNAL", root: bool = False, **attrs: Any) -> Iterator[Spanned]:
    """A span around a block, current inside it; what the block raises is its error
    (``root``: a trace of its own, linked to the caller's span)."""
    tracer = _tracer()
    if tracer is None:
        yield NO_SPAN
        return
    s = Spanned(_start(tracer, name, kind, parent, link, attrs, root=root))
    try:
        with s.current():
            yield s
    except BaseException as exc:
        s.fail(exc)
        raise
    finally:
        s.end()


def enqueue_spans(saga_id: str, tools: Sequence[str], parent: str | None
                  ) -> list[Spanned] | None:
    """One PRODUCER span per step about to be journaled (None when tracing is off)."""
    tracer = _tracer()
    if tracer is None:
        return None
    return [Spanned(_start(tracer, f"enqueue {t}", "PRODUCER", parent, None,
                           {"saga_id": saga_id, "tool": t})) for t in tools]


def step_span(tool: str, saga_id: str, seq: int, attempt: int, parent: str | None,
              start_ns: int) -> Spanned:
    """A run of a step: the child of its journaled enqueue span (CONSUMER)."""
    tracer = _tracer()
    if tracer is None:
        return NO_SPAN
    return Spanned(_start(tracer, f"step {tool}", "CONSUMER", parent, None,
                          {"saga_id": saga_id, "seq": seq, "tool": tool, "attempt": attempt},
                          start_ns))


@contextmanager
def within(carrier: str | None) -> Iterator[None]:
    """A journaled context made current, with no span of its own: what a message sent
    again (the relay, the sweeper, after an app's COMMIT) is published under, so that a
    publish span of an instrumented Celery joins the saga's trace."""
    ctx = None if carrier is None or _tracer() is None else _context(carrier)
    if ctx is None:
        yield
        return
    from opentelemetry import context as context_api

    token = context_api.attach(ctx)
    try:
        yield
    finally:
        context_api.detach(token)


#: step spans whose tool raised, by task id: Celery's verdict (a retry, or the step
#: FAILED in ``on_failure``) ends them, so the FAILED write and its log lines are inside
_parked: dict[str, Spanned] = {}


def park(task_id: str, s: Spanned) -> None:
    if s.span is not None:
        _parked[task_id] = s


def finish_parked(task_id: str, outcome: str) -> None:
    s = _parked.pop(task_id, None)
    if s is not None:
        s.outcome(outcome)
        s.end()


@contextmanager
def resumed(task_id: str) -> Iterator[Spanned]:
    """The parked span of ``task_id`` current again for a block, then ended."""
    s = _parked.pop(task_id, None)
    if s is None:
        yield NO_SPAN
        return
    try:
        with s.current():
            yield s
    finally:
        s.end()


def add_trace_ids(_logger: Any, _method: str, event_dict: Any) -> Any:
    """Log processor: the current span's ``trace_id`` and ``span_id`` on each line."""
    trace = sys.modules.get("opentelemetry.trace")
    if trace is not None:
        ctx = trace.get_current_span().get_span_context()
        if ctx.is_valid:
            event_dict.setdefault("trace_id", f"{ctx.trace_id:032x}")
            event_dict.setdefault("span_id", f"{ctx.span_id:016x}")
    return event_dict
