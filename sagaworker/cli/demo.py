"""``sagaworker demo``: the order saga on the embedded defaults (SQLite, filesystem broker)."""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from .._observe.records import Redaction
from .render import console, render_saga

__all__ = ["Workers", "run_demo", "start_worker"]


def start_worker(app: str, env: dict[str, str], log: Path, *, concurrency: int = 2,
                 timeout: float = 60, extra: tuple[str, ...] = (),
                 pool: str = "prefork") -> subprocess.Popen[bytes]:
    """Start `celery -A app worker -P pool` and wait until it logs that it is ready."""
    out = open(log, "ab")  # noqa: SIM115 - the worker owns it until it exits
    proc = subprocess.Popen(
        [sys.executable, "-m", "celery", "-A", app, "worker", "-P", pool,
         "-c", str(concurrency), "--loglevel=INFO", "--without-gossip", "--without-mingle",
         *extra], env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"worker exited with {proc.returncode}; see {log}")
        if b" ready." in log.read_bytes():
            return proc
        time.sleep(0.1)
    proc.kill()
    raise RuntimeError(f"worker not ready after {timeout} s; see {log}")


EXAMPLE = "tasks"  # the example application of the repository, never installed


def _example_here() -> bool:
    """The example is a folder of the sagaworker checkout the demo runs in (never a
    user's own ``tasks`` package that happens to be in the working directory)."""
    here = Path.cwd()
    project = here / "pyproject.toml"
    return ((here / EXAMPLE / "orders.py").is_file() and project.is_file()
            and 'name = "sagaworker"' in project.read_text(errors="replace"))


def _approver(sw: Any, stop: threading.Event) -> None:
    """Plays the human on the approval gate."""
    while not stop.is_set():
        for req in sw.pending_approvals():
            console.print(f"  approval gate: {req.tool_name.rsplit('.', 1)[-1]}"
                          f"{tuple(req.args)} -> approved by demo-operator", markup=False)
            sw.approve(req.token, approver="demo-operator")
        stop.wait(0.1)


class Workers:
    """The demo's worker process: started, stopped, or killed (SIGKILL, its whole group)."""

    def __init__(self, env: dict[str, str], folder: Path) -> None:
        self.env, self.folder = env, folder
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        self.proc = start_worker(EXAMPLE, self.env, self.folder / "worker.log")

    def kill(self) -> None:
        if self.proc is not None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(20)
            self.proc = None

    def stop(self) -> None:
        if self.proc is None:
            return
        self.proc.terminate()
        try:
            self.proc.wait(20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.proc = None


@contextmanager
def _embedded(keep: bool, **extra: str) -> Iterator[tuple[Path, Any, Workers]]:
    """The example on the embedded defaults, in a folder of its own: the example's module
    (its tables created) and a worker of it, stopped (and the folder removed) after."""
    if str(Path.cwd()) not in sys.path:
        sys.path.insert(0, str(Path.cwd()))
    folder = Path(tempfile.mkdtemp(prefix="sagaworker-demo-"))
    secret = secrets.token_urlsafe(32)
    env = {**os.environ,
           "SAGAWORKER_DATABASE_URL": f"sqlite:///{folder / 'journal.db'}",
           "SAGAWORKER_BROKER_URL": "filesystem://",
           "SAGAWORKER_BROKER_FOLDER": str(folder / "broker"),
           "SAGAWORKER_APPROVAL_SECRET": secret,
           "SAGAWORKER_COMPENSATION_BACKOFF": "0.2",
           "SAGAWORKER_LOG_FORMAT": "json", **{k: v.replace("{folder}", str(folder))
                                                for k, v in extra.items()}}
    os.environ.update(env)
    console.print(f"[bold]sagaworker demo[/] in {folder}\n"
                  "journal: SQLite, broker: kombu filesystem transport (no server)\n"
                  "approval secret: a throwaway one generated for this demo only")
    import importlib

    tasks = importlib.import_module(EXAMPLE)
    tasks.sw.create_schema()  # the release step: the journal and the example's own tables
    workers = Workers(env, folder)
    workers.start()
    try:
        yield folder, tasks, workers
    finally:
        workers.stop()
        if not keep:
            shutil.rmtree(folder, ignore_errors=True)


def _not_here() -> int:
    console.print("error: sagaworker demo runs the example application of the "
                  "repository (tasks/, config/), which the installed library does not "
                  "hold: run `make demo` in a checkout of sagaworker", markup=False)
    return 2


def _closing(folder: Path, keep: bool, outcome: str, command: str = "sagaworker demo") -> None:
    """The last line: the outcome, and where the log is (or the command that keeps it)."""
    where = (f"worker log: {folder / 'worker.log'}" if keep else
             f"run `{command} --keep` to keep the journal and the worker log")
    console.print(f"\nresults: {outcome}; {where}", markup=False)


def run_demo(*, keep: bool = False) -> int:
    if not _example_here():
        return _not_here()
    with _embedded(keep) as (folder, tasks, _):
        import importlib

        sw, place_order = tasks.sw, importlib.import_module(f"{EXAMPLE}.orders").place_order
        stop = threading.Event()
        threading.Thread(target=_approver, args=(sw, stop), daemon=True).start()
        console.rule("1. an order that completes (a flow: sw.start returns, the worker "
                     "carries it)")
        ok = sw.start("order-1001", place_order, "1001", "sku-42", 2, "card-4242", 3_000,
                      metadata={"customer": "c-9"}).wait(timeout=60)
        render_saga(sw.inspect(ok.saga_id), Redaction.of(sw))
        console.rule("2. an order whose card is declined: compensated in reverse")
        bad = sw.start("order-1002", place_order, "1002", "sku-42", 1, "declined-0002", 1_500,
                       metadata={"customer": "c-7"}).wait(timeout=60)
        render_saga(sw.inspect(bad.saga_id), Redaction.of(sw))
        stop.set()
        _closing(folder, keep, f"{ok.saga_id} {ok.status.value}, {bad.saga_id} "
                               f"{bad.status.value}")
        return 0 if ok.status.value == "COMPLETED" and bad.status.value == "COMPENSATED" else 1
