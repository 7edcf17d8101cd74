"""Someone with SQL write access to the journal and no key (docs/encryption.md): what they
write is refused, never read or run as the journal's. A clear value written over a sealed
one, an unkeyed args digest written to match it, an approval written by hand, a pruned
saga's values put back under its reused id. The rows are written with SQL, as that person
would; where a worker must refuse, real ``celery worker`` processes do."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any

import pytest
from sqlalchemy import text

from sagaworker import Sagaworker
from sagaworker._base.canonical import args_digest
from sagaworker._base.crypto import SealedElsewhere
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
from tests.integration.test_encryption import (  # (fixtures and helpers, no tests)
    CARD,
    CHARGE,
    ENTRY,
    KEY_A,
    RECEIPT,
    RESERVATION,
    RESERVE,
    SAGA,
    SKU,
    SSN,
    checkout,
    db_url,
    make_sw,
    raw_rows,
    run_sagas,
    run_step,
    ship,
    sql,
    stored,
)

__all__ = ["db_url", "make_sw"]  # (fixtures of test_encryption.py, used here)

MALLORY = "card-6666-6666-6666-6666"  # the attacker's own card
FACTS = "sagaworker_facts"
SHIP = "tests.integration.test_encryption.ship"


def _reserve(sw: Sagaworker) -> Any:
    spec = sw.registry.tool(RESERVE)
    assert spec is not None
    return spec.task


# -- 1. a clear value written over a sealed one --------------------------------------------

def test_a_clear_value_written_over_a_sealed_one_is_refused(make_sw: Any,
                                                            db_url: str) -> None:
    """A saga journaled with a key: a clear value written with SQL over one of its sealed
    values (the card of a step that ran, its saga's metadata) is refused by every read
    (SealedElsewhere, naming the row), and the undo chain does not run that step's undo
    with it: COMPENSATION_FAILED, saying why."""
    sw: Sagaworker = make_sw(KEY_A)
    flow_id, saga_id = run_sagas(sw)
    sql(db_url, f"UPDATE {ENTRY} SET args = :v WHERE saga_id = :s AND seq = 1",
        v=json.dumps([MALLORY]), s=saga_id)
    sql(db_url, f"UPDATE {SAGA} SET metadata = :v WHERE saga_id = :s",
        v=json.dumps({"customer": "mallory"}), s=flow_id)
    for sid, what in ((saga_id, r"sagaworker_entries\.args \(saga 'saga', task '[^']+'\)"),
                      (flow_id, r"sagaworker_sagas\.metadata \(saga 'flow'\)")):
        with pytest.raises(SealedElsewhere, match=rf"^the value in {what} is in clear, and "
                           r"every value of this saga is sealed: it was written there with "
                           r"SQL, not journaled, and is not read"):
            sw.inspect(sid)
    records, unreadable = sw.journal.scan_sagas(None, 10)
    assert records == [] and sorted(u.saga_id for u in unreadable) == [flow_id, saga_id]
    sw.machine.request_failure(saga_id, "test")
    assert sw.machine.begin_compensation(saga_id, "test", "chain")[0]
    sw.compensator.run_chain(saga_id)
    assert stored(db_url, SAGA, "status", saga_id=saga_id) == "COMPENSATION_FAILED"
    assert stored(db_url, ENTRY, "compensation", saga_id=saga_id, seq=1) == (
        "COMPENSATION_FAILED")
    assert re.match(r"its undo was not run: the value in sagaworker_entries\.args \(saga "
                    r"'saga', task '[^']+'\) is in clear", stored(
                        db_url, ENTRY, "compensation_detail", saga_id=saga_id, seq=1))


def test_after_rotate_key_no_clear_value_reads(make_sw: Any, db_url: str) -> None:
    """A journal written in clear, then encrypted: its old sagas (journaled before the key)
    read in clear until ``db rotate-key`` has sealed every value; from then on a clear
    value written with SQL into one of them is refused too."""
    flow_id, saga_id = run_sagas(make_sw(None), "-old")
    sw: Sagaworker = make_sw(KEY_A)
    assert [e.args for e in sw.inspect(saga_id).entries] == [[SKU]]  # old clear values read
    assert sw.rotate_key() == 4
    assert stored(db_url, FACTS, "value", name="values placed") == "by rotate-key"
    sql(db_url, f"UPDATE {ENTRY} SET args = :v WHERE saga_id = :s", v=json.dumps([MALLORY]),
        s=saga_id)
    for reader in (sw, make_sw(KEY_A)):  # the rotating process, and one started after it
        with pytest.raises(SealedElsewhere, match=r"^the value in sagaworker_entries\.args "
                           r"\(saga 'saga-old', task '[^']+'\) is in clear, and every value "
                           r"of this journal is sealed \(db rotate-key\)"):
            reader.inspect(saga_id)
    assert sw.inspect(flow_id).entries[0].args == [CARD, 987654]


def test_the_args_digest_is_keyed(make_sw: Any, db_url: str) -> None:
    """With keys, the journaled args digest is an HMAC under a key derived from the
    encryption key, not a SHA-256 of the arguments: it confirms no guess of them; a flow's
    replay computes the same one (the flow completes)."""
    sw: Sagaworker = make_sw(KEY_A)
    flow_id, _ = run_sagas(sw)
    assert sw.inspect(flow_id).status.value == "COMPLETED"
    digests = sorted(e["args_digest"] for e in raw_rows(db_url)[ENTRY])
    unkeyed = {args_digest([CARD, 987654], {}), args_digest([SKU], {"quantity": 3})}
    assert len(digests) == 2 and not unkeyed & set(digests)
    assert all(re.fullmatch(r"h[0-9a-f]{63}", d) for d in digests), digests
    assert sw.rt.cipher is not None
    assert digests[0][1:9] == sw.rt.cipher.fingerprints[0][:8]  # which key: its name


def test_digests_journaled_before_keys_verify_and_rotate_key_keys_them(
        make_sw: Any, db_url: str) -> None:
    """A journal from before keyed digests (a clear one, or one encrypted by an earlier
    release): its unkeyed digests still match their flows' replays, and ``db rotate-key``
    rewrites each as a keyed one (only where it matches its arguments)."""
    clear: Sagaworker = make_sw(None)
    for fid in ("old-1", "old-2"):
        clear.start(fid, checkout, CARD, 1, note="n")
        clear.flows.advance(fid)  # journals the charge, digest unkeyed
    sw: Sagaworker = make_sw(KEY_A)
    run_step(sw, "old-1", 1, CHARGE, RECEIPT)
    sw.flows.advance("old-1")  # the replay matches the unkeyed digest: no divergence
    assert sw.inspect("old-1").status.value == "COMPLETED"
    assert stored(db_url, ENTRY, "args_digest", saga_id="old-2", seq=1) == args_digest(
        [CARD, 1], {})
    sw.rotate_key()
    rekeyed = stored(db_url, ENTRY, "args_digest", saga_id="old-2", seq=1)
    assert re.fullmatch(r"h[0-9a-f]{63}", rekeyed) and rekeyed != args_digest([CARD, 1], {})
    run_step(sw, "old-2", 1, CHARGE, RECEIPT)
    sw.flows.advance("old-2")
    assert sw.inspect("old-2").status.value == "COMPLETED"


def test_an_unkeyed_digest_written_with_sql_aims_no_step(make_sw: Any, db_url: str) -> None:
    """A step's args digest rewritten with SQL as the SHA-256 of other arguments (what the
    unkeyed digest was): the worker's check of a delivered message refuses those arguments
    (and the step's own, which no longer match it) before the tool runs."""
    from sagaworker._worker.verify import verify

    sw: Sagaworker = make_sw(KEY_A)
    sw.begin("aimed").enqueue(_reserve(sw), SKU, quantity=1)
    sql(db_url, f"UPDATE {ENTRY} SET args_digest = :d WHERE saga_id = 'aimed'",
        d=args_digest([MALLORY], {"quantity": 1}))
    claim = sw.machine.claim_start("aimed", 1, RESERVE, token="t-aimed", worker="w",
                                   idempotent=False, task_id=None)
    assert claim.start.value == "run"
    spec = sw.registry.tool(RESERVE)
    assert spec is not None
    refused = "the message's arguments do not match the journal; not run"
    assert verify(sw.rt, spec, claim.row, [MALLORY], {"quantity": 1}) == refused
    assert verify(sw.rt, spec, claim.row, [SKU], {"quantity": 1}) == refused


# -- 3. a saga id used again after a prune -------------------------------------------------

def test_a_reused_saga_id_does_not_read_the_pruned_sagas_values(make_sw: Any,
                                                                 db_url: str) -> None:
    """A saga is pruned and its id used again: the old saga's sealed values (kept by
    someone who read the journal, or a backup) written with SQL into the new saga's rows,
    task id included, are refused: each value is sealed for its saga's own nonce."""
    sw: Sagaworker = make_sw(KEY_A)
    old = sw.begin("order-1", metadata={"customer": SSN})
    old.enqueue(_reserve(sw), SKU, quantity=3)
    run_step(sw, "order-1", 1, RESERVE, RESERVATION)
    old.complete()
    kept = {(t, c): stored(db_url, t, c, saga_id="order-1") for t, c in (
        (SAGA, "metadata"), (ENTRY, "args"), (ENTRY, "kwargs"), (ENTRY, "result"),
        (ENTRY, "task_id"))}
    assert sw.prune(0) == 1
    new = sw.begin("order-1", metadata={"customer": "someone else"})
    new.enqueue(_reserve(sw), "sku-new", quantity=1)
    run_step(sw, "order-1", 1, RESERVE, "reservation-new")
    sql(db_url, f"UPDATE {SAGA} SET metadata = :m WHERE saga_id = 'order-1'",
        m=json.dumps(kept[SAGA, "metadata"]))
    with pytest.raises(SealedElsewhere, match=r"^the value in sagaworker_sagas\.metadata "
                       r"\(saga 'order-1'\) was sealed for an earlier saga with the id "
                       r"'order-1' \(pruned, its id used again\)"):
        sw.inspect("order-1")
    sql(db_url, f"UPDATE {ENTRY} SET args = :a, kwargs = :k, result = :r, task_id = :t "
        "WHERE saga_id = 'order-1' AND seq = 1",
        a=json.dumps(kept[ENTRY, "args"]), k=json.dumps(kept[ENTRY, "kwargs"]),
        r=json.dumps(kept[ENTRY, "result"]), t=kept[ENTRY, "task_id"])
    row = sw.journal.entry_row
    with pytest.raises(SealedElsewhere, match=r"sealed for an earlier saga with the id "
                       r"'order-1'"):
        row("order-1", 1)


# -- 2. an approval written with SQL (the worker's check; real workers below) -------------

@pytest.mark.parametrize("keys", [None, KEY_A], ids=["clear", "keyed"])
def test_an_approval_written_with_sql_is_not_proven(make_sw: Any, db_url: str,
                                                    keys: str | None) -> None:
    """With keys or without: a gate approved with SQL (phase, approver, approved digest
    set as an approval writes them) is claimed, and the worker's check refuses to run it:
    the journal holds no proof made with the approval secret. An approval made with the
    token passes the same check."""
    from sagaworker._worker.verify import verify

    sw: Sagaworker = make_sw(keys)
    sw.tool(reversibility="IRREVERSIBLE")(ship)
    spec = sw.registry.tool(SHIP)
    assert spec is not None
    for key in ("forged", "real"):
        sw.begin(key).enqueue(spec.task, f"parcel-{key}")
    sql(db_url, f"UPDATE {ENTRY} SET phase = 'INTENT', approved_by = 'mallory', "
        "approved_at = created_at, approved_digest = args_digest, approval_nonce = NULL "
        "WHERE saga_id = 'forged'")
    sql(db_url, f"UPDATE {SAGA} SET status = 'RUNNING' WHERE saga_id = 'forged'")
    sw.approve({p.saga_id: p.token for p in sw.pending_approvals()}["real"], approver="alice")
    checked = {}
    for key in ("forged", "real"):
        claim = sw.machine.claim_start(key, 1, SHIP, token=f"t-{key}", worker="w",
                                       idempotent=False, task_id=None)
        assert claim.start.value == "run"
        checked[key] = verify(sw.rt, spec, claim.row, [f"parcel-{key}"], {})
    assert checked == {"forged": "approval verification failed: the journal holds no "
                                 "approval made with SAGAWORKER_APPROVAL_SECRET for this "
                                 "step (written there with SQL?); not run", "real": None}


# -- real workers: the relay, the undo, the gate --------------------------------------------

@pytest.fixture(params=sorted(BROKERS))
def keyed_journal(request: pytest.FixtureRequest,
                  tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    """A cluster on a PostgreSQL journal of its own, encrypted (SAGAWORKER_ENCRYPTION_KEYS
    on the producer and the workers), relay after 2 s, a sweep a second; no worker yet."""
    import psycopg

    from sagaworker._journal.migrate import upgrade

    need("PostgreSQL", _pg)
    broker = BROKERS[request.param]
    need(request.param, _broker(broker))
    name = db_name("sw_sqlwriter")
    with psycopg.connect("host=127.0.0.1 user=root dbname=postgres", autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    url = f"postgresql+psycopg://root@127.0.0.1:5432/{name}"
    upgrade(url)
    tmp = tmp_path_factory.mktemp(f"sqlwriter-{request.param}")
    c = Cluster(new_settings(url, broker, tmp, relay_after=2, sweep_interval=1,
                             encryption_keys=KEY_A), tmp, request.param)
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


def _one(c: Cluster, statement: str, **params: Any) -> Any:
    with c.sw.journal.engine.connect() as conn:
        return conn.execute(text(statement), params).one()


def _unpublished(c: Cluster, saga_id: str, *calls: tuple[str, tuple[Any, ...]]) -> None:
    """A saga whose steps are journaled and never published (its producer died)."""
    bus = c.sw.rt.bus
    c.sw.rt.bus = type("Lost", (), {"publish_step": lambda *a, **k: True,
                                    "queue_of": bus.queue_of})()
    try:
        saga = c.sw.begin(saga_id)
        for tool, args in calls:
            saga.enqueue(c.tool(tool), *args)
    finally:
        c.sw.rt.bus = bus


@pytest.mark.services
@pytest.mark.one_broker
def test_a_worker_runs_nothing_with_values_written_in_clear(keyed_journal: Cluster) -> None:
    """Encrypted journal, real workers. A step never published, its arguments rewritten
    in clear with an unkeyed digest to match: the relay does not send it (the row is
    logged unreadable), so the tool never runs with them. A step that ran, its arguments
    rewritten in clear, its saga then failed: its undo is not run with them
    (COMPENSATION_FAILED)."""
    c = keyed_journal
    relayed, undone = uid("relay"), uid("undo")
    _unpublished(c, relayed, ("step", (relayed, "original")))
    _sql(c, f"UPDATE {ENTRY} SET args = :a, args_digest = :d WHERE saga_id = :s",
         a=json.dumps([relayed, MALLORY]), d=args_digest([relayed, MALLORY], {}), s=relayed)
    saga = c.sw.begin(undone)
    saga.enqueue(c.tool("step"), undone, "charged")
    c.start_worker()
    wait_for(lambda: _one(c, f"SELECT phase FROM {ENTRY} WHERE saga_id = :s",
                          s=undone)[0] == "EXECUTED", 60, "the step to run")
    _sql(c, f"UPDATE {ENTRY} SET args = :a WHERE saga_id = :s",
         a=json.dumps([undone, MALLORY]), s=undone)
    saga.fail("test: compensate")
    wait_for(lambda: _one(c, f"SELECT status FROM {SAGA} WHERE saga_id = :s",
                          s=undone)[0] in ("COMPENSATED", "COMPENSATION_FAILED"), 60,
             "the chain to finish")
    wait_for(lambda: c.ledger(relayed) or [e for e in c.events(relayed)
                                           if e["event"] == "sweep_row_unreadable"],
             60, "the relay to send or refuse the rewritten step")
    assert [(r.kind, r.tool) for r in c.ledger(relayed)] == []  # the tool never ran
    assert [(r.kind, r.tool) for r in c.ledger(undone)] == [("effect", "charged")]
    detail = _one(c, f"SELECT compensation_detail FROM {ENTRY} WHERE saga_id = :s",
                  s=undone)[0]
    assert re.match(r"its undo was not run: the value in sagaworker_entries\.args "
                    rf"\(saga '{undone}', task '[^']+'\) is in clear", detail), detail
    assert _one(c, f"SELECT phase FROM {ENTRY} WHERE saga_id = :s", s=relayed)[0] == "INTENT"


# -- 2. an approval written with SQL --------------------------------------------------------

@pytest.mark.services
@pytest.mark.one_broker
def test_an_approval_written_with_sql_runs_nothing(keyed_journal: Cluster) -> None:
    """A gated (IRREVERSIBLE) step approved by SQL (phase, approver, approved digest set
    by hand, as the approval writes them): the relay sends it, the worker checks the
    approval's proof (only the approval secret makes one) and fails the step unrun; the
    saga compensates. An approval made with the secret still runs its step."""
    c = keyed_journal
    forged, real = uid("forged"), uid("real")
    for key in (forged, real):
        c.sw.begin(key).enqueue(c.tool("ship"), key, f"parcel-{key}")
    _sql(c, f"UPDATE {ENTRY} SET phase = 'INTENT', approved_by = 'mallory', "
         "approved_at = now(), approved_digest = args_digest, approval_nonce = NULL "
         "WHERE saga_id = :s", s=forged)
    _sql(c, f"UPDATE {SAGA} SET status = 'RUNNING' WHERE saga_id = :s", s=forged)
    token = {p.saga_id: p.token for p in c.sw.pending_approvals()}[real]
    c.sw.approve(token, approver="alice")
    c.start_worker()
    wait_for(lambda: c.ledger(forged) or _one(
        c, f"SELECT status FROM {SAGA} WHERE saga_id = :s", s=forged)[0] in (
        "COMPENSATED", "COMPENSATION_FAILED"), 60,
        "the forged approval's step to run, or its saga to compensate")
    phase, error = _one(c, f"SELECT phase, error FROM {ENTRY} WHERE saga_id = :s", s=forged)
    assert phase == "FAILED"
    assert error == ("approval verification failed: the journal holds no approval made "
                     "with SAGAWORKER_APPROVAL_SECRET for this step (written there with "
                     "SQL?); not run")
    assert [(r.kind, r.tool) for r in c.ledger(forged)] == []
    wait_for(lambda: [(r.kind, r.tool) for r in c.ledger(real)] == [("effect", "ship")],
             60, "the approved step to run")
