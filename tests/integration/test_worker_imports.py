"""A worker process imports only what a worker uses: each module it imports is resident in
the worker's main process and in every pool child forked from it."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.conftest import ROOT

#: what a worker on PostgreSQL, without encryption keys, metrics or tracing, never needs
NOT_IN_A_WORKER = ("pydantic_settings", "alembic", "mako", "sqlalchemy.orm", "flask",
                   "prometheus_client", "cryptography", "opentelemetry", "sagaworker.cli",
                   "sagaworker.web", "sagaworker.agents")

PROBE = """
import json, sys
from celery import Celery
import sagaworker
app = Celery("probe", broker="memory://")
sw = sagaworker.Sagaworker(app, database_url="postgresql+psycopg://127.0.0.1/test")
sw.settings, app.conf.task_queues  # what a worker reads at start
print(json.dumps(sorted(sys.modules)))
"""


def test_building_a_worker_app_imports_nothing_a_worker_does_not_use() -> None:
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True,
                         check=True, env=env, cwd=ROOT).stdout
    loaded = json.loads(out)
    assert "sagaworker._core.sagaworker" in loaded  # the probe did build one
    assert [m for m in loaded
            if any(m == bad or m.startswith(f"{bad}.") for bad in NOT_IN_A_WORKER)] == []
