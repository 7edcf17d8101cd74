"""Poison rows through real workers: rows journaled before poison keys were refused (or
that no key of this journal opens) stop neither the workers' sweeper nor the listings.

The rows are written with SQL straight into the journal, as they got there before the
producer refused them. Each test gets a journal database of its own: before the fix such a
row stopped the sweeper of every worker on the journal, which must not reach other tests.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest
from cryptography.fernet import Fernet
from sqlalchemy import text

from sagaworker import Phase
from tests.apps.cluster import forget
from tests.conftest import (
    BROKERS,
    Cluster,
    _broker,
    _pg,
    db_name,
    need,
    new_settings,
    uid,
    wait_for,
)

pytestmark = pytest.mark.services
RESERVED = "$sagaworker_enc"


@pytest.fixture(params=sorted(BROKERS))
def own_journal(request: pytest.FixtureRequest,
                tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    """A cluster on a journal database of its own (relay after 2 s, a sweep a second), no
    worker yet."""
    import psycopg

    from sagaworker._journal.migrate import upgrade

    need("PostgreSQL", _pg)
    broker = BROKERS[request.param]
    need(request.param, _broker(broker))
    name = db_name("sw_poison")
    with psycopg.connect("host=127.0.0.1 user=root dbname=postgres", autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    url = f"postgresql+psycopg://root@127.0.0.1:5432/{name}"
    upgrade(url)
    tmp = tmp_path_factory.mktemp(f"poison-{request.param}")
    c = Cluster(new_settings(url, broker, tmp, relay_after=2, sweep_interval=1), tmp,
                request.param)
    try:
        yield c
    finally:
        c.close()
        c.sw.dispose_engine()
        forget(url)
        with psycopg.connect("host=127.0.0.1 user=root dbname=postgres",
                             autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def _sql(c: Cluster, statement: str, **params: Any) -> None:
    with c.sw.journal.engine.begin() as conn:
        conn.execute(text(statement), params)


def _foreign_token() -> str:
    """A real Fernet token, sealed with a key this journal never had."""
    return Fernet(Fernet.generate_key()).encrypt(b'{"card": "4111"}').decode()


def test_poison_rows_stop_neither_the_relay_nor_the_listing(
        own_journal: Cluster, monkeypatch: pytest.MonkeyPatch) -> None:
    """With a flow past its deadline and a lost step that no key opens, and a saga whose
    metadata holds the reserved key, in the journal, the worker's sweeper still relays
    another saga's lost step (it runs once), skips (and logs) the step it cannot read,
    fails the overdue flow (no move opens what it does not use) and sw.sagas() lists
    every saga it can read."""
    c = own_journal
    c.start_worker()  # on a clean journal (its start checks the keys of what it holds)
    flow_id, lost_id, garbage_id, victim = (uid("p-flow"), uid("p-lost"), uid("p-garbage"),
                                            uid("victim"))
    step = c.tool("step")
    # a flow past its deadline whose keyword arguments no key opens (advanced already:
    # only the deadline stage reads it)
    _sql(c, "INSERT INTO sagaworker_sagas (saga_id, status, metadata, created_at, updated_at,"
            " last_seq, exec_counter, comp_counter, resends, deadline_at, flow, flow_args,"
            " flow_kwargs, advanced_seen) VALUES (:id, 'RUNNING', '{}', now(), now(), 0, 0, 0,"
            " 0, now() - interval '1 minute', 'tests.apps.cluster.three_steps', '[]',"
            " CAST(:k AS jsonb), 0)",
         id=flow_id, k=json.dumps({RESERVED: _foreign_token()}))
    monkeypatch.setattr(c.sw.producer, "publish", lambda *a, **k: False)  # publishes lost
    # a lost step whose kwargs no key opens
    c.sw.begin(lost_id).enqueue(step, lost_id, "never")
    _sql(c, "UPDATE sagaworker_entries SET kwargs = CAST(:k AS jsonb) WHERE saga_id = :id",
         id=lost_id, k=json.dumps({RESERVED: _foreign_token()}))
    # the issue's own poison: the reserved key holding no token (reads as it is now)
    c.sw.begin(garbage_id)
    _sql(c, "UPDATE sagaworker_sagas SET metadata = CAST(:m AS jsonb) WHERE saga_id = :id",
         id=garbage_id, m=json.dumps({RESERVED: "x"}))
    # the victim: a lost step of a healthy saga, which only the relay can send
    c.sw.begin(victim).enqueue(step, victim, "relayed")
    monkeypatch.undo()

    wait_for(lambda: c.sw.inspect(victim).entries[0].phase is Phase.EXECUTED, timeout=60,
             what="the sweeper to relay the healthy saga's lost step")
    assert [r.kind for r in c.ledger(victim)] == ["effect"]
    listed = {r.saga_id: r for r in c.sw.sagas()}
    assert {garbage_id, victim} <= listed.keys()
    assert not {flow_id, lost_id} & listed.keys()  # skipped: no key opens them
    assert listed[garbage_id].metadata == {RESERVED: "x"}
    wait_for(lambda: lost_id in {
        e.get("saga_id") for e in c.events() if e.get("event") == "sweep_row_unreadable"},
        timeout=30, what="the workers to log the step they could not send")
    # the overdue flow is failed all the same: its moves never open its arguments
    wait_for(lambda: _status(c, flow_id) == "COMPENSATED", timeout=30,
             what="the overdue flow no key opens to be failed and compensated")


def _status(c: Cluster, saga_id: str) -> str | None:
    with c.sw.journal.engine.connect() as conn:
        return conn.execute(text("SELECT status FROM sagaworker_sagas WHERE saga_id = :id"),
                            {"id": saga_id}).scalar()
