"""``celery -A bench.app worker``: the system named by BENCH_SYSTEM, from the environment."""

from __future__ import annotations

import os

from bench.apps import make_system

system = make_system(os.environ["BENCH_SYSTEM"], broker=os.environ["BENCH_BROKER"],
                     db_url=os.environ["BENCH_DB"], queue=os.environ["BENCH_QUEUE"])
app = system.app
