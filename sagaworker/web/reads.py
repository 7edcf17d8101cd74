"""Who may read the journal from the web: an operator's explicit choice.

The journal's pages and JSON (``/``, ``/ui/...``, ``/sagas``, ``/approvals``) are read by
an authenticated reader only: an operator (``SAGAWORKER_WEB_TOKENS``, the proxy's
``SAGAWORKER_WEB_TRUSTED_HEADER``) or a viewer, whose token reads and decides nothing
(``SAGAWORKER_WEB_VIEWER_TOKENS``/``_FILE``). ``SAGAWORKER_WEB_ANONYMOUS_READS=true`` lets
anyone who reaches the app read them instead; the app says which at start. ``/healthz``,
``/auth`` and the static files answer anyone.

A browser loads the pages itself, with no ``Authorization`` header: signing in on the page
(``POST /auth/session`` with the token, JSON only, so no other site's form can) sets an
``HttpOnly``, ``SameSite=Strict`` cookie that authenticates reads only. Every decision
still needs the token in the ``Authorization`` header (or the proxy's), which no other
site can make a browser send: the cookie never decides.
"""

from __future__ import annotations

import logging
from typing import Any

from flask import Blueprint, Response, g, jsonify, render_template, request

from .api import ValidationFailed, _unauthorized, auth, error, json_body
from .auth import COOKIE, Unauthorized, WebAuth

__all__ = ["announce", "bp", "gate", "refusal"]

bp = Blueprint("reads", __name__)

#: the blueprints whose GETs read the journal (``orders``, the shop's own, is not one)
READERS_OF = frozenset({"api", "dashboard"})
_OPEN = "set SAGAWORKER_WEB_ANONYMOUS_READS=true to let anyone who reaches this app read it"


def refusal(a: WebAuth) -> str:
    """What an anonymous reader is told: how to authenticate, or how to configure."""
    if not a.identifies:
        return ("this app lets nobody read the journal: configure viewer tokens "
                "(SAGAWORKER_WEB_VIEWER_TOKENS), operator tokens (SAGAWORKER_WEB_TOKENS) or an "
                "authenticating proxy's header (SAGAWORKER_WEB_TRUSTED_HEADER), or "
                f"{_OPEN} (docs/web-auth.md)")
    ways = []
    if a.takes_tokens:
        ways.append(f"send Authorization: Bearer <{a.token_kinds} token>")
    if a.trusted_header:
        ways.append(f"sign in through the proxy that sets {a.trusted_header}")
    return (f"reading the journal needs an identity: {' or '.join(ways)}; anonymous reads "
            f"are off ({_OPEN})")


def announce(a: WebAuth, logger: logging.Logger) -> None:
    """Say at start who may read the journal."""
    if a.anonymous_reads:
        logger.warning("anonymous reads: anyone who reaches this app reads the journal "
                       "(SAGAWORKER_WEB_ANONYMOUS_READS=true)")
    elif not a.identifies:
        logger.warning("nobody can read: %s", refusal(a))
    else:
        what = [f"a {a.token_kinds} token"] if a.takes_tokens else []
        what += [f"the proxy's {a.trusted_header}"] if a.trusted_header else []
        logger.info("reads need %s: anonymous reads are off "
                    "(SAGAWORKER_WEB_ANONYMOUS_READS)", " or ".join(what))


def gate() -> Any:
    """Before every request (``app.before_request``): a read of the journal by an
    anonymous client is refused unless anonymous reads were chosen; ``g.reader`` is who
    reads. A page answers a sign-in page, the JSON a 401 saying how to authenticate."""
    if request.blueprint not in READERS_OF or request.method not in ("GET", "HEAD"):
        return None
    a = auth()
    html = request.blueprint == "dashboard"
    try:
        g.reader = a.reader(request)
    except Unauthorized as exc:
        if not html:
            return _unauthorized(str(exc))
        g.reader = None
    if g.reader is not None or a.anonymous_reads:
        return None
    if html:
        return render_template("error.html", code=401, name="Sign in", signin=True,
                               message=refusal(a)), 401
    resp = jsonify({"error": refusal(a), "status": 401})
    if a.takes_tokens:
        resp.headers["WWW-Authenticate"] = 'Bearer realm="sagaworker"'
    return resp, 401


@bp.errorhandler(ValidationFailed)
def _invalid(exc: ValidationFailed) -> tuple[Response, int]:
    return error(422, "invalid request body", reasons=exc.reasons)


@bp.get("/auth")
def whoami() -> tuple[Response, int]:
    """How this app authenticates, and who the request's operator (or reader) is (401 for
    wrong credentials): the dashboard checks a token with it."""
    a = auth()
    try:
        who, reader = a.identify(request), a.reader(request)
    except Unauthorized as exc:
        return _unauthorized(str(exc))
    return jsonify({"read_only": not a.configured, "methods": a.methods,
                    "operator": None if who is None else who.name,
                    "via": None if who is None else who.via,
                    "reader": None if reader is None else reader.name,
                    "role": None if reader is None else reader.role,
                    "anonymous_reads": a.anonymous_reads}), 200


@bp.post("/auth/session")
def open_session() -> tuple[Response, int]:
    """Sign a browser in for reading: ``{"token": T}`` (a viewer's or an operator's) sets
    the read cookie; 401 for a token that is neither."""
    body = json_body()
    if not isinstance(body, dict) or set(body) != {"token"} or not isinstance(
            body["token"], str) or not body["token"].strip() or len(body["token"]) > 4096:
        raise ValidationFailed({"token": "is required, alone: the viewer or operator token"})
    token = body["token"].strip()
    who = auth().token_identity(token)
    if who is None:
        return _unauthorized(f"the token is not a valid {auth().token_kinds or 'viewer'} "
                             "token")
    resp = jsonify({"reader": who.name, "role": who.role})
    resp.set_cookie(COOKIE, token, httponly=True, samesite="Strict",
                    secure=request.is_secure, path=request.script_root or "/")
    return resp, 200


@bp.delete("/auth/session")
def close_session() -> tuple[Response, int]:
    """Sign a browser out: the read cookie is cleared."""
    resp = Response(status=204)
    resp.delete_cookie(COOKIE, httponly=True, samesite="Strict", secure=request.is_secure,
                       path=request.script_root or "/")
    return resp, 204
