"""An app written in the order most Celery apps are: ``Sagaworker(app)`` first, then
``app.config_from_object(...)`` with the app's own queues, prefetch and beat schedule.

Its worker must still consume sagaworker's queue (and so compensate a failed saga), and a
worker whose configuration allows pickle must refuse to start (``TEST_TASK_SERIALIZER``).
"""

from __future__ import annotations

import os
from typing import Any

from celery import Celery
from kombu import Queue  # type: ignore[attr-defined]

from sagaworker import CompensationContext, Sagaworker, Settings
from tests.apps.cluster import _url, record


def celery_config(broker_url: str) -> type:
    default_queue = os.environ.get("TEST_DEFAULT_QUEUE", "celery")

    class CeleryConfig:
        # the app's own choices, in Celery's usual shape
        task_default_queue = default_queue
        task_queues = (Queue(default_queue), Queue(f"{default_queue}-reports"))
        worker_prefetch_multiplier = 4
        beat_schedule: dict[str, Any] = {"nightly-report": {"task": "reports.nightly",
                                                            "schedule": 86400.0}}
        task_serializer = os.environ.get("TEST_TASK_SERIALIZER", "json")
        accept_content = ["json"]

    CeleryConfig.broker_url = broker_url  # type: ignore[attr-defined]
    return CeleryConfig


def build(settings: Settings | None = None) -> tuple[Celery, Sagaworker]:
    settings = settings or Settings()
    app = Celery("tests.apps.configured")
    sw = Sagaworker(app, settings=settings)
    app.config_from_object(celery_config(settings.broker_url))  # after Sagaworker(app)
    if not _url:
        _url.append(settings.database_url)

    @sw.tool(compensable_by="undo_step")
    def step(key: str, name: str, fail: bool = False) -> str:
        if fail:
            raise RuntimeError(f"{name} failed on purpose")
        record(key, "effect", name)
        return f"{name}-done"

    @sw.compensation
    def undo_step(ctx: CompensationContext) -> None:
        record(ctx.args[0], "undo", ctx.args[1])

    return app, sw


if os.environ.get("TESTS_CONFIG_APP_WORKER") == "1":  # set for worker processes
    app, sw = build()
