"""A real headless Chromium on the dashboard, served on 127.0.0.1: screenshots, and an
operator's clicks (sign in, approve, reject, abort, re-drive through the confirmation
dialog) checked in the journal."""

from __future__ import annotations

import os
import shutil
import struct
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from werkzeug.serving import make_server

from sagaworker import Phase, SagaStatus, Sagaworker
from sagaworker.web import WebAuth
from tasks.web import create_app

from .cdp import Browser
from .journal import (
    ALICE_TOKEN,
    Tools,
    audit_rows,
    awaiting_approval,
    compensated,
    completed,
    operators,
    order_flow,
    run_step,
    running,
)

CHROMIUM = Path("/usr/bin/chromium")
OUTPUT = Path(__file__).resolve().parents[1] / "output"
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--hide-scrollbars", "--window-size=1400,900"]


def _need_chromium() -> None:
    if CHROMIUM.exists():
        return
    if os.environ.get("CI") == "true":
        pytest.fail(f"{CHROMIUM} is missing; CI must install it (apt-get install -y chromium)")
    pytest.skip(f"{CHROMIUM} not installed (apt-get install -y chromium)")


def populate(sw: Sagaworker, tools: Tools) -> None:
    """One saga in every interesting state."""
    completed(sw, tools, "order-1001")
    compensated(sw, tools, "order-1002")
    running(sw, tools, "order-1003")
    awaiting_approval(sw, tools, "order-1004")
    compensated(sw, tools, "order-1005", in_doubt=True)
    compensated(sw, tools, "order-1006", card="stuck-4242")
    completed(sw, tools, "order-1007")


@contextmanager
def serve(sw: Sagaworker, auth: WebAuth) -> Iterator[str]:
    server = make_server("127.0.0.1", 0, create_app(sw, flow=order_flow, auth=auth),
                         threaded=True)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_port}"
    finally:
        server.shutdown()
        thread.join(10)


@pytest.fixture
def served(sw: Sagaworker, tools: Tools) -> Iterator[str]:
    """The read-only dashboard over a journal with one saga in every interesting state."""
    populate(sw, tools)
    with serve(sw, WebAuth(anonymous_reads=True)) as url:
        yield url


@pytest.fixture
def browser() -> Iterator[Browser]:
    _need_chromium()
    with Browser(CHROMIUM, flags=FLAGS) as b:
        yield b


def eventually(check: Callable[[], bool], what: str, timeout: float = 20) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


def screenshot(url: str, out: Path) -> Path:
    """Chromium's headless screenshot of ``url`` into ``out`` (a fresh profile each time)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    out.unlink(missing_ok=True)
    profile = tempfile.mkdtemp(prefix="chromium-profile-")
    try:
        proc = subprocess.run([str(CHROMIUM), *FLAGS, f"--user-data-dir={profile}",
                               f"--screenshot={out}", url],
                              capture_output=True, text=True, timeout=120, check=False)
    finally:
        shutil.rmtree(profile, ignore_errors=True)
    assert out.exists(), f"chromium wrote no screenshot (rc {proc.returncode}): {proc.stderr}"
    return out


def png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    width, height = struct.unpack(">II", data[16:24])
    return width, height


def test_dashboard_screenshot(served: str) -> None:
    """Chromium renders the dashboard to a non-trivial 1400x900 PNG."""
    _need_chromium()
    out = screenshot(f"{served}/", OUTPUT / "dashboard.png")
    assert png_size(out) == (1400, 900)
    # a blank or error page compresses to a few kB; the dashboard is far richer
    assert out.stat().st_size > 40_000, out.stat().st_size


def test_saga_timeline_screenshot(served: str) -> None:
    """Chromium renders a dirty saga's timeline page to a non-trivial PNG."""
    _need_chromium()
    out = screenshot(f"{served}/ui/sagas/order-1006", OUTPUT / "saga.png")
    assert png_size(out) == (1400, 900)
    assert out.stat().st_size > 40_000, out.stat().st_size


def test_read_only_page_has_no_buttons(served: str, browser: Browser) -> None:
    """Without operator authentication the page shows the read-only banner and no action
    button, sign-in or dialog at all."""
    for path in ("/", "/ui/sagas/order-1004", "/ui/sagas/order-1006"):
        browser.goto(served + path)
        assert browser.visible("#read-only") == 1
        assert "Read-only." in browser.js("document.getElementById('read-only').innerText")
        assert browser.js("document.querySelectorAll('button[data-action], dialog, "
                          "#signin').length") == 0


def test_operator_signs_in_and_approves(sw: Sagaworker, tools: Tools,
                                        browser: Browser) -> None:
    """An operator's page shows no action button until signed in; a wrong token is
    refused; with alice's token (kept in sessionStorage) approve on the gated order, then
    confirm in the dialog: the journal says approved by alice, and a reload stays signed
    in. Reject needs a reason in the dialog and is journaled as alice's with it."""
    populate(sw, tools)
    awaiting_approval(sw, tools, "order-1008")
    with serve(sw, operators()) as url:
        browser.goto(url + "/")
        assert browser.visible("#signin") == 1
        assert browser.visible("button.op") == 0
        browser.type("#op-token", "swop_wrong")
        browser.click("#signin-button")
        browser.wait("!document.getElementById('signin-error').hidden", "the sign-in error")
        assert "not a valid operator token" in browser.js(
            "document.getElementById('signin-error').textContent")
        assert browser.visible("button.op") == 0

        browser.type("#op-token", ALICE_TOKEN)
        browser.click("#signin-button")
        browser.wait("document.getElementById('operator-name').textContent === 'alice'",
                     "alice to be signed in")
        assert browser.visible("#signin") == 0
        assert browser.visible("button.op") == 5  # 2 gates x (approve, reject), 1 re-drive
        assert browser.js(f"sessionStorage.getItem('sagaworker.operatorToken') === "
                          f"'{ALICE_TOKEN}'")

        browser.click('td[data-gate="order-1004#2"] button.op-approve')
        browser.wait("document.getElementById('confirm').open", "the confirmation dialog")
        assert "Approve step #2 dispatch" in browser.js(
            "document.getElementById('confirm-title').textContent")
        assert sw.inspect("order-1004").entries[1].phase is Phase.AWAITING_APPROVAL
        browser.click("#confirm-ok")
        eventually(lambda: sw.inspect("order-1004").entries[1].approved_by == "alice",
                   "the journal to say approved by alice")
        browser.wait("document.getElementById('flash').textContent.includes("
                     "'Approved (order-1004) by alice')", "the confirmation message")

        # the page reloads itself; the token is still there, the decided gate gone
        browser.wait("document.querySelectorAll('td[data-gate]').length === 1 && "
                     "document.getElementById('operator-name').textContent === 'alice'",
                     "the reloaded page, still signed in")
        browser.click('td[data-gate="order-1008#2"] button.op-reject')
        browser.wait("document.getElementById('confirm').open", "the reject dialog")
        browser.click("#confirm-ok")  # no reason: refused in the dialog
        browser.wait("!document.getElementById('confirm-error').hidden", "the reason error")
        assert sw.inspect("order-1008").entries[1].phase is Phase.AWAITING_APPROVAL
        browser.type("#confirm-reason", "address is a PO box")
        browser.click("#confirm-ok")
        eventually(lambda: sw.inspect("order-1008").entries[1].phase is Phase.REJECTED,
                   "the rejection")
        e = sw.inspect("order-1008").entries[1]
        assert (e.rejected_by, e.rejection_reason) == ("alice", "address is a PO box")


def test_proxy_operator_aborts_and_redrives(sw: Sagaworker, tools: Tools,
                                            browser: Browser) -> None:
    """Behind a proxy that sets X-Forwarded-User (Chromium sends it here) the buttons show
    at once; a cancelled dialog changes nothing; abort with a reason and re-drive are
    journaled as the proxy's user."""
    populate(sw, tools)
    browser.headers({"X-Forwarded-User": "bob"})
    with serve(sw, WebAuth(trusted_header="X-Forwarded-User")) as url:
        browser.goto(url + "/ui/sagas/order-1003")
        assert browser.js("document.getElementById('operator-name').textContent") == "bob"
        browser.click("button.op-abort")
        browser.wait("document.getElementById('confirm').open", "the abort dialog")
        browser.click("#confirm-cancel")
        browser.wait("!document.getElementById('confirm').open", "the dialog to close")
        assert sw.inspect("order-1003").status is SagaStatus.RUNNING
        browser.click("button.op-abort")
        browser.wait("document.getElementById('confirm').open", "the abort dialog")
        browser.type("#confirm-reason", "customer cancelled by phone")
        browser.click("#confirm-ok")
        eventually(lambda: audit_rows(sw, "order-1003") == [
            ("abort", "bob", "customer cancelled by phone")], "the abort in the journal")

        browser.goto(url + "/")
        browser.click('.alarm button.op-redrive[data-saga="order-1006"]')
        browser.wait("document.getElementById('confirm').open", "the re-drive dialog")
        browser.click("#confirm-ok")
        eventually(lambda: [a[:2] for a in audit_rows(sw, "order-1006")] == [
            ("retry_compensation", "bob")], "the re-drive in the journal")
        assert sw.inspect("order-1006").status is SagaStatus.COMPENSATING


def test_a_browser_signs_in_to_read_when_anonymous_reads_are_off(
        sw: Sagaworker, tools: Tools, browser: Browser) -> None:
    """Anonymous reads off (the default): the page is a sign-in page showing no saga; a
    viewer's token opens the dashboard (a cookie the script never sees) with no button,
    sign-out closes it again; an operator's token opens it with the buttons."""
    from sagaworker.web.auth import hash_token

    carol = "swop_carol-browser-viewer-0123456789abcdefghijklm"
    populate(sw, tools)
    auth = WebAuth(tokens=[("alice", hash_token(ALICE_TOKEN))],
                   viewers=[("carol", hash_token(carol))])
    with serve(sw, auth) as url:
        browser.goto(url + "/")
        assert browser.js("document.body.dataset.signin") == "1"
        assert "order-1004" not in browser.js("document.body.innerText")
        browser.type("#op-token", carol)
        browser.click("#signin-button")
        browser.wait("!!document.getElementById('reader-name') && "
                     "document.getElementById('reader-name').textContent === 'carol'",
                     "carol's dashboard")
        assert "order-1004" in browser.js("document.body.innerText")
        assert browser.visible("button.op") == 0
        assert browser.js("document.cookie") == ""  # HttpOnly: no script reads it
        # signing out shows the sign-in form at once, then reloads the page: a token typed
        # before the reload is lost with it. A mark on ``window`` is gone once it reloaded.
        browser.js("window.__before_signout = true")
        browser.click("#reader-signout")
        browser.wait("!window.__before_signout && document.readyState === 'complete' && "
                     "document.body.dataset.signin === '1'", "the sign-in page, reloaded")
        browser.type("#op-token", ALICE_TOKEN)
        browser.click("#signin-button")
        browser.wait("!document.body.dataset.signin && document.getElementById("
                     "'operator-name').textContent === 'alice'", "alice's dashboard")
        assert browser.visible("button.op") == 3  # approve and reject its gate, 1 re-drive


#: run in every page before its own script: records what the page's policy blocked
WATCH_POLICY = ("window.__blocked = []; document.addEventListener('securitypolicyviolation',"
                " (e) => window.__blocked.push(e.violatedDirective + ' ' + e.blockedURI));")


def test_pages_keep_to_their_content_security_policy(sw: Sagaworker, tools: Tools,
                                                     browser: Browser) -> None:
    """Chromium enforces the pages' Content-Security-Policy (no inline script or style)
    and blocks nothing: the look comes from dashboard.css, the sign-in from dashboard.js,
    and a frame of the dashboard is refused."""
    populate(sw, tools)
    browser.call("Page.addScriptToEvaluateOnNewDocument", {"source": WATCH_POLICY},
                 session=True)
    with serve(sw, operators()) as url:
        for path in ("/", "/ui/sagas/order-1005", "/ui/sagas/order-1006"):
            browser.goto(url + path)
            policy = browser.js("fetch(location.href).then(r => "
                                "r.headers.get('content-security-policy'))")
            assert "frame-ancestors 'none'" in policy
            assert browser.js("window.__blocked") == [], path
        browser.goto(url + "/")
        assert browser.js("getComputedStyle(document.querySelector("
                          "'.alarm .title .since')).fontSize") == "14px"
        browser.type("#op-token", ALICE_TOKEN)
        browser.click("#signin-button")
        browser.wait("document.getElementById('operator-name').textContent === 'alice'",
                     "the script to sign alice in")
        browser.js("(() => { const f = document.createElement('iframe'); f.id = 'framed';"
                   " f.addEventListener('load', () => { window.__framed = true; });"
                   f" f.src = '{url}/'; document.body.appendChild(f); }})()")
        browser.wait("window.__framed", "the frame to load")
        shown = ("(() => { try { const d = document.getElementById('framed').contentDocument;"
                 " return !!(d && d.getElementById('operator')); } catch (e) { return false; }"
                 " })()")
        assert browser.js(shown) is False  # the frame got Chromium's error page instead


def test_timeline_screenshots(served: str, sw: Sagaworker, tools: Tools,
                              browser: Browser) -> None:
    """Chromium draws the timeline of a dirty saga and of a 100-step saga (screenshots in
    tests/output/): every row laid out one under the other, each bar at least 3 px wide."""
    saga = sw.begin("order-hundred")
    for seq in range(1, 101):
        saga.enqueue(tools.quote, f"{seq:05d}")
        run_step(sw, "order-hundred", seq, seq)
    for saga_id, name, count in (("order-1006", "timeline.png", 4),
                                 ("order-hundred", "timeline-100.png", 100)):
        out = screenshot(f"{served}/ui/sagas/{saga_id}", OUTPUT / name)
        assert png_size(out) == (1400, 900)
        assert out.stat().st_size > 20_000, out.stat().st_size
        browser.goto(f"{served}/ui/sagas/{saga_id}")
        tops = browser.js("[...document.querySelectorAll('#timeline .tl-row rect')]"
                          ".map(r => r.getBoundingClientRect().top)")
        widths = browser.js("[...document.querySelectorAll('#timeline rect.tl-bar')]"
                            ".map(r => r.getBoundingClientRect().width)")
        rows = browser.js("document.querySelectorAll('#timeline .tl-row').length")
        assert rows == count
        assert round(min(widths), 2) >= 3  # (sub-pixel layout: 2.9999 is a 3 px bar)
        firsts = sorted(set(round(t) for t in tops))
        assert len(firsts) == count  # one line of bars per row
