"""``sagaworker -A bench.mcp_app mcp``: the bench's sagaworker system (``bench.app``, from
the environment), with its ``Sagaworker`` at module level where the command looks for it."""

from __future__ import annotations

from bench.app import system

sw = system.sw
app = system.app
