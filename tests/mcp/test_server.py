"""The MCP server in process, on a SQLite journal and kombu's memory transport (no worker
runs the steps): what it lists, what it refuses (journaling nothing), whose sagas a caller
may touch, and what a gate and an unfinished step look like to a model."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from collections.abc import Awaitable, Callable
from typing import Any

import anyio
import pytest
from mcp import Client

from sagaworker import (
    ConfigurationError,
    Phase,
    SagaStatus,
    Sagaworker,
)
from sagaworker.mcp import SagaServer, TokenVerifier, http_app, parse_tokens
from tests.conftest import ROOT

CALL_ID = "dev.sagaworker/call_id"
MODES = ("legacy", "auto")


def run(server: SagaServer, mode: str, body: Callable[[Client], Awaitable[Any]]) -> Any:
    async def main() -> Any:
        async with Client(server.server(), mode=mode) as client:
            return await body(client)

    return anyio.run(main)


async def begin(client: Client) -> str:
    r = await client.call_tool("saga_begin", {"purpose": "a trip to Lisbon"})
    assert not r.is_error
    return str(r.structured_content["saga_id"])


def entries(sw: Sagaworker, saga_id: str) -> list[tuple[int, str, Phase]]:
    return [(e.seq, e.tool_name.rsplit(".", 1)[-1], e.phase)
            for e in sw.inspect(saga_id).entries]


@pytest.mark.parametrize("mode", MODES)
def test_tools_are_listed_truthfully(sw: Sagaworker, mode: str) -> None:
    """Every tool with its docstring, its schema plus a required saga_id, annotations that
    say the truth and its step's reversibility, undo and gate; the four saga tools; no tool
    that approves or rejects."""
    listed = run(SagaServer(sw), mode, lambda c: c.list_tools()).tools
    tools = {t.name: t for t in listed}
    assert set(tools) == {"saga_begin", "saga_status", "saga_commit", "saga_abort",
                          "book_hotel", "charge_card", "send_voucher"}
    assert not any("approv" in n or "reject" in n for n in tools)
    hotel = tools["book_hotel"]
    assert hotel.description == "Book a hotel room in a city for a number of nights."
    assert hotel.input_schema["required"] == ["saga_id", "key", "city"]
    assert hotel.input_schema["properties"]["saga_id"]["type"] == "string"
    assert hotel.input_schema["properties"]["nights"] == {"default": 1, "title": "Nights",
                                                          "type": "integer"}
    step = {n: (t.annotations.destructive_hint, t.annotations.idempotent_hint,
                t.annotations.read_only_hint, t.meta["dev.sagaworker/step"])
            for n, t in tools.items() if t.meta}
    assert step == {
        "book_hotel": (False, False, False, {"reversibility": "COMPENSATABLE",
                                             "undo": "cancel_hotel", "gated": False}),
        "charge_card": (False, True, False, {"reversibility": "REVERSIBLE",
                                             "undo": "refund_card", "gated": False}),
        "send_voucher": (True, False, False, {"reversibility": "IRREVERSIBLE", "undo": None,
                                              "gated": True})}
    assert tools["saga_status"].annotations.read_only_hint is True
    assert tools["saga_abort"].input_schema["required"] == ["saga_id", "reason"]


def test_tool_option_serves_the_named_tools_only(sw: Sagaworker) -> None:
    """--tool NAME (the function's name or the task's) limits the list; a name the app does
    not have is a ConfigurationError naming the tools it has."""
    server = SagaServer(sw, tools=["book_hotel", "tests.mcp.conftest.send_voucher"])
    assert set(server.catalogue.tools) == {"book_hotel", "send_voucher"}
    with pytest.raises(ConfigurationError, match="book_hotel, charge_card, send_voucher"):
        SagaServer(sw, tools=["book_plane"])


def test_saga_begin_gives_an_unguessable_id_bound_to_its_caller(sw: Sagaworker) -> None:
    """The id is random (not the purpose, not a counter); the metadata names the purpose,
    the client and the principal; the saga runs with no step yet."""
    ids = run(SagaServer(sw), "auto", lambda c: _two(c))
    assert ids[0] != ids[1] and all(len(i) > 24 for i in ids)
    rec = sw.inspect(ids[0])
    assert rec.status is SagaStatus.RUNNING and rec.entries == []
    assert rec.metadata == {"purpose": "a trip to Lisbon", "mcp_client": "mcp",
                            "mcp_principal": "stdio"}


async def _two(client: Client) -> list[str]:
    return [await begin(client), await begin(client)]


@pytest.mark.parametrize("mode", MODES)
def test_refusals_journal_nothing(sw: Sagaworker, mode: str) -> None:
    """Arguments that do not fit (a wrong type, an unknown name, a missing one), no
    saga_id, an unknown saga, a closed saga: isError with the reason, nothing journaled and
    the saga not failed (the model may correct itself)."""
    async def body(client: Client) -> tuple[str, str, list[Any]]:
        open_id, closed_id = await begin(client), await begin(client)
        assert not (await client.call_tool("saga_commit", {"saga_id": closed_id})).is_error
        calls = [
            {"saga_id": open_id, "key": "k", "city": "Lisbon", "nights": "two"},
            {"saga_id": open_id, "key": "k", "city": "Lisbon", "stars": 5},
            {"saga_id": open_id, "key": "k"},
            {"key": "k", "city": "Lisbon"},
            {"saga_id": "mcp-no-such-saga", "key": "k", "city": "Lisbon"},
            {"saga_id": closed_id, "key": "k", "city": "Lisbon"},
        ]
        return open_id, closed_id, [await client.call_tool("book_hotel", a) for a in calls]

    open_id, closed_id, results = run(SagaServer(sw), mode, body)
    assert [r.is_error for r in results] == [True] * 6
    assert [r.structured_content["status"] for r in results] == ["REFUSED"] * 6
    texts = [r.content[0].text for r in results]
    assert "nights" in texts[0] and "stars" in texts[1] and "city" in texts[2]
    assert "saga_id" in texts[3] and "mcp-no-such-saga" in texts[4]
    assert "COMPLETED" in texts[5]
    assert all(t.startswith("Refused, nothing was done") for t in texts)
    assert entries(sw, open_id) == [] and entries(sw, closed_id) == []
    assert sw.inspect(open_id).status is SagaStatus.RUNNING


def test_another_principals_saga_is_no_saga(sw: Sagaworker) -> None:
    """A saga begun by one principal is "no such saga" to another, for its steps, its
    status, its commit and its abort; a saga not begun over MCP is nobody's there."""
    alice, bob = SagaServer(sw, principal="token:alice"), SagaServer(sw, principal="token:bob")
    saga_id = run(alice, "auto", begin)
    sw.begin("from-the-web-app")

    async def as_bob(client: Client) -> list[Any]:
        return [await client.call_tool("book_hotel", {"saga_id": saga_id, "key": "k",
                                                      "city": "Lisbon"}),
                await client.call_tool("saga_status", {"saga_id": saga_id}),
                await client.call_tool("saga_commit", {"saga_id": saga_id}),
                await client.call_tool("saga_abort", {"saga_id": saga_id, "reason": "mine"}),
                await client.call_tool("saga_status", {"saga_id": "from-the-web-app"})]

    results = run(bob, "legacy", as_bob)
    assert [r.is_error for r in results] == [True] * 5
    assert all("is open to you" in r.content[0].text for r in results)
    rec = sw.inspect(saga_id)
    assert rec.status is SagaStatus.RUNNING and rec.entries == [] and rec.reason is None
    mine = run(alice, "legacy", lambda c: c.call_tool("saga_status", {"saga_id": saga_id}))
    assert not mine.is_error and mine.structured_content["status"] == "RUNNING"


@pytest.mark.parametrize("mode", MODES)
def test_a_gate_has_not_run_and_says_so(sw: Sagaworker, mode: str) -> None:
    """An IRREVERSIBLE call answers PENDING_APPROVAL (not an error): the text says it has
    not run, that an operator decides and to check saga_status later; the saga's commit
    waits for the decision; the same call id again journals nothing."""
    async def body(client: Client) -> tuple[str, list[Any]]:
        saga_id = await begin(client)
        args = {"saga_id": saga_id, "key": "k", "email": "ana@example.com"}
        return saga_id, [
            await client.call_tool("send_voucher", args, meta={CALL_ID: "v1"}),
            await client.call_tool("send_voucher", args, meta={CALL_ID: "v1"}),
            await client.call_tool("saga_commit", {"saga_id": saga_id})]

    saga_id, (first, again, commit) = run(SagaServer(sw, wait=0.2), mode, body)
    for r in (first, again):
        assert not r.is_error
        text = r.content[0].text
        assert r.structured_content == {"status": "PENDING_APPROVAL", "saga_id": saga_id,
                                        "seq": 1, "tool": "send_voucher", "expires_at": None,
                                        "message": text.split("\n")[0]}
        assert "has NOT run" in text and "operator" in text and "saga_status" in text
    assert not commit.is_error and commit.structured_content["status"] == "AWAITING_APPROVAL"
    assert "Not committed yet" in commit.content[0].text
    assert entries(sw, saga_id) == [(1, "send_voucher", Phase.AWAITING_APPROVAL)]
    assert [a.seq for a in sw.pending_approvals() if a.saga_id == saga_id] == [1]


def test_a_step_without_an_outcome_within_the_wait_is_running(sw: Sagaworker) -> None:
    """No worker here: the call answers RUNNING once the wait is over (progress sent
    meanwhile when asked), and a retried call with the same call id is the same step."""
    seen: list[tuple[float, float | None, str | None]] = []

    async def progress(done: float, total: float | None, message: str | None) -> None:
        seen.append((done, total, message))

    async def body(client: Client) -> tuple[str, list[Any]]:
        saga_id = await begin(client)
        args = {"saga_id": saga_id, "key": "k", "card": "visa", "amount_cents": 100}
        return saga_id, [
            await client.call_tool("charge_card", args, progress_callback=progress,
                                   meta={CALL_ID: "c1"}),
            await client.call_tool("charge_card", args, meta={CALL_ID: "c1"})]

    saga_id, results = run(SagaServer(sw, wait=1.5), "legacy", body)
    for r in results:
        assert not r.is_error
        text = r.content[0].text
        assert r.structured_content == {"status": "RUNNING", "saga_id": saga_id, "seq": 1,
                                        "tool": "charge_card", "message": text.split("\n")[0]}
        assert "do not call it again" in text
    assert entries(sw, saga_id) == [(1, "charge_card", Phase.INTENT)]
    assert seen and seen[0][1] == 1.5 and "step 1 (charge_card)" in str(seen[0][2])


def test_bearer_tokens_name_their_client() -> None:
    """SAGAWORKER_MCP_TOKENS pairs: a token's SHA-256 names its client; any other token is
    nobody; a malformed entry is refused naming its position, never its hash."""
    line = f"alice:{hashlib.sha256(b'tok-a').hexdigest()}, bob:{'0' * 64}"
    verifier = TokenVerifier(parse_tokens(line))
    got = anyio.run(verifier.verify_token, "tok-a")
    assert got is not None and got.client_id == "alice" and got.token != "tok-a"
    assert anyio.run(verifier.verify_token, "tok-b") is None
    with pytest.raises(ConfigurationError, match="entry 2 is not name:sha256hex"):
        parse_tokens(f"alice:{'0' * 64},bob:xyz")


def test_http_without_tokens_serves_only_loopback(sw: Sagaworker) -> None:
    """Without tokens a network address is refused, saying what to set; loopback is
    served."""
    with pytest.raises(ConfigurationError, match="SAGAWORKER_MCP_TOKENS"):
        http_app(SagaServer(sw), "0.0.0.0", 8765, [])
    assert http_app(SagaServer(sw), "127.0.0.1", 8765, []) is not None
    assert http_app(SagaServer(sw), "0.0.0.0", 8765, [("alice", "0" * 64)]) is not None


def test_without_the_sdk_the_command_exits_2_naming_the_extra() -> None:
    """`sagaworker mcp` without the mcp package: exit 2, naming sagaworker[mcp]."""
    code = ("import sys; sys.modules['mcp'] = None\n"
            "from sagaworker.cli import main\n"
            "main(['-A', 'tests.apps.cluster', 'mcp'])")
    env = {k: v for k, v in os.environ.items() if not k.startswith("SAGAWORKER_")}
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2, proc.stderr
    assert "sagaworker[mcp]" in proc.stderr
