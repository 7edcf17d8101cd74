"""Sagas in the app's own transaction (``connection=``): the app's order and its saga exist
together or not at all; messages leave only after the COMMIT; a process killed between
the COMMIT and the publish leaves the step to the relay. Real PostgreSQL, real workers."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
import textwrap
import threading
from collections.abc import Iterator
from typing import Any

import pytest
from sqlalchemy import Column, Engine, Integer, MetaData, String, Table, create_engine, select
from sqlalchemy.orm import Session

from sagaworker import ConfigurationError, Phase, SagaExists, SagaStatus
from tests.conftest import ROOT, Cluster, uid, wait_for, worker_env

pytestmark = [pytest.mark.services, pytest.mark.one_broker]
T = 60

app_meta = MetaData()
orders = Table("app_orders", app_meta, Column("id", String(64), primary_key=True),
               Column("quantity", Integer, nullable=False))


@pytest.fixture(scope="module")
def app_engine(crash_cluster: Cluster) -> Iterator[Engine]:
    """The app's own engine (not the journal's) on the journal's database."""
    engine = create_engine(crash_cluster.settings.database_url)
    app_meta.create_all(engine)
    yield engine
    engine.dispose()


@pytest.fixture
def published(crash_cluster: Cluster, monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, bool]]:
    """Every step message the producer sends: (task id, its INTENT row already committed,
    as seen from another connection at the moment of the publish)."""
    bus = crash_cluster.sw.rt.bus
    real = bus.publish_step
    seen: list[tuple[str, bool]] = []
    probe = create_engine(crash_cluster.settings.database_url)

    def spy(saga_id: str, seq: int, tool: str, args: Any, kwargs: Any, task_id: str,
            queue: Any, **kw: Any) -> bool:
        with probe.connect() as c:
            row = c.exec_driver_sql("SELECT 1 FROM sagaworker_entries WHERE task_id = %s",
                                    (task_id,)).first()
        seen.append((task_id, row is not None))
        return real(saga_id, seq, tool, args, kwargs, task_id, queue, **kw)

    monkeypatch.setattr(bus, "publish_step", spy)
    yield seen
    probe.dispose()


def order_ids(engine: Engine, oid: str) -> list[str]:
    with engine.connect() as c:
        return [r.id for r in c.execute(select(orders.c.id).where(orders.c.id == oid))]


def test_a_rolled_back_session_leaves_neither_order_nor_saga(
        crash_cluster: Cluster, app_engine: Engine, published: list[tuple[str, bool]]) -> None:
    """Order, saga and step in one Session; rollback: none of them exists, nothing sent."""
    key, step = uid("rb"), crash_cluster.tool("step")
    with Session(app_engine) as s:
        s.execute(orders.insert().values(id=key, quantity=2))
        saga = crash_cluster.sw.begin(key, connection=s)
        saga.enqueue(step, key, "a", connection=s)
        s.rollback()
    assert crash_cluster.sw.journal.saga_row(key) is None
    assert order_ids(app_engine, key) == []
    assert published == []


def test_a_committed_session_publishes_after_its_commit(
        crash_cluster: Cluster, app_engine: Engine, published: list[tuple[str, bool]]) -> None:
    """Nothing is sent before the COMMIT; at the publish the INTENT row is committed; the
    worker runs the step; the order exists beside its saga."""
    key, step = uid("ok"), crash_cluster.tool("step")
    with Session(app_engine) as s:
        s.execute(orders.insert().values(id=key, quantity=2))
        saga = crash_cluster.sw.begin(key, connection=s, metadata={"order": key})
        handle = saga.enqueue(step, key, "a", connection=s)
        assert published == []
        s.commit()
    assert published == [(handle.task_id, True)]
    assert handle.result(timeout=T) == "a-done"
    saga.complete()
    assert crash_cluster.sw.inspect(key).status is SagaStatus.COMPLETED
    assert order_ids(app_engine, key) == [key]


def test_a_rolled_back_savepoint_keeps_the_messages_of_rows_that_commit(
        crash_cluster: Cluster, app_engine: Engine, published: list[tuple[str, bool]]) -> None:
    """Steps a and c commit, b is taken back by a savepoint's rollback: a and c are sent
    at the COMMIT (not left to the relay), b never is; a and c run."""
    key, step = uid("sp"), crash_cluster.tool("step")
    with Session(app_engine) as s:
        saga = crash_cluster.sw.begin(key, connection=s)
        a = saga.enqueue(step, key, "a", connection=s)
        savepoint = s.begin_nested()
        b = saga.enqueue(step, key, "b", connection=s)
        savepoint.rollback()
        c = saga.enqueue(step, key, "c", connection=s)
        s.commit()
    assert published == [(a.task_id, True), (c.task_id, True)]
    assert [a.result(timeout=T), c.result(timeout=T)] == ["a-done", "c-done"]
    assert b.task_id not in {e.task_id for e in crash_cluster.sw.inspect(key).entries}


def test_a_session_joined_to_an_outer_transaction_publishes_after_the_outer_commit(
        crash_cluster: Cluster, app_engine: Engine, published: list[tuple[str, bool]],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A Session joined to the app's outer transaction (SQLAlchemy's test-suite recipe):
    its ``commit()`` releases a savepoint only. An outer rollback sends nothing (the step
    never existed); an outer commit sends the step, its row committed, and it runs."""
    monkeypatch.setattr("sagaworker._journal.app_tx.CONFIRM_FOR", 2.0)
    step = crash_cluster.tool("step")

    def confirmers() -> list[threading.Thread]:
        return [t for t in threading.enumerate() if t.name == "sagaworker-after-commit"]

    for outcome in ("rollback", "commit"):
        key = uid(f"j{outcome[0]}")
        with app_engine.connect() as conn:
            outer = conn.begin()
            with Session(bind=conn, join_transaction_mode="create_savepoint") as s:
                saga = crash_cluster.sw.begin(key, connection=s)
                handle = saga.enqueue(step, key, "a", connection=s)
                s.commit()
            assert published == []  # the outer transaction has not committed
            getattr(outer, outcome)()
        wait_for(lambda: not confirmers(), 20, "the after-commit confirmer to end")
        if outcome == "rollback":
            assert published == []
            assert crash_cluster.sw.journal.saga_row(key) is None
        else:
            assert published == [(handle.task_id, True)]
            assert handle.result(timeout=T) == "a-done"


def test_a_long_lived_session_or_connection_keeps_its_listeners_once(
        crash_cluster: Cluster, app_engine: Engine) -> None:
    """Three transactions of one Session (and of one Connection) with a saga each: the
    listeners sagaworker adds do not pile up."""
    step = crash_cluster.tool("step")
    with Session(app_engine) as s:
        for _ in range(3):
            key = uid("ls")
            crash_cluster.sw.begin(key, connection=s).enqueue(step, key, "a", connection=s)
            s.commit()
        assert (len(s.dispatch.after_commit), len(s.dispatch.after_transaction_end)) == (1, 1)
    with app_engine.connect() as conn:
        for _ in range(3):
            with conn.begin():
                key = uid("lc")
                crash_cluster.sw.begin(key, connection=conn).enqueue(step, key, "a",
                                                                     connection=conn)
        assert (len(conn.dispatch.commit), len(conn.dispatch.rollback)) == (1, 1)
    # (a Connection's steps are sent by the confirmer once committed: let it finish)
    wait_for(lambda: not [t for t in threading.enumerate()
                          if t.name == "sagaworker-after-commit"], 20, "the confirmer")


def test_a_connection_transaction_commits_or_rolls_back_with_the_saga(
        crash_cluster: Cluster, app_engine: Engine, published: list[tuple[str, bool]]) -> None:
    """``engine.begin()``'s Connection: an exception rolls order and saga back (nothing
    sent); a commit sends the step once its row is committed, and it runs."""
    step = crash_cluster.tool("step")
    gone = uid("crb")
    with pytest.raises(RuntimeError, match="app failed"), app_engine.begin() as conn:
        conn.execute(orders.insert().values(id=gone, quantity=1))
        crash_cluster.sw.begin(gone, connection=conn).enqueue(step, gone, "a", connection=conn)
        raise RuntimeError("app failed")
    assert crash_cluster.sw.journal.saga_row(gone) is None and order_ids(app_engine, gone) == []

    key = uid("cok")
    with app_engine.begin() as conn:
        conn.execute(orders.insert().values(id=key, quantity=1))
        handle = crash_cluster.sw.begin(key, connection=conn).enqueue(step, key, "a",
                                                                      connection=conn)
    assert handle.result(timeout=T) == "a-done"
    assert published == [(handle.task_id, True)]


def test_a_taken_id_leaves_the_app_transaction_usable(
        crash_cluster: Cluster, app_engine: Engine) -> None:
    """SagaExists inside the app's transaction (a savepoint on PostgreSQL): the app can
    still write and commit its own rows."""
    key = uid("dup")
    crash_cluster.sw.begin(key)
    with Session(app_engine) as s:
        with pytest.raises(SagaExists):
            crash_cluster.sw.begin(key, connection=s)
        s.execute(orders.insert().values(id=key, quantity=3))
        s.commit()
    assert order_ids(app_engine, key) == [key]


def test_a_connection_on_another_database_is_refused(crash_cluster: Cluster) -> None:
    """connection= on a database other than the journal's: ConfigurationError, naming both."""
    other = create_engine("postgresql+psycopg://root@127.0.0.1:5432/postgres")
    try:
        with Session(other) as s, pytest.raises(ConfigurationError,
                                                match="only with the journal's own database"):
            crash_cluster.sw.begin(uid("x"), connection=s)
    finally:
        other.dispose()


def test_the_journals_database_spelled_another_way_is_accepted(
        crash_cluster: Cluster) -> None:
    """The journal on 127.0.0.1, the app's engine on ``localhost`` (one server, one
    database): accepted (the servers are asked what they are), and the saga commits
    with the app's transaction."""
    url = crash_cluster.settings.database_url.replace("127.0.0.1", "localhost")
    assert url != crash_cluster.settings.database_url
    spelled = create_engine(url)
    key = uid("lh")
    try:
        with Session(spelled) as s:
            crash_cluster.sw.begin(key, connection=s)
            s.commit()
    finally:
        spelled.dispose()
    assert crash_cluster.sw.journal.saga_row(key) is not None


def test_a_flow_started_in_the_app_transaction(
        crash_cluster: Cluster, app_engine: Engine) -> None:
    """sw.start(connection=): rolled back, no saga; committed, the workers carry the flow."""
    from tests.apps.cluster import three_steps

    gone, key = uid("frb"), uid("fok")
    with Session(app_engine) as s:
        crash_cluster.sw.start(gone, three_steps, gone, connection=s)
        s.rollback()
    with Session(app_engine) as s:
        s.execute(orders.insert().values(id=key, quantity=1))
        saga = crash_cluster.sw.start(key, three_steps, key, connection=s)
        s.commit()
    assert saga.wait(timeout=T).value == {"a": "a-done", "b": "b-done", "c": "c-done"}
    assert crash_cluster.sw.journal.saga_row(gone) is None


def test_async_session_commits_with_the_saga(crash_cluster: Cluster) -> None:
    """abegin/aenqueue with an AsyncSession: written through the async driver in its
    transaction; after ``await session.commit()`` the step is sent and runs."""
    from sqlalchemy.ext.asyncio import AsyncSession, create_async_engine

    key, step = uid("as"), crash_cluster.tool("step")

    async def main() -> Any:
        engine = create_async_engine(crash_cluster.settings.database_url)
        try:
            async with engine.connect() as c:
                await c.run_sync(lambda sc: app_meta.create_all(sc))
                await c.commit()
            async with AsyncSession(engine) as s:
                await s.execute(orders.insert().values(id=key, quantity=4))
                saga = await crash_cluster.sw.abegin(key, connection=s)
                handle = await saga.aenqueue(step, key, "a", connection=s)
                assert crash_cluster.sw.journal.saga_row(key) is None  # not committed yet
                await s.commit()
            return await handle.aresult(timeout=T)
        finally:
            await engine.dispose()

    assert asyncio.run(main()) == "a-done"


KILLED_AFTER_COMMIT = textwrap.dedent("""
    import os, signal, sys
    from sqlalchemy import create_engine, event, text
    from sqlalchemy.orm import Session
    from tests.apps.cluster import build

    app, sw = build()
    key = sys.argv[1]
    engine = create_engine(os.environ["SAGAWORKER_DATABASE_URL"])
    with Session(engine) as s:
        # registered before sagaworker's own: the process dies right after the COMMIT
        event.listen(s, "after_commit", lambda _s: os.kill(os.getpid(), signal.SIGKILL))
        s.execute(text("INSERT INTO app_orders (id, quantity) VALUES (:k, 1)"), {"k": key})
        saga = sw.begin(key, connection=s)
        saga.enqueue("tests.apps.cluster.step", key, "a", connection=s)
        s.commit()
    print("not killed")
""")


def test_a_process_killed_after_the_commit_leaves_the_step_to_the_relay(
        crash_cluster: Cluster, app_engine: Engine) -> None:
    """The producer is SIGKILLed between the COMMIT and the publish: the order and the
    INTENT are committed, no message was sent, and the relay sends it: the step runs."""
    key = uid("kill")
    env = worker_env(crash_cluster.settings, crash_cluster.default_queue)
    env.pop("TESTS_APP_WORKER", None)
    proc = subprocess.run([sys.executable, "-c", KILLED_AFTER_COMMIT, key], env=env, cwd=ROOT,
                          capture_output=True, timeout=120)
    assert proc.returncode == -signal.SIGKILL, proc.stderr.decode()[-2000:]
    assert order_ids(app_engine, key) == [key]
    rec = wait_for(lambda: (r := crash_cluster.sw.inspect(key)).entries
                   and r.entries[0].phase is Phase.EXECUTED and r, T, "the relayed step")
    assert [e.phase for e in rec.entries] == [Phase.EXECUTED]
    relayed = [e for e in crash_cluster.events(key) if e.get("event") == "step_relayed"]
    assert relayed, "the step ran without the relay: it was published before the kill"
