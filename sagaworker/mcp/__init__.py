"""An app's tools for any MCP client (extra ``sagaworker[mcp]``): ``sagaworker mcp``.

Each call of an ``@sw.tool`` over MCP is a journaled step of the saga it names, with its
undo, reversibility and approval gate: a host that knows nothing of sagas (Claude Desktop
and Code, Cursor, the OpenAI Agents SDK, Pydantic AI) still gets compensation and signed
approvals. The server only journals, publishes and reads the journal; the Celery workers
run the steps.

The way a call goes: ``catalogue`` (what is listed, arguments checked) → ``access`` (who
calls, whose saga) → ``calls`` / ``saga_tools`` (journal, wait) → ``outcomes`` (the journal
as MCP results) → ``server`` (the SDK's low-level ``Server``) → ``transport`` (stdio, HTTP).
``tasks``: the tasks extension, a call's task read from the journal, for a client that
declares it.
"""

from __future__ import annotations

from .._base.errors import ConfigurationError

try:
    import mcp  # noqa: F401 - the SDK, or the extra to install
except ImportError:
    raise ConfigurationError("sagaworker mcp needs the MCP SDK: pip install "
                             "'sagaworker[mcp]'") from None

from .access import TokenVerifier, parse_tokens
from .server import INSTRUCTIONS, SagaServer
from .transport import PATH, http_app, parse_address, serve_http, serve_stdio

__all__ = ["INSTRUCTIONS", "PATH", "SagaServer", "TokenVerifier", "http_app", "parse_address",
           "parse_tokens", "serve_http", "serve_stdio"]
