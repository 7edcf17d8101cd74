"""The alert matchers in docs/alerting (data, LogQL, VRL) against real sagaworker log lines."""

from __future__ import annotations

import io
import json
import logging
import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import structlog
import yaml

import sagaworker
from sagaworker import Sagaworker

from .journal import Tools, compensated, completed, make_sw

DOCS = Path(__file__).resolve().parents[2] / "docs" / "alerting"
Line = dict[str, Any]


def rules() -> list[dict[str, Any]]:
    data: dict[str, Any] = yaml.safe_load((DOCS / "rules.yml").read_text())
    return list(data["rules"])


# -- the three representations of a matcher --------------------------------------------------

def data_match(match: dict[str, Any], line: Line) -> bool:
    return all(k in line and line[k] == v for k, v in match.items())


def logql_filters(expr: str) -> list[tuple[str, str, str]]:
    """The label filters after ``| json`` in a LogQL expression: (label, op, value)."""
    m = re.search(r"\|\s*json\s*((?:\|\s*\w+\s*(?:=~|!=|=)\s*\"[^\"]*\"\s*)+)\[", expr)
    assert m, f"no `| json | label=\"value\"` pipeline in {expr!r}"
    return re.findall(r"\|\s*(\w+)\s*(=~|!=|=)\s*\"([^\"]*)\"", m.group(1))


def logql_value(v: Any) -> str:
    """What Loki's json parser makes of a JSON value: every extracted label is a string."""
    if isinstance(v, bool):
        return "true" if v else "false"
    return v if isinstance(v, str) else json.dumps(v)


def logql_match(filters: list[tuple[str, str, str]], line: Line) -> bool:
    for label, op, value in filters:
        got = logql_value(line[label]) if label in line else ""
        if op == "=" and got != value:
            return False
        if op == "!=" and got == value:
            return False
        if op == "=~" and not re.fullmatch(value, got):
            return False
    return True


def vrl_terms(condition: str) -> dict[str, Any]:
    """A VRL condition of the form ``.a == "x" && .b == true`` as {field: value}."""
    terms: dict[str, Any] = {}
    for part in condition.split("&&"):
        m = re.fullmatch(r"\s*\.(\w+)\s*==\s*(.+?)\s*", part)
        assert m, f"unsupported VRL term {part!r}"
        terms[m.group(1)] = json.loads(m.group(2))
    return terms


def vrl_match(terms: dict[str, Any], line: Line) -> bool:
    return all(k in line and line[k] == v and type(line[k]) is type(v)
               for k, v in terms.items())


def loki_exprs() -> dict[str, str]:
    doc = yaml.safe_load((DOCS / "loki-rules.yml").read_text())
    return {r["alert"]: r["expr"] for g in doc["groups"] for r in g["rules"]}


def vrl_routes() -> dict[str, str]:
    doc = yaml.safe_load((DOCS / "vector.yaml").read_text())
    routes: dict[str, str] = doc["transforms"]["alerts"]["route"]
    return routes


def fires(rule: dict[str, Any], line: Line) -> set[str]:
    """Which representations of ``rule`` fire on ``line`` (all or none, when consistent)."""
    got = set()
    if data_match(rule["match"], line):
        got.add("data")
    if logql_match(logql_filters(loki_exprs()[rule["alert"]]), line):
        got.add("logql")
    if vrl_match(vrl_terms(vrl_routes()[rule["name"]]), line):
        got.add("vrl")
    return got


# -- real log lines -----------------------------------------------------------------------------

@pytest.fixture
def captured() -> Iterator[io.StringIO]:
    """sagaworker's JSON logging into a buffer; the previous logging set-up is restored."""
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    config = structlog.get_config()
    stream = io.StringIO()
    sagaworker.configure_logging(fmt="json", stream=stream)
    try:
        yield stream
    finally:
        for h in list(root.handlers):
            root.removeHandler(h)
        for h in handlers:
            root.addHandler(h)
        root.setLevel(level)
        structlog.configure(**config)


def lines(stream: io.StringIO) -> list[Line]:
    out = [json.loads(x) for x in stream.getvalue().splitlines() if x.strip()]
    assert out, "nothing was logged"
    return out


@pytest.fixture
def logged(tmp_path: Path, captured: io.StringIO) -> dict[str, list[Line]]:
    """Log lines of real sagas driven through sagaworker's Compensator and sweeper."""
    sw, tools = make_sw(tmp_path / "alerts.db")
    out: dict[str, list[Line]] = {}

    def take(name: str) -> None:
        out[name] = lines(captured)
        captured.seek(0)
        captured.truncate()

    completed(sw, tools, "order-ok")
    compensated(sw, tools, "order-clean")
    take("clean")
    compensated(sw, tools, "order-dirty", card="stuck-1")
    take("dirty")
    compensated(sw, tools, "order-doubt", in_doubt=True)
    take("doubt")
    orphaned(sw, tools)
    take("orphan")
    return out


def orphaned(sw: Sagaworker, tools: Tools) -> None:
    sw.begin("order-orphan").enqueue(tools.reserve, "sku-1", 1)
    time.sleep(0.05)
    sw.settings = sw.settings.model_copy(update={"orphan_after": 0.01})
    assert sw.sweeper.log_orphans() == 1


# -- the tests ------------------------------------------------------------------------------------

def test_rule_files_implement_the_data_matchers() -> None:
    """Every rule in rules.yml has a LogQL alert and a VRL route with the same matchers."""
    exprs, routes = loki_exprs(), vrl_routes()
    assert {r["name"] for r in rules()} == {"compensation_failed", "saga_compensation_failed",
                                            "step_in_doubt", "flow_diverged", "orphan_intent"}
    assert set(exprs) == {r["alert"] for r in rules()}
    assert set(routes) == {r["name"] for r in rules()}
    for r in rules():
        want = {k: logql_value(v) for k, v in r["match"].items()}
        assert {k: v for k, op, v in logql_filters(exprs[r["alert"]]) if op == "="} == want
        assert vrl_terms(routes[r["name"]]) == r["match"]
    assert yaml.safe_load((DOCS / "rules.yml").read_text())["rules"][0]["match"][
        "dirty_state"] is True


def test_dirty_saga_lines_fire_the_compensation_alerts(logged: dict[str, list[Line]]) -> None:
    """A dirty saga's real log lines fire compensation_failed and saga_compensation_failed,
    in all three forms."""
    by_rule = {r["name"]: r for r in rules()}
    hits = {name: [ln for ln in logged["dirty"] if fires(rule, ln)]
            for name, rule in by_rule.items()}
    assert [ln["event"] for ln in hits["compensation_failed"]] == ["compensation_failed"]
    failed = hits["compensation_failed"][0]
    assert failed["dirty_state"] is True and failed["level"] == "error"
    assert failed["saga_id"] == "order-dirty" and failed["seq"] == 3
    assert "payment API timed out" in failed["detail"]
    assert [ln["event"] for ln in hits["saga_compensation_failed"]] == [
        "saga_compensation_failed"]
    assert hits["saga_compensation_failed"][0]["level"] == "critical"
    assert hits["step_in_doubt"] == [] and hits["orphan_intent"] == []
    for rule in by_rule.values():
        for ln in logged["dirty"]:
            assert fires(rule, ln) in (set(), {"data", "logql", "vrl"}), (rule["name"], ln)


def test_in_doubt_and_orphan_lines_fire_their_alerts(logged: dict[str, list[Line]]) -> None:
    """step_in_doubt fires on an in-doubt step's line, orphan_intent on the sweeper's line."""
    by_rule = {r["name"]: r for r in rules()}
    doubt = [ln for ln in logged["doubt"] if fires(by_rule["step_in_doubt"], ln)]
    assert [(ln["saga_id"], ln["seq"]) for ln in doubt] == [("order-doubt", 3)]
    orphan = [ln for ln in logged["orphan"] if fires(by_rule["orphan_intent"], ln)]
    assert [(ln["saga_id"], ln["seq"]) for ln in orphan] == [("order-orphan", 1)]
    assert "age_s" in orphan[0]
    assert not any(fires(by_rule["compensation_failed"], ln)
                   for ln in logged["doubt"] + logged["orphan"])


def test_clean_sagas_fire_nothing(logged: dict[str, list[Line]]) -> None:
    """A completed saga and a cleanly compensated one (with a skipped undo) fire no rule."""
    events = {ln["event"] for ln in logged["clean"]}
    assert {"saga_failed", "compensated", "compensation_skipped", "saga_compensated"} <= events
    for rule in rules():
        assert [ln for ln in logged["clean"] if fires(rule, ln)] == [], rule["name"]


def test_near_misses_do_not_fire() -> None:
    """Lines that only look like a dirty event (a retry, a string 'true') do not page."""
    rule = next(r for r in rules() if r["name"] == "compensation_failed")
    retry = {"event": "compensation_retry", "level": "warning", "attempts": 1}
    not_dirty = {"event": "compensation_failed", "level": "error", "dirty_state": False}
    assert fires(rule, retry) == set() and fires(rule, not_dirty) == set()


def test_a_held_flow_fires_flow_diverged(tmp_path: Path, captured: io.StringIO) -> None:
    """A real held flow's line fires flow_diverged in all three forms; the same divergence
    under on_divergence="compensate" (not held: the saga compensates) does not."""
    from celery import Celery

    from sagaworker import Settings
    from tests.unit.test_flow_changes import CODE, FlowBus, plain, strict, unplain, versions

    CODE["v"] = "1"
    sw = Sagaworker(Celery("alerts-flow", broker="memory://"), settings=Settings(
        database_url=f"sqlite:///{tmp_path / 'f.db'}", broker_url="memory://"))
    sw.compensation(unplain)
    sw.tool(compensable_by="unplain")(plain)
    sw.flow()(versions)
    sw.flow(on_divergence="compensate")(strict)
    sw.rt.bus = FlowBus([])
    for saga_id, flow in (("held-1", versions), ("strict-1", strict)):
        sw.start(saga_id, flow, 1)
        sw.flows.advance(saga_id)
    CODE["v"] = "2"
    try:
        for saga_id in ("held-1", "strict-1"):
            sw.flows.advance(saga_id)
    finally:
        CODE["v"] = "1"
    rule = next(r for r in rules() if r["name"] == "flow_diverged")
    got = lines(captured)
    assert [(ln["saga_id"], ln["seq"]) for ln in got if fires(rule, ln)] == [("held-1", 1)]
    assert all(fires(rule, ln) in (set(), {"data", "logql", "vrl"}) for ln in got)
    assert [ln["saga_id"] for ln in got if ln["event"] == "flow_diverged"] == [
        "held-1", "strict-1"]
