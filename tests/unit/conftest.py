"""tests/unit runs no process: a test that needs a worker, a CLI run or any other
process belongs in tests/integration (where services and processes are expected)."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from typing import Any

import pytest


@pytest.fixture(autouse=True)
def no_processes(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    def refuse(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("a unit test started a process; move it to tests/integration")

    monkeypatch.setattr(subprocess.Popen, "__init__", refuse)
    yield
