"""Tracing behind the otel extra: nothing imported or written without it; in one process
(sagaworker.testing's, on SQLite) the spans and the journaled contexts it makes."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

#: a saga of three steps whose third fails, run in this process on a SQLite journal;
#: prints one JSON line: the journal's trace columns and the opentelemetry modules loaded
SAGA = """
import json, sys
from celery import Celery
from sagaworker import CompensationContext, SagaStatus, Sagaworker
from sagaworker.testing import harness

sw = Sagaworker(Celery("t", broker="memory://"), database_url="sqlite:///" + sys.argv[1])

@sw.tool(compensable_by="release")
def hold(name: str) -> str:
    return name

@sw.compensation
def release(ctx: CompensationContext) -> None:
    pass

with harness(sw) as plan:
    plan.fail_at = 3
    res = sw.saga("t-1", lambda s: [s.call(hold, n) for n in ("a", "b", "c")])
    assert res.status is SagaStatus.COMPENSATED, res
    saga = sw.journal.saga_row("t-1")
    entries = [sw.journal.entry_row("t-1", n) for n in (1, 2, 3)]
    columns = {"saga": saga.trace_context,
               "entries": [[e.trace_context, e.span_context] for e in entries]}
print(json.dumps({"columns": columns,
                  "modules": sorted(m for m in sys.modules if m.startswith("opentelemetry")
                                    and sys.modules[m] is not None)}))
"""

#: the same saga, traced: an SDK provider whose spans are kept in memory
TRACED = """
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

exporter = InMemorySpanExporter()
provider = TracerProvider()
provider.add_span_processor(SimpleSpanProcessor(exporter))
trace.set_tracer_provider(provider)
"""

SPANS = """
got = exporter.get_finished_spans()
names = {s.context.span_id: s.name for s in got}
print(json.dumps([[s.name, s.kind.name, names.get(s.parent.span_id) if s.parent else None,
                   [names.get(lk.context.span_id) for lk in s.links],
                   s.attributes.get("sagaworker.seq"), s.attributes.get("sagaworker.outcome"),
                   s.status.status_code.name, len({x.context.trace_id for x in got})]
                  for s in got]))
"""


def _run(code: str, tmp_path: Path) -> list[str]:
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code),
                           str(tmp_path / "j.db")], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout.strip().splitlines()


def test_importing_sagaworker_imports_no_opentelemetry(tmp_path: Path) -> None:
    """`import sagaworker` (and its parts) loads no opentelemetry module."""
    out = _run("import sys, sagaworker, sagaworker.testing, sagaworker.cli, "
               "sagaworker._observe.tracing\n"
               "print(sorted(m for m in sys.modules if m.startswith('opentelemetry')))",
               tmp_path)
    assert out == ["[]"]


def test_without_opentelemetry_a_saga_runs_and_writes_no_context(tmp_path: Path) -> None:
    """OpenTelemetry not importable at all: a failing saga compensates as always, and no
    trace column is written."""
    out = _run("import sys\nsys.modules['opentelemetry'] = None\n" + SAGA, tmp_path)
    assert json.loads(out[-1]) == {
        "columns": {"saga": None, "entries": [[None, None], [None, None], [None, None]]},
        "modules": []}


def test_installed_but_no_provider_writes_no_context(tmp_path: Path) -> None:
    """The API imported, no provider set (the API's proxy): nothing traced or journaled."""
    out = _run("import opentelemetry.trace\n" + SAGA, tmp_path)
    assert json.loads(out[-1])["columns"] == {
        "saga": None, "entries": [[None, None], [None, None], [None, None]]}


def test_traced_saga_spans_and_journaled_contexts(tmp_path: Path) -> None:
    """Traced: the saga's start, each enqueue (PRODUCER), each run (CONSUMER, the child of
    its enqueue), the FAILED run in error, and the undos (children of the saga's span,
    linked to their runs); the contexts journaled on SQLite."""
    out = _run(TRACED + SAGA + SPANS, tmp_path)
    journal, got = json.loads(out[-2]), json.loads(out[-1])
    cols = journal["columns"]
    assert cols["saga"] is not None and all(e[0] for e in cols["entries"])
    # the outcome's run context is written with EXECUTED only (what an undo links to)
    assert [e[1] is not None for e in cols["entries"]] == [True, True, False]
    hold, step = "__main__.hold", "step __main__.hold"
    # in the order they ended: in this one process a step runs inside its enqueue's
    # publish, and the failure's undos inside the FAILED run's on_failure
    assert [g[:7] for g in got] == [
        ["saga begin", "INTERNAL", None, [], None, None, "UNSET"],
        [step, "CONSUMER", f"enqueue {hold}", [], 1, "executed", "UNSET"],
        [f"enqueue {hold}", "PRODUCER", "saga begin", [], 1, None, "UNSET"],
        [step, "CONSUMER", f"enqueue {hold}", [], 2, "executed", "UNSET"],
        [f"enqueue {hold}", "PRODUCER", "saga begin", [], 2, None, "UNSET"],
        [f"compensate {hold}", "INTERNAL", "saga begin", [step], 2, "compensated", "UNSET"],
        [f"compensate {hold}", "INTERNAL", "saga begin", [step], 1, "compensated", "UNSET"],
        [step, "CONSUMER", f"enqueue {hold}", [], 3, "failed", "ERROR"],
        [f"enqueue {hold}", "PRODUCER", "saga begin", [], 3, None, "UNSET"],
    ]
    assert {g[7] for g in got} == {1}  # one trace


#: a payment whose error quotes its card, with SAGAWORKER_REDACT=card: every span exported
#: (attributes, events, status) printed as one JSON line
SECRET = """
import json, sys
from celery import Celery
from sagaworker import SagaStatus, Sagaworker, Settings
from sagaworker.testing import harness

sw = Sagaworker(Celery("t", broker="memory://"),
                settings=Settings(database_url="sqlite:///" + sys.argv[1], redact="card"))

@sw.tool()
def pay(card: str) -> str:
    raise ValueError(f"card {card} declined")

with harness(sw) as plan:
    res = sw.saga("t-1", lambda s: s.call(pay, "4000111122223333"))
    assert res.status is SagaStatus.COMPENSATED, res
got = exporter.get_finished_spans()
print(json.dumps([[s.name, s.status.status_code.name, s.status.description, dict(s.attributes),
                   [[e.name, dict(e.attributes)] for e in s.events]] for s in got]))
"""


def test_a_failed_steps_span_quotes_no_redacted_value(tmp_path: Path) -> None:
    """The FAILED run's status and exception event carry the redacted error text."""
    out = _run(TRACED + SECRET, tmp_path)
    runs = [s for s in json.loads(out[-1]) if s[0] == "step __main__.pay"]
    assert [(r[1], r[2], r[4]) for r in runs] == [(
        "ERROR", "ValueError: card [REDACTED] declined",
        [["exception", {"exception.type": "builtins.ValueError",
                        "exception.message": "ValueError: card [REDACTED] declined"}]])]
    assert "4000111122223333" not in out[-1]


CALLER = """
import json, sys
from celery import Celery
from sagaworker import Sagaworker

sw = Sagaworker(Celery("t", broker="memory://"), database_url="sqlite:///" + sys.argv[1])
sw.journal.create_all()
with trace.get_tracer("web").start_as_current_span("POST /orders") as request:
    sw.begin("c-1")
got = {s.name: s for s in exporter.get_finished_spans()}
begin, caller = got["saga begin"], got["POST /orders"]
print(json.dumps({"parent": begin.parent.span_id if begin.parent else None,
                  "same_trace": begin.context.trace_id == caller.context.trace_id,
                  "links": [lk.context.span_id == caller.context.span_id
                            for lk in begin.links]}))
"""


def test_a_saga_begun_inside_a_callers_span_starts_a_trace_linked_to_it(
        tmp_path: Path) -> None:
    """A web request's span (its ``traceparent``) is current when the saga begins: the
    saga gets a trace of its own, linked to the request's span, not the request's trace
    (a caller never chooses the trace every worker and undo of the saga joins)."""
    out = _run(TRACED + CALLER, tmp_path)
    assert json.loads(out[-1]) == {"parent": None, "same_trace": False, "links": [True]}
