"""Sagas in Django's own transaction (``sagaworker.contrib.django``), through a real Django
project (tests/django_project) on PostgreSQL: its view creates an Order and starts a saga
in one ``transaction.atomic()`` block. A rollback leaves neither and sends nothing; a
commit runs the saga on real workers; a process killed right after the COMMIT leaves the
step to the relay and the flow to the sweeper. The journal's tables are in the Django
database, made by ``sagaworker db upgrade`` beside ``manage.py migrate``."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from types import ModuleType
from typing import Any

import pytest
from sqlalchemy import Engine, create_engine, text
from sqlalchemy.pool import NullPool

from sagaworker import ConfigurationError, Phase, SagaExists, SagaStatus, Sagaworker
from tests.conftest import ROOT, Cluster, uid, wait_for, worker_env

pytestmark = [pytest.mark.services, pytest.mark.one_broker]
T = 60
SETTINGS = "tests.django_project.shop.settings"


def project_env(settings_env: dict[str, str], database_url: str) -> dict[str, str]:
    """A process of the Django project: sagaworker's settings from the environment given,
    the journal's database from Django's DATABASES (no SAGAWORKER_DATABASE_URL)."""
    env = {k: v for k, v in settings_env.items()
           if k not in ("TESTS_APP_WORKER", "SAGAWORKER_DATABASE_URL")}
    env.update(DJANGO_SETTINGS_MODULE=SETTINGS, SHOP_DATABASE_URL=database_url,
               PYTHONPATH=str(ROOT))
    return env


@pytest.fixture(scope="module")
def dj(pg_url: str) -> Iterator[Sagaworker]:
    """Django set up in this process on the journal's database (``manage.py migrate``);
    a Sagaworker built from Django's settings, on kombu's memory transport."""
    import django
    from django.core.management import call_command

    from sagaworker.contrib.django import settings_from_django
    from tests.apps.cluster import build

    # Django is set up once per process; the variables go with the module (a worker
    # started later with DJANGO_SETTINGS_MODULE would load Celery's Django fixup)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("DJANGO_SETTINGS_MODULE", SETTINGS)
        mp.setenv("SHOP_DATABASE_URL", pg_url)
        django.setup()
        call_command("migrate", verbosity=0)
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv("SAGAWORKER_DATABASE_URL", raising=False)
        mp.setenv("SAGAWORKER_BROKER_URL", "memory://")
        yield build(settings_from_django())[1]


@pytest.fixture(scope="module")
def shop(dj: Sagaworker, crash_cluster: Cluster) -> Iterator[ModuleType]:
    """The project's ``sagas`` module, its Sagaworker built from Django's settings on this
    cluster's broker and queues (as the project's own processes would be)."""
    from sagaworker.contrib.django import settings_from_django
    from tests.apps.cluster import build

    env = project_env(worker_env(crash_cluster.settings, crash_cluster.default_queue),
                      crash_cluster.settings.database_url)
    with pytest.MonkeyPatch.context() as mp:
        for name in [n for n in os.environ if n.startswith("SAGAWORKER_")]:
            mp.delenv(name)
        for name, value in env.items():
            if name.startswith(("SAGAWORKER_", "TEST_", "DJANGO_")):
                mp.setenv(name, value)
        from tests.django_project.shop import sagas

        mp.setattr(sagas, "sw", build(settings_from_django())[1])
        assert sagas.sw.settings.database_url == crash_cluster.settings.database_url
        yield sagas


def spy(sw: Sagaworker, url: str, mp: pytest.MonkeyPatch) -> list[tuple[str, str, bool]]:
    """Every message ``sw`` sends for a saga: (what, id, its row already committed, as
    another connection sees it at the moment of the send)."""
    bus, probe = sw.rt.bus, create_engine(url, poolclass=NullPool)
    seen: list[tuple[str, str, bool]] = []

    def committed(sql: str, key: str) -> bool:
        with probe.connect() as c:
            return c.execute(text(sql), {"k": key}).first() is not None

    def step(saga_id: str, seq: int, tool: str, args: Any, kwargs: Any, task_id: str,
             queue: Any, **kw: Any) -> bool:
        seen.append(("step", task_id, committed(
            "SELECT 1 FROM sagaworker_entries WHERE task_id = :k", task_id)))
        return real_step(saga_id, seq, tool, args, kwargs, task_id, queue, **kw)

    def advance(saga_id: str) -> None:
        seen.append(("advance", saga_id, committed(
            "SELECT 1 FROM sagaworker_sagas WHERE saga_id = :k", saga_id)))
        real_advance(saga_id)

    real_step, real_advance = bus.publish_step, bus.send_advance
    mp.setattr(bus, "publish_step", step)
    mp.setattr(bus, "send_advance", advance)
    return seen


@pytest.fixture
def published(shop: ModuleType, crash_cluster: Cluster,
              monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, str, bool]]:
    return spy(shop.sw, crash_cluster.settings.database_url, monkeypatch)


def post(body: dict[str, Any]) -> Any:
    from django.test import Client

    return Client(raise_request_exception=False).post(
        "/orders", json.dumps(body), content_type="application/json")


def order_ids(key: str) -> list[str]:
    from tests.django_project.orders.models import Order

    return list(Order.objects.filter(id=key).values_list("id", flat=True))


def ledger(crash_cluster: Cluster, key: str) -> list[tuple[str, str]]:
    return [(r.kind, r.tool) for r in crash_cluster.ledger(key)]


# -- the view ---------------------------------------------------------------------------------

def test_the_view_rolled_back_leaves_neither_order_nor_saga(
        shop: ModuleType, crash_cluster: Cluster,
        published: list[tuple[str, str, bool]]) -> None:
    """The view raises after creating the order and starting its flow (or beginning a saga
    and enqueueing a step): a 500, no order, no saga, nothing sent."""
    for kind in ("flow", "steps"):
        key = uid(f"rb-{kind}")
        assert post({"id": key, "saga": kind, "fail": True}).status_code == 500
        assert order_ids(key) == []
        assert crash_cluster.sw.journal.saga_row(key) is None
    assert published == []


def test_the_view_committed_runs_the_flow(
        shop: ModuleType, crash_cluster: Cluster,
        published: list[tuple[str, str, bool]]) -> None:
    """The flow's advance is sent once, after the COMMIT (its saga row committed at the
    send); the workers run it to COMPLETED, its effects in order, the order beside it."""
    key = uid("ok")
    response = post({"id": key, "quantity": 2})
    assert response.status_code == 201, response.content
    assert published == [("advance", key, True)]
    result = crash_cluster.sw.get(key).wait(timeout=T)
    assert result.status is SagaStatus.COMPLETED
    assert result.value == {"a": "a-done", "b": "b-done", "c": "c-done"}
    assert ledger(crash_cluster, key) == [("effect", "a"), ("effect", "b"), ("effect", "c")]
    assert order_ids(key) == [key]


def test_the_view_committed_sends_its_step(
        shop: ModuleType, crash_cluster: Cluster,
        published: list[tuple[str, str, bool]]) -> None:
    """begin + enqueue in the view: the step is published after the COMMIT (its INTENT
    committed at the publish) and runs; the saga completes."""
    key = uid("steps")
    assert post({"id": key, "saga": "steps"}).status_code == 201
    (entry,) = crash_cluster.sw.inspect(key).entries
    assert published == [("step", entry.task_id, True)]
    saga = crash_cluster.sw.get(key)
    wait_for(lambda: crash_cluster.sw.inspect(key).entries[0].phase is Phase.EXECUTED, T,
             "the step")
    saga.complete()
    assert crash_cluster.sw.inspect(key).status is SagaStatus.COMPLETED
    assert crash_cluster.sw.inspect(key).metadata == {"order": key}
    assert ledger(crash_cluster, key) == [("effect", "a")]


# -- a process killed right after the COMMIT ----------------------------------------------------

KILLED_AFTER_COMMIT = textwrap.dedent("""
    import json, os, signal, sys

    import django

    django.setup()
    from django.test import Client

    from tests.django_project.orders.views import order_placed

    def kill(**_):  # the app's on_commit hook, registered before sagaworker's: dies there
        os.kill(os.getpid(), signal.SIGKILL)

    order_placed.connect(kill)
    response = Client().post("/orders", json.dumps({"id": sys.argv[1], "saga": sys.argv[2]}),
                             content_type="application/json")
    print("not killed", response.status_code)
""")


def killed_after_commit(crash_cluster: Cluster, key: str, kind: str) -> None:
    env = project_env(worker_env(crash_cluster.settings, crash_cluster.default_queue),
                      crash_cluster.settings.database_url)
    proc = subprocess.run([sys.executable, "-c", KILLED_AFTER_COMMIT, key, kind], env=env,
                          cwd=ROOT, capture_output=True, timeout=120)
    assert proc.returncode == -signal.SIGKILL, (proc.stdout + proc.stderr).decode()[-3000:]


def test_a_process_killed_after_the_commit_leaves_the_step_to_the_relay(
        shop: ModuleType, crash_cluster: Cluster) -> None:
    """The view's process is SIGKILLed by an on_commit hook that runs before sagaworker's:
    order, saga and INTENT are committed, no message went out; the relay sends the step."""
    key = uid("kill-step")
    killed_after_commit(crash_cluster, key, "steps")
    assert order_ids(key) == [key]
    rec = wait_for(lambda: (r := crash_cluster.sw.inspect(key)).entries
                   and r.entries[0].phase is Phase.EXECUTED and r, T, "the relayed step")
    assert [e.phase for e in rec.entries] == [Phase.EXECUTED]
    assert ledger(crash_cluster, key) == [("effect", "a")]
    relayed = [e for e in crash_cluster.events(key) if e.get("event") == "step_relayed"]
    assert relayed, "the step ran without the relay: it was published before the kill"


def test_a_process_killed_after_the_commit_leaves_the_flow_to_the_sweeper(
        shop: ModuleType, crash_cluster: Cluster) -> None:
    """The same kill after a flow's COMMIT: its advance was never sent; the sweeper sends
    it and the flow runs to COMPLETED."""
    key = uid("kill-flow")
    killed_after_commit(crash_cluster, key, "flow")
    assert order_ids(key) == [key]
    result = crash_cluster.sw.get(key).wait(timeout=T)
    assert result.status is SagaStatus.COMPLETED
    assert ledger(crash_cluster, key) == [("effect", "a"), ("effect", "b"), ("effect", "c")]
    resumed = [e for e in crash_cluster.events(key) if e.get("event") == "flow_resumed"]
    assert resumed, "the flow advanced without the sweeper: it was sent before the kill"


# -- Django's transaction, without workers -----------------------------------------------------

def visible(url: str, key: str) -> tuple[bool, bool]:
    """(the order, the saga) as another connection sees them: committed or not."""
    engine = create_engine(url)
    try:
        with engine.connect() as c:
            return (c.execute(text("SELECT 1 FROM orders_order WHERE id = :k"),
                              {"k": key}).first() is not None,
                    c.execute(text("SELECT 1 FROM sagaworker_sagas WHERE saga_id = :k"),
                              {"k": key}).first() is not None)
    finally:
        engine.dispose()


def test_nothing_commits_or_ends_djangos_transaction_early(
        dj: Sagaworker, monkeypatch: pytest.MonkeyPatch) -> None:
    """Inside atomic(), begin and enqueue (sagaworker's first use of Django's connection in
    the process) neither commit Django's transaction (another connection sees nothing)
    nor end it (Django still sees its order); the block's COMMIT makes both visible."""
    from django.db import connection, transaction

    import sagaworker.contrib.django as contrib
    from tests.django_project.orders.models import Order

    monkeypatch.setattr(contrib, "_engines", {})
    url, key = dj.settings.database_url, uid("early")
    with transaction.atomic():
        Order.objects.create(id=key, quantity=1)
        contrib.enqueue(contrib.begin(dj, key), "tests.apps.cluster.step", key, "a")
        assert visible(url, key) == (False, False)
        assert order_ids(key) == [key]
        assert connection.in_atomic_block and not connection.needs_rollback
    assert visible(url, key) == (True, True)


def test_enqueue_many_publishes_its_steps_after_the_commit(
        dj: Sagaworker, monkeypatch: pytest.MonkeyPatch) -> None:
    """begin + enqueue_many inside atomic(): nothing is sent inside the block; after its
    COMMIT each step is published, its INTENT already committed."""
    from django.db import transaction

    from sagaworker.contrib.django import begin, enqueue_many

    sent = spy(dj, dj.settings.database_url, monkeypatch)
    key = uid("many")
    with transaction.atomic():
        steps = enqueue_many(begin(dj, key), [("tests.apps.cluster.step", (key, n), {})
                                              for n in ("x", "y")])
        assert sent == []
    assert sent == [("step", s.task_id, True) for s in steps]
    assert [e.tool_name for e in dj.inspect(key).entries] == ["tests.apps.cluster.step"] * 2


def test_an_inner_atomic_rolled_back_drops_its_saga_and_its_message(
        dj: Sagaworker, monkeypatch: pytest.MonkeyPatch) -> None:
    """A flow started in an inner atomic() that rolls back: the outer block commits its
    order; the saga is gone and its advance is never sent (Django drops the savepoint's
    on_commit callbacks)."""
    from django.db import transaction

    from sagaworker.contrib.django import start
    from tests.apps.cluster import three_steps
    from tests.django_project.orders.models import Order

    sent = spy(dj, dj.settings.database_url, monkeypatch)
    key = uid("inner")
    with transaction.atomic():
        Order.objects.create(id=key, quantity=1)
        with pytest.raises(RuntimeError), transaction.atomic():
            start(dj, key, three_steps, key)
            raise RuntimeError("the inner block fails")
    assert visible(dj.settings.database_url, key) == (True, False)
    assert sent == []


def test_a_taken_id_leaves_djangos_transaction_usable(dj: Sagaworker) -> None:
    """SagaExists inside atomic() (the journal's write is in its own savepoint): Django's
    transaction is not broken, the app writes and commits its order."""
    from django.db import transaction

    from sagaworker.contrib.django import begin
    from tests.django_project.orders.models import Order

    key = uid("dup")
    dj.begin(key)
    with transaction.atomic():
        with pytest.raises(SagaExists):
            begin(dj, key)
        Order.objects.create(id=key, quantity=3)
    assert order_ids(key) == [key]


def test_outside_atomic_is_refused(dj: Sagaworker) -> None:
    """Outside atomic() Django commits each statement on its own: there is no transaction
    to share, and the call says so (nothing journaled)."""
    from sagaworker.contrib.django import begin

    key = uid("auto")
    with pytest.raises(ConfigurationError, match=r"begin\(\) outside transaction.atomic"):
        begin(dj, key)
    assert dj.journal.saga_row(key) is None


def test_another_django_database_is_refused(dj: Sagaworker) -> None:
    """A Django database other than the journal's: ConfigurationError naming both; one
    that is not PostgreSQL: ConfigurationError saying so."""
    from django.db import transaction

    from sagaworker.contrib.django import begin

    with transaction.atomic(using="other"), pytest.raises(ConfigurationError) as err:
        begin(dj, uid("other"), using="other")
    message = str(err.value)
    assert "the Django database 'other' is postgresql+psycopg://root@127.0.0.1:5432/postgres" \
        in message
    assert f"the journal is on {dj.settings.database_url}" in message
    with transaction.atomic(using="legacy"), pytest.raises(
            ConfigurationError, match=r"'legacy' is sqlite: .* works with PostgreSQL only"):
        begin(dj, uid("legacy"), using="legacy")


def test_settings_are_read_from_django(dj: Sagaworker, pg_url: str,
                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """The journal in the Django database (its URL from DATABASES) unless
    SAGAWORKER_DATABASE_URL says otherwise; SAGAWORKER_* Django settings over the
    environment; a misspelt or invalid one refused, naming it."""
    from django.test import override_settings

    from sagaworker.contrib.django import settings_from_django

    monkeypatch.delenv("SAGAWORKER_DATABASE_URL", raising=False)
    assert settings_from_django().database_url == pg_url
    assert settings_from_django().redact == "card"  # shop/settings.py
    monkeypatch.setenv("SAGAWORKER_QUEUE", "from-env")
    assert settings_from_django().queue == "from-env"
    with override_settings(SAGAWORKER_QUEUE="from-django"):
        assert settings_from_django().queue == "from-django"
    monkeypatch.setenv("SAGAWORKER_DATABASE_URL", "postgresql+psycopg://elsewhere/journal")
    assert settings_from_django().database_url == "postgresql+psycopg://elsewhere/journal"
    with override_settings(SAGAWORKER_BROKER_ULR="redis://"), pytest.raises(
            ConfigurationError, match="SAGAWORKER_BROKER_ULR is no sagaworker setting"):
        settings_from_django()
    with override_settings(SAGAWORKER_RELAY_AFTER=-1), pytest.raises(
            ConfigurationError, match="SAGAWORKER_RELAY_AFTER: Input should be greater"):
        settings_from_django()


def test_db_upgrade_puts_the_journal_beside_manage_py_migrate(fresh_pg_url: str) -> None:
    """In an empty database: ``manage.py migrate`` makes the project's tables and
    ``sagaworker -A <the project's sagas module> db upgrade`` the journal's, in the Django
    database (read from DATABASES, no SAGAWORKER_DATABASE_URL)."""
    env = project_env(dict(os.environ), fresh_pg_url)
    env = {k: v for k, v in env.items() if not k.startswith("SAGAWORKER_")}
    for cmd in ([sys.executable, "tests/django_project/manage.py", "migrate"],
                [sys.executable, "-m", "sagaworker.cli", "-A", "tests.django_project.shop.sagas",
                 "db", "upgrade"]):
        proc = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True,
                              timeout=120)
        assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "journal schema is up to date in " + fresh_pg_url in proc.stdout
    engine: Engine = create_engine(fresh_pg_url)
    try:
        with engine.connect() as c:
            tables = [r[0] for r in c.execute(text(
                "SELECT tablename FROM pg_tables WHERE schemaname = 'public' "
                "AND tablename IN ('orders_order', 'sagaworker_sagas', 'sagaworker_entries') "
                "ORDER BY tablename"))]
    finally:
        engine.dispose()
    assert tables == ["orders_order", "sagaworker_entries", "sagaworker_sagas"]
