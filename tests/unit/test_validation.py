"""Validation fails on boot, not during a refund."""

from __future__ import annotations

from pathlib import Path

import pytest
from celery import Celery

from sagaworker import (
    CompensationContext,
    ConfigurationError,
    FlowContext,
    Reversibility,
    Sagaworker,
)

ROOT = Path(__file__).resolve().parents[2]


def make(tmp_path: Path) -> Sagaworker:
    return Sagaworker(Celery("v", broker="memory://"),
                      database_url=f"sqlite:///{tmp_path / 'v.db'}")


def test_unknown_undo_name_says_did_you_mean(tmp_path: Path) -> None:
    """compensable_by naming no compensation raises with the tool, module and a suggestion."""
    sw = make(tmp_path)

    @sw.tool(compensable_by="relase_inventory")
    def reserve_inventory(sku: str) -> str:
        return sku

    @sw.compensation
    def release_inventory(ctx: CompensationContext) -> None:
        pass

    with pytest.raises(ConfigurationError) as err:
        sw.validate()
    msg = str(err.value)
    assert "reserve_inventory" in msg and __name__ in msg
    assert "did you mean 'release_inventory'" in msg


def test_undo_in_another_module_does_not_count(tmp_path: Path) -> None:
    """The undo binds by function name in the tool's own module only."""
    sw = make(tmp_path)

    def undo() -> None:
        pass

    undo.__module__ = "somewhere.else"
    sw.compensation(undo)

    @sw.tool(compensable_by="undo")
    def t() -> None:
        pass

    with pytest.raises(ConfigurationError, match="names no compensation"):
        sw.validate()


def test_bad_undo_signature(tmp_path: Path) -> None:
    """An undo must take no arguments or exactly one CompensationContext."""
    sw = make(tmp_path)

    @sw.tool(compensable_by="two_args")
    def t() -> None:
        pass

    @sw.compensation
    def two_args(a: object, b: object) -> None:
        pass

    with pytest.raises(ConfigurationError, match="exactly one CompensationContext"):
        sw.validate()


def test_reversible_without_undo(tmp_path: Path) -> None:
    """REVERSIBLE or COMPENSATABLE with no undo is refused."""
    sw = make(tmp_path)

    @sw.tool(reversibility=Reversibility.COMPENSATABLE)
    def t() -> None:
        pass

    with pytest.raises(ConfigurationError, match="COMPENSATABLE but names no undo"):
        sw.validate()


def test_irreversible_with_undo(tmp_path: Path) -> None:
    """IRREVERSIBLE with an undo is refused."""
    sw = make(tmp_path)

    @sw.tool(reversibility=Reversibility.IRREVERSIBLE, compensable_by="u")
    def t() -> None:
        pass

    @sw.compensation
    def u() -> None:
        pass

    with pytest.raises(ConfigurationError, match="IRREVERSIBLE"):
        sw.validate()


def test_valid_declarations_pass_and_default_is_compensatable(tmp_path: Path) -> None:
    """compensable_by without reversibility means COMPENSATABLE; a bare tool needs no undo."""
    sw = make(tmp_path)

    @sw.tool(compensable_by="u")
    def t() -> None:
        pass

    @sw.compensation
    def u() -> None:
        pass

    @sw.tool()
    def lookup() -> int:
        return 1

    sw.validate()
    assert sw.registry.tool(t.name).effective_reversibility is Reversibility.COMPENSATABLE
    assert sw.registry.tool(lookup.name).effective_reversibility is None


def test_producer_validates_before_the_first_saga(tmp_path: Path) -> None:
    """sw.begin() validates first: no saga starts with an undo that cannot run."""
    sw = make(tmp_path)

    @sw.tool(compensable_by="missing")
    def t() -> None:
        pass

    with pytest.raises(ConfigurationError):
        sw.begin("s-1")
    assert sw.sagas() == []


def test_metadata_and_flow_arguments_keep_the_size_limit(tmp_path: Path) -> None:
    """A saga's metadata and a flow's arguments are journaled and carried like a step's
    arguments: over SAGAWORKER_MAX_ARGS_BYTES they are refused, naming the setting, and
    nothing is journaled."""
    from sagaworker import BadInput, Settings

    sw = Sagaworker(Celery("v", broker="memory://"), settings=Settings(
        database_url=f"sqlite:///{tmp_path / 'v.db'}", broker_url="memory://",
        max_args_bytes=1000))
    sw.flow()(big_flow)
    blob = "x" * 2000
    with pytest.raises(BadInput, match=r"the saga's metadata are .* \(SAGAWORKER_MAX_ARGS_BYTES"):
        sw.begin("m-1", metadata={"blob": blob})
    with pytest.raises(BadInput, match="SAGAWORKER_MAX_ARGS_BYTES"):
        sw.start("m-2", big_flow, blob)
    with pytest.raises(BadInput, match="SAGAWORKER_MAX_ARGS_BYTES"):
        sw.start("m-3", big_flow, "small", metadata={"blob": blob})
    assert [r.saga_id for r in sw.sagas()] == []


def big_flow(s: object, data: str) -> str:
    return data


def test_tool_and_flow_decorate_without_parentheses(sqlite_sw: Sagaworker) -> None:
    """``@sw.tool`` and ``@sw.flow`` work bare, as Celery's ``@app.task`` does: a journaled
    task and a registered flow, the same as with parentheses."""
    from celery import Task

    @sqlite_sw.tool
    def lookup(sku: str) -> str:
        return sku

    assert sqlite_sw.flow(bare_flow) is bare_flow
    assert isinstance(lookup, Task)
    assert sqlite_sw.registry.tool(lookup.name) is not None
    assert sqlite_sw.flows.spec_of(bare_flow).fn is bare_flow
    sqlite_sw.validate()


def bare_flow(s: FlowContext, sku: str) -> str:
    """A module-level flow (``test_tool_and_flow_decorate_without_parentheses``)."""
    return str(s.call("tests.unit.test_validation.lookup", sku))
