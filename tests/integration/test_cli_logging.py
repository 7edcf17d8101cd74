"""The command line's log lines, as an operator meets them in a real process: one rule
for every decision (quiet unless ``-v``)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from tests.unit.test_cli_output import APP


@pytest.fixture
def cli_app(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A folder with the app module ``cliapp`` (a gated tool), as the working directory."""
    (tmp_path / "cliapp.py").write_text(
        APP.replace("DB", repr(f"sqlite:///{tmp_path / 'j.db'}")))
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "cliapp", raising=False)
    return tmp_path


def _cli(app_dir: Path, *args: str) -> tuple[int, str, str]:
    import os
    import subprocess

    env = {k: v for k, v in os.environ.items() if not k.startswith("SAGAWORKER_")}
    env["PYTHONPATH"] = os.pathsep.join([str(app_dir), *sys.path])
    proc = subprocess.run([sys.executable, "-m", "sagaworker.cli", "-A", "cliapp", *args],
                          cwd=app_dir, env=env, capture_output=True, text=True, timeout=60)
    return proc.returncode, proc.stdout, proc.stderr


def test_decisions_print_one_line_and_log_lines_only_with_v(cli_app: Path) -> None:
    """approve, reject and abort follow one rule: their own line on stdout and nothing on
    stderr; with ``-v`` sagaworker's JSON log line of the decision on stderr too."""
    import json

    import cliapp  # type: ignore[import-not-found]

    for sid in ("q-1", "q-2", "q-3", "q-4"):
        cliapp.sw.begin(sid).enqueue(cliapp.dispatch_a_parcel_to_a_customer_far_away,
                                     sid, "note")
    tokens = {r.saga_id: r.token for r in cliapp.sw.pending_approvals()}
    runs = {
        "approve": _cli(cli_app, "approve", tokens["q-1"], "--approver", "alice"),
        "reject": _cli(cli_app, "reject", tokens["q-2"], "--reason", "no", "--approver", "al"),
        "abort": _cli(cli_app, "abort", "q-3", "--reason", "gone", "--actor", "al"),
    }
    assert {k: (rc, out.strip(), err) for k, (rc, out, err) in runs.items()} == {
        "approve": (0, "approved", ""), "reject": (0, "rejected", ""),
        "abort": (0, runs["abort"][1].strip(), "")}
    rc, out, err = _cli(cli_app, "-v", "reject", tokens["q-4"], "--reason", "no",
                        "--approver", "al")
    assert (rc, out.strip()) == (0, "rejected")
    events = [json.loads(line)["event"] for line in err.splitlines() if line.startswith("{")]
    assert "approval_rejected" in events
