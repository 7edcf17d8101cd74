"""The tasks extension (``io.modelcontextprotocol/tasks``) with real workers: FastMCP's client
with fastmcp-tasks (it declares the extension, as Pydantic AI's MCP toolset does) against
`sagaworker mcp` processes, over stdio and over Streamable HTTP with two bearer tokens.
The tools are the trip's (tests/apps/cluster.py); each test's effects and undos are read
from the oracle ledger."""

from __future__ import annotations

from typing import Any

import anyio
import fastmcp
import pytest
from fastmcp_tasks import ToolTask, call_tool_task
from mcp.shared.exceptions import MCPError

from sagaworker import Phase, SagaStatus
from tests.conftest import Cluster, uid, wait_for
from tests.mcp.serve import ALICE, BOB, TOKENS, begin, fastmcp_stdio, http_server

pytestmark = [pytest.mark.services, pytest.mark.one_broker]

EMAIL = "ana@example.com"


def kinds(c: Cluster, key: str) -> list[tuple[str, str]]:
    return [(r.kind, r.tool) for r in c.ledger(key)]


def phases(c: Cluster, saga_id: str) -> list[tuple[int, str, Phase]]:
    return [(e.seq, e.tool_name.rsplit(".", 1)[-1], e.phase)
            for e in c.sw.inspect(saga_id).entries]


def test_a_gated_call_is_a_task_an_operator_decides_while_no_server_runs(
        cluster: Cluster) -> None:
    """send_voucher answers a task at once (working: it has NOT run, an operator decides);
    tasks/get says so. The server process ends; the gate is approved with its signed token
    while no request is open and no server runs; a new server process answers tasks/get
    for the same task id from the journal: completed, with the call's EXECUTED result. The
    voucher was sent once."""
    key = uid("mcp")

    async def ask() -> tuple[str, Any, Any]:
        async with fastmcp_stdio(cluster) as client:
            saga_id = await begin(client)
            task = await call_tool_task(client, "send_voucher", {
                "saga_id": saga_id, "key": key, "email": EMAIL})
            return saga_id, task.create_result, await task.status()

    saga_id, created, status = anyio.run(ask)
    assert (created.result_type, created.status) == ("task", "working")
    assert "has NOT run" in str(created.status_message)
    assert (status.status, status.result) == ("working", None)
    assert "operator" in str(status.status_message)
    assert phases(cluster, saga_id) == [(1, "send_voucher", Phase.AWAITING_APPROVAL)]
    assert kinds(cluster, key) == []

    gate = next(a for a in cluster.sw.pending_approvals() if a.saga_id == saga_id)
    cluster.sw.approve(gate.token, approver="ops-oncall")

    async def look() -> tuple[Any, Any]:
        async with fastmcp_stdio(cluster) as client:
            task = ToolTask(client, "send_voucher", created)
            return await task.wait(timeout=60), await task.result()

    final, result = anyio.run(look)
    executed = {"status": "EXECUTED", "saga_id": saga_id, "seq": 1, "tool": "send_voucher",
                "result": f"voucher sent to {EMAIL}"}
    assert final.status == "completed" and final.task_id == created.task_id
    assert final.result["structuredContent"] == executed
    assert not final.result.get("isError")
    assert "send_voucher ran (step 1" in final.result["content"][0]["text"]
    assert result.structured_content == executed and not result.is_error
    assert phases(cluster, saga_id) == [(1, "send_voucher", Phase.EXECUTED)]
    assert kinds(cluster, key) == [("effect", "send_voucher")]


def test_cancelling_a_gated_task_aborts_the_saga_which_undoes_what_ran_once(
        cluster: Cluster) -> None:
    """A hotel booked and a card charged (answered at once), then the voucher's gate as a
    task: tasks/cancel aborts the saga. The card is refunded, then the hotel cancelled,
    each once, and the voucher never sent; the gate is gone from the pending approvals; the
    task reads cancelled, saying what was undone."""
    key = uid("mcp")

    async def body() -> tuple[str, list[Any], Any]:
        async with fastmcp_stdio(cluster, "--wait", "30") as client:
            saga_id = await begin(client)
            ran = [await client.call_tool("book_hotel", {
                       "saga_id": saga_id, "key": key, "city": "Lisbon", "nights": 2}),
                   await client.call_tool("charge_card", {
                       "saga_id": saga_id, "key": key, "card": "visa",
                       "amount_cents": 42000})]
            task = await call_tool_task(client, "send_voucher", {
                "saga_id": saga_id, "key": key, "email": EMAIL})
            await task.cancel()
            await anyio.to_thread.run_sync(lambda: wait_for(
                lambda: cluster.sw.inspect(saga_id).status is SagaStatus.COMPENSATED, 60,
                "the saga to be undone"))
            return saga_id, ran, await task.wait(timeout=30)

    saga_id, ran, final = anyio.run(body)
    assert [r.structured_content["status"] for r in ran] == ["EXECUTED"] * 2
    assert final.status == "cancelled" and final.result is None
    assert ("undoes every step that ran, latest first: charge_card (step 2) COMPENSATED; "
            "book_hotel (step 1) COMPENSATED") in str(final.status_message)
    assert kinds(cluster, key) == [("effect", "book_hotel"), ("effect", "charge_card"),
                                   ("undo", "charge_card"), ("undo", "book_hotel")]
    rec = cluster.sw.inspect(saga_id)
    assert rec.reason is not None and "tasks/cancel" in rec.reason
    assert [e.phase for e in rec.entries] == [Phase.EXECUTED, Phase.EXECUTED, Phase.CANCELLED]
    assert not any(a.saga_id == saga_id for a in cluster.sw.pending_approvals())


def test_a_step_longer_than_the_wait_is_a_task_that_completes_with_its_outcome(
        cluster: Cluster) -> None:
    """--wait 1: a slow step is a task, which FastMCP's ordinary call_tool polls to its
    EXECUTED result; a slow step that fails is a task that completes, once the saga has
    undone what ran, with the FAILED answer (isError) an immediate call gives: what was
    undone, and not to retry in this saga."""
    key = uid("mcp")
    log = cluster.tmp / f"mcp-{key}.log"

    async def body() -> tuple[str, Any, Any, Any]:
        async with fastmcp_stdio(cluster, "--wait", "1", log=log) as client:
            saga_id = await begin(client)
            slow = await client.call_tool("step", {"saga_id": saga_id, "key": key,
                                                   "name": "slow", "sleep": 2.5})
            task = await call_tool_task(client, "step", {
                "saga_id": saga_id, "key": key, "name": "boom", "fail": True, "sleep": 4})
            return saga_id, slow, await task.status(), await task.wait(timeout=60)

    saga_id, slow, status, final = anyio.run(body)
    assert slow.structured_content == {"status": "EXECUTED", "saga_id": saga_id, "seq": 1,
                                       "tool": "step", "result": "slow-done"}
    created = [line for line in log.read_text().splitlines() if "mcp_task_created" in line]
    assert len(created) == 2 and all('"gate": false' in line for line in created)
    assert status.status == "working" and "RUNNING" in str(status.status_message)
    assert final.status == "completed" and final.result["isError"] is True
    got = final.result["structuredContent"]
    assert (got["status"], got["seq"], got["saga_status"]) == ("FAILED", 2, "COMPENSATED")
    assert "boom failed on purpose" in got["error"]
    assert got["compensations"] == [{"seq": 1, "tool": "step", "phase": "COMPENSATED"}]
    text = final.result["content"][0]["text"]
    assert "step (step 1) COMPENSATED" in text and "Do not retry" in text
    assert kinds(cluster, key) == [("effect", "slow"), ("undo", "slow")]


def test_a_task_is_its_callers_and_completes_once_an_operator_rejects_it(cluster: Cluster) -> None:
    """Over HTTP with two bearer tokens: alice's gated call is a task; to bob its id is "not
    found" for tasks/get and tasks/cancel, and nothing is aborted: the saga still waits at
    its gate. An operator rejects the gate: alice's task completes with the FAILED answer
    (isError: rejected, nothing to undo, not to retry in this saga)."""
    key = uid("mcp")
    with http_server(cluster, SAGAWORKER_MCP_TOKENS=TOKENS) as (url, _, _):
        async def alice() -> tuple[str, Any, Any]:
            async with fastmcp.Client(url, auth=ALICE, timeout=60) as client:
                saga_id = await begin(client)
                task = await call_tool_task(client, "send_voucher", {
                    "saga_id": saga_id, "key": key, "email": EMAIL})
                return saga_id, task.create_result, await task.status()

        async def bob(created: Any) -> list[str]:
            refused = []
            async with fastmcp.Client(url, auth=BOB, timeout=60) as client:
                task = ToolTask(client, "send_voucher", created, raise_on_error=False)
                for ask in (task.status, task.cancel):
                    with pytest.raises(MCPError) as err:
                        await ask()
                    refused.append(err.value.error.message)
            return refused

        async def alice_again(created: Any) -> Any:
            async with fastmcp.Client(url, auth=ALICE, timeout=60) as client:
                return await ToolTask(client, "send_voucher", created).wait(timeout=60)

        saga_id, created, status = anyio.run(alice)
        refused = anyio.run(bob, created)
        rec = cluster.sw.inspect(saga_id)
        assert rec.status is SagaStatus.AWAITING_APPROVAL and rec.reason is None
        gate = next(a for a in cluster.sw.pending_approvals() if a.saga_id == saga_id)
        cluster.sw.reject(gate.token, approver="ops-oncall", reason="not today")
        final = anyio.run(alice_again, created)
    assert status.status == "working"
    assert refused == [f"Task {created.task_id} not found"] * 2
    assert cluster.sw.inspect(saga_id).metadata["mcp_principal"] == "token:alice"
    assert final.status == "completed" and final.result["isError"] is True
    got = final.result["structuredContent"]
    assert (got["status"], got["seq"], got["saga_status"], got["compensations"]) == (
        "FAILED", 1, "COMPENSATED", [])
    assert "an operator (ops-oncall) rejected it at its approval gate: not today" in got["error"]
    assert "Do not retry" in got["message"]
    assert kinds(cluster, key) == []
