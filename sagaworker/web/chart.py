"""The saga page's timeline: every forward step and its undo on one time axis (SVG).

Drawn on the server from the journal's own timestamps (the database's clock), so it needs
no script and passes the pages' strict CSP (colours come from the stylesheet's classes):

- a gate's wait: ``approval_requested_at`` to the decision (or now, still waiting);
- queued: journaled (or approved) to the start of the last attempt;
- the run: the last attempt, ``duration_ms`` back from its outcome (EXECUTED at
  ``executed_at``; FAILED, CANCELLED and in doubt at the entry's last write);
- the undo: its last try's outcome at ``compensated_at`` (the journal keeps no start of a
  try: a mark, with the number of tries in its title).

Every bar's title holds the exact times; with ``SAGAWORKER_TRACE_URL`` set and the step's
trace context journaled, the step's row links to its trace.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

from markupsafe import Markup, escape

from .._base.units import MODEL_REQUEST, step_label, unit_kind

__all__ = ["Bar", "Row", "render", "rows_of"]

ROW, LEFT, WIDTH, TOP = 16, 190, 860, 24
MIN_BAR = 3.0


@dataclass(frozen=True)
class Bar:
    kind: str  # gate, queued, executed, model, failed, cancelled, in-doubt, running, undo-*
    start: datetime
    end: datetime
    title: str


@dataclass(frozen=True)
class Row:
    seq: int
    tool: str
    phase: str
    bars: list[Bar]
    trace_id: str | None


def _aware(t: Any) -> datetime | None:
    if t is None:
        return None
    when: datetime = t
    return when if when.tzinfo is not None else when.replace(tzinfo=UTC)


def _at(t: datetime) -> str:
    return t.astimezone(UTC).strftime("%H:%M:%S.%f")[:-3]


def trace_id_of(carrier: Any) -> str | None:
    """The trace id of a journaled W3C context (``{"traceparent": "00-<id>-..."}``)."""
    if not carrier:
        return None
    try:
        parent = json.loads(carrier).get("traceparent", "")
        trace_id = parent.split("-")[1]
    except (ValueError, AttributeError, IndexError):
        return None
    return trace_id if len(trace_id) == 32 and trace_id.strip("0") else None


def rows_of(rows: list[Any], now: datetime) -> list[Row]:
    """One row per entry (raw journal rows, in seq order)."""
    return [_row(r, now) for r in rows]


def _row(r: Any, now: datetime) -> Row:
    bars: list[Bar] = []
    created, updated = _aware(r.created_at), _aware(r.updated_at)
    assert created is not None and updated is not None
    asked = _aware(r.approval_requested_at)
    decided = _aware(r.approved_at) or _aware(r.rejected_at)
    if asked is not None:
        bars.append(Bar("gate", asked, decided or now,
                        f"waiting at the gate {_at(asked)} → "
                        + (_at(decided) if decided else "still waiting")))
    queued_from = decided if decided is not None and r.approved_at is not None else created
    phase = str(r.phase)
    end = _aware(r.executed_at) if phase == "EXECUTED" else updated
    if phase in ("INTENT",):
        bars.append(Bar("queued", queued_from, now, f"queued {_at(queued_from)} → now"))
    elif phase in ("EXECUTED", "FAILED") and end is not None:
        took = timedelta(milliseconds=float(r.duration_ms or 0))
        start = max(queued_from, end - took)
        bars.append(Bar("queued", queued_from, start,
                        f"queued {_at(queued_from)} → {_at(start)}"))
        kind = "in-doubt" if r.in_doubt else phase.lower()
        what = phase.lower()
        if kind == "executed" and unit_kind(str(r.tool_name)) == MODEL_REQUEST:
            kind, what = "model", MODEL_REQUEST  # an agent's model turn
        bars.append(Bar(kind, start, end, f"{what}: ran {_at(start)} → {_at(end)} "
                        f"({took.total_seconds():.3f} s), attempt {r.attempts}"))
    elif phase == "CANCELLED":
        bars.append(Bar("cancelled", queued_from, updated,
                        f"cancelled at {_at(updated)} (never ran)"))
    compensated = _aware(r.compensated_at)
    if r.compensation and compensated is not None:
        outcome = str(r.compensation).lower().replace("_", "-")
        tries = r.compensation_attempts
        bars.append(Bar(f"undo-{outcome}", compensated, compensated,
                        f"undo {r.compensation} at {_at(compensated)} after {tries} "
                        f"tr{'y' if tries == 1 else 'ies'}"))
    return Row(r.seq, step_label(str(r.tool_name)), phase, bars,
               trace_id_of(getattr(r, "trace_context", None)))


def render(saga_created: datetime, rows: list[Row], trace_url: str | None) -> Markup:
    """The SVG: a row per step, a time axis in seconds from the saga's start."""
    t0 = saga_created
    ends = [b.end for row in rows for b in row.bars] or [t0]
    span = max((max(ends) - t0).total_seconds(), 0.001)
    scale = WIDTH / span
    height = TOP + ROW * len(rows) + 8

    def x(t: datetime) -> float:
        return LEFT + max(0.0, (t - t0).total_seconds()) * scale

    out = [f'<svg class="tl" id="timeline" xmlns="http://www.w3.org/2000/svg" '
           f'width="{LEFT + WIDTH + 50}" height="{height}" role="img" '
           f'aria-label="timeline of {len(rows)} steps over {span:.3f} s">']
    for i in range(6):
        tx = LEFT + WIDTH * i / 5
        out.append(f'<line class="tl-tick" x1="{tx:.1f}" y1="{TOP - 6}" x2="{tx:.1f}" '
                   f'y2="{height}"/><text class="tl-axis" x="{tx:.1f}" y="{TOP - 10}">'
                   f'{span * i / 5:.{_digits(span)}f} s</text>')
    for i, row in enumerate(rows):
        y = TOP + ROW * i
        label = escape(f"#{row.seq} {row.tool}")
        out.append(f'<g class="tl-row ph-row-{row.phase.lower().replace("_", "-")}" '
                   f'data-seq="{row.seq}"><text class="tl-label" x="4" y="{y + 11}">'
                   f'{label}</text>')
        link = (trace_url.replace("{trace_id}", row.trace_id)
                if trace_url and row.trace_id else None)
        if link:
            out.append(f'<a href="{escape(link)}" target="_blank" rel="noopener">')
        for b in row.bars:
            left, right = x(b.start), x(b.end)
            w = max(right - left, MIN_BAR)
            out.append(f'<rect class="tl-bar tl-{b.kind}" x="{left:.1f}" y="{y + 2}" '
                       f'width="{w:.1f}" height="{ROW - 4}"><title>{escape(b.title)}'
                       f'</title></rect>')
        if link:
            out.append("</a>")
        out.append("</g>")
    out.append("</svg>")
    return Markup("".join(out))


def _digits(span: float) -> int:
    return 0 if span >= 50 else 1 if span >= 5 else 2 if span >= 0.5 else 3
