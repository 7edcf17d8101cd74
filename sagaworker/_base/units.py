"""Durable units: work a flow runs inline, in the worker that replays it, and journals.

An agent framework's model request (or a function tool that is not an ``@sw.tool``) is a
closure of the replay's own process: no other worker could run it from a message. The
replay journals it as a step named ``unit:<name>`` (INTENT, claimed by the replaying
worker), runs it, and journals its result (EXECUTED) before it goes on; a later replay
returns the journaled result and never runs it again. A worker lost while it runs leaves
the claim to lapse: the sweeper sends the flow's advance (never a message of its own: it
has no task), and the replay that takes the claim over runs it again (a model request may
be sent again), within SAGAWORKER_MAX_RERUNS. It has nothing to undo: its compensation is
SKIPPED.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .errors import BadInput

__all__ = ["FUNCTION_TOOL", "MODEL_REQUEST", "UNIT_PREFIX", "CallFor", "Unit", "is_unit",
           "model_turn", "step_label", "turn_line", "unit_input", "unit_kind"]

UNIT_PREFIX = "unit:"
_MAX = 200 - len(UNIT_PREFIX)


@dataclass(frozen=True)
class Unit:
    """A unit a flow's replay asks to journal before it runs it. ``input``: a digest of
    what it is asked with, as the flow's code gives it (a model request's prompt),
    journaled in its args digest, so that a replay under changed code finds the change."""

    name: str
    input: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name or len(self.name) > _MAX:
            raise BadInput(f"durable unit name {self.name!r}: give a non-empty string of at "
                           f"most {_MAX} characters")

    @property
    def tool_name(self) -> str:
        return UNIT_PREFIX + self.name


def unit_input(unit: Unit) -> dict[str, str]:
    """What a unit's args digest is taken over besides its name: its input's digest, if
    it has one (a unit journaled before inputs were, or without one: nothing)."""
    return {} if unit.input is None else {"input": unit.input}


@dataclass(frozen=True)
class CallFor:
    """A tool asked for by a framework's tool call: its step journals the call's id."""

    tool: Any
    call_id: str


def is_unit(tool_name: str) -> bool:
    return tool_name.startswith(UNIT_PREFIX)


#: the one name of a model request's step, wherever people read it
MODEL_REQUEST = "model request"
FUNCTION_TOOL = "function tool"


def unit_kind(tool_name: str) -> str | None:
    """What a durable unit is: ``model request`` (an agent's request to its model),
    ``function tool`` (a call of a function tool that is not an ``@sw.tool``), or None for
    a step that is no unit."""
    if not is_unit(tool_name):
        return None
    return MODEL_REQUEST if "__model." in tool_name else FUNCTION_TOOL


def step_label(tool_name: str) -> str:
    """A step's one name where people read it (``show``, the dashboard, the JSON): its
    tool's function name; ``model request``; a function tool's own name."""
    kind = unit_kind(tool_name)
    if kind == MODEL_REQUEST:
        return MODEL_REQUEST
    if kind == FUNCTION_TOOL:  # Pydantic AI: ...call_tool:NAME; OpenAI Agents: ...__tool.NAME
        name = tool_name.rpartition(":")[2] if ".call_tool:" in tool_name else \
            tool_name.rpartition("__tool.")[2]
        return name or tool_name
    return tool_name.rsplit(".", 1)[-1]


#: the keys of a model turn's display form (what ``model_turn`` gives)
_TURN_KEYS = frozenset({"model", "input_tokens", "output_tokens", "asks"})


def model_turn(tool_name: str, result: Any) -> dict[str, Any] | None:
    """A durable unit that holds a model's response, as people read it: the model, the
    tokens it reports, the tools it asked for (None for any other step). Its display form
    (a record redacted for people holds it) is given back as it is."""
    if not is_unit(tool_name) or not isinstance(result, dict):
        return None
    if set(result) == _TURN_KEYS:
        return result
    if "model_name" not in result:
        return None
    found_usage, found_parts = result.get("usage"), result.get("parts")
    usage: dict[str, Any] = found_usage if isinstance(found_usage, dict) else {}
    parts: list[Any] = found_parts if isinstance(found_parts, list) else []
    return {"model": result.get("model_name"), "input_tokens": usage.get("input_tokens"),
            "output_tokens": usage.get("output_tokens"),
            "asks": [p.get("tool_name") for p in parts
                     if isinstance(p, dict) and p.get("part_kind") == "tool-call"]}


def turn_line(turn: dict[str, Any]) -> str:
    asks = ", ".join(str(a) for a in turn["asks"]) or "no tool (its answer)"
    return (f"model {turn['model']} · tokens in/out {turn['input_tokens']}/"
            f"{turn['output_tokens']} · asks {asks}")
