"""A Celery message's claim of a step its tool asked to retry: a copy of an earlier retry
(the sweeper's resend, a redelivery) never runs the step, nor does a retry delivered before
its journaled due time, which is sent again for then (on SQLite here; the PostgreSQL
one-statement claim must agree: tests/integration/test_claims.py runs the same checks)."""

from __future__ import annotations

from typing import Any

from sqlalchemy import update

from sagaworker import Sagaworker
from sagaworker._journal.dialect import db_later
from sagaworker._journal.schema import entries
from sagaworker._machine.machine import Start
from tests.conftest import uid


def tools(sw: Sagaworker) -> tuple[Any, Any]:
    @sw.tool()
    def charge(x: int) -> int:
        return x

    @sw.tool(idempotent=True)
    def quote(x: int) -> int:
        return x

    sw.rt.bus.publish_step = lambda *a, **k: True  # type: ignore[method-assign]
    return charge, quote


def _claim(sw: Sagaworker, saga_id: str, tool: Any, token: str, retries: int | None) -> Any:
    spec = sw.registry.tool(tool.name)
    assert spec is not None
    return sw.machine.claim_start(saga_id, 1, tool.name, token=token, worker="w",
                                  idempotent=spec.idempotent, task_id="celery-id",
                                  retries=retries)


def _row(sw: Sagaworker, saga_id: str) -> Any:
    return sw.journal.entry_row(saga_id, 1)


def copies_of_earlier_retries_never_run(sw: Sagaworker, charge: Any) -> None:
    saga_id = uid("turn")
    sw.begin(saga_id).enqueue(charge, 1)
    assert _claim(sw, saga_id, charge, "t0", 0).start is Start.RUN
    sw.machine.retry_later(saga_id, 1, "t0", "Retry", 0.0, 1)  # retry 1, due at once
    # the first message again (the sweeper's resend, a redelivery): refused, nothing written
    assert _claim(sw, saga_id, charge, "copy0", 0).start is Start.SUPERSEDED
    row = _row(sw, saga_id)
    assert (row.attempts, row.attempt_token, row.lease_until) == (1, "t0", None)
    got = _claim(sw, saga_id, charge, "t1", 1)  # Celery's retry 1
    assert (got.start, got.attempt) == (Start.RUN, 2)
    sw.machine.retry_later(saga_id, 1, "t1", "Retry", 0.0, 2)
    # retry 1's other copy, delivered once the run it made asked for retry 2
    assert _claim(sw, saga_id, charge, "copy1", 1).start is Start.SUPERSEDED
    assert [_claim(sw, saga_id, charge, "t2", 2).start, _row(sw, saga_id).attempts] == [
        Start.RUN, 3]


def a_dead_attempts_step_is_not_rerun_by_an_earlier_retrys_copy(sw: Sagaworker,
                                                                quote: Any) -> None:
    saga_id = uid("turn")
    sw.begin(saga_id).enqueue(quote, 1)
    assert _claim(sw, saga_id, quote, "t0", 0).start is Start.RUN
    sw.machine.retry_later(saga_id, 1, "t0", "Retry", 0.0, 1)
    assert _claim(sw, saga_id, quote, "t1", 1).start is Start.RUN
    with sw.journal.engine.begin() as conn:  # retry 1's worker died: its lease lapsed
        conn.execute(update(entries).where(entries.c.saga_id == saga_id)
                     .values(lease_until=db_later(-1.0)))
    assert _claim(sw, saga_id, quote, "copy0", 0).start is Start.SUPERSEDED
    assert _row(sw, saga_id).attempt_token == "t1"
    got = _claim(sw, saga_id, quote, "t1b", 1)  # retry 1 redelivered: the re-run
    assert (got.start, got.rerun, _row(sw, saga_id).reruns) == (Start.RUN, True, 1)


def a_retry_delivered_early_waits_for_its_due_time(sw: Sagaworker, charge: Any) -> None:
    saga_id = uid("turn")
    sw.begin(saga_id).enqueue(charge, 1)
    assert _claim(sw, saga_id, charge, "t0", 0).start is Start.RUN
    sw.machine.retry_later(saga_id, 1, "t0", "Retry", 60.0, 1)
    early = _claim(sw, saga_id, charge, "early", 1)
    assert early.start is Start.NOT_DUE
    assert 50 < early.row.due_in <= 60  # the time left, on the database's clock
    assert _row(sw, saga_id).attempts == 1
    with sw.journal.engine.begin() as conn:  # a minute passes
        conn.execute(update(entries).where(entries.c.saga_id == saga_id)
                     .values(retry_due_at=db_later(-0.5)))
    assert _claim(sw, saga_id, charge, "t1", 1).start is Start.RUN


def test_copies_of_earlier_retries_never_run(sqlite_sw: Sagaworker) -> None:
    """A step retried by its tool: the journal counts the retry before its message goes
    out, and a message counted lower (a copy of an earlier retry) is refused, whichever
    retry it copies; the one counted as the journal runs."""
    copies_of_earlier_retries_never_run(sqlite_sw, tools(sqlite_sw)[0])


def test_a_dead_attempts_step_is_not_rerun_by_an_earlier_retrys_copy(
        sqlite_sw: Sagaworker) -> None:
    """An idempotent step whose retry's worker died: a copy of the message before that
    retry is refused (the locked claim's path), the retry's own redelivery re-runs it."""
    a_dead_attempts_step_is_not_rerun_by_an_earlier_retrys_copy(
        sqlite_sw, tools(sqlite_sw)[1])


def test_a_retry_delivered_early_waits_for_its_due_time(sqlite_sw: Sagaworker) -> None:
    """A retry delivered before its journaled due time is refused with the time left,
    then claimed once due."""
    a_retry_delivered_early_waits_for_its_due_time(sqlite_sw, tools(sqlite_sw)[0])


def test_an_early_retry_is_sent_again_for_its_due_time(sqlite_sw: Sagaworker) -> None:
    """The worker, given a retry before it is due, does not run the tool and does not drop
    the message: it publishes it again, with its count, for the time left."""
    ran: list[int] = []

    @sqlite_sw.tool()
    def pay(x: int) -> int:
        ran.append(x)
        return x

    sent: list[tuple[Any, ...]] = []

    def publish(*a: Any, **k: Any) -> bool:
        sent.append((*a, k))
        return True

    sqlite_sw.rt.bus.publish_step = publish  # type: ignore[method-assign]
    sqlite_sw.begin("early-1").enqueue(pay, 7)
    spec = sqlite_sw.registry.tool(pay.name)
    assert spec is not None
    assert _claim(sqlite_sw, "early-1", pay, "t0", 0).start is Start.RUN
    sqlite_sw.machine.retry_later("early-1", 1, "t0", "Retry", 30.0, 1)
    sent.clear()
    assert sqlite_sw.executor.run_step(spec, "early-1", 1, "celery-id", [7], {},
                                       retries=1) is False
    assert ran == []
    [(saga_id, seq, tool, args, kwargs, task_id, _queue, options)] = sent
    assert (saga_id, seq, tool, args, kwargs, task_id) == ("early-1", 1, pay.name, [7], {},
                                                          "celery-id")
    assert options["retries"] == 1 and 25 < options["countdown"] <= 30
