"""The JSON API: order validation, 202/409, saga JSON and the approval endpoints."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from flask.testing import FlaskClient

from sagaworker import SagaStatus, Sagaworker
from tasks.web import create_app

from .journal import (
    ALICE_TOKEN,
    Tools,
    awaiting_approval,
    bearer,
    compensated,
    completed,
    make_sw,
    operators,
    order_flow,
)

GOOD: dict[str, Any] = {"order_id": "1001", "sku": "sku-42", "quantity": 2,
                        "card": "card-4242", "amount_cents": 3000}


@pytest.mark.parametrize(("body", "field"), [
    ({**GOOD, "quantity": "2"}, "quantity"),
    ({**GOOD, "quantity": True}, "quantity"),
    ({**GOOD, "quantity": 0}, "quantity"),
    ({**GOOD, "amount_cents": 10.5}, "amount_cents"),
    ({**GOOD, "amount_cents": -1}, "amount_cents"),
    ({**GOOD, "order_id": ""}, "order_id"),
    ({**GOOD, "order_id": "a/b"}, "order_id"),
    ({**GOOD, "order_id": "x" * 65}, "order_id"),
    ({**GOOD, "sku": None}, "sku"),
    ({**GOOD, "card": " card"}, "card"),
    ({**GOOD, "extra": 1}, "extra"),
    ({k: v for k, v in GOOD.items() if k != "card"}, "card"),
    ([GOOD], "body"),
    ("order", "body"),
])
def test_bad_order_body_is_422_with_reason(client: FlaskClient, body: Any, field: str) -> None:
    """Every kind of bad field gives 422 naming the field, and starts no saga."""
    resp = client.post("/orders", json=body)
    assert resp.status_code == 422, resp.get_data(as_text=True)
    data = resp.get_json()
    assert data["error"] == "invalid request body"
    assert field in data["reasons"] and isinstance(data["reasons"][field], str)


@pytest.mark.parametrize(("data", "ctype"), [
    ("{not json", "application/json"),
    ("", "application/json"),
    ("order_id=1", "application/x-www-form-urlencoded"),
    ("null", "application/json"),
])
def test_non_json_order_body_is_422(client: FlaskClient, sw: Sagaworker, data: str,
                                    ctype: str) -> None:
    """Malformed JSON, an empty body, a form post or JSON null are 422, never 500."""
    resp = client.post("/orders", data=data, content_type=ctype)
    assert resp.status_code == 422
    assert "body" in resp.get_json()["reasons"]
    assert sw.sagas() == []


def test_all_problems_reported_at_once(client: FlaskClient) -> None:
    """A body with several bad fields lists each one in the 422 reasons."""
    resp = client.post("/orders", json={"order_id": 7, "quantity": -3})
    assert resp.status_code == 422
    assert set(resp.get_json()["reasons"]) == {"order_id", "sku", "quantity", "card",
                                               "amount_cents"}


def test_order_is_accepted_with_202_and_journaled(client: FlaskClient, sw: Sagaworker,
                                                  app: Any) -> None:
    """A valid order is 202 with the saga id, and the saga is in the journal at once."""
    resp = client.post("/orders", json=GOOD)
    assert resp.status_code == 202
    data = resp.get_json()
    assert data["saga_id"] == "order-1001"
    assert resp.headers["Location"] == "/sagas/order-1001"
    rec = sw.inspect("order-1001")
    assert rec.metadata == {"order_id": "1001", "sku": "sku-42", "quantity": 2,
                            "amount_cents": 3000, "card_last4": "4242"}


def test_taken_order_id_is_409(client: FlaskClient) -> None:
    """Posting the same order id twice gives 409 the second time."""
    assert client.post("/orders", json=GOOD).status_code == 202
    resp = client.post("/orders", json={**GOOD, "sku": "other"})
    assert resp.status_code == 409
    assert resp.get_json()["saga_id"] == "order-1001"
    assert "already exists" in resp.get_json()["error"]


def test_order_starts_a_flow_and_no_thread(client: FlaskClient, sw: Sagaworker) -> None:
    """POST /orders journals a flow saga (its name and arguments) and returns: no thread of
    the web process is left driving it."""
    import threading

    before = set(threading.enumerate())
    assert client.post("/orders", json=GOOD).status_code == 202
    rec = sw.inspect("order-1001")
    assert rec.flow == "tests.web.journal.order_flow"
    assert rec.flow_args == ["1001", "sku-42", 2, "card-4242", 3000]
    assert rec.status is SagaStatus.RUNNING and rec.entries == []  # the workers' job
    assert set(threading.enumerate()) <= before


def test_flow_runs_to_the_approval_gate_and_completes(tmp_path: Path) -> None:
    """With tasks run inline the posted order's flow runs its steps and stops at the gate
    (the POST has returned); an approval through the API moves it on to COMPLETED."""
    sw, _ = make_sw(tmp_path / "eager.db", eager=True)
    client = create_app(sw, flow=order_flow, auth=operators()).test_client()
    assert client.post("/orders", json=GOOD).status_code == 202  # customers need no token
    pending = client.get("/approvals", headers=bearer(ALICE_TOKEN)).get_json()["approvals"]
    assert [p["tool_name"].rsplit(".", 1)[-1] for p in pending] == ["dispatch"]
    assert pending[0]["args"] == ["1001"]
    resp = client.post("/approvals/approve", json={"token": pending[0]["token"]},
                       headers=bearer(ALICE_TOKEN))
    assert resp.status_code == 200 and resp.get_json()["decision"] == "approved"
    rec = client.get("/sagas/order-1001").get_json()
    assert rec["status"] == "COMPLETED"
    assert [e["phase"] for e in rec["entries"]] == ["EXECUTED"] * 4
    assert rec["entries"][3]["approved_by"] == "alice"


def test_flow_compensates_when_a_step_fails(tmp_path: Path) -> None:
    """A declined card fails the posted flow, which compensates in reverse."""
    sw, _ = make_sw(tmp_path / "eager.db", eager=True)
    app = create_app(sw, flow=order_flow)
    resp = app.test_client().post("/orders", json={**GOOD, "card": "declined-1"})
    assert resp.status_code == 202
    rec = sw.inspect("order-1001")
    assert rec.status is SagaStatus.COMPENSATED
    assert [(o.seq, o.result.value) for o in rec.report.outcomes] == [
        (2, "SKIPPED"), (1, "COMPENSATED")]


def test_saga_json_shape(client: FlaskClient, sw: Sagaworker, tools: Tools) -> None:
    """GET /sagas/<id> returns the SagaRecord fields, entries and the report as JSON."""
    compensated(sw, tools, "order-9", card="stuck-1")
    resp = client.get("/sagas/order-9")
    assert resp.status_code == 200
    d = resp.get_json()
    assert {"saga_id", "status", "reason", "metadata", "created_at", "updated_at", "entries",
            "report", "dirty", "terminal"} <= set(d)
    assert d["status"] == "COMPENSATION_FAILED" and d["dirty"] is True and d["terminal"]
    e = d["entries"][0]
    assert {"seq", "tool_name", "phase", "args", "kwargs", "result", "error", "task_id",
            "attempts", "executed_at", "compensation", "compensation_detail",
            "compensation_attempts", "in_doubt"} <= set(e)
    assert e["args"] == ["sku-7", 2] and e["result"] == "hold-sku-7-2"
    assert e["executed_at"].endswith("+00:00")
    assert [o["seq"] for o in d["report"]["outcomes"]] == [3, 2, 1]
    assert [o["seq"] for o in d["report"]["dirty"]] == [3]
    assert d["report"]["dirty"][0]["result"] == "COMPENSATION_FAILED"


def test_unknown_saga_is_404_json(client: FlaskClient) -> None:
    """An unknown saga id is a JSON 404."""
    resp = client.get("/sagas/order-nope")
    assert resp.status_code == 404
    assert "order-nope" in resp.get_json()["error"]


def test_saga_list_filters_by_status(client: FlaskClient, sw: Sagaworker, tools: Tools) -> None:
    """GET /sagas?status= filters, and an unknown status is 422."""
    completed(sw, tools, "order-a")
    compensated(sw, tools, "order-b")
    ids = [s["saga_id"] for s in client.get("/sagas?status=COMPLETED").get_json()["sagas"]]
    assert ids == ["order-a"]
    assert client.get("/sagas?status=DONE").status_code == 422
    assert client.get("/sagas?limit=abc").status_code == 422


def test_approvals_list_and_reject(client: FlaskClient, bob: FlaskClient, sw: Sagaworker,
                                   tools: Tools) -> None:
    """Pending approvals are listed, with their token only for an operator; rejecting
    fails the saga, journaled as rejected by that operator."""
    awaiting_approval(sw, tools, "order-g")
    anonymous = client.get("/approvals").get_json()["approvals"]
    assert [(p["saga_id"], p["token"]) for p in anonymous] == [("order-g", None)]
    pending = bob.get("/approvals").get_json()["approvals"]
    assert len(pending) == 1
    p = pending[0]
    assert (p["saga_id"], p["seq"]) == ("order-g", 2) and p["token"] and p["requested_at"]
    resp = bob.post("/approvals/reject", json={"token": p["token"],
                                               "reason": "address is a PO box"})
    assert resp.status_code == 200 and resp.get_json()["approver"] == "bob"
    e = sw.inspect("order-g").entries[1]
    assert (e.phase.value, e.rejected_by, e.rejection_reason) == (
        "REJECTED", "bob", "address is a PO box")
    assert bob.get("/approvals").get_json()["approvals"] == []


def test_reused_token_is_409_and_forged_token_is_400(alice: FlaskClient, sw: Sagaworker,
                                                     tools: Tools) -> None:
    """A token already used is 409; a forged one is 400; both carry the message."""
    awaiting_approval(sw, tools, "order-h")
    token = alice.get("/approvals").get_json()["approvals"][0]["token"]
    assert alice.post("/approvals/approve", json={"token": token}).status_code == 200
    again = alice.post("/approvals/approve", json={"token": token})
    assert again.status_code == 409
    assert "already decided" in again.get_json()["error"]
    forged = alice.post("/approvals/reject", json={"token": token[:-4] + "AAAA",
                                                   "reason": "x"})
    assert forged.status_code == 400
    assert "not valid" in forged.get_json()["error"]


@pytest.mark.parametrize(("path", "body", "field"), [
    ("/approvals/approve", {}, "token"),
    ("/approvals/approve", {"token": "t", "approver": "mallory"}, "approver"),
    ("/approvals/approve", {"token": "t", "x": 1}, "x"),
    ("/approvals/approve", {"token": "t", "saga_id": "s", "seq": 1}, "saga_id"),
    ("/approvals/approve", {"saga_id": "s"}, "seq"),
    ("/approvals/approve", {"saga_id": "s", "seq": True}, "seq"),
    ("/approvals/reject", {"token": "t"}, "reason"),
    ("/approvals/reject", ["t"], "body"),
    ("/sagas/s/abort", {}, "reason"),
    ("/sagas/s/abort", {"reason": "r", "actor": "mallory"}, "actor"),
    ("/sagas/s/retry-compensation", {"x": 1}, "x"),
    ("/sagas/s/retry-compensation", [], "body"),
])
def test_bad_decision_body_is_422(alice: FlaskClient, path: str, body: Any,
                                  field: str) -> None:
    """Missing token (or saga_id and seq) or (to reject, abort) reason, an approver or
    actor in the body (the operator is the authenticated one), or unknown fields, are 422."""
    resp = alice.post(path, json=body)
    assert resp.status_code == 422
    assert field in resp.get_json()["reasons"]


def test_approvals_without_secret_are_503(tmp_path: Path) -> None:
    """Without an approval secret the approval endpoints say so (503), not a 500."""
    from celery import Celery

    from sagaworker import Settings

    sw = Sagaworker(Celery("t", broker="memory://"),
                    database_url=f"sqlite:///{tmp_path / 'j.db'}",
                    settings=Settings(approval_secret=None))
    client = create_app(sw, auth=operators()).test_client()
    resp = client.post("/approvals/approve", json={"token": "a.b"},
                       headers=bearer(ALICE_TOKEN))
    assert resp.status_code == 503
    assert "SAGAWORKER_APPROVAL_SECRET" in resp.get_json()["error"]


def test_wrong_method_and_unknown_path_are_json(client: FlaskClient) -> None:
    """API errors outside validation (405, 404) are JSON too."""
    assert client.get("/orders").status_code == 405
    assert client.get("/orders").get_json()["status"] == 405
    assert client.get("/nothing").get_json()["status"] == 404


@pytest.mark.parametrize("path", ["/orders", "/approvals/approve", "/approvals/reject",
                                  "/sagas/order-run/abort",
                                  "/sagas/order-run/retry-compensation"])
@pytest.mark.parametrize("data", [
    "[" * 60_000,                                 # the parser itself would recurse too far
    '{"a":' * 10_000 + "1" + "}" * 10_000,
    '{"reason": ' + "[" * 200 + "]" * 200 + "}",  # parses, but deeper than any body needs
])
def test_deeply_nested_json_is_400(alice: FlaskClient, sw: Sagaworker, tools: Tools,
                                   path: str, data: str) -> None:
    """A body nested beyond reason is refused with 400 saying so, never a 500 from a
    RecursionError, on every endpoint that takes JSON (the anonymous order one included);
    nothing is journaled."""
    from .journal import running

    running(sw, tools, "order-run")
    resp = alice.post(path, data=data, content_type="application/json")
    assert resp.status_code == 400, resp.get_data(as_text=True)[:300]
    assert "nested" in resp.get_json()["error"]
    assert [r.saga_id for r in sw.sagas()] == ["order-run"]
    assert sw.inspect("order-run").status is SagaStatus.RUNNING
