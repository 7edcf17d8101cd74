"""Bearer tokens as the web app and the MCP server keep them: ``name:sha256hex`` pairs, the
SHA-256 of each token (256 random bits: a fast hash is enough), never the token itself."""

from __future__ import annotations

import hashlib
import re

__all__ = ["HEX", "NAME", "hash_token", "parse_token_lines"]

#: a token's name (journaled as the principal that used it)
NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.@+-]{0,99}$")
HEX = re.compile(r"^[0-9a-f]{64}$")


def hash_token(token: str) -> str:
    """The stored form of a token: its SHA-256, hex."""
    return hashlib.sha256(token.encode()).hexdigest()


def parse_token_lines(text: str, source: str, *, sep: str = "\n",
                      error: type[Exception] = ValueError,
                      make_one: str = "") -> list[tuple[str, str]]:
    """``name:sha256hex`` entries split by ``sep`` (with ``\\n``, ``#`` comments and blanks
    skipped), or ``error`` naming ``source`` and the bad entry's position (never its
    hash), and how to ``make_one``."""
    out: list[tuple[str, str]] = []
    for n, raw in enumerate(text.split(sep), start=1):
        item = raw.split("#", 1)[0].strip() if sep == "\n" else raw.strip()
        if not item:
            continue
        name, colon, digest = item.rpartition(":")
        name, digest = name.strip(), digest.strip().lower()
        if not colon or not NAME.match(name) or not HEX.match(digest):
            raise error(
                f"{source}: entry {n} is not name:sha256hex (a name of letters, digits, "
                "'_', '.', '@', '+' or '-', then ':' and the 64 hex digits of the token's "
                f"SHA-256); make one with {make_one}")
        out.append((name, digest))
    return out
