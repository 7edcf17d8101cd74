"""What every machine's moves share: the results moves answer with, tokens, the lease,
and the small moves several machines perform (doubt, cancel, a failure request). The rules
every move keeps are in ``machine``'s docstring and ``docs/design.md``."""

from __future__ import annotations

import os
import secrets
import socket
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from sqlalchemy import select

from .._base.settings import Settings
from .._base.types import OPEN, OPEN_VALUES, Phase, SagaStatus
from .._journal.dialect import db_now
from .._journal.repository import Journal
from .._journal.schema import entries, sagas
from .lifecycle import move, performs

__all__ = ["Claim", "Executed", "Held", "MoveBase", "Start", "UndoClaim", "UndoState",
           "new_token", "worker_label"]


def new_token() -> str:
    """A fresh attempt or undo token."""
    return secrets.token_hex(16)


def worker_label() -> str:
    """Who runs an attempt, for people to read. No behaviour depends on it."""
    return f"{socket.gethostname()}|{os.getpid()}"


class Start(Enum):
    RUN = "run"                  # this delivery runs the tool
    DONE = "done"                # already EXECUTED: the journaled result stands
    FINISHED = "finished"        # FAILED / CANCELLED / REJECTED: nothing to do
    BUSY = "busy"                # another delivery's attempt is still running
    CANCELLED = "cancelled"      # the saga is failing: the step is not run
    IN_DOUBT = "in_doubt"        # an earlier attempt died with no outcome
    HELD = "held"                # the saga is held on a divergence: runs once resumed
    NOT_APPROVED = "not_approved"
    #: a copy of an earlier Celery retry (the sweeper's resend, a redelivery): the journal
    #: counts a later retry, which runs the step (or ran it)
    SUPERSEDED = "superseded"
    NOT_DUE = "not_due"          # its Celery retry is not due yet: sent again for then
    UNKNOWN = "unknown"          # no such saga or entry
    MISMATCH = "mismatch"        # the message names another tool than the journal


@dataclass(frozen=True)
class Claim:
    start: Start
    attempt: int = 0
    row: Any = None
    saga_status: SagaStatus | None = None
    rerun: bool = False
    #: this claim found the saga past its deadline and asked it to fail
    overdue: bool = False


@dataclass(frozen=True)
class Executed:
    """What journaling EXECUTED came to: ``applied`` False when the attempt was fenced."""

    applied: bool
    status: SagaStatus | None
    flow: str | None = None  # the saga's flow: the worker advances it at once


class UndoClaim(Enum):
    CLAIMED = "claimed"
    BUSY = "busy"                # another undo of the saga is live
    WAITING = "waiting"          # a forward step still runs; its outcome re-sends the chain
    FINISHED = "finished"
    NOT_COMPENSATING = "not_compensating"


@dataclass(frozen=True)
class UndoState:
    state: UndoClaim
    row: Any = None
    attempt: int = 0
    status: SagaStatus | None = None
    reason: str | None = None
    dirty_tools: tuple[str, ...] = ()
    #: forward steps found dead (in doubt) by this move: the caller logs step_in_doubt
    in_doubt: tuple[Any, ...] = ()
    #: undos given up by this move because their worker died on every try
    died: tuple[tuple[Any, str], ...] = field(default=())
    #: the saga's start span's context (tracing): the parent of the undo's span
    trace_context: str | None = None


#: what a process holds a lease on: (saga id, seq, True for an undo, token)
Held = tuple[str, int, bool, str]

_INTENT, _EXECUTED = Phase.INTENT.value, Phase.EXECUTED.value
_OPEN_VALUES = list(OPEN_VALUES)
_CLAIM = move("step", "claim")
_EXECUTE = move("step", "execute")


def _alive(col: Any) -> Any:
    return (col > db_now()).label("alive")



class MoveBase:
    """The journal and the settings every machine's moves use."""

    def __init__(self, journal: Journal, settings: Settings) -> None:
        self.j = journal
        self.settings = settings

    @property
    def lease(self) -> float:
        return self.settings.lease_seconds

    def _overdue(self, conn: Any, saga: Any) -> bool:
        """The saga's deadline passed, on the database's clock."""
        if saga is None or saga.deadline_at is None:
            return False
        return conn.execute(select(sagas.c.saga_id).where(
            sagas.c.saga_id == saga.saga_id, sagas.c.deadline_at <= db_now())).first() is not None

    @performs("step", "doubt")
    def _doubt(self, conn: Any, saga_id: str, seq: int, token: str | None, exhausted: bool,
               reruns: int, *, by: str) -> int:
        """Move ``doubt``: the attempt's worker was lost before an outcome (found by the
        move whose token is ``by``)."""
        why = (f"in doubt: the attempt's worker was lost before an outcome was journaled, "
               f"on each of {reruns + 1} attempts (SAGAWORKER_MAX_RERUNS); the effect may or "
               "may not have happened" if exhausted else
               "in doubt: the attempt's worker was lost before an outcome was journaled; "
               "the effect may or may not have happened")
        # only if the attempt is still the one read and its lease still lapsed (a late
        # heartbeat may have revived it): 0 when it did
        return int(self.j.set_entry(
            conn, saga_id, seq, entries.c.phase == _INTENT,
            entries.c.attempt_token.is_not_distinct_from(token),
            entries.c.lease_until.is_(None) | (entries.c.lease_until < db_now()),
            phase=move("step", "doubt").target, in_doubt=True, lease_until=None,
            attempt_token=token, error=why, decided_by=by))

    @performs("step", "cancel")
    def _cancel(self, conn: Any, saga_id: str, seq: int, why: str, *,
                by: str | None = None) -> int:
        return int(self.j.set_entry(conn, saga_id, seq, entries.c.phase == _INTENT,
                                    entries.c.lease_until.is_(None),
                                    phase=move("step", "cancel").target, error=why,
                                    decided_by=by))

    @performs("saga", "request_failure")
    def _request_failure(self, conn: Any, saga: Any, reason: str,
                         token: str | None = None) -> None:
        """Ask a saga to fail, once: the first reason stands. ``token``: the asking move's,
        which tells its replay after a lost COMMIT that it asked."""
        if saga.fail_requested_at is None and SagaStatus(saga.status) in OPEN:
            self.j.touch(conn, saga.saga_id, fail_requested_at=db_now(), reason=reason,
                         fail_token=token)

