"""`make agent-demo` end to end: the example's trip agent (Pydantic AI, a scripted model)
on SQLite + the filesystem broker + a real worker process."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_make_agent_demo_runs_the_agent_demo() -> None:
    """The Makefile's agent-demo target runs `sagaworker demo --agent` (the command the
    next test runs)."""
    recipe = re.search(r"^agent-demo:.*\n\t(.+)$", (ROOT / "Makefile").read_text(), re.M)
    assert recipe is not None and recipe.group(1) == "$(BIN)/sagaworker demo --agent"


def test_agent_demo_completes_one_trip_and_compensates_another() -> None:
    """Offline, no server: the first trip's voucher pends after the agent framework's own
    approval and is mailed once approved with the signed token (COMPLETED); the second
    trip's declined card ends the run and the hotel is cancelled (COMPENSATED)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SAGAWORKER_")}
    env["PYTHONPATH"] = str(ROOT)
    env["COLUMNS"] = "200"
    proc = subprocess.run([sys.executable, "-m", "sagaworker.cli", "demo", "--agent"], env=env,
                          cwd=ROOT, capture_output=True, timeout=240, text=True)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert "model: scripted, offline" in out
    first, second = out.split("2. a trip whose card is declined")
    # the framework's approval alone leaves the gate pending; the signed token decides
    said = [line.strip() for line in first.splitlines() if line.startswith("  ")]
    assert [s.split(":")[0] for s in said] == [
        "guest", "the run paused at the gate of", "operator", "the run paused at the gate of",
        "still pending", "operator", "agent"]
    assert "no signed token" in said[2] and "with the gate's signed token" in said[5]
    assert "mailed voucher vc-" in said[6]
    assert re.search(r"│ 3\s+│ send_voucher\s+│ EXECUTED", first)
    journal = first.split("saga trip-2001")[1]
    assert "[REDACTED]" in journal and "card-4242" not in journal
    # the declined card: the run ends with ToolFailed, the hotel is undone
    assert "the run ended: ToolFailed: step 2 (tasks.payment.charge_card) failed: " \
           "CardDeclined" in second
    report = second.split("compensation report")[1]
    assert re.search(r"│ 1\s+│ book_hotel\s+│ COMPENSATED", report)
    assert "trip-2001 COMPLETED, trip-2002 COMPENSATED" in out.splitlines()[-1]
    assert "sagaworker-demo-" not in out.splitlines()[-1]
