"""The embedded defaults end to end: SQLite + filesystem broker + a real worker process."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_demo_completes_one_saga_and_compensates_another(tmp_path: Path) -> None:
    """`sagaworker demo` needs no server: one order COMPLETED, one COMPENSATED in reverse."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SAGAWORKER_")}
    env["PYTHONPATH"] = str(ROOT)
    proc = subprocess.run([sys.executable, "-m", "sagaworker.cli", "demo"], env=env,
                          cwd=tmp_path, capture_output=True, timeout=240, text=True)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert "order-1001 COMPLETED" in out
    assert "order-1002 COMPENSATED" in out
    assert "declined" in out
    # the report lists the undos in the order they ran: quote (skipped), then the hold
    report = out.split("compensation report")[-1]
    assert report.index("quote_shipping") < report.index("reserve_inventory")
