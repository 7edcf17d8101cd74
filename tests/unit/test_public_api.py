"""The example uses sagaworker's public API only; everything public is in ``__all__``."""

from __future__ import annotations

import ast
from pathlib import Path

import sagaworker
from tests._ast import parse

ROOT = Path(__file__).resolve().parents[2]


def test_all_is_sorted_and_importable() -> None:
    assert list(sagaworker.__all__) == sorted(sagaworker.__all__)
    for name in sagaworker.__all__:
        assert getattr(sagaworker, name) is not None


def test_the_example_imports_no_private_module() -> None:
    """tasks/ and config/ are what users copy: they never reach into sagaworker._anything
    (the library's own web app and CLI may; they are the library)."""
    for path in sorted([*(ROOT / "tasks").glob("*.py"), *(ROOT / "config").glob("*.py")]):
        for node in ast.walk(parse(path.read_text())):
            names = ([node.module or ""] if isinstance(node, ast.ImportFrom)
                     else [a.name for a in node.names] if isinstance(node, ast.Import) else [])
            for name in names:
                assert not name.startswith("sagaworker._"), f"{path.name} imports {name}"


def test_make_engine_is_public(tmp_path: Path) -> None:
    """The engine the journal would use, for an app's own tables (the example's store)."""
    engine = sagaworker.make_engine(f"sqlite:///{tmp_path / 'x.db'}")
    try:
        with engine.begin() as conn:
            assert conn.exec_driver_sql("SELECT 1").scalar() == 1
    finally:
        engine.dispose()
