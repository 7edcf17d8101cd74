"""Who may decide from the web: read-only without configuration (403), 401 for missing or
wrong credentials, the journaled approver/actor is the authenticated operator (a bearer
token's name or a trusted proxy header, only when configured), never a body field."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from flask.testing import FlaskClient

from sagaworker import Phase, SagaStatus, Sagaworker
from sagaworker.web.auth import AuthConfigError, WebAuth, hash_token, parse_token_lines
from sagaworker.web.tokens import main as tokens_main
from tasks.web import create_app

from .journal import (
    ALICE_TOKEN,
    BOB_TOKEN,
    Tools,
    audit_rows,
    awaiting_approval,
    bearer,
    compensated,
    operators,
    order_flow,
    running,
)

ROOT = Path(__file__).resolve().parents[2]
DECISIONS: list[tuple[str, dict[str, Any]]] = [
    ("/approvals/approve", {"saga_id": "order-g", "seq": 2}),
    ("/approvals/reject", {"saga_id": "order-g", "seq": 2, "reason": "no"}),
    ("/sagas/order-dirty/retry-compensation", {}),
    ("/sagas/order-run/abort", {"reason": "customer cancelled"}),
]


@pytest.fixture
def states(sw: Sagaworker, tools: Tools) -> Sagaworker:
    """A gate (order-g step 2), a dirty saga (order-dirty) and a running one (order-run)."""
    awaiting_approval(sw, tools, "order-g")
    compensated(sw, tools, "order-dirty", card="stuck-1")
    running(sw, tools, "order-run")
    return sw


def _unchanged(sw: Sagaworker) -> None:
    assert sw.inspect("order-g").entries[1].phase is Phase.AWAITING_APPROVAL
    assert sw.inspect("order-dirty").status is SagaStatus.COMPENSATION_FAILED
    assert sw.inspect("order-run").status is SagaStatus.RUNNING
    assert audit_rows(sw, "order-run") == [] and audit_rows(sw, "order-dirty") == []


def _client(sw: Sagaworker, auth: WebAuth) -> FlaskClient:
    return create_app(sw, flow=order_flow, auth=auth).test_client()


# -- read-only -------------------------------------------------------------------------------

@pytest.mark.parametrize(("path", "body"), DECISIONS)
def test_read_only_app_refuses_every_decision_with_403(states: Sagaworker, path: str,
                                                       body: dict[str, Any]) -> None:
    """With no authentication configured, approve, reject, re-drive and abort are 403 with
    a JSON error saying how to configure it, whatever the request carries; nothing moves."""
    client = _client(states, WebAuth())
    for headers in ({}, bearer(ALICE_TOKEN), {"X-Forwarded-User": "alice"}):
        resp = client.post(path, json=body, headers=headers)
        assert resp.status_code == 403, resp.get_data(as_text=True)
        data = resp.get_json()
        assert data["read_only"] is True
        assert "read-only" in data["error"] and "SAGAWORKER_WEB_TOKENS" in data["error"]
        assert "SAGAWORKER_WEB_TRUSTED_HEADER" in data["error"]
        assert "python -m sagaworker.web.tokens new" in data["error"]
    _unchanged(states)


def test_read_only_app_still_reads_and_takes_orders(states: Sagaworker) -> None:
    """Read-only is about decisions: sagas, approvals (without tokens) and orders work
    (here for anyone: anonymous reads on)."""
    client = _client(states, WebAuth(anonymous_reads=True))
    assert client.get("/auth").get_json() == {"read_only": True, "methods": [],
                                              "operator": None, "via": None, "reader": None,
                                              "role": None, "anonymous_reads": True}
    assert client.get("/sagas/order-g").status_code == 200
    pending = client.get("/approvals").get_json()["approvals"]
    assert [(p["saga_id"], p["token"]) for p in pending] == [("order-g", None)]
    order = {"order_id": "77", "sku": "s", "quantity": 1, "card": "c", "amount_cents": 1}
    assert client.post("/orders", json=order).status_code == 202


# -- 401 -------------------------------------------------------------------------------------

@pytest.mark.parametrize("headers", [
    {},
    {"Authorization": "Bearer swop_not-a-token"},
    {"Authorization": f"Bearer {ALICE_TOKEN}x"},
    {"Authorization": "Bearer "},
    {"Authorization": f"Basic {ALICE_TOKEN}"},
    {"Authorization": hash_token(ALICE_TOKEN)},  # the stored hash is not a credential
    {"X-Forwarded-User": "alice"},  # no trusted header configured: ignored
])
@pytest.mark.parametrize(("path", "body"), DECISIONS)
def test_missing_or_wrong_credentials_are_401(client: FlaskClient, states: Sagaworker,
                                              path: str, body: dict[str, Any],
                                              headers: dict[str, str]) -> None:
    """No token, a wrong or malformed one, or an unconfigured header: 401 JSON with a
    Bearer challenge, and nothing changes."""
    resp = client.post(path, json=body, headers=headers)
    assert resp.status_code == 401, resp.get_data(as_text=True)
    assert resp.headers["WWW-Authenticate"].startswith("Bearer")
    assert "Authorization: Bearer" in resp.get_json()["error"]
    _unchanged(states)


def test_wrong_token_is_401_on_reads_that_identify(client: FlaskClient) -> None:
    """GET /auth and GET /approvals with a wrong token say so (401) rather than answer as
    if anonymous; without one they answer."""
    wrong = {"Authorization": "Bearer nope"}
    assert client.get("/auth", headers=wrong).status_code == 401
    assert client.get("/approvals", headers=wrong).status_code == 401
    assert client.get("/auth").get_json()["operator"] is None
    me = client.get("/auth", headers=bearer(BOB_TOKEN)).get_json()
    assert (me["read_only"], me["operator"], me["via"]) == (False, "bob", "token")


# -- 200 with a token ------------------------------------------------------------------------

def test_approve_with_token_journals_the_tokens_name(alice: FlaskClient,
                                                     states: Sagaworker) -> None:
    """alice's token approves (the gate named by saga and step); the journal says alice."""
    resp = alice.post("/approvals/approve", json={"saga_id": "order-g", "seq": 2})
    assert resp.status_code == 200, resp.get_json()
    assert resp.get_json() == {"decision": "approved", "approver": "alice", "reason": None}
    e = states.inspect("order-g").entries[1]
    assert e.phase is not Phase.AWAITING_APPROVAL and e.approved_by == "alice"
    again = alice.post("/approvals/approve", json={"saga_id": "order-g", "seq": 2})
    assert again.status_code == 409 and "not waiting for approval" in again.get_json()["error"]
    assert alice.post("/approvals/approve",
                      json={"saga_id": "order-g", "seq": 9}).status_code == 404
    assert alice.post("/approvals/approve",
                      json={"saga_id": "order-x", "seq": 1}).status_code == 404


def test_body_cannot_name_the_approver(bob: FlaskClient, states: Sagaworker) -> None:
    """A body claiming another approver is refused (422) and the gate stays open; without
    it bob's rejection is journaled as bob's."""
    token = bob.get("/approvals").get_json()["approvals"][0]["token"]
    claim = bob.post("/approvals/reject", json={"token": token, "approver": "alice",
                                                "reason": "fraud"})
    assert claim.status_code == 422
    assert "authenticated operator" in claim.get_json()["reasons"]["approver"]
    assert states.inspect("order-g").entries[1].phase is Phase.AWAITING_APPROVAL
    ok = bob.post("/approvals/reject", json={"token": token, "reason": "fraud"})
    assert ok.status_code == 200
    e = states.inspect("order-g").entries[1]
    assert (e.phase, e.rejected_by, e.rejection_reason) == (Phase.REJECTED, "bob", "fraud")


def test_abort_and_redrive_journal_the_operator(alice: FlaskClient, bob: FlaskClient,
                                                states: Sagaworker) -> None:
    """Abort (with a reason) and re-drive answer 202 and journal the operator as actor;
    an unknown saga is 404, a finished one 409."""
    resp = alice.post("/sagas/order-run/abort", json={"reason": "customer cancelled"})
    assert resp.status_code == 202, resp.get_json()
    assert resp.get_json()["aborted_by"] == "alice"
    assert audit_rows(states, "order-run") == [("abort", "alice", "customer cancelled")]
    assert states.inspect("order-run").reason == "aborted by alice: customer cancelled"
    redrive = bob.post("/sagas/order-dirty/retry-compensation", json={})
    assert redrive.status_code == 202, redrive.get_json()
    assert redrive.get_json()["rerun"] == [3] and redrive.get_json()["actor"] == "bob"
    assert [(a, who) for a, who, _ in audit_rows(states, "order-dirty")] == [
        ("retry_compensation", "bob")]
    assert states.inspect("order-dirty").status is SagaStatus.COMPENSATING
    assert alice.post("/sagas/nope/abort", json={"reason": "x"}).status_code == 404
    assert alice.post("/sagas/nope/retry-compensation", json={}).status_code == 404
    assert alice.post("/sagas/order-dirty/abort", json={"reason": "x"}).status_code == 409
    assert alice.post("/sagas/order-g/retry-compensation", json={}).status_code == 409


def test_decisions_need_json(alice: FlaskClient, states: Sagaworker) -> None:
    """A form post (what a cross-site page can send without a preflight) is refused."""
    resp = alice.post("/sagas/order-run/abort", data={"reason": "x"})
    assert resp.status_code == 422
    resp = alice.post("/sagas/order-dirty/retry-compensation")
    assert resp.status_code == 422
    _unchanged(states)


# -- the trusted header ----------------------------------------------------------------------

def test_trusted_header_identifies_only_when_configured(states: Sagaworker) -> None:
    """With SAGAWORKER_WEB_TRUSTED_HEADER=X-Forwarded-User the proxy's user is the
    approver; another header name is not trusted; an empty header is no identity."""
    proxied = _client(states, WebAuth(trusted_header="X-Forwarded-User"))
    other = proxied.post("/approvals/approve", json={"saga_id": "order-g", "seq": 2},
                         headers={"X-Auth-Request-User": "mallory"})
    assert other.status_code == 401
    assert "sign in through the proxy that sets X-Forwarded-User" in other.get_json()["error"]
    assert "WWW-Authenticate" not in other.headers  # no token login here
    empty = proxied.post("/approvals/approve", json={"saga_id": "order-g", "seq": 2},
                         headers={"X-Forwarded-User": "  "})
    assert empty.status_code == 401
    # a bearer token is no identity where only the header is configured
    assert proxied.post("/approvals/approve", json={"saga_id": "order-g", "seq": 2},
                        headers=bearer(ALICE_TOKEN)).status_code == 401
    _unchanged(states)
    ok = proxied.post("/approvals/approve", json={"saga_id": "order-g", "seq": 2},
                      headers={"X-Forwarded-User": "carol@example.com"})
    assert ok.status_code == 200 and ok.get_json()["approver"] == "carol@example.com"
    assert states.inspect("order-g").entries[1].approved_by == "carol@example.com"
    me = proxied.get("/auth", headers={"X-Forwarded-User": "carol@example.com"}).get_json()
    assert me["operator"] == "carol@example.com" and me["via"] == "header:X-Forwarded-User"


def test_header_wins_over_the_proxys_own_bearer(states: Sagaworker) -> None:
    """Both configured: oauth2-proxy may pass its ID token as a bearer alongside the user
    header; the header is the identity. Without the header a token still works."""
    both = WebAuth(tokens=[("alice", hash_token(ALICE_TOKEN))],
                   trusted_header="X-Auth-Request-User")
    client = _client(states, both)
    resp = client.post("/sagas/order-run/abort", json={"reason": "stop"},
                       headers={"X-Auth-Request-User": "dave",
                                "Authorization": "Bearer eyJ.oidc.id-token"})
    assert resp.status_code == 202 and resp.get_json()["aborted_by"] == "dave"
    resp = client.post("/sagas/order-dirty/retry-compensation", json={},
                       headers=bearer(ALICE_TOKEN))
    assert resp.status_code == 202 and resp.get_json()["actor"] == "alice"
    assert client.get("/auth").get_json()["methods"] == ["token",
                                                         "header:X-Auth-Request-User"]


def test_absurd_header_values_are_refused(states: Sagaworker) -> None:
    client = _client(states, WebAuth(trusted_header="X-Forwarded-User"))
    for value in ("a" * 201, "bob\x07"):
        resp = client.post("/approvals/approve", json={"saga_id": "order-g", "seq": 2},
                           headers={"X-Forwarded-User": value})
        assert resp.status_code == 401
    _unchanged(states)


@pytest.mark.parametrize("headers", [
    [("X-Forwarded-User", "alice, mallory")],
    [("X-Forwarded-User", "mallory,alice")],
    [("X-Forwarded-User", "alice"), ("X-Forwarded-User", "mallory")],
])
def test_several_proxy_user_values_are_no_identity(states: Sagaworker,
                                                   headers: list[tuple[str, str]]) -> None:
    """A user header holding several values (a chain of proxies joined them with a comma,
    or the client sent its own copy next to the proxy's) names nobody: 401 saying so,
    never a decision journaled under the joined text or either name."""
    client = _client(states, WebAuth(trusted_header="X-Forwarded-User"))
    for path, body in DECISIONS:
        resp = client.post(path, json=body, headers=headers)
        assert resp.status_code == 401, (path, resp.get_json())
        assert "X-Forwarded-User header holds several values" in resp.get_json()["error"]
    me = client.get("/auth", headers=headers)
    assert me.status_code == 401 and "several values" in me.get_json()["error"]
    page = client.get("/", headers=headers).get_data(as_text=True)
    assert 'id="operator-name"></b>' in page and "mallory" not in page
    _unchanged(states)


# -- configuration ---------------------------------------------------------------------------

def test_tokens_from_the_environment(monkeypatch: pytest.MonkeyPatch, states: Sagaworker,
                                     tmp_path: Path) -> None:
    """create_app() reads SAGAWORKER_WEB_TOKENS (comma-separated name:sha256)."""
    monkeypatch.chdir(tmp_path)  # no .env here
    monkeypatch.setenv("SAGAWORKER_WEB_TOKENS",
                       f" alice:{hash_token(ALICE_TOKEN)} , bob:{hash_token(BOB_TOKEN)}")
    client = create_app(states, flow=order_flow).test_client()
    assert client.get("/auth", headers=bearer(BOB_TOKEN)).get_json()["operator"] == "bob"
    resp = client.post("/approvals/approve", json={"saga_id": "order-g", "seq": 2},
                       headers=bearer(ALICE_TOKEN))
    assert resp.status_code == 200 and resp.get_json()["approver"] == "alice"


def test_nothing_configured_in_the_environment_is_read_only(monkeypatch: pytest.MonkeyPatch,
                                                           states: Sagaworker,
                                                           tmp_path: Path) -> None:
    monkeypatch.chdir(tmp_path)
    for var in ("SAGAWORKER_WEB_TOKENS", "SAGAWORKER_WEB_TOKENS_FILE",
                "SAGAWORKER_WEB_TRUSTED_HEADER"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("SAGAWORKER_WEB_TOKENS", "")  # an empty line is unset
    client = create_app(states, flow=order_flow).test_client()
    assert client.get("/auth").get_json()["read_only"] is True


def test_tokens_file_is_reread_when_it_changes(monkeypatch: pytest.MonkeyPatch,
                                               states: Sagaworker, tmp_path: Path) -> None:
    """SAGAWORKER_WEB_TOKENS_FILE: comments allowed; adding and revoking a line takes effect
    without a restart; a file broken later authenticates nobody (fails closed)."""
    import os

    f = tmp_path / "operators"
    f.write_text(f"# on-call\nalice:{hash_token(ALICE_TOKEN)}  # since March\n\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("SAGAWORKER_WEB_TOKENS_FILE", str(f))
    client = create_app(states, flow=order_flow).test_client()

    def who(token: str) -> Any:
        resp = client.get("/auth", headers=bearer(token))
        return resp.get_json()["operator"] if resp.status_code == 200 else resp.status_code

    assert (who(ALICE_TOKEN), who(BOB_TOKEN)) == ("alice", 401)
    f.write_text(f"bob:{hash_token(BOB_TOKEN)}\n")
    os.utime(f, (1, 1))  # a different mtime even within the clock's resolution
    assert (who(ALICE_TOKEN), who(BOB_TOKEN)) == (401, "bob")
    f.write_text("garbage\n")
    os.utime(f, (2, 2))
    assert (who(ALICE_TOKEN), who(BOB_TOKEN)) == (401, 401)


@pytest.mark.parametrize(("env", "needle"), [
    ({"SAGAWORKER_WEB_TOKENS": "alice"}, "SAGAWORKER_WEB_TOKENS: entry 1"),
    ({"SAGAWORKER_WEB_TOKENS": f"alice:{hash_token('x')},bob:abc"},
     "SAGAWORKER_WEB_TOKENS: entry 2"),
    ({"SAGAWORKER_WEB_TOKENS": f"a b:{hash_token('x')}"}, "SAGAWORKER_WEB_TOKENS: entry 1"),
    ({"SAGAWORKER_WEB_TOKENS_FILE": "/nonexistent/operators"}, "cannot be read"),
    ({"SAGAWORKER_WEB_TRUSTED_HEADER": "X-User: x"}, "SAGAWORKER_WEB_TRUSTED_HEADER"),
])
def test_malformed_settings_fail_at_start(monkeypatch: pytest.MonkeyPatch, sw: Sagaworker,
                                          tmp_path: Path, env: dict[str, str],
                                          needle: str) -> None:
    """A malformed setting stops the app at start, naming the setting (never silently
    read-only, never echoing a hash)."""
    monkeypatch.chdir(tmp_path)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    with pytest.raises(AuthConfigError) as exc:
        create_app(sw, flow=order_flow)
    assert needle in str(exc.value)
    assert hash_token("x") not in str(exc.value)


def test_repr_shows_no_hash() -> None:
    auth = operators()
    assert hash_token(ALICE_TOKEN) not in repr(auth) and "token" in repr(auth)


# -- the token helper ------------------------------------------------------------------------

def test_tokens_new_prints_a_token_and_its_line(capsys: pytest.CaptureFixture[str]) -> None:
    """``python -m sagaworker.web.tokens new NAME``: stdout is the token, then ``NAME:sha256`` that
    SAGAWORKER_WEB_TOKENS accepts and that authenticates the token as NAME."""
    assert tokens_main(["new", "erin"]) == 0
    token, line = capsys.readouterr().out.split()
    assert token.startswith("swop_") and len(token) > 40
    assert line == f"erin:{hash_token(token)}"
    assert parse_token_lines(line, "SAGAWORKER_WEB_TOKENS", sep=",") == [
        ("erin", hash_token(token))]
    assert tokens_main(["new", "erin"]) == 0
    assert capsys.readouterr().out.split()[0] != token  # a fresh token every time
    with pytest.raises(SystemExit) as exc:
        tokens_main(["new", "bad name"])
    assert exc.value.code == 2


def test_tokens_module_runs(tmp_path: Path) -> None:
    """The module runs as ``python -m sagaworker.web.tokens``; ``hash`` reads a token on stdin."""
    got = subprocess.run([sys.executable, "-m", "sagaworker.web.tokens", "hash"], input="abc\n",
                         cwd=ROOT, capture_output=True, text=True, timeout=60, check=False)
    assert got.returncode == 0, got.stderr
    assert got.stdout.strip() == hash_token("abc")


def test_a_revocation_that_keeps_size_and_mtime_is_seen(tmp_path: Path) -> None:
    """A tokens file replaced by one of the same size with its modification time kept
    (`cp -p`, `rsync -t`): the revoked token authenticates nobody any more."""
    import os

    from sagaworker.web.auth import _TokenFile

    path = tmp_path / "tokens"
    path.write_text(f"alice:{hash_token('a' * 32)}\n")
    tokens = _TokenFile(path)
    assert [n for n, _ in tokens.load()] == ["alice"]
    st = path.stat()
    path.write_text(f"carol:{hash_token('c' * 32)}\n")
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert path.stat().st_size == st.st_size and path.stat().st_mtime_ns == st.st_mtime_ns
    assert [n for n, _ in tokens.load()] == ["carol"]


@pytest.mark.parametrize("header", ["Host", "authorization", "Cookie"])
def test_a_header_clients_send_themselves_is_refused_as_trusted(header: str) -> None:
    """SAGAWORKER_WEB_TRUSTED_HEADER=Host (or Authorization, Cookie) would make anyone an
    operator: refused at start, naming the setting and what to name instead."""
    with pytest.raises(AuthConfigError, match=r"SAGAWORKER_WEB_TRUSTED_HEADER.*proxy"):
        WebAuth(trusted_header=header)


@pytest.mark.parametrize("header", ["Sec-Fetch-Site", "sec-fetch-user", "X-Forwarded-For",
                                    "X-Forwarded-Host", "X-Real-IP", "Forwarded",
                                    "X-Requested-With", "Accept-Language", "X-User"])
def test_a_header_that_names_no_signed_in_user_is_refused_as_trusted(
        monkeypatch: pytest.MonkeyPatch, sw: Sagaworker, tmp_path: Path, header: str) -> None:
    """A browser sends Sec-Fetch-Site (``same-origin``) with a plain form POST, and a proxy
    sets X-Forwarded-For to the client's address: trusting either made anyone an
    operator. Only a header an authenticating proxy sets to the signed-in user is
    accepted (or X-Sagaworker-*, one the operator's proxy sets): the app refuses to
    start, naming the setting and the headers it takes."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("SAGAWORKER_WEB_TRUSTED_HEADER", header)
    with pytest.raises(AuthConfigError) as exc:
        create_app(sw, flow=order_flow)
    assert str(exc.value) == (
        f"SAGAWORKER_WEB_TRUSTED_HEADER {header!r} is not a header an authenticating proxy "
        "sets to the signed-in user (a browser or a client may send it itself: "
        "Sec-Fetch-Site: same-origin would name an operator); name one of "
        "X-Forwarded-User, X-Forwarded-Email, X-Forwarded-Preferred-Username, "
        "X-Auth-Request-User, X-Auth-Request-Email, X-Auth-Request-Preferred-Username, "
        "Remote-User, Remote-Email, X-Remote-User, X-Webauth-User, X-Authentik-Username, "
        "X-Authentik-Email, X-Pomerium-Claim-Email, Cf-Access-Authenticated-User-Email, "
        "X-Goog-Authenticated-User-Email, X-Amzn-Oidc-Identity, X-Ms-Client-Principal-Name, "
        "or an X-Sagaworker-* header your proxy sets (and strips from requests)")


@pytest.mark.parametrize("header", ["X-Forwarded-User", "x-auth-request-email", "Remote-User",
                                    "Cf-Access-Authenticated-User-Email", "X-Sagaworker-User"])
def test_the_identity_headers_of_authenticating_proxies_are_trusted(
        states: Sagaworker, header: str) -> None:
    """oauth2-proxy's, Authelia's, Cloudflare Access's (any case), or an X-Sagaworker-*
    header of the operator's own proxy: the signed-in user it names approves."""
    client = _client(states, WebAuth(trusted_header=header))
    ok = client.post("/approvals/approve", json={"saga_id": "order-g", "seq": 2},
                     headers={header: "carol@example.com"})
    assert (ok.status_code, ok.get_json()["approver"]) == (200, "carol@example.com")
