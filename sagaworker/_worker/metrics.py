"""Prometheus metrics, read from the journal at scrape time (opt-in: SAGAWORKER_METRICS_PORT).

Reading the journal rather than counting in-process keeps the figures right across
prefork children and across horizontally scaled workers: every worker reports the same
totals, so dashboards aggregate with max(), not sum().
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
)
from prometheus_client.registry import Collector
from sqlalchemy import case, func, select

from .._base.types import Phase, SagaStatus
from .._journal.dialect import db_later, seconds_between
from .._journal.runtime import Runtime
from .._journal.schema import entries, sagas

__all__ = ["JournalCollector", "serve_metrics"]

BUCKETS = (0.1, 0.5, 1.0, 5.0, 10.0, 30.0, 60.0, 300.0, 1800.0)


class JournalCollector(Collector):
    def __init__(self, rt: Runtime) -> None:
        self.rt = rt

    def collect(self) -> Iterator[Any]:
        eng = self.rt.journal.reader  # a read: on SQLite no write lock
        with eng.connect() as conn:
            steps = conn.execute(select(entries.c.tool_name, entries.c.phase, func.count())
                                 .group_by(entries.c.tool_name, entries.c.phase)).all()
            comps = conn.execute(select(entries.c.tool_name, entries.c.compensation,
                                        func.count())
                                 .where(entries.c.compensation.is_not(None))
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


def serve_metrics(rt: Runtime, port: int, addr: str = "0.0.0.0") -> None:
    registry = CollectorRegistry()
    registry.register(JournalCollector(rt))
    start_http_server(port, addr=addr, registry=registry)
