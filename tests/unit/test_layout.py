"""The house: folders in the order a step travels, imports pointing one way (down the
floors), no import circles, type-only imports included."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from tests._ast import parse

PKG = Path(__file__).resolve().parents[2] / "sagaworker"

#: the floors, lowest first: a part imports its own floor or floors below it, never above
FLOORS: list[set[str]] = [
    {"_base"},            # errors, types, settings, canonical JSON, crypto, the registry
    {"_observe"},         # logging and redaction: every part may log
    {"_journal"},         # the store: schema, dialects, the repository, its operations
    {"_machine"},         # the lifecycle table and every move on it, with their SQL
    {"_broker"},          # what crosses the broker: messages, transports
    {"_runtime"},         # what the parts share: the journal, its machine, the bus
    {"_producer"},        # what a producer does: begin, enqueue, start, approve
    {"_worker"},          # what a worker does: run a step, advance a flow
    {"_recovery"},        # compensation, the sweeper
    {"_core"},            # the one place that assembles the parts (and wires Celery)
    {"__init__", "cli", "web", "testing", "agents", "contrib", "mcp"},  # on top: the public
    # API, the CLI, the web app, the agent adapters, the framework integrations, the MCP
    # server
]


def _part(path: Path) -> str:
    """The top-level part of sagaworker a file belongs to."""
    rel = path.relative_to(PKG)
    return rel.parts[0] if len(rel.parts) > 1 else rel.stem


def _module(path: Path) -> str:
    rel = path.relative_to(PKG).with_suffix("")
    parts = [p for p in rel.parts if p != "__init__"]
    return ".".join(["sagaworker", *parts])


def _imports() -> dict[str, set[str]]:
    """Every sagaworker module (subpackages included) and the sagaworker modules it
    imports, resolved to full dotted names."""
    graph: dict[str, set[str]] = {}
    for path in PKG.rglob("*.py"):
        if "migrations" in path.parts:
            continue
        mod = _module(path)
        package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
        deps = graph.setdefault(mod, set())
        for node in ast.walk(parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")
                    base = base[: len(base) - (node.level - 1)]
                    target = ".".join([*base, *([node.module] if node.module else [])])
                else:
                    target = node.module or ""
                if not target.startswith("sagaworker"):
                    continue
                for alias in node.names:  # a submodule, or a name from the module
                    sub = f"{target}.{alias.name}"
                    deps.add(sub if _is_module(sub) else target)
            elif isinstance(node, ast.Import):
                deps.update(a.name for a in node.names if a.name.startswith("sagaworker"))
    return graph


def _is_module(dotted: str) -> bool:
    rel = Path(*dotted.split(".")[1:])
    return (PKG / rel).with_suffix(".py").is_file() or (PKG / rel / "__init__.py").is_file()


def _floor(part: str) -> int:
    for i, floor in enumerate(FLOORS):
        if part in floor:
            return i
    raise AssertionError(f"sagaworker/{part} is on no floor: add it to FLOORS")


def _part_of(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def test_every_part_is_on_a_floor() -> None:
    """A new folder or module has to say where it sits in the way a step travels."""
    for path in PKG.rglob("*.py"):
        if "migrations" not in path.parts:
            _floor(_part(path))


def test_imports_point_down_the_floors() -> None:
    """No part imports one above it: the producer never reaches into the worker, the
    journal never into recovery, nothing below the CLI or the web app into them."""
    wrong = []
    for mod, deps in sorted(_imports().items()):
        for dep in sorted(deps):
            if _floor(_part_of(dep)) > _floor(_part_of(mod)):
                wrong.append(f"{mod} imports {dep}")
    assert wrong == []


def test_the_floor_guard_sees_subpackages() -> None:
    """The guard reads relative imports inside subpackages (a broken guard passes all)."""
    graph = _imports()
    assert "sagaworker._journal.schema" in graph["sagaworker._machine.step_moves"]
    assert "sagaworker._base.errors" in graph["sagaworker._producer.producer"]
    assert _floor(_part_of("sagaworker._recovery.sweeper")) > _floor(
        _part_of("sagaworker._worker.flows"))


def test_the_lifecycle_stands_on_the_store() -> None:
    """``_machine`` (the lifecycle table, every move and their SQL) imports the store
    (``_journal``), never the reverse: the store has no move of its own to reach for, and
    the runtime, which makes both, stands above them."""
    assert _floor("_journal") < _floor("_machine") < _floor("_runtime")
    graph = _imports()
    up = [f"{m} imports {d}" for m, deps in sorted(graph.items()) if _part_of(m) == "_journal"
          for d in sorted(deps) if _part_of(d) in ("_machine", "_runtime")]
    assert up == []
    assert "sagaworker._journal.pgconn" in graph["sagaworker._machine.pgfast"]


def test_no_import_circles() -> None:
    """Each part is handed what it uses; no module reaches back to an owner that imports it
    (``TYPE_CHECKING`` imports count too)."""
    imports = _imports()  # (parsed once: every module's imports)
    graph = {m: {d for d in deps if d in imports} for m, deps in imports.items()}
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


@pytest.mark.parametrize(("limit", "what"), [(400, "module"), (270, "class"),
                                           (60, "function")])
def test_small_rooms(limit: int, what: str) -> None:
    """No module of the library over ~400 lines, no class over ~250, no function over
    ~60 (docs/design.md)."""
    big = []
    for p in PKG.rglob("*.py"):
        if "migrations" in p.parts:
            continue
        text = p.read_text()
        if what == "module":
            n = len(text.splitlines())
            big += [f"{p.relative_to(PKG)}: {n}"] if n > limit else []
            continue
        kind = ast.ClassDef if what == "class" else (ast.FunctionDef, ast.AsyncFunctionDef)
        for node in ast.walk(parse(text)):
            if isinstance(node, kind):
                n = (node.end_lineno or node.lineno) - node.lineno + 1
                if n > limit:
                    big.append(f"{p.relative_to(PKG)}:{node.name}: {n}")
    assert big == []


def test_the_lifecycle_lives_in_one_table() -> None:
    """The table names each move once, every move goes between states its own machine
    has, and every state but the start is reached by some move and left by some move
    unless it is terminal."""
    from sagaworker import OutcomeResult, Phase, SagaStatus
    from sagaworker._machine import lifecycle as lc

    states = {
        "saga": {lc.NEW, "FAILING", *SagaStatus.__members__},
        "step": {lc.NEW, lc.ATTEMPT_RUNNING, *Phase.__members__},
        "undo": {lc.UNDO_NONE, lc.UNDO_TRYING, *OutcomeResult.__members__},
    }
    terminal = {SagaStatus.COMPLETED.value, SagaStatus.COMPENSATED.value, Phase.EXECUTED.value,
                Phase.FAILED.value, Phase.REJECTED.value, Phase.CANCELLED.value,
                OutcomeResult.COMPENSATED.value, OutcomeResult.SKIPPED.value}
    names = [(m.machine, m.name) for m in lc.MOVES]
    assert len(names) == len(set(names))
    for m in lc.MOVES:
        assert {*m.sources, m.target} <= states[m.machine], f"{m.machine}.{m.name}"
    for machine, known in states.items():
        moves = [m for m in lc.MOVES if m.machine == machine]
        reached = {m.target for m in moves}
        left = {s for m in moves for s in m.sources}
        assert known - {lc.NEW} - reached == set(), f"{machine}: states no move reaches"
        assert known - terminal - left == set(), f"{machine}: states no move leaves"


def test_reliability_doc_draws_the_table() -> None:
    """docs/reliability.md shows the diagrams the lifecycle table draws, as they are now."""
    from sagaworker._machine.lifecycle import mermaid

    doc = (PKG.parent / "docs" / "reliability.md").read_text()
    for machine in ("saga", "step", "undo"):
        assert f"```mermaid\n{mermaid(machine)}\n```" in doc, f"regenerate the {machine} diagram"


def test_design_doc_lists_every_move_with_its_guard() -> None:
    """docs/design.md's table of moves is the lifecycle table as it is now."""
    from sagaworker._machine.lifecycle import MOVES

    doc = (PKG.parent / "docs" / "design.md").read_text()
    for m in MOVES:
        row = (f"| {m.machine} | `{m.name}` | {', '.join(m.sources)} → {m.target} | "
               f"{m.guard} | {m.emits} |")
        assert row in doc, f"docs/design.md: the row of {m.machine}.{m.name} is out of date"


def test_no_code_points_to_a_tracker_or_spec_section() -> None:
    """Comments point to docs/ in the repository, never to "SPEC n" or "issue n" (the
    package, its tests, the benchmarks, the docs and the README; the CHANGELOG keeps
    history)."""
    import re

    pattern = re.compile(r"\b(SPEC|issue)\s+(§\s*)?\d+", re.IGNORECASE)
    root = PKG.parent
    files = [*PKG.rglob("*.py"), *(root / "docs").rglob("*.md"), *(root / "tests").rglob("*.py"),
             *(root / "bench").rglob("*.py"), root / "README.md"]
    hits = [f"{p.relative_to(root)}:{i}" for p in files
            for i, line in enumerate(p.read_text().splitlines(), 1) if pattern.search(line)]
    assert hits == []


def _performers() -> dict[tuple[str, str], list[str]]:
    """Every move, and the functions that declare they perform it (``@performs``)."""
    import importlib

    found: dict[tuple[str, str], list[str]] = {}
    for path in (PKG / "_machine").glob("*.py"):
        mod = importlib.import_module(_module(path))
        for obj in vars(mod).values():
            members = vars(obj).items() if isinstance(obj, type) else [("", obj)]
            for name, fn in members:
                for m in getattr(fn, "__moves__", ()):
                    where = f"{mod.__name__}.{getattr(obj, '__name__', '')}.{name}"
                    if where not in found.setdefault(m, []):
                        found[m].append(where)
    return found


def test_every_move_of_the_table_is_performed_by_a_named_function() -> None:
    """Each row of the lifecycle table has the function that performs it, and no function
    names a move the table does not have (``performs`` raises at import for those)."""
    from sagaworker._machine.lifecycle import MOVES

    performed = _performers()
    missing = [f"{m.machine}.{m.name}" for m in MOVES if (m.machine, m.name) not in performed]
    assert missing == []
    assert set(performed) <= {(m.machine, m.name) for m in MOVES}


def test_design_doc_names_the_file_of_every_move() -> None:
    """docs/design.md's table names, for each move, the file of ``sagaworker/_machine``
    whose function performs it: a newcomer finds the code of any row."""
    import importlib

    from sagaworker._machine.lifecycle import MOVES

    performed_in: dict[tuple[str, str], set[str]] = {}
    for path in (PKG / "_machine").glob("*.py"):
        for obj in vars(importlib.import_module(_module(path))).values():
            for fn in vars(obj).values() if isinstance(obj, type) else [obj]:
                for m in getattr(fn, "__moves__", ()):  # (the module that defines it)
                    performed_in.setdefault(m, set()).add(fn.__module__.rpartition(".")[2])
    doc = (PKG.parent / "docs" / "design.md").read_text().splitlines()
    wrong = []
    for m in MOVES:
        row = next((line for line in doc if line.startswith(f"| {m.machine} | `{m.name}` |")),
                   "")
        named = row.rstrip(" |").rpartition("|")[2]
        files = performed_in.get((m.machine, m.name), set())
        if not files or any(f"`{f}`" not in named for f in files):
            wrong.append(f"{m.machine}.{m.name}: performed in {sorted(files)}")
    assert wrong == []


_WRITES = {"set_entry", "touch", "values"}


def _writes_state(call: ast.Call) -> bool:
    name = call.func.attr if isinstance(call.func, ast.Attribute) else getattr(
        call.func, "id", "")
    return name in _WRITES and any(k.arg in ("status", "phase") for k in call.keywords)


def _performs(fn: ast.AST) -> bool:
    return any(isinstance(d, ast.Call) and getattr(d.func, "id", "") == "performs"
               for d in getattr(fn, "decorator_list", []))


def test_a_status_or_phase_is_written_only_by_a_move() -> None:
    """Outside the functions marked ``@performs``, no code of the package writes a saga's
    status or an entry's phase (``set_entry``/``touch``/``.values(...)`` with one, or a
    ``values["status"]`` item)."""
    wrong = []

    def visit(node: ast.AST, inside: bool, where: str) -> None:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            inside = inside or _performs(node)
            where = f"{where}.{node.name}"
        writes = (isinstance(node, ast.Call) and _writes_state(node)) or (
            isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Store)
            and isinstance(node.slice, ast.Constant) and node.slice.value in ("status",
                                                                                "phase"))
        if writes and not inside:
            wrong.append(f"{where}:{getattr(node, 'lineno', '?')}")
        for child in ast.iter_child_nodes(node):
            visit(child, inside, where)

    for path in PKG.rglob("*.py"):
        if "migrations" not in path.parts:
            visit(parse(path.read_text()), False, str(path.relative_to(PKG)))
    assert wrong == []


def test_every_move_is_performed_in_the_machine() -> None:
    """No function outside ``sagaworker/_machine`` is marked ``@performs``: the store and
    every part above it reach a move through the machine, never perform one."""
    wrong = [f"{path.relative_to(PKG)}:{node.name}" for path in PKG.rglob("*.py")
             if "migrations" not in path.parts and _part(path) != "_machine"
             for node in ast.walk(parse(path.read_text())) if _performs(node)]
    assert wrong == []


#: a statement that writes a row (``UPDATE t SET``, ``INSERT INTO t (``) naming a status or
#: a phase: the SQL of a move
_WRITE_SQL = re.compile(r"\b(?:UPDATE\s+\S+\s+(?:AS\s+\w+\s+)?SET|INSERT\s+INTO\s+\S+\s*\()")
_STATE_COLUMN = re.compile(r"\b(?:status|phase)\b")


def _sql_of_moves(path: Path) -> list[int]:
    """The lines of ``path``'s strings (f-strings whole) that are a move's SQL."""
    found = []
    for node in ast.walk(parse(path.read_text())):
        if isinstance(node, ast.JoinedStr):
            text = "".join(v.value if isinstance(v, ast.Constant) else
                           "{" + ast.unparse(v.value) + "}" for v in node.values)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            text = node.value
        else:
            continue
        if _WRITE_SQL.search(text) and _STATE_COLUMN.search(text):
            found.append(node.lineno)
    return found


def test_no_sql_of_a_move_outside_the_machine() -> None:
    """The moves' own SQL (the one-round-trip statements) stands in ``_machine`` too: no
    string elsewhere in the package writes a saga's status or an entry's phase (the
    migrations aside: they are the schema's history)."""
    wrong = [f"{path.relative_to(PKG)}:{line}" for path in PKG.rglob("*.py")
             if "migrations" not in path.parts and _part(path) != "_machine"
             for line in _sql_of_moves(path)]
    assert wrong == []
    assert _sql_of_moves(PKG / "_machine" / "pgfast.py"), "the guard sees no SQL at all"


def test_no_host_clock_is_written_to_the_journal() -> None:
    """Every stamp the journal holds is the database's clock (``db_now``/``db_later``):
    no code of the journal's moves, the repository, retention or the sweeper calls the
    host's ``now()`` / ``datetime.now()`` outside ``repository.now`` itself (which is
    for people to read)."""
    wrong = []
    for path in [*(PKG / "_journal").glob("*.py"), *(PKG / "_machine").glob("*.py"),
                 *(PKG / "_recovery").glob("*.py")]:
        tree = parse(path.read_text())
        allowed = {id(n) for f in ast.walk(tree)
                   if isinstance(f, ast.FunctionDef) and f.name == "now" for n in ast.walk(f)}
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and id(node) not in allowed and (
                    getattr(node.func, "id", None) or getattr(node.func, "attr", None)) in (
                    "now", "utcnow", "time"):
                wrong.append(f"{path.relative_to(PKG)}:{node.lineno}")
    assert wrong == []


def test_the_revisions_read_from_the_migration_files_are_alembics() -> None:
    """The worker's schema check reads the revisions without Alembic: the same history."""
    from alembic.script import ScriptDirectory

    from sagaworker._journal.migrate import alembic_config
    from sagaworker._journal.readiness import _revisions

    script = ScriptDirectory.from_config(alembic_config("sqlite://"))
    assert _revisions() == (script.get_current_head(),
                            [r.revision for r in script.walk_revisions()][::-1])


def test_without_migration_sources_the_revisions_come_from_alembic_or_a_clear_error(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """An install without the migrations' .py files (compiled only) neither crashes the
    schema check with an IndexError nor guesses: Alembic's view, or a ConfigurationError
    that says to reinstall."""
    from sagaworker import ConfigurationError
    from sagaworker._journal import readiness

    real = readiness._revisions()
    readiness._revisions.cache_clear()
    empty = tmp_path / "_journal"
    (empty / "migrations" / "versions").mkdir(parents=True)
    monkeypatch.setattr(readiness, "__file__", str(empty / "readiness.py"))
    assert readiness._revisions() == real  # Alembic reads the installed package
    readiness._revisions.cache_clear()
    from alembic.script import ScriptDirectory

    monkeypatch.setattr(ScriptDirectory, "get_current_head", lambda self: None)
    with pytest.raises(ConfigurationError, match="reinstall sagaworker"):
        readiness._revisions()
    monkeypatch.undo()
    readiness._revisions.cache_clear()
