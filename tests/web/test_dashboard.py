"""The server-rendered dashboard: list, filters, attention panel, saga timeline."""

from __future__ import annotations

import html as htmllib
import re
from urllib.parse import urljoin, urlsplit

import pytest
from flask.testing import FlaskClient

from sagaworker import SagaStatus, Sagaworker

from .journal import Tools, audit_rows, awaiting_approval, compensated, completed, running


def _html(client: FlaskClient, url: str, status: int = 200) -> str:
    resp = client.get(url)
    assert resp.status_code == status, resp.get_data(as_text=True)[:500]
    assert resp.mimetype == "text/html"
    return resp.get_data(as_text=True)


def _section(html: str, start: str, end: str) -> str:
    i = html.index(start)
    return html[i:html.index(end, i)]


def test_index_lists_sagas_newest_first(client: FlaskClient, sw: Sagaworker,
                                        tools: Tools) -> None:
    """The saga table lists every saga, newest first, with its status badge."""
    completed(sw, tools, "order-first")
    compensated(sw, tools, "order-second")
    running(sw, tools, "order-third")
    table = _section(_html(client, "/"), 'id="sagas"', "</table>")
    assert re.findall(r"<b>(order-[a-z]+)</b>", table) == [
        "order-third", "order-second", "order-first"]
    assert "badge st-completed" in table and "badge st-compensated" in table
    assert "badge st-running" in table


def test_status_filter_links_and_filtering(client: FlaskClient, sw: Sagaworker,
                                           tools: Tools) -> None:
    """Each status has a filter link; ?status= shows only that status and marks the link."""
    completed(sw, tools, "order-ok")
    compensated(sw, tools, "order-undone")
    html = _html(client, "/")
    for s in ("RUNNING", "AWAITING_APPROVAL", "COMPLETED", "COMPENSATING", "COMPENSATED",
              "COMPENSATION_FAILED"):
        assert f'href="/?status={s}"' in html
    table = _section(_html(client, "/?status=COMPLETED"), 'id="sagas"', "</table>")
    assert "order-ok" in table and "order-undone" not in table
    assert 'href="/?status=COMPLETED" class="on"' in _html(client, "/?status=COMPLETED")
    assert "Unknown status" in _html(client, "/?status=BOGUS", 400).replace("unknown", "Unknown")


def test_dirty_and_in_doubt_sagas_are_highlighted_at_the_top(client: FlaskClient,
                                                             sw: Sagaworker,
                                                             tools: Tools) -> None:
    """COMPENSATION_FAILED and in-doubt sagas appear in the attention panel, before the
    table, with the failed undo, its error and the re-drive command."""
    compensated(sw, tools, "order-dirty", card="stuck-77")
    compensated(sw, tools, "order-doubt", in_doubt=True)
    compensated(sw, tools, "order-clean")
    completed(sw, tools, "order-ok")
    html = _html(client, "/?status=COMPLETED")  # shown whatever the filter
    top = _section(html, "Needs attention", 'id="sagas"')
    assert 'data-kind="dirty"' in top and 'data-kind="in-doubt"' in top
    assert "order-dirty" in top and "order-doubt" in top
    assert "order-clean" not in top and "order-ok" not in top
    assert "undo of #3 charge failed" in top
    assert "payment API timed out (HTTP 504)" in top
    assert "sagaworker retry-compensation order-dirty" in top
    assert "#3 charge in doubt" in top
    assert html.index("order-dirty") < html.index('id="sagas"')


def test_all_clear_when_nothing_is_dirty(client: FlaskClient, sw: Sagaworker,
                                         tools: Tools) -> None:
    """With no dirty or in-doubt saga the panel says all clear."""
    completed(sw, tools, "order-ok")
    assert "No dirty or in-doubt sagas" in _html(client, "/")


def test_pending_approvals_on_the_index(client: FlaskClient, sw: Sagaworker,
                                        tools: Tools) -> None:
    """Steps waiting at the approval gate are listed on the index."""
    awaiting_approval(sw, tools, "order-gated")
    html = _html(client, "/")
    block = _section(html, "Waiting for approval (1)", "</table>")
    assert "order-gated" in block and "#2 dispatch" in block


def test_saga_timeline_forward_then_undos_in_run_order(client: FlaskClient, sw: Sagaworker,
                                                       tools: Tools) -> None:
    """The saga page lists forward steps in seq order, then undos in the order they ran,
    each coloured by phase or outcome, with errors and details."""
    compensated(sw, tools, "order-dirty", card="stuck-77")
    html = _html(client, "/ui/sagas/order-dirty")
    assert 'id="status">COMPENSATION_FAILED' in html
    assert 'id="dirty"' in html
    forward = _section(html, 'id="forward"', 'id="undos"')
    assert re.findall(r'<li class="k-([a-z-]+)[^"]*" data-seq="(\d+)"', forward) == [
        ("executed", "1"), ("executed", "2"), ("executed", "3"), ("failed", "4")]
    assert "OutOfStock: sku-8: cannot hold 1" in forward
    undos = html[html.index('id="undos"'):]
    assert re.findall(r'<li class="k-([a-z-]+)[^"]*" data-seq="(\d+)"', undos) == [
        ("compensation-failed", "3"), ("skipped", "2"), ("compensated", "1")]
    assert "ConnectionError: payment API timed out" in undos
    assert "no undo declared" in undos


def test_saga_page_shows_approvals_who_and_when(client: FlaskClient, sw: Sagaworker,
                                                tools: Tools) -> None:
    """An approved or rejected gate shows who decided and when."""
    awaiting_approval(sw, tools, "order-a")
    awaiting_approval(sw, tools, "order-r")
    for p in sw.pending_approvals():
        if p.saga_id == "order-a":
            sw.approve(p.token, approver="alice")
        else:
            sw.reject(p.token, approver="bob", reason="fraud check")
    a = _html(client, "/ui/sagas/order-a")
    assert "by <b>alice</b> at 20" in a and "UTC" in a
    r = _html(client, "/ui/sagas/order-r")
    assert "by <b>bob</b> at 20" in r and "fraud check" in r
    waiting = sw.inspect("order-r")
    assert waiting.entries[1].phase.value == "REJECTED"


def test_in_doubt_saga_page_warns(client: FlaskClient, sw: Sagaworker, tools: Tools) -> None:
    """An in-doubt step is flagged on its saga page with a check-by-hand banner."""
    compensated(sw, tools, "order-doubt", in_doubt=True)
    html = _html(client, "/ui/sagas/order-doubt")
    assert 'id="doubt"' in html and "IN DOUBT" in html and "check it by hand" in html


def test_unknown_saga_page_is_404_html(client: FlaskClient) -> None:
    """An unknown saga id on the dashboard is an HTML 404 page."""
    assert "order-missing" in _html(client, "/ui/sagas/order-missing", 404)


def test_user_text_is_escaped(client: FlaskClient, sw: Sagaworker, tools: Tools) -> None:
    """Saga ids, metadata and errors are HTML-escaped."""
    sw.begin("order-<b>x</b>", metadata={"note": "<script>alert(1)</script>"})
    html = _html(client, "/ui/sagas/order-<b>x</b>")
    assert "<script>alert(1)" not in html and "&lt;script&gt;" in html
    assert "order-&lt;b&gt;x&lt;/b&gt;" in _html(client, "/")


#: saga ids that, put in a URL as they are, would lead a browser to another saga or page
ODD_IDS = ["x/../../sagas/victim", "../victim", "victim/..", "victim?x=1#y", "a%2Fb%3F",
           "/victim", "victim/", "a//b", "sp ace ü"]


def _follow(page: str, href: str) -> str:
    """Where a browser on ``page`` goes for ``href``: dot segments removed, no fragment."""
    parts = urlsplit(urljoin("http://dashboard" + page, htmllib.unescape(href)))
    return parts.path + (f"?{parts.query}" if parts.query else "")


def _url_of(page_html: str, action: str) -> str:
    found = re.findall(rf'data-action="{action}"\s+data-url="([^"]*)"', page_html)
    assert len(found) == 1, found
    return str(found[0])


@pytest.mark.parametrize("odd", ODD_IDS)
def test_a_saga_id_is_one_path_segment_in_every_url(alice: FlaskClient, sw: Sagaworker,
                                                    tools: Tools, odd: str) -> None:
    """Links and the Abort/Re-drive buttons carry the saga id percent-encoded as one path
    segment: followed as a browser does, they reach that saga's page and act on that
    saga, never on another one (``victim``) whose name the id spells out."""
    running(sw, tools, "victim")
    running(sw, tools, odd)
    compensated(sw, tools, "dirty-victim", card="stuck-1")
    compensated(sw, tools, odd + "-dirty", card="stuck-2")
    index = _html(alice, "/")
    pages = {}
    for saga_id in (odd, odd + "-dirty"):
        href = re.search(r'<a href="([^"]*)"><b>' + re.escape(htmllib.escape(saga_id))
                         + "</b></a>", index)
        assert href is not None, saga_id
        pages[saga_id] = _follow("/", href.group(1))
        assert f"<h1>{htmllib.escape(saga_id)} " in _html(alice, pages[saga_id])
    abort_url = _follow(pages[odd], _url_of(_html(alice, pages[odd]), "abort"))
    resp = alice.post(abort_url, json={"reason": "stop"})
    assert resp.status_code == 202, resp.get_data(as_text=True)
    assert resp.get_json()["saga_id"] == odd
    assert audit_rows(sw, odd) == [("abort", "alice", "stop")]
    assert sw.inspect("victim").status is SagaStatus.RUNNING and not audit_rows(sw, "victim")
    dirty = pages[odd + "-dirty"]
    resp = alice.post(_follow(dirty, _url_of(_html(alice, dirty), "redrive")), json={})
    assert resp.status_code == 202, resp.get_data(as_text=True)
    assert [a[:2] for a in audit_rows(sw, odd + "-dirty")] == [("retry_compensation", "alice")]
    assert not audit_rows(sw, "dirty-victim")


def _idle(sw: Sagaworker, tools: Tools, saga_id: str) -> None:
    """An asynchronous saga whose producer went away after one step: nothing written for
    two hours, then the sweeper's pass reports it (saga_idle)."""
    from datetime import timedelta

    from sqlalchemy import update

    from sagaworker._journal.repository import now
    from sagaworker._journal.schema import entries, sagas

    from .journal import run_step

    sw.begin(saga_id).enqueue(tools.reserve, "sku-1", 1)
    run_step(sw, saga_id, 1, "hold-1")
    old = now() - timedelta(hours=2)
    with sw.journal.engine.begin() as conn:
        conn.execute(update(sagas).where(sagas.c.saga_id == saga_id).values(updated_at=old))
        conn.execute(update(entries).where(entries.c.saga_id == saga_id)
                     .values(updated_at=old))
    assert sw.sweeper.sweep()["idle"] == 1


def test_idle_sagas_are_pinned_with_the_abort_command(client: FlaskClient, sw: Sagaworker,
                                                      tools: Tools) -> None:
    """A RUNNING asynchronous saga the sweeper reported idle is pinned at the top of the
    dashboard with the command that aborts it, and listed by GET /sagas?idle=1; a saga
    that is merely running is not, and one written to since the report drops out."""
    running(sw, tools, "order-busy")
    _idle(sw, tools, "order-idle")
    html = _html(client, "/")
    pinned = _section(html, "Needs attention", 'id="sagas"')
    assert 'data-kind="idle" data-saga="order-idle"' in pinned
    assert "sagaworker abort order-idle --reason" in pinned
    assert "order-busy" not in pinned and "No dirty" not in pinned
    assert html.index('data-saga="order-idle"') < html.index('id="sagas"')
    assert [s["saga_id"] for s in client.get("/sagas?idle=1").get_json()["sagas"]] == [
        "order-idle"]
    assert client.get("/sagas?idle=maybe").status_code == 422
    sw.get("order-idle").enqueue(tools.quote, "10115")  # its producer came back
    assert 'data-kind="idle"' not in _html(client, "/")
    assert client.get("/sagas?idle=true").get_json()["sagas"] == []


def test_flow_saga_page_shows_the_flow_and_where_it_waits(client: FlaskClient,
                                                          sw: Sagaworker) -> None:
    """A flow saga's page and JSON give the flow's name, its arguments (redacted by name),
    the step it waits on and its deadline."""
    from .journal import order_flow

    sw.settings = sw.settings.model_copy(update={"redact": "card"})
    sw.start("order-f1", order_flow, "f1", "sku-5", 3, "card-0000-1111", 2500, deadline=600)
    sw.flows.advance("order-f1")  # a worker's replay: the first step is journaled
    page = _html(client, "/ui/sagas/order-f1")
    assert "card-0000-1111" not in page
    flow = _section(page, 'id="flow"', "</div>")
    assert "tests.web.journal.order_flow" in flow
    assert "&#34;f1&#34;, &#34;sku-5&#34;, 3, &#34;[REDACTED]&#34;, 2500" in flow
    waiting = _section(page, 'id="waiting"', "</div>")
    assert "#1 reserve" in waiting and "ph-intent" in waiting
    assert "deadline" in _section(page, 'id="deadline"', "</div>")
    d = client.get("/sagas/order-f1").get_json()
    assert d["flow"] == "tests.web.journal.order_flow" and d["deadline_at"]
    assert d["flow_args"] == ["f1", "sku-5", 3, "[REDACTED]", 2500]
    assert d["waiting_on"] == {"seq": 1, "tool_name": "tests.web.journal.reserve",
                               "phase": "INTENT"}
    assert "card-0000-1111" not in client.get("/sagas").get_data(as_text=True)


def _buttons(html: str) -> list[tuple[str, str, bool]]:
    """The operators' buttons: (action, saga, hidden)."""
    return [(a, s, "hidden" in rest) for a, s, rest in re.findall(
        r'<button type="button" class="op [^"]*" data-action="(\w+)"\s+data-url="[^"]*" '
        r'data-saga="([^"]*)"([^>]*)>', html)]


def test_read_only_dashboard_says_so_and_has_no_buttons(sw: Sagaworker, tools: Tools) -> None:
    """With no operator authentication configured the dashboard shows the read-only banner
    (how to configure it) and renders no action button, dialog or script."""
    from sagaworker.web import WebAuth, create_app

    awaiting_approval(sw, tools, "order-gated")
    compensated(sw, tools, "order-dirty", card="stuck-1")
    client = create_app(sw, auth=WebAuth(anonymous_reads=True)).test_client()
    for url in ("/", "/ui/sagas/order-gated", "/ui/sagas/order-dirty"):
        html = _html(client, url)
        banner = _section(html, 'id="read-only"', "</div>")
        assert "Read-only." in banner and "SAGAWORKER_WEB_TOKENS" in banner
        assert "SAGAWORKER_WEB_TRUSTED_HEADER" in banner
        assert "data-action" not in html and "<dialog" not in html
        assert "dashboard.js" not in html and 'id="signin"' not in html
    assert '<meta http-equiv="refresh" content="30">' in _html(client, "/")


def test_operator_dashboard_hides_buttons_until_signed_in(client: FlaskClient,
                                                          sw: Sagaworker, tools: Tools) -> None:
    """Where operators sign in with a token, the page has the sign-in form and the buttons
    (approve and reject per gate, re-drive per dirty saga, abort per open saga) hidden
    until the script knows the operator; no approval token is in the page."""
    awaiting_approval(sw, tools, "order-gated")
    compensated(sw, tools, "order-dirty", card="stuck-1")
    html = _html(client, "/")
    assert 'id="signin"' in html and 'id="read-only"' not in html and "<dialog" in html
    assert _buttons(html) == [("redrive", "order-dirty", True),
                              ("approve", "order-gated", True),
                              ("reject", "order-gated", True)]
    assert 'data-seq="2"' in html and 'data-step="dispatch"' in html
    token = sw.pending_approvals()[0].token
    assert token not in html
    assert 'http-equiv="refresh"' not in html and 'data-refresh="30"' in html
    gated = _html(client, "/ui/sagas/order-gated")
    assert _buttons(gated) == [("abort", "order-gated", True), ("approve", "order-gated", True),
                               ("reject", "order-gated", True)]
    assert 'data-url="/sagas/order-gated/abort"' in gated
    assert _buttons(_html(client, "/ui/sagas/order-dirty")) == [
        ("redrive", "order-dirty", True)]


def test_proxy_signed_in_operator_sees_the_buttons(sw: Sagaworker, tools: Tools) -> None:
    """Behind a proxy that sets the trusted header the page knows the operator: the buttons
    are shown and the operator named; without the header they stay hidden."""
    from sagaworker.web import WebAuth, create_app

    awaiting_approval(sw, tools, "order-gated")
    client = create_app(sw, auth=WebAuth(trusted_header="X-Forwarded-User",
                                         anonymous_reads=True)).test_client()
    resp = client.get("/", headers={"X-Forwarded-User": "carol"})
    html = resp.get_data(as_text=True)
    assert 'id="operator-name">carol</b>' in html and 'id="signin"' not in html
    assert _buttons(html) == [("approve", "order-gated", False),
                              ("reject", "order-gated", False)]
    anonymous = _html(client, "/")
    assert _buttons(anonymous) == [("approve", "order-gated", True),
                                   ("reject", "order-gated", True)]
    assert "come through the proxy that sets X-Forwarded-User" in anonymous


SECURITY_HEADERS = {"X-Frame-Options": "DENY", "X-Content-Type-Options": "nosniff",
                    "Referrer-Policy": "no-referrer"}


@pytest.mark.parametrize(("method", "url"), [
    ("GET", "/"), ("GET", "/ui/sagas/order-gated"), ("GET", "/ui/sagas/order-missing"),
    ("GET", "/static/dashboard.css"), ("GET", "/static/dashboard.js"), ("GET", "/sagas"),
    ("GET", "/sagas/order-missing"), ("GET", "/approvals"), ("GET", "/auth"),
    ("GET", "/healthz"), ("POST", "/orders"), ("POST", "/sagas/order-gated/abort"),
    ("DELETE", "/sagas"), ("GET", "/nowhere")])
def test_every_response_forbids_framing_and_foreign_content(
        client: FlaskClient, sw: Sagaworker, tools: Tools, method: str, url: str) -> None:
    """Pages, the API, static files and errors all say: no framing (clickjacking the
    operators' buttons), content from this origin only, no inline script, no sniffing,
    no referrer."""
    awaiting_approval(sw, tools, "order-gated")
    resp = client.open(url, method=method, json={} if method == "POST" else None)
    for name, value in SECURITY_HEADERS.items():
        assert resp.headers.get(name) == value, (name, resp.headers)
    csp = {d.split()[0]: d.split()[1:] for d in
           resp.headers["Content-Security-Policy"].split(";") if d.strip()}
    assert csp["default-src"] == ["'self'"] and csp["frame-ancestors"] == ["'none'"]
    for directive in ("script-src", "style-src"):
        assert csp.get(directive, ["'self'"]) == ["'self'"]  # nothing inline, no eval
    assert csp["object-src"] == ["'none'"] and csp["base-uri"] == ["'none'"]


def test_pages_need_nothing_inline(client: FlaskClient, sw: Sagaworker, tools: Tools) -> None:
    """Every page keeps to its policy: no inline script, event handler or style attribute
    (the look lives in dashboard.css, the behaviour in dashboard.js)."""
    awaiting_approval(sw, tools, "order-gated")
    compensated(sw, tools, "order-dirty", card="stuck-1")
    compensated(sw, tools, "order-doubt", in_doubt=True)
    _idle(sw, tools, "order-idle")
    for url in ("/", "/ui/sagas/order-gated", "/ui/sagas/order-dirty", "/ui/sagas/order-doubt",
                "/ui/sagas/order-idle"):
        html = _html(client, url)
        assert not re.search(r"\sstyle=", html), url
        assert not re.search(r"\son[a-z]+=", html), url
        assert re.findall(r"<script[^>]*>", html) == [
            '<script src="/static/dashboard.js">'], url
        assert "javascript:" not in html, url


#: characters that reorder or hide text (right-to-left override, isolates, marks,
#: zero-width characters, a terminal escape)
HIDDEN = ["\u202e", "\u202a", "\u202b", "\u202c", "\u202d", "\u2066", "\u2067", "\u2068",
          "\u2069", "\u200e", "\u200f", "\u200b", "\u200c", "\u200d", "\u2060", "\ufeff",
          "\x1b"]


def test_hidden_formatting_characters_are_shown_escaped(alice: FlaskClient, sw: Sagaworker,
                                                         tools: Tools) -> None:
    """An approver sees the real saga id and arguments: a right-to-left override, an
    isolate or a zero-width character in a journal value is shown as ``\\uXXXX`` on the
    index's approval table and the saga page. The buttons still decide that saga: the
    script sends the id it reads percent-encoded from ``data-saga-id``."""
    from urllib.parse import quote, unquote

    sid = "order-\u202e4321\u202c-\u200b\u2066x\u2069"
    saga = sw.begin(sid, metadata={"note\u200f": "IBAN \u202e0987\u202c \x1b[8mhidden"})
    saga.enqueue(tools.reserve, "sku-\u2067x\u2069", 1)
    saga.enqueue(tools.dispatch, "ship to \u202eevil\u202c\ufeff")
    index, page = _html(alice, "/"), _html(alice, f"/ui/sagas/{quote(sid, safe='')}")
    approvals = _section(index, "Waiting for approval", "</table>")
    for html in (approvals, page):
        for ch in HIDDEN:
            assert ch not in html, repr(ch)
        assert "order-\\u202e4321\\u202c-\\u200b\\u2066x\\u2069" in html
        assert "ship to \\u202eevil\\u202c\\ufeff" in html
    assert "IBAN \\u202e0987\\u202c \\u001b[8mhidden" in page and "note\\u200f" in page
    assert "sku-\\u2067x\\u2069" in page
    ids = re.findall(r'data-action="approve"[^>]*data-saga-id="([^"]*)"', approvals)
    assert ids == [quote(sid, safe="")]
    resp = alice.post("/approvals/approve", json={"saga_id": unquote(ids[0]), "seq": 2})
    assert resp.status_code == 200, resp.get_json()


def test_commands_to_copy_quote_the_saga_id(client: FlaskClient, sw: Sagaworker,
                                            tools: Tools) -> None:
    """The re-drive and abort commands a page offers to copy quote the id for the shell:
    pasted, an id like ``x; touch pwned`` is one argument, not a second command."""
    from urllib.parse import quote

    odd = "x; touch pwned"
    compensated(sw, tools, odd, card="stuck-1")
    _idle(sw, tools, odd + " $(id)")
    for url in ("/", f"/ui/sagas/{quote(odd, safe='')}"):
        text = htmllib.unescape(_html(client, url))
        assert "sagaworker retry-compensation 'x; touch pwned'" in text
        assert "sagaworker retry-compensation x;" not in text
    assert "sagaworker abort 'x; touch pwned $(id)' --reason" in htmllib.unescape(
        _html(client, "/"))


def test_the_dashboard_names_the_app_it_serves(client: FlaskClient, sw: Sagaworker) -> None:
    """The header and the page title name the Celery app (``Celery("t")``), not the
    example's orders."""
    page = _html(client, "/")
    assert f"{sw.app.main} on-call" in page and "orders on-call" not in page
    assert re.search(rf"<title>[^<]*sagas · {sw.app.main} · sagaworker</title>", page)


def test_a_diverged_flow_is_pinned_with_the_commands_that_resolve_it(
        client: FlaskClient, sw: Sagaworker) -> None:
    """A flow held on a divergence is pinned beside dirty and idle sagas with the resume
    and abort commands; its page says why it is held; its JSON carries ``diverged``."""
    from sqlalchemy import update

    from sagaworker._journal.schema import entries

    from .journal import order_flow

    sw.start("order-d1", order_flow, "d1", "sku-5", 3, "card-0000-1111", 2500)
    sw.flows.advance("order-d1")
    with sw.journal.engine.begin() as conn:  # the deployed code now asks for another step 1
        conn.execute(update(entries).where(entries.c.saga_id == "order-d1")
                     .values(args_digest="0" * 64))
    sw.flows.advance("order-d1")
    pinned = _section(_html(client, "/"), "Needs attention", 'id="sagas"')
    assert 'data-kind="diverged" data-saga="order-d1"' in pinned
    assert "sagaworker flows resume order-d1" in pinned
    assert "sagaworker abort order-d1 --reason" in pinned
    page = _html(client, "/ui/sagas/order-d1")
    assert 'id="diverged"' in page and "flow diverged at step 1" in page
    got = client.get("/sagas/order-d1").get_json()
    assert got["status"] == "RUNNING" and got["diverged"].startswith("flow diverged at step 1")


def test_a_held_flows_gate_is_offered_nowhere(alice: FlaskClient, sw: Sagaworker) -> None:
    """A flow held at its gate: no Approve on its page nor on the index, and an
    operator's approval by saga and step is refused (409), naming what resolves it."""
    from sqlalchemy import update

    from sagaworker._journal.schema import entries

    from .journal import order_flow, run_step

    sw.start("order-h1", order_flow, "h1", "sku-5", 3, "card-0000-1111", 2500)
    for seq in (1, 2, 3):
        sw.flows.advance("order-h1")
        run_step(sw, "order-h1", seq, seq)
    sw.flows.advance("order-h1")  # dispatch waits at its gate
    assert 'data-gate="order-h1#4"' in _html(alice, "/ui/sagas/order-h1")
    assert "Waiting for approval (1)" in _html(alice, "/")
    with sw.journal.engine.begin() as conn:  # the deployed code now asks for another step 1
        conn.execute(update(entries).where(entries.c.saga_id == "order-h1", entries.c.seq == 1)
                     .values(args_digest="0" * 64))
    sw.flows.advance("order-h1")
    page = _html(alice, "/ui/sagas/order-h1")
    assert 'id="diverged"' in page and "data-gate=" not in page
    assert "Waiting for approval" not in _html(alice, "/")
    resp = alice.post("/approvals/approve", json={"saga_id": "order-h1", "seq": 4})
    assert resp.status_code == 409
    assert "sagaworker flows resume order-h1" in resp.get_json()["error"]
    assert sw.inspect("order-h1").entries[3].phase.value == "AWAITING_APPROVAL"
