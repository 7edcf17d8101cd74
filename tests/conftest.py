"""Fixtures: one per real service. Locally a missing service skips; with CI=true it fails."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import time
import uuid
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from sagaworker import Sagaworker, Settings

ROOT = Path(__file__).resolve().parent.parent
CI = os.environ.get("CI") == "true"
PG_ADMIN = "postgresql+psycopg://root@127.0.0.1:5432/postgres"
#: approval secrets of the test settings (at least 32 bytes, as the settings demand)
TEST_SECRET = "test-secret-0123456789abcdefghijklmnop"
UNIT_SECRET = "unit-secret-0123456789abcdefghijklmnop"
#: this test run's own: a RabbitMQ vhost and a Redis database (never the default ones a
#: developer's own app may use), unless SAGAWORKER_TEST_AMQP_URL/_REDIS_URL name others
RUN_ID = uuid.uuid4().hex[:8]
_AMQP = os.environ.get("SAGAWORKER_TEST_AMQP_URL")
_VHOST = None if _AMQP else f"sw-test-{os.getpid()}-{RUN_ID}"
_REDIS = os.environ.get("SAGAWORKER_TEST_REDIS_URL")
BROKERS = {"rabbitmq": _AMQP or f"amqp://guest:guest@127.0.0.1:5672/{_VHOST}",
           "redis": _REDIS or "redis://127.0.0.1:6379/15"}  # (the db own_brokers claims)
#: a broker URL this run must not use, and why (its tests skip, or fail with CI=true)
_UNUSABLE: dict[str, str] = {}
#: the key that says which run holds a Redis database, and its value for this run
_REDIS_MARK, _REDIS_OWNER = "sagaworker-test-run", f"{os.getpid()}-{RUN_ID}"


def _rabbitmqctl(*args: str) -> bool:
    try:
        return subprocess.run(["rabbitmqctl", "-q", *args], capture_output=True,
                              timeout=60).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def _reap_vhosts() -> None:
    """The vhosts of earlier runs that were killed (their test process is gone)."""
    if _VHOST is None:
        return
    try:
        names = subprocess.run(["rabbitmqctl", "-q", "list_vhosts"], capture_output=True,
                               text=True, timeout=60).stdout.split()
    except (OSError, subprocess.TimeoutExpired):
        return
    for name in names:
        parts = name.split("-")
        if name.startswith("sw-test-") and len(parts) == 4 and parts[2].isdigit() \
                and not os.path.exists(f"/proc/{parts[2]}"):
            _rabbitmqctl("delete_vhost", name)


def db_name(prefix: str) -> str:
    """A PostgreSQL database name of this test process's own: its pid in it, so that a
    later run can tell (and drop) what a killed run left (``_reap_databases``)."""
    return f"{prefix}_{os.getpid()}_{uuid.uuid4().hex[:8]}"


_RUN_DB = re.compile(r"^sw_[a-z]+_(\d+)_[0-9a-f]{8}$")


def _reap_databases() -> list[str]:
    """Drop the databases of earlier runs that were killed (their test process is gone):
    each test database names its run's pid (``db_name``). Those of a live run stay."""
    try:
        import psycopg

        with psycopg.connect("host=127.0.0.1 port=5432 user=root dbname=postgres",
                             autocommit=True, connect_timeout=3) as c:
            names = [r[0] for r in c.execute("SELECT datname FROM pg_database")]
            dead = [n for n in names if (m := _RUN_DB.match(n))
                    and not os.path.exists(f"/proc/{m.group(1)}")]
            for name in dead:
                c.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
    except Exception:  # (no PostgreSQL here: the tests that need it say so)
        return []
    return dead


@pytest.fixture(scope="session", autouse=True)
def own_brokers() -> Iterator[None]:
    """The run's RabbitMQ vhost, made for it and deleted with it (with every queue a test
    left: an interrupted run leaks no queue into the default vhost), and a Redis database
    that was empty, claimed for the run and flushed at its end. Never the default vhost or
    a database someone else's data is in: without rabbitmqctl here (a remote broker) the
    RabbitMQ tests skip (fail with CI=true) and say to set SAGAWORKER_TEST_AMQP_URL. The
    databases, vhosts and Redis databases killed runs left are dropped first."""
    _reap_databases()
    _reap_vhosts()
    made = _VHOST is not None and _rabbitmqctl("add_vhost", _VHOST) and _rabbitmqctl(
        "set_permissions", "-p", _VHOST, "guest", ".*", ".*", ".*")
    if _VHOST is not None and not made:
        _UNUSABLE[BROKERS["rabbitmq"]] = (
            f"rabbitmqctl could not make this run's vhost {_VHOST!r} (set "
            "SAGAWORKER_TEST_AMQP_URL to an amqp:// URL of a vhost of your own)")
    claimed = _REDIS is None and _claim_redis_db()
    yield
    if made:
        _rabbitmqctl("delete_vhost", str(_VHOST))
    if claimed:
        with contextlib.suppress(Exception):
            client = _redis(BROKERS["redis"])
            if client.get(_REDIS_MARK) == _REDIS_OWNER.encode():
                client.flushdb()


def _redis(url: str) -> Any:
    import redis

    return redis.Redis.from_url(url, socket_connect_timeout=3)


#: the Redis database this run claimed (its mark is set again after a Redis restart)
_CLAIMED: list[str] = []


def remark_redis() -> None:
    """After the fault tests restarted Redis (which keeps nothing): the run's mark again,
    so the database stays this run's (and is flushed at its end)."""
    if _CLAIMED:
        _redis(_CLAIMED[-1]).set(_REDIS_MARK, _REDIS_OWNER, nx=True)


def _claim_redis_db() -> bool:
    """Point BROKERS["redis"] at a database of this run's own: one that is empty (or that a
    killed run left, flushed first), marked with this run's pid; False without Redis (its
    tests say so) or without such a database (they say what to set)."""
    try:
        for db in range(1, 16):
            url = f"redis://127.0.0.1:6379/{db}"
            client = _redis(url)
            owner = (client.get(_REDIS_MARK) or b"").decode()
            if owner and not os.path.exists(f"/proc/{owner.split('-')[0]}"):
                client.flushdb()  # a killed run's
            if client.dbsize() == 0 and client.set(_REDIS_MARK, _REDIS_OWNER, nx=True):
                BROKERS["redis"] = url
                _CLAIMED.append(url)
                return True
    except Exception:  # (no Redis here: the tests that need it say so)
        return False
    _UNUSABLE[BROKERS["redis"]] = ("no Redis database 1-15 is empty for this run (set "
                                   "SAGAWORKER_TEST_REDIS_URL to a database of your own)")
    return False


#: make slow: every test on both brokers (make test runs a test marked one_broker on one)
BOTH_BROKERS = os.environ.get("SAGAWORKER_TEST_BOTH_BROKERS") == "1"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """A test marked ``one_broker`` keeps one of its broker variants in ``make test``
    (which must stay under its budget): the one its module's path picks, so a module's
    broker-parametrized fixtures start on one broker only, and each broker takes its share
    of the modules. ``make slow`` runs them on both."""
    if BOTH_BROKERS:
        return
    names = sorted(BROKERS)
    keep: list[pytest.Item] = []
    dropped: list[pytest.Item] = []
    for item in items:
        spec = getattr(item, "callspec", None)
        broker = None if spec is None else next(
            (v for v in spec.params.values() if isinstance(v, str) and v in BROKERS), None)
        if broker is not None and item.get_closest_marker("one_broker") is not None:
            module = item.nodeid.split("::")[0]
            if broker != names[zlib.crc32(module.encode()) % len(names)]:
                dropped.append(item)
                continue
        keep.append(item)
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = keep


def need(service: str, check: Callable[[], Any]) -> None:
    try:
        check()
    except Exception as exc:
        msg = f"{service} is not reachable ({type(exc).__name__}: {exc})"
        if CI:
            pytest.fail(f"{msg}; CI=true requires it", pytrace=False)
        pytest.skip(msg)


def _pg() -> None:
    import psycopg

    psycopg.connect("host=127.0.0.1 port=5432 user=root dbname=postgres",
                    connect_timeout=3).close()


def _broker(url: str) -> Callable[[], None]:
    def check() -> None:
        from kombu import Connection

        if url in _UNUSABLE:
            raise ConnectionError(_UNUSABLE[url])

        with Connection(url, connect_timeout=3) as c:
            c.ensure_connection(max_retries=1, timeout=3)
    return check


@pytest.fixture(scope="session")
def pg_url() -> Iterator[str]:
    """A fresh PostgreSQL database for this test session, migrated with Alembic."""
    need("PostgreSQL", _pg)
    import psycopg

    name = db_name("sw_test")
    with psycopg.connect("host=127.0.0.1 user=root dbname=postgres", autocommit=True) as c:
        c.execute(f'CREATE DATABASE "{name}"')
    url = f"postgresql+psycopg://root@127.0.0.1:5432/{name}"
    from sagaworker._journal.migrate import upgrade

    upgrade(url)
    yield url
    with psycopg.connect("host=127.0.0.1 user=root dbname=postgres", autocommit=True) as c:
        c.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@pytest.fixture
def fresh_pg_url() -> Iterator[str]:
    """An empty PostgreSQL database (not migrated), dropped afterwards."""
    need("PostgreSQL", _pg)
    import psycopg

    name = db_name("sw_cli")
    with psycopg.connect("host=127.0.0.1 user=root dbname=postgres", autocommit=True) as c:
        c.execute(f'CREATE DATABASE "{name}"')
    yield f"postgresql+psycopg://root@127.0.0.1:5432/{name}"
    with psycopg.connect("host=127.0.0.1 user=root dbname=postgres", autocommit=True) as c:
        c.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def worker_env(settings: Settings, default_queue: str, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SAGAWORKER_")}
    env.update({
        "PYTHONPATH": str(ROOT), "TESTS_APP_WORKER": "1", "TEST_DEFAULT_QUEUE": default_queue,
        "SAGAWORKER_DATABASE_URL": settings.database_url,
        "SAGAWORKER_BROKER_URL": settings.broker_url,
        "SAGAWORKER_BROKER_FOLDER": settings.broker_folder,
        "SAGAWORKER_QUEUE": settings.queue,
        "SAGAWORKER_COMPENSATION_RETRIES": str(settings.compensation_retries),
        "SAGAWORKER_COMPENSATION_BACKOFF": str(settings.compensation_backoff),
        "SAGAWORKER_APPROVAL_SECRET": (settings.approval_secret.get_secret_value()
                                       if settings.approval_secret else ""),
        "SAGAWORKER_ENCRYPTION_KEYS": (settings.encryption_keys.get_secret_value()
                                       if settings.encryption_keys else ""),
        "SAGAWORKER_REDELIVER_AFTER": str(settings.redeliver_after),
        "SAGAWORKER_RELAY_AFTER": str(settings.relay_after),
        "SAGAWORKER_SWEEP_INTERVAL": str(settings.sweep_interval),
        "SAGAWORKER_LOG_FORMAT": "json",
        "SAGAWORKER_METRICS_PORT": str(settings.metrics_port),
        # the worker ends itself when this test process is gone (killed, interrupted):
        # no worker of an ended run keeps consuming (tests/apps/cluster.py)
        "TESTS_PARENT_PID": str(os.getpid()),
        # a test tool's own Redis client uses the run's database too
        "TESTS_REDIS_URL": BROKERS["redis"],
    })
    env.update(extra)
    return env


class Cluster:
    """Real `celery worker` processes plus a producer Sagaworker in the test process."""

    def __init__(self, settings: Settings, tmp: Path, broker: str) -> None:
        from tests.apps.cluster import build

        self.settings, self.tmp, self.broker = settings, tmp, broker
        self.default_queue = f"t-{uuid.uuid4().hex[:8]}"
        os.environ["TEST_DEFAULT_QUEUE"] = self.default_queue
        self.app, self.sw = build(settings)
        self.workers: list[tuple[subprocess.Popen[bytes], Path]] = []

    def start_worker(self, concurrency: int = 2, pool: str = "prefork",
                     args: tuple[str, ...] = (), **extra_env: str) -> subprocess.Popen[bytes]:
        from sagaworker.cli.demo import start_worker

        n = len(self.workers) + 1
        log = self.tmp / f"worker{n}.log"
        proc = start_worker("tests.apps.cluster", worker_env(self.settings, self.default_queue,
                                                     **extra_env),
                            log, concurrency=concurrency, pool=pool,
                            extra=("-n", f"w{n}-{uuid.uuid4().hex[:4]}@%h", *args))
        self.workers.append((proc, log))
        return proc

    def tool(self, name: str) -> Any:
        """The Celery task of a test tool (tests/apps/cluster.py) as the producer sees it."""
        return self.sw.registry.tool(f"tests.apps.cluster.{name}").task

    def stop_workers(self) -> None:
        for proc, _ in self.workers:
            if proc.poll() is None:
                proc.terminate()
        for proc, _ in self.workers:
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)
        self.workers.clear()

    def close(self) -> None:
        """At teardown: the workers killed (process group: the pool's children too; a warm
        shutdown takes 2-3 s a worker, spent on nothing a test checks), then the queues
        deleted. A test that stops its workers to check what a stop does uses
        ``stop_workers``."""
        for proc, _ in self.workers:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)  # start_worker: a session of its own
        for proc, _ in self.workers:
            proc.wait(20)
        self.workers.clear()
        self.cleanup_queues()

    def events(self, saga_id: str | None = None) -> list[dict[str, Any]]:
        """Every JSON log line the workers wrote (for one saga, if given)."""
        out = []
        for _, log in self.workers:
            for line in log.read_text(errors="replace").splitlines():
                if not line.startswith("{"):
                    continue
                try:
                    ev = json.loads(line)
                except ValueError:
                    continue
                if saga_id is None or ev.get("saga_id") == saga_id:
                    out.append(ev)
        return out

    def ledger(self, key: str) -> list[Any]:
        from tests.apps.cluster import rows

        return rows(self.settings.database_url, key)

    def cleanup_queues(self) -> None:
        """At teardown: the cluster's queues deleted, and the producer's pooled journal
        connections closed (a session's clusters would otherwise keep more connections
        idle than PostgreSQL's default 100 allows)."""
        from kombu import Connection

        self.sw.rt.reset_engine()

        names = [self.default_queue, self.settings.queue]
        try:
            with Connection(self.settings.broker_url, connect_timeout=3) as c:
                ch = c.channel()
                for n in names:
                    try:
                        ch.queue_delete(n)
                    except Exception:
                        ch = c.channel()
        except Exception:
            pass


def new_settings(database_url: str, broker_url: str, tmp: Path, **over: Any) -> Settings:
    base: dict[str, Any] = {
        "database_url": database_url, "broker_url": broker_url,
        "broker_folder": str(tmp / "broker"), "queue": f"sw-{uuid.uuid4().hex[:8]}",
        "compensation_retries": 2, "compensation_backoff": 0.05,
        "approval_secret": TEST_SECRET, "redeliver_after": 30, "relay_after": 5,
        "sweep_interval": 1,
    }
    base.update(over)
    return Settings(**base)


def _cluster(request: pytest.FixtureRequest, pg_url: str,
             tmp_path_factory: pytest.TempPathFactory, label: str,
             **over: Any) -> Iterator[Cluster]:
    broker = BROKERS[request.param]
    need(request.param, _broker(broker))
    tmp = tmp_path_factory.mktemp(f"{label}-{request.param}")
    c = Cluster(new_settings(pg_url, broker, tmp, **over), tmp, request.param)
    c.start_worker()
    yield c
    c.close()


@pytest.fixture(scope="module", params=sorted(BROKERS))
def cluster(request: pytest.FixtureRequest, pg_url: str,
            tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    """One worker (prefork, 2 processes) on PostgreSQL and a real broker."""
    yield from _cluster(request, pg_url, tmp_path_factory, "cluster")


@pytest.fixture(scope="module", params=sorted(BROKERS))
def crash_cluster(request: pytest.FixtureRequest, pg_url: str,
                  tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    """Like `cluster`, with short leases and a fast sweeper, for crash and loss scenarios."""
    yield from _cluster(request, pg_url, tmp_path_factory, "crash", redeliver_after=4,
                        relay_after=2, sweep_interval=1)


def wait_for(check: Callable[[], Any], timeout: float = 30, what: str = "condition") -> Any:
    """Await a condition (polling), failing the test with `what` when it never holds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = check()
        if got:
            return got
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


def uid(prefix: str = "s") -> str:
    return f"{prefix}-{uuid.uuid4().hex[:10]}"


@pytest.fixture
def sqlite_sw(tmp_path: Path) -> Iterator[Sagaworker]:
    """A Sagaworker on a temporary SQLite journal and kombu's memory transport."""
    from celery import Celery

    app = Celery("unit", broker="memory://")
    s = Settings(database_url=f"sqlite:///{tmp_path / 'j.db'}", broker_url="memory://",
                 approval_secret=UNIT_SECRET, broker_folder=str(tmp_path / "b"))
    yield Sagaworker(app, settings=s)

