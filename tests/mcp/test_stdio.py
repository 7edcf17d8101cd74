"""`sagaworker mcp` over stdio, as a host runs it: the SDK's client spawns the server
process, real `celery worker` processes run the steps on PostgreSQL and RabbitMQ/Redis.
The tools are the trip's (tests/apps/cluster.py): book_hotel (undo: cancel_hotel),
charge_card (the card "declined" fails; undo: refund_card), send_voucher (IRREVERSIBLE)."""

from __future__ import annotations

import json
import subprocess
from typing import Any

import anyio
import pytest

from sagaworker import Phase, SagaStatus
from tests.conftest import ROOT, Cluster, uid, wait_for
from tests.mcp.serve import CALL_ID, COMMAND, begin, env, stdio

pytestmark = [pytest.mark.services, pytest.mark.one_broker]


def kinds(c: Cluster, key: str) -> list[tuple[str, str]]:
    return [(r.kind, r.tool) for r in c.ledger(key)]


def steps(c: Cluster, saga_id: str) -> list[tuple[int, str, Phase, str | None]]:
    return [(e.seq, e.tool_name.rsplit(".", 1)[-1], e.phase, e.call_id)
            for e in c.sw.inspect(saga_id).entries]


def hotel(saga_id: str, key: str) -> dict[str, Any]:
    return {"saga_id": saga_id, "key": key, "city": "Lisbon", "nights": 2}


@pytest.mark.parametrize("mode", ["legacy", "auto"])
def test_a_call_is_a_step_the_workers_run(cluster: Cluster, mode: str) -> None:
    """Both protocol eras: a call journals one step, a worker runs it, the call answers
    EXECUTED with the tool's result; saga_commit completes the saga."""
    key = uid("mcp")

    async def body() -> tuple[str, Any, Any]:
        async with stdio(cluster, mode=mode) as client:
            saga_id = await begin(client)
            done = await client.call_tool("book_hotel", hotel(saga_id, key))
            return saga_id, done, await client.call_tool("saga_commit", {"saga_id": saga_id})

    saga_id, done, commit = anyio.run(body)
    assert not done.is_error, done.content
    assert done.structured_content == {"status": "EXECUTED", "saga_id": saga_id, "seq": 1,
                                       "tool": "book_hotel",
                                       "result": {"booking": "H-Lisbon-2"}}
    assert "EXECUTED" in done.content[0].text
    assert kinds(cluster, key) == [("effect", "book_hotel")]
    assert not commit.is_error and commit.structured_content["status"] == "COMPLETED"
    assert cluster.sw.inspect(saga_id).status is SagaStatus.COMPLETED


def test_a_failed_call_undoes_what_ran_once_and_says_what(cluster: Cluster) -> None:
    """A hotel booked, then the card declined: the call answers FAILED (isError) with what
    was undone (the hotel, COMPENSATED) and not to retry in this saga; the undo ran once,
    and the saga takes no more steps (the next call is refused, journaling nothing)."""
    key = uid("mcp")

    async def body() -> tuple[str, list[Any]]:
        async with stdio(cluster, "--wait", "30") as client:
            saga_id = await begin(client)
            booked = await client.call_tool("book_hotel", hotel(saga_id, key))
            declined = await client.call_tool("charge_card", {
                "saga_id": saga_id, "key": key, "card": "declined", "amount_cents": 42000})
            again = await client.call_tool("charge_card", {
                "saga_id": saga_id, "key": key, "card": "visa", "amount_cents": 42000})
            return saga_id, [booked, declined, again]

    saga_id, (booked, declined, again) = anyio.run(body)
    assert booked.structured_content["status"] == "EXECUTED"
    assert declined.is_error
    got = declined.structured_content
    assert (got["status"], got["seq"], got["tool"], got["saga_status"]) == (
        "FAILED", 2, "charge_card", "COMPENSATED")
    assert "card declined" in got["error"]
    assert got["compensations"] == [{"seq": 1, "tool": "book_hotel", "phase": "COMPENSATED"}]
    text = declined.content[0].text
    assert "book_hotel (step 1) COMPENSATED" in text and "Do not retry" in text
    assert got["message"] == text.split("\n")[0]
    assert again.is_error and again.structured_content["status"] == "REFUSED"
    rec = cluster.sw.inspect(saga_id)
    assert rec.status is SagaStatus.COMPENSATED and len(rec.entries) == 2
    assert kinds(cluster, key) == [("effect", "book_hotel"), ("undo", "book_hotel")]


def test_a_gate_is_decided_by_a_signed_token_not_by_any_request(cluster: Cluster) -> None:
    """send_voucher answers PENDING_APPROVAL (it has not run); no tool approves, and the
    same call again (its call id) journals nothing and still pends. Approved with the
    gate's signed token while no server runs, the step runs, and a new server process's
    saga_status shows it EXECUTED; the retried call then answers EXECUTED."""
    key = uid("mcp")
    voucher = {"key": key, "email": "ana@example.com"}

    async def ask() -> tuple[str, list[str], list[Any]]:
        async with stdio(cluster) as client:
            saga_id = await begin(client)
            names = [t.name for t in (await client.list_tools()).tools]
            call = {"saga_id": saga_id, **voucher}
            return saga_id, names, [
                await client.call_tool("send_voucher", call, meta={CALL_ID: "v1"}),
                await client.call_tool("send_voucher", call, meta={CALL_ID: "v1"}),
                await client.call_tool("saga_commit", {"saga_id": saga_id})]

    saga_id, names, (first, again, commit) = anyio.run(ask)
    assert not any("approv" in n or "reject" in n for n in names)
    for r in (first, again):
        assert not r.is_error
        assert (r.structured_content["status"], r.structured_content["seq"]) == (
            "PENDING_APPROVAL", 1)
        assert "has NOT run" in r.content[0].text
    assert "Not committed yet" in commit.content[0].text
    assert steps(cluster, saga_id) == [(1, "send_voucher", Phase.AWAITING_APPROVAL, "v1")]
    assert kinds(cluster, key) == []

    gate = next(a for a in cluster.sw.pending_approvals() if a.saga_id == saga_id)
    cluster.sw.approve(gate.token, approver="ops-oncall")
    wait_for(lambda: steps(cluster, saga_id)[0][2] is Phase.EXECUTED, 60, "the voucher")

    async def look() -> list[Any]:
        async with stdio(cluster) as client:
            return [await client.call_tool("saga_status", {"saga_id": saga_id}),
                    await client.call_tool("send_voucher", {"saga_id": saga_id, **voucher},
                                           meta={CALL_ID: "v1"})]

    status, retried = anyio.run(look)
    assert status.structured_content["steps"] == [
        {"seq": 1, "tool": "send_voucher", "phase": "EXECUTED",
         "result": "voucher sent to ana@example.com"}]
    assert retried.structured_content["status"] == "EXECUTED"
    assert len(steps(cluster, saga_id)) == 1
    assert kinds(cluster, key) == [("effect", "send_voucher")]


def test_a_retried_call_id_answers_the_journaled_step(cluster: Cluster) -> None:
    """The same call id again, from a restarted server (a host retrying after a lost
    answer): the first step's outcome, nothing journaled, the tool not run again."""
    key = uid("mcp")

    async def call(saga_id: str | None) -> tuple[str, Any]:
        async with stdio(cluster) as client:
            saga_id = saga_id or await begin(client)
            return saga_id, await client.call_tool("book_hotel", hotel(saga_id, key),
                                                   meta={CALL_ID: "call-7"})

    saga_id, first = anyio.run(call, None)
    _, second = anyio.run(call, saga_id)
    assert first.structured_content == second.structured_content
    assert second.structured_content["status"] == "EXECUTED"
    assert steps(cluster, saga_id) == [(1, "book_hotel", Phase.EXECUTED, "call-7")]
    assert kinds(cluster, key) == [("effect", "book_hotel")]


def test_refusals_journal_nothing(cluster: Cluster) -> None:
    """Bad arguments, an unknown saga and a committed one: isError with the reason, nothing
    journaled, nothing run, the open saga still RUNNING."""
    key = uid("mcp")

    async def body() -> tuple[str, str, list[Any]]:
        async with stdio(cluster) as client:
            saga_id, closed = await begin(client), await begin(client)
            await client.call_tool("saga_commit", {"saga_id": closed})
            return saga_id, closed, [
                await client.call_tool("book_hotel", {**hotel(saga_id, key), "nights": "2x"}),
                await client.call_tool("book_hotel", hotel("mcp-nobody", key)),
                await client.call_tool("book_hotel", hotel(closed, key))]

    saga_id, closed, results = anyio.run(body)
    assert [(r.is_error, r.structured_content["status"]) for r in results] == [
        (True, "REFUSED")] * 3
    assert steps(cluster, saga_id) == [] and steps(cluster, closed) == []
    assert cluster.sw.inspect(saga_id).status is SagaStatus.RUNNING
    assert kinds(cluster, key) == []


def test_a_slow_step_answers_running_with_progress_and_a_closed_transport_stops_nothing(
        cluster: Cluster) -> None:
    """A step slower than the wait: progress notifications while it waits, then RUNNING.
    A call whose client gives up and closes the transport mid-wait leaves its step to the
    workers: both steps end EXECUTED, and saga_status tells."""
    key = uid("mcp")
    seen: list[str | None] = []

    async def progress(done: float, total: float | None, message: str | None) -> None:
        seen.append(message)

    async def body() -> tuple[str, Any]:
        async with stdio(cluster, "--wait", "2.5") as client:
            saga_id = await begin(client)
            slow = await client.call_tool("step", {"saga_id": saga_id, "key": key,
                                                   "name": "slow", "sleep": 4},
                                          progress_callback=progress)
        async with stdio(cluster, "--wait", "30") as client:
            with anyio.move_on_after(1.5):
                await client.call_tool("step", {"saga_id": saga_id, "key": key,
                                                "name": "abandoned", "sleep": 3})
        return saga_id, slow

    saga_id, slow = anyio.run(body)
    assert not slow.is_error
    assert slow.structured_content == {"status": "RUNNING", "saga_id": saga_id, "seq": 1,
                                       "tool": "step",
                                       "message": slow.content[0].text.split("\n")[0]}
    assert len(seen) >= 2 and all("step 1 (step) has no outcome yet" in str(m) for m in seen)
    wait_for(lambda: [s[2] for s in steps(cluster, saga_id)] == [Phase.EXECUTED] * 2, 60,
             "both steps to run")

    async def status() -> Any:
        async with stdio(cluster) as client:
            return await client.call_tool("saga_status", {"saga_id": saga_id})

    got = anyio.run(status).structured_content
    assert [(s["tool"], s["phase"], s["result"]) for s in got["steps"]] == [
        ("step", "EXECUTED", "slow-done"), ("step", "EXECUTED", "abandoned-done")]
    assert kinds(cluster, key) == [("effect", "slow"), ("effect", "abandoned")]


def test_a_server_given_files_for_stdin_and_stdout_answers_through_the_sdks_threads(
        cluster: Cluster) -> None:
    """`sagaworker mcp < requests.jsonl > answers.jsonl`: files, not pipes, so served by the
    SDK's threads (the loop cannot poll a file); each request is answered, in the file."""
    requests = cluster.tmp / "requests.jsonl"
    answers = cluster.tmp / "answers.jsonl"
    lines = [
        {"jsonrpc": "2.0", "id": 1, "method": "initialize",
         "params": {"protocolVersion": "2025-11-25", "capabilities": {},
                    "clientInfo": {"name": "a-file", "version": "1"}}},
        {"jsonrpc": "2.0", "method": "notifications/initialized"},
        {"jsonrpc": "2.0", "id": 2, "method": "tools/list"}]
    requests.write_text("".join(json.dumps(line) + "\n" for line in lines))
    with requests.open("rb") as stdin, answers.open("wb") as stdout:
        proc = subprocess.run(COMMAND, stdin=stdin, stdout=stdout, stderr=subprocess.PIPE,
                              env=env(cluster), cwd=ROOT, timeout=120)
    assert proc.returncode == 0, proc.stderr
    got = [json.loads(line) for line in answers.read_text().splitlines()]
    assert [a["id"] for a in got] == [1, 2], got
    assert got[0]["result"]["serverInfo"]["name"] == "sagaworker"
    assert {"book_hotel", "saga_begin"} <= {t["name"] for t in got[1]["result"]["tools"]}
