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


def test_the_quick_start_names_make_agent_demo() -> None:
    """The README's quick start names both demos: `make demo` and `make agent-demo`."""
    readme = (ROOT / "README.md").read_text()
    quick = readme.split("## Quick start", 1)[1].split("\n## ", 1)[0]
    assert re.search(r"^make agent-demo +# ", quick, re.M), quick


#: what an agent framework costs a process that imports it (1 to 4 s each)
FRAMEWORKS = ("pydantic_ai", "agents", "langchain", "langchain_core", "langgraph",
              "sagaworker.agents.pydantic_ai", "sagaworker.agents.openai_agents",
              "sagaworker.agents.langchain")


def test_the_readmes_durable_agent_is_built_on_first_use() -> None:
    """The README's durable agent run imports its framework where the agent is built, on
    first use, not at the module's import: every `sagaworker` command, the web app and a
    producer import the app module and never run the agent."""
    import ast

    readme = (ROOT / "README.md").read_text()
    section = readme.split("### Durable agent runs", 1)[1]
    code = section.split("```python\n", 1)[1].split("```", 1)[0]
    top = [node for node in ast.parse(code).body if isinstance(node, ast.Import | ast.ImportFrom)]
    imported = {a.name if isinstance(n, ast.Import) else f"{n.module}.{a.name}"
                for n in top for a in n.names}
    assert sorted(m for m in imported if m.startswith(FRAMEWORKS)) == []


def test_agent_demo_resumes_a_killed_run_waits_at_a_gate_and_compensates() -> None:
    """Offline, no server: a trip whose worker is SIGKILLed during the model's first turn
    is finished by a new worker from the journal (only that turn sent twice); a trip waits
    at the voucher's gate with every worker stopped and completes after the signed
    approval; a declined card cancels the hotel (COMPENSATED)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SAGAWORKER_")}
    env["PYTHONPATH"] = str(ROOT)
    env["COLUMNS"] = "200"
    proc = subprocess.run([sys.executable, "-m", "sagaworker.cli", "demo", "--agent"], env=env,
                          cwd=ROOT, capture_output=True, timeout=300, text=True)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert "model: scripted, offline" in out
    killed, rest = out.split("2. a trip at the voucher's gate")
    gated, declined = rest.split("3. a trip whose card is declined")
    assert "the worker is killed (SIGKILL) while the model answers turn 1" in killed
    assert "model requests per turn: turn 1: 2, turn 2: 1, turn 3: 1, turn 4: 1" in killed
    assert re.search(r"│ 6\s+│ send_voucher\s+│ EXECUTED", killed)
    # one name for a model request everywhere, and no arguments shown for it
    assert re.search(r"│ 1\s+│ model request\s+│ EXECUTED\s+│\s+│ model .* asks book_hotel",
                     killed)
    journal = killed.split("saga trip-2001")[1]
    assert "[REDACTED]" in journal and "card-4242" not in journal
    assert "every worker is stopped: no process runs the agent" in gated
    assert "trip-2003: COMPLETED" in gated
    report = declined.split("compensation report")[1]
    assert re.search(r"│ 2\s+│ book_hotel\s+│ COMPENSATED", report)
    assert "CardDeclined" in declined
    last = out.splitlines()[-1]
    assert "trip-2001 COMPLETED, trip-2003 COMPLETED, trip-2002 COMPENSATED" in last
    assert "sagaworker-demo-" not in last
    # the hint names the command that keeps this demo's folder
    assert last.endswith("; run `sagaworker demo --agent --keep` to keep the journal and the "
                         "worker log")
