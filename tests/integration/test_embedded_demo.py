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
    env["COLUMNS"] = "200"
    proc = subprocess.run([sys.executable, "-m", "sagaworker.cli", "demo"], env=env,
                          cwd=ROOT, capture_output=True, timeout=240, text=True)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    # the flow's arguments redacted by parameter name: only the card
    assert 'flow: tasks.orders.place_order("1001", "sku-42", 2, "[REDACTED]", 3000)' in out
    # the last line points to nothing the demo deleted
    assert "sagaworker-demo-" not in out.splitlines()[-1] and "--keep" in out
    assert "order-1001 COMPLETED" in out
    assert "order-1002 COMPENSATED" in out
    assert "declined" in out
    # the report lists the undos in the order they ran: quote (skipped), then the hold
    report = out.split("compensation report")[-1]
    assert report.index("quote_shipping") < report.index("reserve_inventory")


def test_demo_outside_a_checkout_says_where_to_run_it(tmp_path: Path) -> None:
    """The example is not installed with the library: in another folder the demo exits 2
    saying to run it in a checkout, and imports no module named ``tasks``."""
    (tmp_path / "tasks").mkdir()
    (tmp_path / "tasks" / "__init__.py").write_text(
        "raise SystemExit('the demo imported a user module')\n")
    (tmp_path / "tasks" / "orders.py").write_text("")
    env = {k: v for k, v in os.environ.items() if not k.startswith("SAGAWORKER_")}
    env["PYTHONPATH"] = str(ROOT / "sagaworker" / "..")
    proc = subprocess.run([sys.executable, "-m", "sagaworker.cli", "demo"], env=env,
                          cwd=tmp_path, capture_output=True, timeout=60, text=True)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "make demo" in proc.stdout + proc.stderr
