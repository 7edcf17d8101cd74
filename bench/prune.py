"""``python -m bench.prune``: the rate of ``sw.prune`` on PostgreSQL (retention).

One process, about half a minute. It creates its own database ``bench_prune_<run>``
(migrated with Alembic, so the notify triggers are there), fills it with ``--entries``
journal entries of 10-step COMPLETED sagas finished 40 days ago (one audit row each) plus
``--keep`` recent ones, then times ``prune(older_than=30 days)`` batch by batch, checks
what is left and drops the database. It prints one JSON object.

    .venv/bin/python -m bench.prune --entries 100000 --batch 1000
"""

from __future__ import annotations

import argparse
import json
import time
import uuid
from datetime import timedelta
from typing import Any

import psycopg

from sagaworker._journal.dialect import make_engine
from sagaworker._journal.migrate import upgrade
from sagaworker._journal.repository import Journal, now
from sagaworker._journal.retention import prune_batch

ADMIN = "host=127.0.0.1 port=5432 user=root dbname=postgres"
STEPS = 10


def fill(url: str, old_sagas: int, keep: int) -> None:
    with psycopg.connect(url, autocommit=True) as conn:
        with conn.transaction():
            for prefix, first, last, age in (("old-", 1, old_sagas, "40 days"),
                                              ("new-", 1, keep, "1 hour")):
                if last < first:
                    continue
                conn.execute(
                    "INSERT INTO sagaworker_sagas (saga_id, status, metadata, created_at, "
                    "updated_at, last_seq, exec_counter, finished_at) "
                    f"SELECT %s || g, 'COMPLETED', '{{}}'::jsonb, now() - interval '{age}', "
                    f"now() - interval '{age}', {STEPS}, {STEPS}, now() - interval '{age}' "
                    "FROM generate_series(%s::int, %s::int) g", (prefix, first, last))
                conn.execute(
                    "INSERT INTO sagaworker_entries (saga_id, seq, tool_name, phase, args, "
                    "kwargs, args_digest, task_id, result, attempts, created_at, updated_at, "
                    "executed_at, exec_order, in_doubt, compensation_attempts) "
                    "SELECT %s || g, s, 'bench.noop', 'EXECUTED', '[\"k\"]'::jsonb, "
                    "'{}'::jsonb, md5(g::text), md5(g::text || '-' || s), to_jsonb(s), 1, "
                    f"now() - interval '{age}', now() - interval '{age}', "
                    f"now() - interval '{age}', s, false, 0 "
                    f"FROM generate_series(%s::int, %s::int) g, generate_series(1, {STEPS}) s",
                    (prefix, first, last))
                conn.execute(
                    "INSERT INTO sagaworker_audit (saga_id, seq, action, actor, at) "
                    f"SELECT %s || g, 1, 'approved', 'bench', now() - interval '{age}' "
                    "FROM generate_series(%s::int, %s::int) g", (prefix, first, last))
        for table in ("sagaworker_sagas", "sagaworker_entries", "sagaworker_audit"):
            conn.execute(f"VACUUM ANALYZE {table}")


def counts(url: str) -> dict[str, int]:
    with psycopg.connect(url) as conn:
        out = {}
        for table in ("sagaworker_sagas", "sagaworker_entries", "sagaworker_audit"):
            row = conn.execute(f"SELECT count(*) FROM {table}").fetchone()
            out[table] = int(row[0]) if row else 0
        return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--entries", type=int, default=100_000, help="journal entries to prune")
    ap.add_argument("--keep", type=int, default=1000, help="recent sagas that must stay")
    ap.add_argument("--batch", type=int, default=1000, help="sagas per transaction")
    args = ap.parse_args()
    name = f"bench_prune_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(ADMIN, autocommit=True) as c:
        c.execute(f'CREATE DATABASE "{name}"')
    url = f"postgresql://root@127.0.0.1:5432/{name}"
    engine: Any = None
    try:
        upgrade(url)
        old = args.entries // STEPS
        t = time.perf_counter()
        fill(url, old, args.keep)
        fill_s = time.perf_counter() - t
        before = counts(url)
        engine = make_engine(url)
        journal = Journal(engine)
        cutoff = now() - timedelta(days=30)
        batches: list[float] = []
        sagas = rows = 0
        t = time.perf_counter()
        while True:
            b = time.perf_counter()
            got = prune_batch(journal, cutoff, include_dirty=False, batch=args.batch)
            batches.append(time.perf_counter() - b)
            sagas += got.sagas
            rows += got.rows
            if not got.more:
                break
        took = time.perf_counter() - t
        after = counts(url)
        assert sagas == old and after["sagaworker_sagas"] == args.keep, (sagas, after)
        assert after["sagaworker_entries"] == args.keep * STEPS, after
        batches.sort()
        print(json.dumps({
            "entries": args.entries, "batch_sagas": args.batch, "fill_s": round(fill_s, 2),
            "rows_before": before, "rows_after": after, "sagas_deleted": sagas,
            "rows_deleted": rows, "seconds": round(took, 3),
            "rows_per_s": round(rows / took), "sagas_per_s": round(sagas / took),
            "transactions": len(batches),
            "batch_ms_median": round(1000 * batches[len(batches) // 2], 1),
            "batch_ms_max": round(1000 * batches[-1], 1),
        }, indent=2))
    finally:
        if engine is not None:
            engine.dispose()
        with psycopg.connect(ADMIN, autocommit=True) as c:
            c.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


if __name__ == "__main__":
    main()
