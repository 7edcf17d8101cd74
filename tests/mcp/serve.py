"""Running `sagaworker -A tests.apps.cluster mcp` as its own process for the tests, over
stdio (the SDK's client or FastMCP's spawns it) or Streamable HTTP (started here, its port
awaited). FastMCP's client declares the tasks extension (fastmcp-tasks, imported here)."""

from __future__ import annotations

import hashlib
import socket
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from pathlib import Path
from typing import Any

import fastmcp
import fastmcp_tasks  # noqa: F401 - FastMCP's clients declare the tasks extension
from fastmcp.client.transports import StdioTransport
from mcp import Client, StdioServerParameters
from mcp.client.stdio import stdio_client
from mcp.client.streamable_http import streamable_http_client
from mcp.shared._httpx_utils import create_mcp_http_client

from tests.conftest import ROOT, Cluster, wait_for, worker_env

COMMAND = [sys.executable, "-m", "sagaworker.cli", "-A", "tests.apps.cluster", "mcp"]
CALL_ID = "dev.sagaworker/call_id"
#: two clients' bearer tokens, and SAGAWORKER_MCP_TOKENS naming them alice and bob
ALICE, BOB = "swmcp_alice-token", "swmcp_bob-token"
TOKENS = ",".join(f"{name}:{hashlib.sha256(token.encode()).hexdigest()}"
                  for name, token in (("alice", ALICE), ("bob", BOB)))


def env(c: Cluster, **extra: str) -> dict[str, str]:
    """The cluster's environment: its journal, broker, queues and secret."""
    return worker_env(c.settings, c.default_queue, **extra)


@asynccontextmanager
async def stdio(c: Cluster, *args: str, mode: str = "auto", log: Path | None = None,
                **extra: str) -> AsyncIterator[Client]:
    """A client of a server process of its own, over stdio (its stderr in ``log``)."""
    params = StdioServerParameters(command=COMMAND[0], args=[*COMMAND[1:], *args],
                                   env=env(c, **extra), cwd=str(ROOT))
    path = log or c.tmp / "mcp-stdio.log"
    with path.open("a") as errlog:
        async with Client(stdio_client(params, errlog=errlog), mode=mode) as client:
            yield client


def stdio_transport(c: Cluster, *args: str, log: Path | None = None,
                    **extra: str) -> StdioTransport:
    """FastMCP's transport to a server process of its own (its stderr in ``log``), ended
    when the client closes."""
    return StdioTransport(COMMAND[0], [*COMMAND[1:], *args], env=env(c, **extra),
                          cwd=str(ROOT), keep_alive=False,
                          log_file=log or c.tmp / "mcp-stdio.log")


@asynccontextmanager
async def fastmcp_stdio(c: Cluster, *args: str, log: Path | None = None,
                        **extra: str) -> AsyncIterator[fastmcp.Client[Any]]:
    """FastMCP's client of a server process of its own, over stdio."""
    async with fastmcp.Client(stdio_transport(c, *args, log=log, **extra),
                              timeout=120) as client:
        yield client


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextmanager
def http_server(c: Cluster, *args: str, **extra: str
                ) -> Iterator[tuple[str, Path, subprocess.Popen[bytes]]]:
    """A server process over Streamable HTTP on a free loopback port: its URL, its log and
    the process."""
    port = free_port()
    log = c.tmp / f"mcp-http-{port}.log"
    with log.open("w") as out:
        proc = subprocess.Popen([*COMMAND, "--http", f"127.0.0.1:{port}", *args],
                                env=env(c, **extra), cwd=ROOT, stdout=out,
                                stderr=subprocess.STDOUT)
    try:
        wait_for(lambda: _listening(port) or proc.poll() is not None, 60, "the MCP server")
        assert proc.poll() is None, log.read_text()
        yield f"http://127.0.0.1:{port}/mcp", log, proc
    finally:
        if proc.poll() is None:
            proc.terminate()
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)


def _listening(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5):
            return True
    except OSError:
        return False


@asynccontextmanager
async def http(url: str, token: str | None = None, mode: str = "auto"
               ) -> AsyncIterator[Client]:
    """A client over Streamable HTTP, sending ``token`` as its bearer token if given."""
    headers = {"Authorization": f"Bearer {token}"} if token else None
    async with create_mcp_http_client(headers=headers) as http_client:
        transport: Any = streamable_http_client(url, http_client=http_client)
        async with Client(transport, mode=mode) as client:
            yield client


async def begin(client: Client | fastmcp.Client[Any], purpose: str = "a trip") -> str:
    r = await client.call_tool("saga_begin", {"purpose": purpose})
    assert not r.is_error, r.content
    assert r.structured_content is not None
    return str(r.structured_content["saga_id"])
