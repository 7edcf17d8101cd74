"""What an anonymous reader of the web app gets: never a secret of the journal's, its
database's or its approvers', nor a result of any size, and nothing at all unless the
operator chose to let anyone read."""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import sys
from pathlib import Path
from typing import Any

import pytest
from celery import Celery
from click.testing import CliRunner

from sagaworker import FlowContext, Reversibility, Sagaworker, Settings
from sagaworker._base.canonical import canonical_args
from sagaworker.cli.commands import main
from sagaworker.web.auth import AuthConfigError, WebAuth, hash_token
from tasks.web import create_app

from .journal import ALICE_TOKEN, SECRET, bearer, operators

CARD = "4111111111111111"
#: a model turn as the OpenAI Agents adapter journals it (``_openai_durable._dump``): the
#: SDK keeps a tool call's arguments as a JSON string
OPENAI_TURN: dict[str, Any] = {
    "model_name": "openai-agents",
    "parts": [{"part_kind": "tool-call", "tool_name": "charge"}],
    "usage": {"input_tokens": 12, "output_tokens": 7},
    "response": {"output": [{
        "type": "function_call", "name": "charge", "call_id": "call_1", "id": "fc_1",
        "arguments": json.dumps({"card": CARD, "amount_cents": 3000})}],
        "usage": {"input_tokens": 12, "output_tokens": 7}, "response_id": "resp_1"}}
#: how every reader is shown that turn: its model, tokens and the tools it asked for
SHOWN_TURN = {"model": "openai-agents", "input_tokens": 12, "output_tokens": 7,
              "asks": ["charge"]}
LIMIT = 1024 * 1024  # SAGAWORKER_MAX_RESULT_BYTES' default
BIG = "x" * LIMIT  # as JSON: LIMIT + 2 bytes (its quotes)


async def refused_call(s: FlowContext, answer: dict[str, Any], text: int = 0) -> str:
    """A durable agent run whose model asked for ``charge`` with a card, and whose call
    was refused (no step holds the card: nothing to scrub it with). ``text``: the model
    also answered that many characters."""
    async def ask() -> dict[str, Any]:
        return {**answer, "text": "y" * text} if text else answer

    await s.unit("agent__model.request", ask)
    return "refused"


def big_result(s: FlowContext) -> str:
    """A tool whose result is over the limit."""
    s.call(f"{__name__}.fetch_report", "r-1")
    return "never"


def big_return(s: FlowContext) -> str:
    """A flow whose own return value is over the limit."""
    return BIG


def make_app(db: Path, **settings: Any) -> Sagaworker:
    """An eager Sagaworker (steps run inline) that redacts ``card``."""
    app = Celery("anon", broker="memory://")
    app.conf.task_always_eager = True
    given: dict[str, Any] = {"approval_secret": SECRET, "redact": "card",
                             "sweep_interval": 0, "compensation_retries": 0,
                             "compensation_backoff": 0, **settings}
    sw = Sagaworker(app, database_url=f"sqlite:///{db}", settings=Settings(**given))

    @sw.tool()
    def fetch_report(report_id: str) -> str:
        return BIG

    @sw.tool(reversibility=Reversibility.IRREVERSIBLE)
    def pay_out(card: str, amount_cents: int) -> str:
        return "paid"

    for flow in (refused_call, big_result, big_return):
        sw.flow()(flow)
    sw.validate()
    return sw


def reader(sw: Sagaworker) -> Any:
    """The anonymous client of an app whose operators chose to let anyone read."""
    return create_app(sw, auth=operators()).test_client()

#: a journal that cannot be reached, its password in each form a URL may carry it
DOWN = ("postgresql+psycopg://shop:hun@ter2-x@127.0.0.1:1/shop?password=hunter2-q"
        "&sslpassword=key-pass-9")


def test_a_journal_that_cannot_be_reached_is_unavailable_not_its_url(
        caplog: pytest.LogCaptureFixture) -> None:
    """Every read answers 503 "journal unavailable": the URL (and any form of its
    password) is logged masked on the server, never sent to the client."""
    sw = Sagaworker(Celery("down", broker="memory://"), database_url=DOWN,
                    settings=Settings(approval_secret=SECRET))
    client = create_app(sw, auth=operators()).test_client()
    caplog.set_level(logging.WARNING)
    for path in ("/sagas", "/sagas/order-1", "/approvals", "/", "/ui/sagas/order-1"):
        resp = client.get(path)
        body = resp.get_data(as_text=True)
        assert resp.status_code == 503, (path, body)
        for secret in ("hun", "ter2", "hunter2-q", "key-pass-9", "127.0.0.1", "shop:"):
            assert secret not in body, (path, secret)
        if path == "/" or path.startswith("/ui/"):  # a page says it in HTML
            assert "journal unavailable" in body
        else:
            assert resp.get_json() == {"error": "journal unavailable", "status": 503}
    logged = [r.getMessage() for r in caplog.records if "cannot reach" in r.getMessage()]
    assert len(logged) == 5
    assert all("postgresql+psycopg://shop:***@127.0.0.1:1/shop?password=***&sslpassword=***"
               in m for m in logged)
    assert not [m for m in logged if "hunter2" in m or "key-pass" in m or "ter2-x" in m]


@pytest.mark.parametrize("answer", [
    OPENAI_TURN,
    # Pydantic AI's own part keeps a tool call's arguments as a JSON string too
    {"model_name": "gpt-4o", "usage": {"input_tokens": 12, "output_tokens": 7},
     "parts": [{"part_kind": "tool-call", "tool_name": "charge", "tool_call_id": "c1",
                "args": json.dumps({"card": CARD, "amount_cents": 3000})}]},
], ids=["openai-agents", "pydantic-ai"])
def test_a_model_turn_is_served_in_its_display_form(tmp_path: Path, answer: dict[str, Any],
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """GET /sagas, /sagas/<id> and ``show --json`` serve a model turn as the dashboard
    shows it (model, tokens, tools asked), never its whole response: a card in a refused
    tool call's string arguments was served in clear."""
    sw = make_app(tmp_path / "j.db")
    sw.start("agent-1", refused_call, answer)
    client = reader(sw)
    one = client.get("/sagas/agent-1")
    listed = client.get("/sagas")
    shown = {**SHOWN_TURN, "model": answer["model_name"]}
    assert one.get_json()["entries"][0]["result"] == shown
    assert one.get_json()["entries"][0]["model_turn"] == shown
    assert listed.get_json()["sagas"][0]["entries"][0]["result"] == shown
    (tmp_path / "anonapp.py").write_text(
        "from pathlib import Path\n"
        "from tests.web.test_anonymous_reader import make_app\n"
        f"sw = make_app(Path({str(tmp_path / 'j.db')!r}))\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "anonapp", raising=False)
    cli = CliRunner().invoke(main, ["-A", "anonapp", "show", "--json", "agent-1"])
    listed_cli = CliRunner().invoke(main, ["-A", "anonapp", "list", "--json"])
    assert cli.exit_code == 0 and listed_cli.exit_code == 0, cli.output + listed_cli.output
    assert json.loads(cli.output)["entries"][0]["result"] == shown
    assert json.loads(listed_cli.output)[0]["entries"][0]["result"] == shown
    for text in (one.get_data(as_text=True), listed.get_data(as_text=True), cli.output,
                 listed_cli.output):
        assert CARD not in text


def test_a_tool_result_over_the_limit_is_executed_with_an_error(tmp_path: Path) -> None:
    """The tool ran (its effect happened): EXECUTED, no result journaled, the error saying
    why; the saga fails and compensates. Nothing the size of the result is served."""
    sw = make_app(tmp_path / "j.db")
    sw.start("big-1", big_result)
    resp = reader(sw).get("/sagas/big-1")
    rec = resp.get_json()
    error = (f"result is {LIMIT + 2} bytes, over the {LIMIT}-byte limit "
             "(SAGAWORKER_MAX_RESULT_BYTES); return a reference (an id, a URL) instead of "
             "the data")
    assert [(e["phase"], e["result"], e["error"]) for e in rec["entries"]] == [
        ("EXECUTED", None, error)]
    assert rec["status"] == "COMPENSATED"
    assert rec["reason"] == f"step 1 ({__name__}.fetch_report) failed: {error}"
    assert len(resp.get_data()) < 10_000


def test_a_model_response_over_the_limit_is_executed_with_an_error(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A durable unit's value (a model's answer) keeps SAGAWORKER_MAX_RESULT_BYTES, read
    from the environment like every setting: the 30 MB answer was journaled and served."""
    monkeypatch.setenv("SAGAWORKER_MAX_RESULT_BYTES", "4096")
    sw = make_app(tmp_path / "j.db")
    sw.start("big-2", refused_call, OPENAI_TURN, 5000)
    resp = reader(sw).get("/sagas/big-2")
    rec = resp.get_json()
    size = len(json.dumps({**OPENAI_TURN, "text": "y" * 5000}, separators=(",", ":")))
    error = (f"result is {size} bytes, over the 4096-byte limit "
             "(SAGAWORKER_MAX_RESULT_BYTES); return a reference (an id, a URL) instead of "
             "the data")
    assert [(e["phase"], e["result"], e["error"]) for e in rec["entries"]] == [
        ("EXECUTED", None, error)]
    assert rec["status"] == "COMPENSATED"
    assert "y" * 100 not in resp.get_data(as_text=True)


def test_a_flow_return_value_over_the_limit_fails_the_saga(tmp_path: Path) -> None:
    """The flow's return value is not journaled: the saga fails, saying why and what to
    return instead."""
    sw = make_app(tmp_path / "j.db")
    sw.start("big-3", big_return)
    resp = reader(sw).get("/sagas/big-3")
    rec = resp.get_json()
    assert rec["status"] == "COMPENSATED"
    assert sw.journal.saga_and_entries("big-3")[0].result is None
    assert rec["reason"] == (
        f"the return value of flow '{__name__}.big_return' is {LIMIT + 2} bytes, over the "
        f"{LIMIT}-byte limit (SAGAWORKER_MAX_RESULT_BYTES); return a reference (an id, a "
        "URL) instead of the data; nothing was journaled")
    assert len(resp.get_data()) < 10_000


def _mark(card: str, key: bytes) -> str:
    digest = hmac.new(key, b"redacted|" + canonical_args([card], {}).encode(),
                      hashlib.sha256).hexdigest()[:8]
    return f"[REDACTED …{card[-4:]} #{digest}]"


def test_an_approvers_fingerprint_is_for_operators_only(tmp_path: Path) -> None:
    """An anonymous reader sees a gated step's redacted card as ``[REDACTED]``: no last
    characters, no mark to link two sagas by, no HMAC to try approval secrets against.
    An operator sees the mark, keyed with a key derived from the secret (HMAC of a fixed
    label), never with the secret that signs approvals."""
    sw = make_app(tmp_path / "j.db")
    sw.begin("gate-1").enqueue(f"{__name__}.pay_out", CARD, 3000)
    client = reader(sw)
    anonymous = client.get("/approvals").get_json()["approvals"]
    assert [(a["args"], a["token"]) for a in anonymous] == [(["[REDACTED]", 3000], None)]
    page = client.get("/").get_data(as_text=True)
    assert "&#34;[REDACTED]&#34;, 3000" in page and CARD[-4:] not in page
    assert "[REDACTED …" not in page and "[REDACTED #" not in page
    derived = hmac.new(SECRET.encode(), b"sagaworker redacted-value fingerprint",
                       hashlib.sha256).digest()
    signed = client.get("/approvals", headers=bearer(ALICE_TOKEN)).get_json()["approvals"]
    assert signed[0]["args"] == [_mark(CARD, derived), 3000]
    assert signed[0]["args"][0] != _mark(CARD, SECRET.encode())


def test_a_low_entropy_approval_secret_is_warned_of_at_start(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A secret of 32 bytes or more that repeats itself is still guessable (and each
    fingerprint an operator reads is something to try guesses against): said at start."""
    caplog.set_level(logging.WARNING)
    weak = "approval" * 4
    sw = make_app(tmp_path / "j.db", approval_secret=weak)
    create_app(sw, auth=operators())
    assert [r.getMessage() for r in caplog.records if "entropy" in r.getMessage()] == [
        "SAGAWORKER_APPROVAL_SECRET looks guessable: its characters carry about 80 bits "
        "of entropy, under 128; replace it with a random one, the same value everywhere. "
        'Make one with: python -c "import secrets; print(secrets.token_urlsafe(32))"']
    assert weak not in caplog.text


# -- who may read: an operator's explicit choice ---------------------------------------------

CAROL_TOKEN = "swop_carol-viewer-web-tests-0123456789abcdefghijk"
READS_CLOSED = ("reading the journal needs an identity: send Authorization: Bearer <viewer or "
                "operator token>; anonymous reads are off (set "
                "SAGAWORKER_WEB_ANONYMOUS_READS=true to let anyone who reaches this app read "
                "it)")


def _named_readers() -> WebAuth:
    """alice decides, carol only reads; anonymous reads left at their default."""
    return WebAuth(tokens=[("alice", hash_token(ALICE_TOKEN))],
                   viewers=[("carol", hash_token(CAROL_TOKEN))])


def test_the_journal_is_read_only_by_those_the_operator_named(tmp_path: Path) -> None:
    """By default an anonymous client reads nothing (401, saying how to authenticate and
    which setting opens reads to anyone); a viewer's token reads, never decides; an
    operator's reads and decides."""
    sw = make_app(tmp_path / "j.db")
    sw.begin("gate-1").enqueue(f"{__name__}.pay_out", CARD, 3000)
    client = create_app(sw, auth=_named_readers()).test_client()
    for path in ("/sagas", "/sagas/gate-1", "/approvals", "/sagas?idle=1"):
        resp = client.get(path)
        assert (resp.status_code, resp.get_json()) == (
            401, {"error": READS_CLOSED, "status": 401}), path
        assert resp.headers["WWW-Authenticate"] == 'Bearer realm="sagaworker"'
    for path in ("/", "/ui/sagas/gate-1"):
        page = client.get(path)
        html = page.get_data(as_text=True)
        assert page.status_code == 401 and "gate-1" not in html and "pay_out" not in html
        assert 'id="signin"' in html and "SAGAWORKER_WEB_ANONYMOUS_READS" in html
    assert client.get("/healthz").status_code == 200
    assert client.get("/auth").get_json() == {
        "read_only": False, "methods": ["token"], "operator": None, "via": None,
        "reader": None, "role": None, "anonymous_reads": False}
    wrong = client.get("/sagas", headers=bearer("swop_nobody"))
    assert wrong.status_code == 401
    assert wrong.get_json()["error"].startswith(
        "the bearer token is not a valid viewer or operator token")
    carol = bearer(CAROL_TOKEN)
    assert client.get("/sagas/gate-1", headers=carol).status_code == 200
    assert client.get("/auth", headers=carol).get_json()["reader"] == "carol"
    gates = client.get("/approvals", headers=carol).get_json()["approvals"]
    assert [(g["args"], g["token"]) for g in gates] == [(["[REDACTED]", 3000], None)]
    refused = client.post("/approvals/approve", json={"saga_id": "gate-1", "seq": 1},
                          headers=carol)
    assert (refused.status_code, refused.get_json()) == (403, {
        "error": "carol's token is a viewer's: it reads the journal and decides nothing; "
                 "an operator decides (SAGAWORKER_WEB_TOKENS)"})
    assert sw.inspect("gate-1").entries[0].phase.value == "AWAITING_APPROVAL"
    assert client.get("/sagas", headers=bearer(ALICE_TOKEN)).status_code == 200


def test_a_browser_reads_with_a_sign_in_cookie_that_never_decides(tmp_path: Path) -> None:
    """The dashboard's pages are loaded by the browser itself: signing in once sets an
    HttpOnly, SameSite=Strict cookie that authenticates reads only. A decision still
    needs the token in the Authorization header (no other site can make a browser send
    it), so the cookie cannot be used to decide; signing out clears it."""
    sw = make_app(tmp_path / "j.db")
    sw.begin("gate-1").enqueue(f"{__name__}.pay_out", CARD, 3000)
    app = create_app(sw, auth=_named_readers())
    viewer, operator = app.test_client(), app.test_client()
    assert viewer.post("/auth/session", json={"token": "swop_nobody"}).status_code == 401
    assert viewer.post("/auth/session", data={"token": CAROL_TOKEN}).status_code == 422
    assert viewer.get_cookie("sagaworker_reader") is None
    signed = viewer.post("/auth/session", json={"token": CAROL_TOKEN})
    assert (signed.status_code, signed.get_json()) == (200, {"reader": "carol",
                                                             "role": "viewer"})
    assert signed.headers["Set-Cookie"] == (
        f"sagaworker_reader={CAROL_TOKEN}; HttpOnly; Path=/; SameSite=Strict")
    page = viewer.get("/").get_data(as_text=True)
    assert "gate-1" in page and 'id="reader-name">carol<' in page
    assert viewer.get("/sagas/gate-1").status_code == 200
    assert operator.post("/auth/session", json={"token": ALICE_TOKEN}).status_code == 200
    assert operator.get("/approvals").get_json()["approvals"][0]["token"] is None
    decided = operator.post("/approvals/approve", json={"saga_id": "gate-1", "seq": 1})
    assert decided.status_code == 401
    assert sw.inspect("gate-1").entries[0].phase.value == "AWAITING_APPROVAL"
    out = viewer.delete("/auth/session")
    assert out.status_code == 204 and viewer.get_cookie("sagaworker_reader") is None
    assert viewer.get("/sagas").status_code == 401


def test_anonymous_reads_are_an_explicit_setting_said_at_start(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    """SAGAWORKER_WEB_ANONYMOUS_READS=true opens reads to anyone, and the app says so
    when it starts; left unset, it says reads need an identity; a value that is not true
    or false stops the app at start; viewer tokens come from the environment too."""
    caplog.set_level(logging.INFO)
    sw = make_app(tmp_path / "j.db")
    monkeypatch.setenv("SAGAWORKER_WEB_TOKENS", f"alice:{hash_token(ALICE_TOKEN)}")
    monkeypatch.setenv("SAGAWORKER_WEB_VIEWER_TOKENS", f"carol:{hash_token(CAROL_TOKEN)}")
    monkeypatch.setenv("SAGAWORKER_WEB_ANONYMOUS_READS", "true")
    opened = create_app(sw).test_client()
    assert opened.get("/sagas").status_code == 200
    monkeypatch.delenv("SAGAWORKER_WEB_ANONYMOUS_READS")
    closed = create_app(sw).test_client()
    assert closed.get("/sagas").status_code == 401
    assert closed.get("/sagas", headers=bearer(CAROL_TOKEN)).status_code == 200
    said = [r.getMessage() for r in caplog.records if "reads" in r.getMessage()]
    assert said == [
        "anonymous reads: anyone who reaches this app reads the journal "
        "(SAGAWORKER_WEB_ANONYMOUS_READS=true)",
        "reads need a viewer or operator token: anonymous reads are off "
        "(SAGAWORKER_WEB_ANONYMOUS_READS)"]
    monkeypatch.setenv("SAGAWORKER_WEB_ANONYMOUS_READS", "maybe")
    with pytest.raises(AuthConfigError, match=r"^SAGAWORKER_WEB_ANONYMOUS_READS='maybe' is "
                                              r"neither true nor false"):
        create_app(sw)


def test_an_app_nobody_may_read_says_what_to_configure(tmp_path: Path) -> None:
    """Nothing configured: no reader at all, and the 401 names every way to open it."""
    sw = make_app(tmp_path / "j.db")
    resp = create_app(sw, auth=WebAuth()).test_client().get("/sagas")
    assert (resp.status_code, resp.get_json()["error"]) == (401, (
        "this app lets nobody read the journal: configure viewer tokens "
        "(SAGAWORKER_WEB_VIEWER_TOKENS), operator tokens (SAGAWORKER_WEB_TOKENS) or an "
        "authenticating proxy's header (SAGAWORKER_WEB_TRUSTED_HEADER), or set "
        "SAGAWORKER_WEB_ANONYMOUS_READS=true to let anyone who reaches this app read it "
        "(docs/web-auth.md)"))
