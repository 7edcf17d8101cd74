"""A small Flask app for the example order saga: a JSON API and an on-call dashboard.

``flask --app webapp:create_app run`` (development) or
``gunicorn 'webapp:create_app()'`` (production, see the Procfile).

Approving, rejecting, re-driving and aborting need an authenticated operator
(``webapp.auth``: ``SAGAWORKER_WEB_TOKENS``/``SAGAWORKER_WEB_TOKENS_FILE`` or
``SAGAWORKER_WEB_TRUSTED_HEADER``); with neither configured the app is read-only.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from flask import Flask, Response, jsonify, render_template, request
from werkzeug.exceptions import HTTPException

from sagaworker import Sagaworker

from . import api, dashboard
from .auth import READ_ONLY, WebAuth
from .orders import DEFAULT_FLOW, Order, Orders, ValidationFailed, parse_order

__all__ = ["Order", "Orders", "ValidationFailed", "WebAuth", "create_app", "parse_order"]


def _wants_html() -> bool:
    return request.path == "/" or request.path.startswith(("/ui/", "/static/"))


def create_app(sw: Sagaworker | None = None, *, flow: Callable[..., Any] | str | None = None,
               deadline: float | None = None, auth: WebAuth | None = None) -> Flask:
    """The app. ``sw`` defaults to the example's ``tasks.sw`` and ``flow`` to its order
    flow (``tasks.orders.place_order``): ``POST /orders`` starts it with ``sw.start`` and
    returns, and the workers carry it. ``deadline`` (seconds) bounds each order's saga.
    ``auth`` says who may decide (default: ``WebAuth.from_env()``; nothing configured is
    read-only); a malformed setting raises ``AuthConfigError`` here, at start."""
    if sw is None:
        import tasks

        sw = tasks.sw
    app = Flask(__name__)
    app.config["MAX_CONTENT_LENGTH"] = 64 * 1024
    app.json.sort_keys = False  # type: ignore[attr-defined]
    app.extensions["sagaworker"] = sw
    app.extensions["sagaworker_orders"] = Orders(sw, flow or DEFAULT_FLOW, deadline)
    app.extensions["sagaworker_auth"] = web_auth = auth if auth is not None else WebAuth.from_env()
    if not web_auth.configured:
        app.logger.warning("read-only: %s", READ_ONLY)
    app.register_blueprint(api.bp)
    app.register_blueprint(dashboard.bp)
    dashboard.register_filters(app)

    @app.errorhandler(HTTPException)
    def http_error(exc: HTTPException) -> Any:
        code = exc.code or 500
        if _wants_html():
            return render_template("error.html", code=code, name=exc.name,
                                   message=exc.description), code
        return jsonify({"error": exc.description, "status": code}), code

    @app.errorhandler(Exception)
    def crash(exc: Exception) -> tuple[Response, int]:
        app.logger.exception("unhandled error on %s %s", request.method, request.path)
        return jsonify({"error": f"internal error: {type(exc).__name__}", "status": 500}), 500

    @app.get("/healthz")
    def healthz() -> dict[str, str]:
        return {"status": "ok"}

    return app
