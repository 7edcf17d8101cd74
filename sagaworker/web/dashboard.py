"""The server-rendered dashboard: what needs a human first, then every saga, newest first."""

from __future__ import annotations

import json
import shlex
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any
from urllib.parse import quote

from flask import Blueprint, abort, g, render_template, request
from markupsafe import Markup

from sagaworker import (
    ConfigurationError,
    EntryRecord,
    Outcome,
    Phase,
    Redaction,
    SagaNotFound,
    SagaRecord,
    SagaStatus,
    SealedElsewhere,
)
from sagaworker._base.errors import JournalUnavailable
from sagaworker._base.units import model_turn, step_label, turn_line
from sagaworker._observe.records import waiting_step
from sagaworker._observe.visible import visible

from . import chart
from .api import auth, operator, sw_of
from .auth import Identity
from .queries import diverged_sagas, idle_sagas

__all__ = ["Attention", "Ops", "TimelineUndo", "bp", "register_filters"]

bp = Blueprint("dashboard", __name__)

STATUSES = [s.value for s in SagaStatus]
#: sagas scanned for in-doubt steps (COMPENSATION_FAILED ones are queried by status)
SCAN = 500


@dataclass(frozen=True)
class Attention:
    """A saga a human must look at, and why."""

    rec: SagaRecord
    dirty: list[Outcome]
    in_doubt: list[EntryRecord]


@dataclass(frozen=True)
class TimelineUndo:
    order: int
    outcome: Outcome
    entry: EntryRecord | None


@dataclass(frozen=True)
class Ops:
    """What the page offers operators: ``enabled`` False is the read-only app (no buttons,
    a banner); ``operator`` is known when the proxy's header came with the page request,
    otherwise the script signs in with a bearer token kept in ``sessionStorage``.
    ``viewers``: viewer tokens sign in too (to read); ``reader``: who reads this page."""

    enabled: bool
    tokens: bool
    header: str | None
    operator: Identity | None
    viewers: bool = False
    reader: Identity | None = None


@bp.app_context_processor
def _ops() -> dict[str, Any]:
    a = auth()
    return {"ops": Ops(a.configured, a.uses_tokens, a.trusted_header,
                       operator() if a.configured else None, a.uses_viewer_tokens,
                       g.get("reader")),
            # the app the dashboard serves, by its Celery name (``Celery("shop")``)
            "app_name": str(sw_of().app.main or "sagaworker")}


def attention(recent: list[SagaRecord], dirty: list[SagaRecord]) -> list[Attention]:
    seen: dict[str, Attention] = {}
    for rec in [*dirty, *recent]:
        if rec.saga_id in seen:
            continue
        if rec.status is SagaStatus.COMPENSATION_FAILED or rec.report.in_doubt:
            seen[rec.saga_id] = Attention(rec, rec.report.dirty, rec.report.in_doubt)
    return sorted(seen.values(), key=lambda a: a.rec.updated_at, reverse=True)


@bp.get("/")
def index() -> str:
    sw = sw_of()
    status = request.args.get("status") or None
    if status is not None and status not in STATUSES:
        abort(400, f"unknown status {status!r}; one of {', '.join(STATUSES)}")
    red = Redaction.of(sw)  # SAGAWORKER_REDACT: no page shows a redacted argument
    # a saga the journal cannot read is shown as such, never a 500 for the whole page
    scanned, unreadable = sw.journal.scan_sagas(None, SCAN)
    recent = [red.record(r) for r in scanned]
    dirty = [red.record(r) for r in sw.sagas(status=SagaStatus.COMPENSATION_FAILED, limit=100)]
    if status is None:
        listed = recent[:100]
    else:
        found, more = sw.journal.scan_sagas(status, 100)
        listed = [red.record(r) for r in found]
        named = {u.saga_id for u in unreadable}
        unreadable += [u for u in more if u.saga_id not in named]
    counts = {s: sum(1 for r in recent if r.status.value == s) for s in STATUSES}
    approvals: list[Any] | None
    try:
        # fingerprints of redacted values are for operators only (their sign-in too)
        who = g.get("reader")
        marks = red if who is not None and who.role == "operator" else red.unmarked()
        approvals = [marks.approval(a) for a in sw.pending_approvals()]
    except JournalUnavailable:  # logged; the page says only that (create_app)
        raise
    except ConfigurationError:
        approvals = None  # no approval secret configured here
    idle = [red.record(r) for r in idle_sagas(sw)]
    diverged = [red.record(r) for r in diverged_sagas(sw)]
    return render_template("index.html", sagas=listed, status=status, statuses=STATUSES,
                           counts=counts, scanned=len(recent), idle=idle, diverged=diverged,
                           attention=attention(recent, dirty), approvals=approvals,
                           unreadable=unreadable)


@bp.get("/ui/sagas/<saga_id:saga_id>")
def saga_page(saga_id: str) -> str:
    sw = sw_of()
    try:
        rec = Redaction.of(sw).record(sw.inspect(saga_id))
    except SagaNotFound:
        abort(404, f"no saga {saga_id!r} in the journal")
    except SealedElsewhere as exc:  # a value copied in with SQL: not shown, said why
        abort(409, str(exc))
    except JournalUnavailable:  # logged; the page says only that (create_app)
        raise
    except ConfigurationError as exc:  # no key here opens it (as the API's 503)
        abort(503, str(exc))
    by_seq = {e.seq: e for e in rec.entries}
    undos = [TimelineUndo(i, o, by_seq.get(o.seq))
             for i, o in enumerate(rec.report.outcomes, start=1)]
    _saga, rows = sw.journal.saga_and_entries(saga_id)
    timeline = chart.render(rec.created_at, chart.rows_of(rows, datetime.now(UTC)),
                            sw.settings.trace_url)
    return render_template("saga.html", rec=rec, undos=undos, waiting=waiting_step(rec),
                           timeline=timeline)


def _short_tool(name: str) -> str:
    return step_label(name)


def _when(t: datetime | None) -> str:
    return "" if t is None else t.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


def _ago(t: datetime | None, now: datetime | None = None) -> str:
    if t is None:
        return ""
    s = int(((now or datetime.now(UTC)) - t).total_seconds())
    if s < 0:
        return "just now"
    for unit, size in (("d", 86400), ("h", 3600), ("min", 60)):
        if s >= size:
            return f"{s // size} {unit} ago"
    return f"{s} s ago"


def _js(v: Any) -> str:
    return json.dumps(v, default=str, ensure_ascii=False)


def _args(e: EntryRecord | SagaRecord) -> str:
    """A step's arguments, or a flow saga's (``name=value`` for keywords)."""
    if isinstance(e, SagaRecord):
        args, kwargs = e.flow_args or [], e.flow_kwargs or {}
    else:
        args, kwargs = e.args, e.kwargs
    parts = [_js(a) for a in args] + [f"{k}={_js(v)}" for k, v in kwargs.items()]
    return ", ".join(parts)


def _css(value: Any) -> str:
    return str(getattr(value, "value", value)).lower().replace("_", "-")


def _shown(value: Any) -> Any:
    """Every ``{{ }}`` of the pages: text with a right-to-left override, an isolate or a
    zero-width character shows them escaped (``\u202e``), so an approver reads the saga
    and the arguments the journal holds. Markup (a macro's HTML) was shown piece by piece."""
    if isinstance(value, str) and not isinstance(value, Markup):
        return visible(value)
    return value


def _segment(saga_id: str) -> str:
    """The exact id, percent-encoded (the script decodes it to name the saga it decides)."""
    return quote(saga_id, safe="")


def register_filters(app: Any) -> None:
    app.jinja_env.finalize = _shown
    app.jinja_env.filters.update(tool=_short_tool, when=_when, ago=_ago, js=_js,
                                 args=_args, css=_css, segment=_segment,
                                 sh=shlex.quote,  # a command to copy: the id one argument
                                 model_turn=lambda e: model_turn(e.tool_name, e.result),
                                 turn_line=turn_line)
    app.jinja_env.globals.update(Phase=Phase, SagaStatus=SagaStatus)
    app.context_processor(lambda: {"now": datetime.now(UTC)})
