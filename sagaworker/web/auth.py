"""Who may decide from the web: operator bearer tokens, or a header set by an authenticating
proxy, each configured explicitly. With neither, the app is read-only.

- ``SAGAWORKER_WEB_TOKENS``: comma-separated ``name:sha256hex`` pairs, the SHA-256 of each
  operator's token (``python -m sagaworker.web.tokens new NAME`` makes a token and its line), and/or
  ``SAGAWORKER_WEB_TOKENS_FILE``: a file of such lines (``#`` comments, blank lines), read
  again when it changes. A request sends ``Authorization: Bearer <token>``; the operator is
  the token's name.
- ``SAGAWORKER_WEB_TRUSTED_HEADER``: a header the authenticating proxy in front of the app
  sets to the signed-in user (oauth2-proxy's ``X-Forwarded-User`` or
  ``X-Auth-Request-User``, an ingress's). Trusted only when configured, and then the proxy
  must be the only way to reach the app: anyone who reaches it directly can set the header.

The identity is what approve, reject, re-drive and abort journal as the approver or actor;
a request body never names it.
"""

from __future__ import annotations

import hashlib
import hmac
import re
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

from flask import Request

from .._base.settings import FromEnvironment

__all__ = ["AuthConfigError", "Identity", "Unauthorized", "WebAuth", "WebSettings",
           "hash_token", "parse_token_lines"]

#: an operator's name: what the journal records as approver or actor
NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.@+-]{0,99}$")
_HEX = re.compile(r"^[0-9a-f]{64}$")
#: the longest identity a proxy header may carry (the journal's approver column is free text)
MAX_HEADER_IDENTITY = 200
HOW_TO = ("set SAGAWORKER_WEB_TOKENS to name:sha256 pairs (make a token and its line with "
          "`python -m sagaworker.web.tokens new NAME`) or SAGAWORKER_WEB_TOKENS_FILE to a file of "
          "them, or SAGAWORKER_WEB_TRUSTED_HEADER (e.g. X-Forwarded-User) behind an "
          "authenticating proxy")
READ_ONLY = ("this web app is read-only: no operator authentication is configured, so it "
             "cannot approve, reject, re-drive or abort. To decide from the web, " + HOW_TO)


class AuthConfigError(ValueError):
    """The web authentication settings are malformed (named in the message)."""


class Unauthorized(Exception):
    """Missing or wrong credentials: a 401."""


@dataclass(frozen=True)
class Identity:
    """An authenticated operator: ``name`` is journaled; ``via`` is ``token`` or the header."""

    name: str
    via: str


def hash_token(token: str) -> str:
    """The stored form of a token: its SHA-256, hex. Tokens are 256 random bits, so a fast
    hash is enough (nothing to brute-force); the server never keeps the token itself."""
    return hashlib.sha256(token.encode()).hexdigest()


def parse_token_lines(text: str, source: str, *, sep: str = "\n") -> list[tuple[str, str]]:
    """``name:sha256hex`` entries (``#`` comments and blanks skipped), or AuthConfigError
    naming ``source`` and the bad entry's position (never its hash)."""
    out: list[tuple[str, str]] = []
    for n, raw in enumerate(text.split(sep), start=1):
        item = raw.split("#", 1)[0].strip() if sep == "\n" else raw.strip()
        if not item:
            continue
        name, colon, digest = item.rpartition(":")
        name, digest = name.strip(), digest.strip().lower()
        if not colon or not NAME.match(name) or not _HEX.match(digest):
            raise AuthConfigError(
                f"{source}: entry {n} is not name:sha256hex (a name of letters, digits, "
                "'_', '.', '@', '+' or '-', then ':' and the 64 hex digits of the token's "
                "SHA-256); make one with `python -m sagaworker.web.tokens new NAME`")
        out.append((name, digest))
    return out


class WebSettings(FromEnvironment):
    """``SAGAWORKER_WEB_*`` from the environment (and a ``.env`` file)."""

    env_prefix: ClassVar[str] = "SAGAWORKER_WEB_"

    tokens: str = ""
    tokens_file: str = ""
    trusted_header: str = ""


@dataclass
class _TokenFile:
    path: Path
    stamp: tuple[int, ...] = ()
    entries: list[tuple[str, str]] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def load(self) -> list[tuple[str, str]]:
        """The file's entries, read again when it changed (tokens can be
        added or revoked without a restart). A file that became unreadable or malformed
        authenticates nobody until fixed (fail closed)."""
        try:
            st = self.path.stat()
            # the change time too: a revocation copied in with `cp -p` keeps the size
            # and the modification time, never the change time (nor a moved-in inode)
            stamp = (st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)
        except OSError:
            return []
        with self.lock:
            if stamp != self.stamp:
                try:
                    self.entries = parse_token_lines(
                        self.path.read_text(), f"SAGAWORKER_WEB_TOKENS_FILE {self.path}")
                except (OSError, UnicodeDecodeError, AuthConfigError):
                    self.entries = []
                self.stamp = stamp
            return self.entries


def _header_user(request: Request, header: str) -> str:
    """The proxy's user, "" when the header is absent or blank, or Unauthorized. A
    WSGI server joins repeated headers with commas, and so does a chain of proxies that
    each append: several values name nobody (the client's own copy may be one)."""
    values = request.headers.getlist(header)
    value = ",".join(values).strip()
    if len(values) > 1 or "," in value:
        raise Unauthorized(f"the {header} header holds several values (sent "
                           "more than once, or joined with commas by a chain of proxies):"
                           " the proxy must set it to exactly one user, overwriting any "
                           "copy from the client")
    if len(value) > MAX_HEADER_IDENTITY or not value.isprintable():
        raise Unauthorized(f"the {header} header is not a usable identity")
    return value


#: headers a client sends of its own: never an identity a proxy vouches for
_CLIENT_HEADERS = frozenset({"host", "authorization", "cookie", "user-agent", "referer",
                             "origin", "content-type", "content-length", "accept",
                             "proxy-authorization"})


class WebAuth:
    """The configured ways to authenticate an operator (none: read-only)."""

    def __init__(self, *, tokens: list[tuple[str, str]] | None = None,
                 tokens_file: str | Path | None = None,
                 trusted_header: str | None = None) -> None:
        self._tokens = list(tokens or [])
        for name, digest in self._tokens:
            if not NAME.match(name) or not _HEX.match(digest):
                raise AuthConfigError(f"operator token entry for {name!r} is not "
                                      "name:sha256hex")
        self._file: _TokenFile | None = None
        if tokens_file:
            path = Path(tokens_file)
            try:  # a missing or malformed file at start is an error, not a silent read-only
                parse_token_lines(path.read_text(), f"SAGAWORKER_WEB_TOKENS_FILE {path}")
            except (OSError, UnicodeDecodeError) as exc:
                raise AuthConfigError(
                    f"SAGAWORKER_WEB_TOKENS_FILE {path} cannot be read: {exc}") from exc
            self._file = _TokenFile(path)
        header = (trusted_header or "").strip()
        if header and not re.match(r"^[A-Za-z0-9-]+$", header):
            raise AuthConfigError(f"SAGAWORKER_WEB_TRUSTED_HEADER {header!r} is not a header "
                                  "name (letters, digits and '-')")
        if header.lower() in _CLIENT_HEADERS:
            # a header every client sends itself (no proxy replaces it): trusting it would
            # make anyone who sets it an operator
            raise AuthConfigError(
                f"SAGAWORKER_WEB_TRUSTED_HEADER {header!r} is a header clients send "
                "themselves; name the header your authenticating proxy sets (and strips from "
                "requests), e.g. X-Forwarded-User")
        self.trusted_header = header or None

    @classmethod
    def from_env(cls) -> WebAuth:
        """From ``SAGAWORKER_WEB_TOKENS``, ``SAGAWORKER_WEB_TOKENS_FILE`` and
        ``SAGAWORKER_WEB_TRUSTED_HEADER`` (unset or empty: not configured)."""
        s = WebSettings()
        tokens = parse_token_lines(s.tokens, "SAGAWORKER_WEB_TOKENS", sep=",")
        return cls(tokens=tokens, tokens_file=s.tokens_file.strip() or None,
                   trusted_header=s.trusted_header)

    @property
    def uses_tokens(self) -> bool:
        return bool(self._tokens) or self._file is not None

    @property
    def configured(self) -> bool:
        """False: the app is read-only."""
        return self.uses_tokens or self.trusted_header is not None

    @property
    def methods(self) -> list[str]:
        return (["token"] if self.uses_tokens else []) + (
            [f"header:{self.trusted_header}"] if self.trusted_header else [])

    def _token_name(self, token: str) -> str | None:
        digest = hash_token(token)
        entries = self._tokens + (self._file.load() if self._file else [])
        found = None
        for name, stored in entries:  # compare with every entry: no early exit to time
            if hmac.compare_digest(digest, stored) and found is None:
                found = name
        return found

    def identify(self, request: Request) -> Identity | None:
        """The operator making ``request``, None when it carries no credentials, or
        Unauthorized when it carries wrong ones.

        The proxy's header wins when configured and present (a proxy may also pass its own
        ``Authorization``, e.g. oauth2-proxy's ID token); otherwise a bearer token."""
        if self.trusted_header:
            value = _header_user(request, self.trusted_header)
            if value:
                return Identity(value, f"header:{self.trusted_header}")
        if not self.uses_tokens:
            return None
        auth = request.headers.get("Authorization", "")
        if not auth:
            return None
        scheme, _, token = auth.partition(" ")
        token = token.strip()
        if scheme.lower() != "bearer" or not token:
            raise Unauthorized("send the operator token as Authorization: Bearer <token>")
        name = self._token_name(token)
        if name is None:
            raise Unauthorized("the bearer token is not a valid operator token")
        return Identity(name, "token")

    def __repr__(self) -> str:  # never the hashes
        return f"WebAuth(methods={self.methods!r})"

