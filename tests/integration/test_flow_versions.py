"""Changing a flow's code (README "Changing a flow") through real workers on PostgreSQL
and a real broker: sagas waiting at a gate under one version of a flow meet workers
running another."""

from __future__ import annotations

from typing import Any

import pytest
from click.testing import CliRunner
from sqlalchemy import select, update

from sagaworker import ApprovalInvalid, FlowDiverged, Phase, SagaStatus, testing
from sagaworker._journal.dialect import db_later
from sagaworker._journal.schema import sagas
from sagaworker._worker.check import Finding, check_flows
from tests.apps.cluster import versioned
from tests.conftest import Cluster, uid, wait_for

pytestmark = [pytest.mark.services, pytest.mark.one_broker]
T = 60
FLOW = "tests.apps.cluster.versioned"


def kinds(c: Cluster, key: str) -> list[tuple[str, str]]:
    return [(r.kind, r.tool) for r in c.ledger(key)]


def findings(c: Cluster, keys: list[str]) -> dict[str, Finding]:
    """What `flows check` finds among these sagas (the journal holds other tests' too)."""
    return {f.saga_id: f for f in check_flows(c.sw, FLOW)
            if isinstance(f, Finding) and f.saga_id in keys}


def gate(c: Cluster, key: str) -> Any:
    return next((p for p in c.sw.pending_approvals() if p.saga_id == key), None)


def cli(c: Cluster, monkeypatch: pytest.MonkeyPatch, *args: str) -> Any:
    """The real CLI on the cluster's Sagaworker (its -A module is the test app's)."""
    from sagaworker.cli.commands import main

    monkeypatch.setattr("sagaworker.cli.context.load", lambda app: c.sw)
    return CliRunner().invoke(main, ["-A", "tests.apps.cluster", *args])


def held_at(c: Cluster, key: str) -> Any:
    """When a replay last found the saga diverged (the resume stamps it too)."""
    with c.sw.journal.engine.connect() as conn:
        return conn.execute(select(sagas.c.diverged_at).where(sagas.c.saga_id == key)
                            ).scalar_one()


def deploy(c: Cluster, code: str, **env: str) -> None:
    c.stop_workers()
    c.start_worker(TEST_FLOW_CODE=code, **env)


def test_a_deploy_that_changes_a_flow_holds_its_sagas_and_patches_serve_both(
        cluster: Cluster, monkeypatch: pytest.MonkeyPatch) -> None:
    c, sw = cluster, cluster.sw
    # four orders wait at the ship gate under code 1 (a, ship, c)
    resumed, retried, overdue, patched = every = [uid("v") for _ in range(4)]
    old = every[:3]  # approved under code 2 (``patched`` waits at its gate for code 3)
    for k in every:
        sw.start(k, versioned, k, "p", deadline=3600)
    gates = {k: wait_for(lambda k=k: gate(c, k), T, f"the gate of {k}") for k in every}

    # before the deploy: code 2 (step b inserted before ship) would diverge on each
    monkeypatch.setenv("TEST_FLOW_CODE", "2")
    found = findings(c, every)
    assert set(found) == set(every)
    f = found[resumed]
    assert (f.kind, f.seq) == ("diverged", 2)
    assert f.journaled == "tests.apps.cluster.ship('" + resumed + "', 'p')"
    assert f.asked == "tests.apps.cluster.step('" + resumed + "', 'b')"
    with pytest.raises(FlowDiverged) as e:
        testing.replay(sw, resumed)
    assert (e.value.seq, e.value.journaled, e.value.asked) == (2, f.journaled, f.asked)
    r = cli(c, monkeypatch, "flows", "check", "--flow", FLOW)
    assert r.exit_code == 1 and f"{resumed}\t{FLOW}\tdiverged at step 2" in r.output
    monkeypatch.setenv("TEST_FLOW_CODE", "1")
    assert findings(c, every) == {}
    testing.replay(sw, resumed)  # code 1 carries it on

    # code 2 ships anyway: once approved, ship runs and the replay after it diverges:
    # held, nothing more journaled or run, nothing undone, logged once
    deploy(c, "2")
    for k in old:
        sw.approve(gates[k].token, approver="alice")
    for k in old:
        wait_for(lambda k=k: sw.inspect(k).diverged, T, f"{k} held")
    for k in old:
        rec = sw.inspect(k)
        assert rec.status is SagaStatus.RUNNING
        assert [(e.tool_name, e.phase) for e in rec.entries] == [
            ("tests.apps.cluster.step", Phase.EXECUTED),
            ("tests.apps.cluster.ship", Phase.EXECUTED)]
        assert rec.diverged is not None and rec.diverged.startswith("flow diverged at step 2")
        assert kinds(c, k) == [("effect", "a"), ("effect", "ship")]
    wait_for(lambda: [e for e in c.events(resumed) if e.get("event") == "flow_diverged"],
             T, "flow_diverged logged")
    # still code 2: held again, silently. No worker runs while the resume stamps the hold
    # and that stamp is read: a fast replay would stamp it again first, unseen
    c.stop_workers()
    r = cli(c, monkeypatch, "flows", "resume", resumed)
    assert r.exit_code == 0, r.output
    asked = held_at(c, resumed)
    deploy(c, "2")
    wait_for(lambda: held_at(c, resumed) > asked, T, "the resumed replay")
    logged = [e for e in c.events(resumed) if e.get("event") == "flow_diverged"]
    assert len(logged) == 1 and logged[0]["seq"] == 2 and logged[0]["held"] is True
    r = cli(c, monkeypatch, "show", resumed)
    assert "diverged" in r.output and f"sagaworker flows resume {resumed}" in r.output

    # a held saga's deadline still compensates it (ship is irreversible: skipped)
    with sw.journal.engine.begin() as conn:
        conn.execute(update(sagas).where(sagas.c.saga_id == overdue)
                     .values(deadline_at=db_later(-1)))
    res = sw.get(overdue).wait(timeout=T)
    assert res.status is SagaStatus.COMPENSATED and res.error == "deadline passed"
    assert [r.tool for r in c.ledger(overdue) if r.kind == "undo"] == ["a"]

    # a rollback to code 1, then `flows resume`: it completes; the others stay held
    deploy(c, "1")
    r = cli(c, monkeypatch, "flows", "resume", resumed)
    assert r.exit_code == 0 and "resumed" in r.output
    res = sw.get(resumed).wait(timeout=T)
    assert res.status is SagaStatus.COMPLETED and res.value == ["a-done", "shipped-p", "c-done"]
    assert sw.inspect(resumed).diverged is None
    assert kinds(c, resumed) == [("effect", "a"), ("effect", "ship"), ("effect", "c")]
    assert sw.inspect(retried).diverged is not None  # (the sweeper retries it in 600 s)

    # the sweeper's own retry (SAGAWORKER_DIVERGED_RETRY) after the rollback
    deploy(c, "1", SAGAWORKER_DIVERGED_RETRY="1")
    assert sw.get(retried).wait(timeout=T).status is SagaStatus.COMPLETED
    assert kinds(c, retried) == [("effect", "a"), ("effect", "ship"), ("effect", "c")]

    # code 3 patches b in: the order that waited at its gate since code 1 replays past
    # the patch (no marker there: its journal holds ship) and completes without b
    deploy(c, "3")
    sw.approve(gates[patched].token, approver="alice")
    res = sw.get(patched).wait(timeout=T)
    assert res.status is SagaStatus.COMPLETED and res.value == ["a-done", "shipped-p", "c-done"]
    assert kinds(c, patched) == [("effect", "a"), ("effect", "ship"), ("effect", "c")]
    # and a new saga under code 3 runs b, with the patch's marker journaled before it
    new = uid("v")
    saga = sw.start(new, versioned, new, "q")
    sw.approve(wait_for(lambda: gate(c, new), T, "the new saga's gate").token,
               approver="alice")
    res = saga.wait(timeout=T)
    assert res.value == ["a-done", "b-done", "shipped-q", "c-done"]
    assert [e.tool_name for e in sw.inspect(new).entries] == [
        "tests.apps.cluster.step", "patch:add-b", "tests.apps.cluster.step",
        "tests.apps.cluster.ship", "tests.apps.cluster.step"]
    assert kinds(c, new) == [("effect", "a"), ("effect", "b"), ("effect", "ship"),
                             ("effect", "c")]
    r = cli(c, monkeypatch, "show", new)
    assert "patch:add-b" in r.output


def test_flows_check_only_reads(cluster: Cluster, monkeypatch: pytest.MonkeyPatch) -> None:
    """On a connection where PostgreSQL refuses every write (as a read replica does),
    ``flows check`` still checks every saga in flight and finds the one that diverges."""
    from sqlalchemy import text

    from tests.apps.cluster import build

    c = cluster
    key = uid("ro")
    c.sw.start(key, versioned, key, "p")
    wait_for(lambda: gate(c, key), T, "the gate")
    sep = "&" if "?" in c.settings.database_url else "?"
    ro_url = f"{c.settings.database_url}{sep}options=-c%20default_transaction_read_only%3Don"
    _, ro = build(c.settings.model_copy(update={"database_url": ro_url}))
    with pytest.raises(Exception, match="read-only transaction"), ro.journal.engine.begin() as conn:
        conn.execute(text("UPDATE sagaworker_sagas SET reason = 'x' WHERE saga_id = :k"),
                      {"k": key})
    monkeypatch.setenv("TEST_FLOW_CODE", "2")
    monkeypatch.setattr("sagaworker.cli.context.load", lambda app: ro)
    from sagaworker.cli.commands import main

    r = CliRunner().invoke(main, ["-A", "tests.apps.cluster", "flows", "check", "--flow",
                                  FLOW, "--json"])
    assert r.exit_code == 1, r.output
    assert key in r.output and "read-only" not in r.output
    ro.rt.reset_engine()


def refused_held(c: Cluster, key: str) -> list[dict[str, Any]]:
    """The workers' refusals of a delivered step of a held saga."""
    return [e for e in c.events(key) if e.get("event") == "step_held"]


def test_a_held_sagas_gate_is_not_offered_and_no_worker_runs_its_approved_step(
        cluster: Cluster, monkeypatch: pytest.MonkeyPatch) -> None:
    """A held saga's gate is not offered nor approved, and a worker never runs a
    step of it. ``early`` was approved a moment before a replay held it: its ship message
    waits in the queue, and the worker it reaches refuses it. ``late`` is held at its gate:
    not listed, its token refused naming the commands that resolve it. After a rollback
    and ``flows resume`` both move on, ship run once each."""
    c, sw = cluster, cluster.sw
    # its workers run code 1 (the module's cluster may run the code an earlier test left)
    deploy(c, "1")
    early, late = uid("h"), uid("h")
    for k in (early, late):
        sw.start(k, versioned, k, "p")
    gates = {k: wait_for(lambda k=k: gate(c, k), T, f"the gate of {k}") for k in (early, late)}

    # approved (its message queued, no worker running), then a replay of code 2 holds it
    c.stop_workers()
    sw.approve(gates[early].token, approver="alice")
    monkeypatch.setenv("TEST_FLOW_CODE", "2")
    sw.flows.advance(early)
    monkeypatch.setenv("TEST_FLOW_CODE", "1")
    assert sw.inspect(early).diverged is not None
    deploy(c, "2")  # its worker is handed early's ship
    wait_for(lambda: refused_held(c, early) or kinds(c, early) != [("effect", "a")], T,
             "early's ship delivered")
    assert kinds(c, early) == [("effect", "a")]
    assert [e["seq"] for e in refused_held(c, early)] == [2]
    # a worker of code 2 holds late at its gate
    assert cli(c, monkeypatch, "flows", "resume", late).exit_code == 0
    wait_for(lambda: sw.inspect(late).diverged, T, f"{late} held")

    step, ship = "tests.apps.cluster.step", "tests.apps.cluster.ship"
    for k, phase in ((early, Phase.INTENT), (late, Phase.AWAITING_APPROVAL)):
        rec = sw.inspect(k)
        assert rec.status.value == ("RUNNING" if k == early else "AWAITING_APPROVAL")
        assert [(e.tool_name, e.phase, e.attempts) for e in rec.entries] == [
            (step, Phase.EXECUTED, 1), (ship, phase, 0)]
        assert kinds(c, k) == [("effect", "a")]
    assert gate(c, early) is None and gate(c, late) is None
    with pytest.raises(ApprovalInvalid) as refused:
        sw.approve(gates[late].token, approver="alice")
    assert str(refused.value) == (
        f"saga {late!r} is held: its flow's code no longer replays its journal, so nothing "
        "of it runs and its gates are closed. Deploy code that replays it (a rollback, or "
        f"s.patched(...)), then `sagaworker flows resume {late}`; or `sagaworker abort "
        f"{late} --reason R` to compensate. Nothing changed")
    assert sw.inspect(late).entries[1].phase is Phase.AWAITING_APPROVAL

    # the rollback and `flows resume`: early's ship is sent again and runs, late's gate is
    # offered again
    deploy(c, "1")
    for k in (early, late):
        assert cli(c, monkeypatch, "flows", "resume", k).exit_code == 0
    sw.approve(wait_for(lambda: gate(c, late), T, "late's gate offered again").token,
               approver="alice")
    for k in (early, late):
        res = sw.get(k).wait(timeout=T)
        assert res.status is SagaStatus.COMPLETED and res.value == [
            "a-done", "shipped-p", "c-done"]
        assert kinds(c, k) == [("effect", "a"), ("effect", "ship"), ("effect", "c")]
        assert sw.inspect(k).entries[1].attempts == 1
