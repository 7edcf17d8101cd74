"""``ast.parse`` for the tests that read the library's source.

CPython 3.11's AST constructor keeps its recursion depth in state that another thread
parsing at the same moment (a traceback's carets are found with ``ast.parse`` there) can
leave off by some levels: ``SystemError: AST constructor recursion depth mismatch``
(python/cpython#106905, fixed in 3.12). A full run hit it once in a layout test while the
suite's background threads logged. Parsing is pure, so it is simply done again."""

from __future__ import annotations

import ast


def parse(source: str) -> ast.Module:
    for _ in range(5):
        try:
            return ast.parse(source)
        except SystemError as exc:
            if "recursion depth mismatch" not in str(exc):
                raise
    return ast.parse(source)
