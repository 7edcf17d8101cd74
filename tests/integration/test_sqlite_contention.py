"""The embedded default under load: a producer, a real worker and readers (the dashboard's
queries, `list`, metrics) on ONE SQLite journal, with no `database is locked` anywhere."""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from sagaworker._base.types import SagaStatus
from sagaworker._worker.metrics import JournalCollector
from sagaworker.cli.demo import start_worker
from tests.conftest import TEST_SECRET

ROOT = Path(__file__).resolve().parents[2]
RUN_FOR = 10.0


def test_producer_worker_and_readers_share_one_sqlite_journal(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SAGAWORKER_")}
    env.update(PYTHONPATH=str(ROOT), SAGAWORKER_DATABASE_URL=f"sqlite:///{tmp_path / 'j.db'}",
               SAGAWORKER_BROKER_URL="filesystem://",
               SAGAWORKER_BROKER_FOLDER=str(tmp_path / "broker"),
               SAGAWORKER_APPROVAL_SECRET=TEST_SECRET, SAGAWORKER_LOG_FORMAT="json",
               SAGAWORKER_SWEEP_INTERVAL="2", SAGAWORKER_COMPENSATION_BACKOFF="0.05")
    for k, v in env.items():
        if k.startswith("SAGAWORKER_"):
            monkeypatch.setenv(k, v)
    sys.modules.pop("tests.apps.embedded", None)
    mod = importlib.import_module("tests.apps.embedded")
    sw, work = mod.sw, mod.work
    sw.journal  # noqa: B018 - creates the embedded journal's tables before the worker
    log = tmp_path / "worker.log"
    proc = start_worker("tests.apps.embedded", env, log, concurrency=2)
    stop = threading.Event()
    errors: list[str] = []
    finished: list[tuple[str, SagaStatus, SagaStatus]] = []
    reads = [0]

    def producer(p: int) -> None:
        k = 0
        while not stop.is_set():
            k += 1
            sid, fail = f"p{p}-{k}", k % 4 == 1
            want = SagaStatus.COMPENSATED if fail else SagaStatus.COMPLETED
            try:
                if k % 2:  # the synchronous form
                    res = sw.saga(sid, lambda s, sid=sid, fail=fail: [
                        s.call(work, sid, 1), s.call(work, sid, 2, fail=fail)], timeout=60)
                else:  # the asynchronous form: enqueue, result(), complete or fail, wait
                    saga = sw.begin(sid, metadata={"p": p})
                    steps = saga.enqueue_many([(work, (sid, 1), {}), (work, (sid, 2), {})])
                    assert [st.result(timeout=60) for st in steps] == [2, 4]
                    if fail:
                        saga.fail("the customer cancelled")
                    else:
                        saga.complete()
                    res = saga.wait(timeout=60)
                finished.append((sid, res.status, want))
            except Exception as exc:
                errors.append(f"producer {sid}: {type(exc).__name__}: {exc}")

    def reader() -> None:
        collector = JournalCollector(sw.rt)
        while not stop.is_set():
            try:
                recent = sw.sagas(limit=200)
                for rec in recent[:10]:
                    sw.inspect(rec.saga_id)
                sw.sagas(status=SagaStatus.COMPENSATION_FAILED, limit=100)
                sw.pending_approvals()
                list(collector.collect())
                reads[0] += 1
            except Exception as exc:
                errors.append(f"reader: {type(exc).__name__}: {exc}")

    threads = ([threading.Thread(target=producer, args=(p,)) for p in range(3)]
               + [threading.Thread(target=reader) for _ in range(2)])
    try:
        for t in threads:
            t.start()
        time.sleep(RUN_FOR)
        stop.set()
        for t in threads:
            t.join(120)
    finally:
        stop.set()
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
        sw.dispose_engine()
    text = log.read_text(errors="replace")
    assert not errors, "\n".join(errors[:10])
    assert "database is locked" not in text, [ln for ln in text.splitlines()
                                               if "database is locked" in ln][:5]
    for bad in ("OperationalError", "Unrecoverable error", "database_retry"):
        assert bad not in text, [ln for ln in text.splitlines() if bad in ln][:3]
    print(f"{len(finished)} sagas and {reads[0]} dashboard reads in {RUN_FOR} s")
    # the three parties really overlapped (how fast they went is the benchmarks' business)
    assert len(finished) >= 2, f"only {len(finished)} sagas in {RUN_FOR} s"
    assert reads[0] >= 2, f"only {reads[0]} dashboard reads in {RUN_FOR} s"
    wrong = [(sid, got, want) for sid, got, want in finished if got is not want]
    assert not wrong, wrong[:5]
    statuses: dict[Any, int] = {}
    for _, got, _ in finished:
        statuses[got] = statuses.get(got, 0) + 1
    assert statuses.get(SagaStatus.COMPENSATED) and statuses.get(SagaStatus.COMPLETED)


# -- reads take no write lock; busy writes are replayed, a COMMIT never is ----------------


def _statements(engine: Any) -> list[str]:
    from sqlalchemy import event

    seen: list[str] = []
    event.listen(engine, "before_cursor_execute",
                 lambda _c, _cur, stmt, *_a: seen.append(stmt.split()[0].upper()
                                                         + (" IMMEDIATE" if "IMMEDIATE" in stmt
                                                            else "")))
    return seen


def test_every_read_path_opens_a_deferred_transaction(sqlite_sw: Any) -> None:
    """sagas(), inspect(), a step's result(), wait(), approvals and metrics: each a WAL
    reader (plain BEGIN); only writes take BEGIN IMMEDIATE."""
    sw = sqlite_sw
    sw.rt.bus.publish_step = lambda *a, **k: True

    @sw.tool()
    def t(x: int) -> int:
        return x

    saga = sw.begin("r-1")
    step = saga.enqueue(t, 1)
    seen = _statements(sw.journal.engine)
    sw.sagas()
    sw.inspect("r-1")
    sw.get("r-1")
    _ = step.phase
    with pytest.raises(TimeoutError):
        step.result(timeout=0.05)
    with pytest.raises(TimeoutError):
        saga.wait(timeout=0.05)
    list(JournalCollector(sw.rt).collect())
    assert seen and "BEGIN IMMEDIATE" not in seen, seen
    assert "BEGIN" in seen
    seen.clear()
    sw.begin("r-2")
    assert seen[0] == "BEGIN IMMEDIATE"


def test_a_long_read_does_not_block_a_writer(sqlite_sw: Any,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """A reader holding its transaction open (a dashboard page mid-render) does not keep a
    producer from journaling: WAL readers hold no write lock. The writer here neither waits
    (busy timeout 0) nor replays, so a write the reader blocked would raise."""
    from sqlalchemy import event, select

    from sagaworker._journal import transactions
    from sagaworker._journal.schema import sagas

    sw = sqlite_sw
    sw.begin("before")
    monkeypatch.setattr(transactions, "BUSY_RETRY_SECONDS", 0.0)
    event.listen(sw.journal.engine, "checkout",
                 lambda dbapi, rec, proxy: dbapi.execute("PRAGMA busy_timeout = 0"))
    with sw.journal.reader.connect() as conn:
        assert conn.execute(select(sagas.c.saga_id)).all()
        sw.begin("during").complete()
        # and the reader's snapshot stays the one it began with
        assert [r.saga_id for r in conn.execute(select(sagas.c.saga_id))] == ["before"]


def _short_timeout_journal(path: Path) -> Any:
    """A journal whose SQLite busy timeout is 0.1 s (the real one waits 30 s)."""
    from sqlalchemy import create_engine

    from sagaworker._journal.dialect import _sqlite_immediate_transactions
    from sagaworker._journal.repository import Journal

    engine = create_engine(f"sqlite:///{path}", connect_args={"timeout": 0.1,
                                                              "check_same_thread": False})
    _sqlite_immediate_transactions(engine)
    journal = Journal(engine)
    journal.create_all()
    return journal


def _machine(journal: Any) -> Any:
    """The moves over that journal (a saga is begun by one)."""
    from sagaworker._base.settings import Settings
    from sagaworker._machine.machine import Machine

    return Machine(journal, Settings())


def test_a_busy_producer_write_is_replayed(tmp_path: Path) -> None:
    """Another process holds the write lock past the busy timeout: the producer's write
    is replayed on a short backoff and lands once."""
    import sqlite3

    journal = _short_timeout_journal(tmp_path / "b.db")
    holder = sqlite3.connect(tmp_path / "b.db", isolation_level=None, check_same_thread=False)
    holder.execute("BEGIN IMMEDIATE")
    release = threading.Timer(0.6, holder.execute, args=("COMMIT",))
    release.start()
    t = time.monotonic()
    _machine(journal).create_saga("busy-1", {})
    release.join()
    assert time.monotonic() - t >= 0.5
    assert journal.saga_row("busy-1") is not None
    holder.close()
    journal.engine.dispose()


def test_a_busy_write_gives_up_after_a_few_seconds(tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    import sqlite3

    from sqlalchemy.exc import OperationalError

    from sagaworker._journal import transactions as _journal

    monkeypatch.setattr(_journal, "BUSY_RETRY_SECONDS", 0.5)
    journal = _short_timeout_journal(tmp_path / "g.db")
    holder = sqlite3.connect(tmp_path / "g.db", isolation_level=None)
    holder.execute("BEGIN IMMEDIATE")
    t = time.monotonic()
    with pytest.raises(OperationalError, match="locked"):
        _machine(journal).create_saga("never", {})
    assert 0.4 < time.monotonic() - t < 3
    holder.execute("ROLLBACK")
    holder.close()
    journal.engine.dispose()


def test_a_failed_commit_is_never_replayed(tmp_path: Path) -> None:
    """COMMIT itself fails (busy): the write may have landed elsewhere, so it propagates and
    the body ran once."""
    import sqlite3

    from sqlalchemy import event
    from sqlalchemy.exc import OperationalError

    journal = _short_timeout_journal(tmp_path / "c.db")
    runs = [0]

    def fail_commit(_conn: Any) -> None:
        raise OperationalError("COMMIT", None, sqlite3.OperationalError("database is locked"))

    event.listen(journal.engine, "commit", fail_commit)

    def body(conn: Any) -> None:
        runs[0] += 1

    with pytest.raises(OperationalError):
        journal.write(body)
    assert runs == [1]
    journal.engine.dispose()
