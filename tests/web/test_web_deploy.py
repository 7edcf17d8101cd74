"""The deploy story, with real processes: the example web app on gunicorn (the
Procfile's ``web`` line), a real ``sagaworker worker``, PostgreSQL and RabbitMQ.

The web app starts each order's flow and returns; killing it (``kill -9``, not a graceful
stop) with orders waiting at their approval gate, or before their charge has run, loses
nothing: after a restart every order completes (or, declined, compensates) and none stays
RUNNING.
"""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from celery import Celery

from sagaworker import Phase, SagaStatus, Sagaworker
from sagaworker.web.auth import hash_token
from tests.conftest import BROKERS, _broker, _pg, db_name, need, uid, wait_for

pytestmark = pytest.mark.services

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
SECRET = "deploy-test-secret-0123456789abcdefghij"
#: the operator the web app knows (SAGAWORKER_WEB_TOKENS): decisions are journaled as alice
OPERATOR_TOKEN = "swop_deploy-test-operator-0123456789abcdefghij"
T = 90


def procfile(process: str) -> list[str]:
    for line in (ROOT / "Procfile").read_text().splitlines():
        name, _, cmd = line.partition(":")
        if name.strip() == process:
            return shlex.split(cmd)
    raise AssertionError(f"no {process!r} line in the Procfile")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def kill9(proc: subprocess.Popen[bytes]) -> None:
    """kill -9 the process and everything it started (its own session)."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(10)


@dataclass
class Deployment:
    """One deployment of the example: its database, its queues, its processes."""

    tmp: Path
    database_url: str
    env: dict[str, str]
    port: int = field(default_factory=free_port)
    web: subprocess.Popen[bytes] | None = None
    worker: subprocess.Popen[bytes] | None = None
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)

    def run(self, argv: list[str]) -> None:
        got = subprocess.run(argv, cwd=self.tmp, env=self.env, capture_output=True, text=True,
                             timeout=180, check=False)
        assert got.returncode == 0, got.stdout[-2000:] + got.stderr[-2000:]

    def spawn(self, argv: list[str], log: str) -> subprocess.Popen[bytes]:
        out = open(self.tmp / log, "ab")  # noqa: SIM115 - the process owns it
        proc = subprocess.Popen(argv, cwd=self.tmp, env={**self.env, "PORT": str(self.port)},
                                stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        self.procs.append(proc)
        return proc

    def start_web(self) -> None:
        """The Procfile's web line (gunicorn binds $PORT), up once /healthz answers."""
        self.web = self.spawn(procfile("web"), "web.log")
        wait_for(lambda: self.healthy() or self.web_died(), 60, "the web app to answer")
        assert self.healthy(), (self.tmp / "web.log").read_text()[-3000:]

    def web_died(self) -> bool:
        assert self.web is not None
        return self.web.poll() is not None

    def healthy(self) -> bool:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/healthz", timeout=2):
                return True
        except (OSError, urllib.error.URLError):
            return False

    def start_worker(self) -> None:
        """The Procfile's worker line, up once Celery says it is ready."""
        log = self.tmp / "worker.log"
        self.worker = self.spawn([*procfile("worker"), "-c", "2", "--without-gossip",
                                  "--without-mingle", "-n", f"deploy-{uuid.uuid4().hex[:6]}@%h"],
                                 "worker.log")
        wait_for(lambda: b" ready." in log.read_bytes() or self.worker.poll() is not None,
                 90, "the worker to be ready")
        assert self.worker.poll() is None, log.read_text()[-3000:]

    def call(self, method: str, path: str, body: Any = None) -> tuple[int, Any]:
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(f"http://127.0.0.1:{self.port}{path}", data=data,
                                     method=method,
                                     headers={"Content-Type": "application/json",
                                              "Authorization": f"Bearer {OPERATOR_TOKEN}"})
        try:
            with urllib.request.urlopen(req, timeout=30) as resp:
                return resp.status, json.loads(resp.read())
        except urllib.error.HTTPError as exc:
            return exc.code, json.loads(exc.read())

    def post_order(self, order_id: str, card: str = "card-4242") -> str:
        status, body = self.call("POST", "/orders", {
            "order_id": order_id, "sku": "sku-42", "quantity": 1, "card": card,
            "amount_cents": 1000})
        assert status == 202, body
        saga_id: str = body["saga_id"]
        return saga_id

    def approve_all(self, saga_ids: list[str]) -> None:
        """Approve every gate of these sagas through the web app's API."""
        def pending() -> list[dict[str, Any]]:
            status, body = self.call("GET", "/approvals")
            assert status == 200, body
            return [p for p in body["approvals"] if p["saga_id"] in saga_ids]

        reqs = wait_for(lambda: len(pending()) == len(saga_ids) and pending(), T,
                        "every gate to be pending")
        for p in reqs:
            status, body = self.call("POST", "/approvals/approve",
                                     {"token": p["token"]})
            assert status == 200, body

    def stop(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGTERM)
                except ProcessLookupError:
                    continue
        for proc in self.procs:
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                kill9(proc)


@pytest.fixture
def deployment(tmp_path: Path) -> Iterator[Deployment]:
    """A fresh PostgreSQL database and queues of its own on RabbitMQ; the Procfile's
    release step (``sagaworker db upgrade``) run on it, as a deploy does."""
    need("PostgreSQL", _pg)
    need("rabbitmq", _broker(BROKERS["rabbitmq"]))
    import psycopg

    name = db_name("sw_deploy")
    with psycopg.connect("host=127.0.0.1 user=root dbname=postgres", autocommit=True) as c:
        c.execute(f'CREATE DATABASE "{name}"')
    url = f"postgresql+psycopg://root@127.0.0.1:5432/{name}"
    tag = uuid.uuid4().hex[:8]
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("SAGAWORKER_", "CELERY_"))}
    env.update({
        "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}", "PYTHONPATH": str(ROOT),
        "SAGAWORKER_DATABASE_URL": url, "SAGAWORKER_BROKER_URL": BROKERS["rabbitmq"],
        "SAGAWORKER_QUEUE": f"sw-deploy-{tag}", "CELERY_TASK_DEFAULT_QUEUE": f"deploy-{tag}",
        "SAGAWORKER_APPROVAL_SECRET": SECRET, "SAGAWORKER_LOG_FORMAT": "json",
        "SAGAWORKER_SWEEP_INTERVAL": "1", "SAGAWORKER_RELAY_AFTER": "3",
        "SAGAWORKER_WEB_TOKENS": f"alice:{hash_token(OPERATOR_TOKEN)}"})
    d = Deployment(tmp_path, url, env)
    d.run(procfile("release"))  # the journal and the example's own tables
    try:
        yield d
    finally:
        d.stop()
        _delete_queues([env["SAGAWORKER_QUEUE"], env["CELERY_TASK_DEFAULT_QUEUE"]])
        with psycopg.connect("host=127.0.0.1 user=root dbname=postgres",
                             autocommit=True) as c:
            c.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def _delete_queues(names: list[str]) -> None:
    from kombu import Connection

    try:
        with Connection(BROKERS["rabbitmq"], connect_timeout=3) as conn:
            for n in names:
                with contextlib.suppress(Exception):
                    conn.channel().queue_delete(n)
    except Exception:
        pass


def probe(d: Deployment) -> Sagaworker:
    """A Sagaworker of the test's own on the deployment's journal, to inspect it."""
    return Sagaworker(Celery("probe", broker=BROKERS["rabbitmq"]), database_url=d.database_url)


def statuses(sw: Sagaworker, saga_ids: list[str]) -> dict[str, SagaStatus]:
    return {s: sw.inspect(s).status for s in saga_ids}


def test_orders_waiting_at_their_gate_survive_a_kill_9_of_the_web_app(
        deployment: Deployment) -> None:
    """Orders wait at their approval gate; the web app is killed (kill -9) and started
    again; the gates approved through it, every order completes, its parcel sent once."""
    d = deployment
    d.start_worker()
    d.start_web()
    ids = [d.post_order(uid("gate")) for _ in range(4)]
    sw = probe(d)
    wait_for(lambda: set(statuses(sw, ids).values()) == {SagaStatus.AWAITING_APPROVAL}, T,
             "every order to wait at its gate")
    assert d.web is not None
    kill9(d.web)
    assert not d.healthy()
    d.start_web()  # the deploy: a new web process, nothing handed over
    d.approve_all(ids)
    wait_for(lambda: set(statuses(sw, ids).values()) == {SagaStatus.COMPLETED}, T,
             "every order to complete")
    for saga_id in ids:
        rec = sw.inspect(saga_id)
        assert [e.phase for e in rec.entries] == [Phase.EXECUTED] * 4, rec
        assert rec.entries[3].approved_by == "alice"
        assert sw.get(saga_id).wait(timeout=5).value["shipment"].startswith("ship-")
    from sqlalchemy import func, select

    from tasks._store import shipments

    with sw.journal.engine.connect() as conn:
        sent = conn.execute(select(shipments.c.order_id, func.count())
                            .group_by(shipments.c.order_id)).all()
    assert sorted(n for _, n in sent) == [1] * 4


def test_orders_posted_before_a_kill_9_and_before_their_charge_still_finish(
        deployment: Deployment) -> None:
    """Orders are posted with no worker running yet (so no charge has run) and the web app
    is killed (kill -9) right after; once a worker runs, every order reaches its gate or,
    declined, compensates; after a restart of the web app and the approvals every order
    is terminal: none stays RUNNING."""
    d = deployment
    d.start_web()
    good = [d.post_order(uid("early")) for _ in range(3)]
    declined = d.post_order(uid("declined"), card="declined-0042")
    assert d.web is not None
    kill9(d.web)
    sw = probe(d)
    assert all(sw.inspect(s).entries == [] for s in [*good, declined])  # nothing ran yet
    d.start_worker()
    wait_for(lambda: statuses(sw, [declined])[declined] is SagaStatus.COMPENSATED, T,
             "the declined order to compensate")
    undone = sw.inspect(declined)
    assert [(o.seq, o.result.value) for o in undone.report.outcomes] == [
        (2, "SKIPPED"), (1, "COMPENSATED")]
    d.start_web()
    d.approve_all(good)
    wait_for(lambda: set(statuses(sw, good).values()) == {SagaStatus.COMPLETED}, T,
             "every good order to complete")
    assert not [r for r in sw.sagas(limit=50) if not r.status.terminal]


def test_the_examples_tables_are_created_once_by_concurrent_releases() -> None:
    """Four release steps at once on a fresh PostgreSQL database create the example's
    tables without a `type "example_holds" already exists` (they take turns on a lock)."""
    need("PostgreSQL", _pg)
    import threading

    import psycopg
    from sqlalchemy import create_engine, inspect

    from tasks._store import create_tables

    name = db_name("sw_tables")
    with psycopg.connect("host=127.0.0.1 user=root dbname=postgres", autocommit=True) as c:
        c.execute(f'CREATE DATABASE "{name}"')
    url = f"postgresql+psycopg://root@127.0.0.1:5432/{name}"
    errors: list[BaseException] = []

    def release() -> None:
        try:
            create_tables(url)
        except BaseException as exc:
            errors.append(exc)

    try:
        threads = [threading.Thread(target=release) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert errors == []
        engine = create_engine(url)
        assert {"example_holds", "example_charges", "example_shipments"} <= set(
            inspect(engine).get_table_names())
        engine.dispose()
    finally:
        with psycopg.connect("host=127.0.0.1 user=root dbname=postgres",
                             autocommit=True) as c:
            c.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
