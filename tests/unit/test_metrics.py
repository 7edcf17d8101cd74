"""The workers' Prometheus endpoint: on the loopback interface unless told otherwise, and
never on the network without a bearer token."""

from __future__ import annotations

import socket
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from celery import Celery

from sagaworker import ConfigurationError, Sagaworker, Settings
from sagaworker._worker.metrics import serve_metrics

TOKEN = "metrics-scrape-token-0123456789abcdef"


def _sw(tmp_path: Path) -> Sagaworker:
    return Sagaworker(Celery("m", broker="memory://"),
                      database_url=f"sqlite:///{tmp_path / 'j.db'}",
                      settings=Settings(sweep_interval=0))


def _port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _scrape(port: int, token: str | None = None) -> tuple[int, str]:
    req = urllib.request.Request(f"http://127.0.0.1:{port}/metrics")
    if token is not None:
        req.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def test_metrics_bind_to_the_loopback_interface_by_default(tmp_path: Path) -> None:
    """Unset, SAGAWORKER_METRICS_ADDR is 127.0.0.1: the server listens there only."""
    assert Settings().metrics_addr == "127.0.0.1"
    port = _port()
    server = serve_metrics(_sw(tmp_path).rt, port)
    try:
        assert server.server_address[0] == "127.0.0.1"
        status, body = _scrape(port)
        assert status == 200 and "sagaworker_sagas" in body
    finally:
        server.shutdown()
        server.server_close()


@pytest.mark.parametrize("addr", ["0.0.0.0", "::", "10.1.2.3", "metrics.internal"])
def test_metrics_on_the_network_without_a_token_are_refused(tmp_path: Path,
                                                            addr: str) -> None:
    """Any address but the loopback one needs SAGAWORKER_METRICS_TOKEN: one line saying
    which settings to change, and nothing listens."""
    with pytest.raises(ConfigurationError) as exc:
        serve_metrics(_sw(tmp_path).rt, _port(), addr)
    msg = str(exc.value)
    assert "\n" not in msg
    assert "SAGAWORKER_METRICS_TOKEN" in msg and "SAGAWORKER_METRICS_ADDR" in msg
    assert Settings(metrics_port=9808, metrics_addr=addr).metrics_problem == msg
    assert Settings(metrics_port=9808, metrics_addr=addr,
                    metrics_token=TOKEN).metrics_problem is None


def test_a_metrics_token_is_required_of_every_scrape(tmp_path: Path) -> None:
    """With SAGAWORKER_METRICS_TOKEN a scrape needs ``Authorization: Bearer <token>``
    (Prometheus: ``authorization: {credentials: ...}``); otherwise 401, no figure."""
    sw = _sw(tmp_path)
    port = _port()
    server = serve_metrics(sw.rt, port, "127.0.0.1", token=TOKEN)
    try:
        for token in (None, "wrong", TOKEN + "x"):
            status, body = _scrape(port, token)
            assert status == 401 and "sagaworker_sagas" not in body
            assert "Authorization: Bearer" in body
        status, body = _scrape(port, TOKEN)
        assert status == 200 and 'sagaworker_sagas{status="RUNNING"}' in body
    finally:
        server.shutdown()
        server.server_close()
