"""Where a sagaworker step's time goes: py-spy on the worker tree, pyinstrument on the
producer's enqueue loop. ``python -m bench.profile`` (needs py-spy and pyinstrument)."""

from __future__ import annotations

import collections
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from pyinstrument import Profiler

from bench import harness, suites
from bench.apps import counter
from bench.workers import LOG_DIR

BROKER = "amqp://guest:guest@127.0.0.1:5672//"


def summarize(collapsed: Path, top: int = 25) -> str:
    """Inclusive share of samples per frame, from py-spy's collapsed (raw) output."""
    incl: collections.Counter[str] = collections.Counter()
    total = 0
    for line in collapsed.read_text().splitlines():
        stack, _, n = line.rpartition(" ")
        if not n.isdigit():
            continue
        count = int(n)
        total += count
        for frame in set(stack.split(";")):
            incl[frame] += count
    rows = [f"{100 * c / max(1, total):5.1f}%  {f}" for f, c in incl.most_common(top * 3)
            if "sagaworker" in f or "sqlalchemy" in f or "psycopg" in f or "structlog" in f
            or "kombu" in f or "bench" in f]
    return f"{total} samples\n" + "\n".join(rows[:top])


def main() -> int:
    run = f"prof{os.getpid()}"
    name = f"bench_sw_{run}"
    db_url = harness.create_database(name)
    harness.prepare_schema(db_url, BROKER, run)
    b = harness.Bench(run, "rabbitmq", BROKER, db_url, ("sagaworker",))
    out = LOG_DIR / f"{run}-worker.txt"
    try:
        suites.step_round(b, "sagaworker", 100)
        spy = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
        rec = subprocess.Popen([spy, "record", "--pid", str(b.workers["sagaworker"].proc.pid),
                                "--subprocesses", "--format", "raw", "--rate", "200",
                                "--duration", "12", "--output", str(out), "--nonblocking"],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        time.sleep(1.0)
        prof = Profiler(interval=0.0005)
        prof.start()
        res = suites.step_round(b, "sagaworker", 1000)
        prof.stop()
        rec.wait(timeout=60)
        print(f"steps/s while profiled: {res['steps_per_s']:.1f}")
        print("\n== producer (pyinstrument; includes waiting for the workers) ==")
        print(prof.output_text(unicode=False, color=False, show_all=False))
        print("\n== worker tree (py-spy, inclusive %) ==")
        print(summarize(out) if out.exists() else "py-spy produced nothing (ptrace denied?)")
    finally:
        b.close()
        counter().close()
        harness.drop_database(name)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
