"""The JSON API: start orders, read sagas, decide approval gates."""

from __future__ import annotations

from typing import Any

from flask import Blueprint, Response, current_app, jsonify, request

from sagaworker import (
    ApprovalInvalid,
    ConfigurationError,
    Redaction,
    SagaExists,
    SagaNotFound,
    SagaStatus,
)

from .orders import Orders, ValidationFailed, parse_order, saga_id_for
from .queries import idle_sagas
from .serialize import approval_json, saga_json

__all__ = ["bp", "state"]

bp = Blueprint("api", __name__)

Reply = tuple[Response, int]


def state() -> Orders:
    orders: Orders = current_app.extensions["sagaworker_orders"]
    return orders


def _error(status: int, message: str, **extra: Any) -> Reply:
    return jsonify({"error": message, **extra}), status


def _json_body() -> Any:
    """The decoded body, or ValidationFailed when it is not JSON."""
    if not request.is_json:
        raise ValidationFailed({"body": "send JSON with Content-Type: application/json"})
    body = request.get_json(silent=True)
    if body is None:
        raise ValidationFailed({"body": "is not valid JSON"})
    return body


@bp.errorhandler(ValidationFailed)
def _invalid(exc: ValidationFailed) -> Reply:
    return _error(422, "invalid request body", reasons=exc.reasons)


@bp.post("/orders")
def post_order() -> Reply:
    order = parse_order(_json_body())
    try:
        saga_id = state().start(order)  # journaled and handed to the workers: returns at once
    except SagaExists as exc:
        return _error(409, str(exc), saga_id=saga_id_for(order.order_id))
    resp = jsonify({"saga_id": saga_id, "status": SagaStatus.RUNNING.value,
                    "links": {"self": f"/sagas/{saga_id}", "ui": f"/ui/sagas/{saga_id}"}})
    resp.headers["Location"] = f"/sagas/{saga_id}"
    return resp, 202


@bp.get("/sagas")
def list_sagas() -> Reply:
    status = request.args.get("status") or None
    if status is not None and status not in SagaStatus.__members__:
        raise ValidationFailed({"status": "must be one of " + ", ".join(SagaStatus)})
    raw_limit = request.args.get("limit", "100")
    if not raw_limit.isdigit() or not 1 <= int(raw_limit) <= 1000:
        raise ValidationFailed({"limit": "must be an integer between 1 and 1000"})
    idle = request.args.get("idle", "")
    if idle not in ("", "0", "1", "true", "false"):
        raise ValidationFailed({"idle": "must be true or false"})
    sw = state().sw
    if idle in ("1", "true"):  # the sweeper reported them idle (saga_idle): abort or complete
        recs = idle_sagas(sw, int(raw_limit))
    else:
        recs = sw.sagas(status=status, limit=int(raw_limit))
    red = Redaction.of(sw)
    return jsonify({"sagas": [saga_json(r, red) for r in recs]}), 200


@bp.get("/sagas/<path:saga_id>")
def get_saga(saga_id: str) -> Reply:
    sw = state().sw
    try:
        rec = sw.inspect(saga_id)
    except SagaNotFound as exc:
        return _error(404, str(exc))
    return jsonify(saga_json(rec, Redaction.of(sw))), 200


@bp.get("/approvals")
def list_approvals() -> Reply:
    sw = state().sw
    try:
        pending = sw.pending_approvals()
    except ConfigurationError as exc:
        return _error(503, str(exc))
    red = Redaction.of(sw)
    return jsonify({"approvals": [approval_json(a, red) for a in pending]}), 200


def _decision(body: Any, *, need_reason: bool) -> tuple[str, str, str | None]:
    if not isinstance(body, dict):
        raise ValidationFailed({"body": "must be a JSON object with token, approver"
                                        + (", reason" if need_reason else "")})
    reasons: dict[str, str] = {k: "unknown field" for k in body
                               if k not in ("token", "approver", "reason")}
    values: dict[str, str | None] = {}
    for key, required, limit in (("token", True, 4096), ("approver", True, 200),
                                 ("reason", need_reason, 1000)):
        value = body.get(key)
        if value is None and not required:
            values[key] = None
        elif not isinstance(value, str) or not value.strip():
            reasons[key] = "is required: a non-empty string"
        elif len(value) > limit:
            reasons[key] = f"must be at most {limit} characters"
        else:
            values[key] = value.strip()
    if reasons:
        raise ValidationFailed(reasons)
    return str(values["token"]), str(values["approver"]), values.get("reason")


def _gate_error(exc: Exception) -> Reply:
    if isinstance(exc, ConfigurationError):
        return _error(503, str(exc))
    # a decided or cancelled gate is a conflict with the journal; a bad token is a bad request
    conflict = "already decided" in str(exc)
    return _error(409 if conflict else 400, str(exc))


@bp.post("/approvals/approve")
def approve() -> Reply:
    token, approver, reason = _decision(_json_body(), need_reason=False)
    try:
        state().sw.approve(token, approver=approver)
    except (ApprovalInvalid, ConfigurationError) as exc:
        return _gate_error(exc)
    return jsonify({"decision": "approved", "approver": approver, "reason": reason}), 200


@bp.post("/approvals/reject")
def reject() -> Reply:
    token, approver, reason = _decision(_json_body(), need_reason=True)
    try:
        state().sw.reject(token, approver=approver, reason=str(reason))
    except (ApprovalInvalid, ConfigurationError) as exc:
        return _gate_error(exc)
    return jsonify({"decision": "rejected", "approver": approver, "reason": reason}), 200
