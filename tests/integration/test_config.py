"""sagaworker's Celery settings hold however the app is configured, in a real worker."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import pytest

from sagaworker import OutcomeResult, SagaStatus
from tests.conftest import (
    BROKERS,
    ROOT,
    _broker,
    need,
    new_settings,
    uid,
    worker_env,
)

pytestmark = pytest.mark.services


def test_worker_of_an_app_configured_after_sagaworker_compensates(
        pg_url: str, tmp_path: Path) -> None:
    """`config_from_object` after `Sagaworker(app)`, with the app's own `task_queues`: a plain
    `celery -A module worker` still consumes the sagaworker queue and compensates."""
    from sagaworker.cli.demo import start_worker
    from tests.apps.cluster import rows
    from tests.apps.configured import build

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
    proc = start_worker("tests.apps.configured", env, log, extra=("-n", f"cfg-{uid()}@%h"))
    try:
        key = uid("k")
        step = sw.registry.tool("tests.apps.configured.step").task

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



def test_db_upgrade_migrates_the_apps_postgresql_database(fresh_pg_url: str,
                                                         tmp_path: Path) -> None:
    """`sagaworker -A module db upgrade`, with the module's `Sagaworker(app,
    database_url=<PostgreSQL>)` and no SAGAWORKER_* variable: PostgreSQL is migrated and
    no ./sagaworker.db appears."""
    from sqlalchemy import create_engine, inspect

    from sagaworker._journal.schema import metadata

    (tmp_path / "pg_cli_app.py").write_text(
        "from celery import Celery\n"
        "from sagaworker import Sagaworker\n"
        "app = Celery('pg_cli_app')\n"
        f"sw = Sagaworker(app, database_url={fresh_pg_url!r})\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("SAGAWORKER_")}
    env["PYTHONPATH"] = str(ROOT)
    cli = Path(sys.executable).with_name("sagaworker")
    r = subprocess.run([str(cli), "-A", "pg_cli_app", "db", "upgrade"], cwd=tmp_path,
                       env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert fresh_pg_url.rsplit("/", 1)[1] in r.stdout
    engine = create_engine(fresh_pg_url)
    try:
        tables = set(inspect(engine).get_table_names())
    finally:
        engine.dispose()
    assert {"sagaworker_alembic_version", *metadata.tables} <= tables
    assert not (tmp_path / "sagaworker.db").exists()
