"""Where a setting comes from: what is passed in, then the environment (any case), then a
``.env`` file in the working directory, then the default."""

from __future__ import annotations

import contextlib
import os
import threading
from pathlib import Path

import pytest
from pydantic import ValidationError

from sagaworker import ConfigurationError, Settings


@pytest.fixture
def workdir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.chdir(tmp_path)
    for name in ("SAGAWORKER_LOG_LEVEL", "SAGAWORKER_COMPENSATION_RETRIES",
                 "SAGAWORKER_ORPHAN_AFTER", "SAGAWORKER_APPROVAL_TTL"):
        monkeypatch.delenv(name, raising=False)
    (tmp_path / ".env").write_text(
        "# the app's .env\n"
        "SAGAWORKER_LOG_LEVEL=debug\n"
        "SAGAWORKER_COMPENSATION_RETRIES=7\n"
        "sagaworker_orphan_after=12\n"
        "SAGAWORKER_NOT_A_SETTING=1\n"
        "SAGAWORKER_WEB_TOKENS=alice:" + "a" * 64 + "\n")
    return tmp_path


def test_passed_then_environment_then_dotenv_then_default(
        workdir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SAGAWORKER_COMPENSATION_RETRIES", "5")
    monkeypatch.setenv("sagaworker_approval_ttl", "60")
    s = Settings(orphan_after=3)
    assert (s.log_level, s.compensation_retries, s.orphan_after, s.approval_ttl,
            s.max_reruns) == ("DEBUG", 5, 3.0, 60.0, 3)
    # what the environment or the file set counts as set (a broker named there is used)
    assert s.model_fields_set == {"log_level", "compensation_retries", "orphan_after",
                                  "approval_ttl"}
    assert Settings().orphan_after == 12.0


def test_a_bad_value_names_the_field_and_hides_the_value(
        workdir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SAGAWORKER_APPROVAL_TTL", "hunter2-not-a-number")
    with pytest.raises(ValidationError) as got:
        Settings()
    assert [e["loc"] for e in got.value.errors()] == [("approval_ttl",)]
    assert "hunter2" not in str(got.value)


def test_settings_are_frozen(workdir: Path) -> None:
    with pytest.raises(ValidationError):
        Settings().log_level = "INFO"  # type: ignore[misc]


def test_the_web_settings_read_their_own_prefix(workdir: Path) -> None:
    pytest.importorskip("flask")
    from sagaworker.web.auth import WebSettings

    assert WebSettings().tokens == "alice:" + "a" * 64



def test_a_dotenv_that_is_a_named_pipe_is_read(tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """Secret managers hand ``.env`` over as a FIFO (1Password's environments do)."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("SAGAWORKER_LOG_LEVEL", raising=False)
    fifo = tmp_path / ".env"
    os.mkfifo(fifo)

    def write() -> None:
        with contextlib.suppress(OSError):
            fifo.write_text("SAGAWORKER_LOG_LEVEL=warning\n")

    writer = threading.Thread(target=write, daemon=True)
    writer.start()
    try:
        assert Settings().log_level == "WARNING"
    finally:  # a reader that never came: let the writer's open() return
        os.close(os.open(fifo, os.O_RDONLY | os.O_NONBLOCK))
        writer.join(timeout=5)


def test_a_dotenv_that_cannot_be_read_is_named(workdir: Path) -> None:
    (workdir / ".env").write_bytes(b"SAGAWORKER_LOG_LEVEL=d\xe9bug\n")
    with pytest.raises(ConfigurationError) as got:
        Settings()
    assert str(workdir / ".env") in str(got.value) and "UTF-8" in str(got.value)


def test_pydantic_settings_options_are_refused_not_ignored(workdir: Path) -> None:
    with pytest.raises(TypeError, match=r"takes no _env_file: it reads SAGAWORKER_\*"):
        Settings(_env_file=None)  # type: ignore[call-arg]


def test_a_setting_may_be_named_in_any_case_and_defaults_are_validated(
        workdir: Path) -> None:
    s = Settings(LOG_LEVEL="warning", ORPHAN_AFTER=5)  # type: ignore[call-arg]
    assert (s.log_level, s.orphan_after) == ("WARNING", 5.0)
    # a default goes through its field's type, as a value from the environment does
    assert isinstance(Settings().approval_ttl, float)


def test_a_dotenv_value_is_read_literally(workdir: Path,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """``${VAR}`` in ``.env`` is text, never another variable of the environment: no
    variable reaches a setting (the trace URL the dashboard renders) through a line."""
    monkeypatch.setenv("SW_TEST_DATABASE_PASSWORD", "hunter2")
    (workdir / ".env").write_text(
        "SAGAWORKER_TRACE_URL=https://tempo.example/${SW_TEST_DATABASE_PASSWORD}/{trace_id}\n"
        "SAGAWORKER_REDACT=${SW_TEST_DATABASE_PASSWORD:-card}\n")
    s = Settings()
    assert s.trace_url == "https://tempo.example/${SW_TEST_DATABASE_PASSWORD}/{trace_id}"
    assert s.redact == "${SW_TEST_DATABASE_PASSWORD:-card}"


def test_a_dotenv_pipe_nobody_writes_is_named_not_waited_for(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A ``.env`` named pipe with no writer (the secret manager is not running) would hang
    every process silently: after ``DOTENV_PIPE_WAIT`` seconds a ConfigurationError names
    the file and what to do."""
    from sagaworker._base import settings as settings_module

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(settings_module, "DOTENV_PIPE_WAIT", 0.2)
    fifo = tmp_path / ".env"
    os.mkfifo(fifo)
    try:
        with pytest.raises(ConfigurationError) as got:
            Settings()
    finally:  # the reader still waiting in open(): a writer that comes and goes ends it
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
    assert str(got.value) == (
        f"{fifo} is a named pipe that no process wrote within 0.2 s: start what writes it "
        "(your secret manager's run command), or remove it and set SAGAWORKER_* in the "
        "environment")
