"""The JSON API: read sagas; decide approval gates, re-drive and abort as an authenticated
operator (``sagaworker.web.auth``)."""

from __future__ import annotations

from collections.abc import Callable
from functools import wraps
from typing import Any
from urllib.parse import quote

from flask import Blueprint, Response, current_app, g, jsonify, request
from werkzeug.exceptions import BadRequest
from werkzeug.routing import PathConverter

from sagaworker import (
    ApprovalInvalid,
    BadInput,
    ConfigurationError,
    Phase,
    Redaction,
    SagaNotFound,
    SagaStatus,
    Sagaworker,
    SagaworkerError,
    SealedElsewhere,
)
from sagaworker._base.errors import JournalUnavailable
from sagaworker._journal.raw_rows import UnreadableSaga
from sagaworker._producer.approvals import held_gate

from .auth import READ_ONLY, Identity, Unauthorized, WebAuth
from .queries import idle_sagas
from .serialize import approval_json, saga_json, unreadable_json

__all__ = ["SagaIdConverter", "ValidationFailed", "auth", "bp", "configuration", "error",
           "json_body", "operator", "sw_of"]

bp = Blueprint("api", __name__)

Reply = tuple[Response, int]


class ValidationFailed(ValueError):
    """A request body or query is not valid; ``reasons`` maps each bad field to why (422)."""

    def __init__(self, reasons: dict[str, str]) -> None:
        super().__init__("; ".join(f"{k}: {v}" for k, v in reasons.items()))
        self.reasons = reasons


class SagaIdConverter(PathConverter):
    """``<saga_id:...>``: a saga id in a URL, built percent-encoded as one path segment
    (``/``, ``?``, ``#`` and ``%`` included), so no link or button built from an id like
    ``x/../../sagas/victim`` leads a browser to another saga. A WSGI server decodes
    ``%2F`` before routing, so the route matches across ``/`` to get the id back whole."""

    regex = ".+?"
    part_isolating = False

    def to_url(self, value: Any) -> str:
        return quote(str(value), safe="")


def sw_of() -> Sagaworker:
    """The Sagaworker the app serves (``create_app(sw)``)."""
    sw: Sagaworker = current_app.extensions["sagaworker"]
    return sw


def auth() -> WebAuth:
    web_auth: WebAuth = current_app.extensions["sagaworker_auth"]
    return web_auth


def operator() -> Identity | None:
    """The operator making this request, or None (no or wrong credentials)."""
    try:
        return auth().identify(request)
    except Unauthorized:
        return None


def error(status: int, message: str, **extra: Any) -> Reply:
    return jsonify({"error": message, **extra}), status


def configuration(exc: ConfigurationError) -> Reply:
    """503 naming what is misconfigured here; a journal that cannot be reached is raised
    on: logged, and answered only "journal unavailable" (create_app), never its URL."""
    if isinstance(exc, JournalUnavailable):
        raise exc
    return error(503, str(exc))


#: the deepest JSON body accepted: every body the API takes is an object of plain values
MAX_DEPTH = 32
_TOO_DEEP = (f"the JSON body is nested more than {MAX_DEPTH} levels deep; send an object of "
             "plain fields")


def _depth_exceeds(value: Any, limit: int) -> bool:
    """Whether ``value`` nests lists or objects deeper than ``limit`` (no recursion)."""
    stack = [(value, 1)]
    while stack:
        v, depth = stack.pop()
        if isinstance(v, dict | list):
            if depth > limit:
                return True
            stack.extend((x, depth + 1) for x in (v.values() if isinstance(v, dict) else v))
    return False


def json_body() -> Any:
    """The decoded body, ValidationFailed when it is not JSON, or 400 when it nests deeper
    than any body needs (the parser would otherwise recurse into a RecursionError)."""
    if not request.is_json:
        raise ValidationFailed({"body": "send JSON with Content-Type: application/json"})
    try:
        body = request.get_json(silent=True)
    except RecursionError:
        raise BadRequest(_TOO_DEEP) from None
    if body is None:
        raise ValidationFailed({"body": "is not valid JSON"})
    if _depth_exceeds(body, MAX_DEPTH):
        raise BadRequest(_TOO_DEEP)
    return body


@bp.errorhandler(ValidationFailed)
def _invalid(exc: ValidationFailed) -> Reply:
    return error(422, "invalid request body", reasons=exc.reasons)



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
    sw = sw_of()
    unreadable: list[UnreadableSaga] = []
    if idle in ("1", "true"):  # the sweeper reported them idle (saga_idle): abort or complete
        recs = idle_sagas(sw, int(raw_limit))
    else:  # a saga the journal cannot read is named, not a 500 for the whole listing
        recs, unreadable = sw.journal.scan_sagas(status, int(raw_limit))
    red = Redaction.of(sw)
    return jsonify({"sagas": [saga_json(r, red) for r in recs],
                    "unreadable": [unreadable_json(u) for u in unreadable]}), 200


@bp.get("/sagas/<saga_id:saga_id>")
def get_saga(saga_id: str) -> Reply:
    sw = sw_of()
    try:
        rec = sw.inspect(saga_id)
    except SagaNotFound as exc:
        return error(404, str(exc))
    except SealedElsewhere as exc:  # a value copied in with SQL: not shown, said why
        return error(409, str(exc))
    except ConfigurationError as exc:  # no key here opens it
        return configuration(exc)
    return jsonify(saga_json(rec, Redaction.of(sw))), 200


@bp.get("/approvals")
def list_approvals() -> Reply:
    sw = sw_of()
    try:
        pending = sw.pending_approvals()
    except ConfigurationError as exc:
        return configuration(exc)
    red = Redaction.of(sw)
    try:
        who = auth().identify(request)
    except Unauthorized as exc:
        return _unauthorized(str(exc))
    # a token is a capability, a fingerprint an operator's aid: only operators get them
    out = [approval_json(a, red if who is not None else red.unmarked()) for a in pending]
    if who is None:
        for a in out:
            a["token"] = None
    return jsonify({"approvals": out}), 200


def _unauthorized(message: str) -> Reply:
    resp, status = error(401, message + "; " + _how_to_authenticate())
    if auth().uses_tokens:
        resp.headers["WWW-Authenticate"] = 'Bearer realm="sagaworker"'
    return resp, status


def _how_to_authenticate() -> str:
    ways = []
    if auth().takes_tokens:
        ways.append(f"send Authorization: Bearer <{auth().token_kinds} token>")
    if auth().trusted_header:
        ways.append(f"sign in through the proxy that sets {auth().trusted_header}")
    return " or ".join(ways)


def operator_only(view: Callable[..., Reply]) -> Callable[..., Reply]:
    """The view runs only for an authenticated operator (``g.operator``): 403 when the app
    is read-only, 401 for missing or wrong credentials. Checked before the body is read."""
    @wraps(view)
    def wrapper(*args: Any, **kwargs: Any) -> Reply:
        if not auth().configured:
            return error(403, READ_ONLY, read_only=True)
        try:
            who = auth().identify(request)
        except Unauthorized as exc:
            return _unauthorized(str(exc))
        if who is None:
            viewer = auth().reader(request)  # (a viewer's token; a cookie never decides)
            if viewer is not None and viewer.via == "viewer token":
                return error(403, f"{viewer.name}'s token is a viewer's: it reads the journal "
                                  "and decides nothing; an operator decides "
                                  "(SAGAWORKER_WEB_TOKENS)")
            return _unauthorized("this endpoint needs an authenticated operator")
        g.operator = who
        return view(*args, **kwargs)
    return wrapper


_APPROVER = ("is not accepted: the approver is the authenticated operator (the bearer "
             "token's name or the proxy's header), never a body field")


def _text_field(body: dict[str, Any], key: str, limit: int, reasons: dict[str, str]) -> str:
    value = body.get(key)
    if not isinstance(value, str) or not value.strip():
        reasons[key] = "is required: a non-empty string"
        return ""
    if len(value) > limit:
        reasons[key] = f"must be at most {limit} characters"
    return value.strip()


def _decision(body: Any, *, need_reason: bool) -> tuple[str | None, tuple[str, int] | None,
                                                         str | None]:
    """The gate (a ``token``, or ``saga_id`` and ``seq``) and the reason, or 422."""
    if not isinstance(body, dict):
        raise ValidationFailed({"body": "must be a JSON object with token (or saga_id and "
                                        "seq)" + (" and reason" if need_reason else "")})
    allowed = {"token", "saga_id", "seq", "reason"}
    reasons: dict[str, str] = {k: _APPROVER if k == "approver" else "unknown field"
                               for k in body if k not in allowed}
    token = step = None
    if "token" in body:
        token = _text_field(body, "token", 4096, reasons)
        for k in ("saga_id", "seq"):
            if k in body:
                reasons[k] = "give either token or saga_id and seq, not both"
    elif "saga_id" in body or "seq" in body:
        saga_id = _text_field(body, "saga_id", 200, reasons)
        seq = body.get("seq")
        if isinstance(seq, bool) or not isinstance(seq, int) or seq < 1:
            reasons["seq"] = "is required with saga_id: the step's number, an integer >= 1"
        else:
            step = (saga_id, seq)
    else:
        reasons["token"] = "is required (or saga_id and seq): a non-empty string"
    reason = None
    if need_reason or body.get("reason") is not None:
        reason = _text_field(body, "reason", 1000, reasons)
    if reasons:
        raise ValidationFailed(reasons)
    return token, step, reason


def _token_for(step: tuple[str, int]) -> str | Reply:
    """The current token of the gate at saga ``step[0]`` step ``step[1]``, or the error."""
    saga_id, seq = step
    sw = sw_of()
    for p in sw.pending_approvals():
        if (p.saga_id, p.seq) == (saga_id, seq):
            return p.token
    try:
        rec = sw.inspect(saga_id)
    except SagaNotFound as exc:
        return error(404, str(exc))
    except SealedElsewhere as exc:  # a value copied in with SQL: its gate is not offered
        return error(409, str(exc))
    entry = next((e for e in rec.entries if e.seq == seq), None)
    if entry is None:
        return error(404, f"saga {saga_id!r} has no step {seq}")
    if rec.diverged is not None and entry.phase is Phase.AWAITING_APPROVAL:
        return error(409, held_gate(saga_id))  # held on a divergence: not offered
    return error(409, f"saga {saga_id!r} step {seq} is {entry.phase.value}, saga "
                       f"{rec.status.value}: not waiting for approval (already decided, "
                       "cancelled or its saga is failing); nothing changed")


def _gateerror(exc: Exception) -> Reply:
    if isinstance(exc, ConfigurationError):
        return configuration(exc)
    # a decided or cancelled gate is a conflict with the journal; a bad token is a bad request
    conflict = "already decided" in str(exc)
    return error(409 if conflict else 400, str(exc))


def _decide(approve: bool) -> Reply:
    token, step, reason = _decision(json_body(), need_reason=not approve)
    who: Identity = g.operator
    sw = sw_of()
    try:
        if token is None:
            assert step is not None
            found = _token_for(step)
            if not isinstance(found, str):
                return found
            token = found
        if approve:
            sw.approve(token, approver=who.name)
        else:
            sw.reject(token, approver=who.name, reason=str(reason))
    except (ApprovalInvalid, ConfigurationError) as exc:
        return _gateerror(exc)
    except SealedElsewhere as exc:  # the gate's arguments were copied in with SQL
        return error(409, str(exc))
    return jsonify({"decision": "approved" if approve else "rejected", "approver": who.name,
                    "reason": reason}), 200


@bp.post("/approvals/approve")
@operator_only
def approve() -> Reply:
    """Approve a gate; the approver journaled is the authenticated operator."""
    return _decide(True)


@bp.post("/approvals/reject")
@operator_only
def reject() -> Reply:
    """Reject a gate with a reason; the saga fails and compensates."""
    return _decide(False)


def _object(body: Any, allowed: set[str]) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise ValidationFailed({"body": "must be a JSON object"})
    bad = {k: "is not accepted: the actor is the authenticated operator, never a body field"
           if k in ("actor", "approver") else "unknown field" for k in body if k not in allowed}
    if bad:
        raise ValidationFailed(bad)
    return body


@bp.post("/sagas/<saga_id:saga_id>/retry-compensation")
@operator_only
def retry_compensation(saga_id: str) -> Reply:
    """Operator re-drive: re-run the saga's COMPENSATION_FAILED undos (a worker runs them).
    The body is a JSON object (``{}``)."""
    _object(json_body(), set())
    who: Identity = g.operator
    out: dict[str, Any] = {"saga_id": saga_id, "actor": who.name}
    try:
        seqs = sw_of().retry_compensation(saga_id, actor=who.name)
    except SagaNotFound as exc:
        return error(404, str(exc))
    except JournalUnavailable:  # logged; the client is told only that (create_app)
        raise
    except SagaworkerError as exc:
        return error(409, str(exc))
    if not seqs:
        return error(409, f"saga {saga_id!r} has no COMPENSATION_FAILED undo to re-run")
    return jsonify({**out, "rerun": seqs}), 202


@bp.post("/sagas/<saga_id:saga_id>/abort")
@operator_only
def abort(saga_id: str) -> Reply:
    """An operator fails a running saga with a reason: its gates close and it compensates."""
    body = _object(json_body(), {"reason"})
    reasons: dict[str, str] = {}
    reason = _text_field(body, "reason", 1000, reasons)
    if reasons:
        raise ValidationFailed(reasons)
    who: Identity = g.operator
    out: dict[str, Any] = {"saga_id": saga_id, "aborted_by": who.name, "reason": reason}
    try:
        sw_of().abort(saga_id, reason=reason, actor=who.name)
    except SagaNotFound as exc:
        return error(404, str(exc))
    except BadInput:  # an id no saga can have (a NUL, a lone surrogate): the app's 400
        raise
    except JournalUnavailable:  # logged; the client is told only that (create_app)
        raise
    except SagaworkerError as exc:
        return error(409, str(exc))
    return jsonify(out), 202
