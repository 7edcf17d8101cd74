"""Waiting without polling on PostgreSQL: LISTEN/NOTIFY from the 0003 triggers, and the
polling fallback when the triggers or the listener's connection are missing."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from celery import Celery

from sagaworker import Sagaworker
from sagaworker._journal.notify import Notifier
from tests.conftest import uid
from tests.integration._pgdb import execute, fresh_database

pytestmark = pytest.mark.services

EXECUTED = ("UPDATE sagaworker_entries SET phase = 'EXECUTED', result = '42'::jsonb "
            "WHERE saga_id = %s AND seq = 1")
COMPLETED = ("UPDATE sagaworker_sagas SET status = 'COMPLETED', finished_at = now(), "
             "updated_at = now() WHERE saga_id = %s")


@pytest.fixture(scope="module")
def notify_url() -> Iterator[str]:
    with fresh_database("sw_notify") as url:
        yield url


def make_sw(url: str) -> tuple[Sagaworker, Any]:
    """A producer on ``url`` whose steps are journaled but never published."""
    sw = Sagaworker(Celery(uid("notify"), broker="memory://"), database_url=url)

    @sw.tool()
    def thing(x: int) -> int:
        return x

    sw.rt.bus.publish_step = lambda *a, **k: True  # type: ignore[method-assign]
    return sw, thing


def count_reads(sw: Sagaworker, name: str) -> list[int]:
    """Count calls of one Journal read method (a poll is one read)."""
    calls = [0]
    real = getattr(sw.journal, name)

    def counted(*a: Any, **k: Any) -> Any:
        calls[0] += 1
        return real(*a, **k)

    setattr(sw.journal, name, counted)
    return calls


def later(url: str, sql: str, saga_id: str, after: float) -> tuple[threading.Thread, list[float]]:
    """Commit ``sql`` from another connection ``after`` seconds from now."""
    done: list[float] = []

    def run() -> None:
        time.sleep(after)
        execute(url, sql, saga_id)
        done.append(time.monotonic())

    t = threading.Thread(target=run)
    t.start()
    return t, done


def notifier(sw: Sagaworker) -> Notifier:
    n = sw.journal._notifier
    assert n is not None
    return n


def wait_until(cond: Callable[[], bool], timeout: float) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(0.02)
    return cond()


def test_result_wakes_on_the_notify_not_by_polling(notify_url: str) -> None:
    """result() returns at once after another connection commits the outcome, having read
    the journal a handful of times in 1.5 s (polling reads it every 5-50 ms)."""
    sw, thing = make_sw(notify_url)
    step = sw.begin(uid("n")).enqueue(thing, 1)
    reads = count_reads(sw, "entry_row")
    t, done = later(notify_url, EXECUTED, step.saga_id, 1.5)
    assert step.result(timeout=10) == 42
    back = time.monotonic()
    t.join()
    assert back - done[0] < 0.3, f"woke {back - done[0]:.3f} s after the commit"
    assert notifier(sw).listening
    assert reads[0] <= 12, f"{reads[0]} reads: it polled"
    sw.journal.engine.dispose()


def test_wait_and_sync_saga_wake_on_the_notify(notify_url: str) -> None:
    """Saga.wait() wakes on the saga's terminal status, sw.saga's s.call on the outcome."""
    sw, thing = make_sw(notify_url)
    saga = sw.begin(uid("w"))
    reads = count_reads(sw, "saga_row")
    t, done = later(notify_url, COMPLETED, saga.saga_id, 1.5)
    res = saga.wait(timeout=10)
    back = time.monotonic()
    t.join()
    assert res.status.value == "COMPLETED"
    assert back - done[0] < 0.3 and reads[0] <= 12, (back - done[0], reads[0])

    sid = uid("sync")
    t, done = later(notify_url, EXECUTED, sid, 1.0)
    result = sw.saga(sid, lambda s: s.call(thing, 1), timeout=10)
    t.join()
    assert result.status.value == "COMPLETED" and result.value == 42
    sw.journal.engine.dispose()


def test_the_triggers_notify_outcomes_of_waited_sagas_only(notify_url: str) -> None:
    """INTENT, claims and other column updates send nothing; an outcome, one notification,
    and only while somebody waits on the saga (a sagaworker_waiters row)."""
    import psycopg

    sw, thing = make_sw(notify_url)
    step = sw.begin(uid("t")).enqueue(thing, 1)
    other = sw.begin(uid("unwaited")).enqueue(thing, 1)
    execute(notify_url, "INSERT INTO sagaworker_waiters (saga_id, waiter) VALUES (%s, 'x')",
            step.saga_id)
    with psycopg.connect(notify_url.replace("postgresql+psycopg", "postgresql"),
                         autocommit=True) as listen:
        listen.execute("LISTEN sagaworker")
        execute(notify_url, "UPDATE sagaworker_entries SET attempts = attempts + 1, "
                "phase = phase WHERE saga_id = %s", step.saga_id)
        execute(notify_url, "UPDATE sagaworker_sagas SET status = 'RUNNING', "
                "updated_at = now() WHERE saga_id = %s", step.saga_id)
        execute(notify_url, EXECUTED, other.saga_id)  # nobody waits on it
        execute(notify_url, COMPLETED, other.saga_id)
        assert [n.payload for n in listen.notifies(timeout=0.5)] == []
        execute(notify_url, EXECUTED, step.saga_id)
        execute(notify_url, COMPLETED, step.saga_id)
        got = [n.payload for n in listen.notifies(timeout=1.0, stop_after=2)]
    assert got == [step.saga_id, step.saga_id]
    sw.journal.engine.dispose()


def test_waiting_registers_the_saga_and_lets_it_go_after(notify_url: str,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """A waiting call's saga is in sagaworker_waiters while it waits (and a little after:
    the next step of a synchronous saga finds it there), then no longer."""
    import sagaworker._journal.notify as notify

    monkeypatch.setattr(notify, "KEEP_REGISTERED", 0.5)
    sw, thing = make_sw(notify_url)
    step = sw.begin(uid("reg")).enqueue(thing, 1)

    def registered() -> bool:
        import psycopg

        with psycopg.connect(notify_url.replace("postgresql+psycopg", "postgresql")) as c:
            row = c.execute("SELECT count(*) FROM sagaworker_waiters WHERE saga_id = %s",
                            (step.saga_id,)).fetchone()
            return bool(row and row[0])

    t, _ = later(notify_url, EXECUTED, step.saga_id, 1.0)
    seen: list[bool] = []
    threading.Timer(0.7, lambda: seen.append(registered())).start()
    assert step.result(timeout=10) == 42
    t.join()
    assert seen == [True]
    assert wait_until(lambda: not registered(), 5), "the registration stayed"
    sw.journal.engine.dispose()


def test_waiting_polls_when_the_triggers_are_missing() -> None:
    """A database migrated without 0003's triggers (or with them dropped): result() still
    returns promptly, by polling, and the listener knows it is not listening."""
    with fresh_database("sw_notrig") as url:
        execute(url, "DROP TRIGGER sagaworker_entries_notify ON sagaworker_entries")
        sw, thing = make_sw(url)
        step = sw.begin(uid("p")).enqueue(thing, 1)
        reads = count_reads(sw, "entry_row")
        t, done = later(url, EXECUTED, step.saga_id, 1.0)
        assert step.result(timeout=10) == 42
        back = time.monotonic()
        t.join()
        assert back - done[0] < 0.3
        assert not notifier(sw).listening
        assert reads[0] > 12  # it polled
        sw.journal.engine.dispose()


def test_a_lost_listener_connection_falls_back_then_listens_again(notify_url: str) -> None:
    """The listener's backend is killed while a call waits: the call polls meanwhile and
    still returns promptly; the listener reconnects and waiting is by notify again."""
    sw, thing = make_sw(notify_url)
    step = sw.begin(uid("k")).enqueue(thing, 1)
    got: list[Any] = []
    waiter = threading.Thread(target=lambda: got.append(step.result(timeout=20)))
    waiter.start()
    assert wait_until(lambda: sw.journal._notifier is not None
                      and notifier(sw).listening, 5)
    execute(notify_url, "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
            "WHERE datname = current_database() "
            "AND application_name = 'sagaworker-listener'")
    assert wait_until(lambda: not notifier(sw).listening, 5)
    execute(notify_url, EXECUTED, step.saga_id)
    done = time.monotonic()
    waiter.join(10)
    assert got == [42] and time.monotonic() - done < 0.5
    step2 = sw.begin(uid("k2")).enqueue(thing, 1)
    assert wait_until(lambda: notifier(sw).listening, 10), "the listener did not come back"
    reads = count_reads(sw, "entry_row")
    t, commit = later(notify_url, EXECUTED, step2.saga_id, 1.0)
    assert step2.result(timeout=10) == 42
    t.join()
    assert reads[0] <= 10 and time.monotonic() - commit[0] < 0.3
    sw.journal.engine.dispose()


def test_an_outcome_that_missed_the_registration_is_seen_without_a_safety_poll(
        notify_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The outcome's transaction ran its trigger before the waiting call registered the
    saga (nobody to notify) and commits after the call read the step still running: the
    call sees the outcome by its next read, not at its safety poll (set to 60 s here)."""
    import psycopg

    import sagaworker._journal.notify as notify
    import sagaworker._producer.saga as saga_mod

    monkeypatch.setattr(saga_mod, "SAFETY_POLL", 60.0)
    monkeypatch.setattr(notify, "REGISTER_GRACE", 30.0, raising=False)
    sw, thing = make_sw(notify_url)
    step = sw.begin(uid("race")).enqueue(thing, 1)
    real, after = sw.journal.entry_row, [0]

    def read(*a: Any) -> Any:  # counts the reads begun once the saga was registered
        n = sw.journal._notifier
        after[0] += n is not None and step.saga_id in n._registered
        return real(*a)

    sw.journal.entry_row = read  # type: ignore[method-assign]
    got: list[Any] = []
    with psycopg.connect(notify_url.replace("postgresql+psycopg", "postgresql")) as worker:
        worker.execute(EXECUTED, (step.saga_id,))  # its trigger: no waiter to notify
        waiting = threading.Thread(target=lambda: got.append(step.result(timeout=20)))
        waiting.start()
        # registered, and read since (the step still INTENT to it: not committed)
        assert wait_until(lambda: after[0] >= 1, 10)
        worker.commit()
    waiting.join(15)
    assert got == [42], "the outcome waited for the safety poll"
    sw.journal.engine.dispose()
