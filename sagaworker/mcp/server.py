"""The MCP server: the SDK's low-level ``Server`` with sagaworker's handlers.

``tools/list`` answers the catalogue; ``tools/call`` hands an app tool's call to
:class:`~.calls.ToolCalls` and a saga tool's to :class:`~.saga_tools.SagaTools`;
``tasks/*`` (the tasks extension, for a client that declares it) go to
:class:`~.tasks.Tasks`. The
handlers only call the public producer side (``begin``, ``enqueue``, ``inspect``,
``abort``, results read from the journal): the workers run the steps, and the server can
be killed and restarted at any time.
"""

from __future__ import annotations

from collections.abc import Sequence
from importlib.metadata import PackageNotFoundError, version
from typing import Any

import mcp_types as types
from mcp.server.lowlevel import Server
from mcp.shared.exceptions import MCPError

from .._observe.logging import get_logger
from . import outcomes
from .access import Owners, principal
from .calls import ToolCalls
from .catalogue import Catalogue
from .saga_tools import SagaTools
from .tasks import Tasks

__all__ = ["INSTRUCTIONS", "SagaServer"]

log = get_logger()

INSTRUCTIONS = """\
These tools change the world, and each call is a step of a saga: a group of steps that \
succeed together or are undone together. Call saga_begin first and pass its saga_id to \
every tool call of the task; call saga_commit when the task is done.
Each call answers a status. EXECUTED: the step ran. FAILED: the tool failed and every \
step that ran in the saga is being undone, latest first: do not retry in that saga \
(begin a new one to try again). PENDING_APPROVAL: the step has NOT run; it waits for an \
operator's signed approval, which nobody in this conversation can give: check \
saga_status later. RUNNING: the step goes on without you: do not call it again, check \
saga_status. A refusal (bad arguments, an unknown or closed saga) changed nothing: \
correct the call."""


def _version() -> str:
    try:
        return version("sagaworker")
    except PackageNotFoundError:  # a checkout run without installing it
        return ""


class SagaServer:
    """One app's tools served over MCP; ``server()`` builds the SDK's ``Server``."""

    def __init__(self, sw: Any, *, tools: Sequence[str] = (), wait: float = 3.0,
                 principal: str = "stdio") -> None:
        if not wait >= 0:
            raise ValueError(f"wait={wait!r}: give seconds >= 0")
        sw.ensure_valid()
        self.sw = sw
        self.catalogue = Catalogue.of(sw.registry.tools, tools)
        owners = Owners(sw)
        #: the tasks extension (io.modelcontextprotocol/tasks): served when the app has an
        #: approval secret, which keys the task ids
        self.tasks = Tasks.of(sw, self.catalogue, owners)
        self.calls = ToolCalls(sw, self.catalogue, owners, wait, self.tasks)
        self.saga_tools = SagaTools(sw, self.catalogue, owners, wait)
        #: the caller when the request carries no token (stdio; HTTP without tokens)
        self.default_principal = principal

    def server(self) -> Server[Any]:
        low: Server[Any] = Server("sagaworker", version=_version(), instructions=INSTRUCTIONS,
                                  on_list_tools=self.list_tools)
        # registered as a plain handler: a call answers a tool result, or a task
        low.add_request_handler("tools/call", types.CallToolRequestParams, self.call_tool)
        if self.tasks is not None:
            self.tasks.install(low, self.caller)
        return low

    def caller(self) -> str:
        """The principal of the request being handled."""
        return principal(self.default_principal)

    async def list_tools(self, ctx: Any, params: types.PaginatedRequestParams | None
                         ) -> types.ListToolsResult:
        return types.ListToolsResult(tools=self.catalogue.definitions())

    async def call_tool(self, ctx: Any, params: types.CallToolRequestParams
                        ) -> types.CallToolResult | dict[str, Any]:
        caller = self.caller()
        arguments = dict(params.arguments or {})
        name = params.name
        try:
            if name in self.saga_tools.handlers:
                return await self.saga_tools.call(ctx, name, arguments, caller)
            tool = self.catalogue.tools.get(name)
            if tool is None:
                raise MCPError(types.INVALID_PARAMS, f"unknown tool {name!r}; tools/list "
                               "names the tools this server serves")
            meta = dict(params.meta) if params.meta else None
            return await self.calls.call(ctx, tool, arguments, meta, caller)
        except MCPError:
            raise
        except Exception as exc:  # the journal away, say: told, never as a refusal
            log.error("mcp_call_error", tool=name, error=type(exc).__name__)
            return outcomes.unknown(name, exc)
