"""Render tests/output/reliability.json (written by the fault suite) as Markdown tables.

    .venv/bin/python -m tests.faults.report > docs/reliability-figures.md
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

OUTPUT = Path(__file__).resolve().parents[1] / "output" / "reliability.json"

DESCRIPTION = {
    "worker-sigkill": "whole worker process group SIGKILLed 3x, restarted",
    "child-sigkill": "a random prefork pool child SIGKILLed every second",
    "broker-restart": "broker stopped and started mid-run (Redis keeps nothing on disk)",
    "postgres-restart": "PostgreSQL stopped (fast) and started mid-run",
    "producer-crash": "producer killed after 20 INTENT commits, before any publish",
    "compensation-worker-kill": "the -Q sagaworker worker SIGKILLed 3x mid-chain",
    "duplicate-failures": "10 saga-failure messages per failing saga",
    "duplicate-deliveries": "every tool message published 3 times",
    "flow-worker-sigkill": "flows left to the workers; whole worker SIGKILLed 3x, restarted",
}


def main() -> None:
    data = json.loads(OUTPUT.read_text())
    out = ["| scenario | broker | sagas | faults injected | completed / compensated | "
           "effects | lost | duplicated (effect / undo) | in doubt | undo re-tried | s |",
           "|---|---|---|---|---|---|---|---|---|---|---|"]
    for key in sorted(data):
        f = data[key]
        if f["scenario"] not in DESCRIPTION:
            continue
        out.append(f"| {f['scenario']} | {f['broker']} | {f['sagas']} | {f['faults']} | "
                   f"{f['completed']} / {f['compensated']} | {f['effects']} | "
                   f"{f['effects_lost']} | {f['effects_duplicated']} / "
                   f"{f['undos_duplicated']} | {f['in_doubt']} | {f.get('undo_retries', 0)} | "
                   f"{f['seconds']} |")
    sys.stdout.write("\n".join(out) + "\n")


if __name__ == "__main__":
    main()
