"""Mistakes are named at start, in one line: a worker refuses to start (exit 3), a
producer gets a ConfigurationError, the CLI prints the line, never a traceback."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from sagaworker import ConfigurationError, Sagaworker, SagaworkerError, Settings
from tests.conftest import BROKERS, ROOT, TEST_SECRET, _broker, need

pytestmark = pytest.mark.services

UNREACHABLE = "postgresql+psycopg://shop:hunter2-secret@127.0.0.1:1/shop"


def _worker(tmp_path: Path, database_url: str, secret: str,
            **settings: str) -> subprocess.CompletedProcess[str]:
    """`celery -A tests.apps.cluster worker` as a user starts it; it must exit by itself."""
    need("rabbitmq", _broker(BROKERS["rabbitmq"]))
    env = {k: v for k, v in os.environ.items() if not k.startswith("SAGAWORKER_")}
    env.update(PYTHONPATH=str(ROOT), TESTS_APP_WORKER="1",
               TEST_DEFAULT_QUEUE=f"start-{uuid.uuid4().hex[:6]}",
               SAGAWORKER_DATABASE_URL=database_url,
               SAGAWORKER_BROKER_URL=BROKERS["rabbitmq"],
               SAGAWORKER_QUEUE=f"sw-start-{uuid.uuid4().hex[:6]}",
               SAGAWORKER_APPROVAL_SECRET=secret, SAGAWORKER_SWEEP_INTERVAL="0", **settings)
    return subprocess.run([sys.executable, "-m", "celery", "-A", "tests.apps.cluster", "worker",
                           "-c", "1", "--without-gossip", "--without-mingle"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)


def _refusal(proc: subprocess.CompletedProcess[str]) -> str:
    out = proc.stdout + proc.stderr
    assert proc.returncode == 3, out
    assert "Traceback" not in out
    lines = [ln for ln in proc.stderr.splitlines() if "refusing to start" in ln]
    assert len(lines) == 1, out
    return lines[0]


def test_a_worker_refuses_an_unreachable_database_masking_the_password(
        tmp_path: Path) -> None:
    """One line: the URL with its password masked, and what to check."""
    line = _refusal(_worker(tmp_path, UNREACHABLE, TEST_SECRET))
    assert "cannot reach the journal database" in line
    assert "postgresql+psycopg://shop:***@127.0.0.1:1/shop" in line
    assert "hunter2" not in line


def test_a_worker_refuses_a_journal_nobody_migrated(tmp_path: Path, fresh_pg_url: str) -> None:
    """Instead of starting and logging sweep_failed every 15 s."""
    line = _refusal(_worker(tmp_path, fresh_pg_url, TEST_SECRET))
    assert "db upgrade" in line and "missing" in line


def test_a_worker_refuses_an_older_schema(tmp_path: Path, fresh_pg_url: str) -> None:
    from sagaworker._journal.migrate import upgrade

    upgrade(fresh_pg_url, "0003")
    line = _refusal(_worker(tmp_path, fresh_pg_url, TEST_SECRET))
    assert "revision 0003, older than" in line and "db upgrade" in line


@pytest.mark.parametrize("secret", ["", "too-short"])
def test_a_worker_with_gated_tools_refuses_a_missing_or_short_secret(
        tmp_path: Path, pg_url: str, secret: str) -> None:
    """A gate nobody could open would leave flows stalled: refused, naming the setting and
    the gated tools, without echoing the secret."""
    line = _refusal(_worker(tmp_path, pg_url, secret))
    assert "SAGAWORKER_APPROVAL_SECRET" in line and "tests.apps.cluster.ship" in line
    assert "token_urlsafe" in line
    if secret:
        assert secret not in line


def test_a_worker_refuses_metrics_on_the_network_without_a_token(tmp_path: Path,
                                                                 pg_url: str) -> None:
    """Metrics bound to every interface with no token would show anyone the journal's
    figures: refused in one line naming both settings, before anything listens."""
    line = _refusal(_worker(tmp_path, pg_url, TEST_SECRET, SAGAWORKER_METRICS_PORT="9808",
                            SAGAWORKER_METRICS_ADDR="0.0.0.0"))
    assert "SAGAWORKER_METRICS_ADDR=0.0.0.0" in line and "SAGAWORKER_METRICS_TOKEN" in line


def test_a_producer_gets_a_configuration_error_not_raw_sql(fresh_pg_url: str) -> None:
    """The forgotten `db upgrade` and the wrong URL, as a producer meets them; the
    producer recovers once the schema is there (no restart)."""
    from celery import Celery

    from sagaworker._journal.migrate import upgrade

    sw = Sagaworker(Celery("p", broker="memory://"), settings=Settings(
        database_url=fresh_pg_url, approval_secret=TEST_SECRET))
    with pytest.raises(ConfigurationError, match="db upgrade"):
        sw.begin("p-1")
    upgrade(fresh_pg_url)
    sw.begin("p-1")
    assert sw.inspect("p-1").saga_id == "p-1"
    down = Sagaworker(Celery("q", broker="memory://"), settings=Settings(
        database_url=UNREACHABLE, approval_secret=TEST_SECRET))
    with pytest.raises(ConfigurationError, match=r"shop:\*\*\*@127\.0\.0\.1:1") as err:
        down.begin("p-2")
    assert "hunter2" not in str(err.value)


def test_the_cli_prints_one_line(tmp_path: Path) -> None:
    """`list` against a database that cannot be reached: one line on stderr, exit 1."""
    (tmp_path / "downapp.py").write_text(
        "from celery import Celery\nfrom sagaworker import Sagaworker\n"
        f"sw = Sagaworker(Celery('d', broker='memory://'), database_url={UNREACHABLE!r})\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("SAGAWORKER_")}
    env["PYTHONPATH"] = str(ROOT)
    proc = subprocess.run([sys.executable, "-m", "sagaworker.cli", "-A", "downapp", "list"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert proc.stderr.count("\n") == 1 and proc.stderr.startswith("error: cannot reach")
    assert "hunter2" not in proc.stderr


def test_a_worker_refuses_a_sqlite_journal_it_cannot_open(tmp_path: Path) -> None:
    """The embedded journal in a folder that does not exist: one line, exit 3, instead
    of a worker that logs ready and fails every task."""
    line = _refusal(_worker(tmp_path, "sqlite:////nonexistent-folder/sub/j.db", TEST_SECRET))
    assert "cannot reach the journal database" in line


@pytest.mark.parametrize("case", ["missing folder", "old revision"])
def test_a_producer_on_sqlite_gets_the_same_one_line_errors(tmp_path: Path, case: str) -> None:
    from celery import Celery

    from sagaworker._journal.migrate import upgrade

    url = "sqlite:////nonexistent-folder/sub/j.db"
    if case == "old revision":
        url = f"sqlite:///{tmp_path / 'old.db'}"
        upgrade(url, "0001")
    sw = Sagaworker(Celery("s", broker="memory://"), settings=Settings(
        database_url=url, approval_secret=TEST_SECRET))
    with pytest.raises(ConfigurationError,
                       match="cannot reach" if case == "missing folder" else "db upgrade"):
        sw.begin("s-1")


def test_worker_refuses_to_start_with_a_pickle_serializer(tmp_path: Path) -> None:
    """A real `celery worker` on an app configured with pickle exits 3 and names it."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SAGAWORKER_")}
    env.update(PYTHONPATH=str(ROOT), TESTS_CONFIG_APP_WORKER="1", TESTS_APP_WORKER="0",
               TEST_TASK_SERIALIZER="pickle", SAGAWORKER_BROKER_URL="memory://",
               SAGAWORKER_DATABASE_URL=f"sqlite:///{tmp_path / 'p.db'}",
               SAGAWORKER_BROKER_FOLDER=str(tmp_path / "broker"))
    proc = subprocess.run([sys.executable, "-m", "celery", "-A", "tests.apps.configured", "worker",
                           "-P", "solo", "--without-mingle", "--without-gossip"],
                          env=env, cwd=tmp_path, capture_output=True, timeout=60)
    err = proc.stderr.decode()
    assert proc.returncode == 3, err[-2000:]
    assert "refusing to start the worker" in err and "task_serializer='pickle'" in err


def test_worker_refuses_to_start(tmp_path: Path) -> None:
    """A worker whose tools fail validation exits non-zero at boot, naming the tool."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SAGAWORKER_")}
    env.update(PYTHONPATH=str(ROOT), SAGAWORKER_DATABASE_URL=f"sqlite:///{tmp_path / 'b.db'}",
               SAGAWORKER_BROKER_FOLDER=str(tmp_path / "broker"))
    proc = subprocess.run([sys.executable, "-m", "celery", "-A", "tests.apps.bad", "worker",
                           "-c", "1", "--without-mingle", "--without-gossip"],
                          env=env, cwd=tmp_path, capture_output=True, timeout=60)
    assert proc.returncode != 0
    err = proc.stderr.decode()
    assert "reserve_inventory" in err and "release_inventory" in err


def test_free_text_with_a_nul_is_journaled_on_postgresql(pg_url: str) -> None:
    """A reason, an abort's reason, an error text holding a NUL: PostgreSQL refuses the
    character with a raw error, so the journal writes it as ``\\x00`` instead."""
    from celery import Celery

    sw = Sagaworker(Celery("nul", broker="memory://"), settings=Settings(
        database_url=pg_url, approval_secret=TEST_SECRET))
    sw.rt.bus.send_failure = lambda *a, **k: True  # type: ignore[method-assign]
    saga_id = f"nul-{uuid.uuid4().hex[:8]}"
    sw.begin(saga_id)
    sw.abort(saga_id, reason="card\x00declined", actor="op")
    assert sw.inspect(saga_id).reason == "aborted by op: card\\x00declined"
    with pytest.raises(SagaworkerError, match="NUL"):
        sw.abort(saga_id, reason="again", actor="o\x00p")


@pytest.mark.parametrize("keys", ["", "other"])
def test_a_worker_without_the_journals_key_refuses_to_start(tmp_path: Path, fresh_pg_url: str,
                                                            keys: str) -> None:
    """A journal whose values are sealed with a key: a worker with no key, or another one,
    would run steps (the claim reads no sealed column) and write their results in clear or
    under a key nobody else has. It refuses to start, naming the setting, never the key."""
    from celery import Celery
    from cryptography.fernet import Fernet

    from sagaworker._base.crypto import fingerprint
    from sagaworker._journal.migrate import upgrade

    upgrade(fresh_pg_url)
    key = Fernet.generate_key().decode()
    producer = Sagaworker(Celery("p", broker="memory://"), settings=Settings(
        database_url=fresh_pg_url, encryption_keys=key))
    producer.check_ready()  # the journal now names the key its values are sealed with
    other = Fernet.generate_key().decode() if keys else ""
    line = _refusal(_worker(tmp_path, fresh_pg_url, TEST_SECRET,
                            SAGAWORKER_ENCRYPTION_KEYS=other))
    assert "SAGAWORKER_ENCRYPTION_KEYS" in line and fingerprint(key) in line
    assert key not in line and (not other or other not in line)


NO_BROKER_APP = (
    "from celery import Celery\nfrom sagaworker import Sagaworker\n"
    "app = Celery('nobroker')\nsw = Sagaworker(app)\n\n"
    "@sw.tool()\ndef lookup(sku: str) -> str:\n    return sku\n")


def test_a_database_journal_with_no_broker_is_refused_naming_the_setting(
        tmp_path: Path, pg_url: str) -> None:
    """A real database and no broker (neither SAGAWORKER_BROKER_URL nor the app's
    broker_url): the worker exits 3 in one line naming SAGAWORKER_BROKER_URL, and a
    producer gets a ConfigurationError saying the same, instead of messages left in a
    folder of this host that no worker reads."""
    from celery import Celery

    (tmp_path / "nobroker.py").write_text(NO_BROKER_APP)
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("SAGAWORKER_", "CELERY_"))}
    env.update(PYTHONPATH=f"{tmp_path}:{ROOT}", SAGAWORKER_DATABASE_URL=pg_url)
    proc = subprocess.run([sys.executable, "-m", "celery", "-A", "nobroker", "worker", "-c",
                           "1", "--without-gossip", "--without-mingle"], cwd=tmp_path,
                          env=env, capture_output=True, text=True, timeout=120)
    assert "SAGAWORKER_BROKER_URL" in _refusal(proc)
    producer = Sagaworker(Celery("nobroker-producer"), settings=Settings(database_url=pg_url))
    with pytest.raises(ConfigurationError, match="SAGAWORKER_BROKER_URL"):
        producer.begin("never-begun")
    assert producer.journal.saga_row("never-begun") is None
    producer.journal.engine.dispose()


def test_the_embedded_journal_keeps_the_embedded_broker(tmp_path: Path) -> None:
    """With the embedded SQLite journal and no broker, nothing is refused (the demo)."""
    from celery import Celery

    sw = Sagaworker(Celery("embedded"), settings=Settings(
        database_url=f"sqlite:///{tmp_path / 'j.db'}", broker_folder=str(tmp_path / "b")))
    sw.journal.create_all()
    assert sw.begin("e-1").saga_id == "e-1"


def test_a_worker_with_another_approval_secret_refuses_to_start(
        tmp_path: Path, pg_url: str) -> None:
    """The journal's approvals are made with TEST_SECRET (its fingerprint recorded); a
    worker with gated tools and another secret exits 3 in one line naming both
    fingerprints: it would run steps approved with a secret it does not hold."""
    from celery import Celery

    from sagaworker._producer.signer import approval_fingerprint

    recorder = Sagaworker(Celery("rec", broker="memory://"), settings=Settings(
        database_url=pg_url, approval_secret=TEST_SECRET))
    recorder.gate.checked_signer()
    recorder.journal.engine.dispose()
    other = "another-approval-secret-" + "9" * 32
    line = _refusal(_worker(tmp_path, pg_url, other))
    assert "SAGAWORKER_APPROVAL_SECRET" in line
    assert approval_fingerprint(TEST_SECRET) in line and approval_fingerprint(other) in line
    assert other not in line
