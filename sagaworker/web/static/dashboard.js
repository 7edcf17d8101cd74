// The operators' buttons: approve, reject, re-drive and abort, each confirmed in a <dialog>,
// posted to the JSON API. The identity is the proxy's header (nothing to do here) or an
// operator token entered once and kept in sessionStorage (this tab only), sent as
// "Authorization: Bearer". The server checks it on every request; hiding the buttons is
// only a courtesy. Signing in also sets the server's read cookie (HttpOnly: never seen
// here), with which the browser loads the pages when anonymous reads are off; it never
// decides. A viewer's token signs in for reading only.
(function () {
  "use strict";
  const KEY = "sagaworker.operatorToken";
  const $ = (id) => document.getElementById(id);
  const box = $("operator");
  if (!box) return; // read-only app: no buttons were rendered
  const dialog = $("confirm"); // none when only viewers are configured
  const flash = $("flash");
  let pending = null; // the button whose action the dialog confirms

  function storedToken() {
    try { return sessionStorage.getItem(KEY); } catch (e) { return null; }
  }

  function headers() {
    const h = { "Content-Type": "application/json", "Accept": "application/json" };
    const token = storedToken();
    if (token) h["Authorization"] = "Bearer " + token;
    return h;
  }

  function showButtons(on) {
    document.querySelectorAll("button.op").forEach((b) => { b.hidden = !on; });
  }

  function signedIn(name) {
    $("operator-name").textContent = name;
    $("signed-in").hidden = false;
    const form = $("signin");
    if (form) form.hidden = true;
    showButtons(true);
  }

  function signedOut(message) {
    try { sessionStorage.removeItem(KEY); } catch (e) { /* private mode */ }
    $("signed-in").hidden = true;
    const form = $("signin");
    if (form) form.hidden = false;
    const err = $("signin-error");
    if (err) { err.textContent = message || ""; err.hidden = !message; }
    showButtons(false);
  }

  async function whoami(token) {
    const resp = await fetch(box.dataset.authUrl, {
      headers: { "Accept": "application/json", "Authorization": "Bearer " + token },
      cache: "no-store",
    });
    const body = await resp.json().catch(() => ({}));
    if (resp.ok && (body.operator || body.reader)) return body;
    throw new Error(body.error || "not a valid token");
  }

  // the read cookie, for the pages this browser loads (the token itself is sent once)
  function session(method, token) {
    return fetch(box.dataset.sessionUrl, {
      method: method, credentials: "same-origin",
      headers: { "Content-Type": "application/json", "Accept": "application/json" },
      body: token ? JSON.stringify({ token: token }) : undefined,
    });
  }

  async function signIn(token, fresh) {
    try {
      const who = await whoami(token);
      if (fresh) await session("POST", token);
      // the sign-in page becomes the page itself; a viewer's name is rendered by the server
      if (fresh && (document.body.dataset.signin || !who.operator)) {
        if (who.operator) sessionStorage.setItem(KEY, token);
        location.reload();
        return;
      }
      if (!who.operator) return;
      sessionStorage.setItem(KEY, token);
      signedIn(who.operator);
    } catch (e) {
      signedOut(e.message);
    }
  }

  async function signOutAll() {
    signedOut("");
    await session("DELETE").catch(() => null);
    location.reload();
  }

  const form = $("signin");
  if (form) {
    form.addEventListener("submit", (ev) => {
      ev.preventDefault();
      const input = $("op-token");
      const token = input.value.trim();
      input.value = "";
      if (token) signIn(token, true);
    });
    const token = storedToken();
    if (token) signIn(token, false);
  }
  const out = $("signout");
  if (out) out.addEventListener("click", signOutAll);
  const readerOut = $("reader-signout");
  if (readerOut) readerOut.addEventListener("click", signOutAll);
  if (!dialog) return; // viewers only: nothing to decide here

  const TEXT = {
    approve: (b) => ["Approve step #" + b.dataset.seq + " " + b.dataset.step + "?",
      "Saga " + b.dataset.saga + ": the step is published and runs; it is irreversible. " +
      "You are journaled as the approver."],
    reject: (b) => ["Reject step #" + b.dataset.seq + " " + b.dataset.step + "?",
      "Saga " + b.dataset.saga + " fails and compensates: its executed steps are undone."],
    redrive: (b) => ["Re-drive the failed undos of " + b.dataset.saga + "?",
      "Only the undos that failed run again (same idempotency keys). Fix their cause first."],
    abort: (b) => ["Abort " + b.dataset.saga + "?",
      "The saga fails: its gates close and its executed steps are undone."],
  };
  const NEEDS_REASON = { reject: true, abort: true };

  function open(button) {
    pending = button;
    const [title, text] = TEXT[button.dataset.action](button);
    $("confirm-title").textContent = title;
    $("confirm-text").textContent = text;
    $("confirm-reason").value = "";
    $("confirm-reason-row").hidden = !NEEDS_REASON[button.dataset.action];
    $("confirm-error").hidden = true;
    $("confirm-ok").disabled = false;
    $("confirm-ok").textContent = button.textContent.replace("…", "");
    dialog.showModal();
    if (NEEDS_REASON[button.dataset.action]) $("confirm-reason").focus();
  }

  function body(button) {
    const a = button.dataset.action;
    const reason = $("confirm-reason").value.trim();
    if (a === "approve" || a === "reject") {
      // the exact id (data-saga shows it with hidden characters escaped)
      const b = { saga_id: decodeURIComponent(button.dataset.sagaId),
        seq: Number(button.dataset.seq) };
      if (a === "reject") b.reason = reason;
      return b;
    }
    return a === "abort" ? { reason: reason } : {};
  }

  function fail(message) {
    const err = $("confirm-error");
    err.textContent = message;
    err.hidden = false;
    $("confirm-ok").disabled = false;
  }

  async function confirm() {
    const button = pending;
    if (!button) return;
    if (NEEDS_REASON[button.dataset.action] && !$("confirm-reason").value.trim()) {
      fail("Give a reason: it is journaled with the decision.");
      return;
    }
    $("confirm-ok").disabled = true;
    let resp, data;
    try {
      resp = await fetch(button.dataset.url, {
        method: "POST", headers: headers(), body: JSON.stringify(body(button)),
      });
      data = await resp.json().catch(() => ({}));
    } catch (e) {
      fail("The request failed: " + e.message);
      return;
    }
    if (resp.status === 401) {
      dialog.close();
      signedOut(data.error || "sign in again");
      return;
    }
    if (!resp.ok) {
      const why = data.reasons ? Object.entries(data.reasons).map(([k, v]) => k + " " + v)
        .join("; ") : "";
      fail((data.error || ("HTTP " + resp.status)) + (why ? ": " + why : ""));
      return;
    }
    dialog.close();
    pending = null;
    const who = data.approver || data.aborted_by || data.actor || "";
    flash.textContent = ({ approve: "Approved", reject: "Rejected", redrive: "Re-drive queued",
      abort: "Aborted" })[button.dataset.action] + " (" + button.dataset.saga + ") by " + who +
      (data.warning ? ". " + data.warning : "");
    flash.dataset.done = button.dataset.action;
    flash.hidden = false;
    setTimeout(() => location.reload(), 1500);
  }

  document.addEventListener("click", (ev) => {
    const b = ev.target.closest("button.op");
    if (b && !b.hidden) open(b);
  });
  $("confirm-cancel").addEventListener("click", () => { pending = null; dialog.close(); });
  $("confirm-ok").addEventListener("click", confirm);

  // the page's auto-refresh, held while the operator is in a dialog or typing a token
  const every = Number(document.body.dataset.refresh || 0);
  if (every > 0) {
    setInterval(() => {
      const typing = document.activeElement && document.activeElement.tagName === "INPUT";
      if (!dialog.open && !typing && flash.hidden) location.reload();
    }, every * 1000);
  }
}());
