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
