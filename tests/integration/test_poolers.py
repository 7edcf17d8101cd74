"""A connection pooler between sagaworker and its journal is refused at start: the
journal finds a statement whose connection was lost by its server process, which a pooler
hides (it hands out a process id of its own) and, in transaction mode, changes under it.
Tested with a real PgBouncer in front of the run's PostgreSQL database."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from celery import Celery

from sagaworker import ConfigurationError, Sagaworker, Settings
from tests.conftest import CI, TEST_SECRET
from tests.integration.test_startup import _refusal, _worker

pytestmark = pytest.mark.services


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(params=["transaction", "session"])
def pooled_url(request: pytest.FixtureRequest, pg_url: str) -> Iterator[str]:
    """The run's database through a PgBouncer of the test's own (``make pooler``)."""
    binary = shutil.which("pgbouncer") or "/usr/sbin/pgbouncer"
    if not os.path.exists(binary):
        if CI:
            pytest.fail("pgbouncer is not installed; CI=true requires it (make pooler)")
        pytest.skip("pgbouncer is not installed (make pooler)")
    # PgBouncer refuses to run as root: it runs as postgres here, so its folder is one
    # that user can reach (pytest's are its owner's only)
    with tempfile.TemporaryDirectory(prefix=f"sw-pgbouncer-{request.param}-") as tmp:
        yield from _pgbouncer(binary, Path(tmp), request.param, pg_url)


def _pgbouncer(binary: str, folder: Path, mode: str, pg_url: str) -> Iterator[str]:
    folder.chmod(0o777)
    port = _free_port()
    (folder / "users.txt").write_text('"root" ""\n')
    (folder / "pgbouncer.ini").write_text(
        "[databases]\n* = host=127.0.0.1 port=5432\n[pgbouncer]\n"
        f"listen_addr = 127.0.0.1\nlisten_port = {port}\nauth_type = trust\n"
        f"auth_file = {folder}/users.txt\npool_mode = {mode}\nunix_socket_dir =\n"
        f"logfile = {folder}/pgbouncer.log\n")
    for f in folder.iterdir():
        f.chmod(0o666)
    cmd = [binary, str(folder / "pgbouncer.ini")]
    if os.geteuid() == 0:
        cmd = ["runuser", "-u", "postgres", "--", *cmd]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 20
        while True:
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", port)) == 0:
                    break
            assert proc.poll() is None, f"pgbouncer exited: {proc.stderr.read()!r}"  # type: ignore[union-attr]
            assert time.monotonic() < deadline, "pgbouncer did not listen"
            time.sleep(0.05)
        yield pg_url.replace("127.0.0.1:5432", f"127.0.0.1:{port}")
    finally:
        proc.terminate()
        proc.wait(10)


def test_a_worker_refuses_a_journal_behind_a_connection_pooler(
        tmp_path: Path, pooled_url: str) -> None:
    """One line naming the pooler and what to do, exit 3, never a worker that would
    watch (and stop) another client's statement after a lost connection."""
    line = _refusal(_worker(tmp_path, pooled_url, TEST_SECRET))
    assert "connection pooler" in line and "SAGAWORKER_DATABASE_URL" in line


def test_a_producer_behind_a_connection_pooler_gets_a_configuration_error(
        pooled_url: str) -> None:
    sw = Sagaworker(Celery("pooled", broker="memory://"), settings=Settings(
        database_url=pooled_url, broker_url="memory://", approval_secret=TEST_SECRET))
    with pytest.raises(ConfigurationError, match="connection pooler"):
        sw.begin("pooled-1")


def test_the_server_process_is_known_on_a_direct_connection(pg_url: str) -> None:
    """Directly connected, the process id a connection was given is its server's: the
    check says nothing, and the lost-statement wait watches that process."""
    from sqlalchemy import text

    from sagaworker._journal import pgconn
    from sagaworker._journal.dialect import make_engine

    engine = make_engine(pg_url)
    try:
        with engine.connect() as conn:
            assert conn.connection.info["sagaworker_pooled"] is False
            assert pgconn.backend_pid(conn) == conn.execute(
                text("SELECT pg_backend_pid()")).scalar()
    finally:
        engine.dispose()
