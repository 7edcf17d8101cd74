"""``sagaworker mcp``: the app's tools for MCP clients (extra ``sagaworker[mcp]``).

Over stdio by default (a host starts it: Claude Desktop, Claude Code, Cursor, an agent
SDK's ``MCPServerStdio``), or Streamable HTTP with ``--http HOST:PORT`` (path ``/mcp``).
Without the SDK it exits 2 naming the extra.
"""

from __future__ import annotations

import hashlib
import logging
import secrets
import sys
from typing import Any

import click

from .._base.errors import ConfigurationError
from .context import Ctx, app_name, pass_ctx

__all__ = ["mcp"]


@click.command("mcp")
@click.option("--http", "http", default=None, metavar="HOST:PORT",
              help="serve Streamable HTTP at http://HOST:PORT/mcp instead of stdio (without "
              "SAGAWORKER_MCP_TOKENS: a loopback address only)")
@click.option("--tool", "tools", multiple=True, metavar="NAME",
              help="serve only this tool (repeatable; default: every @sw.tool of the app)")
@click.option("--wait", type=click.FloatRange(0, 600), default=3.0, show_default=True,
              help="seconds a call waits for its step's outcome before it answers RUNNING "
              "(a task, to a client that declared the MCP tasks extension)")
@click.option("--new-token", "new_token", default=None, metavar="NAME",
              help="print a new bearer token for client NAME and its SAGAWORKER_MCP_TOKENS "
              "entry, then exit")
@pass_ctx
def mcp(c: Ctx, http: str | None, tools: tuple[str, ...], wait: float,
        new_token: str | None) -> None:
    """Serve the app's tools to MCP clients: each call a journaled saga step, with its
    undo and approval gate (the workers run the steps)."""
    try:
        from .. import mcp as sw_mcp
    except ConfigurationError as exc:  # the SDK is missing: the extra to install
        click.echo(f"error: {exc}", err=True)
        sys.exit(2)
    if new_token is not None:
        _new_token(new_token)
        return
    import anyio

    try:
        address = None if http is None else sw_mcp.parse_address(http)
    except ConfigurationError as exc:
        raise click.UsageError(str(exc)) from None
    sw = c.sw
    tokens = sw_mcp.parse_tokens(sw.settings.mcp_tokens)
    if address is not None and not tokens:
        from ..mcp.access import is_loopback

        if not is_loopback(address[0]):
            raise click.UsageError(
                f"--http {http}: without SAGAWORKER_MCP_TOKENS only a loopback address is "
                "served (127.0.0.1, ::1); set SAGAWORKER_MCP_TOKENS to name:sha256 pairs "
                "(`sagaworker mcp --new-token NAME`) to serve the network")
    sw.check_ready()  # the journal reachable and current, a secret for gated tools
    server = sw_mcp.SagaServer(sw, tools=tools, wait=wait,
                               principal="stdio" if address is None else "loopback")
    _logging(sw)
    served = f"{len(server.catalogue.tools)} tool(s) of {app_name(c.app)}" + (
        "" if server.tasks is not None else
        " (no MCP tasks: they need SAGAWORKER_APPROVAL_SECRET, which keys their ids)")
    if address is None:
        click.echo(f"sagaworker mcp: {served} over stdio", err=True)
        anyio.run(sw_mcp.serve_stdio, server)
        return
    host, port = address
    where = f"http://{f'[{host}]' if ':' in host else host}:{port}{sw_mcp.PATH}"
    click.echo(f"sagaworker mcp: {served} on {where}" + (
        f" (bearer tokens of {len(tokens)} client(s))" if tokens else
        " (no SAGAWORKER_MCP_TOKENS: loopback only, every caller is one principal)"),
        err=True)
    anyio.run(sw_mcp.serve_http, server, host, port, tokens)


def _logging(sw: Any) -> None:
    """sagaworker's events as JSON lines on stderr (stdout is the protocol's, on stdio);
    the SDK's own lines only from warnings up (no request's text in them)."""
    from .._observe.logging import configure_logging

    settings = sw.settings
    configure_logging(fmt=settings.log_format, level=settings.log_level,
                      redact_keys=settings.redact_keys)
    logging.getLogger("mcp").setLevel(logging.WARNING)


def _new_token(name: str) -> None:
    from ..mcp.access import parse_tokens

    token = "swmcp_" + secrets.token_urlsafe(32)
    line = f"{name}:{hashlib.sha256(token.encode()).hexdigest()}"
    try:
        parse_tokens(line)
    except ConfigurationError:
        raise click.UsageError(f"--new-token {name!r}: a client's name is letters, digits, "
                               "'_', '.', '@', '+' or '-' (at most 100)") from None
    click.echo(f"token (give it to the client, as Authorization: Bearer; it is not kept):\n"
               f"{token}\nSAGAWORKER_MCP_TOKENS entry (comma-separate several):\n{line}")
