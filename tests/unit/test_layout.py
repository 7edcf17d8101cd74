"""The house: no import circles inside the package, type-only imports included."""

from __future__ import annotations

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parents[2] / "sagaworker"


def _imports() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for path in PKG.glob("*.py"):
        mod = path.stem
        deps = graph.setdefault(mod, set())
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level == 1:
                if node.module:
                    deps.add(node.module.split(".")[0])
                else:  # from . import x
                    deps.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith(
                    "sagaworker."):
                deps.add(node.module.split(".")[1])  # type: ignore[union-attr]
    return graph


def test_no_import_circles() -> None:
    """Each part is handed what it uses; no module reaches back to an owner that imports it
    (``TYPE_CHECKING`` imports count too)."""
    graph = _imports()
    path: list[str] = []
    done: set[str] = set()

    def visit(mod: str) -> None:
        if mod in path:
            raise AssertionError("import circle: " + " -> ".join([*path[path.index(mod):], mod]))
        if mod in done or mod not in graph:
            return
        path.append(mod)
        for dep in sorted(graph[mod]):
            visit(dep)
        path.pop()
        done.add(mod)

    for mod in sorted(graph):
        visit(mod)


def test_the_lifecycle_lives_in_one_table() -> None:
    """Only the state machine's modules name the moves; the table lists each move once."""
    from sagaworker._lifecycle import MOVES

    names = [(m.machine, m.name) for m in MOVES]
    assert len(names) == len(set(names))


def test_reliability_doc_draws_the_table() -> None:
    """docs/reliability.md shows the diagrams the lifecycle table draws, as they are now."""
    from sagaworker._lifecycle import mermaid

    doc = (PKG.parent / "docs" / "reliability.md").read_text()
    for machine in ("saga", "step", "undo"):
        assert f"```mermaid\n{mermaid(machine)}\n```" in doc, f"regenerate the {machine} diagram"
