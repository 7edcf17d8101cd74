"""Prometheus metrics, read from the journal at scrape time (opt-in: SAGAWORKER_METRICS_PORT).

Served on SAGAWORKER_METRICS_ADDR (127.0.0.1 unless told); any other address needs
SAGAWORKER_METRICS_TOKEN, which every scrape then sends as ``Authorization: Bearer``.

Reading the journal rather than counting in-process keeps the figures right across
prefork children and across horizontally scaled workers: every worker reports the same
totals, so dashboards aggregate with max(), not sum().
"""

from __future__ import annotations

import hmac
import socket
import threading
from collections.abc import Callable, Iterable, Iterator
from socketserver import ThreadingMixIn
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry, make_wsgi_app
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
)
from prometheus_client.registry import Collector
from sqlalchemy import case, func, select

from .._base.errors import ConfigurationError
from .._base.patches import PATCH_PREFIX
from .._base.settings import metrics_exposure_problem
from .._base.types import Phase, SagaStatus
from .._journal.dialect import db_later, seconds_between
from .._journal.schema import entries, sagas
from .._runtime import Runtime

__all__ = ["JournalCollector", "serve_metrics"]

BUCKETS = (0.1, 0.5, 1.0, 5.0, 10.0, 30.0, 60.0, 300.0, 1800.0)


class JournalCollector(Collector):
    def __init__(self, rt: Runtime) -> None:
        self.rt = rt

    def collect(self) -> Iterator[Any]:
        eng = self.rt.journal.reader  # a read: on SQLite no write lock
        with eng.connect() as conn:
            tools = ~entries.c.tool_name.startswith(PATCH_PREFIX)  # (a flow's patch marker)
            steps = conn.execute(select(entries.c.tool_name, entries.c.phase, func.count())
                                 .where(tools)
                                 .group_by(entries.c.tool_name, entries.c.phase)).all()
            comps = conn.execute(select(entries.c.tool_name, entries.c.compensation,
                                        func.count())
                                 .where(entries.c.compensation.is_not(None), tools)
                                 .group_by(entries.c.tool_name, entries.c.compensation)).all()
            statuses: dict[str, int] = dict(conn.execute(select(sagas.c.status, func.count())
                                         .group_by(sagas.c.status)).all())
            cutoff = db_later(-self.rt.settings.orphan_after)
            orphans = conn.execute(select(func.count()).select_from(entries).where(
                entries.c.phase == Phase.INTENT.value, entries.c.created_at < cutoff)).scalar()
            secs = seconds_between(sagas.c.compensation_started_at, sagas.c.finished_at)
            done = (sagas.c.compensation_started_at.is_not(None)
                    & sagas.c.finished_at.is_not(None))
            row = conn.execute(select(
                func.count(), func.coalesce(func.sum(secs), 0.0),
                *[func.sum(case((secs <= b, 1), else_=0)) for b in BUCKETS],
            ).where(done)).one()
        g = GaugeMetricFamily("sagaworker_steps", "Journal entries by tool and phase",
                              labels=["tool", "phase"])
        for tool, phase, n in steps:
            g.add_metric([tool, phase], n)
        yield g
        c = CounterMetricFamily("sagaworker_compensations", "Undo outcomes by tool and outcome",
                                labels=["tool", "outcome"])
        for tool, outcome, n in comps:
            c.add_metric([tool, outcome], n)
        yield c
        s = GaugeMetricFamily("sagaworker_sagas", "Sagas by status", labels=["status"])
        for st in SagaStatus:
            s.add_metric([st.value], statuses.get(st.value, 0))
        yield s
        yield GaugeMetricFamily("sagaworker_orphans",
                                "INTENT entries older than SAGAWORKER_ORPHAN_AFTER",
                                value=int(orphans or 0))
        count, total, *cum = row
        h = HistogramMetricFamily(
            "sagaworker_compensation_duration_seconds",
            "From the compensation start to the terminal status",
            buckets=[(str(b), int(x or 0)) for b, x in zip(BUCKETS, cum, strict=True)]
            + [("+Inf", int(count))],
            sum_value=float(total or 0.0))
        yield h


class _Server(ThreadingMixIn, WSGIServer):
    daemon_threads = True


class _Server6(_Server):
    address_family = socket.AF_INET6


class _Quiet(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        pass


WSGIApp = Callable[[dict[str, Any], Callable[..., Any]], Iterable[bytes]]


def _bearer_only(app: WSGIApp, token: str) -> WSGIApp:
    expected = f"Bearer {token}".encode()

    def guarded(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        sent = str(environ.get("HTTP_AUTHORIZATION", "")).encode("utf-8", "replace")
        if not hmac.compare_digest(sent, expected):
            start_response("401 Unauthorized", [
                ("Content-Type", "text/plain; charset=utf-8"),
                ("WWW-Authenticate", 'Bearer realm="sagaworker metrics"')])
            return [b"send Authorization: Bearer <SAGAWORKER_METRICS_TOKEN>\n"]
        return app(environ, start_response)
    return guarded


def serve_metrics(rt: Runtime, port: int, addr: str | None = None, *,
                  token: str | None = None) -> WSGIServer:
    """Serve the journal's metrics on ``addr`` (default SAGAWORKER_METRICS_ADDR) from a
    daemon thread; ``token`` (default SAGAWORKER_METRICS_TOKEN) is asked of every scrape.
    ConfigurationError, and nothing served, for a non-loopback address without a token."""
    addr = rt.settings.metrics_addr if addr is None else addr
    if token is None and rt.settings.metrics_token is not None:
        token = rt.settings.metrics_token.get_secret_value()
    problem = metrics_exposure_problem(addr, bool(token))
    if problem:
        raise ConfigurationError(problem)
    registry = CollectorRegistry()
    registry.register(JournalCollector(rt))
    app: WSGIApp = make_wsgi_app(registry)
    if token:
        app = _bearer_only(app, token)
    server = make_server(addr, port, app, server_class=_Server6 if ":" in addr else _Server,
                         handler_class=_Quiet)
    threading.Thread(target=server.serve_forever, daemon=True,
                     name="sagaworker-metrics").start()
    return server
