"""`sagaworker mcp --http` with real workers: Streamable HTTP at /mcp, without tokens on
loopback, and with SAGAWORKER_MCP_TOKENS, each saga bound to the client that began it."""

from __future__ import annotations

import json
import signal
import urllib.error
import urllib.request
from typing import Any

import anyio
import pytest

from sagaworker import Phase, SagaStatus
from tests.conftest import Cluster, uid, wait_for
from tests.mcp.serve import ALICE, BOB, TOKENS, begin, http, http_server

pytestmark = [pytest.mark.services, pytest.mark.one_broker]



def door(url: str, token: str | None) -> int:
    """The HTTP status of an initialize request sent with ``token`` (if any)."""
    body = json.dumps({"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {
        "protocolVersion": "2025-11-25", "capabilities": {},
        "clientInfo": {"name": "door", "version": "1"}}}).encode()
    headers = {"Content-Type": "application/json",
               "Accept": "application/json, text/event-stream"}
    if token:
        headers["Authorization"] = f"Bearer {token}"
    try:
        with urllib.request.urlopen(urllib.request.Request(url, body, headers), timeout=30) as r:
            return int(r.status)
    except urllib.error.HTTPError as exc:
        return exc.code


def hotel(saga_id: str, key: str) -> dict[str, Any]:
    return {"saga_id": saga_id, "key": key, "city": "Porto", "nights": 1}


@pytest.mark.parametrize("mode", ["legacy", "auto"])
def test_without_tokens_loopback_serves_every_caller_as_one(cluster: Cluster,
                                                            mode: str) -> None:
    """No tokens: served on loopback, says so at start; a call runs as a step and answers
    EXECUTED; the saga names its principal and client."""
    key = uid("mcp")
    with http_server(cluster) as (url, log, _):
        async def body() -> tuple[str, Any]:
            async with http(url, mode=mode) as client:
                saga_id = await begin(client, "by http")
                return saga_id, await client.call_tool("book_hotel", hotel(saga_id, key))

        saga_id, done = anyio.run(body)
        assert "loopback only" in log.read_text()
    assert done.structured_content["status"] == "EXECUTED", done.content
    assert done.structured_content["result"] == {"booking": "H-Porto-1"}
    meta = cluster.sw.inspect(saga_id).metadata
    assert (meta["mcp_principal"], meta["purpose"]) == ("loopback", "by http")


@pytest.mark.parametrize("mode", ["legacy", "auto"])
def test_tokens_bind_each_saga_to_its_client(cluster: Cluster, mode: str) -> None:
    """With tokens: no token, or a wrong one, is refused at the door (401); alice's call runs;
    bob is told alice's saga does not exist, for a step, its status and an abort, and
    nothing is journaled or failed for it."""
    key = uid("mcp")
    with http_server(cluster, SAGAWORKER_MCP_TOKENS=TOKENS) as (url, log, _):
        async def alice() -> tuple[str, Any]:
            async with http(url, ALICE, mode) as client:
                saga_id = await begin(client)
                return saga_id, await client.call_tool("book_hotel", hotel(saga_id, key))

        async def bob(saga_id: str) -> list[Any]:
            async with http(url, BOB, mode) as client:
                return [await client.call_tool("book_hotel", hotel(saga_id, key)),
                        await client.call_tool("saga_status", {"saga_id": saga_id}),
                        await client.call_tool("saga_abort", {"saga_id": saga_id,
                                                              "reason": "not mine"})]

        saga_id, done = anyio.run(alice)
        refused = anyio.run(bob, saga_id)
        assert [door(url, token) for token in (None, "swmcp_forged", ALICE)] == [
            401, 401, 200]
        assert "bearer tokens of 2 client(s)" in log.read_text()
    assert done.structured_content["status"] == "EXECUTED"
    assert [(r.is_error, "is open to you" in r.content[0].text) for r in refused] == [
        (True, True)] * 3
    rec = cluster.sw.inspect(saga_id)
    assert rec.metadata["mcp_principal"] == "token:alice"
    assert rec.status is SagaStatus.RUNNING and rec.reason is None
    assert [(e.seq, e.phase) for e in rec.entries] == [(1, Phase.EXECUTED)]


def test_a_server_killed_mid_call_leaves_the_step_to_the_workers(cluster: Cluster) -> None:
    """SIGKILL the server while a call waits for its step: the kill hits a live call (its
    client loses the answer), the workers finish the step, and it runs once."""
    key = uid("mcp")
    saga_ids: list[str] = []
    killed: list[int] = []
    with http_server(cluster, "--wait", "60") as (url, _, proc):
        async def body() -> None:
            with anyio.fail_after(60):
                async with http(url) as client, anyio.create_task_group() as tg:
                    saga_id = await begin(client)
                    saga_ids.append(saga_id)
                    tg.start_soon(client.call_tool, "step", {
                        "saga_id": saga_id, "key": key, "name": "slow", "sleep": 3})
                    await anyio.to_thread.run_sync(lambda: wait_for(
                        lambda: cluster.sw.inspect(saga_id).entries, 30, "the step"))
                    assert proc.poll() is None  # the call is waiting: the kill hits it
                    proc.kill()
                    killed.append(await anyio.to_thread.run_sync(proc.wait))

        with pytest.raises(BaseException):  # the client loses its answer  # noqa: B017
            anyio.run(body)
    assert killed == [-signal.SIGKILL]
    saga_id = saga_ids[0]
    wait_for(lambda: cluster.sw.inspect(saga_id).entries[0].phase is Phase.EXECUTED, 60,
             "the workers to finish the step")
    assert [(r.kind, r.tool) for r in cluster.ledger(key)] == [("effect", "slow")]
