"""The tools an MCP client is shown, and the arguments it sends checked against them.

Each ``@sw.tool`` is listed under its function's name (as the agent adapters name it),
with its docstring as description and the input schema the MCP SDK builds from the
function's signature (``func_metadata``, what the SDK's own ``MCPServer`` lists), plus the
required ``saga_id`` naming the saga the call is a step of. Its annotations say the truth
about the step: never read-only, destructive only when IRREVERSIBLE (no undo, behind a
signed approval), idempotent as declared; ``_meta["dev.sagaworker/step"]`` names its
reversibility, its undo and whether it waits at a gate.

The saga tools (``saga_begin``, ``saga_status``, ``saga_commit``, ``saga_abort``) are
listed beside them. No tool approves or rejects a gate.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import mcp_types as types
from mcp.server.mcpserver.exceptions import InvalidSignature
from mcp.server.mcpserver.utilities.func_metadata import FuncMetadata, func_metadata
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from .._base.errors import BadInput, ConfigurationError
from .._base.registry import ToolSpec
from .._base.types import Reversibility
from ..agents._core import split_arguments

__all__ = ["SAGA_ID", "STEP_META", "Abort", "Begin", "Catalogue", "McpTool", "SagaRef",
           "refusal_text"]

#: the argument every app tool takes beside its own: the saga the call is a step of
SAGA_ID = "saga_id"
#: the ``_meta`` key of a listed tool that describes its step
STEP_META = "dev.sagaworker/step"
_SAGA_ID_SCHEMA = {"type": "string", "description": (
    "the saga this call is a step of: the saga_id saga_begin returned. If a later step "
    "fails, this step is undone with the others")}


def refusal_text(exc: ValidationError) -> str:
    """A pydantic refusal as one line a model can correct from (never the values sent)."""
    parts = []
    for err in exc.errors(include_url=False, include_input=False):
        where = ".".join(str(p) for p in err["loc"]) or "arguments"
        parts.append(f"{where}: {err['msg']}")
    return "; ".join(parts)


@dataclass(frozen=True)
class McpTool:
    """One ``@sw.tool`` as an MCP client sees it."""

    spec: ToolSpec
    meta: FuncMetadata = field(repr=False)

    @classmethod
    def of(cls, spec: ToolSpec) -> McpTool:
        name = spec.fn.__name__
        if SAGA_ID in inspect.signature(spec.fn).parameters:
            raise ConfigurationError(
                f"tool {spec.name!r} has a parameter named {SAGA_ID!r}, the argument the MCP "
                "server adds to every tool (the saga of the call): rename the parameter")
        try:
            meta = func_metadata(spec.fn, structured_output=False)
        except (InvalidSignature, TypeError, ValueError) as exc:
            raise ConfigurationError(f"tool {spec.name!r} cannot be served over MCP: no JSON "
                                     f"schema of its arguments ({exc})") from exc
        if name in _SAGA_TOOLS:
            raise ConfigurationError(f"tool {spec.name!r} is named like the MCP server's "
                                     f"saga tool {name!r}: rename it, or leave it out "
                                     "(--tool NAME lists the tools to serve)")
        return cls(spec, meta)

    @property
    def name(self) -> str:
        """The name the model calls it by: the function's name (as the agent adapters)."""
        return self.spec.fn.__name__

    def definition(self) -> types.Tool:
        schema = self.meta.arg_model.model_json_schema(by_alias=True)
        schema["properties"] = {SAGA_ID: dict(_SAGA_ID_SCHEMA), **schema.get("properties", {})}
        schema["required"] = [SAGA_ID, *schema.get("required", [])]
        schema.pop("title", None)
        rev = self.spec.effective_reversibility
        return types.Tool(
            name=self.name, description=(self.spec.fn.__doc__ or "").strip() or None,
            input_schema=schema,
            annotations=types.ToolAnnotations(
                read_only_hint=False,
                destructive_hint=rev is Reversibility.IRREVERSIBLE,
                idempotent_hint=self.spec.idempotent),
            _meta={STEP_META: {"reversibility": None if rev is None else rev.value,
                               "undo": self.spec.compensable_by,
                               "gated": self.spec.gated}})

    def arguments(self, given: dict[str, Any]) -> tuple[list[Any], dict[str, Any]]:
        """The model's arguments (``saga_id`` taken out) as the tool's call: positional
        parameters in order, as ``saga.enqueue`` journals them. ``BadInput`` when they do
        not fit the schema (unknown names included): nothing is journaled."""
        fields = self.meta.arg_model.model_fields
        unknown = sorted(set(given) - set(fields)
                         - {f.alias for f in fields.values() if f.alias})
        if unknown:
            raise BadInput(f"{self.name} takes no argument {', '.join(unknown)}; it takes "
                           f"{', '.join([SAGA_ID, *fields]) }")
        try:
            validated = self.meta.validate_arguments(given)
        except ValidationError as exc:
            raise BadInput(f"arguments of {self.name} do not fit its schema: "
                           f"{refusal_text(exc)}") from None
        plain = {k: v.model_dump(mode="python") if isinstance(v, BaseModel) else v
                 for k, v in validated.items()}
        return split_arguments(self.spec.fn, plain)


class SagaRef(BaseModel):
    """``saga_status``/``saga_commit``: the saga named."""

    model_config = ConfigDict(extra="forbid")
    saga_id: str = Field(min_length=1, max_length=200, description="the saga's id, as "
                         "saga_begin returned it")


class Begin(BaseModel):
    """``saga_begin``'s arguments."""

    model_config = ConfigDict(extra="forbid")
    purpose: str = Field(default="", max_length=2000, description=(
        "what the saga is for, in a sentence (kept with it for the operators)"))
    deadline_s: int | None = Field(default=None, gt=0, le=10 * 365 * 86400, description=(
        "seconds after which an unfinished saga is undone; none: open until committed or "
        "aborted"))


class Abort(SagaRef):
    """``saga_abort``'s arguments."""

    reason: str = Field(min_length=1, max_length=2000, description="why it is abandoned")


def _saga_tool(name: str, model: type[BaseModel], description: str, *, read_only: bool,
               destructive: bool, idempotent: bool) -> types.Tool:
    schema = model.model_json_schema(by_alias=True)
    schema.pop("title", None)
    schema.pop("description", None)
    return types.Tool(name=name, description=description, input_schema=schema,
                      annotations=types.ToolAnnotations(read_only_hint=read_only,
                                                        destructive_hint=destructive,
                                                        idempotent_hint=idempotent))


_SAGA_TOOLS: dict[str, tuple[type[BaseModel], str, dict[str, bool]]] = {
    "saga_begin": (Begin, (
        "Begin a saga: a group of tool calls that succeed together or are undone together. "
        "Returns its saga_id; pass it to every tool call of the task. Commit it with "
        "saga_commit once the task is done, or abandon it with saga_abort."),
        {"read_only": False, "destructive": False, "idempotent": False}),
    "saga_status": (SagaRef, (
        "The saga's status and each step's phase and result (or error), and what was undone "
        "if it failed. Read-only: use it to learn the outcome of a step that was still "
        "RUNNING or PENDING_APPROVAL."),
        {"read_only": True, "destructive": False, "idempotent": True}),
    "saga_commit": (SagaRef, (
        "Finish the saga once every step has run: its effects stand. Refused while a step "
        "is running or waits for an operator's approval."),
        {"read_only": False, "destructive": False, "idempotent": True}),
    "saga_abort": (Abort, (
        "Abandon the saga: every step that ran is undone, latest first (irreversible steps "
        "cannot be). Steps not yet run never run."),
        {"read_only": False, "destructive": True, "idempotent": False}),
}


class Catalogue:
    """The tools one server lists, by the name the model calls them."""

    def __init__(self, specs: Iterable[ToolSpec]) -> None:
        self.tools: dict[str, McpTool] = {}
        for spec in specs:
            tool = McpTool.of(spec)
            other = self.tools.get(tool.name)
            if other is not None:
                raise ConfigurationError(
                    f"two tools are named {tool.name!r} ({other.spec.name} and {spec.name}); "
                    "a model calls tools by name: serve one of them (--tool NAME)")
            self.tools[tool.name] = tool
        self.by_task = {t.spec.name: t.name for t in self.tools.values()}
        self.saga_tools = {name: _saga_tool(name, model, text, **hints)
                           for name, (model, text, hints) in _SAGA_TOOLS.items()}

    @classmethod
    def of(cls, registry_tools: dict[str, ToolSpec], names: Sequence[str] = ()) -> Catalogue:
        """Every tool of the registry, or those ``names`` names (the function's name or the
        task's registered name); ``ConfigurationError`` for a name no tool has."""
        if not names:
            return cls(registry_tools.values())
        chosen: list[ToolSpec] = []
        for name in names:
            spec = registry_tools.get(name) or next(
                (s for s in registry_tools.values() if s.fn.__name__ == name), None)
            if spec is None:
                known = ", ".join(sorted(s.fn.__name__ for s in registry_tools.values()))
                raise ConfigurationError(f"--tool {name}: the app has no such tool (it has "
                                         f"{known or 'none'})")
            if spec not in chosen:
                chosen.append(spec)
        return cls(chosen)

    def definitions(self) -> list[types.Tool]:
        return [*self.saga_tools.values(), *(t.definition() for t in self.tools.values())]

    def label(self, task_name: str) -> str:
        """A journaled step's tool as the model knows it."""
        return self.by_task.get(task_name) or task_name.rsplit(".", 1)[-1]
