"""``celery worker`` subprocesses (prefork, -c 2), started and stopped by the bench."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import IO, Any

import psutil

ROOT = Path(__file__).resolve().parent.parent
LOG_DIR = Path(os.environ.get("BENCH_LOG_DIR", "/tmp/sagaworker-bench-logs"))


class Worker:
    """One ``celery -A bench.app worker -P prefork -c 2`` for one system."""

    def __init__(self, system: str, *, broker: str, db_url: str, queue: str,
                 app: Any, concurrency: int = 2, nth: int = 0) -> None:
        self.system, self.queue, self.app = system, queue, app
        self.hostname = f"{queue}{f'-{nth}' if nth else ''}@bench"
        LOG_DIR.mkdir(parents=True, exist_ok=True)
        self.log_path = LOG_DIR / f"{queue}{f'-{nth}' if nth else ''}.log"
        env = {**os.environ, "PYTHONPATH": str(ROOT), "BENCH_SYSTEM": system,
               "BENCH_BROKER": broker, "BENCH_DB": db_url, "BENCH_QUEUE": queue,
               "SAGAWORKER_DATABASE_URL": db_url, "SAGAWORKER_BROKER_URL": broker,
               "SAGAWORKER_QUEUE": f"{queue}.sw"}
        cmd = [sys.executable, "-m", "celery", "-A", "bench.app", "worker", "-P", "prefork",
               "-c", str(concurrency), "-n", self.hostname, "--without-gossip",
               "--without-mingle", "--without-heartbeat", "-l", "INFO"]
        self._log: IO[bytes] = self.log_path.open("wb")
        self.proc = subprocess.Popen(cmd, cwd=str(ROOT), env=env, stdout=self._log,
                                     stderr=subprocess.STDOUT, start_new_session=True)

    def wait_ready(self, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"worker {self.hostname} exited {self.proc.returncode}; "
                                   f"see {self.log_path}")
            try:
                if (self.app.control.ping(destination=[self.hostname], timeout=0.5)
                        and len(psutil.Process(self.proc.pid).children()) >= 2):
                    return
            except Exception:  # broker hiccup while booting: ask again
                pass
            time.sleep(0.2)
        raise TimeoutError(f"worker {self.hostname} not ready in {timeout} s; "
                           f"see {self.log_path}")

    def rss_mib(self) -> float:
        """Resident memory of the whole worker tree (main process + pool children)."""
        root = psutil.Process(self.proc.pid)
        procs = [root, *root.children(recursive=True)]
        total = 0
        for p in procs:
            with contextlib.suppress(psutil.NoSuchProcess):
                total += p.memory_info().rss
        return total / (1024 * 1024)

    def terminate(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)  # warm shutdown of this worker only

    def stop(self) -> None:
        self.terminate()
        if self.proc.poll() is None:
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)  # our own session, started above
                self.proc.wait(timeout=10)
        self._log.close()
