"""sagaworker as a library inside someone else's project: the built wheel holds only
``sagaworker``, and a project with its own ``tasks`` and ``config`` packages, outside this
repository, runs a saga that compensates on PostgreSQL and RabbitMQ with a real worker."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
import zipfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import BROKERS, ROOT, _broker, need

pytestmark = pytest.mark.services


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, str]]:
    """The wheel ``pip wheel .`` builds from this checkout, and what the build printed."""
    out = tmp_path_factory.mktemp("wheel")
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w",
                           str(out), str(ROOT)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (path,) = out.glob("sagaworker-*.whl")
    yield path, proc.stdout + proc.stderr


def test_the_wheel_installs_sagaworker_and_nothing_else(wheel: tuple[Path, str]) -> None:
    """No example package (``tasks``, ``config``, ``webapp``) shadows a user's own; the
    dashboard's templates and the migrations travel with the library."""
    path, _ = wheel
    names = zipfile.ZipFile(path).namelist()
    top = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
    assert top == {"sagaworker"}
    assert "sagaworker/web/templates/saga.html" in names
    assert "sagaworker/web/static/dashboard.js" in names
    assert "sagaworker/_journal/migrations/versions/0001_journal.py" in names
    assert "sagaworker/py.typed" in names


def test_the_build_prints_no_deprecation_warning(wheel: tuple[Path, str]) -> None:
    """pyproject's license is an SPDX expression: setuptools has nothing to warn about."""
    assert "Deprecat" not in wheel[1]


USER_CONFIG = '''"""The user's own configuration package (a Django project has one named config)."""
OWNER = "the user's config"
'''

USER_TASKS = '''"""The user's own tasks module: their Celery app, their tools."""
import os

from celery import Celery

import config
from sagaworker import CompensationContext, Sagaworker

assert config.OWNER == "the user's config"
app = Celery("shop", broker=os.environ["SHOP_BROKER"])
app.conf.task_default_queue = os.environ["SHOP_QUEUE"]
sw = Sagaworker(app, database_url=os.environ["SHOP_DB"])
LEDGER = os.environ["SHOP_LEDGER"]


def note(line: str) -> None:
    with open(LEDGER, "a") as f:
        f.write(line + "\\n")


@sw.tool(compensable_by="release")
def reserve(sku: str) -> str:
    note(f"reserve {sku}")
    return f"hold-{sku}"


@sw.compensation
def release(ctx: CompensationContext) -> None:
    note(f"release {ctx.result}")


@sw.tool()
def charge(card: str) -> str:
    note(f"charge {card}")
    raise RuntimeError("card declined")
'''

PRODUCER = '''import sys
from tasks import charge, reserve, sw

saga = sw.begin(sys.argv[1])
saga.enqueue(reserve, "sku-1").result(timeout=60)
saga.enqueue(reserve, "sku-2").result(timeout=60)
try:
    saga.enqueue(charge, "card-9").result(timeout=60)
except Exception as exc:
    print("tool failed:", exc)
res = sw.get(sys.argv[1]).wait(timeout=90)
print("STATUS", res.status.value)
'''


def test_a_users_project_runs_a_saga_from_the_installed_wheel(
        wheel: tuple[Path, str], tmp_path: Path, pg_url: str) -> None:
    """The wheel installed into a folder of its own; the project's own ``config`` and
    ``tasks`` are the ones imported (worker and producer); the saga compensates in reverse
    and the CLI reads it with ``-A tasks``."""
    broker = BROKERS["rabbitmq"]
    need("RabbitMQ", _broker(broker))
    site, project = tmp_path / "site", tmp_path / "shop"
    proc = subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-q",
                           "--target", str(site), str(wheel[0])], capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    (project / "config").mkdir(parents=True)
    (project / "config" / "__init__.py").write_text(USER_CONFIG)
    (project / "tasks").mkdir()
    (project / "tasks" / "__init__.py").write_text(USER_TASKS)
    (project / "producer.py").write_text(PRODUCER)
    ledger = tmp_path / "ledger.txt"
    queue = f"shop-{uuid.uuid4().hex[:8]}"
    env = {k: v for k, v in os.environ.items() if not k.startswith("SAGAWORKER_")}
    env.update(PYTHONPATH=str(site), SHOP_BROKER=broker, SHOP_QUEUE=queue, SHOP_DB=pg_url,
               SHOP_LEDGER=str(ledger), SAGAWORKER_LOG_FORMAT="json",
               SAGAWORKER_COMPENSATION_BACKOFF="0.1")
    where = subprocess.run([sys.executable, "-c", "import sagaworker, config, tasks; "
                            "print(sagaworker.__file__); print(config.__file__)"],
                           cwd=project, env=env, capture_output=True, text=True, timeout=60)
    assert where.returncode == 0, where.stderr
    lib, cfg = where.stdout.split()
    assert lib.startswith(str(site)) and cfg.startswith(str(project))
    log = tmp_path / "worker.log"
    worker = subprocess.Popen(
        [sys.executable, "-m", "celery", "-A", "tasks", "worker", "-Q", f"{queue},sagaworker",
         "-c", "2", "--without-gossip", "--without-mingle", "--loglevel=INFO"],
        cwd=project, env=env, stdout=log.open("wb"), stderr=subprocess.STDOUT,
        start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        while b" ready." not in log.read_bytes():
            assert worker.poll() is None, log.read_text()
            assert time.monotonic() < deadline, log.read_text()
            time.sleep(0.2)
        saga_id = f"shop-{uuid.uuid4().hex[:8]}"
        run = subprocess.run([sys.executable, "producer.py", saga_id], cwd=project, env=env,
                             capture_output=True, text=True, timeout=180)
        assert run.returncode == 0, run.stdout + run.stderr + log.read_text()
        assert "STATUS COMPENSATED" in run.stdout, run.stdout + log.read_text()
        assert ledger.read_text().splitlines() == [
            "reserve sku-1", "reserve sku-2", "charge card-9", "release hold-sku-2",
            "release hold-sku-1"]
        show = subprocess.run([sys.executable, "-m", "sagaworker.cli", "-A", "tasks", "show",
                               saga_id, "--json"], cwd=project, env=env, capture_output=True,
                              text=True, timeout=60)
        assert show.returncode == 0, show.stderr
        assert json.loads(show.stdout)["status"] == "COMPENSATED"
    finally:
        os.killpg(worker.pid, signal.SIGTERM)
        try:
            worker.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(worker.pid, signal.SIGKILL)
