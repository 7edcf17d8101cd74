"""Declared tools and their undos, and the boot-time validation of the pairing."""

from __future__ import annotations

import difflib
import inspect
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from .errors import ConfigurationError
from .types import Reversibility

__all__ = ["Registry", "ToolSpec", "UndoSpec"]


@dataclass
class ToolSpec:
    name: str
    fn: Callable[..., Any]
    module: str
    compensable_by: str | None
    reversibility: Reversibility | None
    idempotent: bool
    queue: str | None
    task: Any = None  # the Celery task, set once registered
    signature: inspect.Signature | None = None

    @property
    def effective_reversibility(self) -> Reversibility | None:
        if self.reversibility is not None:
            return self.reversibility
        return Reversibility.COMPENSATABLE if self.compensable_by else None

    @property
    def gated(self) -> bool:
        return self.effective_reversibility is Reversibility.IRREVERSIBLE


@dataclass
class UndoSpec:
    fn: Callable[..., Any]
    module: str
    name: str
    takes_context: bool = False


@dataclass
class Registry:
    tools: dict[str, ToolSpec] = field(default_factory=dict)
    undos: dict[tuple[str, str], UndoSpec] = field(default_factory=dict)
    validated: bool = False

    def add_tool(self, spec: ToolSpec) -> None:
        if spec.name in self.tools and self.tools[spec.name].fn is not spec.fn:
            raise ConfigurationError(
                f"two tools are named {spec.name!r}; pass name=... to one of them")
        self.tools[spec.name] = spec
        self.validated = False

    def add_undo(self, fn: Callable[..., Any]) -> UndoSpec:
        spec = UndoSpec(fn=fn, module=fn.__module__, name=fn.__name__)
        self.undos[(spec.module, spec.name)] = spec
        self.validated = False
        return spec

    def tool(self, name: str) -> ToolSpec | None:
        return self.tools.get(name)

    def undo_for(self, tool: ToolSpec) -> UndoSpec | None:
        if tool.compensable_by is None:
            return None
        return self.undos.get((tool.module, tool.compensable_by))

    def validate(self) -> None:
        """Raise ConfigurationError naming the first tool whose undo cannot work."""
        for tool in self.tools.values():
            self._validate_tool(tool)
        self.validated = True

    def _validate_tool(self, tool: ToolSpec) -> None:
        rev = tool.effective_reversibility
        where = f"tool {tool.name!r}"
        if rev is Reversibility.IRREVERSIBLE and tool.compensable_by:
            raise ConfigurationError(
                f"{where} is IRREVERSIBLE but declares compensable_by="
                f"{tool.compensable_by!r}; an irreversible effect has no undo: drop "
                "compensable_by, or declare it COMPENSATABLE")
        reversible = rev in (Reversibility.REVERSIBLE, Reversibility.COMPENSATABLE)
        if rev is not None and reversible and not tool.compensable_by:
            raise ConfigurationError(
                f"{where} is {rev.value} but names no undo; add compensable_by='<function>' "
                "naming an @sw.compensation function in the same module")
        if tool.compensable_by is None:
            return
        undo = self.undo_for(tool)
        if undo is None:
            known = [n for (m, n) in self.undos if m == tool.module]
            hint = difflib.get_close_matches(tool.compensable_by, known, n=1)
            did = f"; did you mean {hint[0]!r}?" if hint else (
                f"; decorate the undo with @sw.compensation in module {tool.module}")
            raise ConfigurationError(
                f"compensable_by={tool.compensable_by!r} on {where} names no compensation "
                f"in module {tool.module!r}{did}")
        undo.takes_context = _undo_arity(undo, tool)


def _undo_arity(undo: UndoSpec, tool: ToolSpec) -> bool:
    """True when the undo takes one CompensationContext, False when it takes nothing."""
    sig = inspect.signature(undo.fn)
    required = [p for p in sig.parameters.values()
                if p.default is inspect.Parameter.empty
                and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    if not required:
        return False
    if len(required) == 1 and required[0].kind in (
        inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD
    ):
        return True
    raise ConfigurationError(
        f"compensation {undo.name!r} (undo of tool {tool.name!r}) has signature "
        f"{undo.name}{sig}; an undo takes no arguments or exactly one CompensationContext, "
        f"e.g. def {undo.name}(ctx: CompensationContext) -> None")
