"""Django is an extra: only ``sagaworker.contrib.django`` imports it, and importing that
module without Django says which extra to install."""

from __future__ import annotations

import ast
import importlib
import sys
from pathlib import Path

import pytest

from sagaworker import ConfigurationError
from tests._ast import parse

PKG = Path(__file__).resolve().parents[2] / "sagaworker"


def test_only_the_django_module_imports_django() -> None:
    """No other module of the library imports Django (nothing is imported without the
    extra)."""
    found = []
    for path in sorted(PKG.rglob("*.py")):
        for node in ast.walk(parse(path.read_text())):
            names = ([node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level
                     else [a.name for a in node.names] if isinstance(node, ast.Import) else [])
            if any(n == "django" or n.startswith("django.") for n in names):
                found.append(str(path.relative_to(PKG)))
    assert sorted(set(found)) == ["contrib/django.py"]


def test_without_django_the_import_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    """Django not installed: ConfigurationError naming ``sagaworker[django]``."""
    for name in [n for n in sys.modules if n == "django" or n.startswith("django.")
                 or n == "sagaworker.contrib.django"]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "django", None)  # import django: ImportError
    with pytest.raises(ConfigurationError, match=r"pip install 'sagaworker\[django\]'"):
        importlib.import_module("sagaworker.contrib.django")
