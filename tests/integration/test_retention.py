"""Retention (`db prune`, `sw.prune`): each rule on SQLite and on PostgreSQL."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from celery import Celery
from sqlalchemy import func, select, text, update

from sagaworker import Sagaworker, Settings
from sagaworker._journal.repository import now
from sagaworker._journal.retention import parse_age
from sagaworker._journal.schema import audit, entries, sagas
from tests.integration._pgdb import fresh_database

ROOT = Path(__file__).resolve().parents[2]
DAY = 86400.0


@pytest.fixture(scope="module")
def pg_retention_url() -> Iterator[str]:
    with fresh_database("sw_retention") as url:
        yield url


@pytest.fixture(params=["sqlite", pytest.param("postgresql", marks=pytest.mark.services)])
def sw(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Sagaworker]:
    """A producer on an empty journal whose steps are journaled, never published."""
    if request.param == "sqlite":
        url = f"sqlite:///{tmp_path / 'r.db'}"
    else:
        url = request.getfixturevalue("pg_retention_url")
    s = Sagaworker(Celery(f"retention-{request.param}", broker="memory://"),
                   database_url=url)
    if request.param == "postgresql":
        with s.journal.engine.begin() as conn:
            conn.execute(text("TRUNCATE sagaworker_audit, sagaworker_entries, "
                              "sagaworker_sagas"))

    @s.tool()
    def step(x: int) -> int:
        return x

    s.rt.bus.publish_step = lambda *a, **k: True  # type: ignore[method-assign]
    yield s
    s.journal.engine.dispose()


def make(sw: Sagaworker, saga_id: str, status: str, *, finished_days: float | None,
         updated_days: float, in_doubt: bool = False, steps: int = 2) -> None:
    """A saga with ``steps`` entries and an audit row, aged and set to ``status``."""
    tool = next(iter(sw.registry.tools.values())).task
    saga = sw.begin(saga_id)
    for i in range(steps):
        saga.enqueue(tool, i)
    t = now()
    with sw.journal.engine.begin() as conn:
        sw.journal.audit(conn, saga_id, 1, "test", "tester")
        conn.execute(update(sagas).where(sagas.c.saga_id == saga_id).values(
            status=status, updated_at=t - timedelta(days=updated_days),
            finished_at=None if finished_days is None else t - timedelta(days=finished_days)))
        conn.execute(update(entries).where(entries.c.saga_id == saga_id).values(
            phase="EXECUTED"))
        if in_doubt:
            conn.execute(update(entries).where(entries.c.saga_id == saga_id,
                                               entries.c.seq == 1).values(in_doubt=True))


def rows(sw: Sagaworker) -> tuple[set[str], dict[str, int], dict[str, int]]:
    """Saga ids left, and entry and audit rows left per saga."""
    with sw.journal.engine.connect() as conn:
        ids = set(conn.execute(select(sagas.c.saga_id)).scalars())
        ents = dict(conn.execute(select(entries.c.saga_id, func.count())  # type: ignore[arg-type]
                                 .group_by(entries.c.saga_id)).all())
        auds = dict(conn.execute(select(audit.c.saga_id, func.count())  # type: ignore[arg-type]
                                 .group_by(audit.c.saga_id)).all())
    return ids, ents, auds


def test_prune_deletes_old_clean_terminal_sagas_and_keeps_the_rest(sw: Sagaworker) -> None:
    make(sw, "old-completed", "COMPLETED", finished_days=40, updated_days=40)
    make(sw, "old-compensated", "COMPENSATED", finished_days=40, updated_days=40)
    make(sw, "old-no-finish", "COMPLETED", finished_days=None, updated_days=40)
    make(sw, "old-dirty", "COMPENSATION_FAILED", finished_days=40, updated_days=40)
    make(sw, "old-in-doubt", "COMPENSATED", finished_days=40, updated_days=40, in_doubt=True)
    for st in ("RUNNING", "AWAITING_APPROVAL", "COMPENSATING"):
        make(sw, f"old-{st.lower()}", st, finished_days=None, updated_days=40)
    make(sw, "recent", "COMPLETED", finished_days=1, updated_days=1)
    make(sw, "touched-lately", "COMPLETED", finished_days=40, updated_days=1)
    never = {"old-running", "old-awaiting_approval", "old-compensating", "recent",
             "touched-lately"}
    assert sw.prune(30 * DAY) == 3
    ids, ents, auds = rows(sw)
    assert ids == never | {"old-dirty", "old-in-doubt"}
    assert set(ents) == ids and set(auds) == ids  # entries and audit rows went with them
    assert all(n == 2 for n in ents.values())
    # dirty and in-doubt go only when told; open sagas never
    assert sw.prune(30 * DAY, include_dirty=True) == 2
    ids, ents, auds = rows(sw)
    assert ids == never and set(ents) == never and set(auds) == never
    assert sw.prune(0, include_dirty=True) == 2  # recent and touched-lately: now old enough
    assert rows(sw)[0] == {"old-running", "old-awaiting_approval", "old-compensating"}


def test_prune_works_in_batches_each_its_own_transaction(sw: Sagaworker) -> None:
    from sqlalchemy import event

    for i in range(7):
        make(sw, f"b-{i}", "COMPLETED", finished_days=2, updated_days=2, steps=1)
    commits: list[int] = []
    event.listen(sw.journal.engine, "commit", lambda _c: commits.append(1))
    assert sw.prune(DAY, batch=3) == 7
    assert len(commits) == 3  # 3 + 3 + 1
    assert rows(sw)[0] == set()
    assert sw.prune(DAY) == 0


@pytest.mark.services
def test_prune_skips_a_saga_another_transaction_holds(pg_retention_url: str) -> None:
    """FOR UPDATE SKIP LOCKED: a saga row someone is writing is left for the next run,
    and the prune does not wait for it."""
    s = Sagaworker(Celery("retention-lock", broker="memory://"), database_url=pg_retention_url)

    @s.tool()
    def step(x: int) -> int:
        return x

    s.rt.bus.publish_step = lambda *a, **k: True  # type: ignore[method-assign]
    with s.journal.engine.begin() as conn:
        conn.execute(text("TRUNCATE sagaworker_audit, sagaworker_entries, sagaworker_sagas"))
    make(s, "held", "COMPLETED", finished_days=5, updated_days=5)
    make(s, "free", "COMPLETED", finished_days=5, updated_days=5)
    with s.journal.engine.connect() as holder:
        trans = holder.begin()
        s.journal.lock_saga(holder, "held")
        got: list[int] = []
        t = threading.Thread(target=lambda: got.append(s.prune(DAY)))
        started = time.monotonic()
        t.start()
        t.join(10)
        assert got == [1] and time.monotonic() - started < 5
        trans.rollback()
    assert rows(s)[0] == {"held"}
    assert s.prune(DAY) == 1
    s.journal.engine.dispose()


def test_parse_age() -> None:
    assert parse_age("30d") == 30 * DAY
    assert parse_age("12h") == 12 * 3600
    assert parse_age("90m") == 90 * 60
    assert parse_age("45s") == 45
    assert parse_age("3600") == 3600
    assert parse_age("2w") == 14 * DAY
    for bad in ("", "d", "30x", "-5d", "1.2.3"):
        with pytest.raises(ValueError):
            parse_age(bad)


def test_db_prune_command(tmp_path: Path) -> None:
    """`sagaworker db prune --older-than AGE [--include-dirty]` on the app's journal; a bad
    age is a usage error (exit 2)."""
    db = tmp_path / "app.db"
    (tmp_path / "pruneapp.py").write_text(
        "from celery import Celery\nfrom sagaworker import Sagaworker\n"
        f"app = Celery('pruneapp')\nsw = Sagaworker(app, database_url={f'sqlite:///{db}'!r})\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("SAGAWORKER_")}
    env.update(PYTHONPATH=str(ROOT), SAGAWORKER_BROKER_FOLDER=str(tmp_path / "broker"))
    code = ("import pruneapp; from sqlalchemy import text; sw = pruneapp.sw\n"
            "for sid, st in (('a', 'COMPLETED'), ('b', 'COMPENSATION_FAILED')):\n"
            "    sw.begin(sid)\n"
            "    with sw.journal.engine.begin() as c:\n"
            "        c.execute(text(\"UPDATE sagaworker_sagas SET status = :st, updated_at = \"\n"
            "                       \"'2000-01-01 00:00:00.000000' WHERE saga_id = :s\"),\n"
            "                  {'st': st, 's': sid})\n")
    subprocess.run([sys.executable, "-c", code], env=env, cwd=tmp_path, check=True)

    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "sagaworker.cli", "-A", "pruneapp", "db",
                               "prune", *args], env=env, cwd=tmp_path, capture_output=True,
                              text=True, timeout=120)

    r = cli("--older-than", "30x")
    assert r.returncode == 2 and "--older-than" in r.stderr, r.stderr
    r = cli("--older-than", "30d")
    assert r.returncode == 0 and "pruned 1 saga" in r.stdout, r.stdout + r.stderr
    r = cli("--older-than", "30d", "--include-dirty", "--json")
    assert r.returncode == 0 and '"pruned": 1' in r.stdout, r.stdout + r.stderr


def test_beat_prunes_daily_only_when_retention_days_is_set(tmp_path: Path) -> None:
    def build(**over: Any) -> Sagaworker:
        s = Settings(database_url=f"sqlite:///{tmp_path / 'beat.db'}", broker_url="memory://",
                     broker_folder=str(tmp_path / "b"), **over)
        return Sagaworker(Celery(f"beat-{len(over)}", broker="memory://"), settings=s)

    assert "sagaworker-retention" not in build().app.conf.beat_schedule
    sw = build(retention_days=30)
    entry = sw.app.conf.beat_schedule["sagaworker-retention"]
    assert entry["task"] == "sagaworker.prune" and entry["schedule"] == DAY
    assert entry["options"]["queue"] == sw.settings.queue
    sw.begin("beat-old")
    with sw.journal.engine.begin() as conn:
        conn.execute(update(sagas).values(status="COMPLETED",
                                          updated_at=now() - timedelta(days=31)))
    assert sw.app.tasks["sagaworker.prune"]() == 1
    assert Settings(retention_days="").retention_days is None  # type: ignore[arg-type]
