"""A real headless Chromium screenshot of the dashboard, served on 127.0.0.1."""

from __future__ import annotations

import os
import shutil
import struct
import subprocess
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from werkzeug.serving import make_server

from sagaworker import Sagaworker
from webapp import create_app

from .journal import Tools, awaiting_approval, compensated, completed, order_flow, running

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


@pytest.fixture
def served(sw: Sagaworker, tools: Tools) -> Iterator[str]:
    """The dashboard over a journal with one saga in every interesting state."""
    completed(sw, tools, "order-1001")
    compensated(sw, tools, "order-1002")
    running(sw, tools, "order-1003")
    awaiting_approval(sw, tools, "order-1004")
    compensated(sw, tools, "order-1005", in_doubt=True)
    compensated(sw, tools, "order-1006", card="stuck-4242")
    completed(sw, tools, "order-1007")
    server = make_server("127.0.0.1", 0, create_app(sw, flow=order_flow), threaded=True)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_port}"
    finally:
        server.shutdown()
        thread.join(10)


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
