"""Who calls, and which sagas they may touch.

Over stdio the caller is whoever started the process (principal ``stdio``). Over HTTP,
``SAGAWORKER_MCP_TOKENS`` holds comma-separated ``name:sha256hex`` pairs (the SHA-256 of
each client's bearer token, as ``SAGAWORKER_WEB_TOKENS``; ``sagaworker mcp --new-token
NAME`` makes a token and its line); the SDK's bearer middleware
checks each request with :class:`TokenVerifier`, and the caller's principal is
``token:NAME``. Without tokens, HTTP serves a loopback address only, and every caller is
``loopback``.

A saga begun through MCP names its principal in its metadata (``mcp_principal``, beside
``mcp_client`` and ``purpose``); another principal's saga, or one not begun through MCP,
is "no such saga" to a caller: its existence is not told.
"""

from __future__ import annotations

import hmac
import ipaddress
from collections import OrderedDict
from typing import Any

from mcp.server.auth.middleware.auth_context import get_access_token
from mcp.server.auth.provider import AccessToken

from .._base.errors import ConfigurationError, SagaNotFound, SagaworkerError
from .._base.tokens import hash_token, parse_token_lines
from .._producer.saga import Saga

__all__ = ["PRINCIPAL", "Owners", "TokenVerifier", "is_loopback", "no_saga", "parse_tokens",
           "principal"]

#: the metadata key naming the principal that began a saga
PRINCIPAL = "mcp_principal"


def parse_tokens(text: str) -> list[tuple[str, str]]:
    """``SAGAWORKER_MCP_TOKENS``: ``name:sha256hex`` pairs, comma-separated; a malformed
    entry is a ConfigurationError naming its position (never its hash)."""
    return parse_token_lines(text, "SAGAWORKER_MCP_TOKENS", sep=",", error=ConfigurationError,
                             make_one="`sagaworker mcp --new-token NAME`")


class TokenVerifier:
    """The SDK's ``TokenVerifier``: a bearer token is a configured client's, or nobody's."""

    def __init__(self, entries: list[tuple[str, str]]) -> None:
        self._entries = list(entries)

    async def verify_token(self, token: str) -> AccessToken | None:
        digest = hash_token(token)
        found = None
        for name, stored in self._entries:  # every entry compared: no early exit to time
            if hmac.compare_digest(digest, stored) and found is None:
                found = name
        if found is None:
            return None
        # the digest, not the token, is what the SDK keeps of it
        return AccessToken(token=digest, client_id=found, scopes=[])

    def __repr__(self) -> str:  # never the hashes
        return f"TokenVerifier({len(self._entries)} clients)"


def principal(default: str) -> str:
    """The caller of the request being handled: its token's name, else ``default``."""
    token = get_access_token()
    return f"token:{token.client_id}" if token is not None else default


def is_loopback(host: str) -> bool:
    try:
        return host == "localhost" or ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


class Owners:
    """The sagas callers may touch: each saga's principal, read from the journal once (it
    never changes), and its handle, kept for the calls that follow."""

    def __init__(self, sw: Any, size: int = 10_000) -> None:
        self.sw, self._size = sw, size
        self._known: OrderedDict[str, tuple[str | None, Saga]] = OrderedDict()

    def remember(self, saga: Saga, owner: str | None) -> None:
        self._known[saga.saga_id] = (owner, saga)
        self._known.move_to_end(saga.saga_id)
        while len(self._known) > self._size:
            self._known.popitem(last=False)

    async def open(self, saga_id: str, caller: str) -> Saga:
        """The saga's handle if ``caller`` began it; SagaNotFound otherwise (another
        principal's saga is told as an unknown one)."""
        known = self._known.get(saga_id)
        if known is None:
            try:
                rec = await self.sw.ainspect(saga_id)
                saga = await self.sw.aget(saga_id)
            except SagaworkerError:  # unknown, pruned, an id no saga can have
                raise SagaNotFound(no_saga(saga_id)) from None
            owner = rec.metadata.get(PRINCIPAL) if isinstance(rec.metadata, dict) else None
            known = (owner if isinstance(owner, str) else None, saga)
            self.remember(saga, known[0])
        owner, saga = known
        if owner is None or not hmac.compare_digest(owner.encode(), caller.encode()):
            raise SagaNotFound(no_saga(saga_id))
        return saga


def no_saga(saga_id: str) -> str:
    return (f"no saga {saga_id!r} is open to you: use the saga_id saga_begin returned "
            "(a saga begun by another client, or not through this server, is not yours)")
