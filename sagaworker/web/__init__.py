"""The on-call dashboard and its JSON API, for any app's Sagaworker (extra ``[web]``).

``sagaworker -A MODULE web`` serves it; ``create_app(sw)`` returns the Flask app to mount
in your own WSGI stack (or to add your own blueprints to, as the example's order endpoint
does in ``tasks/web.py``).

Approving, rejecting, re-driving and aborting need an authenticated operator
(``sagaworker.web.auth``: ``SAGAWORKER_WEB_TOKENS``/``SAGAWORKER_WEB_TOKENS_FILE`` or
``SAGAWORKER_WEB_TRUSTED_HEADER``); with neither configured the app is read-only.
Reading the journal needs an operator or a viewer (``SAGAWORKER_WEB_VIEWER_TOKENS``), unless
the operator chose ``SAGAWORKER_WEB_ANONYMOUS_READS=true`` (``sagaworker.web.reads``).
"""

from __future__ import annotations

from typing import Any

from sagaworker._base.errors import BadInput, ConfigurationError, JournalUnavailable

try:
    from flask import Flask, Response, current_app, jsonify, render_template, request
    from werkzeug.exceptions import HTTPException
except ImportError as exc:  # pragma: no cover - exercised without the extra installed
    raise ConfigurationError(
        "sagaworker.web needs Flask: pip install 'sagaworker[web]'") from exc

from sagaworker import Sagaworker
from sagaworker._producer.signer import weak_secret

from . import api, dashboard, reads
from .api import SagaIdConverter, ValidationFailed
from .auth import READ_ONLY, WebAuth

__all__ = ["SECURITY_HEADERS", "ValidationFailed", "WebAuth", "create_app"]

#: on every response: the pages load script and style from this origin only (nothing
#: inline: dashboard.js and dashboard.css), no page may frame them (a framed page would
#: let another site trick an operator into clicking Approve), no type sniffing, no referrer
SECURITY_HEADERS = {
    "Content-Security-Policy": "default-src 'self'; script-src 'self'; style-src 'self'; "
                               "img-src 'self' data:; object-src 'none'; base-uri 'none'; "
                               "form-action 'self'; frame-ancestors 'none'",
    "X-Frame-Options": "DENY",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
}


#: all a client learns of a journal that cannot be reached (the log says why)
UNAVAILABLE = "journal unavailable"


def _wants_html() -> bool:
    return request.path == "/" or request.path.startswith(("/ui/", "/static/"))


def _unavailable(exc: JournalUnavailable) -> Any:
    """The reason names the database (its password masked): for the server's log only,
    never for a client, who may be anyone who reaches the app."""
    current_app.logger.warning("journal unavailable on %s %s: %s", request.method,
                               request.path, exc)
    if _wants_html():
        return render_template("error.html", code=503, name="Service Unavailable",
                               message=UNAVAILABLE), 503
    return jsonify({"error": UNAVAILABLE, "status": 503}), 503


def _announce(app: Flask, sw: Sagaworker, web_auth: WebAuth) -> None:
    """Said at start: who may read the journal, and an approval secret that looks
    guessable (it keys the fingerprints operators read)."""
    reads.announce(web_auth, app.logger)
    weak = weak_secret(sw.settings)
    if weak is not None:
        app.logger.warning(weak)


def create_app(sw: Sagaworker, *, auth: WebAuth | None = None) -> Flask:
    """The dashboard and JSON API over ``sw``'s journal. ``auth`` says who may decide and
    who may read (default: ``WebAuth.from_env()``; nothing configured decides and reads
    nothing); a malformed setting raises ``AuthConfigError`` here, at start."""
    if not isinstance(sw, Sagaworker):
        raise ConfigurationError(
            f"create_app() takes your app's Sagaworker, got {type(sw).__name__}: "
            "create_app(sw) with the sw of the module that declares your tools")
    app = Flask(__name__)
    app.config["MAX_CONTENT_LENGTH"] = 64 * 1024
    app.json.sort_keys = False  # type: ignore[attr-defined]
    app.extensions["sagaworker"] = sw
    app.extensions["sagaworker_auth"] = web_auth = auth if auth is not None else WebAuth.from_env()
    if not web_auth.configured:
        app.logger.warning("read-only: %s", READ_ONLY)
    _announce(app, sw, web_auth)
    app.url_map.converters["saga_id"] = SagaIdConverter
    app.before_request(reads.gate)
    app.register_blueprint(api.bp)
    app.register_blueprint(reads.bp)
    app.register_blueprint(dashboard.bp)
    dashboard.register_filters(app)

    @app.errorhandler(HTTPException)
    def http_error(exc: HTTPException) -> Any:
        code = exc.code or 500
        if _wants_html():
            return render_template("error.html", code=code, name=exc.name,
                                   message=exc.description), code
        return jsonify({"error": exc.description, "status": code}), code

    @app.errorhandler(BadInput)
    def bad_input(exc: BadInput) -> tuple[Response, int]:
        # an id or a value no saga can hold (a NUL, a lone surrogate): the caller's error
        return jsonify({"error": str(exc), "status": 400}), 400

    app.register_error_handler(JournalUnavailable, _unavailable)

    @app.errorhandler(Exception)
    def crash(exc: Exception) -> tuple[Response, int]:
        app.logger.exception("unhandled error on %s %s", request.method, request.path)
        return jsonify({"error": f"internal error: {type(exc).__name__}", "status": 500}), 500

    @app.after_request
    def security_headers(resp: Response) -> Response:
        for name, value in SECURITY_HEADERS.items():
            resp.headers.setdefault(name, value)
        return resp

    @app.get("/healthz")
    def healthz() -> dict[str, str]:
        return {"status": "ok"}

    return app
