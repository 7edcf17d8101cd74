"""The app of the embedded-default contention test: tools that touch nothing but the journal.

(tests/apps/cluster.py's tools write an oracle ledger into the same database with a plain engine,
whose own locking would be measured instead of the journal's.)
"""

from __future__ import annotations

from celery import Celery

from sagaworker import CompensationContext, Sagaworker, Settings

settings = Settings()
app = Celery("tests.apps.embedded")
app.conf.broker_url = settings.broker_url
sw = Sagaworker(app, settings=settings)


@sw.tool(compensable_by="undo")
def work(key: str, n: int, fail: bool = False) -> int:
    if fail:
        raise RuntimeError(f"{key}: step {n} fails on purpose")
    return n * 2


@sw.compensation
def undo(ctx: CompensationContext) -> None:
    return None
