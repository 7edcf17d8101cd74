"""The ``sagaworker`` command line: ``commands`` holds the commands, ``render`` the tables,
``demo`` the example run on the embedded defaults."""

from __future__ import annotations

from .commands import main

__all__ = ["main"]
