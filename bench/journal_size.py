"""Step throughput as the journal grows (filled to 10^3..10^6 rows), and again once
``sw.prune`` removed what had finished."""

from __future__ import annotations

import time
from typing import Any

import psycopg

from bench.harness import Bench
from bench.suites import step_throughput


def fill_journal(db_url: str, have: int, want: int) -> None:
    """Bring both journals to ``want`` rows: 10-step COMPLETED sagas, generate_series."""
    if want <= have:
        return
    a, z = have // 10, want // 10
    url = db_url.replace("postgresql+psycopg://", "postgresql://")
    with psycopg.connect(url, autocommit=True) as conn:
        with conn.transaction():
            conn.execute(
                "INSERT INTO sagaworker_sagas (saga_id, status, metadata, created_at, "
                "updated_at, last_seq, exec_counter, finished_at) "
                "SELECT 'fill-' || g, 'COMPLETED', '{}'::jsonb, now() - interval '1 day', "
                "now() - interval '1 day', 10, 10, now() - interval '1 day' "
                "FROM generate_series(%s::int, %s::int) g", (a, z - 1))
            conn.execute(
                "INSERT INTO sagaworker_entries (saga_id, seq, tool_name, phase, args, kwargs, "
                "args_digest, task_id, result, attempts, created_at, updated_at, published_at, "
                "started_at, executed_at, exec_order, duration_ms, in_doubt, "
                "compensation_attempts) "
                "SELECT 'fill-' || g, s, 'bench.sw.noop', 'EXECUTED', '[\"k\"]'::jsonb, "
                "'{}'::jsonb, md5(g::text), md5(g::text || '-' || s), to_jsonb(s), 1, "
                "now() - interval '1 day', now() - interval '1 day', now() - interval '1 day', "
                "now() - interval '1 day', now() - interval '1 day', s, 0.1, false, 0 "
                "FROM generate_series(%s::int, %s::int) g, generate_series(1, 10) s",
                (a, z - 1))
            conn.execute(
                "INSERT INTO bench_minimal (id, phase, tool, args, result, created_at, "
                "executed_at) SELECT gen_random_uuid(), 'EXECUTED', 'noop', '[\"k\"]'::jsonb, "
                "'1'::jsonb, now() - interval '1 day', now() - interval '1 day' "
                "FROM generate_series(1, %s::int)", ((z - a) * 10,))
        conn.execute("VACUUM ANALYZE sagaworker_sagas")
        conn.execute("VACUUM ANALYZE sagaworker_entries")
        conn.execute("VACUUM ANALYZE bench_minimal")


def journal_rows(db_url: str) -> int:
    url = db_url.replace("postgresql+psycopg://", "postgresql://")
    with psycopg.connect(url) as conn:
        row = conn.execute("SELECT count(*) FROM sagaworker_entries").fetchone()
        return int(row[0]) if row else 0


def big_journal(b: Bench, sizes: tuple[int, ...], n: int, rounds: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    have = 0
    for size in sizes:
        t = time.perf_counter()
        fill_journal(b.db_url, have, size)
        have = max(have, size)
        fill_s = time.perf_counter() - t
        res = step_throughput(b, n, rounds)
        res["rows_before"] = journal_rows(b.db_url)
        res["fill_seconds"] = fill_s
        out[str(size)] = res
    return out


def after_prune(b: Bench, n: int, rounds: int) -> dict[str, Any]:
    """Prune the filled journal (its sagas finished a day ago) with ``sw.prune``: the
    prune's own rate, then the step throughput again on what is left."""
    sw = b.systems["sagaworker"].sw
    before = journal_rows(b.db_url)
    t = time.perf_counter()
    sagas_deleted = sw.prune(12 * 3600.0)
    prune_s = time.perf_counter() - t
    after = journal_rows(b.db_url)
    url = b.db_url.replace("postgresql+psycopg://", "postgresql://")
    with psycopg.connect(url, autocommit=True) as conn:  # what the autovacuum does later
        conn.execute("VACUUM ANALYZE sagaworker_sagas")
        conn.execute("VACUUM ANALYZE sagaworker_entries")
    res = step_throughput(b, n, rounds)
    res.update(entries_before=before, entries_after=after, sagas_deleted=sagas_deleted,
               prune_seconds=prune_s,
               prune_entries_per_s=(before - after) / prune_s if prune_s else float("nan"))
    return res
