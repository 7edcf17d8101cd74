"""The state machine: every move of the lifecycle table (``lifecycle.MOVES``) performed
as one guarded compare-and-set transaction by one function that names its row
(``@performs``): a saga's moves in ``saga_moves``, a step's in ``step_moves`` (its first
row, journaled by its producer, in ``intent_moves``), a gate's in ``gate_moves``, an undo's
in ``undo_moves``.

Rules every move keeps (``docs/design.md`` says why):
- it locks the saga row first, then entry rows (the one lock order: no deadlocks), except
  the two single-statement hot paths (claim and EXECUTED) whose one statement is the
  compare-and-set;
- a forward attempt and an undo try are fenced by a random token taken when they are
  claimed: heartbeat, release, outcome and failure match on it, so a stale attempt, a late
  heartbeat or a duplicate delivery never writes over a newer one;
- tokens are made by the caller, outside the transaction, so a transaction replayed after
  a lost COMMIT (``@retrying``) recognises its own write and answers as the first time did;
- every stamp is the database's clock (``db_now``/``db_later``): leases, deadlines, the
  sweeper's conditions; no two hosts' clocks are ever compared. Progress is counted, not
  timed (a flow's advance records how many outcomes its replay read);
- a move that decides for someone else (a step found in doubt or cancelled, a saga asked
  to fail by an abort or a deadline, a gate decided) writes its caller's token on the
  row, so its replay reports what it found (events included), never a second time.
"""

from __future__ import annotations

from .gate_moves import GateMoves
from .intent_moves import IntentMoves
from .moves_base import (
    Claim,
    Executed,
    Held,
    Start,
    UndoClaim,
    UndoState,
    new_token,
    worker_label,
)
from .saga_moves import SagaMoves
from .step_moves import StepMoves
from .undo_moves import UndoMoves

__all__ = ["Claim", "Executed", "Held", "Machine", "Start", "UndoClaim", "UndoState",
           "new_token", "worker_label"]


class Machine(SagaMoves, IntentMoves, StepMoves, GateMoves, UndoMoves):
    """Every move that changes a status, a phase, an attempt or an undo try."""
