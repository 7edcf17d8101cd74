"""Make an operator token for the web app: ``python -m sagaworker.web.tokens new NAME``.

Prints the token once (give it to the operator; it is not stored anywhere) and the
``NAME:sha256`` line for ``SAGAWORKER_WEB_TOKENS`` (comma-separated) or a line of
``SAGAWORKER_WEB_TOKENS_FILE``. ``python -m sagaworker.web.tokens hash`` reads a token on stdin
and prints its hash (to check which line a token belongs to).
"""

from __future__ import annotations

import argparse
import secrets
import sys

from .auth import NAME, hash_token

__all__ = ["main", "new_token"]

#: tokens start with this, so secret scanners and people recognise them
PREFIX = "swop_"


def new_token() -> str:
    """A fresh operator token: 256 random bits."""
    return PREFIX + secrets.token_urlsafe(32)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m sagaworker.web.tokens",
                                     description="operator tokens for the sagaworker web app")
    sub = parser.add_subparsers(dest="command", required=True)
    new = sub.add_parser("new", help="make a token for NAME and print it and its NAME:hash")
    new.add_argument("name", help="the operator, journaled as approver/actor")
    sub.add_parser("hash", help="read a token on stdin, print its SHA-256")
    args = parser.parse_args(argv)
    if args.command == "hash":
        token = sys.stdin.readline().strip()
        if not token:
            parser.error("no token on stdin")
        print(hash_token(token))
        return 0
    if not NAME.match(args.name):
        parser.error("NAME must be letters, digits, '_', '.', '@', '+' or '-' (at most 100), "
                     "starting with a letter or digit")
    token = new_token()
    print(f"token (give it to {args.name}; shown once, never stored):", file=sys.stderr)
    print(token)
    print("add to SAGAWORKER_WEB_TOKENS (comma-separated) or a line of "
          "SAGAWORKER_WEB_TOKENS_FILE:", file=sys.stderr)
    print(f"{args.name}:{hash_token(token)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
