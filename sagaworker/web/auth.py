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

Who may *read* the journal is configured as explicitly (``sagaworker.web.reads``): an
operator, a viewer (``SAGAWORKER_WEB_VIEWER_TOKENS``/``_FILE``: tokens that read and decide
nothing) or, only with ``SAGAWORKER_WEB_ANONYMOUS_READS=true``, anyone who reaches the app.
"""

from __future__ import annotations

import hmac
import re
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

from flask import Request

from .._base.settings import FromEnvironment
from .._base.tokens import HEX as _HEX
from .._base.tokens import NAME as NAME
from .._base.tokens import hash_token as hash_token
from .._base.tokens import parse_token_lines as _parse

__all__ = ["IDENTITY_HEADERS", "OWN_HEADER_PREFIX", "AuthConfigError", "Identity",
           "Unauthorized", "WebAuth", "WebSettings", "hash_token", "parse_token_lines"]

#: an operator's name: what the journal records as approver or actor
#: the longest identity a proxy header may carry (the journal's approver column is free text)
MAX_HEADER_IDENTITY = 200
#: the sign-in cookie of the dashboard's browsers: a token that authenticates reads only
COOKIE = "sagaworker_reader"
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
    """An authenticated operator: ``name`` is journaled; ``via`` is ``token`` or the header
    (``viewer token``, ``cookie`` for a reader); ``role``: ``operator`` or ``viewer``."""

    name: str
    via: str
    role: str = "operator"


def parse_token_lines(text: str, source: str, *, sep: str = "\n") -> list[tuple[str, str]]:
    """``name:sha256hex`` entries (``#`` comments and blanks skipped), or AuthConfigError
    naming ``source`` and the bad entry's position (never its hash)."""
    return _parse(text, source, sep=sep, error=AuthConfigError,
                  make_one="`python -m sagaworker.web.tokens new NAME`")


class WebSettings(FromEnvironment):
    """``SAGAWORKER_WEB_*`` from the environment (and a ``.env`` file)."""

    env_prefix: ClassVar[str] = "SAGAWORKER_WEB_"

    tokens: str = ""
    tokens_file: str = ""
    trusted_header: str = ""
    #: tokens that read the journal and decide nothing: name:sha256 pairs, and/or a file
    viewer_tokens: str = ""
    viewer_tokens_file: str = ""
    #: ``true``: anyone who reaches the app reads the journal (an operator's choice)
    anonymous_reads: str = ""


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


def _token_source(entries: list[tuple[str, str]] | None, path: str | Path | None,
                  setting: str) -> tuple[list[tuple[str, str]], _TokenFile | None]:
    """Checked ``name:sha256`` entries and their file (read now: a missing or malformed
    file at start is an error naming ``setting``, never a silent nobody)."""
    out = list(entries or [])
    for name, digest in out:
        if not NAME.match(name) or not _HEX.match(digest):
            raise AuthConfigError(f"{setting}: the entry for {name!r} is not name:sha256hex")
    if not path:
        return out, None
    file = Path(path)
    try:
        parse_token_lines(file.read_text(), f"{setting}_FILE {file}")
    except (OSError, UnicodeDecodeError) as exc:
        raise AuthConfigError(f"{setting}_FILE {file} cannot be read: {exc}") from exc
    return out, _TokenFile(file)


def _yes(raw: str, setting: str) -> bool:
    value = raw.strip().lower()
    if value in ("", "0", "false", "no", "off"):
        return False
    if value in ("1", "true", "yes", "on"):
        return True
    raise AuthConfigError(f"{setting}={raw!r} is neither true nor false: set it to true to let "
                          "anyone who reaches the app read the journal, or leave it unset")


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


#: the headers authenticating proxies set to the signed-in user: oauth2-proxy's, Authelia's
#: and Traefik's forward auth (Remote-*), Apache's, Grafana's auth proxy convention,
#: authentik's, Pomerium's, Cloudflare Access's, Google's IAP, AWS ALB's, Azure App
#: Service's. Any other header may come from the client itself (a browser sends
#: Sec-Fetch-Site: same-origin with a plain form POST; a proxy appends X-Forwarded-For)
IDENTITY_HEADERS = (
    "X-Forwarded-User", "X-Forwarded-Email", "X-Forwarded-Preferred-Username",
    "X-Auth-Request-User", "X-Auth-Request-Email", "X-Auth-Request-Preferred-Username",
    "Remote-User", "Remote-Email", "X-Remote-User", "X-Webauth-User", "X-Authentik-Username",
    "X-Authentik-Email", "X-Pomerium-Claim-Email", "Cf-Access-Authenticated-User-Email",
    "X-Goog-Authenticated-User-Email", "X-Amzn-Oidc-Identity", "X-Ms-Client-Principal-Name")
#: the prefix of a header of the operator's own choosing, set by their proxy: no browser
#: sends one, and another site's script cannot add it without a CORS preflight
OWN_HEADER_PREFIX = "X-Sagaworker-"


def _identity_header(header: str) -> bool:
    name = header.lower()
    return (name in {h.lower() for h in IDENTITY_HEADERS}
            or (name.startswith(OWN_HEADER_PREFIX.lower()) and name != OWN_HEADER_PREFIX.lower()))


class WebAuth:
    """The configured ways to authenticate an operator (none: read-only)."""

    def __init__(self, *, tokens: list[tuple[str, str]] | None = None,
                 tokens_file: str | Path | None = None,
                 trusted_header: str | None = None,
                 viewers: list[tuple[str, str]] | None = None,
                 viewers_file: str | Path | None = None,
                 anonymous_reads: bool = False) -> None:
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
        if header and not _identity_header(header):
            # a header a client may send itself (no proxy replaces it): trusting it would
            # make anyone who sends it an operator
            raise AuthConfigError(
                f"SAGAWORKER_WEB_TRUSTED_HEADER {header!r} is not a header an authenticating "
                "proxy sets to the signed-in user (a browser or a client may send it itself: "
                "Sec-Fetch-Site: same-origin would name an operator); name one of "
                f"{', '.join(IDENTITY_HEADERS)}, or an {OWN_HEADER_PREFIX}* header your "
                "proxy sets (and strips from requests)")
        self.trusted_header = header or None
        self._viewers, self._viewers_file = _token_source(
            viewers, viewers_file, "SAGAWORKER_WEB_VIEWER_TOKENS")
        #: anyone who reaches the app reads the journal (SAGAWORKER_WEB_ANONYMOUS_READS)
        self.anonymous_reads = bool(anonymous_reads)

    @classmethod
    def from_env(cls) -> WebAuth:
        """From ``SAGAWORKER_WEB_TOKENS``, ``SAGAWORKER_WEB_TOKENS_FILE`` and
        ``SAGAWORKER_WEB_TRUSTED_HEADER`` (unset or empty: not configured)."""
        s = WebSettings()
        tokens = parse_token_lines(s.tokens, "SAGAWORKER_WEB_TOKENS", sep=",")
        viewers = parse_token_lines(s.viewer_tokens, "SAGAWORKER_WEB_VIEWER_TOKENS", sep=",")
        return cls(tokens=tokens, tokens_file=s.tokens_file.strip() or None,
                   trusted_header=s.trusted_header, viewers=viewers,
                   viewers_file=s.viewer_tokens_file.strip() or None,
                   anonymous_reads=_yes(s.anonymous_reads, "SAGAWORKER_WEB_ANONYMOUS_READS"))

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
        """The operator making ``request``, None when it carries no credentials (or a
        viewer's, which decide nothing), or Unauthorized when it carries wrong ones.

        The proxy's header wins when configured and present (a proxy may also pass its own
        ``Authorization``, e.g. oauth2-proxy's ID token); otherwise a bearer token."""
        who = self._who(request, cookie=False)
        return who if who is not None and who.role == "operator" else None

    def reader(self, request: Request) -> Identity | None:
        """Who reads with ``request``: an operator or a viewer, from the proxy's header,
        the bearer token, or else the sign-in cookie (``reads.COOKIE``: reads only, never
        ``identify``'s); None: anonymous. Unauthorized for a wrong bearer token."""
        return self._who(request, cookie=True)

    def _who(self, request: Request, *, cookie: bool) -> Identity | None:
        if self.trusted_header:
            value = _header_user(request, self.trusted_header)
            if value:
                return Identity(value, f"header:{self.trusted_header}")
        if not self.takes_tokens:
            return None
        auth = request.headers.get("Authorization", "")
        if not auth:
            kept = request.cookies.get(COOKIE, "") if cookie else ""
            who = self.token_identity(kept) if kept else None  # (revoked since: nobody)
            return None if who is None else Identity(who.name, "cookie", who.role)
        scheme, _, token = auth.partition(" ")
        token = token.strip()
        if scheme.lower() != "bearer" or not token:
            raise Unauthorized(f"send the {self.token_kinds} token as Authorization: Bearer "
                               "<token>")
        who = self.token_identity(token)
        if who is None:
            raise Unauthorized(f"the bearer token is not a valid {self.token_kinds} token")
        return who

    def token_identity(self, token: str) -> Identity | None:
        """The operator or viewer ``token`` names (an operator's wins), or None."""
        name = self._token_name(token)
        if name is not None:
            return Identity(name, "token")
        digest = hash_token(token)
        entries = self._viewers + (self._viewers_file.load() if self._viewers_file else [])
        found = None
        for viewer, stored in entries:  # compare with every entry: no early exit to time
            if hmac.compare_digest(digest, stored) and found is None:
                found = viewer
        return None if found is None else Identity(found, "viewer token", "viewer")

    @property
    def uses_viewer_tokens(self) -> bool:
        return bool(self._viewers) or self._viewers_file is not None

    @property
    def takes_tokens(self) -> bool:
        return self.uses_tokens or self.uses_viewer_tokens

    @property
    def token_kinds(self) -> str:
        """What a token may be here: ``operator``, ``viewer`` or ``viewer or operator``."""
        return " or ".join(k for k, on in (("viewer", self.uses_viewer_tokens),
                                           ("operator", self.uses_tokens)) if on)

    @property
    def identifies(self) -> bool:
        """Some reader can be identified (a token, the proxy's header)."""
        return self.takes_tokens or self.trusted_header is not None

    def __repr__(self) -> str:  # never the hashes
        return f"WebAuth(methods={self.methods!r})"

