"""Where a setting comes from: what is passed in, then the environment (any case), then a
``.env`` file in the working directory, then the default."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from sagaworker import Settings


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

