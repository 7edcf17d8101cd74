"""Encryption at rest (SAGAWORKER_ENCRYPTION_KEYS): the journal's arguments, results and
metadata are stored encrypted, read back in clear, rotated to a new key; a missing or a
wrong key is an error naming the setting. On SQLite, and on PostgreSQL (a fresh database
per test: rotation rewrites every row of the journal)."""

from __future__ import annotations

import asyncio
import json
import os
import re
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from celery import Celery
from cryptography.fernet import Fernet
from sqlalchemy import create_engine, text

from sagaworker import ConfigurationError, FlowContext, SagaStatus, Sagaworker, Settings
from sagaworker._base import digests
from sagaworker._base.canonical import args_digest
from sagaworker._base.crypto import SealedElsewhere
from sagaworker._base.types import OutcomeResult
from tests.conftest import ROOT, UNIT_SECRET, _pg, db_name, need
from tests.statemachine.model import RecordingBus

KEY_A = Fernet.generate_key().decode()
KEY_B = Fernet.generate_key().decode()
#: every argument, result and metadata value is distinctive, so the raw rows can be
#: searched for it
CARD = "card-4242-4242-4242-4242"
AMOUNT = 987654
NOTE = "note-gift-wrap-for-alice"
RECEIPT = "receipt-ch-secret-991"
SSN = "ssn-123-45-6789"
SKU = "sku-secret-sku-77"
RESERVATION = "reservation-r-secret-55"
SECRETS = (CARD, str(AMOUNT), NOTE, RECEIPT, SSN, SKU, RESERVATION)
CHARGE = f"{__name__}.charge"
RESERVE = f"{__name__}.reserve"
#: the seven columns that are encrypted (the rest stays in clear; docs/encryption.md)
SEALED = {"sagaworker_sagas": ("metadata", "flow_args", "flow_kwargs", "result"),
          "sagaworker_entries": ("args", "kwargs", "result")}
MAKE_KEY = "Fernet.generate_key().decode()"


def charge(card: str, amount: int) -> str:
    return RECEIPT


def reserve(sku: str, *, quantity: int) -> str:
    return RESERVATION


def checkout(s: FlowContext, card: str, amount: int, *, note: str) -> dict[str, Any]:
    return {"receipt": s.call(CHARGE, card, amount), "note": note}


# -- a journal on either database --------------------------------------------------------

@pytest.fixture(params=["sqlite", pytest.param("postgresql", marks=pytest.mark.services)])
def db_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'j.db'}"
        return
    need("PostgreSQL", _pg)
    import psycopg

    from sagaworker._journal.migrate import upgrade

    name = db_name("sw_crypto")
    with psycopg.connect("host=127.0.0.1 user=root dbname=postgres", autocommit=True) as c:
        c.execute(f'CREATE DATABASE "{name}"')
    url = f"postgresql+psycopg://root@127.0.0.1:5432/{name}"
    upgrade(url)  # the migrations, not create_all: the columns are what Alembic made
    yield url
    with psycopg.connect("host=127.0.0.1 user=root dbname=postgres", autocommit=True) as c:
        c.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@pytest.fixture
def make_sw(db_url: str) -> Iterator[Any]:
    """Sagaworkers on the test's journal, each with the keys it is given (a process each,
    as it were: a producer, a worker, an operator's CLI)."""
    made: list[Sagaworker] = []

    def make(keys: str | None, url: str = db_url) -> Sagaworker:
        sw = Sagaworker(Celery(f"enc-{len(made)}", broker="memory://"), settings=Settings(
            database_url=url, broker_url="memory://", approval_secret=UNIT_SECRET,
            encryption_keys=keys, relay_after=300))
        sw.tool()(charge)
        sw.tool()(reserve)
        sw.flow()(checkout)
        sw.rt.bus = RecordingBus([])
        made.append(sw)
        return sw

    yield make
    for sw in made:
        sw.rt.reset_engine()  # its connections closed before the database is dropped


def run_step(sw: Sagaworker, saga_id: str, seq: int, tool: str, result: Any) -> None:
    """What a worker does with a step: claim it, journal its result."""
    token = f"t-{uuid.uuid4().hex[:8]}"
    sw.machine.claim_start(saga_id, seq, tool, token=token, worker="w", idempotent=False,
                           task_id=None)
    assert sw.machine.executed(saga_id, seq, token, result, 1.0).applied


def run_sagas(sw: Sagaworker, suffix: str = "") -> tuple[str, str]:
    """A flow that completes (flow arguments, a step, the flow's result) and an asynchronous
    saga with a keyword argument: every encrypted column gets a value."""
    flow_id, saga_id = f"flow{suffix}", f"saga{suffix}"
    sw.start(flow_id, checkout, CARD, AMOUNT, note=NOTE, metadata={"customer": SSN})
    sw.flows.advance(flow_id)  # journals the charge
    run_step(sw, flow_id, 1, CHARGE, RECEIPT)
    sw.flows.advance(flow_id)  # the flow returns: COMPLETED with its value
    saga = sw.begin(saga_id, metadata={"customer": SSN})
    saga.enqueue(sw.registry.tool(RESERVE).task, SKU, quantity=3)
    run_step(sw, saga_id, 1, RESERVE, RESERVATION)
    return flow_id, saga_id


def raw_rows(url: str) -> dict[str, list[dict[str, Any]]]:
    """Both tables as plain SQL reads them (no sagaworker type in between)."""
    engine = create_engine(url)
    try:
        with engine.connect() as conn:
            out = {}
            for table in SEALED:
                rows = conn.execute(text(f"SELECT * FROM {table}")).mappings().all()
                out[table] = [{k: _json(v) for k, v in r.items()} for r in rows]
            return out
    finally:
        engine.dispose()


def _json(v: Any) -> Any:
    if isinstance(v, str) and v[:1] in "[{\"n":
        try:
            return json.loads(v)  # SQLite hands JSON columns back as text
        except ValueError:
            return v
    return v


def clear_secrets(url: str) -> set[str]:
    """The secrets found anywhere in the raw journal (every column of every row)."""
    dump = json.dumps(raw_rows(url), default=str)
    return {s for s in SECRETS if s in dump}


def assert_sealed(url: str) -> None:
    for table, rows in raw_rows(url).items():
        assert rows
        for row in rows:
            for col in SEALED[table]:
                v = row[col]
                assert v is None or (isinstance(v, dict) and list(v) == ["$sagaworker_enc"]), (
                    table, col, v)


def assert_reads_clear(sw: Sagaworker, flow_id: str, saga_id: str) -> None:
    flow = sw.inspect(flow_id)
    assert flow.status is SagaStatus.COMPLETED
    assert flow.metadata == {"customer": SSN}
    assert (flow.flow_args, flow.flow_kwargs) == ([CARD, AMOUNT], {"note": NOTE})
    assert [(e.args, e.kwargs, e.result) for e in flow.entries] == [
        ([CARD, AMOUNT], {}, RECEIPT)]
    assert sw.journal.saga_row(flow_id).result == {"receipt": RECEIPT, "note": NOTE}
    saga = sw.inspect(saga_id)
    assert saga.metadata == {"customer": SSN}
    assert [(e.args, e.kwargs, e.result) for e in saga.entries] == [
        ([SKU], {"quantity": 3}, RESERVATION)]
    assert {r.saga_id for r in sw.sagas()} >= {flow_id, saga_id}


# -- the tests ------------------------------------------------------------------------------

def test_stored_encrypted_read_in_clear(make_sw: Any, db_url: str) -> None:
    """With keys set, no argument, result or metadata value is in the raw rows (the seven
    columns hold the encrypted wrapper, or NULL); sw.inspect and the state machine see the
    clear values; the args digest is the clear arguments' own, keyed (an HMAC under a key
    derived from the encryption key: not a SHA-256 anyone can compute from a guess)."""
    sw = make_sw(KEY_A)
    flow_id, saga_id = run_sagas(sw)
    assert clear_secrets(db_url) == set()
    assert_sealed(db_url)
    assert_reads_clear(sw, flow_id, saga_id)
    # a producer and a worker are separate processes: another Sagaworker with the same keys
    assert_reads_clear(make_sw(KEY_A), flow_id, saga_id)
    entries = raw_rows(db_url)["sagaworker_entries"]
    found = {e["args_digest"] for e in entries}
    assert found == {digests.digest(sw.rt.cipher, [CARD, AMOUNT], {}),
                     digests.digest(sw.rt.cipher, [SKU], {"quantity": 3})}
    assert not found & {args_digest([CARD, AMOUNT], {}), args_digest([SKU], {"quantity": 3})}
    # what stays in clear: ids, tool names, phases (the sweeper and queries need them)
    assert {(e["saga_id"], e["tool_name"], e["phase"]) for e in entries} == {
        (flow_id, CHARGE, "EXECUTED"), (saga_id, RESERVE, "EXECUTED")}


def test_a_clear_journal_reads_after_keys_are_set(make_sw: Any, db_url: str) -> None:
    """A journal written before encryption was turned on still reads, new writes are
    encrypted, and rotate-key encrypts the old clear values (a second run rewrites none)."""
    flow_id, saga_id = run_sagas(make_sw(None), "-old")
    assert clear_secrets(db_url) == set(SECRETS)  # clear, as before this setting existed
    sw = make_sw(KEY_A)
    assert_reads_clear(sw, flow_id, saga_id)
    new_flow, new_saga = run_sagas(sw, "-new")
    assert_reads_clear(sw, new_flow, new_saga)
    assert sw.rotate_key() == 4  # the old rows (2 sagas, 2 entries); the new are sealed
    assert clear_secrets(db_url) == set()
    assert_sealed(db_url)
    assert sw.rotate_key() == 0
    for fid, sid in ((flow_id, saga_id), (new_flow, new_saga)):
        assert_reads_clear(make_sw(KEY_A), fid, sid)


def test_rotate_key_then_the_old_key_is_dropped(make_sw: Any, db_url: str) -> None:
    """A new key first, the old one after it: both read; rotate-key re-encrypts everything
    with the new key, after which the old key can be dropped (and alone it reads nothing)."""
    flow_id, saga_id = run_sagas(make_sw(KEY_A))
    before = raw_rows(db_url)
    both = make_sw(f"{KEY_B}, {KEY_A}")
    assert_reads_clear(both, flow_id, saga_id)
    assert both.rotate_key(batch=1) == 4  # two sagas, two entries; one saga a transaction
    after = raw_rows(db_url)
    assert after != before and clear_secrets(db_url) == set()
    assert_sealed(db_url)
    assert both.rotate_key() == 0
    assert_reads_clear(make_sw(KEY_B), flow_id, saga_id)
    with pytest.raises(ConfigurationError, match="SAGAWORKER_ENCRYPTION_KEYS holds no key "
                       "the journal's values are sealed with"):
        make_sw(KEY_A).inspect(saga_id)


def test_a_missing_or_wrong_key_is_a_clear_error(make_sw: Any, db_url: str) -> None:
    """Reading an encrypted journal without keys, or with keys that do not decrypt it, is a
    ConfigurationError naming the setting, for a reader and for a worker's move alike; never
    a garbage value. rotate-key without keys says what to set."""
    flow_id, saga_id = run_sagas(make_sw(KEY_A))
    none, wrong = make_sw(None), make_sw(KEY_B)
    for sw, msg in ((none, r"holds no key: set SAGAWORKER_ENCRYPTION_KEYS"),
                    (wrong, r"SAGAWORKER_ENCRYPTION_KEYS holds no key the journal's")):
        with pytest.raises(ConfigurationError, match=msg):
            sw.inspect(flow_id)
        with pytest.raises(ConfigurationError, match=msg):
            sw.sagas()
        with pytest.raises(ConfigurationError, match=msg):
            sw.flows.advance(flow_id)
        with pytest.raises(ConfigurationError, match=msg):  # a worker picking up a step
            sw.machine.claim_start(saga_id, 1, RESERVE, token="tx", worker="w",
                                   idempotent=False, task_id=None)
    with pytest.raises(ConfigurationError, match="holds no key: set SAGAWORKER_ENCRYPTION_KEYS"):
        none.rotate_key()
    assert_reads_clear(make_sw(KEY_A), flow_id, saga_id)  # nothing was changed meanwhile


def test_a_malformed_key_is_refused_at_startup(monkeypatch: pytest.MonkeyPatch) -> None:
    """A key that is not a Fernet key: ConfigurationError saying how to make one, from the
    environment as from code; the message never echoes the key. Unset or empty: clear."""
    bad = "not-a-fernet-key-but-a-secret-all-the-same"
    for value in (bad, f"{KEY_A},{bad}"):
        with pytest.raises(ConfigurationError) as exc:
            Settings(encryption_keys=value)
        assert "SAGAWORKER_ENCRYPTION_KEYS" in str(exc.value) and MAKE_KEY in str(exc.value)
        assert bad not in str(exc.value) and KEY_A not in str(exc.value)
    monkeypatch.setenv("SAGAWORKER_ENCRYPTION_KEYS", bad)
    with pytest.raises(ConfigurationError, match="not a Fernet key"):
        Sagaworker(Celery("bad", broker="memory://"))
    monkeypatch.setenv("SAGAWORKER_ENCRYPTION_KEYS", "")
    assert Settings().encryption_keys is None
    monkeypatch.setenv("SAGAWORKER_ENCRYPTION_KEYS", f"{KEY_A}, {KEY_B}")
    s = Settings()
    assert s.encryption_keys is not None and KEY_A not in repr(s)


def test_each_sagaworker_keeps_its_own_keys(make_sw: Any, tmp_path: Path) -> None:
    """Two Sagaworkers in one process on two journals: one encrypts, the other, without
    keys, writes and reads its own journal in clear."""
    other = f"sqlite:///{tmp_path / 'other.db'}"
    sealed, clear = make_sw(KEY_A), make_sw(None, other)
    run_sagas(sealed)
    flow_id, saga_id = run_sagas(clear)
    assert clear_secrets(other) == set(SECRETS)
    assert_reads_clear(clear, flow_id, saga_id)
    assert_reads_clear(sealed, flow_id, saga_id)  # its own journal, same ids


def test_cli_rotate_key(tmp_path: Path) -> None:
    """`sagaworker db rotate-key` on the app's journal prints how many rows it re-encrypted;
    without keys it refuses (exit 1) naming the setting."""
    db = tmp_path / "app.db"
    (tmp_path / "encapp.py").write_text(
        "from celery import Celery\n"
        "from sagaworker import Sagaworker\n"
        "app = Celery('encapp', broker='memory://')\n"
        f"sw = Sagaworker(app, database_url={f'sqlite:///{db}'!r})\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("SAGAWORKER_")}
    env.update(PYTHONPATH=f"{tmp_path}{os.pathsep}{ROOT}",
               SAGAWORKER_BROKER_FOLDER=str(tmp_path / "broker"))
    meta = {"customer": SSN}
    code = f"import encapp; s = encapp.sw.begin('s-1', metadata={meta!r}); s.complete()"
    subprocess.run([sys.executable, "-c", code], env=env, cwd=tmp_path, check=True)

    def cli(*args: str, keys: str | None) -> subprocess.CompletedProcess[str]:
        e = dict(env) if keys is None else {**env, "SAGAWORKER_ENCRYPTION_KEYS": keys}
        return subprocess.run([sys.executable, "-m", "sagaworker.cli", "-A", "encapp", *args],
                              cwd=tmp_path, env=e, capture_output=True, text=True,
                              timeout=120)

    r = cli("db", "rotate-key", keys=None)
    assert r.returncode == 1 and "SAGAWORKER_ENCRYPTION_KEYS" in r.stderr, r.stderr
    r = cli("db", "rotate-key", keys=KEY_A)
    assert r.returncode == 0 and "re-encrypted 1 rows" in r.stdout, r.stderr
    assert SSN not in json.dumps(raw_rows(f"sqlite:///{db}"), default=str)
    r = cli("show", "s-1", "--json", keys=KEY_A)
    assert r.returncode == 0 and json.loads(r.stdout)["metadata"] == {"customer": SSN}
    r = cli("show", "s-1", "--json", keys=None)
    assert r.returncode != 0 and "SAGAWORKER_ENCRYPTION_KEYS" in r.stderr


def test_a_journal_sealed_before_keys_were_named_refuses_the_wrong_processes(
        make_sw: Any, db_url: str) -> None:
    """A journal encrypted by a release that named no key (its facts empty, as an upgrade
    leaves them): a process with no key, or with another key, is refused at start (and
    names nothing, so it locks nobody out); the right key starts and is named."""
    from sqlalchemy import create_engine, delete, select

    from sagaworker._journal.schema import facts

    run_sagas(make_sw(KEY_A))
    engine = create_engine(db_url)
    with engine.begin() as conn:
        conn.execute(delete(facts))
    with pytest.raises(ConfigurationError, match="holds no key: set SAGAWORKER_ENCRYPTION"):
        make_sw(None).check_ready()
    with pytest.raises(ConfigurationError, match="none of the keys in SAGAWORKER_ENCRYPTION"):
        make_sw(KEY_B).check_ready()
    with engine.connect() as conn:
        assert conn.execute(select(facts.c.name)).all() == []
    make_sw(KEY_A).check_ready()
    with engine.connect() as conn:
        assert len(conn.execute(select(facts.c.name)).all()) == 1
    engine.dispose()


@pytest.mark.services
@pytest.mark.parametrize("sweep_interval", [1, 0])
def test_a_keyless_worker_stops_when_encryption_is_turned_on(
        fresh_pg_url: str, tmp_path_factory: pytest.TempPathFactory,
        sweep_interval: float) -> None:
    """A worker started on a clear journal, without keys, is running when a process with
    SAGAWORKER_ENCRYPTION_KEYS names its key in the journal: the worker logs
    ``journal_keys_changed`` (critical) and shuts down rather than journal results in
    clear next to sealed ones. A worker that sweeps nothing (SAGAWORKER_SWEEP_INTERVAL=0,
    as docs/scaling.md has tool-only workers) too: the key fact has a timer of its own
    (``KEYS_EVERY``, 2 s here)."""
    from sagaworker._journal.migrate import upgrade
    from tests.conftest import BROKERS, Cluster, _broker, new_settings, wait_for

    need("rabbitmq", _broker(BROKERS["rabbitmq"]))
    upgrade(fresh_pg_url)
    tmp = tmp_path_factory.mktemp("keys")
    c = Cluster(new_settings(fresh_pg_url, BROKERS["rabbitmq"], tmp,
                             sweep_interval=sweep_interval), tmp, "rabbitmq")
    try:
        worker = c.start_worker(TESTS_KEYS_EVERY="2")
        keyed = Sagaworker(Celery("keyed", broker="memory://"), settings=Settings(
            database_url=fresh_pg_url, broker_url="memory://", encryption_keys=KEY_A))
        keyed.begin("sealed-1", metadata={"card": "4111111111111111"})  # names its key
        keyed.rt.reset_engine()
        wait_for(lambda: worker.poll() is not None, 60, "the keyless worker to stop")
        events = [e for e in c.events() if e.get("event") == "journal_keys_changed"]
        assert len(events) == 1 and events[0]["level"] == "critical"
        assert "SAGAWORKER_ENCRYPTION_KEYS" in events[0]["error"]
    finally:
        c.close()
        c.sw.rt.reset_engine()


# -- each value sealed for its place --------------------------------------------------------
# (its column, its saga, and an entry's task id or seq): a ciphertext copied with SQL into
# another row or column is refused by every read (a saga read, a listing, the sweeper's
# relay, the undo chain's claim, rotate-key), never read as that row's value; a token
# sealed before places were still reads, and rotate-key seals it for its place

ENTRY, SAGA = "sagaworker_entries", "sagaworker_sagas"


def copy(url: str, table: str, column: str, src: dict[str, Any], dst: dict[str, Any],
         into: str | None = None) -> None:
    """What someone with SQL and no key can do: a stored value copied to another row (or
    another column: ``into``), byte for byte."""
    def where(row: dict[str, Any], p: str) -> str:
        return " AND ".join(f"{k} = :{p}{k}" for k in row)

    engine = create_engine(url)
    try:
        with engine.begin() as conn:
            n = conn.execute(text(
                f"UPDATE {table} SET {into or column} = (SELECT {column} FROM {table} "
                f"WHERE {where(src, 's')}) WHERE {where(dst, 'd')}"),
                {**{f"s{k}": v for k, v in src.items()},
                 **{f"d{k}": v for k, v in dst.items()}}).rowcount
        assert n == 1
    finally:
        engine.dispose()


def stored(url: str, table: str, column: str, **row: Any) -> Any:
    engine = create_engine(url)
    try:
        with engine.connect() as conn:
            v = conn.execute(text(f"SELECT {column} FROM {table} WHERE "
                                  + " AND ".join(f"{k} = :{k}" for k in row)), row).scalar()
        return _json(v)
    finally:
        engine.dispose()


def test_a_value_copied_into_another_saga_is_refused_by_every_read(
        make_sw: Any, db_url: str) -> None:
    sw: Sagaworker = make_sw(KEY_A)
    _, mine = run_sagas(sw, "-a")
    flow, theirs = run_sagas(sw, "-b")
    copy(db_url, ENTRY, "args", {"saga_id": mine, "seq": 1}, {"saga_id": theirs, "seq": 1})
    copy(db_url, SAGA, "metadata", {"saga_id": mine}, {"saga_id": flow})
    for saga_id, what in ((theirs, "sagaworker_entries.args"),
                          (flow, "sagaworker_sagas.metadata")):
        with pytest.raises(SealedElsewhere, match=rf"the value in {what} \(saga '{saga_id}'"
                           rf"[^)]*\) was sealed for {what} \(saga '{mine}'"):
            sw.inspect(saga_id)
    # a listing skips (and names) the sagas it cannot read, and lists the others
    records, unreadable = sw.journal.scan_sagas(None, 10)
    assert sorted(r.saga_id for r in records) == sorted(["flow-a", mine])
    assert sorted(u.saga_id for u in unreadable) == sorted([flow, theirs])
    assert all("copied there with SQL" in u.error for u in unreadable)
    # the one that was copied from still reads as it was written
    assert [e.args for e in sw.inspect(mine).entries] == [[SKU]]
    assert sw.inspect(mine).metadata == {"customer": SSN}


def test_a_result_copied_to_another_step_is_not_undone_and_pages(
        make_sw: Any, db_url: str) -> None:
    """The undo chain claims each undo with the step's values (on PostgreSQL the next one in
    the statement that records an outcome): a step whose result was copied from another
    saga is not undone with it; it is journaled COMPENSATION_FAILED saying so (the page),
    and the chain goes on and finishes. Its claim, replayed after a lost COMMIT, says the
    same."""
    sw: Sagaworker = make_sw(KEY_A)
    _, mine = run_sagas(sw, "-a")
    _, theirs = run_sagas(sw, "-b")
    spec = sw.registry.tool(RESERVE)
    assert spec is not None
    sw.get(theirs).enqueue(spec.task, SKU, quantity=1)
    run_step(sw, theirs, 2, RESERVE, RESERVATION)
    copy(db_url, ENTRY, "result", {"saga_id": mine, "seq": 1}, {"saga_id": theirs, "seq": 1})
    sw.machine.request_failure(theirs, "test")
    assert sw.machine.begin_compensation(theirs, "test", "chain")[0]
    first = sw.machine.claim_undo(theirs, "u1")
    assert (first.row.seq, first.row.result, first.row.unreadable) == (2, RESERVATION, None)
    _, second = sw.machine.record_and_claim(theirs, 2, OutcomeResult.SKIPPED, "no undo", 0,
                                            "u1", "u2")
    where = (rf"sagaworker_entries\.result \(saga '{theirs}', step 1\) was sealed for "
             rf"sagaworker_entries\.result \(saga '{mine}', step 1\)")
    assert (second.row.seq, second.row.result) == (1, None)
    assert re.search(where, second.row.unreadable)
    replayed = sw.machine.claim_undo(theirs, "u2")  # its COMMIT reply lost: the same row
    assert (replayed.row.seq, replayed.row.result) == (1, None)
    assert re.search(where, replayed.row.unreadable)
    sw.machine.release_undo(theirs, 1, "u2", "test: the chain below claims it again")
    sw.compensator.run_chain(theirs)
    # (the saga's reads refuse its copied value: read in plain SQL)
    assert stored(db_url, SAGA, "status", saga_id=theirs) == "COMPENSATION_FAILED"
    assert [stored(db_url, ENTRY, "compensation", saga_id=theirs, seq=n) for n in (1, 2)] == [
        "COMPENSATION_FAILED", "SKIPPED"]
    assert re.search("its undo was not run: the value in " + where, stored(
        db_url, ENTRY, "compensation_detail", saga_id=theirs, seq=1))
    assert sw.inspect(mine).entries[0].result == RESERVATION  # the copied-from one reads


def test_a_value_moved_to_another_column_or_step_is_refused(make_sw: Any,
                                                             db_url: str) -> None:
    """Arguments copied into another step of the same saga (another task id), or into the
    keyword column of their own row: refused; the relay's read skips (and logs) that step
    and sends the others."""
    sw: Sagaworker = make_sw(KEY_A)
    _, done = run_sagas(sw)
    copy(db_url, ENTRY, "args", {"saga_id": done, "seq": 1},
         {"saga_id": done, "seq": 1}, into="kwargs")
    with pytest.raises(SealedElsewhere, match=r"sagaworker_entries\.kwargs \(saga 'saga', "
                       r"task '[^']+'\) was sealed for sagaworker_entries\.args \(saga"):
        sw.inspect(done)
    spec = sw.registry.tool(RESERVE)
    assert spec is not None
    saga = sw.begin("waiting")
    saga.enqueue(spec.task, "sku-1", quantity=1)
    saga.enqueue(spec.task, "sku-2", quantity=2)
    copy(db_url, ENTRY, "args", {"saga_id": "waiting", "seq": 1},
         {"saga_id": "waiting", "seq": 2})
    assert [(o.seq, o.args) for o in sw.sweeper.orphans(0)
            if o.saga_id == "waiting"] == [(1, ["sku-1"])]
    with pytest.raises(SealedElsewhere, match=r"sagaworker_entries\.args \(saga 'waiting'"):
        sw.inspect("waiting")


def sql(url: str, statement: str, **params: Any) -> None:
    engine = create_engine(url)
    try:
        with engine.begin() as conn:
            conn.execute(text(statement), params)
    finally:
        engine.dispose()


def test_a_value_sealed_before_places_still_reads_and_rotate_key_places_it(
        make_sw: Any, db_url: str) -> None:
    """A journal from before places (its tokens' plaintext is the bare JSON): they read;
    rotate-key seals each for its place (with the same first key: nothing else to
    rewrite), after which a token sealed before places can only have been copied in, and
    is refused; and rotate-key refuses a value copied from elsewhere, naming the row,
    rewriting nothing."""
    sw: Sagaworker = make_sw(KEY_A)
    _, saga_id = run_sagas(sw)
    _, other = run_sagas(sw, "-x")

    def old(value: Any) -> str:  # a token as a release before places sealed it
        return json.dumps({"$sagaworker_enc": Fernet(KEY_A.encode()).encrypt(
            json.dumps(value).encode()).decode()})

    legacy = json.loads(old(["legacy-sku"]))
    # a saga journaled by that release: no nonce, each of its values such a token
    sql(db_url, f"UPDATE {SAGA} SET place_nonce = NULL, metadata = :m WHERE saga_id = :s",
        m=old({"customer": SSN}), s=saga_id)
    sql(db_url, f"UPDATE {ENTRY} SET args = :v, kwargs = :k, result = :r WHERE saga_id = :s",
        v=json.dumps(legacy), k=old({"quantity": 3}), r=old(RESERVATION), s=saga_id)
    # (nothing says so before a rotate-key: even a new journal may be written by a
    # process of an earlier release, still running beside this one)
    assert stored(db_url, "sagaworker_facts", "value", name="values placed") is None
    assert [e.args for e in sw.inspect(saga_id).entries] == [["legacy-sku"]]
    assert sw.rotate_key() == 2  # that saga, its entry; the rest is sealed for its place
    placed = stored(db_url, ENTRY, "args", saga_id=saga_id, seq=1)
    assert placed != legacy and sw.rt.cipher is not None and sw.rt.cipher.is_placed(placed)
    assert [e.args for e in sw.inspect(saga_id).entries] == [["legacy-sku"]]
    assert sw.rotate_key() == 0
    sql(db_url, f"UPDATE {ENTRY} SET args = :v WHERE saga_id = :s", v=json.dumps(legacy),
        s=other)  # an old token (from a backup, say) put back with SQL
    for reader in (sw, make_sw(KEY_A)):  # the rotating process, and one started after it
        with pytest.raises(SealedElsewhere, match=rf"sagaworker_entries\.args \(saga "
                           rf"'{other}'.* was sealed before values had places"):
            reader.inspect(other)
    sql(db_url, f"UPDATE {ENTRY} SET args = :v WHERE saga_id = :s", v=json.dumps(placed),
        s=other)
    copy(db_url, ENTRY, "result", {"saga_id": other, "seq": 1}, {"saga_id": saga_id, "seq": 1})
    rotating = make_sw(f"{KEY_B},{KEY_A}")
    with pytest.raises(SealedElsewhere, match=rf"sagaworker_entries.result \(saga "
                       rf"'{saga_id}', step 1\) was sealed for .*'{other}'"):
        rotating.rotate_key()
    assert stored(db_url, ENTRY, "result", saga_id=saga_id, seq=1) == stored(
        db_url, ENTRY, "result", saga_id=other, seq=1)  # left as found, not re-sealed


def ship(parcel: str) -> str:
    return f"shipped-{parcel}"


def test_a_delivery_under_another_task_id_keeps_the_journaled_one(make_sw: Any,
                                                                  db_url: str) -> None:
    """A step's arguments are sealed for its task id: a claim by a delivery under another
    id (a message published again by hand) leaves the journaled id, so they still read."""
    sw: Sagaworker = make_sw(KEY_A)
    spec = sw.registry.tool(RESERVE)
    assert spec is not None
    saga = sw.begin("redelivered")
    step = saga.enqueue(spec.task, SKU, quantity=2)
    claim = sw.machine.claim_start("redelivered", 1, RESERVE, token="t-other", worker="w",
                                   idempotent=False, task_id="another-celery-id")
    assert claim.start.value == "run"
    [e] = sw.inspect("redelivered").entries
    assert (e.task_id, e.args, e.kwargs) == (step.task_id, [SKU], {"quantity": 2})


def test_a_copied_value_stops_no_move_of_its_saga(make_sw: Any, db_url: str) -> None:
    """The moves decide on the clear columns: a saga whose metadata and a step whose
    arguments were copied from elsewhere are still claimed, journaled, failed and
    compensated (only reading those values is refused)."""
    sw: Sagaworker = make_sw(KEY_A)
    _, mine = run_sagas(sw, "-a")
    spec = sw.registry.tool(RESERVE)
    assert spec is not None
    saga = sw.begin("victim", metadata={"customer": "victim"})
    saga.enqueue(spec.task, "sku-v", quantity=1)
    saga.enqueue(spec.task, "sku-w", quantity=1)
    copy(db_url, SAGA, "metadata", {"saga_id": mine}, {"saga_id": "victim"})
    copy(db_url, ENTRY, "args", {"saga_id": "victim", "seq": 1},
         {"saga_id": "victim", "seq": 2})
    run_step(sw, "victim", 1, RESERVE, RESERVATION)  # claim and EXECUTED
    run_step(sw, "victim", 2, RESERVE, RESERVATION)
    sw.machine.request_failure("victim", "test")
    sw.machine.begin_compensation("victim", "test", "chain")  # as the failure handler does
    sw.compensator.run_chain("victim")
    assert stored(db_url, SAGA, "status", saga_id="victim") == "COMPENSATION_FAILED"
    details = [stored(db_url, ENTRY, "compensation_detail", saga_id="victim", seq=n)
               for n in (1, 2)]
    assert details[0] == "no undo declared"
    assert "its undo was not run: the value in sagaworker_entries.args" in details[1]


def test_a_gate_whose_arguments_were_copied_is_not_offered(make_sw: Any,
                                                           db_url: str) -> None:
    """pending_approvals() leaves out (and logs) a gate whose arguments were copied from
    another gate, lists the others; its approval is refused naming the copy."""
    sw: Sagaworker = make_sw(KEY_A)
    sw.tool(reversibility="IRREVERSIBLE")(ship)
    spec = sw.registry.tool(f"{__name__}.ship")
    assert spec is not None
    for key in ("g1", "g2"):
        sw.begin(key).enqueue(spec.task, f"parcel-{key}")
    token = {p.saga_id: p.token for p in sw.pending_approvals()}["g2"]
    copy(db_url, ENTRY, "args", {"saga_id": "g1", "seq": 1}, {"saga_id": "g2", "seq": 1})
    assert [(p.saga_id, p.args) for p in sw.pending_approvals()] == [("g1", ["parcel-g1"])]
    with pytest.raises(SealedElsewhere, match=r"saga 'g2'.*sealed for.*saga 'g1'"):
        sw.approve(token, approver="alice")
    # the API says so (409), by token and by step, rather than a 500
    from sagaworker.web import create_app
    from tests.web.journal import ALICE_TOKEN, operators

    client = create_app(sw, auth=operators()).test_client()
    for body in ({"token": token}, {"saga_id": "g2", "seq": 1}):
        got = client.post("/approvals/approve", json=body,
                          headers={"Authorization": f"Bearer {ALICE_TOKEN}"})
        assert got.status_code == 409 and "copied there with SQL" in got.get_json()["error"]


def test_a_place_key_stored_with_a_copied_token_is_ignored(make_sw: Any,
                                                           db_url: str) -> None:
    """Someone who copies a token and stores the row's own place beside it gains nothing:
    the reads that open stored values (a listing, the relay) drop that key and refuse the
    token, as the others do."""
    sw: Sagaworker = make_sw(KEY_A)
    _, mine = run_sagas(sw, "-a")
    spec = sw.registry.tool(RESERVE)
    assert spec is not None
    step = sw.begin("forged").enqueue(spec.task, "sku-f", quantity=1)
    token = stored(db_url, ENTRY, "args", saga_id=mine, seq=1)
    forged = {**token, "$sagaworker_at": ["forged", step.task_id]}
    engine = create_engine(db_url)
    with engine.begin() as conn:
        conn.execute(text(f"UPDATE {ENTRY} SET args = :v WHERE saga_id = 'forged'"),
                     {"v": json.dumps(forged)})
    engine.dispose()
    records, unreadable = sw.journal.scan_sagas(None, 10)
    assert "forged" not in {r.saga_id for r in records}
    assert [u.saga_id for u in unreadable] == ["forged"]
    assert [o.saga_id for o in sw.sweeper.orphans(0)] == []
    with pytest.raises(SealedElsewhere):
        sw.inspect("forged")


def test_a_result_copied_into_a_waited_step_fails_that_wait_alone(
        make_sw: Any, db_url: str) -> None:
    """Two steps of two sagas awaited on one loop (one read of the hub for both): one's
    result is a copy, made with SQL, of another saga's. Its ``aresult`` raises
    SealedElsewhere; the other's returns its value. (One row no key opens never stalls
    the other waits of the loop.)"""
    sw: Sagaworker = make_sw(KEY_A)
    _, source = run_sagas(sw, "-src")
    spec = sw.registry.tool(RESERVE)
    assert spec is not None
    copied, fine = sw.begin("copied"), sw.begin("fine")
    steps = [s.enqueue(spec.task, SKU, quantity=1) for s in (copied, fine)]

    async def main() -> list[Any]:
        waits = [asyncio.ensure_future(s.aresult(20)) for s in steps]
        await asyncio.sleep(0.3)  # both wait in the hub
        await asyncio.to_thread(run_step, sw, "fine", 1, RESERVE, RESERVATION)
        await asyncio.to_thread(copy, db_url, ENTRY, "result", {"saga_id": source, "seq": 1},
                                {"saga_id": "copied", "seq": 1})
        await asyncio.to_thread(sql, db_url, f"UPDATE {ENTRY} SET phase = 'EXECUTED' "
                                "WHERE saga_id = 'copied' AND seq = 1")
        return list(await asyncio.gather(*waits, return_exceptions=True))

    got, value = asyncio.run(main())
    assert value == RESERVATION
    assert isinstance(got, SealedElsewhere), got
