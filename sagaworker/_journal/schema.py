"""The journal's tables. Queries live in ``_journal``; dialect quirks in ``_dialect``."""

from __future__ import annotations

from typing import Any

from sqlalchemy import (
    Boolean,
    Column,
    DateTime,
    Float,
    ForeignKey,
    Index,
    Integer,
    MetaData,
    String,
    Table,
    Text,
    select,
    text,
)

from .._base.crypto import NONCE, SealedJSON, derive_place, keyed_only

__all__ = ["audit", "entries", "facts", "metadata", "sagas"]

metadata = MetaData()

_ts = DateTime(timezone=True)


def _sealed(table: str, column: str, *, nullable: bool = True, container: bool = False,
            place: tuple[str, ...] = ("saga_id",)) -> Column[Any]:
    """A JSON column of user data: encrypted at rest when SAGAWORKER_ENCRYPTION_KEYS is set
    (``_crypto``), each value for its place (``place``: the columns of its row a value is
    sealed for); the same JSON/JSONB column in the database either way. ``container``:
    it always holds a dict (kwargs, metadata), never read as a kombu type tag itself."""
    return Column(column, SealedJSON(f"{table}.{column}", place, container),
                  nullable=nullable)


#: an entry's arguments are sealed for its saga and task id (its seq is given by the
#: statement that journals them, after they are sealed), its result for its saga and seq;
#: a saga's values, its entries' included, for its nonce too (``sagas.place_nonce``)
_CALL = ("saga_id", "task_id", NONCE)
_STEP = ("saga_id", "seq", NONCE)


sagas = Table(
    "sagaworker_sagas",
    metadata,
    Column("saga_id", String(200), primary_key=True),
    Column("status", String(32), nullable=False),
    Column("reason", Text),
    # this saga's own nonce, part of the place of each of its values (and its entries'):
    # a saga id used again after a prune never reads the pruned saga's values. Set when
    # the saga is journaled with SAGAWORKER_ENCRYPTION_KEYS (then every value of the saga
    # is sealed, and a clear one is refused); NULL otherwise, or before this column
    Column(NONCE, String(32)),
    _sealed("sagaworker_sagas", "metadata", nullable=False, container=True,
            place=("saga_id", NONCE)),
    Column("created_at", _ts, nullable=False),
    Column("updated_at", _ts, nullable=False),
    # next seq to hand out; bumped in the enqueue transaction
    Column("last_seq", Integer, nullable=False, default=0),
    # order of EXECUTED commits: bumped under the saga row lock with each EXECUTED
    Column("exec_counter", Integer, nullable=False, default=0),
    # order of undo outcomes (the report's order): bumped with each outcome
    Column("comp_counter", Integer, nullable=False, server_default="0"),
    # a failure was asked for (saga.fail or a FAILED step) but maybe not yet handled
    Column("fail_requested_at", _ts),
    Column("compensation_started_at", _ts),
    Column("finished_at", _ts),
    # last time the compensation chain moved (sweeper resumes a stalled chain)
    Column("chain_touched_at", _ts),
    # the token of the failure handler that started the chain, and of the chain that
    # closed it: a transaction replayed after a lost COMMIT recognises its own write
    Column("chain_token", String(32)),
    Column("closed_by", String(32)),
    # the sweeper resends a saga's lost message on a backoff, not on every pass
    Column("resend_at", _ts),
    Column("resends", Integer, nullable=False, server_default="0"),
    # flows and deadlines
    Column("deadline_at", _ts),
    Column("flow", String(300)),
    _sealed("sagaworker_sagas", "flow_args", place=("saga_id", NONCE)),
    _sealed("sagaworker_sagas", "flow_kwargs", container=True, place=("saga_id", NONCE)),
    # a flow's journaled return value (SagaResult.value)
    _sealed("sagaworker_sagas", "result", place=("saga_id", NONCE)),
    # the last time a worker advanced the flow (for people to read), and how many of the
    # flow's steps had an outcome in the journal that replay read: the sweeper re-sends
    # the advance while more steps have one (a count, never two hosts' clocks compared)
    Column("advanced_at", _ts),
    Column("advanced_seen", Integer),
    # the token of the move that asked the saga to fail (an operator's abort, a passed
    # deadline): replayed after a lost COMMIT, that move answers as its first run did
    Column("fail_token", String(32)),
    Column("idle_reported_at", _ts),
    # the W3C trace context of the saga's start span (OpenTelemetry, when configured):
    # the parent of its undos' and its flow's advance spans, in whichever process
    Column("trace_context", Text),
    # a flow held because its replay diverged from the journal: what the replay found
    # (logged again only when that changes), and when a replay last found it (the
    # sweeper replays a held flow again every SAGAWORKER_DIVERGED_RETRY seconds)
    Column("divergence", Text),
    Column("diverged_at", _ts),
    Index("ix_sagaworker_sagas_status_finished", "status", "finished_at"),
    Index("ix_sagaworker_sagas_created", "created_at"),
    Index("ix_sagaworker_sagas_deadline", "deadline_at"),
)

entries = Table(
    "sagaworker_entries",
    metadata,
    Column(
        "saga_id",
        String(200),
        ForeignKey("sagaworker_sagas.saga_id", ondelete="CASCADE"),
        primary_key=True,
    ),
    Column("seq", Integer, primary_key=True),
    Column("tool_name", String(300), nullable=False),
    Column("phase", String(32), nullable=False),
    _sealed("sagaworker_entries", "args", nullable=False, place=_CALL),
    _sealed("sagaworker_entries", "kwargs", nullable=False, container=True, place=_CALL),
    Column("args_digest", String(64), nullable=False),
    Column("queue", String(200)),
    Column("task_id", String(64)),
    _sealed("sagaworker_entries", "result", place=_STEP),
    Column("error", Text),
    Column("attempts", Integer, nullable=False, default=0),
    Column("created_at", _ts, nullable=False),
    Column("updated_at", _ts, nullable=False),
    Column("published_at", _ts),
    Column("started_at", _ts),
    # a running attempt holds the entry until this time (two deliveries never run at once)
    Column("lease_until", _ts),
    # who runs it, for people to read; no behaviour depends on it (tokens fence attempts)
    Column("worker", String(300)),
    # the running (or last) forward attempt's token: every write an attempt makes is a
    # compare-and-set on it, so a stale attempt, a late heartbeat or a replayed COMMIT
    # never touches a newer attempt
    Column("attempt_token", String(32)),
    # re-runs of an idempotent step whose attempt died (capped by SAGAWORKER_MAX_RERUNS)
    Column("reruns", Integer, nullable=False, server_default="0"),
    # releases of a claim stopped before its tool started (capped by SAGAWORKER_MAX_RERUNS;
    # Celery's retries are not releases); NULL: none
    Column("releases", Integer),
    # an attempt that raised waits for Celery's retry message, due at this time
    Column("retry_due_at", _ts),
    Column("celery_retries", Integer, nullable=False, server_default="0"),
    # the sweeper resends this entry's message on a backoff
    Column("resend_at", _ts),
    Column("resends", Integer, nullable=False, server_default="0"),
    Column("executed_at", _ts),
    Column("exec_order", Integer),
    Column("duration_ms", Float),
    Column("in_doubt", Boolean, nullable=False, default=False),
    # the token of the move that journaled this entry's outcome from outside its attempt
    # (a claim or a chain that found its worker lost, a claim that cancelled it):
    # replayed after a lost COMMIT, that move reports what it found again
    Column("decided_by", String(32)),
    # the caller's id for this step (an agent framework's tool-call id): one step per id
    Column("call_id", String(200)),
    # compensation
    Column("compensation", String(32)),
    Column("compensation_detail", Text),
    Column("compensation_attempts", Integer, nullable=False, default=0),
    Column("comp_lease_until", _ts),
    Column("comp_worker", String(300)),
    # the running (or last) undo try's token (the same fencing as attempt_token)
    Column("undo_token", String(32)),
    Column("compensated_at", _ts),
    # the order undos ran in (report order)
    Column("comp_order", Integer),
    # approval gate
    Column("approval_nonce", String(64)),
    Column("approval_requested_at", _ts),
    Column("approved_by", String(200)),
    Column("approved_at", _ts),
    Column("approved_digest", String(64)),
    # what only the approval secret makes: the approval's nonce and an HMAC over the
    # saga, the step, its task id, tool, arguments and approver (``signer.prove``); the
    # worker checks it before a gated tool runs (an approval written by SQL runs nothing)
    Column("approval_proof", String(128)),
    Column("rejected_by", String(200)),
    Column("rejected_at", _ts),
    Column("rejection_reason", Text),
    # tracing: the context of the step's enqueue span (the parent of each run of it, also
    # of a message the relay or the sweeper sent again), and of the run that journaled its
    # outcome (what the undo's span links to); NULL where nothing was traced
    Column("trace_context", Text),
    Column("span_context", Text),
    Index("ix_sagaworker_entries_phase_created", "phase", "created_at"),
    Index("ux_sagaworker_entries_call_id", "saga_id", "call_id", unique=True),
    # retention keeps the sagas with an in-doubt entry: without it, each batch of a prune
    # read the whole entries table to find the (few) in-doubt rows
    Index("ix_sagaworker_entries_in_doubt", "saga_id",
          postgresql_where=text("in_doubt IS true"), sqlite_where=text("in_doubt IS 1")),
)

#: an entry's saga's nonce, read beside its values by a process with keys (``keyed_only``:
#: a process without keys reads NULL, at no cost). The saga's id under a name of its own:
#: SQLite's RETURNING names columns without their table, and ``saga_id = saga_id`` would
#: compare the saga's id with itself
_saga = select(sagas.c.saga_id.label("place_saga"), sagas.c[NONCE]).subquery(
    "sagaworker_place")
derive_place(NONCE, lambda t: keyed_only(
    select(_saga.c[NONCE]).where(_saga.c.place_saga == t.c.saga_id).scalar_subquery()))

audit = Table(
    "sagaworker_audit",
    metadata,
    Column("id", Integer, primary_key=True, autoincrement=True),
    Column("saga_id", String(200), nullable=False),
    Column("seq", Integer),
    Column("action", String(64), nullable=False),
    Column("actor", String(200)),
    Column("detail", Text),
    Column("at", _ts, nullable=False),
    # the token of the move that wrote it: its replay after a lost COMMIT writes no second
    Column("token", String(32)),
    Index("ix_sagaworker_audit_saga", "saga_id", "at"),
)

#: what the journal knows about itself: the fingerprint of the encryption key its values
#: are sealed with (a worker holding no key, or another one, refuses to run a step)
facts = Table(
    "sagaworker_facts",
    metadata,
    Column("name", String(64), primary_key=True),
    Column("value", Text, nullable=False),
)
