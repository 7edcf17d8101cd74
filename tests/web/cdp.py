"""Drive Debian's headless Chromium over the DevTools protocol on a pipe
(``--remote-debugging-pipe``: commands on fd 3, replies on fd 4, NUL-separated JSON), so a
test clicks real buttons with real mouse events. Nothing beyond the standard library."""

from __future__ import annotations

import contextlib
import json
import os
import select
import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

__all__ = ["Browser", "BrowserError"]


class BrowserError(AssertionError):
    pass


class Browser:
    """One headless Chromium with one page. ``with Browser(path) as b: b.goto(url)``."""

    def __init__(self, chromium: Path, *, flags: list[str], timeout: float = 30) -> None:
        self.timeout = timeout
        self.profile = tempfile.mkdtemp(prefix="chromium-profile-")
        cmd_r, self._cmd_w = os.pipe()   # we write commands, Chromium reads fd 3
        self._out_r, out_w = os.pipe()   # Chromium writes fd 4, we read

        def fds() -> None:  # in the child: the pipe ends at fds 3 and 4, inheritable
            a, b = os.dup(cmd_r), os.dup(out_w)
            os.dup2(a, 3)
            os.dup2(b, 4)

        self._log = tempfile.TemporaryFile()  # noqa: SIM115 - closed in close()
        self.proc = subprocess.Popen(
            [str(chromium), *flags, "--remote-debugging-pipe",
             f"--user-data-dir={self.profile}", "about:blank"],
            preexec_fn=fds, close_fds=False, stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL, stderr=self._log)
        os.close(cmd_r)
        os.close(out_w)
        self._buf = b""
        self._id = 0
        self.events: list[dict[str, Any]] = []
        try:
            target = self.call("Target.createTarget", {"url": "about:blank"})["targetId"]
            self.session = self.call("Target.attachToTarget",
                                     {"targetId": target, "flatten": True})["sessionId"]
            for domain in ("Page", "Runtime", "Network"):
                self.call(f"{domain}.enable", session=True)
        except BaseException:
            self.close()
            raise

    # -- the protocol ------------------------------------------------------------------

    def _read(self, deadline: float) -> dict[str, Any]:
        while b"\0" not in self._buf:
            left = deadline - time.monotonic()
            if left <= 0:
                raise BrowserError("chromium did not answer in time")
            ready, _, _ = select.select([self._out_r], [], [], left)
            if not ready:
                continue
            chunk = os.read(self._out_r, 1 << 16)
            if not chunk:
                raise BrowserError(f"chromium exited (rc {self.proc.poll()}): {self.log()}")
            self._buf += chunk
        msg, _, self._buf = self._buf.partition(b"\0")
        data: dict[str, Any] = json.loads(msg)
        return data

    def call(self, method: str, params: dict[str, Any] | None = None, *,
             session: bool = False) -> dict[str, Any]:
        self._id += 1
        msg: dict[str, Any] = {"id": self._id, "method": method, "params": params or {}}
        if session:
            msg["sessionId"] = self.session
        os.write(self._cmd_w, json.dumps(msg).encode() + b"\0")
        deadline = time.monotonic() + self.timeout
        while True:
            reply = self._read(deadline)
            if reply.get("id") == self._id:
                if "error" in reply:
                    raise BrowserError(f"{method}: {reply['error']}")
                result: dict[str, Any] = reply.get("result", {})
                return result
            self.events.append(reply)

    # -- a page ------------------------------------------------------------------------

    def js(self, expression: str) -> Any:
        """The value of ``expression`` in the page (promises awaited)."""
        got = self.call("Runtime.evaluate", {"expression": expression, "returnByValue": True,
                                             "awaitPromise": True}, session=True)
        if "exceptionDetails" in got:
            raise BrowserError(f"{expression}: {got['exceptionDetails']}")
        return got["result"].get("value")

    def wait(self, expression: str, what: str, timeout: float | None = None) -> Any:
        """Await ``expression`` true. One that throws counts as not yet: a page that
        reloads has no ``document.body`` for a moment (the last error is reported)."""
        deadline = time.monotonic() + (timeout or self.timeout)
        last: BrowserError | None = None
        while time.monotonic() < deadline:
            try:
                value = self.js(expression)
            except BrowserError as exc:
                value, last = None, exc
            if value:
                return value
            time.sleep(0.1)
        raise BrowserError(f"timed out waiting for {what} ({expression})"
                           + (f"; last error: {last}" if last is not None else ""))

    def goto(self, url: str) -> None:
        self.call("Page.navigate", {"url": url}, session=True)
        self.wait(f"location.href === {json.dumps(url)} && document.readyState === 'complete'",
                  f"{url} to load")

    def headers(self, headers: dict[str, str]) -> None:
        """Send these headers with every request (what an authenticating proxy adds)."""
        self.call("Network.setExtraHTTPHeaders", {"headers": headers}, session=True)

    def visible(self, selector: str) -> int:
        """How many elements match ``selector`` and are rendered (not hidden)."""
        return int(self.js(
            f"[...document.querySelectorAll({json.dumps(selector)})]"
            ".filter(e => e.getClientRects().length > 0).length"))

    def click(self, selector: str) -> None:
        """A real mouse click (pressed and released) at the middle of the element."""
        box = self.wait(
            f"(() => {{ const e = document.querySelector({json.dumps(selector)});"
            " if (!e || !e.getClientRects().length) return null;"
            " e.scrollIntoView({block: 'center'}); const r = e.getBoundingClientRect();"
            " return [r.left + r.width / 2, r.top + r.height / 2]; })()",
            f"{selector} to be visible")
        for kind in ("mousePressed", "mouseReleased"):
            self.call("Input.dispatchMouseEvent", {"type": kind, "x": box[0], "y": box[1],
                                                   "button": "left", "clickCount": 1},
                      session=True)

    def type(self, selector: str, text: str) -> None:
        """Focus the field and type ``text`` into it as keyboard input."""
        self.click(selector)
        self.call("Input.insertText", {"text": text}, session=True)

    def log(self) -> str:
        """The end of Chromium's stderr."""
        self._log.seek(0)
        return self._log.read().decode(errors="replace")[-2000:]

    def close(self) -> None:
        for fd in (self._cmd_w, self._out_r):
            with contextlib.suppress(OSError):
                os.close(fd)
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self._log.close()
        shutil.rmtree(self.profile, ignore_errors=True)

    def __enter__(self) -> Browser:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
