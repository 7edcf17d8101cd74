"""One UPDATE ... RETURNING, four ways, on the same PostgreSQL (``python -m bench.statement``):
what a single journal statement costs the client (CPU) and the caller (wall) in each form.

* SQLAlchemy ``engine.begin()`` with the statement built per call (the step path before
  2026-12-03; three round trips: BEGIN, the statement, COMMIT);
* ``exec_driver_sql`` on a connection in autocommit (one round trip, SQLAlchemy's execution);
* the driver's connection from the pool in autocommit (``sagaworker/_journal/pgconn.py``);
* the driver's pipeline mode (BEGIN, statement, COMMIT in one network round trip).
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Callable

from sqlalchemy import Column, Integer, MetaData, String, Table, create_engine, update

from bench import harness

SQL = "UPDATE t SET n = n + 1, tok = %(tok)s WHERE id = %(id)s AND tok <> 'x' RETURNING n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.statement", description=__doc__)
    p.add_argument("-n", type=int, default=3000)
    a = p.parse_args(argv)
    name = f"bench_stmt_{os.getpid()}"
    url = harness.create_database(name)
    eng = create_engine(url, pool_size=5)
    try:
        with eng.begin() as c:
            c.exec_driver_sql("CREATE TABLE t (id int primary key, n int, tok text)")
            c.exec_driver_sql("INSERT INTO t SELECT g, 0, '' FROM generate_series(1,100) g")
        t = Table("t", MetaData(), Column("id", Integer, primary_key=True),
                  Column("n", Integer), Column("tok", String))
        auto = eng.execution_options(isolation_level="AUTOCOMMIT")

        def built(i: int) -> None:
            with eng.begin() as c:
                c.execute(update(t).where(t.c.id == i % 100 + 1, t.c.tok != "x")
                          .values(n=t.c.n + 1, tok=str(i)).returning(t.c.n)).first()

        def driver_sql(i: int) -> None:
            with auto.connect() as c:
                c.exec_driver_sql(SQL, {"id": i % 100 + 1, "tok": str(i)}).first()

        def raw_auto(i: int) -> None:
            raw = eng.raw_connection()
            try:
                pg = raw.driver_connection
                assert pg is not None
                pg.autocommit = True
                pg.execute(SQL, {"id": i % 100 + 1, "tok": str(i)}).fetchone()
                pg.autocommit = False
            finally:
                raw.close()

        def pipeline(i: int) -> None:
            raw = eng.raw_connection()
            try:
                pg = raw.driver_connection
                assert pg is not None
                with pg.pipeline():
                    pg.execute(SQL, {"id": i % 100 + 1, "tok": str(i)}).fetchone()
                    pg.commit()
            finally:
                raw.close()

        forms: list[tuple[str, Callable[[int], None]]] = [
            ("SQLAlchemy begin + built statement", built),
            ("exec_driver_sql, autocommit", driver_sql),
            ("driver connection, autocommit", raw_auto),
            ("driver pipeline (BEGIN, statement, COMMIT)", pipeline)]
        print("| form | CPU ms | wall ms |\n|---|---|---|")
        for label, fn in forms:
            for i in range(100):  # warm: connections, prepared statements
                fn(i)
            t0, c0 = time.perf_counter(), time.process_time()
            for i in range(a.n):
                fn(i)
            print(f"| {label} | {1e3 * (time.process_time() - c0) / a.n:.3f} | "
                  f"{1e3 * (time.perf_counter() - t0) / a.n:.3f} |")
    finally:
        eng.dispose()
        harness.drop_database(name)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
