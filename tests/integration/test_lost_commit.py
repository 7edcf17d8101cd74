"""A move replayed after a lost COMMIT reply answers as its first run did, pages included.

The connection is cut right after a COMMIT that succeeded (the database applied it, the
caller never heard): ``@retrying`` replays the whole transaction, which now finds its own
write. Each test checks the fault hit (a commit was lost) and that the replay still
reports what the first run found: the step in doubt, the undo given up, the deadline,
one audit row, the approval.
"""

from __future__ import annotations

import sqlite3
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import psycopg
import pytest
from sqlalchemy import func, select, update
from structlog.testing import capture_logs

from sagaworker import ApprovalInvalid, CompensationContext, Reversibility, SagaStatus, Sagaworker
from sagaworker._journal.dialect import db_later
from sagaworker._journal.schema import audit, entries, sagas
from sagaworker._machine.machine import Start, UndoClaim
from tests.integration.test_clocks import ON_BOTH, journal_only

_M = "tests.integration.test_lost_commit"


@pytest.fixture(params=ON_BOTH)
def sw(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Sagaworker]:
    sw = journal_only(request, tmp_path, compensation_retries=0)

    @sw.tool(compensable_by="undo_plain")
    def plain(n: int) -> int:
        return n

    @sw.compensation
    def undo_plain(ctx: CompensationContext) -> None:
        pass

    @sw.tool(reversibility=Reversibility.IRREVERSIBLE)
    def ship(n: int) -> int:
        return n

    yield sw
    sw.rt.journal.engine.dispose()


@contextmanager
def lose_commit_reply(sw: Sagaworker, nth: int = 1) -> Iterator[list[int]]:
    """The ``nth`` COMMIT from now is applied and its reply lost (the connection dropped
    right after it); yields how many commits are still to lose (0: the fault hit)."""
    dialect = sw.journal.engine.dialect
    real = dialect.do_commit
    count = [0]
    left = [1]

    def do_commit(dbapi_conn: Any) -> None:
        real(dbapi_conn)
        count[0] += 1
        if count[0] == nth and left[0]:
            left[0] = 0
            if dialect.name == "postgresql":  # SQLAlchemy takes it for a disconnect
                raise psycopg.OperationalError("server closed the connection unexpectedly")
            raise sqlite3.OperationalError("disk I/O error")

    dialect.do_commit = do_commit  # type: ignore[method-assign]
    try:
        yield left
    finally:
        del dialect.do_commit


def new_id() -> str:
    return f"l-{uuid.uuid4().hex[:10]}"


def started_and_lost(sw: Sagaworker, saga_id: str, seq: int, tool: str) -> None:
    """Step ``seq`` was claimed and its worker lost (the lease lapsed, no outcome)."""
    claim = sw.machine.claim_start(saga_id, seq, tool, token=f"dead{seq}", worker="w",
                                   idempotent=False, task_id=None)
    assert claim.start is Start.RUN
    with sw.journal.engine.begin() as conn:
        conn.execute(update(entries).where(entries.c.saga_id == saga_id, entries.c.seq == seq)
                     .values(lease_until=db_later(-1)))


def executed(sw: Sagaworker, saga_id: str, seq: int, tool: str) -> None:
    token = uuid.uuid4().hex
    assert sw.machine.claim_start(saga_id, seq, tool, token=token, worker="w",
                                  idempotent=False, task_id=None).start is Start.RUN
    assert sw.machine.executed(saga_id, seq, token, seq, 1.0).applied


def abort_rows(sw: Sagaworker, saga_id: str) -> int:
    with sw.journal.reader.connect() as conn:
        return int(conn.execute(select(func.count()).select_from(audit).where(
            audit.c.saga_id == saga_id, audit.c.action == "abort")).scalar() or 0)


def events(logs: list[dict[str, Any]], name: str) -> list[dict[str, Any]]:
    return [e for e in logs if e["event"] == name]


def test_a_claim_that_found_a_dead_step_answers_in_doubt_again(sw: Sagaworker) -> None:
    """The claim that journals a dead step in doubt (and asks the saga to fail) loses its
    COMMIT reply: replayed, it still answers IN_DOUBT, so its worker logs step_in_doubt
    and sends the failure message (not 'finished', which pages nobody)."""
    saga_id = new_id()
    sw.begin(saga_id).enqueue(f"{_M}.plain", 1)
    started_and_lost(sw, saga_id, 1, f"{_M}.plain")
    with lose_commit_reply(sw) as left:
        claim = sw.machine.claim_start(saga_id, 1, f"{_M}.plain", token="next", worker="w",
                                       idempotent=False, task_id=None)
    assert left == [0]
    assert claim.start is Start.IN_DOUBT
    assert sw.inspect(saga_id).entries[0].in_doubt


def test_a_chain_that_found_a_dead_step_still_pages(sw: Sagaworker) -> None:
    """The chain's claim finds a forward step dead (in doubt) and claims the next undo;
    its COMMIT reply is lost. Replayed, it still reports the step in doubt: one
    step_in_doubt line, the page on-call keys on."""
    saga_id = new_id()
    saga = sw.begin(saga_id)
    saga.enqueue(f"{_M}.plain", 1)
    saga.enqueue(f"{_M}.plain", 2)
    executed(sw, saga_id, 1, f"{_M}.plain")
    started_and_lost(sw, saga_id, 2, f"{_M}.plain")
    sw.machine.request_failure(saga_id, "a reason")
    with capture_logs() as logs, lose_commit_reply(sw, nth=2) as left:
        sw.compensator.handle_failure(saga_id, "a reason")  # commit 1: begin compensation
    assert left == [0]
    assert [(e["seq"], e["tool"]) for e in events(logs, "step_in_doubt")] == [
        (2, f"{_M}.plain")]
    assert sw.inspect(saga_id).status is SagaStatus.COMPENSATED


def test_an_undo_given_up_as_died_still_pages(sw: Sagaworker) -> None:
    """An undo's worker died on its last try; the chain that gives it up and finishes the
    saga dirty loses its COMMIT reply. Replayed, it still logs compensation_failed and
    saga_compensation_failed."""
    saga_id = new_id()
    sw.begin(saga_id).enqueue(f"{_M}.plain", 1)
    executed(sw, saga_id, 1, f"{_M}.plain")
    won, _, _ = sw.machine.begin_compensation(saga_id, "a reason", "chain")
    assert won
    assert sw.machine.claim_undo(saga_id, "undo1").state is UndoClaim.CLAIMED
    with sw.journal.engine.begin() as conn:  # its worker died: the undo's lease lapses
        conn.execute(update(entries).where(entries.c.saga_id == saga_id)
                     .values(comp_lease_until=db_later(-1)))
    with capture_logs() as logs, lose_commit_reply(sw) as left:
        sw.compensator.run_chain(saga_id)
    assert left == [0]
    assert [e["detail"][:29] for e in events(logs, "compensation_failed")] == [
        "the undo's worker died during"]
    assert len(events(logs, "saga_compensation_failed")) == 1
    assert sw.inspect(saga_id).status is SagaStatus.COMPENSATION_FAILED


def test_a_deadline_pass_that_lost_its_reply_still_reports_it(sw: Sagaworker) -> None:
    """The sweeper's deadline pass asks an overdue saga to fail; the reply is lost. The
    replay answers with the saga (saga_deadline_passed logged, the failure sent)."""
    saga_id = new_id()
    sw.begin(saga_id, deadline=30)
    with sw.journal.engine.begin() as conn:
        conn.execute(update(sagas).where(sagas.c.saga_id == saga_id)
                     .values(deadline_at=db_later(-1)))
    with capture_logs() as logs, lose_commit_reply(sw) as left:
        sw.sweeper.sweep()
    assert left == [0]
    assert len(events(logs, "saga_deadline_passed")) == 1
    assert ("failure", saga_id, "deadline passed") in sw.rt.bus.sent  # type: ignore[attr-defined]


def test_an_abort_that_lost_its_reply_is_audited_once(sw: Sagaworker) -> None:
    """An operator's abort loses its COMMIT reply: replayed, it neither fails nor writes
    a second audit row."""
    saga_id = new_id()
    sw.begin(saga_id)
    with lose_commit_reply(sw) as left:
        sw.abort(saga_id, reason="stop it", actor="ops")
    assert left == [0]
    assert abort_rows(sw, saga_id) == 1


def test_an_approval_that_lost_its_reply_is_granted(sw: Sagaworker) -> None:
    """The approval is journaled and its reply lost: replayed, it answers as granted and
    the step is published (not 'already decided, this token was used')."""
    saga_id = new_id()
    sw.begin(saga_id).enqueue(f"{_M}.ship", 1)
    (token,) = [a.token for a in sw.pending_approvals() if a.saga_id == saga_id]
    with lose_commit_reply(sw) as left:
        sw.approve(token, approver="ops")
    assert left == [0]
    assert ("step", saga_id, 1) in sw.rt.bus.sent  # type: ignore[attr-defined]
    assert sw.inspect(saga_id).entries[0].approved_by == "ops"


def test_an_approved_steps_failure_that_lost_its_reply_answers_as_its_first_run(
        sw: Sagaworker) -> None:
    """An approved gated step (its approval's token on the row) FAILED by the attempt that
    holds it, the reply lost: replayed, the move finds its own FAILED and answers with the
    saga's status, as its first run (it took the approval's token for another move's
    doubt and answered None: the worker then sent no failure; found by the model
    checker)."""
    saga_id = new_id()
    sw.begin(saga_id).enqueue(f"{_M}.ship", 1)
    (token,) = [a.token for a in sw.pending_approvals() if a.saga_id == saga_id]
    sw.approve(token, approver="ops")
    claim = sw.machine.claim_start(saga_id, 1, f"{_M}.ship", token="t1", worker="w",
                                   idempotent=False, task_id=None, retries=0)
    assert claim.start is Start.RUN
    with lose_commit_reply(sw) as left:
        status = sw.machine.failed(saga_id, 1, "t1", "Boom")
    assert left == [0]
    assert status is SagaStatus.RUNNING  # (asked to fail by this move)
    row = sw.journal.entry_row(saga_id, 1)
    assert (row.phase, row.in_doubt, row.attempt_token) == ("FAILED", False, "t1")


def test_an_abort_of_a_failing_saga_that_lost_its_reply_is_audited_once(
        sw: Sagaworker) -> None:
    """A step failed (the saga is asked to fail, its handler has not run) and an operator
    aborts it too; the reply is lost. Replayed, the abort writes no second audit row."""
    saga_id = new_id()
    sw.begin(saga_id)
    sw.machine.request_failure(saga_id, "a step failed")
    with lose_commit_reply(sw) as left:
        sw.abort(saga_id, reason="stop it", actor="ops")
    assert left == [0]
    assert abort_rows(sw, saga_id) == 1


def test_an_approval_refused_for_its_deadline_answers_the_same_when_replayed(
        sw: Sagaworker) -> None:
    """The gate refuses an approval after the deadline and asks the saga to fail; the
    reply is lost. Replayed, it refuses for the deadline again (the event logged once with
    its deadline, the failure sent), not as 'its gates are closed'."""
    saga_id = new_id()
    sw.begin(saga_id, deadline=30).enqueue(f"{_M}.ship", 1)
    (token,) = [a.token for a in sw.pending_approvals() if a.saga_id == saga_id]
    with sw.journal.engine.begin() as conn:
        conn.execute(update(sagas).where(sagas.c.saga_id == saga_id)
                     .values(deadline_at=db_later(-1)))
    with capture_logs() as logs, lose_commit_reply(sw) as left, \
            pytest.raises(ApprovalInvalid, match="passed its deadline"):
        sw.approve(token, approver="ops")
    assert left == [0]
    (event,) = events(logs, "saga_deadline_passed")
    assert event["deadline_at"] is not None
    assert ("failure", saga_id, "deadline passed") in sw.rt.bus.sent  # type: ignore[attr-defined]


def test_enqueue_many_that_lost_its_commit_reply_answers_as_its_first_run(
        sw: Sagaworker) -> None:
    """``enqueue_many``'s COMMIT applied, its reply lost: the call returns the steps it
    journaled (no error for steps that exist, so no caller retries them into doubles)."""
    saga = sw.begin(new_id())
    tool = sw.registry.tool(f"{_M}.plain").task  # type: ignore[union-attr]
    with capture_logs() as logs, lose_commit_reply(sw) as left:
        steps = saga.enqueue_many([(tool, (1,), {}), (tool, (2,), {})])
    assert left == [0], "no COMMIT reply was lost: the test proves nothing"
    assert [(s.seq, s.task_id) for s in steps] == [
        (e.seq, e.task_id) for e in sw.inspect(saga.saga_id).entries]
    assert [s.seq for s in steps] == [1, 2]
    assert len(events(logs, "database_commit_reply_lost")) == 1
