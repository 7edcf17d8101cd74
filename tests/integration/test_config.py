"""sagaworker's Celery settings hold however the app is configured, in a real worker."""

from __future__ import annotations

import os
import subprocess
import uuid
from pathlib import Path
from typing import Any

import pytest

from sagaworker import OutcomeResult, SagaStatus
from tests.conftest import BROKERS, _broker, need, new_settings, uid, worker_env

pytestmark = pytest.mark.services


def test_worker_of_an_app_configured_after_sagaworker_compensates(
        pg_url: str, tmp_path: Path) -> None:
    """`config_from_object` after `Sagaworker(app)`, with the app's own `task_queues`: a plain
    `celery -A module worker` still consumes the sagaworker queue and compensates."""
    from sagaworker._demo import start_worker
    from tests.app import rows
    from tests.config_app import build

    broker = BROKERS["rabbitmq"]
    need("rabbitmq", _broker(broker))
    settings = new_settings(pg_url, broker, tmp_path)
    default_queue = f"t-{uuid.uuid4().hex[:8]}"
    os.environ["TEST_DEFAULT_QUEUE"] = default_queue
    app, sw = build(settings)
    assert {q.name for q in app.conf.task_queues} == {
        default_queue, f"{default_queue}-reports", settings.queue}
    env = worker_env(settings, default_queue, TESTS_APP_WORKER="0",
                     TESTS_CONFIG_APP_WORKER="1")
    log = tmp_path / "worker.log"
    proc = start_worker("tests.config_app", env, log, extra=("-n", f"cfg-{uid()}@%h"))
    try:
        key = uid("k")
        step = sw.registry.tool("tests.config_app.step").task

        def work(s: Any) -> None:
            s.call(step, key, "a")
            s.call(step, key, "b", fail=True)

        res = sw.saga(key, work, timeout=60)
        assert res.status is SagaStatus.COMPENSATED, log.read_text()[-3000:]
        assert [(o.seq, o.result) for o in res.report.outcomes] == [
            (1, OutcomeResult.COMPENSATED)]
        assert [(r.kind, r.tool) for r in rows(settings.database_url, key)] == [
            ("effect", "a"), ("undo", "a")]
        banner = log.read_text()
        assert f".> {settings.queue}" in banner and f".> {default_queue}-reports" in banner
    finally:
        proc.terminate()
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
        os.environ.pop("TEST_DEFAULT_QUEUE", None)
        from kombu import Connection

        with Connection(broker, connect_timeout=3) as c:
            ch = c.channel()
            for n in (default_queue, f"{default_queue}-reports", settings.queue):
                try:
                    ch.queue_delete(n)
                except Exception:
                    ch = c.channel()
