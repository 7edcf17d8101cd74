"""The embedded defaults keep their files to their owner: the SQLite journal (and its WAL
and shared-memory files) is created 0600, the filesystem broker's folders 0700 and its
message files 0600, whatever the umask (they hold the arguments in clear)."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest
from celery import Celery

from sagaworker import Sagaworker, Settings
from tests.conftest import UNIT_SECRET


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_embedded_journal_and_broker_files_are_private(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for name in list(os.environ):
        if name.startswith("SAGAWORKER_"):
            monkeypatch.delenv(name)
    monkeypatch.chdir(tmp_path)
    old = os.umask(0o022)
    try:
        app = Celery("embedded")
        sw = Sagaworker(app, settings=Settings(approval_secret=UNIT_SECRET))

        @sw.tool()
        def charge(card: str) -> str:
            return "ok"

        sw.begin("s-1").enqueue(charge, "4111111111111111")
    finally:
        os.umask(old)
    journal = sorted(tmp_path.glob("sagaworker.db*"))
    assert tmp_path / "sagaworker.db" in journal
    assert {p.name: mode(p) for p in journal} == {p.name: 0o600 for p in journal}
    broker = tmp_path / ".sagaworker" / "broker"
    folders = [broker, *(p for p in broker.rglob("*") if p.is_dir())]
    assert {str(p): mode(p) for p in folders} == {str(p): 0o700 for p in folders}
    messages = list((broker / "out").glob("*.msg"))
    assert messages and all(mode(p) == 0o600 for p in messages)


@pytest.mark.parametrize("how", ["upgrade", "create_schema"])
def test_a_journal_made_by_db_upgrade_is_private(tmp_path: Path, how: str) -> None:
    """``sagaworker db upgrade`` (``upgrade``) and ``sw.create_schema()`` create a new
    SQLite journal 0600 too, whatever the umask (Alembic's engine would make it 0644)."""
    from sagaworker._journal.migrate import upgrade

    url = f"sqlite:///{tmp_path / 'j.db'}"
    old = os.umask(0o022)
    try:
        if how == "upgrade":
            upgrade(url)
        else:
            Sagaworker(Celery("schema"), settings=Settings(
                database_url=url, broker_url="memory://")).create_schema()
    finally:
        os.umask(old)
    assert mode(tmp_path / "j.db") == 0o600
