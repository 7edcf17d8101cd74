"""Serving the server: stdio for a host that starts it, Streamable HTTP at ``/mcp``.

Both protocol eras the SDK speaks are served on each (the 2025-11-25 handshake and the
stateless 2026-07-28). Over HTTP with ``SAGAWORKER_MCP_TOKENS``, the SDK's bearer
middleware checks every request with :class:`~.access.TokenVerifier` (a 401 without a
valid token); without tokens only a loopback address is served.
"""

from __future__ import annotations

from typing import Any, cast

from mcp.server.auth.settings import AuthSettings
from mcp.server.stdio import stdio_server
from pydantic import AnyHttpUrl

from .._base.errors import ConfigurationError
from .access import TokenVerifier, is_loopback
from .pipes import pipe_stdio
from .server import SagaServer

__all__ = ["PATH", "http_app", "parse_address", "serve_http", "serve_stdio"]

#: the Streamable HTTP endpoint
PATH = "/mcp"


def parse_address(text: str) -> tuple[str, int]:
    """``HOST:PORT`` (``[::1]:8765`` for IPv6) as (host, port)."""
    host, colon, port = text.rpartition(":")
    host = host.strip("[]")
    if not colon or not host or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ConfigurationError(f"--http {text!r}: give HOST:PORT, e.g. 127.0.0.1:8765")
    return host, int(port)


async def serve_stdio(server: SagaServer) -> None:
    """Serve over the process's stdin and stdout until the host closes them: on the loop
    when they are pipes or sockets (``pipes``), else through the SDK's threads."""
    low = server.server()
    async with pipe_stdio() as pipes:
        streams = stdio_server() if pipes is None else stdio_server(*cast(Any, pipes))
        async with streams as (read, write):
            await low.run(read, write, low.create_initialization_options())


def http_app(server: SagaServer, host: str, port: int,
             tokens: list[tuple[str, str]]) -> Any:
    """The Starlette app of Streamable HTTP at ``/mcp``, behind the bearer tokens if any."""
    if not tokens and not is_loopback(host):
        raise ConfigurationError(
            f"--http {host}:{port} without SAGAWORKER_MCP_TOKENS would let anyone who "
            "reaches it run the app's tools: set SAGAWORKER_MCP_TOKENS to name:sha256 pairs "
            "(`sagaworker mcp --new-token NAME` makes one), or serve 127.0.0.1")
    verifier = TokenVerifier(tokens) if tokens else None
    # a resource server only: no authorization server of its own (the issuer is unused)
    auth = None if verifier is None else AuthSettings(
        issuer_url=AnyHttpUrl(f"http://{'localhost' if ':' in host else host}:{port}"),
        resource_server_url=None)
    return server.server().streamable_http_app(
        streamable_http_path=PATH, host=host, auth=auth, token_verifier=verifier)


async def serve_http(server: SagaServer, host: str, port: int,
                     tokens: list[tuple[str, str]]) -> None:
    """Serve Streamable HTTP on ``host:port`` until stopped."""
    import uvicorn

    app = http_app(server, host, port, tokens)
    # log_config=None: uvicorn's lines go through the process's own (JSON) logging
    config = uvicorn.Config(app, host=host, port=port, log_config=None, lifespan="on")
    await uvicorn.Server(config).serve()
