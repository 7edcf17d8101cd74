"""``python -m bench.flows_check``: ``sagaworker flows check`` on a journal of sagas in flight.

One process, under a minute. It creates its own database ``bench_check_<run>`` (migrated
with Alembic), fills it with ``--sagas`` order flows waiting at their dispatch gate (three
EXECUTED steps and the gate each), then times, side by side and ``--rounds`` times each:

- ``read``: the same pages of sagas and entries read with nothing replayed (the floor);
- ``same``: ``check_flows`` with the code that wrote the journal (no finding);
- ``changed``: ``check_flows`` with a step inserted before the charge (every saga found).

It checks the findings, drops the database and prints one JSON object.

    .venv/bin/python -m bench.flows_check --sagas 10000
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
import uuid
from typing import Any

import psycopg
from celery import Celery
from sqlalchemy import select

from sagaworker import FlowContext, Sagaworker, Settings
from sagaworker._base.canonical import args_digest
from sagaworker._journal.migrate import upgrade
from sagaworker._journal.schema import entries, sagas
from sagaworker._worker.check import Finding, check_flows

ADMIN = "host=127.0.0.1 port=5432 user=root dbname=postgres"
CODE = {"v": "same"}
MOD = "bench.flows_check"
FLOW = f"{MOD}.order"


def reserve(sku: str, quantity: int) -> str:
    return f"hold-{sku}"


def quote(postcode: str) -> int:
    return 5


def screen(order_id: str) -> bool:
    return True


def charge(order_id: str, cents: int) -> str:
    return f"charge-{order_id}"


def dispatch(order_id: str) -> str:
    return f"shipped-{order_id}"


def order(s: FlowContext, order_id: str, sku: str, quantity: int) -> str:
    s.call(f"{MOD}.reserve", sku, quantity)
    cents = 100 + s.call(f"{MOD}.quote", "10115")
    if CODE["v"] == "changed":
        s.call(f"{MOD}.screen", order_id)
    s.call(f"{MOD}.charge", order_id, cents)
    return str(s.call(f"{MOD}.dispatch", order_id))


def app(url: str) -> Sagaworker:
    sw = Sagaworker(Celery("bench_check"), settings=Settings(
        database_url=url, broker_url="memory://", approval_secret="b" * 40))
    for fn in (reserve, quote, screen, charge):
        sw.tool()(fn)
    from sagaworker import Reversibility

    sw.tool(reversibility=Reversibility.IRREVERSIBLE)(dispatch)
    sw.flow()(order)
    return sw


def fill(url: str, n: int) -> None:
    """``n`` order flows at their gate: reserve, quote, charge EXECUTED; dispatch waits."""
    with psycopg.connect(url) as conn, conn.cursor() as cur:
        cur.executemany(
            "INSERT INTO sagaworker_sagas (saga_id, status, metadata, created_at, updated_at, "
            "last_seq, exec_counter, flow, flow_args, flow_kwargs) VALUES (%s, "
            "'AWAITING_APPROVAL', '{}'::jsonb, now(), now(), 4, 3, %s, %s::jsonb, '{}'::jsonb)",
            [(f"o-{i}", FLOW, json.dumps([f"o-{i}", "sku-1", 2])) for i in range(n)])
        rows = []
        for i in range(n):
            oid = f"o-{i}"
            steps = [("reserve", ["sku-1", 2], "hold-sku-1", "EXECUTED"),
                     ("quote", ["10115"], 5, "EXECUTED"),
                     ("charge", [oid, 105], f"charge-{oid}", "EXECUTED"),
                     ("dispatch", [oid], None, "AWAITING_APPROVAL")]
            for seq, (tool, args, result, phase) in enumerate(steps, start=1):
                rows.append((oid, seq, f"{MOD}.{tool}", phase, json.dumps(args),
                             args_digest(args, {}), str(uuid.uuid4()),
                             None if result is None else json.dumps(result),
                             seq if phase == "EXECUTED" else None))
        cur.executemany(
            "INSERT INTO sagaworker_entries (saga_id, seq, tool_name, phase, args, kwargs, "
            "args_digest, task_id, result, attempts, created_at, updated_at, exec_order, "
            "in_doubt, compensation_attempts) VALUES (%s, %s, %s, %s, %s::jsonb, '{}'::jsonb, "
            "%s, %s, %s::jsonb, 1, now(), now(), %s, false, 0)", rows)
        conn.commit()
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("VACUUM ANALYZE sagaworker_sagas")
        conn.execute("VACUUM ANALYZE sagaworker_entries")


def read_only_pages(sw: Sagaworker) -> int:
    """The floor: the pages ``check_flows`` reads, with nothing replayed."""
    after, n = "", 0
    while True:
        with sw.journal.reader.connect() as conn:
            page = conn.execute(select(sagas).where(sagas.c.flow.is_not(None),
                                                    sagas.c.saga_id > after)
                                .order_by(sagas.c.saga_id).limit(500)).all()
            if not page:
                return n
            ids = [s.saga_id for s in page]
            conn.execute(select(entries).where(entries.c.saga_id.in_(ids))
                         .order_by(entries.c.saga_id, entries.c.seq)).all()
        n += len(page)
        after = page[-1].saga_id


def timed(fn: Any) -> tuple[float, Any]:
    t = time.perf_counter()
    got = fn()
    return time.perf_counter() - t, got


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sagas", type=int, default=10_000, help="flow sagas in flight")
    ap.add_argument("--rounds", type=int, default=5)
    a = ap.parse_args()
    name = f"bench_check_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(ADMIN, autocommit=True) as c:
        c.execute(f'CREATE DATABASE "{name}"')
    url = f"postgresql://root@127.0.0.1:5432/{name}"
    sw: Sagaworker | None = None
    try:
        upgrade(url)
        fill_s, _ = timed(lambda: fill(url, a.sagas))
        sw = app(url)
        runs: dict[str, list[float]] = {"read": [], "same": [], "changed": []}
        for _ in range(a.rounds):
            for kind in runs:
                CODE["v"] = kind
                took, got = timed((lambda: read_only_pages(sw)) if kind == "read"
                                  else (lambda: list(check_flows(sw))))
                runs[kind].append(took)
                if kind != "read":
                    found = [f for f in got if isinstance(f, Finding)]
                    assert got[-1] == a.sagas, got[-1]
                    assert len(found) == (a.sagas if kind == "changed" else 0), found[:1]
                    assert all(f.seq == 3 for f in found)
        med = {k: statistics.median(v) for k, v in runs.items()}
        print(json.dumps({
            "sagas": a.sagas, "entries": 4 * a.sagas, "fill_s": round(fill_s, 1),
            "rounds": a.rounds,
            "seconds_median": {k: round(v, 3) for k, v in med.items()},
            "seconds_spread": {k: [round(min(v), 3), round(max(v), 3)]
                               for k, v in runs.items()},
            "sagas_per_s": {k: round(a.sagas / v) for k, v in med.items()},
            "check_over_read": {k: round(med[k] / med["read"], 2)
                                for k in ("same", "changed")},
        }, indent=2))
    finally:
        if sw is not None:
            sw.rt.reset_engine()
        with psycopg.connect(ADMIN, autocommit=True) as c:
            c.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


if __name__ == "__main__":  # the flow's name is its module's: bench.flows_check
    from bench.flows_check import main as main_of_the_module

    main_of_the_module()
