"""Readable tables (rich) and JSON for the CLI."""

from __future__ import annotations

import json
from collections.abc import Sequence
from datetime import UTC, datetime
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.table import Table
from rich.text import Text

from .._base.jsonable import plain
from .._base.patches import patch_id
from .._base.types import (
    ApprovalRequest,
    EntryRecord,
    OutcomeResult,
    Phase,
    SagaRecord,
    SagaStatus,
)
from .._base.units import FUNCTION_TOOL, model_turn, step_label, turn_line, unit_kind
from .._journal.raw_rows import UnreadableSaga
from .._observe.records import Redaction, saga_json, waiting_step
from .._observe.visible import visible

__all__ = ["approval_line", "console", "flow_call", "redacted", "render_saga", "render_sagas",
           "saga_json", "to_json", "waiting_step"]

console = Console(highlight=False)

_STATUS = {SagaStatus.COMPLETED: "green", SagaStatus.COMPENSATED: "yellow",
           SagaStatus.COMPENSATION_FAILED: "bold red", SagaStatus.COMPENSATING: "magenta",
           SagaStatus.RUNNING: "cyan", SagaStatus.AWAITING_APPROVAL: "blue"}
_PHASE = {Phase.EXECUTED: "green", Phase.FAILED: "red", Phase.REJECTED: "red",
          Phase.CANCELLED: "dim", Phase.INTENT: "cyan", Phase.AWAITING_APPROVAL: "blue"}
_OUTCOME = {OutcomeResult.COMPENSATED: "green", OutcomeResult.SKIPPED: "yellow",
            OutcomeResult.COMPENSATION_FAILED: "bold red"}


def redacted(o: Any, redaction: Redaction | None = None) -> Any:
    """Records (or lists of them) as they may be shown: SAGAWORKER_REDACT applied (by
    default with what this process's ``Sagaworker`` was configured with)."""
    return (redaction or Redaction.current()).any(o)


def to_json(o: Any, redaction: Redaction | None = None) -> str:
    return json.dumps(plain(redacted(o, redaction)), indent=2, default=str)


def flow_call(rec: SagaRecord) -> str | None:
    """``name(arg, ..., key=value)`` of a flow saga (as given, redact it first)."""
    if rec.flow is None:
        return None
    parts = [json.dumps(a, default=str) for a in rec.flow_args or []]
    parts += [f"{k}={json.dumps(v, default=str)}" for k, v in (rec.flow_kwargs or {}).items()]
    return f"{rec.flow}({', '.join(parts)})"




def _cell(v: Any) -> str:
    """A journal value as a table shows it: whole (a table folds long cells, never cuts
    them), as text (a ``[/]`` in a reason is not markup), hidden characters escaped."""
    return escape(visible(json.dumps(v, default=str) if not isinstance(v, str) else v))


def approval_line(p: ApprovalRequest) -> str:
    """A gate as `approvals` lists it (plain text, not markup): the saga, the step and
    the arguments exactly, a right-to-left override or a zero-width space escaped."""
    return visible(f"{p.saga_id} #{p.seq} {p.tool_name} args={p.args!r} kwargs={p.kwargs!r}")


#: columns of a fixed vocabulary (a status, a phase, a number): never broken
_WHOLE = {"saga", "seq", "status", "phase", "outcome", "attempts", "undo", "undo tries", "steps",
          "created"}


#: the narrowest a free-text column may get before the rows are printed as blocks
_MIN_TEXT = 10


def _table(columns: tuple[str, ...], **kw: Any) -> Table:
    """A table that wraps (folds) its free-text cells to the width it has, piped or in a
    narrow terminal, and never shortens a value with an ellipsis."""
    t = Table(**kw)
    for col in columns:
        if col in _WHOLE:
            t.add_column(col, no_wrap=True, overflow="ignore")
        else:
            t.add_column(col, overflow="fold", min_width=_MIN_TEXT)
    return t


class _Grid:
    """Rows shown as a table, or, in a terminal too narrow for its columns, as one block
    a row (``column: value`` lines): a value is never cut and a column never vanishes."""

    def __init__(self, columns: tuple[str, ...], title: str | None = None) -> None:
        self.columns, self.title = columns, title
        self.rows: list[tuple[str, ...]] = []

    def add_row(self, *cells: str) -> None:
        self.rows.append(cells)

    def _needs(self) -> int:
        """The narrowest this table can be with every column whole: a fixed column as
        wide as its widest cell, a free-text one at least ``_MIN_TEXT``; each column
        three more for its padding and border, and the last border."""
        width = 1
        for i, col in enumerate(self.columns):
            cells = [Text.from_markup(r[i]).cell_len for r in self.rows] or [0]
            widest = max(len(col), *cells) if col in _WHOLE else max(len(col), _MIN_TEXT)
            width += widest + 3
        return width

    def print(self) -> None:
        t = _table(self.columns, title=self.title, title_justify="left")
        for row in self.rows:
            t.add_row(*row)
        if self._needs() <= console.width:
            console.print(t)
            return
        if self.title:
            console.print(self.title)
        for row in self.rows:
            whole = [f"{c} {v}" for c, v in zip(self.columns, row, strict=True)
                     if c in _WHOLE and v]
            console.print("- " + "  ".join(whole))
            for c, v in zip(self.columns, row, strict=True):
                if c not in _WHOLE and v:
                    console.print(f"  {c}: {v}", overflow="fold")


def _tool(name: str) -> str:
    """A step's one name (``model request`` for an agent's model request), a function
    tool's call marked as one."""
    label = step_label(name)
    if unit_kind(name) == FUNCTION_TOOL:
        label = f"{label} ({FUNCTION_TOOL})"
    return escape(visible(label))


def render_saga(rec: SagaRecord, redaction: Redaction | None = None) -> None:
    rec = redacted(rec, redaction)
    c = _STATUS.get(rec.status, "")
    console.print(f"[bold]saga {_cell(rec.saga_id)}[/]  [{c}]{rec.status.value}[/]"
                  + (f"  reason: {_cell(rec.reason)}" if rec.reason else ""))
    call = flow_call(rec)
    if call is not None:
        console.print(f"flow: {visible(call)}", markup=False)
    if rec.diverged:
        console.print(f"[bold red]diverged[/] (held: nothing runs, nothing is undone): "
                      f"{_cell(rec.diverged)}")
        console.print(f"  resolve: deploy code that replays its journal (a rollback, or "
                      f"s.patched(...)), then `sagaworker flows resume {rec.saga_id}`; or "
                      f"`sagaworker abort {rec.saga_id} --reason R` to compensate it",
                      markup=False)
    step = waiting_step(rec)
    if step is not None:
        what = ("an approval" if step.phase is Phase.AWAITING_APPROVAL
                else "its outcome")
        console.print(f"waiting on: step {step.seq} {_tool(step.tool_name)} "
                      f"({step.phase.value}, {what})", markup=False)
    if rec.deadline_at is not None:
        console.print(f"deadline: {rec.deadline_at.isoformat()}", markup=False)
    t = _Grid(("seq", "tool", "phase", "args", "result / error", "attempts", "undo",
               "undo tries"), title="journal")
    for e in rec.entries:
        turn = model_turn(e.tool_name, e.result)
        args = "" if unit_kind(e.tool_name) else _cell([e.args, e.kwargs])  # (a unit has none)
        t.add_row(str(e.seq), _tool(e.tool_name), _phase(e), args,
                  _cell(turn_line(turn)) if turn is not None else
                  _cell(e.result) if e.phase is Phase.EXECUTED else _cell(e.error or ""),
                  str(e.attempts), _outcome(e), str(e.compensation_attempts or ""))
    t.print()
    if rec.report.outcomes or rec.report.in_doubt:
        r = _Grid(("seq", "tool", "outcome", "attempts", "detail"),
                  title="compensation report (in the order the undos ran)")
        for o in rec.report.outcomes:
            oc = _OUTCOME[o.result]
            r.add_row(str(o.seq), _tool(o.tool_name), f"[{oc}]{o.result.value}[/]",
                      str(o.attempts), _cell(o.detail or ""))
        for e in rec.report.in_doubt:
            r.add_row(str(e.seq), _tool(e.tool_name), "[bold red]IN DOUBT[/]",
                      str(e.attempts), _cell(e.error or ""))
        r.print()


def _phase(e: EntryRecord) -> str:
    c = _PHASE.get(e.phase, "")
    label = e.phase.value + (" (in doubt)" if e.in_doubt else "")
    return f"[{c}]{label}[/]"


def _outcome(e: EntryRecord) -> str:
    if e.compensation is None or patch_id(e.tool_name) is not None:
        return ""  # (a patch marker has nothing to undo)
    return f"[{_OUTCOME[e.compensation]}]{e.compensation.value}[/]"


def render_sagas(recs: list[SagaRecord], redaction: Redaction | None = None,
                 unreadable: Sequence[UnreadableSaga] = ()) -> None:
    """The sagas as a table, newest first; one the journal could not read is a row of its
    own saying so (its status and why), not a failed listing."""
    recs = redacted(recs, redaction)
    rows: list[tuple[datetime | None, str, tuple[str, ...]]] = []
    for r in recs:
        c = _STATUS.get(r.status, "")
        rows.append((r.created_at, r.saga_id, (
            _cell(r.saga_id), f"[{c}]{r.status.value}[/]"
            + (" [bold red](diverged)[/]" if r.diverged else ""), str(len(r.entries)),
            r.created_at.strftime("%Y-%m-%d %H:%M:%S"), _cell(r.reason or ""))))
    for u in unreadable:
        rows.append((u.created_at, u.saga_id, (
            _cell(u.saga_id), _cell(u.status), "?",
            u.created_at.strftime("%Y-%m-%d %H:%M:%S") if u.created_at else "",
            f"[bold red]unreadable[/]: {_cell(u.error)}")))
    # the journal's order (newest first, then by id) with the unreadable ones in place
    oldest = datetime.min.replace(tzinfo=UTC)
    rows.sort(key=lambda row: (row[0] or oldest, row[1]), reverse=True)
    t = _Grid(("saga", "status", "steps", "created", "reason"))
    for _, _, cells in rows:
        t.add_row(*cells)
    t.print()
