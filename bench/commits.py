"""``python -m bench.commits``: how many journaled steps per second one PostgreSQL commits.

The database side of a step alone (no broker, no Python): pgbench runs the three
transactions sagaworker commits per step (the INTENT insert that bumps the saga's seq, the
claim, the EXECUTED outcome that numbers it on the saga row) as three autocommit
statements, against a journal migrated with Alembic, from 1, 4 and 16 clients over 2000
RUNNING sagas, in three set-ups: the notify triggers of migration 0003 with a waiter
registered on every saga (each outcome commit notifies, as under ``sw.saga``), the
triggers with nobody waiting (the asynchronous form), and no triggers at all; and
pgbench's built-in TPC-B on the same server, interleaved, so that published TPC-B figures
of bigger machines scale to steps/s. One pgbench "transaction" is one step, so its tps is
steps/s and 3x that is commits/s. Also WAL bytes per transaction.

    .venv/bin/python -m bench.commits --seconds 5 --rounds 3 --clients 1,4,16
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import tempfile
import uuid
from pathlib import Path

import psycopg

from sagaworker._journal.migrate import upgrade

ADMIN = "host=127.0.0.1 port=5432 user=root dbname=postgres"

STEP = """\\set sid random(1, :sagas)
WITH bump AS (UPDATE sagaworker_sagas SET last_seq = last_seq + 1, updated_at = now()
    WHERE saga_id = 'b-' || :sid AND status = 'RUNNING' RETURNING saga_id, last_seq)
INSERT INTO sagaworker_entries (saga_id, seq, tool_name, phase, args, kwargs, args_digest,
    task_id, attempts, created_at, updated_at, in_doubt, compensation_attempts)
SELECT saga_id, last_seq, 'bench.noop', 'INTENT', '["k"]', '{}', 'digest',
    md5(random()::text), 0, now(), now(), false, 0 FROM bump RETURNING seq \\gset
UPDATE sagaworker_entries SET attempts = attempts + 1, started_at = now(),
    lease_until = now() + interval '60 seconds', worker = 'bench|1', attempt_token = 'tok',
    updated_at = now()
    WHERE saga_id = 'b-' || :sid AND seq = :seq AND phase = 'INTENT' AND lease_until IS NULL;
WITH s AS (UPDATE sagaworker_sagas SET exec_counter = exec_counter + 1, updated_at = now()
    WHERE saga_id = 'b-' || :sid RETURNING exec_counter)
UPDATE sagaworker_entries e SET phase = 'EXECUTED', result = '1', executed_at = now(),
    exec_order = s.exec_counter, lease_until = NULL, updated_at = now()
    FROM s WHERE e.saga_id = 'b-' || :sid AND e.seq = :seq AND e.attempt_token = 'tok';
"""


def wal_lsn(url: str) -> int:
    with psycopg.connect(url) as conn:
        row = conn.execute("SELECT pg_current_wal_lsn() - '0/0'::pg_lsn").fetchone()
        return int(row[0]) if row else 0


def run(url: str, script: Path | None, clients: int, seconds: int,
        sagas: int) -> tuple[float, float]:
    """(tps, WAL bytes per transaction) of one pgbench run; script None: built-in TPC-B."""
    what = ["-b", "tpcb-like"] if script is None else ["-D", f"sagas={sagas}", "-f", str(script)]
    before = wal_lsn(url)
    out = subprocess.run(
        ["pgbench", "-n", "-c", str(clients), "-j", str(min(clients, 2)), "-T", str(seconds),
         *what, url], capture_output=True, text=True, check=True).stdout
    wal = wal_lsn(url) - before
    m = re.search(r"tps = ([\d.]+)", out)
    n = re.search(r"actually processed: (\d+)", out)
    if not m or not n:
        raise RuntimeError(out)
    return float(m.group(1)), wal / max(int(n.group(1)), 1)


VARIANTS = ("every_saga_waited", "nobody_waiting", "no_triggers", "pgbench_tpcb")


def set_up(url: str, variant: str) -> None:
    if variant == "pgbench_tpcb":
        return
    on = "DISABLE" if variant == "no_triggers" else "ENABLE"
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(f"ALTER TABLE sagaworker_entries {on} TRIGGER sagaworker_entries_notify")
        conn.execute(f"ALTER TABLE sagaworker_sagas {on} TRIGGER sagaworker_sagas_notify")
        conn.execute("DELETE FROM sagaworker_waiters")
        if variant == "every_saga_waited":
            conn.execute("INSERT INTO sagaworker_waiters (saga_id, waiter) "
                         "SELECT saga_id, 'bench' FROM sagaworker_sagas")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=int, default=5)
    ap.add_argument("--clients", default="1,4,16")
    ap.add_argument("--sagas", type=int, default=2000)
    ap.add_argument("--rounds", type=int, default=3, help="medians over interleaved rounds")
    args = ap.parse_args()
    name = f"bench_commits_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(ADMIN, autocommit=True) as c:
        c.execute(f'CREATE DATABASE "{name}"')
        settings = {k: c.execute(f"SHOW {k}").fetchone()[0]  # type: ignore[index]
                    for k in ("synchronous_commit", "fsync", "shared_buffers", "server_version")}
    url = f"postgresql://root@127.0.0.1:5432/{name}"
    results: dict[str, dict[str, float]] = {}
    wal_bytes: dict[str, int] = {}
    try:
        upgrade(url)
        subprocess.run(["pgbench", "-i", "-q", "-s", "10", url], capture_output=True,
                       check=True)
        with psycopg.connect(url, autocommit=True) as conn:
            conn.execute(
                "INSERT INTO sagaworker_sagas (saga_id, status, metadata, created_at, "
                "updated_at, last_seq, exec_counter) SELECT 'b-' || g, 'RUNNING', "
                "'{}'::jsonb, now(), now(), 0, 0 FROM generate_series(1, %s) g",
                (args.sagas,))
        with tempfile.TemporaryDirectory() as tmp:
            script = Path(tmp) / "step.sql"
            script.write_text(STEP)
            runs: dict[str, dict[str, list[float]]] = {}
            wal: dict[str, list[float]] = {}
            k = len(VARIANTS)
            for r in range(args.rounds):  # interleaved, the order rotated each round
                for variant in VARIANTS[r % k:] + VARIANTS[:r % k]:
                    set_up(url, variant)
                    for n in (int(x) for x in args.clients.split(",")):
                        tps, wal_per_tx = run(url, None if variant == "pgbench_tpcb"
                                              else script, n, args.seconds, args.sagas)
                        runs.setdefault(variant, {}).setdefault(str(n), []).append(tps)
                        wal.setdefault(variant, []).append(wal_per_tx)
            results = {v: {n: round(statistics.median(ts), 1) for n, ts in by.items()}
                       for v, by in runs.items()}
            wal_bytes = {v: round(statistics.median(w)) for v, w in wal.items()}
    finally:
        with psycopg.connect(ADMIN, autocommit=True) as c:
            c.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
    print(json.dumps({"postgresql": settings, "seconds": args.seconds, "rounds": args.rounds,
                      "load_average": os.getloadavg(),
                      "tps_by_clients (a step, or one TPC-B transaction)": results,
                      "wal_bytes_per_tx": wal_bytes,
                      "step_over_tpcb_by_clients": {
                          v: {n: round(t / results["pgbench_tpcb"][n], 3)
                              for n, t in r.items()}
                          for v, r in results.items() if v != "pgbench_tpcb"}}, indent=2))


if __name__ == "__main__":
    main()
