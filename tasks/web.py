"""The example's web app: the library's dashboard and API (``sagaworker.web``) plus the
order endpoint. ``flask --app tasks.web:create_app run`` (development) or
``gunicorn 'tasks.web:create_app()'`` (production, see the Procfile).

The order endpoint's two halves: strict validation of the body, and starting the flow.

``POST /orders`` journals the order as a durable flow (``sw.start``) and returns: the
workers carry it forward from the journal, so no thread of the web process drives a saga,
and a deploy or a crash of the web app loses nothing. A taken id is a 409 at once. The
journal is the state: ``GET /sagas/<id>`` reads it from any process.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from flask import Blueprint, Flask, Response, current_app, jsonify, url_for

from sagaworker import SagaExists, SagaStatus, Sagaworker
from sagaworker.web import ValidationFailed, WebAuth
from sagaworker.web import create_app as dashboard_app
from sagaworker.web.api import error, json_body

__all__ = ["DEFAULT_FLOW", "Order", "Orders", "ValidationFailed", "create_app",
           "parse_order", "saga_id_for"]

#: the example's order flow, by its registered name (``tasks.orders.place_order``)
DEFAULT_FLOW = "tasks.orders.place_order"

_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
_FIELDS = ("order_id", "sku", "quantity", "card", "amount_cents")
MAX_QUANTITY = 10_000
MAX_AMOUNT_CENTS = 100_000_000


@dataclass(frozen=True)
class Order:
    order_id: str
    sku: str
    quantity: int
    card: str
    amount_cents: int

    @property
    def metadata(self) -> dict[str, Any]:
        """What the journal keeps about the order (never the full card number)."""
        return {"order_id": self.order_id, "sku": self.sku, "quantity": self.quantity,
                "amount_cents": self.amount_cents, "card_last4": self.card[-4:]}


def saga_id_for(order_id: str) -> str:
    return f"order-{order_id}"


def _text(body: dict[str, Any], key: str, reasons: dict[str, str], *, limit: int,
          pattern: re.Pattern[str] | None = None) -> str:
    value = body.get(key)
    if not isinstance(value, str):
        reasons[key] = f"must be a string, got {type(value).__name__}"
        return ""
    if not value.strip() or value != value.strip():
        reasons[key] = "must be non-empty, without leading or trailing spaces"
    elif len(value) > limit:
        reasons[key] = f"must be at most {limit} characters"
    elif pattern is not None and not pattern.match(value):
        reasons[key] = "must be letters, digits, '-', '_' or '.', starting with a letter or digit"
    return value


def _int(body: dict[str, Any], key: str, reasons: dict[str, str], *, low: int,
         high: int) -> int:
    value = body.get(key)
    if isinstance(value, bool) or not isinstance(value, int):
        reasons[key] = f"must be an integer, got {type(value).__name__}"
        return 0
    if not low <= value <= high:
        reasons[key] = f"must be between {low} and {high}"
    return value


def parse_order(body: Any) -> Order:
    """The order in ``body`` (decoded JSON), or ValidationFailed saying every problem."""
    if not isinstance(body, dict):
        raise ValidationFailed({"body": "must be a JSON object with the fields "
                                        + ", ".join(_FIELDS)})
    reasons: dict[str, str] = {}
    for key in sorted(set(body) - set(_FIELDS)):
        reasons[str(key)] = "unknown field"
    for key in _FIELDS:
        if key not in body:
            reasons[key] = "is required"
    order = Order(
        order_id=_text(body, "order_id", reasons, limit=64, pattern=_ID),
        sku=_text(body, "sku", reasons, limit=80),
        quantity=_int(body, "quantity", reasons, low=1, high=MAX_QUANTITY),
        card=_text(body, "card", reasons, limit=80),
        amount_cents=_int(body, "amount_cents", reasons, low=1, high=MAX_AMOUNT_CENTS),
    )
    if reasons:
        raise ValidationFailed({k: reasons[k] for k in sorted(reasons)})
    return order


@dataclass(frozen=True)
class Orders:
    """Starts order flows: ``flow`` is a registered flow (the function or its name) called
    as ``flow(s, order_id, sku, quantity, card, amount_cents)``."""

    sw: Sagaworker
    flow: Callable[..., Any] | str = DEFAULT_FLOW
    deadline: float | None = None

    def start(self, order: Order) -> str:
        """Journal the order's flow saga (SagaExists when the id is taken) and return: the
        workers run it."""
        saga = self.sw.start(saga_id_for(order.order_id), self.flow,  # type: ignore[arg-type]
                             order.order_id, order.sku, order.quantity, order.card,
                             order.amount_cents, metadata=order.metadata,
                             deadline=self.deadline)
        return saga.saga_id


bp = Blueprint("orders", __name__)


@bp.errorhandler(ValidationFailed)
def _invalid(exc: ValidationFailed) -> tuple[Response, int]:
    return error(422, "invalid request body", reasons=exc.reasons)


@bp.post("/orders")
def post_order() -> tuple[Response, int]:
    order = parse_order(json_body())
    orders: Orders = current_app.extensions["sagaworker_orders"]
    try:
        saga_id = orders.start(order)  # journaled and handed to the workers: returns at once
    except SagaExists as exc:
        return error(409, str(exc), saga_id=saga_id_for(order.order_id))
    here = url_for("api.get_saga", saga_id=saga_id)  # the id percent-encoded, one segment
    resp = jsonify({"saga_id": saga_id, "status": SagaStatus.RUNNING.value,
                    "links": {"self": here,
                              "ui": url_for("dashboard.saga_page", saga_id=saga_id)}})
    resp.headers["Location"] = here
    return resp, 202


def create_app(sw: Sagaworker | None = None, *, flow: Callable[..., Any] | str | None = None,
               deadline: float | None = None, auth: WebAuth | None = None) -> Flask:
    """The example's app: ``sagaworker.web.create_app(sw)`` with ``POST /orders``. ``sw``
    defaults to the example's ``tasks.sw`` and ``flow`` to its order flow: ``POST /orders``
    starts it with ``sw.start`` and returns, and the workers carry it. ``deadline``
    (seconds) bounds each order's saga."""
    if sw is None:
        from . import sw as example_sw

        sw = example_sw
    app = dashboard_app(sw, auth=auth)
    app.extensions["sagaworker_orders"] = Orders(sw, flow or DEFAULT_FLOW, deadline)
    app.register_blueprint(bp)
    return app
