"""Changing a flow's code, the journal's side: a diverged replay holds its saga,
the sweeper retries it, patches serve old and new journals, ``flows check`` reads only."""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from celery import Celery
from click.testing import CliRunner
from sqlalchemy import update
from structlog.testing import capture_logs

from sagaworker import FlowContext, FlowDiverged, SagaStatus, Sagaworker, Settings, testing
from sagaworker._journal.dialect import db_later
from sagaworker._journal.schema import sagas
from sagaworker.testing import check_compensation
from tests.unit.test_flow_sweeps import FlowBus, age, run_step

#: the code the flows below run (a deploy changes it between replays)
CODE = {"v": "1"}
PLAIN = "tests.unit.test_flow_changes.plain"


def plain(n: int) -> int:
    return n


def unplain() -> None:
    return None


def versions(s: FlowContext, n: int) -> list[int]:
    """1: plain(n), plain(n+1). 2 and 3: another first step (two different divergences).
    4: a patch marker before the first step. 5: the patch asked for twice."""
    v = CODE["v"]
    if v in ("4", "5") and s.patched("double"):
        if v == "5":
            s.patched("double")
        n *= 2
    first = {"2": n + 100, "3": n + 200}.get(v, n)
    return [s.call(PLAIN, first), s.call(PLAIN, n + 1)]


def patched_flow(s: FlowContext, n: int) -> list[int]:
    """A patch whose new branch runs a step: compensated like any other step."""
    out = [s.call(PLAIN, n)]
    if s.patched("extra"):
        out.append(s.call(PLAIN, n + 1))
    out.append(s.call(PLAIN, n + 2))
    return out


def strict(s: FlowContext, n: int) -> list[int]:
    return versions(s, n)


def only_a_patch(s: FlowContext) -> str:
    """No step at all: a marker, then the return (the advance replays it again itself)."""
    return "new" if s.patched("p") else "old"


@pytest.fixture
def sw(tmp_path: Path) -> Iterator[Sagaworker]:
    CODE["v"] = "1"
    sw = Sagaworker(Celery("changes", broker="memory://"), settings=Settings(
        database_url=f"sqlite:///{tmp_path / 'j.db'}", broker_url="memory://",
        approval_secret="s" * 40, relay_after=30))

    sw.compensation(unplain)
    sw.tool(compensable_by="unplain")(plain)
    sw.flow()(versions)
    sw.flow()(patched_flow)
    sw.flow(on_divergence="compensate")(strict)
    sw.flow()(only_a_patch)
    sw.rt.bus = FlowBus([])
    yield sw


def events(logs: list[dict[str, Any]], name: str) -> list[dict[str, Any]]:
    return [e for e in logs if e["event"] == name]


def test_a_diverged_replay_holds_the_saga_and_logs_each_divergence_once(
        sw: Sagaworker) -> None:
    sw.start("v-1", versions, 1)
    sw.flows.advance("v-1")  # journals plain(1)
    CODE["v"] = "2"
    with capture_logs() as logs:
        sw.flows.advance("v-1")
        sw.flows.advance("v-1")  # the same divergence again: not logged again
    rec = sw.inspect("v-1")
    assert rec.status is SagaStatus.RUNNING and rec.reason is None
    assert rec.diverged == ("flow diverged at step 1: the journal holds "
                            f"{PLAIN}(1), the replay asked for {PLAIN}(101)")
    assert [e.seq for e in rec.entries] == [1]  # nothing journaled while held
    (logged,) = events(logs, "flow_diverged")
    assert logged["seq"] == 1 and logged["held"] is True and "flows resume v-1" in logged[
        "resolve"]
    CODE["v"] = "3"  # another deploy, another divergence: logged again
    with capture_logs() as logs:
        sw.flows.advance("v-1")
    assert [e["detail"] for e in events(logs, "flow_diverged")] == [
        f"flow diverged at step 1: the journal holds {PLAIN}(1), the replay asked for "
        f"{PLAIN}(201)"]
    CODE["v"] = "1"  # the rollback: released, and it moves on
    with capture_logs() as logs:
        sw.flows.advance("v-1")
    assert [e["event"] for e in logs if e["event"].startswith("flow_")] == [
        "flow_divergence_resolved"]
    run_step(sw, "v-1", 1, PLAIN, 1)  # (no step of a held saga runs: released first)
    sw.flows.advance("v-1")
    rec = sw.inspect("v-1")
    assert rec.diverged is None and [e.seq for e in rec.entries] == [1, 2]


def test_on_divergence_compensate_fails_the_saga(sw: Sagaworker) -> None:
    sw.start("s-1", strict, 1)
    sw.flows.advance("s-1")
    CODE["v"] = "2"
    sw.flows.advance("s-1")
    rec = sw.inspect("s-1")
    assert rec.diverged is None  # failed (its failure message compensates it), not held
    assert (rec.reason or "").startswith("flow diverged at step 1")


def test_an_unknown_on_divergence_is_refused(sw: Sagaworker) -> None:
    from sagaworker import ConfigurationError

    with pytest.raises(ConfigurationError, match=r"'hold'.*'compensate'"):
        sw.flow(on_divergence="retry")(strict)


def test_the_sweeper_replays_a_held_flow_once_every_diverged_retry(sw: Sagaworker) -> None:
    bus = sw.rt.bus
    assert isinstance(bus, FlowBus)
    sw.start("v-2", versions, 1)
    sw.flows.advance("v-2")
    run_step(sw, "v-2", 1, PLAIN, 1)  # an outcome the held replay saw: no lost advance
    CODE["v"] = "2"
    sw.flows.advance("v-2")
    bus.advances.clear()
    sweeper = sw.sweeper
    sweeper.sweep()
    assert bus.advances == []  # not before SAGAWORKER_DIVERGED_RETRY (600 s)
    with sw.journal.engine.begin() as conn:
        conn.execute(update(sagas).where(sagas.c.saga_id == "v-2")
                     .values(diverged_at=db_later(-601)))
    sweeper.sweep()
    sweeper.sweep()  # stamped by the first: one advance
    assert bus.advances == ["v-2"]


def test_patches_serve_old_and_new_journals(sw: Sagaworker) -> None:
    sw.start("old", versions, 1)  # started under code 1: no marker at step 1
    sw.flows.advance("old")
    CODE["v"] = "4"
    sw.start("new", versions, 1)
    sw.flows.advance("new")  # a marker, then plain(2)
    testing.replay(sw, "old")  # patched() is False there: plain(1) still matches
    assert [(e.tool_name, e.args) for e in sw.inspect("new").entries] == [
        ("patch:double", []), (PLAIN, [2])]
    assert [(e.tool_name, e.args) for e in sw.inspect("old").entries] == [(PLAIN, [1])]
    CODE["v"] = "1"  # the marker where the code asks for none: a divergence naming it
    with pytest.raises(FlowDiverged) as e:
        testing.replay(sw, "new")
    assert (e.value.seq, e.value.journaled) == (1, "patch marker 'double'")
    CODE["v"] = "5"  # one id asked for twice
    with pytest.raises(FlowDiverged, match="patch 'double' twice"):
        testing.replay(sw, "new")


def test_a_patched_flow_compensates_its_steps_and_lists_no_marker(sw: Sagaworker) -> None:
    """The toolkit fails each step in turn: every EXECUTED step is undone in reverse, the
    marker is never undone nor reported."""
    check_compensation(sw, patched_flow, 1)


def _cli_app(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, sw: Sagaworker) -> Any:
    from sagaworker.cli.commands import main

    monkeypatch.setattr("sagaworker.cli.context.load", lambda app: sw)
    runner = CliRunner(**({"mix_stderr": False} if "mix_stderr" in CliRunner.__init__.
                          __code__.co_varnames else {}))
    return lambda *a: runner.invoke(main, ["-A", "app", "flows", *a])


def test_flows_check_names_each_saga_that_would_diverge(
        sw: Sagaworker, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cli = _cli_app(tmp_path, monkeypatch, sw)
    for k in ("c-1", "c-2"):
        sw.start(k, versions, 1)
        sw.flows.advance(k)
    r = cli("check")
    assert r.exit_code == 0, r.output
    assert "2 saga(s) in flight checked" in r.stderr
    CODE["v"] = "2"
    r = cli("check", "--flow", "tests.unit.test_flow_changes.versions")
    assert r.exit_code == 1
    assert r.stdout.splitlines() == [
        f"{k}\ttests.unit.test_flow_changes.versions\tdiverged at step 1\tflow diverged at "
        f"step 1: the journal holds {PLAIN}(1), the replay asked for {PLAIN}(101)"
        for k in ("c-1", "c-2")]
    r = cli("check", "--json")
    got = json.loads(r.stdout)
    assert got["checked"] == 2 and [(f["saga_id"], f["seq"], f["asked"]) for f in
                                    got["findings"]] == [("c-1", 1, f"{PLAIN}(101)"),
                                                         ("c-2", 1, f"{PLAIN}(101)")]
    assert cli("check", "--flow", "no.such.flow").exit_code == 0
    r = cli("resume", "nope")
    assert r.exit_code == 1 and "no saga 'nope'" in r.stderr


def test_starting_a_flow_the_app_module_does_not_import_warns_once(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A flow declared in a module the worker's -A module never imports would be
    `flow_unknown` on every worker: the producer says so, once, naming the fix."""
    (tmp_path / "reachapp.py").write_text(
        "from celery import Celery\nfrom sagaworker import Sagaworker, Settings\n"
        f"app = Celery('reachapp')\nsw = Sagaworker(app, settings=Settings(database_url="
        f"{str('sqlite:///' + str(tmp_path / 'j.db'))!r}, broker_url='memory://'))\n"
        "import reachin  # noqa\n")
    flow = "def f(s, n):\n    return n\n"
    (tmp_path / "reachin.py").write_text("from reachapp import sw\n@sw.flow()\n" + flow)
    (tmp_path / "reachout.py").write_text("from reachapp import sw\n@sw.flow()\n" + flow)
    monkeypatch.syspath_prepend(str(tmp_path))
    for m in ("reachapp", "reachin", "reachout"):
        monkeypatch.delitem(sys.modules, m, raising=False)
    import reachapp  # type: ignore[import-not-found]
    import reachin  # type: ignore[import-not-found]
    import reachout  # type: ignore[import-not-found]

    sw = reachapp.sw
    sw.create_schema()
    sw.rt.bus = FlowBus([])
    with capture_logs() as logs:
        sw.start("in-1", reachin.f, 1)
        sw.start("out-1", reachout.f, 1)
        sw.start("out-2", reachout.f, 2)
    (warned,) = events(logs, "flow_not_imported_by_app")
    assert warned["flow"] == "reachout.f"
    assert "import reachout from reachapp" in warned["detail"]


def test_list_and_show_mark_a_held_saga(
        sw: Sagaworker, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from sagaworker.cli.commands import main

    monkeypatch.setattr("sagaworker.cli.context.load", lambda app: sw)
    sw.start("h-1", versions, 1)
    sw.flows.advance("h-1")
    CODE["v"] = "2"
    sw.flows.advance("h-1")
    r = CliRunner().invoke(main, ["-A", "app", "list"], terminal_width=200)
    assert r.exit_code == 0 and "RUNNING (diverged)" in r.output
    r = CliRunner().invoke(main, ["-A", "app", "show", "h-1"], terminal_width=200)
    assert "diverged (held: nothing runs, nothing is undone)" in r.output
    assert "sagaworker flows resume h-1" in r.output
    r = CliRunner().invoke(main, ["-A", "app", "show", "h-1", "--json"])
    assert json.loads(r.output)["diverged"].startswith("flow diverged at step 1")


def _held(sw: Sagaworker, saga_id: str) -> None:
    sw.start(saga_id, versions, 1)
    sw.flows.advance(saga_id)
    CODE["v"] = "2"
    sw.flows.advance(saga_id)
    assert sw.inspect(saga_id).diverged is not None


def test_a_journal_newer_than_the_code_is_not_held(sw: Sagaworker) -> None:
    """A rolling deploy: a worker on the new code journaled a patch marker; a worker still
    on the old code replays the saga: it is not held nor paged, it waits for the new."""
    CODE["v"] = "4"
    sw.start("r-1", versions, 1)
    sw.flows.advance("r-1")  # the marker, then plain(2)
    CODE["v"] = "1"
    with capture_logs() as logs:
        sw.flows.advance("r-1")
    assert sw.inspect("r-1").diverged is None
    assert events(logs, "flow_diverged") == []
    assert [e["seq"] for e in events(logs, "flow_newer_than_code")] == [1]
    with pytest.raises(FlowDiverged):  # (flows check with the old code still names it)
        testing.replay(sw, "r-1")


def test_an_aborted_held_saga_is_no_longer_shown_held(sw: Sagaworker) -> None:
    _held(sw, "a-1")
    sw.abort("a-1", reason="gave up", actor="ops")
    assert sw.inspect("a-1").diverged is None


def test_a_marker_is_no_lost_advance_for_the_sweeper(sw: Sagaworker) -> None:
    """A replay that journals [marker, step] records the marker as seen: the sweeper does
    not take it for an outcome whose advance was lost."""
    bus = sw.rt.bus
    assert isinstance(bus, FlowBus)
    CODE["v"] = "4"
    sw.start("m-1", versions, 1)
    sw.flows.advance("m-1")
    age(sw, "m-1", 120)
    bus.advances.clear()
    sw.sweeper.sweep()
    assert bus.advances == []


def test_a_flow_of_nothing_but_a_patch_completes(sw: Sagaworker) -> None:
    sw.start("p-1", only_a_patch)
    sw.flows.advance("p-1")
    rec = sw.inspect("p-1")
    assert rec.status is SagaStatus.COMPLETED
    assert [e.tool_name for e in rec.entries] == ["patch:p"]
    assert sw.get("p-1").wait(timeout=1).value == "new"


def test_flows_resume_hands_a_held_saga_to_the_workers(
        sw: Sagaworker, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    bus = sw.rt.bus
    assert isinstance(bus, FlowBus)
    _held(sw, "h-2")
    bus.advances.clear()
    cli = _cli_app(tmp_path, monkeypatch, sw)
    r = cli("resume", "h-2")
    assert r.exit_code == 0 and "resumed h-2" in r.stdout
    assert bus.advances == ["h-2"]
    sw.abort("h-2", reason="gave up", actor="ops")
    r = cli("resume", "h-2")
    assert r.exit_code == 1 and "(failing): nothing to resume" in r.stderr


def test_flows_check_names_an_unreadable_saga_and_checks_the_rest(
        sw: Sagaworker, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from sqlalchemy import text

    for k in ("u-1", "u-2", "u-3"):
        sw.start(k, versions, 1)
        sw.flows.advance(k)
    with sw.journal.engine.begin() as conn:
        conn.execute(text("UPDATE sagaworker_sagas SET flow_args = '{not json' "
                          "WHERE saga_id = 'u-2'"))
    r = _cli_app(tmp_path, monkeypatch, sw)("check", "--json")
    got = json.loads(r.stdout)
    assert r.exit_code == 1 and got["checked"] == 3
    assert [(f["saga_id"], f["kind"]) for f in got["findings"]] == [("u-2", "unreadable")]


def test_the_import_walk_says_nothing_when_it_cannot_tell(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from sagaworker._worker import reach

    app = Celery("tests.unit.test_flow_changes")
    assert reach.reaches(app, "tests.unit.test_flow_sweeps") is True
    monkeypatch.setattr(reach, "_LIMIT", 1)
    assert reach.reaches(app, "tests.unit.test_flow_sweeps") is None
