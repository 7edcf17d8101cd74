"""The one-round-trip statements of the step path (``_pgfast``) on a real PostgreSQL:
lost connections, statements that outlive their client, interrupted statements."""

from __future__ import annotations

import contextlib
import dataclasses
import signal
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from celery import Celery
from psycopg.types.json import Jsonb
from sqlalchemy import create_engine, select
from sqlalchemy.exc import OperationalError

from sagaworker import Sagaworker
from sagaworker._base.canonical import args_digest
from sagaworker._base.types import Reversibility
from sagaworker._journal import pgconn
from sagaworker._journal.schema import entries, sagas
from sagaworker._machine import pgfast as _pgfast
from sagaworker._worker.verify import verify
from tests.conftest import uid

pytestmark = pytest.mark.services


class Proxy:
    """A TCP proxy to PostgreSQL whose client side can be cut while the server side stays
    open: the server process goes on with the statement it was given, as when a client
    host or a network path dies."""

    def __init__(self, upstream: tuple[str, int] = ("127.0.0.1", 5432)) -> None:
        self.upstream = upstream
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.clients: list[socket.socket] = []
        self.servers: list[socket.socket] = []
        self.lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            server = socket.create_connection(self.upstream)
            with self.lock:
                self.clients.append(client)
                self.servers.append(server)
            threading.Thread(target=self._pump, args=(client, server), daemon=True).start()
            threading.Thread(target=self._pump, args=(server, client), daemon=True).start()

    @staticmethod
    def _pump(src: socket.socket, dst: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while data := src.recv(65536):
                dst.sendall(data)

    def cut_clients(self) -> None:
        """Close every client-side socket; the server-side ones stay open and silent."""
        with self.lock:
            for c in self.clients:
                with contextlib.suppress(OSError):
                    c.shutdown(socket.SHUT_RDWR)
                c.close()
            self.clients.clear()

    def close(self) -> None:
        self.listener.close()
        self.cut_clients()
        for s in self.servers:
            with contextlib.suppress(OSError):
                s.close()


@pytest.fixture
def proxied(pg_url: str) -> Iterator[tuple[Sagaworker, Proxy]]:
    proxy = Proxy()
    url = pg_url.replace("127.0.0.1:5432", f"127.0.0.1:{proxy.port}")
    sw = Sagaworker(Celery("pgfast", broker="memory://"), database_url=url)

    @sw.tool()
    def charge(amount: int) -> int:
        return amount

    sw.rt.bus.publish_step = lambda *a, **k: True  # type: ignore[method-assign]
    yield sw, proxy
    sw.journal.engine.dispose()
    proxy.close()


def _direct(pg_url: str) -> psycopg.Connection[Any]:
    return psycopg.connect(pg_url.replace("postgresql+psycopg://", "postgresql://"))


def test_intent_whose_connection_is_lost_while_it_waits_is_journaled_once(
        proxied: tuple[Sagaworker, Proxy], pg_url: str) -> None:
    """An INTENT waiting on the saga row lock when its client's connection dies would
    commit later on its own; the producer's replay must not journal the step a second
    time (the step would run twice: the relay publishes the orphan, the replay its own)."""
    sw, proxy = proxied
    saga_id = uid("orphan")
    saga = sw.begin(saga_id)
    holder = _direct(pg_url)
    holder.execute("SELECT 1 FROM sagaworker_sagas WHERE saga_id = %s FOR UPDATE",
                   (saga_id,))
    result: dict[str, Any] = {}

    def enqueue() -> None:
        try:
            result["step"] = saga.enqueue(sw.registry.tools[next(iter(sw.registry.tools))]
                                          .task, 5)
        except Exception as exc:  # reported by the assertion below
            result["error"] = exc

    t = threading.Thread(target=enqueue)
    t.start()
    with _direct(pg_url) as watcher:
        watcher.autocommit = True
        waiting = None
        deadline = time.monotonic() + 10
        while waiting is None and time.monotonic() < deadline:
            row = watcher.execute(
                "SELECT pid FROM pg_stat_activity WHERE wait_event_type = 'Lock' "
                "AND query LIKE '%%INSERT INTO sagaworker_entries%%'").fetchone()
            waiting = row[0] if row else None
            time.sleep(0.02)
        assert waiting is not None, "the INTENT never waited on the saga row"
        proxy.cut_clients()  # the client's connection dies; its statement waits on
        # the producer replays the INTENT: its new statement queues on the saga row too
        deadline = time.monotonic() + 10
        replay = None
        while replay is None and time.monotonic() < deadline:
            row = watcher.execute(
                "SELECT pid FROM pg_stat_activity WHERE wait_event_type = 'Lock' "
                "AND query LIKE '%%INSERT INTO sagaworker_entries%%' AND pid <> %s",
                (waiting,)).fetchone()
            replay = row[0] if row else None
            time.sleep(0.02)
        assert replay is not None, "the producer did not replay the INTENT"
    holder.commit()  # the saga row is free: whatever still waits on it commits now
    holder.close()
    t.join(30)
    assert "error" not in result, result.get("error")
    assert result["step"].seq == 1
    with sw.journal.engine.connect() as conn:
        seqs = list(conn.execute(select(entries.c.seq).where(entries.c.saga_id == saga_id))
                    .scalars())
        last = conn.execute(select(sagas.c.last_seq).where(sagas.c.saga_id == saga_id)).scalar()
    assert seqs == [1], f"the step was journaled {len(seqs)} times: {seqs}"
    assert last == 1


def test_a_refused_connect_is_sqlalchemys_operational_error() -> None:
    """What ``_journal.retrying`` replays: a failed connect too, not only a lost statement
    (a PostgreSQL restart refuses connections for a while)."""
    with socket.create_server(("127.0.0.1", 0)) as s:
        port = s.getsockname()[1]
    engine = create_engine(f"postgresql+psycopg://root@127.0.0.1:{port}/postgres")
    with pytest.raises(OperationalError):
        _pgfast.claim(engine, saga_id="s", seq=1, tool="t", token="x", worker="w",
                      task_id=None, lease=5)
    engine.dispose()


def test_a_failed_statement_quotes_none_of_its_parameters(pg_url: str) -> None:
    """A one-round-trip statement's error (it reaches log lines) carries its SQL and the
    server's message, not the values bound to it (a tool's arguments and results)."""
    from sqlalchemy.exc import ProgrammingError

    from sagaworker import make_engine

    card = "4000123412341234"
    engine = make_engine(pg_url)
    with pytest.raises(ProgrammingError) as err:
        pgconn.run(engine, "SELECT 1 FROM nowhere WHERE x = %(card)s", {"card": card})
    assert "nowhere" in str(err.value) and card not in str(err.value)
    engine.dispose()


class _Interrupted(BaseException):
    pass


def test_a_statement_interrupted_midway_never_returns_its_connection_to_the_pool(
        pg_url: str) -> None:
    """A soft time limit (or a gevent timeout) raised while a statement runs: the
    connection is discarded, and the next checkout is a clean transactional one."""
    engine = create_engine(pg_url, pool_size=1, max_overflow=0)

    def alarm(*_: Any) -> None:
        raise _Interrupted

    old = signal.signal(signal.SIGALRM, alarm)
    try:
        signal.setitimer(signal.ITIMER_REAL, 0.2)
        with pytest.raises(_Interrupted):
            pgconn.run(engine, "SELECT pg_sleep(2)", {})
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
    raw = engine.raw_connection()
    try:
        pg = raw.driver_connection
        assert pg is not None and not pg.autocommit
        assert pg.info.transaction_status == psycopg.pq.TransactionStatus.IDLE
    finally:
        raw.close()
    assert pgconn.run(engine, "SELECT 41 + %(n)s", {"n": 1}) == (42,)
    engine.dispose()


def test_a_tool_made_gated_since_its_step_was_journaled_is_refused_cleanly() -> None:
    """The fast claim returns what ``verify`` needs: an entry journaled ungated, claimed
    by a worker whose tool is now gated, is refused (not an AttributeError)."""
    sw = Sagaworker(Celery("gated", broker="memory://"), database_url="sqlite://")

    @sw.tool()
    def ship(order: str) -> str:
        return order

    spec = sw.registry.tool(next(iter(sw.registry.tools)))
    assert spec is not None
    gated = dataclasses.replace(spec, reversibility=Reversibility.IRREVERSIBLE)
    assert gated.gated
    row = _pgfast.Claimed(1, args_digest(("o-1",), {}))
    problem = verify(sw.rt, gated, row, ("o-1",), {})
    assert problem is not None and "approval verification failed" in problem


def _executed_saga(sw: Sagaworker, steps: int) -> str:
    """A saga with ``steps`` EXECUTED steps of ``charge``, failing: its chain may start."""
    saga_id = uid("undo")
    saga = sw.begin(saga_id)
    m = sw.rt.machine
    for i in range(steps):
        seq = saga.enqueue(sw.registry.tools[next(iter(sw.registry.tools))].task, i).seq
        token = f"t{i}".ljust(32, "x")
        assert m.claim_start(saga_id, seq, next(iter(sw.registry.tools)), token=token,
                             worker="test", idempotent=False, task_id=None).attempt == 1
        assert m.executed(saga_id, seq, token, i, 1.0).applied
    m.begin_compensation(saga_id, "test", "b" * 32)
    return saga_id


def test_an_undo_outcome_lands_and_the_next_undo_is_claimed_in_one_call(
        proxied: tuple[Sagaworker, Proxy]) -> None:
    """The chain's common step on PostgreSQL (one round trip): the outcome is journaled
    on the undo the chain holds, and the latest-EXECUTED remaining step's undo claimed."""
    from sagaworker._base.types import OutcomeResult

    sw, _ = proxied
    saga_id = _executed_saga(sw, 3)
    m = sw.rt.machine
    st = m.claim_undo(saga_id, "c1".ljust(32, "x"))
    assert st.row.seq == 3
    recorded, st2 = m.record_and_claim(saga_id, 3, OutcomeResult.COMPENSATED, None, 1,
                                       "c1".ljust(32, "x"), "c2".ljust(32, "x"))
    assert recorded and isinstance(st2.row, _pgfast.UndoRow)  # the one-call path ran
    assert (st2.row.seq, st2.row.args, st2.attempt, st2.reason) == (2, [1], 1, "test")
    rows = {r.seq: r for r in sw.inspect(saga_id).entries}
    assert rows[3].compensation is OutcomeResult.COMPENSATED


def test_a_late_undo_whose_step_was_taken_over_records_nothing(
        proxied: tuple[Sagaworker, Proxy]) -> None:
    """An undo whose lease lapsed and whose step another chain took over finishes late:
    its outcome is refused (the taker's undo runs), on the one-call path too."""
    from sqlalchemy import update as sa_update

    from sagaworker._base.types import OutcomeResult

    sw, _ = proxied
    saga_id = _executed_saga(sw, 3)
    m = sw.rt.machine
    late, taker = "late".ljust(32, "x"), "taker".ljust(32, "x")
    assert m.claim_undo(saga_id, late).row.seq == 3
    with sw.journal.engine.begin() as conn:  # its lease lapses
        conn.execute(sa_update(entries).where(entries.c.saga_id == saga_id,
                                              entries.c.seq == 3)
                     .values(comp_lease_until=select(sagas.c.created_at).where(
                         sagas.c.saga_id == saga_id).scalar_subquery()))
    assert m.claim_undo(saga_id, taker).row.seq == 3  # another chain takes it over
    recorded, _ = m.record_and_claim(saga_id, 3, OutcomeResult.COMPENSATED, None, 1, late,
                                     "next".ljust(32, "x"))
    assert not recorded
    row = sw.journal.entry_row(saga_id, 3)
    assert row.compensation is None and row.undo_token == taker


def test_a_flow_never_completes_over_a_step_journaled_while_it_waited(
        proxied: tuple[Sagaworker, Proxy], pg_url: str) -> None:
    """A flow's replay returned and its saga completes in one statement; that statement
    waits on the saga row while another journals a step and commits: its snapshot does
    not see the step, so the saga's last seq (checked again on the locked row) must
    refuse, and the full path then says why the saga cannot complete."""
    from sagaworker import SagaworkerError

    sw, _ = proxied
    saga_id = uid("complete")
    sw.begin(saga_id)
    holder = _direct(pg_url)
    holder.execute("SELECT 1 FROM sagaworker_sagas WHERE saga_id = %s FOR UPDATE",
                   (saga_id,))
    result: dict[str, Any] = {}

    def complete() -> None:
        try:
            sw.rt.machine.complete(saga_id, result=1, expect_seq=0)
            result["completed"] = True
        except SagaworkerError as exc:
            result["refused"] = str(exc)

    t = threading.Thread(target=complete)
    t.start()
    with _direct(pg_url) as watcher:
        watcher.autocommit = True
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and not watcher.execute(
                "SELECT pid FROM pg_stat_activity WHERE wait_event_type = 'Lock' "
                "AND query LIKE '%%SET status = ''COMPLETED''%%'").fetchone():
            time.sleep(0.02)
    holder.execute(_pgfast._intent_sql(False, False), {
        "saga": saga_id, "tool": "charge", "phase": "INTENT", "args": Jsonb([1]),
        "kwargs": Jsonb({}), "digest": args_digest([1], {}), "queue": None,
        "task_id": uid("task"), "nonce": None})
    holder.commit()
    t.join(20)
    holder.close()
    assert "refused" in result and "not EXECUTED" in result["refused"], result
    assert sw.inspect(saga_id).status.value == "RUNNING"


def test_an_eager_claim_whose_reply_is_lost_while_the_database_is_away_stays_claimed(
        pg_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """An eager step's INTENT and claim commit, the reply is lost and the database is
    unreachable for a moment (the next reads fail too): the journal waits it out, finds
    the step by its task id and the claim by its token, and answers as the first run
    would have (the step is this worker's to run, not left to lapse into doubt)."""
    from sagaworker._journal.reads import Claiming, NewEntry

    sw = Sagaworker(Celery("pgfast", broker="memory://"), database_url=pg_url)
    saga_id = uid("eager-lost")
    sw.begin(saga_id)
    real = pgconn.run
    calls: list[str] = []

    def flaky(engine: Any, sql: str, params: dict[str, Any]) -> Any:
        calls.append(sql)
        if len(calls) == 1:  # the INTENT: applied, its reply lost
            real(engine, sql, params)
            raise OperationalError(sql, {}, Exception("server closed the connection"))
        if len(calls) <= 4:  # the database is away for the next three statements
            raise OperationalError(sql, {}, Exception("connection refused"))
        return real(engine, sql, params)

    monkeypatch.setattr(pgconn, "run", flaky)
    claim = Claiming("tok-eager", "w1", 30.0)
    e = NewEntry(tool_name="t.charge", args=[5], kwargs={}, args_digest=args_digest([5], {}),
                 queue=None, task_id=uid("task"), gated=False, held=True, claim=claim)
    assert sw.machine.add_entries(saga_id, [e]) == [1]
    assert len(calls) > 4, "the database was never away: the test proves nothing"
    assert claim.done, "the claim that committed was not recognised by its token"
    with sw.journal.engine.connect() as conn:
        rows = conn.execute(select(entries.c.seq, entries.c.attempt_token).where(
            entries.c.saga_id == saga_id)).all()
    assert [tuple(r) for r in rows] == [(1, "tok-eager")]
    sw.journal.engine.dispose()


@pytest.mark.parametrize("holder", ["a running forward step", "another undo's live lease"])
def test_the_one_call_undo_claims_nothing_while_something_holds_the_chain(
        proxied: tuple[Sagaworker, Proxy], holder: str) -> None:
    """``sagaworker_undo_next``'s own guards, each alone: the outcome of undo 3 is
    journaled but undo 2 is not claimed while a forward step of the saga runs (its late
    arrival is undone first) or while another undo of the saga holds a live lease (one
    undo at a time); the chain is told to wait. Removing either guard from the function
    fails this test."""
    from sqlalchemy import func as sa_func
    from sqlalchemy import update as sa_update

    from sagaworker._base.types import OutcomeResult
    from sagaworker._machine.machine import UndoClaim

    sw, _ = proxied
    saga_id = _executed_saga(sw, 3)
    m = sw.rt.machine
    c1 = "c1".ljust(32, "x")
    assert m.claim_undo(saga_id, c1).row.seq == 3
    later = sa_func.now() + sa_func.make_interval(0, 0, 0, 0, 0, 0, 60)
    with sw.journal.engine.begin() as conn:
        if holder == "a running forward step":  # a step journaled late, still running
            conn.execute(sa_update(entries).where(entries.c.saga_id == saga_id,
                                                  entries.c.seq == 1)
                         .values(phase="INTENT", lease_until=later, compensation=None))
        else:  # another chain's undo of step 1, alive
            conn.execute(sa_update(entries).where(entries.c.saga_id == saga_id,
                                                  entries.c.seq == 1)
                         .values(comp_lease_until=later, undo_token="other".ljust(32, "x")))
    recorded, st = m.record_and_claim(saga_id, 3, OutcomeResult.COMPENSATED, None, 1, c1,
                                      "c2".ljust(32, "x"))
    assert recorded
    assert st.state in (UndoClaim.WAITING, UndoClaim.BUSY), st.state
    row2 = sw.journal.entry_row(saga_id, 2)
    assert (row2.comp_lease_until, row2.undo_token) == (None, None)
