"""The lifecycle, as a table: every state of a saga, of a step and of its undo, and every
move allowed between them, with its guard and what it emits.

This is the one place that says which moves exist. ``_machine`` performs them (each one a
guarded compare-and-set transaction that names its row here), ``docs/reliability.md``
draws them (``mermaid()``; a unit test checks the drawing is the table's) and the stateful
test (``tests/statemachine/``) checks the invariants over interleavings of
them. A move not in the table is an error (``move()`` raises), never a silent no-op.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from .._base.types import OutcomeResult, Phase, SagaStatus

_F = TypeVar("_F", bound=Callable[..., Any])

__all__ = ["MOVES", "Move", "mermaid", "move", "performs"]

#: pseudo-states of the drawing: before a row exists, the attempt and undo sub-states
NEW = "[*]"
UNDO_NONE = "NO_OUTCOME"
UNDO_TRYING = "UNDO_TRYING"
ATTEMPT_IDLE = "INTENT"
ATTEMPT_RUNNING = "RUNNING_ATTEMPT"


@dataclass(frozen=True)
class Move:
    """One allowed move of one row: from any of ``sources`` to ``target``."""

    machine: str            # "saga", "step" (an entry's phase) or "undo" (its outcome)
    name: str
    sources: tuple[str, ...]
    target: str
    guard: str              # what the compare-and-set checks
    emits: str = ""         # the log event(s) the caller emits once the move committed


_OPEN = (SagaStatus.RUNNING.value, SagaStatus.AWAITING_APPROVAL.value)

MOVES: tuple[Move, ...] = (
    # -- the saga ------------------------------------------------------------------
    Move("saga", "begin", (NEW,), SagaStatus.RUNNING.value,
         "the id is new (primary key); a flow's name and arguments journaled with it"),
    Move("saga", "request_failure", _OPEN, "FAILING",
         "fail(), a FAILED or in-doubt step, a rejection, a deadline or an abort: the first "
         "reason stands; gates close and no step starts from here on",
         "saga_failed, saga_deadline_passed, saga_aborted"),
    Move("saga", "begin_compensation_failing", ("FAILING",), SagaStatus.COMPENSATING.value,
         "the failure handler (one wins, saga row lock)", "compensation_started"),
    Move("saga", "await_decision", (SagaStatus.RUNNING.value,),
         SagaStatus.AWAITING_APPROVAL.value,
         "a gated step is journaled; the saga is not failing", "approval_requested"),
    Move("saga", "decided", (SagaStatus.AWAITING_APPROVAL.value,), SagaStatus.RUNNING.value,
         "an approval left no other step awaiting a decision", "approval_granted"),
    Move("saga", "complete", (SagaStatus.RUNNING.value,), SagaStatus.COMPLETED.value,
         "not failing; every step EXECUTED"),
    Move("saga", "begin_compensation", _OPEN, SagaStatus.COMPENSATING.value,
         "one failure handler wins (saga row lock); unstarted steps and open gates are "
         "CANCELLED in the same transaction", "saga_failed, compensation_started"),
    Move("saga", "finish", (SagaStatus.COMPENSATING.value,), SagaStatus.COMPENSATED.value,
         "no step running, no undo without an outcome, none COMPENSATION_FAILED",
         "saga_compensated"),
    Move("saga", "finish_dirty", (SagaStatus.COMPENSATING.value,),
         SagaStatus.COMPENSATION_FAILED.value,
         "as finish, with an undo COMPENSATION_FAILED", "saga_compensation_failed"),
    Move("saga", "redrive", (SagaStatus.COMPENSATION_FAILED.value,),
         SagaStatus.COMPENSATING.value,
         "an operator re-drive reopens the COMPENSATION_FAILED undos", ""),
    # -- a step (journal entry) ------------------------------------------------------
    Move("step", "journal", (NEW,), Phase.INTENT.value,
         "the saga is open and not failing; INTENT commits before the publish", "step_intent"),
    Move("step", "gate", (NEW,), Phase.AWAITING_APPROVAL.value,
         "as journal, for an IRREVERSIBLE tool (never published)", "approval_requested"),
    Move("step", "mark", (NEW,), Phase.EXECUTED.value,
         "as journal, for a flow's patch marker: no tool, no message, its undo SKIPPED "
         "with it", "flow_patch_marked"),
    Move("step", "approve", (Phase.AWAITING_APPROVAL.value,), Phase.INTENT.value,
         "a valid token; the saga is open, was never asked to fail and is not held",
         "approval_granted"),
    Move("step", "reject", (Phase.AWAITING_APPROVAL.value,), Phase.REJECTED.value,
         "a valid token; the saga is open and was never asked to fail; asks it to fail",
         "approval_rejected"),
    Move("step", "claim", (ATTEMPT_IDLE,), ATTEMPT_RUNNING,
         "no live attempt; the saga is open, not failing and not held (diverged); a gated "
         "step is approved; a Celery message counted no lower than the journaled retry, "
         "and that retry due; a fresh attempt token and a lease on the database clock",
         "step_rerun, step_superseded, step_not_due"),
    Move("step", "heartbeat", (ATTEMPT_RUNNING,), ATTEMPT_RUNNING,
         "the attempt token still holds the lease"),
    Move("step", "release", (ATTEMPT_RUNNING,), ATTEMPT_IDLE,
         "the attempt token; the tool raised and Celery may retry, or the attempt stopped "
         "before its tool started (not in doubt)"),
    Move("step", "execute", (ATTEMPT_RUNNING,), Phase.EXECUTED.value,
         "the attempt token (a fenced-out attempt journals nothing)", "step_executed"),
    Move("step", "fail", (ATTEMPT_RUNNING, ATTEMPT_IDLE), Phase.FAILED.value,
         "the attempt token; Celery gave up, or the message does not match the journal",
         "step_failed"),
    Move("step", "doubt", (ATTEMPT_RUNNING,), Phase.FAILED.value,
         "the lease lapsed with no outcome and the tool is not idempotent, its re-runs are "
         "used up, or its saga is failing: in_doubt, never undone", "step_in_doubt"),
    Move("step", "cancel", (ATTEMPT_IDLE, Phase.AWAITING_APPROVAL.value),
         Phase.CANCELLED.value,
         "the saga is failing and no attempt of the step is live", ""),
    # -- an undo (an EXECUTED entry's outcome) ----------------------------------------
    Move("undo", "claim_undo", (UNDO_NONE,), UNDO_TRYING,
         "saga COMPENSATING; no forward step of the saga running; no other undo of the "
         "saga live; the latest-EXECUTED entry without an outcome; a fresh undo token",
         "compensation_retry"),
    Move("undo", "record", (UNDO_TRYING,), OutcomeResult.COMPENSATED.value,
         "the undo token", "compensated"),
    Move("undo", "skip", (UNDO_TRYING,), OutcomeResult.SKIPPED.value,
         "the undo token; no undo declared or the step is IRREVERSIBLE",
         "compensation_skipped"),
    Move("undo", "give_up", (UNDO_TRYING,), OutcomeResult.COMPENSATION_FAILED.value,
         "the undo token; it raised on its last try, or its worker died on every try",
         "compensation_failed"),
    Move("undo", "release_undo", (UNDO_TRYING,), UNDO_NONE,
         "the undo token; it raised with tries left (retried with backoff)"),
    Move("undo", "reopen", (OutcomeResult.COMPENSATION_FAILED.value,), UNDO_NONE,
         "an operator re-drive (same idempotency key)"),
)

_BY_NAME = {(m.machine, m.name): m for m in MOVES}


def move(machine: str, name: str) -> Move:
    """The move of that name; KeyError for one the table does not allow."""
    return _BY_NAME[(machine, name)]


def performs(machine: str, *names: str) -> Callable[[_F], _F]:
    """Mark the function that performs these moves of one machine (each must be in the
    table). Every move is performed by exactly one function (a test holds the code to it),
    and only such functions write a status or a phase."""
    for name in names:
        move(machine, name)  # KeyError at import for a move the table does not allow

    def mark(fn: _F) -> _F:
        done: tuple[tuple[str, str], ...] = getattr(fn, "__moves__", ())
        fn.__moves__ = (*done, *((machine, n) for n in names))  # type: ignore[attr-defined]
        return fn

    return mark


def mermaid(machine: str) -> str:
    """A Mermaid state diagram of one machine, drawn from the table."""
    lines = ["stateDiagram-v2"]
    for m in MOVES:
        if m.machine != machine:
            continue
        for src in m.sources:
            lines.append(f"    {src} --> {m.target}: {m.name}")
    return "\n".join(lines)

