"""Celery configuration (``app.config_from_object("config.celery")``), from SAGAWORKER_*.

Reliability settings (late acks, prefetch 1, visibility timeout, publisher confirms,
queues) are applied by ``Sagaworker`` itself; this module holds the app's own choices.
"""

from __future__ import annotations

import os

from sagaworker import Settings

_settings = Settings()

# SAGAWORKER_BROKER_URL when set; else none here: Sagaworker then takes the embedded
# broker beside the embedded SQLite journal, and refuses to run beside a real database
broker_url = _settings.broker_url if "broker_url" in _settings.model_fields_set else None
# the queue of the example's tool tasks: Celery's "celery" unless set (two deployments that
# share a broker vhost give each its own)
task_default_queue = os.environ.get("CELERY_TASK_DEFAULT_QUEUE", "celery")
task_serializer = "json"
accept_content = ["json"]
result_backend = None
task_ignore_result = True
timezone = "UTC"
enable_utc = True
worker_send_task_events = False
# SIGTERM is a warm shutdown: running tools finish, the rest is requeued (acks_late).
worker_proc_alive_timeout = 10
