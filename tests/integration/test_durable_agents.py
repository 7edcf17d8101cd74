"""Durable agent runs through real worker processes on PostgreSQL and a real broker: a
Pydantic AI agent inside a flow (``Durability``, ``flow_toolset``) whose model requests
and tool calls are journaled steps. A scripted model (``tests.apps.cluster.trip_model``)
writes every request it serves to the ledger, so the tests count the turns sent."""

from __future__ import annotations

import os
import signal
from typing import Any

import pytest

from sagaworker import OutcomeResult, Phase, SagaStatus
from sagaworker._observe.records import saga_json
from tests.apps.cluster import durable_trip, durable_trip_oai
from tests.conftest import Cluster, uid, wait_for

pytest.importorskip("pydantic_ai")
create_app = pytest.importorskip("sagaworker.web").create_app
WebAuth = pytest.importorskip("sagaworker.web").WebAuth
pytestmark = [pytest.mark.services, pytest.mark.one_broker]
T = 60
UNIT = "unit:trip__model.request"


def turns(c: Cluster, key: str) -> list[str]:
    return [r.tool for r in c.ledger(key) if r.kind == "model"]


def effects(c: Cluster, key: str) -> list[str]:
    return [r.tool for r in c.ledger(key) if r.kind == "effect"]


def gone(pid: int) -> bool:
    """The process is dead: no longer there, or a zombie its parent has not reaped yet
    (``kill(pid, 0)`` still succeeds on a zombie)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] in ("Z", "X")
    except FileNotFoundError:
        return True


def killed_mid_request(c: Cluster, key: str, saga: Any) -> None:
    """SIGKILL of the process holding the run's first model request (it has started and
    the model was asked); the run completes, only that request sent twice."""
    row = wait_for(lambda: (r := c.sw.journal.entry_row(key, 1)) is not None
                   and r.started_at is not None and r, T, "the model request to start")
    wait_for(lambda: turns(c, key) == ["turn-0"], T, "the model to be asked")
    pid = int(row.worker.rpartition("|")[2])
    os.kill(pid, signal.SIGKILL)
    res = saga.wait(timeout=T)
    assert res.status is SagaStatus.COMPLETED, res.error
    assert gone(pid)  # the kill hit the process that held the request
    assert turns(c, key) == ["turn-0", "turn-0", "turn-1", "turn-2"]


def test_a_durable_run_sends_each_model_turn_once(crash_cluster: Cluster) -> None:
    """Each model turn is a journaled step: the replays after each tool step read the
    turns before it from the journal (three requests for two tools, not six)."""
    c, key = crash_cluster, uid("ag")
    res = c.sw.start(key, durable_trip, key).wait(timeout=T)
    assert res.status is SagaStatus.COMPLETED, res.error
    assert res.value == f"trip booked for {key}"
    assert turns(c, key) == ["turn-0", "turn-1", "turn-2"]
    assert effects(c, key) == ["book_hotel", "charge_card"]
    entries = c.sw.inspect(key).entries
    assert [e.tool_name for e in entries] == [
        UNIT, "tests.apps.cluster.book_hotel", UNIT, "tests.apps.cluster.charge_card", UNIT]
    # each tool step carries the framework's tool-call id (within the run's own id)
    assert [e.call_id for e in entries] == [
        None, f"{key}/trip/0/call-0", None, f"{key}/trip/0/call-1", None]
    # shown: each model turn with its model, tokens and the tools it asked for
    turns_shown = [e.get("model_turn") for e in saga_json(c.sw.inspect(key))["entries"]]
    assert [t and t["asks"] for t in turns_shown] == [
        ["book_hotel"], None, ["charge_card"], None, []]
    # one name for a model request in the JSON, beside the step's kind
    shown = saga_json(c.sw.inspect(key))["entries"]
    assert [(e["name"], e["kind"]) for e in shown] == [
        ("model request", "model request"), ("book_hotel", "tool"),
        ("model request", "model request"), ("charge_card", "tool"),
        ("model request", "model request")]
    assert turns_shown[0]["model"] == "function:trip_model:"
    assert turns_shown[0]["input_tokens"] > 0 and turns_shown[0]["output_tokens"] > 0
    page = create_app(c.sw, auth=WebAuth(anonymous_reads=True)).test_client().get(
        f"/ui/sagas/{key}").get_data(as_text=True)
    assert "asks book_hotel" in page
    assert page.count('<span class="name" title="unit:trip__model.request">model request'
                      '</span>') == 3
    assert page.count('class="tl-bar tl-model"') == 3  # the timeline draws the 3 turns


def test_a_worker_killed_during_a_model_request_is_resumed_without_repeating_a_turn(
        crash_cluster: Cluster) -> None:
    """SIGKILL of the process sending the first model request: the sweeper hands the
    flow to another process, which sends that request again (it has no journaled
    response) and no other; every tool runs once."""
    c, key = crash_cluster, uid("ag")
    killed_mid_request(c, key, c.sw.start(key, durable_trip, key, slow=True))
    assert effects(c, key) == ["book_hotel", "charge_card"]


def test_a_declined_card_cancels_the_hotel(crash_cluster: Cluster) -> None:
    """The charge FAILS: the saga compensates whatever the agent would do next; the
    hotel's undo runs, the model turns have nothing to undo."""
    c, key = crash_cluster, uid("ag")
    res = c.sw.start(key, durable_trip, key, card="declined").wait(timeout=T)
    assert res.status is SagaStatus.COMPENSATED
    assert [r.tool for r in c.ledger(key) if r.kind == "undo"] == ["book_hotel"]
    assert [(o.tool_name, o.result) for o in res.report.outcomes] == [
        (UNIT, OutcomeResult.SKIPPED), ("tests.apps.cluster.book_hotel",
                                        OutcomeResult.COMPENSATED),
        (UNIT, OutcomeResult.SKIPPED)]
    assert turns(c, key) == ["turn-0", "turn-1"]
    # a model request's skip is no warning: nothing was there to undo (the chain logs its
    # last lines once the saga's end is journaled: awaited)
    wait_for(lambda: [e for e in c.events(key) if e.get("event") == "saga_compensated"], T,
             "saga_compensated logged")
    skips = [e for e in c.events(key) if e.get("event") == "compensation_skipped"]
    assert [(e["level"], e["detail"]) for e in skips] == [
        ("info", "a model request: nothing to undo")] * 2


def test_a_gate_waits_with_no_process_and_the_run_resumes_once_approved(
        crash_cluster: Cluster) -> None:
    """The voucher waits at its gate; every worker stops; a new one, after the signed
    approval, finishes the run from the journal: no model turn repeated."""
    c, key = crash_cluster, uid("ag")
    saga = c.sw.start(key, durable_trip, key, voucher=True)
    req = wait_for(lambda: next((p for p in c.sw.pending_approvals() if p.saga_id == key),
                                None), T, "the voucher's gate")
    c.stop_workers()
    c.start_worker()
    c.sw.approve(req.token, approver="alice")
    res = saga.wait(timeout=T)
    assert res.status is SagaStatus.COMPLETED, res.error
    assert turns(c, key) == ["turn-0", "turn-1", "turn-2", "turn-3"]
    assert effects(c, key) == ["book_hotel", "charge_card", "send_voucher"]
    assert [e.phase for e in c.sw.inspect(key).entries] == [Phase.EXECUTED] * 7


def test_a_deploy_that_changes_the_agents_instructions_holds_its_runs_at_turn_one(
        crash_cluster: Cluster, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two runs wait at the voucher's gate. Code that instructs the agent otherwise is found
    by `flows check` ("the prompt changed at turn 1"), and once deployed the worker holds the
    run it replays: not compensated, no turn sent again. A run journaled before model
    requests carried their prompt's digest is replayed by the new code as before."""
    from sqlalchemy import update

    from sagaworker._base import digests
    from sagaworker._journal.schema import entries
    from sagaworker._worker.check import Finding, check_flows

    c = crash_cluster
    key, older = uid("ap"), uid("ap")
    for k in (key, older):
        c.sw.start(k, durable_trip, k, voucher=True)
    gates = {k: wait_for(lambda k=k: next((p for p in c.sw.pending_approvals()
                                           if p.saga_id == k), None), T, f"{k}'s gate")
             for k in (key, older)}
    # ``older``'s model requests as a journal written before digests of prompts
    with c.sw.journal.engine.begin() as conn:
        conn.execute(update(entries).where(entries.c.saga_id == older,
                                           entries.c.tool_name == UNIT)
                     .values(args_digest=digests.digest(c.sw.rt.cipher, [UNIT[5:]], {})))

    monkeypatch.setenv("TEST_TRIP_INSTRUCTIONS", "Book the cheapest trip.")
    found = {f.saga_id: f for f in check_flows(c.sw, "tests.apps.cluster.durable_trip")
             if isinstance(f, Finding) and f.saga_id in (key, older)}
    assert list(found) == [key]
    assert (found[key].kind, found[key].seq) == ("diverged", 1)
    assert "the prompt changed at turn 1" in found[key].detail

    c.stop_workers()
    for k in (key, older):
        c.sw.approve(gates[k].token, approver="alice")
    c.start_worker(TEST_TRIP_INSTRUCTIONS="Book the cheapest trip.")
    try:
        res = c.sw.get(older).wait(timeout=T)
        assert res.status is SagaStatus.COMPLETED, res.error
        rec = wait_for(lambda: (r := c.sw.inspect(key)).diverged and r, T, f"{key} held")
        assert rec.status is SagaStatus.RUNNING
        assert rec.diverged.startswith("flow diverged at step 1")
        assert "the prompt changed at turn 1" in rec.diverged
        # the approved voucher ran (asked for under the code that journaled it); nothing
        # undone, no turn sent again
        assert effects(c, key) == ["book_hotel", "charge_card", "send_voucher"]
        assert turns(c, key) == ["turn-0", "turn-1", "turn-2"]
        assert not [e for e in c.sw.inspect(key).entries if e.compensation is not None]
    finally:  # the module's worker as it was: the instructions of this process's code
        c.stop_workers()
        monkeypatch.delenv("TEST_TRIP_INSTRUCTIONS")  # (a worker inherits the environment)
        c.start_worker()


# -- the OpenAI Agents SDK: sagaworker.agents.openai_agents.run with flow_tools ----------------



def test_an_openai_agents_run_sends_each_model_turn_once(crash_cluster: Cluster) -> None:
    c, key = crash_cluster, uid("oa")
    res = c.sw.start(key, durable_trip_oai, key).wait(timeout=T)
    assert res.status is SagaStatus.COMPLETED, res.error
    assert res.value == f"trip booked for {key}"
    assert turns(c, key) == ["turn-0", "turn-1", "turn-2"]
    assert effects(c, key) == ["book_hotel", "charge_card"]
    shown = [e.get("model_turn") for e in saga_json(c.sw.inspect(key))["entries"]]
    assert [t and (t["model"], t["asks"], t["input_tokens"], t["output_tokens"])
            for t in shown] == [("Scripted", ["book_hotel"], 10, 3), None,
                                ("Scripted", ["charge_card"], 10, 3), None,
                                ("Scripted", [], 10, 3)]


def test_an_openai_agents_run_replayed_by_code_that_prompts_otherwise_diverges(
        crash_cluster: Cluster, monkeypatch: pytest.MonkeyPatch) -> None:
    """The prompt's digest journaled by the worker is the one this process computes for
    the same code (a replay does not diverge), and another for code that instructs the
    agent otherwise: a replay under it diverges at the first model request, turn 1."""
    from sagaworker import FlowDiverged, testing

    c, key = crash_cluster, uid("oa")
    res = c.sw.start(key, durable_trip_oai, key).wait(timeout=T)
    assert res.status is SagaStatus.COMPLETED, res.error
    testing.replay(c.sw, key)
    monkeypatch.setenv("TEST_TRIP_INSTRUCTIONS", "Book the cheapest trip.")
    with pytest.raises(FlowDiverged) as e:
        testing.replay(c.sw, key)
    assert e.value.seq == 1
    assert "the prompt changed at turn 1" in str(e.value)


def test_an_openai_agents_run_killed_mid_request_resumes_without_repeating_a_turn(
        crash_cluster: Cluster) -> None:
    c, key = crash_cluster, uid("oa")
    killed_mid_request(c, key, c.sw.start(key, durable_trip_oai, key, slow=True))
    assert effects(c, key) == ["book_hotel", "charge_card"]


def test_an_openai_agents_run_whose_card_is_declined_cancels_the_hotel(
        crash_cluster: Cluster) -> None:
    c, key = crash_cluster, uid("oa")
    res = c.sw.start(key, durable_trip_oai, key, card="declined").wait(timeout=T)
    assert res.status is SagaStatus.COMPENSATED
    assert [r.tool for r in c.ledger(key) if r.kind == "undo"] == ["book_hotel"]


@pytest.mark.parametrize("ending", ["rejected", "deadline"])
def test_a_rejected_or_overdue_gate_ends_the_run_and_compensates(crash_cluster: Cluster,
                                                                 ending: str) -> None:
    """At the voucher's gate a signed rejection, or a deadline passing, fails the saga:
    the charge and the hotel are undone latest first, the model is not asked again."""
    from sqlalchemy import update

    from sagaworker._journal.dialect import db_later
    from sagaworker._journal.schema import sagas

    c, key = crash_cluster, uid("ag")
    saga = c.sw.start(key, durable_trip, key, voucher=True, deadline=3600)
    req = wait_for(lambda: next((p for p in c.sw.pending_approvals() if p.saga_id == key),
                                None), T, "the voucher's gate")
    if ending == "rejected":
        c.sw.reject(req.token, approver="bob", reason="no voucher by mail")
    else:
        with c.sw.journal.engine.begin() as conn:
            conn.execute(update(sagas).where(sagas.c.saga_id == key)
                         .values(deadline_at=db_later(-1)))
    res = saga.wait(timeout=T)
    assert res.status is SagaStatus.COMPENSATED
    assert [r.tool for r in c.ledger(key) if r.kind == "undo"] == ["charge_card", "book_hotel"]
    assert turns(c, key) == ["turn-0", "turn-1", "turn-2"]
    assert "send_voucher" not in effects(c, key)


def test_a_model_request_longer_than_the_lease_is_sent_once(crash_cluster: Cluster) -> None:
    """A request that outlasts its claim's lease twice over: the worker's heartbeat
    keeps the claim, so the sweeper hands the flow to nobody else (no second request)."""
    c, key = crash_cluster, uid("ag")
    res = c.sw.start(key, durable_trip, key, linger=True).wait(timeout=T)
    assert res.status is SagaStatus.COMPLETED, res.error
    assert turns(c, key) == ["turn-0", "turn-1", "turn-2"]


def test_a_worker_killed_during_a_tool_is_resumed_without_asking_the_model_again(
        crash_cluster: Cluster) -> None:
    """SIGKILL of the process running an idempotent tool the model asked for: the step is
    run again by another process (as any idempotent step), the run goes on from the
    journal, and no model turn is sent twice (the request before the tool has its
    response in the journal)."""
    c, key = crash_cluster, uid("ag")
    saga = c.sw.start(key, durable_trip, key, quote=True)
    row = wait_for(lambda: (r := c.sw.journal.entry_row(key, 2)) is not None
                   and r.started_at is not None and effects(c, key) == ["quote_room"] and r,
                   T, "the quote to start")
    pid = int(row.worker.rpartition("|")[2])
    os.kill(pid, signal.SIGKILL)
    res = saga.wait(timeout=T)
    assert res.status is SagaStatus.COMPLETED, res.error
    assert gone(pid)  # the kill hit the process running the tool
    assert effects(c, key) == ["quote_room", "quote_room", "book_hotel", "charge_card"]
    assert turns(c, key) == ["turn-0", "turn-1", "turn-2", "turn-3"]
