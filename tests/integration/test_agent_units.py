"""A durable agent run's plain function tools (not ``@sw.tool``s) are journaled units of the
flow's saga, through real worker processes on PostgreSQL and a real broker
(tests/apps/agent_runs.py): run once across every replay, never cancelled into a re-run
by a sibling call, in doubt (not re-run) when their worker dies mid-body unless declared
idempotent; a unit's value is the journaled one on its first run as on every replay."""

from __future__ import annotations

import os
import signal
from collections import Counter
from typing import Any

import pytest

from sagaworker import OutcomeResult, Phase, SagaStatus
from tests.conftest import Cluster, uid, wait_for
from tests.integration.test_durable_agents import effects, gone, turns

pytest.importorskip("pydantic_ai")
pytestmark = [pytest.mark.services, pytest.mark.one_broker]
T = 60
FLOWS = "tests.apps.agent_runs"


def hotel(key: str) -> list[Any]:
    return ["book_hotel", {"key": key, "city": "Lisbon", "nights": 2}]


def mail(key: str, to: str = "ana") -> list[Any]:
    return ["send_mail", {"key": key, "to": to}]


def charge(key: str, card: str = "visa") -> list[Any]:
    return ["charge_card", {"key": key, "card": card, "amount_cents": 42000}]


def start(c: Cluster, key: str, flow: str, *args: Any, **kwargs: Any) -> Any:
    return c.sw.start(key, f"{FLOWS}.{flow}", key, *args, **kwargs)


def events(c: Cluster, key: str, name: str) -> list[dict[str, Any]]:
    return [e for e in c.events(key) if e.get("event") == name]


def test_an_openai_agents_plain_function_tool_runs_once_across_replays(
        crash_cluster: Cluster) -> None:
    """A plain ``@function_tool`` first, then three ``flow_tools`` steps: each step's
    outcome replays the run, and the mail went out once (it went out 4 times)."""
    c, key = crash_cluster, uid("fu")
    plan = [[mail(key)], [hotel(key)], [charge(key)], [["quote_room", {"key": key,
                                                                      "city": "Porto"}]]]
    res = start(c, key, "mail_run_oai", plan).wait(timeout=T)
    assert res.status is SagaStatus.COMPLETED, res.error
    assert res.value == f"done {key}"
    assert effects(c, key) == ["send_mail", "book_hotel", "charge_card", "quote_room"]
    assert turns(c, key) == ["turn-0", "turn-1", "turn-2", "turn-3", "turn-4"]
    names = [e.tool_name for e in c.sw.inspect(key).entries]
    assert names[:2] == ["unit:mailer__model.request", "unit:mailer__tool.send_mail"]


def test_parallel_calls_a_flow_step_and_a_function_tool_each_run_once(
        crash_cluster: Cluster) -> None:
    """One response asks for a plain function tool and a ``flow_toolset`` step at once:
    the step suspends the replay while the function tool runs; it finishes and journals
    its outcome (it was cancelled with its claim held, and ran again after the lease)."""
    c, key = crash_cluster, uid("fp")
    res = start(c, key, "mail_run", [[mail(key, "pause"), hotel(key)]]).wait(timeout=T)
    assert res.status is SagaStatus.COMPLETED, res.error
    assert Counter(effects(c, key)) == Counter({"book_hotel": 1, "send_mail": 1})
    assert turns(c, key) == ["turn-0", "turn-1"]
    assert not events(c, key, "step_rerun") and not events(c, key, "step_in_doubt")


def test_a_failing_call_leaves_no_sibling_claimed(crash_cluster: Cluster) -> None:
    """One response asks for a function tool that raises and one that is still running
    then: the run fails and compensates the hotel; the sibling finishes and journals its
    outcome (EXECUTED, SKIPPED in the compensation), nobody pages it in doubt."""
    c, key = crash_cluster, uid("fg")
    plan = [[hotel(key)], [["explode", {"key": key}], mail(key, "pause")]]
    res = start(c, key, "mail_run", plan).wait(timeout=T)
    assert res.status is SagaStatus.COMPENSATED
    assert [r.tool for r in c.ledger(key) if r.kind == "undo"] == ["book_hotel"]
    entries = c.sw.inspect(key).entries
    mailed = next(e for e in entries if e.tool_name.endswith("send_mail"))
    assert mailed.phase is Phase.EXECUTED
    assert effects(c, key).count("send_mail") == 1
    assert not events(c, key, "step_in_doubt")
    assert res.report is not None and not res.report.in_doubt


def _kill_in_mail(c: Cluster, key: str) -> int:
    """SIGKILL the process running the slow mail (its effect recorded, its body asleep)."""
    def running() -> Any:
        for e in c.sw.inspect(key).entries:
            if e.tool_name.endswith("send_mail") and e.phase is Phase.INTENT:
                row = c.sw.journal.entry_row(key, e.seq)
                if row.worker and "send_mail" in effects(c, key):
                    return row
        return None

    row = wait_for(running, T, "the mail to be running")
    pid = int(row.worker.rpartition("|")[2])
    os.kill(pid, signal.SIGKILL)
    return pid


def test_a_function_tool_killed_mid_body_is_in_doubt_not_run_again(
        crash_cluster: Cluster) -> None:
    """SIGKILL of the process running a plain function tool: it may have mailed, so it is
    not run again: in doubt (paged), the run fails and the hotel is cancelled."""
    c, key = crash_cluster, uid("fk")
    saga = start(c, key, "mail_run", [[hotel(key)], [mail(key, "slow")]])
    pid = _kill_in_mail(c, key)
    res = saga.wait(timeout=T)
    assert gone(pid)  # the kill hit the process running the mail
    assert res.status is SagaStatus.COMPENSATED
    assert effects(c, key) == ["book_hotel", "send_mail"]
    assert [r.tool for r in c.ledger(key) if r.kind == "undo"] == ["book_hotel"]
    entries = c.sw.inspect(key).entries
    mailed = next(e for e in entries if e.tool_name.endswith("send_mail"))
    assert mailed.phase is Phase.FAILED and mailed.in_doubt
    assert res.report is not None and [o.seq for o in res.report.in_doubt] == [mailed.seq]
    # what ran before it is undone latest first (the model turns have nothing to undo)
    assert [(o.seq, o.result) for o in res.report.outcomes] == [
        (e.seq, OutcomeResult.SKIPPED if e.tool_name.startswith("unit:")
         else OutcomeResult.COMPENSATED)
        for e in reversed(entries) if e.phase is Phase.EXECUTED]
    assert [e["seq"] for e in events(c, key, "step_in_doubt")] == [mailed.seq]


def test_a_function_tool_declared_idempotent_is_run_again_after_a_kill(
        crash_cluster: Cluster) -> None:
    """``Durability(sw, idempotent_tools={"send_mail"})``: the killed mail is run again
    and the run completes, no model turn sent twice."""
    c, key = crash_cluster, uid("fi")
    saga = start(c, key, "mail_run", [[hotel(key)], [mail(key, "slow")]], "idempotent")
    pid = _kill_in_mail(c, key)
    res = saga.wait(timeout=T)
    assert gone(pid)
    assert res.status is SagaStatus.COMPLETED, res.error
    assert effects(c, key) == ["book_hotel", "send_mail", "send_mail"]
    assert turns(c, key) == ["turn-0", "turn-1", "turn-2"]


def test_a_units_value_is_the_journaled_one_on_its_first_run_too(
        crash_cluster: Cluster) -> None:
    """The agent's output (with keys PostgreSQL's jsonb reorders) reaches a step's
    arguments: the first run passes what every replay reads, so the flow is not held as
    diverged (it was, for ever)."""
    c, key = crash_cluster, uid("fv")
    res = start(c, key, "counted_run").wait(timeout=T)
    assert res.status is SagaStatus.COMPLETED, res.error
    assert [r.tool for r in c.ledger(key) if r.kind == "effect"] == [
        '{"a": 2, "zz": 1, "bbb": 3}', "after"]
    assert not events(c, key, "flow_diverged")


def test_a_tool_steps_result_is_the_journaled_one_on_the_first_run_too(
        crash_cluster: Cluster) -> None:
    """The same for a tool step's result handed on by a flow (run eagerly by the worker
    that advanced the flow, or delivered): the next step's arguments are what every
    replay reads, and the flow completes without a divergence."""
    from tests.apps.cluster import passes_counts

    c, key = crash_cluster, uid("ft")
    res = c.sw.start(key, passes_counts, key).wait(timeout=T)
    assert res.status is SagaStatus.COMPLETED, res.error
    assert [r.tool for r in c.ledger(key) if r.kind == "effect"] == [
        "counts", '{"a": 2, "zz": 1, "bbb": 3}']
    assert not events(c, key, "flow_diverged")


def test_a_unit_whose_value_the_journal_cannot_hold_fails_the_run_clearly(
        crash_cluster: Cluster) -> None:
    """A function tool of an OpenAI Agents run returns NaN: its effect happened, so its
    step is EXECUTED with the error saying why no result is journaled, and the run fails
    and compensates (it was a raw SQL error, then the step paged in doubt)."""
    c, key = crash_cluster, uid("fn")
    res = start(c, key, "mail_run_oai", [[hotel(key)], [["measure", {"key": key}]]]).wait(
        timeout=T)
    assert res.status is SagaStatus.COMPENSATED
    assert effects(c, key) == ["book_hotel", "measure"]
    assert [r.tool for r in c.ledger(key) if r.kind == "undo"] == ["book_hotel"]
    measured = next(e for e in c.sw.inspect(key).entries if e.tool_name.endswith("measure"))
    assert measured.phase is Phase.EXECUTED and not measured.in_doubt
    assert measured.error == "result is not JSON: float (NaN or infinity)"
    assert not events(c, key, "step_in_doubt")


# -- what a prompt-injected model can make of a durable run -------------------------------


def test_a_reused_tool_call_id_is_a_step_of_its_own(crash_cluster: Cluster) -> None:
    """The model names two calls, in two turns, with one tool-call id: each is a step of
    its own (the second id journaled with its occurrence), the run completes (every
    advance failed with an IntegrityError until the deadline)."""
    c, key = crash_cluster, uid("fd")
    res = start(c, key, "mail_run", [[[*hotel(key), "dup"]], [[*charge(key), "dup"]]]).wait(
        timeout=T)
    assert res.status is SagaStatus.COMPLETED, res.error
    assert effects(c, key) == ["book_hotel", "charge_card"]
    assert [e.call_id for e in c.sw.inspect(key).entries if e.call_id] == [
        f"{key}/mailer_plain/0/dup", f"{key}/mailer_plain/0/dup#2"]


def test_tool_call_ids_of_a_long_saga_id_stay_unique(crash_cluster: Cluster) -> None:
    """A saga id of 190 characters: its tool-call ids, cut at 200, were one and the same
    (the second call wedged the run); a long one keeps its start and a digest."""
    c = crash_cluster
    key = uid("fl") + "-" + "x" * (190 - len(uid("fl")) - 1)
    assert len(key) == 190
    res = start(c, key, "mail_run", [[hotel(key)], [charge(key)]]).wait(timeout=T)
    assert res.status is SagaStatus.COMPLETED, res.error
    assert effects(c, key) == ["book_hotel", "charge_card"]
    ids = [e.call_id for e in c.sw.inspect(key).entries if e.call_id]
    assert len(ids) == 2 and len(set(ids)) == 2 and all(len(i) <= 200 for i in ids)


@pytest.mark.parametrize("flow", ["mail_run", "mail_run_oai"])
def test_arguments_the_journal_refuses_are_a_model_retry(crash_cluster: Cluster,
                                                         flow: str) -> None:
    """A ``flow_toolset`` (``flow_tools``) call whose arguments cannot be journaled (over
    SAGAWORKER_MAX_ARGS_BYTES) goes back to the model as a retry, as outside a flow; the
    model's next call runs (the saga failed and undid everything)."""
    c, key = crash_cluster, uid("fr")
    huge = ["book_hotel", {"key": key, "city": "@300kB", "nights": 2}]
    res = start(c, key, flow, [[huge], [hotel(key)]]).wait(timeout=T)
    assert res.status is SagaStatus.COMPLETED, res.error
    assert effects(c, key) == ["book_hotel"]
    assert turns(c, key) == ["turn-0", "turn-1", "turn-2"]


def test_a_model_answer_with_a_nul_fails_the_run_without_quoting_it(
        crash_cluster: Cluster) -> None:
    """The model's answer holds a NUL (no PostgreSQL text holds one) and a card: the
    request's step is EXECUTED with an error naming the NUL, the run fails and undoes the
    hotel; the reason quotes nothing of the answer (it was a raw DataError quoting the
    response, then a false in-doubt)."""
    c, key = crash_cluster, uid("fz")
    card = "4111111111111111"
    res = start(c, key, "mail_run", [[hotel(key)]], "plain", f"card {card} @NUL").wait(
        timeout=T)
    assert res.status is SagaStatus.COMPENSATED
    assert [r.tool for r in c.ledger(key) if r.kind == "undo"] == ["book_hotel"]
    last = c.sw.inspect(key).entries[-1]
    assert last.tool_name == "unit:mailer_plain__model.request"
    assert last.phase is Phase.EXECUTED and last.error is not None and "NUL" in last.error
    reason = c.sw.inspect(key).reason or ""
    assert reason == f"step {last.seq} (unit:mailer_plain__model.request) failed: " \
                     f"{last.error}"
    assert card not in reason and card not in last.error
    assert not events(c, key, "step_in_doubt")
