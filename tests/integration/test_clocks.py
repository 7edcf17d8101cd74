"""Counters and the database's clock, never two hosts' clocks: a lost flow advance is sent
again whatever the clocks of the workers say, deadlines are measured on the database's
clock and closed by the gates and claims themselves, and a lapsed lease is taken over only
if it is still lapsed when the takeover writes (journal logic on SQLite and PostgreSQL)."""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
import time_machine
from celery import Celery
from sqlalchemy import select, update
from structlog.testing import capture_logs

from sagaworker import (
    ApprovalInvalid,
    FlowContext,
    Reversibility,
    SagaStatus,
    Sagaworker,
    Settings,
)
from sagaworker._journal.dialect import aware, db_later, db_now
from sagaworker._journal.schema import entries, sagas
from sagaworker._machine.machine import Start
from tests.conftest import TEST_SECRET

_M = "tests.integration.test_clocks"


class Bus:
    """The broker, recording: nothing is delivered unless a test delivers it."""

    def __init__(self) -> None:
        self.sent: list[tuple[Any, ...]] = []

    def publish_step(self, saga_id: str, seq: int, tool: str, *a: Any, **k: Any) -> bool:
        self.sent.append(("step", saga_id, seq))
        return True

    def send_failure(self, saga_id: str, reason: str) -> None:
        self.sent.append(("failure", saga_id, reason))

    def send_compensate(self, saga_id: str, *, countdown: float | None = None) -> None:
        self.sent.append(("compensate", saga_id))

    def send_advance(self, saga_id: str, *, countdown: float | None = None) -> None:
        self.sent.append(("advance", saga_id))

    def queue_of(self, tool: str, queue: str | None) -> str | None:
        return None

    def ready(self, queues: set[str]) -> dict[str, int]:
        return {}


def both(s: FlowContext, n: int) -> list[Any]:
    """Two steps side by side, awaited together."""
    return s.gather(s.enqueue(f"{_M}.plain", n), s.enqueue(f"{_M}.plain", n + 1))


#: a journal on each database (the fixtures' parameter)
ON_BOTH = ["sqlite", pytest.param("postgresql", marks=pytest.mark.services)]


def journal_only(request: pytest.FixtureRequest, tmp_path: Path, **settings: Any) -> Sagaworker:
    """A Sagaworker on the parameter's database whose broker only records (``Bus``)."""
    url = (f"sqlite:///{tmp_path / 'j.db'}" if request.param == "sqlite"
           else request.getfixturevalue("pg_url"))
    sw = Sagaworker(Celery("journal", broker="memory://"), settings=Settings(
        database_url=url, broker_url="memory://", approval_secret=TEST_SECRET,
        lease_seconds=30, **settings))
    sw.rt.bus = Bus()  # type: ignore[assignment]
    return sw


@pytest.fixture(params=ON_BOTH)
def sw(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Sagaworker]:
    sw = journal_only(request, tmp_path, relay_after=0.2)

    @sw.tool(idempotent=True)
    def plain(n: int) -> int:
        return n

    @sw.tool(reversibility=Reversibility.IRREVERSIBLE)
    def ship(n: int) -> int:
        return n

    sw.flow()(both)
    yield sw
    sw.rt.journal.engine.dispose()


def bus(sw: Sagaworker) -> Bus:
    return sw.rt.bus  # type: ignore[return-value]


def new_id() -> str:
    return f"c-{uuid.uuid4().hex[:10]}"


def run_step(sw: Sagaworker, saga_id: str, seq: int) -> None:
    """A worker runs step ``seq`` and journals EXECUTED (its advance is lost)."""
    tool = sw.inspect(saga_id).entries[seq - 1].tool_name
    token = uuid.uuid4().hex
    claim = sw.machine.claim_start(saga_id, seq, tool, token=token, worker="w",
                                   idempotent=True, task_id=None)
    assert claim.start is Start.RUN
    assert sw.machine.executed(saga_id, seq, token, seq, 1.0).applied


def quiet(sw: Sagaworker, saga_id: str) -> None:
    """The saga had no write for a while (its last update moves back)."""
    with sw.journal.engine.begin() as conn:
        conn.execute(update(sagas).where(sagas.c.saga_id == saga_id)
                     .values(updated_at=db_later(-60)))


def resent(sw: Sagaworker, saga_id: str) -> bool:
    bus(sw).sent.clear()
    sw.sweeper.sweep()
    return ("advance", saga_id) in bus(sw).sent


def test_an_outcome_journaled_while_a_replay_reads_is_advanced_again(sw: Sagaworker) -> None:
    """Two parallel steps: a replay reads the journal, the other step's worker journals
    EXECUTED and dies before its advance, the replay then records its advance. The
    sweeper still sends the advance again (the replay read one outcome, two exist)."""
    saga_id = new_id()
    sw.start(saga_id, both, 1)
    sw.flows.advance(saga_id)
    run_step(sw, saga_id, 1)
    read = sw.journal.saga_and_entries

    def read_then_race(sid: str) -> Any:
        got = read(sid)
        run_step(sw, saga_id, 2)  # committed after the read, its advance lost
        return got

    sw.journal.saga_and_entries = read_then_race  # type: ignore[method-assign]
    sw.flows.advance(saga_id)
    del sw.journal.saga_and_entries
    assert [e.phase.value for e in sw.inspect(saga_id).entries] == ["EXECUTED", "EXECUTED"]
    assert sw.inspect(saga_id).status is SagaStatus.RUNNING
    quiet(sw, saga_id)
    assert resent(sw, saga_id)
    sw.flows.advance(saga_id)  # the re-sent advance completes the flow
    assert sw.inspect(saga_id).status is SagaStatus.COMPLETED


def test_a_worker_whose_clock_is_behind_loses_no_advance(sw: Sagaworker) -> None:
    """The worker that journals the second outcome runs 2 s behind the one that advanced
    the flow a moment before; its advance is lost. The sweeper sends it again."""
    saga_id = new_id()
    sw.start(saga_id, both, 1)
    sw.flows.advance(saga_id)
    run_step(sw, saga_id, 1)
    sw.flows.advance(saga_id)  # waits on step 2
    with time_machine.travel(datetime.now(UTC) - timedelta(seconds=2), tick=True):
        run_step(sw, saga_id, 2)
    quiet(sw, saga_id)
    assert resent(sw, saga_id)


def test_a_replay_that_saw_everything_is_not_resent(sw: Sagaworker) -> None:
    """The count is what stops the resend too: a flow whose replay read every outcome is
    left alone (it waits on nothing lost)."""
    saga_id = new_id()
    sw.start(saga_id, both, 1)
    sw.flows.advance(saga_id)
    run_step(sw, saga_id, 1)
    sw.flows.advance(saga_id)
    quiet(sw, saga_id)
    assert not resent(sw, saga_id)


def db_time(sw: Sagaworker) -> datetime:
    with sw.journal.reader.connect() as conn:
        return aware(conn.execute(select(db_now())).scalar_one())  # type: ignore[return-value]


def test_a_deadline_is_measured_on_the_databases_clock(sw: Sagaworker) -> None:
    """A producer 120 s behind gives its saga a 60 s deadline: 60 s on the database's
    clock, not one already passed (nothing fails it at the next sweep)."""
    saga_id = new_id()
    with time_machine.travel(datetime.now(UTC) - timedelta(seconds=120), tick=True):
        sw.begin(saga_id, deadline=60)
    row = sw.journal.saga_row(saga_id)
    left = (aware(row.deadline_at) - db_time(sw)).total_seconds()  # type: ignore[operator]
    assert 50 < left <= 60
    sw.sweeper.sweep()
    assert sw.journal.saga_row(saga_id).fail_requested_at is None


def wait_past_deadline(sw: Sagaworker, saga_id: str) -> None:
    """Until the database's clock passes the saga's deadline."""
    give_up = time.monotonic() + 10
    while time.monotonic() < give_up:
        with sw.journal.reader.connect() as conn:
            if conn.execute(select(sagas.c.saga_id).where(
                    sagas.c.saga_id == saga_id, sagas.c.deadline_at < db_now())).first():
                return
        time.sleep(0.05)
    raise AssertionError("the deadline never passed on the database's clock")


def test_an_approval_after_the_deadline_is_refused_and_fails_the_saga(sw: Sagaworker) -> None:
    """The sweeper has not run: the gate itself refuses an approval made after the
    deadline, asks the saga to fail and sends the failure message."""
    saga_id = new_id()
    saga = sw.begin(saga_id, deadline=0.3)
    saga.enqueue(f"{_M}.ship", 1)
    (token,) = [a.token for a in sw.pending_approvals() if a.saga_id == saga_id]
    wait_past_deadline(sw, saga_id)
    with capture_logs() as logs, pytest.raises(ApprovalInvalid, match="deadline"):
        sw.approve(token, approver="ops")
    row = sw.journal.saga_row(saga_id)
    assert (row.fail_requested_at is not None, row.reason) == (True, "deadline passed")
    assert sw.inspect(saga_id).entries[0].approved_by is None
    assert ("failure", saga_id, "deadline passed") in bus(sw).sent
    (event,) = [e for e in logs if e["event"] == "saga_deadline_passed"]
    assert event["deadline_at"] == aware(row.deadline_at).isoformat()  # type: ignore[union-attr]


def test_a_claim_after_the_deadline_runs_nothing(sw: Sagaworker) -> None:
    """A step delivered after its saga's deadline (the sweeper has not run) is not run:
    the claim cancels it and asks the saga to fail."""
    saga_id = new_id()
    saga = sw.begin(saga_id, deadline=0.3)
    saga.enqueue(f"{_M}.plain", 1)
    wait_past_deadline(sw, saga_id)
    claim = sw.machine.claim_start(saga_id, 1, f"{_M}.plain", token="t1", worker="w",
                                   idempotent=True, task_id=None)
    assert (claim.start, claim.overdue) == (Start.CANCELLED, True)
    assert sw.journal.saga_row(saga_id).reason == "deadline passed"


def test_a_failure_request_is_resent_whatever_the_producers_clock(sw: Sagaworker) -> None:
    """A producer 300 s ahead asks a saga to fail and its failure message is lost: the
    sweeper (on the database's clock) sends it again at once, not 300 s later."""
    saga_id = new_id()
    saga = sw.begin(saga_id)
    with time_machine.travel(datetime.now(UTC) + timedelta(seconds=300), tick=True):
        saga.fail("a reason")
    bus(sw).sent.clear()
    give_up = time.monotonic() + 10
    while ("failure", saga_id, "a reason") not in bus(sw).sent:
        assert time.monotonic() < give_up, "the lost failure message was never sent again"
        sw.sweeper.sweep()
        time.sleep(0.1)


@pytest.mark.services
def test_a_lapsed_lease_revived_before_the_takeover_is_not_taken(pg_url: str,
                                                                 tmp_path: Path) -> None:
    """An idempotent step's lease lapsed; a new delivery's claim reads it lapsed, and
    before it writes, the late-but-live attempt's heartbeat extends it. The takeover is a
    compare-and-set on what the claim read: it finds the attempt alive (BUSY), so the tool
    never runs twice at once."""
    app = Celery("lease", broker="memory://")
    sw = Sagaworker(app, settings=Settings(database_url=pg_url, broker_url="memory://",
                                           lease_seconds=30))

    @sw.tool(idempotent=True)
    def plain(n: int) -> int:
        return n

    sw.rt.bus = Bus()  # type: ignore[assignment]
    saga_id = new_id()
    sw.begin(saga_id).enqueue(plain, 1)
    tool = f"{_M}.plain"
    assert sw.machine.claim_start(saga_id, 1, tool, token="old", worker="w",
                                  idempotent=True, task_id=None).start is Start.RUN
    with sw.journal.engine.begin() as conn:
        conn.execute(update(entries).where(entries.c.saga_id == saga_id)
                     .values(lease_until=db_later(-1)))
    overdue = sw.machine._overdue

    def heartbeat_between(conn: Any, saga: Any) -> bool:
        # another connection, as the live attempt's worker would
        t = threading.Thread(target=sw.machine.heartbeat, args=([(saga_id, 1, False, "old")],))
        t.start()
        t.join()
        return overdue(conn, saga)

    sw.machine._overdue = heartbeat_between  # type: ignore[method-assign]
    claim = sw.machine.claim_start(saga_id, 1, tool, token="new", worker="w",
                                   idempotent=True, task_id=None)
    assert claim.start is Start.BUSY
    assert sw.journal.entry_row(saga_id, 1).attempt_token == "old"
    sw.rt.journal.engine.dispose()
