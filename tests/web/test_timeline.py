"""The saga page's timeline: forward steps and undos on one time axis, from the journal."""

from __future__ import annotations

import itertools
import json
import re

import pytest
from flask.testing import FlaskClient
from pydantic import ValidationError
from sqlalchemy import update

from sagaworker import Sagaworker, Settings
from sagaworker._journal.schema import entries

from .journal import Tools, awaiting_approval, compensated, run_step

ROW = re.compile(r'<g class="tl-row ph-row-([a-z-]+)" data-seq="(\d+)">(.*?)</g>', re.S)


def rows(client: FlaskClient, saga_id: str) -> list[tuple[str, int, list[str], str]]:
    """(phase, seq, the bars' kinds in drawing order, the row's markup) per row."""
    page = client.get(f"/ui/sagas/{saga_id}")
    assert page.status_code == 200
    html = page.get_data(as_text=True)
    svg = html[html.index('<svg class="tl"'):html.index("</svg>")]
    return [(phase, int(seq), re.findall(r'class="tl-bar tl-([a-z-]+)"', body), body)
            for phase, seq, body in ROW.findall(svg)]


def test_every_step_and_undo_is_drawn_in_seq_order(client: FlaskClient, sw: Sagaworker,
                                                   tools: Tools) -> None:
    """A dirty saga: each row a step in seq order, its bars queued then ran (coloured by
    outcome), then its undo's mark (COMPENSATED, SKIPPED, COMPENSATION_FAILED); the FAILED
    step has no undo. Each bar's title holds its times."""
    compensated(sw, tools, "order-tl", card="stuck-77")
    got = rows(client, "order-tl")
    assert [(phase, seq, bars) for phase, seq, bars, _ in got] == [
        ("executed", 1, ["queued", "executed", "undo-compensated"]),
        ("executed", 2, ["queued", "executed", "undo-skipped"]),
        ("executed", 3, ["queued", "executed", "undo-compensation-failed"]),
        ("failed", 4, ["queued", "failed"]),
    ]
    titles = re.findall(r"<title>(.*?)</title>", got[2][3])
    assert titles[1].startswith("executed: ran ") and "(0.013 s), attempt 1" in titles[1]
    assert titles[2].startswith("undo COMPENSATION_FAILED at ") and "after 1 try" in titles[2]
    assert 'id="timeline"' in client.get("/ui/sagas/order-tl").get_data(as_text=True)


def test_a_gate_is_drawn_waiting_then_decided(client: FlaskClient, sw: Sagaworker,
                                             tools: Tools) -> None:
    """A gated step waits (its bar open, "still waiting"); once approved and run, the
    gate's bar ends at the decision and the run follows."""
    awaiting_approval(sw, tools, "order-gate")
    waiting = rows(client, "order-gate")
    assert [(seq, bars) for _, seq, bars, _ in waiting] == [
        (1, ["queued", "executed"]), (2, ["gate"])]
    assert "still waiting" in waiting[1][3]
    token = next(p.token for p in sw.pending_approvals() if p.saga_id == "order-gate")
    sw.approve(token, approver="ops@example.com")
    run_step(sw, "order-gate", 2, "ship-order-gate")
    decided = rows(client, "order-gate")
    assert decided[1][2] == ["gate", "queued", "executed"]
    assert "still waiting" not in decided[1][3]


def test_a_row_links_to_its_trace(client: FlaskClient, sw: Sagaworker, tools: Tools) -> None:
    """With SAGAWORKER_TRACE_URL set, a step whose trace context is journaled links to
    its trace; one without a context links nowhere. A template without {trace_id} is
    refused when the settings are read."""
    compensated(sw, tools, "order-tr")
    trace_id = "4bf92f3577b34da6a3ce929d0e0e4736"
    with sw.journal.engine.begin() as conn:
        conn.execute(update(entries).where(entries.c.saga_id == "order-tr",
                                           entries.c.seq == 1)
                     .values(trace_context=json.dumps(
                         {"traceparent": f"00-{trace_id}-00f067aa0ba902b7-01"})))
    sw.settings = sw.settings.model_copy(
        update={"trace_url": "https://tempo.example/trace/{trace_id}"})
    got = rows(client, "order-tr")
    assert f'<a href="https://tempo.example/trace/{trace_id}"' in got[0][3]
    assert "<a " not in got[1][3]
    with pytest.raises(ValidationError, match=r"must hold \{trace_id\}"):
        Settings(trace_url="https://tempo.example/trace/")


def test_a_hundred_steps_stay_readable(client: FlaskClient, sw: Sagaworker,
                                       tools: Tools) -> None:
    """100 steps: 100 rows, one under the other (no two overlap), the picture as tall as
    its rows (the page scrolls it)."""
    saga = sw.begin("order-100")
    for seq in range(1, 101):
        saga.enqueue(tools.quote, f"{seq:05d}")
        run_step(sw, "order-100", seq, seq)
    got = rows(client, "order-100")
    assert [seq for _, seq, _, _ in got] == list(range(1, 101))
    ys = [float(re.search(r'<rect [^>]*y="([\d.]+)"', body).group(1))  # type: ignore[union-attr]
          for _, _, _, body in got]
    assert all(b - a >= 16 for a, b in itertools.pairwise(ys))
    html = client.get("/ui/sagas/order-100").get_data(as_text=True)
    height = int(re.search(r'<svg class="tl"[^>]*height="(\d+)"', html).group(1))  # type: ignore[union-attr]
    assert height == 24 + 16 * 100 + 8
