"""The MCP tasks extension (``io.modelcontextprotocol/tasks``) in process, on a
SQLite journal and kombu's memory transport (no worker runs the steps): which calls become
tasks, their wire shapes, and tasks read from the journal by any server and bound to their
caller. The client is the SDK's, with the tasks extension of ``fastmcp-tasks`` (the client
half FastMCP and Pydantic AI use)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from datetime import datetime
from typing import Any

import anyio
import mcp_types as types
import pytest
from fastmcp_tasks.client import TasksClientExtension
from fastmcp_tasks.client_models import (
    CancelTaskRequest,
    CancelTaskRequestParams,
    ClientCreateTaskResult,
    ClientGetTaskResult,
    GetTaskRequest,
    GetTaskRequestParams,
)
from mcp import Client
from mcp.shared.exceptions import MCPError
from pydantic import ConfigDict

from sagaworker import ApprovalInvalid, Phase, SagaStatus, Sagaworker
from sagaworker.mcp import SagaServer

TASKS = "io.modelcontextprotocol/tasks"
CALL_ID = "dev.sagaworker/call_id"


class Raw(types.Result):
    """Any result, every key kept as the wire had it."""

    model_config = ConfigDict(extra="allow")


def run(server: SagaServer, body: Callable[[Client], Awaitable[Any]], *,
        tasks: bool = True, mode: str = "auto") -> Any:
    """``body`` with a client of ``server`` that declares the tasks extension (or not)."""
    async def main() -> Any:
        extensions = [TasksClientExtension()] if tasks else None
        async with Client(server.server(), mode=mode, extensions=extensions) as client:
            return await body(client)

    return anyio.run(main)


async def begin(client: Client) -> str:
    r = await client.call_tool("saga_begin", {"purpose": "a trip to Lisbon"})
    assert not r.is_error
    return str(r.structured_content["saga_id"])


def voucher(saga_id: str) -> dict[str, Any]:
    return {"saga_id": saga_id, "key": "k", "email": "ana@example.com"}


async def call(client: Client, name: str, args: dict[str, Any],
               meta: dict[str, Any] | None = None) -> Any:
    """The call's answer as sent: a task (``ClientCreateTaskResult``) or a tool result."""
    return await client.session.call_tool(name, args, meta=meta, allow_claimed=True)


async def get(client: Client, task_id: str) -> ClientGetTaskResult:
    return await client.session.send_request(
        GetTaskRequest(params=GetTaskRequestParams(task_id=task_id)), ClientGetTaskResult)


async def get_raw(client: Client, task_id: str) -> dict[str, Any]:
    got = await client.session.send_request(
        GetTaskRequest(params=GetTaskRequestParams(task_id=task_id)), Raw)
    return dict(got.model_extra or {})


async def cancel(client: Client, task_id: str) -> dict[str, Any]:
    got = await client.session.send_request(
        CancelTaskRequest(params=CancelTaskRequestParams(task_id=task_id)), Raw)
    return dict(got.model_extra or {})


async def refused(request: Awaitable[Any]) -> tuple[int, str]:
    with pytest.raises(MCPError) as err:
        await request
    return err.value.error.code, err.value.error.message


def entries(sw: Sagaworker, saga_id: str) -> list[tuple[int, str, Phase]]:
    return [(e.seq, e.tool_name.rsplit(".", 1)[-1], e.phase)
            for e in sw.inspect(saga_id).entries]


def test_a_gate_is_a_task_for_a_client_that_declared_the_extension(sw: Sagaworker) -> None:
    """The server advertises the extension; a gated call answers a task handle (working, the
    text saying the step has NOT run and an operator decides) instead of PENDING_APPROVAL;
    tasks/get answers it working from the journal; the same call id again is the same step
    and its task reads the same."""
    async def body(client: Client) -> tuple[Any, ...]:
        saga_id = await begin(client)
        first = await call(client, "send_voucher", voucher(saga_id), {CALL_ID: "v1"})
        again = await call(client, "send_voucher", voucher(saga_id), {CALL_ID: "v1"})
        return (client.server_capabilities, saga_id, first, again,
                await get_raw(client, first.task_id), await get(client, again.task_id))

    caps, saga_id, first, again, raw, got = run(SagaServer(sw, wait=0.2), body)
    assert caps.extensions == {TASKS: {}}
    for created in (first, again):
        assert isinstance(created, ClientCreateTaskResult)
        assert (created.result_type, created.status) == ("task", "working")
        assert "has NOT run" in str(created.status_message)
        assert "operator" in str(created.status_message)
        assert created.poll_interval_ms and created.poll_interval_ms > 0
        assert datetime.fromisoformat(created.created_at).tzinfo is not None
    assert len(first.task_id) > 40 and saga_id not in first.task_id
    assert set(raw) == {"resultType", "taskId", "status", "statusMessage", "createdAt",
                        "lastUpdatedAt", "ttlMs", "pollIntervalMs"}
    assert (raw["resultType"], raw["taskId"], raw["status"], raw["ttlMs"]) == (
        "complete", first.task_id, "working", None)
    assert raw["statusMessage"] == first.status_message
    assert (got.status, got.result, got.error) == ("working", None, None)
    assert entries(sw, saga_id) == [(1, "send_voucher", Phase.AWAITING_APPROVAL)]


@pytest.mark.parametrize("mode", ["legacy", "auto"])
def test_without_the_extension_the_answers_are_as_before(sw: Sagaworker, mode: str) -> None:
    """A client that did not declare the extension (or a 2025-11-25 session, where it cannot
    be declared) gets PENDING_APPROVAL and RUNNING as before; tasks/get is refused to it:
    -32021 (missing client capability) on 2026-07-28, no such method on 2025-11-25."""
    async def body(client: Client) -> tuple[Any, ...]:
        saga_id = await begin(client)
        card = {"saga_id": saga_id, "key": "k", "card": "visa", "amount_cents": 1}
        return (saga_id, await client.call_tool("send_voucher", voucher(saga_id)),
                await client.call_tool("charge_card", card),
                await refused(get(client, "no-task")))

    saga_id, gate, running, (code, message) = run(
        SagaServer(sw, wait=0.3), body, tasks=mode == "legacy", mode=mode)
    assert gate.structured_content["status"] == "PENDING_APPROVAL"
    assert running.structured_content["status"] == "RUNNING"
    if mode == "auto":
        assert code == -32021 and TASKS in message
    else:
        assert code == types.METHOD_NOT_FOUND
    assert entries(sw, saga_id) == [(1, "send_voucher", Phase.AWAITING_APPROVAL),
                                    (2, "charge_card", Phase.INTENT)]


def test_a_step_without_an_outcome_within_the_wait_is_a_task(sw: Sagaworker) -> None:
    """No worker here: once the wait is over the call answers a task that is working (the
    step RUNNING), and tasks/get says so from the journal."""
    async def body(client: Client) -> tuple[Any, ...]:
        saga_id = await begin(client)
        created = await call(client, "charge_card", {
            "saga_id": saga_id, "key": "k", "card": "visa", "amount_cents": 100})
        return saga_id, created, await get(client, created.task_id)

    saga_id, created, got = run(SagaServer(sw, wait=0.3), body)
    assert isinstance(created, ClientCreateTaskResult) and created.status == "working"
    assert "RUNNING" in str(created.status_message)
    assert got.status == "working" and "RUNNING" in str(got.status_message)
    assert entries(sw, saga_id) == [(1, "charge_card", Phase.INTENT)]


def test_a_task_is_read_from_the_journal_by_any_server_and_bound_to_its_caller(
        sw: Sagaworker) -> None:
    """Alice's task, read by another server process of hers (a restart, a second replica):
    the same task. To Bob it is unknown, for tasks/get and tasks/cancel (-32602, the answer
    an id that never was gets), and so is an id altered in any part: nothing is cancelled."""
    alice = SagaServer(sw, principal="token:alice", wait=0.2)

    async def create(client: Client) -> tuple[str, str]:
        saga_id = await begin(client)
        return saga_id, (await call(client, "send_voucher", voucher(saga_id))).task_id

    saga_id, task_id = run(alice, create)
    parts = task_id.split(".")
    altered = [".".join([*parts[:-1], parts[-1][:-2] + "AA"]),
               ".".join([parts[0], "2", *parts[2:]]), task_id + "x", "mcp-" + task_id]

    async def as_bob(client: Client) -> list[tuple[int, str]]:
        return [await refused(get(client, task_id)), await refused(cancel(client, task_id))]

    async def as_alice(client: Client) -> tuple[Any, list[tuple[int, str]]]:
        return (await get(client, task_id),
                [await refused(get(client, t)) for t in altered])

    bobs = run(SagaServer(sw, principal="token:bob"), as_bob)
    got, alterations = run(SagaServer(sw, principal="token:alice"), as_alice)
    assert got.status == "working" and got.task_id == task_id
    for code, message in [*bobs, *alterations]:
        assert code == types.INVALID_PARAMS and "not found" in message
    rec = sw.inspect(saga_id)
    assert rec.status is SagaStatus.AWAITING_APPROVAL and rec.reason is None
    assert [a.seq for a in sw.pending_approvals() if a.saga_id == saga_id] == [1]


def test_cancelling_a_gated_task_aborts_its_saga_and_rejects_nothing(sw: Sagaworker) -> None:
    """tasks/cancel answers an empty result and aborts the saga (the reason names the task's
    step): the gate is closed, not rejected (an approval is refused after it), and the task
    reads cancelled; cancelling it again changes nothing."""
    async def body(client: Client) -> tuple[Any, ...]:
        saga_id = await begin(client)
        task_id = (await call(client, "send_voucher", voucher(saga_id))).task_id
        gate = next(a for a in sw.pending_approvals() if a.saga_id == saga_id)
        acks = [await cancel(client, task_id), await cancel(client, task_id)]
        return saga_id, gate, acks, await get(client, task_id)

    saga_id, gate, acks, got = run(SagaServer(sw, wait=0.2), body)
    assert [set(a) for a in acks] == [{"resultType"}] * 2
    assert got.status == "cancelled" and got.result is None
    assert "aborted" in str(got.status_message)
    rec = sw.inspect(saga_id)
    assert rec.reason == ("aborted by mcp:stdio: the client cancelled the task of step 1 "
                          "(send_voucher): tasks/cancel")
    assert rec.entries[0].phase is not Phase.REJECTED
    assert not any(a.saga_id == saga_id for a in sw.pending_approvals())
    with pytest.raises(ApprovalInvalid):
        sw.approve(gate.token, approver="ops")
