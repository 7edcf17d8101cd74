"""The test suite's own footprint: a run leaves no database behind, even when it was
killed (a later run drops what a dead run's process made)."""

from __future__ import annotations

import os

import pytest

from tests.conftest import _pg, _reap_databases, db_name, need

pytestmark = pytest.mark.services


def _dead_pid() -> int:
    pid = 4_000_000
    while os.path.exists(f"/proc/{pid}"):
        pid += 1
    return pid


def test_a_killed_runs_databases_are_dropped_and_a_live_runs_kept() -> None:
    need("PostgreSQL", _pg)
    import psycopg

    mine = db_name("sw_reap")
    theirs = mine.replace(f"_{os.getpid()}_", f"_{_dead_pid()}_")
    admin = "host=127.0.0.1 port=5432 user=root dbname=postgres"
    with psycopg.connect(admin, autocommit=True) as c:
        for name in (mine, theirs):
            c.execute(f'CREATE DATABASE "{name}"')
    try:
        dropped = _reap_databases()
        with psycopg.connect(admin, autocommit=True) as c:
            left = {r[0] for r in c.execute("SELECT datname FROM pg_database")}
        assert theirs in dropped and theirs not in left
        assert mine not in dropped and mine in left
    finally:
        with psycopg.connect(admin, autocommit=True) as c:
            for name in (mine, theirs):
                c.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def test_the_runs_redis_database_was_empty_and_a_database_with_data_is_never_claimed(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The run's Redis database is one it claimed (marked with its pid), never one holding
    someone else's data (flushed at the run's end, it would be lost); a database a killed
    run left is taken back."""
    from tests import conftest

    need("Redis", lambda: conftest._redis("redis://127.0.0.1:6379/0").ping())
    if conftest._REDIS is not None:
        pytest.skip("SAGAWORKER_TEST_REDIS_URL names the run's database")
    ours = conftest.BROKERS["redis"]
    assert conftest._redis(ours).get(conftest._REDIS_MARK) == conftest._REDIS_OWNER.encode()
    # a second run beside this one: every other database holds someone's data but one,
    # which a killed run left
    others = [db for db in range(1, 16) if not ours.endswith(f"/{db}")]
    left_by_dead, busy = others[0], others[1:]
    made: list[tuple[int, str]] = []
    try:
        for db in busy:
            client = conftest._redis(f"redis://127.0.0.1:6379/{db}")
            if client.dbsize() == 0:
                client.set("someone-elses", "data")
                made.append((db, "someone-elses"))
        dead = conftest._redis(f"redis://127.0.0.1:6379/{left_by_dead}")
        dead.set(conftest._REDIS_MARK, f"{_dead_pid()}-0")
        dead.set("a-killed-runs-queue", "x")
        monkeypatch.setattr(conftest, "_REDIS_OWNER", f"{os.getpid()}-another-live-run")
        monkeypatch.setattr(conftest, "_UNUSABLE", {})
        monkeypatch.setitem(conftest.BROKERS, "redis", "unset")
        assert conftest._claim_redis_db()
        assert conftest.BROKERS["redis"] == f"redis://127.0.0.1:6379/{left_by_dead}"
        assert dead.get("a-killed-runs-queue") is None
        for db, key in made:
            assert conftest._redis(f"redis://127.0.0.1:6379/{db}").get(key) == b"data"
        # and with none free: the tests are told what to set, never handed a used database
        dead.set("now-in-use", "y")
        monkeypatch.setitem(conftest.BROKERS, "redis", "unset")
        assert not conftest._claim_redis_db()
        assert conftest.BROKERS["redis"] == "unset"
        assert "SAGAWORKER_TEST_REDIS_URL" in conftest._UNUSABLE["unset"]
    finally:
        for db, key in made:
            conftest._redis(f"redis://127.0.0.1:6379/{db}").delete(key)
        conftest._redis(f"redis://127.0.0.1:6379/{left_by_dead}").flushdb()
