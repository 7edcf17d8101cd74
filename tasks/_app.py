"""The Celery app and the Sagaworker of the example (kept apart so the tools can import it)."""

from __future__ import annotations

from celery import Celery

from sagaworker import Sagaworker

app = Celery("tasks")
app.config_from_object("config.celery")
sw = Sagaworker(app)
