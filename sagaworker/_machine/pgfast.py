"""The three writes of every step on PostgreSQL, each one round trip.

INTENT (the producer), the claim and EXECUTED (the worker) are each a single statement: a
compare-and-set (the claim, EXECUTED) or a data-modifying CTE (INTENT bumps the saga's seq
and inserts the entry). A single statement is atomic by itself, so it runs in autocommit
on the driver's connection, taken from the engine's pool (``_journal.pgconn``): no
``BEGIN`` and ``COMMIT`` round trips, and no SQL built or compiled per call. That is a
third of the client CPU of the SQLAlchemy form and half its wall time
(``python -m bench.costs``, docs/benchmarks.md). Everything else, and every path that is
not the common case, stays in SQLAlchemy.

Failures keep the journal's rules (``pgconn``), and an INTENT whose reply was lost is
recognised by its task id before it is sent again (``Machine.add_entries``).
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

from psycopg.types.json import Jsonb
from sqlalchemy import Engine

from .._base.crypto import Placed, SealedElsewhere, SealedJSON
from .._base.types import OPEN, Phase
from .._journal import pgconn
from .._journal.pgconn import Place, enabled
from .._journal.schema import entries, sagas

__all__ = ["Claimed", "UndoRow", "claim", "complete", "enabled", "executed", "intent",
           "intent_seq", "undo_next"]

_S, _E = sagas.name, entries.name
_OPEN = ", ".join(f"'{s.value}'" for s in sorted(OPEN, key=lambda s: s.value))
_INTENT, _EXECUTED = Phase.INTENT.value, Phase.EXECUTED.value


class Claimed(NamedTuple):
    """What a claim that landed on the fast path needs of the entry (an entry no one
    approved: a tool made gated since it was journaled is refused by ``verify``)."""

    attempts: int
    args_digest: str
    approved_by: str | None = None
    approved_digest: str | None = None
    trace_context: str | None = None  # the step's enqueue span's (tracing)
    place_nonce: str | None = None  # its saga's (``sagas.place_nonce``)


#: a statement sealing values for a saga's nonce writes only while it is the saga's
_NONCE = " AND place_nonce IS NOT DISTINCT FROM %(place)s::text"


class UndoRow(NamedTuple):
    """The entry whose undo the chain claimed, as the chain reads it (decrypted)."""

    seq: int
    tool_name: str
    args: Any
    kwargs: Any
    result: Any
    span_context: str | None
    exec_order: int
    compensation_attempts: int
    undo_token: str
    reason: str | None  # the saga's (its failure reason) and its start span's context
    trace_context: str | None
    #: why its values cannot be read (sealed for another row: copied there with SQL)
    unreadable: str | None = None


def _json(engine: Engine, column: str, value: Any, *at: Any) -> Jsonb:
    """An entry's JSON column's value as SQLAlchemy would bind it (sealed when keys are
    set, for the place ``at``)."""
    sealed: SealedJSON = entries.c[column].type  # type: ignore[assignment]
    return Jsonb(sealed.process_bind_param(Placed(value, at), engine.dialect))


_CLAIM = f"""
UPDATE {_E} AS e SET
    attempts = e.attempts + 1, started_at = statement_timestamp(),
    lease_until = statement_timestamp() + make_interval(secs => %(lease)s::double precision),
    worker = %(worker)s, attempt_token = %(token)s, retry_due_at = NULL,
    task_id = COALESCE(e.task_id, %(task_id)s), resends = 0, resend_at = NULL,
    updated_at = statement_timestamp()
FROM {_S} AS s
WHERE e.saga_id = %(saga)s AND e.seq = %(seq)s AND e.phase = '{_INTENT}'
  AND e.lease_until IS NULL AND e.tool_name = %(tool)s AND e.approved_by IS NULL
  AND s.saga_id = e.saga_id AND s.status IN ({_OPEN}) AND s.fail_requested_at IS NULL
  AND (s.deadline_at IS NULL OR s.deadline_at > statement_timestamp())
  AND s.divergence IS NULL
  AND (%(retries)s::integer IS NULL OR e.celery_retries <= %(retries)s::integer)
  AND (%(retries)s::integer IS NULL OR e.retry_due_at IS NULL
       OR e.retry_due_at <= statement_timestamp())
RETURNING e.attempts, e.args_digest, e.trace_context, s.place_nonce
"""


def claim(engine: Engine, *, saga_id: str, seq: int, tool: str, token: str, worker: str,
          task_id: str | None, lease: float, retries: int | None = None) -> Claimed | None:
    """Move ``claim``, the common case: an ungated INTENT nobody holds, in an open saga not
    asked to fail, before its deadline; delivered by a Celery message counted ``retries``
    (None: no message), not a copy of an earlier retry, and its retry due. None: not the
    common case (the caller takes the locked path)."""
    row = pgconn.run(engine, _CLAIM, {"lease": lease, "worker": worker, "token": token,
                                      "task_id": task_id, "saga": saga_id, "seq": seq,
                                      "tool": tool, "retries": retries})
    return None if row is None else Claimed(int(row[0]), str(row[1]), trace_context=row[2],
                                            place_nonce=row[3])


@functools.cache
def _executed_sql(traced: bool, keyed: bool = False) -> str:
    # the run's span context only when it was traced: else the statement is unchanged
    span = " span_context = %(span)s," if traced else ""
    guard, nonce = (" AND EXISTS (SELECT 1 FROM bump)", _NONCE) if keyed else ("", "")
    return f"""
WITH bump AS (
    UPDATE {_S} SET exec_counter = exec_counter + 1, updated_at = statement_timestamp()
    WHERE saga_id = %(saga)s{nonce} RETURNING exec_counter, status, flow)
UPDATE {_E} SET
    phase = '{_EXECUTED}', result = %(result)s, executed_at = statement_timestamp(),
    updated_at = statement_timestamp(),{span}
    exec_order = (SELECT exec_counter FROM bump), lease_until = NULL,
    duration_ms = %(ms)s, error = NULL
WHERE saga_id = %(saga)s AND seq = %(seq)s AND phase = '{_INTENT}'{guard}
  AND attempt_token = %(token)s
RETURNING (SELECT status FROM bump), (SELECT flow FROM bump)
"""


def executed(engine: Engine, *, saga_id: str, seq: int, token: str, result: Any,
             duration_ms: float, span_context: str | None = None,
             place: Place | None = None) -> tuple[str, str | None] | None:
    """Move ``execute`` fenced by the attempt token, with the saga row's lock and the next
    execution order taken in the same statement. (status, flow), or None on a miss.
    ``place``: the result sealed for that nonce (a miss when it is not the saga's)."""
    nonce = None if place is None else place.nonce
    row = pgconn.run(engine, _executed_sql(span_context is not None, place is not None), {
        "saga": saga_id, "seq": seq, "token": token, "place": nonce,
        "result": _json(engine, "result", result, saga_id, seq, nonce), "ms": duration_ms,
        "span": span_context})
    return None if row is None else (str(row[0]), row[1])


@functools.cache
def _intent_sql(gated: bool, traced: bool, flow: bool = False, claim: bool = False,
                keyed: bool = False) -> str:
    status = ", status = 'AWAITING_APPROVAL'" if gated else ""
    # the enqueue span's context only when it was traced: else the statement is unchanged
    column, value = (", trace_context", ", %(trace)s") if traced else ("", "")
    # a flow's replay: only if the journal is still what it read, and what it read noted
    advanced = (", advanced_at = statement_timestamp(), advanced_seen = %(seen)s, "
                "resends = 0, resend_at = NULL") if flow else ""
    expect = " AND last_seq = %(expect)s" if flow else ""
    expect += _NONCE if keyed else ""
    # an eager step: claimed by this statement unless the saga's deadline passed (then
    # the claim's own path finds it so and fails the saga)
    live = ", (deadline_at IS NULL OR deadline_at > statement_timestamp()) AS live"
    attempts, claimed, claims = "0", "", ""
    if claim:
        attempts = "CASE WHEN live THEN 1 ELSE 0 END"
        claimed = ", started_at, lease_until, worker, attempt_token"
        claims = (", CASE WHEN live THEN statement_timestamp() END, CASE WHEN live THEN "
                  "statement_timestamp() + make_interval(secs => %(lease)s::double precision)"
                  " END, CASE WHEN live THEN %(worker)s END, CASE WHEN live THEN %(token)s END")
    return f"""
WITH bump AS (
    UPDATE {_S} SET last_seq = last_seq + 1, updated_at = statement_timestamp(){status}{advanced}
    WHERE saga_id = %(saga)s AND status IN ({_OPEN}) AND fail_requested_at IS NULL{expect}
    RETURNING last_seq{live})
INSERT INTO {_E} (saga_id, seq, tool_name, phase, args, kwargs, args_digest, queue,
                  task_id, attempts, created_at, updated_at, in_doubt,
                  compensation_attempts, approval_nonce, approval_requested_at{column}{claimed})
SELECT %(saga)s, last_seq, %(tool)s, %(phase)s, %(args)s, %(kwargs)s, %(digest)s,
       %(queue)s, %(task_id)s, {attempts}, statement_timestamp(), statement_timestamp(),
       false, 0, %(nonce)s, {"statement_timestamp()" if gated else "NULL"}{value}{claims}
FROM bump
RETURNING seq, attempt_token
"""


def intent(engine: Engine, *, saga_id: str, tool: str, args: list[Any],
           kwargs: dict[str, Any], digest: str, queue: str | None, task_id: str,
           gated: bool, nonce: str | None, trace_context: str | None = None,
           expect: int | None = None, seen: int | None = None,
           claim: tuple[str, str, float] | None = None,
           place: Place | None = None) -> tuple[int, bool] | None:
    """One step's INTENT (AWAITING_APPROVAL when gated) and the saga's seq bump: (seq,
    claimed), or None when the saga takes no new steps. ``expect``/``seen``: a flow's
    replay (``Machine.add_entries``); ``claim`` (token, worker, lease): an eager step,
    claimed in the same statement (``claimed``) unless the saga's deadline passed.
    ``place``: the values sealed for that nonce (None too when it is not the saga's)."""
    phase = Phase.AWAITING_APPROVAL.value if gated else _INTENT
    token, worker, lease = claim or (None, None, 0.0)
    saga_nonce = None if place is None else place.nonce  # (``nonce``: the gate's)
    row = pgconn.run(engine, _intent_sql(gated, trace_context is not None,
                                         expect is not None, claim is not None and not gated,
                                         place is not None), {
        "saga": saga_id, "tool": tool, "phase": phase, "place": saga_nonce,
        "args": _json(engine, "args", args, saga_id, task_id, saga_nonce),
        "kwargs": _json(engine, "kwargs", kwargs, saga_id, task_id, saga_nonce),
        "digest": digest, "queue": queue, "task_id": task_id, "nonce": nonce,
        "trace": trace_context, "expect": expect, "seen": seen, "token": token,
        "worker": worker, "lease": lease})
    return None if row is None else (int(row[0]), token is not None and row[1] == token)


_INTENT_SEQ = (f"SELECT seq, attempt_token FROM {_E} WHERE saga_id = %(saga)s "
               "AND task_id = %(task_id)s")


def intent_seq(engine: Engine, saga_id: str, task_id: str) -> tuple[int, str | None] | None:
    """The seq (and the claim's token) of the INTENT journaled with this task id, if that
    statement committed."""
    row = pgconn.run(engine, _INTENT_SEQ, {"saga": saga_id, "task_id": task_id})
    return None if row is None else (int(row[0]), row[1])


# (the function: migration 0009; a saga's reason and start span do not change while it
# compensates, so reading them beside the function's row is reading them after it)
_UNDO_NEXT = f"""
SELECT e.seq, e.tool_name, e.args, e.kwargs, e.result, e.span_context, e.exec_order,
       e.compensation_attempts, e.undo_token, s.reason, s.trace_context, e.task_id,
       s.place_nonce
FROM sagaworker_undo_next(%(saga)s, %(seq)s, %(result)s, %(detail)s, %(attempts)s,
                          %(token)s, %(next)s, %(lease)s, %(worker)s) AS e
JOIN {_S} AS s ON s.saga_id = e.saga_id
WHERE s.saga_id = %(saga)s
"""


def undo_next(engine: Engine, *, saga_id: str, seq: int, result: str, detail: str | None,
              attempts: int, token: str, next_token: str, lease: float,
              worker: str) -> UndoRow | None:
    """Moves ``record`` (or ``skip``/``give_up``) and ``claim_undo``, the common case: the
    outcome lands on the undo this chain holds, and another EXECUTED step's undo is
    claimed; one round trip. None: not the common case, nothing written (the caller
    takes the full path)."""
    row = pgconn.run(engine, _UNDO_NEXT, {"saga": saga_id, "seq": seq, "result": result,
                                          "detail": detail, "attempts": attempts,
                                          "token": token, "next": next_token, "lease": lease,
                                          "worker": worker})
    if row is None:
        return None
    call, step = (saga_id, row[11], row[12]), (saga_id, int(row[0]), row[12])
    got = UndoRow(int(row[0]), str(row[1]), None, None, None, row[5], int(row[6]),
                  int(row[7]), str(row[8]), row[9], row[10])
    try:
        return got._replace(args=_opened(engine, "args", row[2], call),
                            kwargs=_opened(engine, "kwargs", row[3], call),
                            result=_opened(engine, "result", row[4], step))
    except SealedElsewhere as exc:  # the undo is not run: the chain journals why
        return got._replace(unreadable=str(exc))


def _opened(engine: Engine, column: str, value: Any, at: tuple[Any, ...]) -> Any:
    """An entry's JSON column's value as SQLAlchemy would read it from the row placed at
    ``at`` (opened when sealed)."""
    sealed: SealedJSON = entries.c[column].type  # type: ignore[assignment]
    return sealed.open_at(value, engine.dialect, at)


# A flow's saga completes: the saga row's last seq must still be the one the replay read
# (checked again on the row's latest version once it is locked), so an entry journaled
# after this statement's snapshot, which the NOT EXISTS cannot see, is never skipped.
_COMPLETE = """
UPDATE {_S} SET status = 'COMPLETED', finished_at = statement_timestamp(),
    updated_at = statement_timestamp(), result = %(result)s
WHERE saga_id = %(saga)s AND status = 'RUNNING' AND fail_requested_at IS NULL
  AND last_seq = %(expect)s{guard}
  AND NOT EXISTS (SELECT 1 FROM {_E} WHERE saga_id = %(saga)s
                  AND (phase <> '{_EXECUTED}' OR error IS NOT NULL))
RETURNING 1
"""


def complete(engine: Engine, *, saga_id: str, result: Any, expect: int,
             place: Place | None = None) -> bool:
    """Move ``complete`` for a flow whose replay returned, in one round trip: False when
    not the common case (nothing written: the caller takes the full path). ``place``: the
    result sealed for that nonce (False when it is not the saga's)."""
    nonce = None if place is None else place.nonce
    sealed: SealedJSON = sagas.c.result.type  # type: ignore[assignment]
    value = Jsonb(sealed.process_bind_param(Placed(result, (saga_id, nonce)), engine.dialect))
    sql = _COMPLETE.format(_S=_S, _E=_E, _EXECUTED=_EXECUTED,
                           guard="" if place is None else _NONCE)
    return pgconn.run(engine, sql, {"saga": saga_id, "result": value, "expect": expect,
                                    "place": nonce}) is not None
