"""The sweeper: finds from the journal what a lost message left behind and sends it again.

Run by Celery beat (``sagaworker.sweep``) and by every worker on a timer. Re-sending is
always safe (every handler is a compare-and-set against the journal), but not free: each
row is resent on a backoff (``resend_at``, doubling from ``SAGAWORKER_RELAY_AFTER`` up to
an hour), taken with a compare-and-set so that of many sweepers one resends it, and a long
queue is not multiplied by duplicates.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime
from typing import Any

import structlog
from sqlalchemy import and_, func, or_, select, update

from .._base.types import OPEN_VALUES, EntryRecord, Phase, SagaStatus
from .._base.units import is_unit
from .._journal.dialect import aware, db_now
from .._journal.raw_rows import opened, why_unreadable
from .._journal.rows import entry_record
from .._journal.schema import entries, sagas
from .._observe import tracing
from .._observe.logging import get_logger
from .._runtime import Runtime
from .resends import MAX_BACKOFF, Resends

#: an agent's model request's entry (``_base.units``: unit:<agent>__model.request...)
_MODEL_REQUESTS = "unit:%\\_\\_model.%"

__all__ = ["Sweeper"]

log = get_logger()
_BATCH = 500

_ASK_ROUNDS = 16  # rounds of asking the broker about a relay batch's queues
_OPEN = list(OPEN_VALUES)
_PENDING = [Phase.INTENT.value, Phase.AWAITING_APPROVAL.value]  # no outcome yet


class Sweeper:
    def __init__(self, rt: Runtime) -> None:
        self.rt = rt
        self.resends = Resends(rt)

    def orphans(self, older_than: float) -> list[EntryRecord]:
        return [entry_record(r) for r in _readable(self.rt.journal.orphans(older_than), self.rt)]

    def log_orphans(self) -> int:
        rows = self.rt.journal.orphans(self.rt.settings.orphan_after)
        t = self._clock() if rows else None
        for r in rows:
            log.error("orphan_intent", saga_id=r.saga_id, seq=r.seq, tool=r.tool_name,
                      task_id=r.task_id, age_s=round((t - aware(r.created_at)).total_seconds(), 1))  # type: ignore[operator]
        return len(rows)

    def _clock(self) -> datetime:
        """The database's clock (the journal's stamps are on it, never on this host's)."""
        with self.rt.journal.reader.connect() as conn:
            return aware(conn.execute(select(db_now())).scalar_one())  # type: ignore[return-value]

    def sweep(self) -> dict[str, int]:
        """One pass; returns how many of each kind of work it sent again."""
        counts = _each_stage({
            "deadlines": self._deadlines, "failures": self._failures,
            "chains": self._chains, "relayed": self._relay, "retries": self._retries,
            "in_doubt": self._in_doubt, "requests": self.requests, "flows": self._flows,
            "diverged": self._diverged,
            "idle": self._idle})
        if any(counts.values()):
            log.info("sweep", **counts)
        return counts

    # -- what a lost message leaves behind ----------------------------------------------

    def _failures(self) -> int:
        """Sagas asked to fail whose failure message never got handled."""
        rows = self.resends.sagas(and_(sagas.c.status.in_(_OPEN),
                                sagas.c.fail_requested_at.is_not(None),
                                sagas.c.fail_requested_at
                                < self.resends.ago(min(self.rt.settings.relay_after, 10.0))))
        for r in rows:
            with tracing.within(r.trace_context):
                self.rt.bus.send_failure(r.saga_id, r.reason or "saga failed")
        return len(rows)

    def _chains(self) -> int:
        """Compensation chains that stopped moving (their worker died, a message lost).
        A chain waits (no undo) while a forward step of its saga runs, and is resent on
        the usual backoff, doubling towards an hour. Once no forward step runs, the step
        it waited on has an outcome whose message should have resumed it: if that message
        was lost, the chain is resent at once and then on a short backoff (``lease`` at
        most), never left to the hour its long wait earned."""
        s = self.rt.settings
        stalled = and_(sagas.c.status == SagaStatus.COMPENSATING.value,
                       func.coalesce(sagas.c.chain_touched_at, sagas.c.updated_at)
                       < self.resends.ago(s.lease_seconds))
        running = select(entries.c.seq).where(
            entries.c.saga_id == sagas.c.saga_id, entries.c.phase == Phase.INTENT.value,
            entries.c.lease_until.is_not(None), entries.c.lease_until >= db_now()).exists()
        short = max(s.lease_seconds, s.relay_after)
        rows = [*self.resends.sagas(and_(stalled, running)),
                *self.resends.sagas(and_(stalled, ~running), cap=short)]
        for r in rows:
            with structlog.contextvars.bound_contextvars(saga_id=r.saga_id):
                log.warning("compensation_resumed")
            with tracing.within(r.trace_context):
                self.rt.bus.send_compensate(r.saga_id)
        return len(rows)

    def _deadlines(self) -> int:
        """Sagas past their deadline: failed (reason ``deadline passed``), they compensate."""
        rows = self.rt.journal.stale(
            select(sagas.c.saga_id).where(sagas.c.status.in_(_OPEN),
                                          sagas.c.fail_requested_at.is_(None),
                                          sagas.c.deadline_at < db_now()).limit(_BATCH))
        n = 0
        for r in rows:
            saga = _fail_overdue(self.rt, r.saga_id)
            if saga is None:
                continue
            n += 1
            log.warning("saga_deadline_passed", saga_id=r.saga_id,
                        deadline_at=aware(saga.deadline_at).isoformat())  # type: ignore[union-attr]
            self.rt.bus.send_failure(r.saga_id, "deadline passed")
        return n

    def _flows(self) -> int:
        """Flows with more steps that have an outcome than their last replay read (the
        advance was lost with the worker that journaled the outcome, or raced a replay
        that read the journal just before it, or that worker did not know the flow), or
        never replayed: sent again. A count, never two hosts' clocks compared. Other
        steps of the flow may still run or wait at a gate meanwhile."""
        quiet = self.resends.ago(self.rt.settings.relay_after)
        outcomes = (select(func.count()).select_from(entries)
                    .where(entries.c.saga_id == sagas.c.saga_id,
                           entries.c.phase.not_in(_PENDING)).scalar_subquery())
        rows = self.resends.sagas(and_(sagas.c.flow.is_not(None), sagas.c.status.in_(_OPEN),
                                sagas.c.fail_requested_at.is_(None),
                                sagas.c.divergence.is_(None),  # (held: _diverged's)
                                sagas.c.updated_at < quiet,
                                or_(sagas.c.advanced_seen.is_(None),
                                    outcomes > sagas.c.advanced_seen)))
        for r in rows:
            with structlog.contextvars.bound_contextvars(saga_id=r.saga_id):
                log.warning("flow_resumed", flow=r.flow)
            with tracing.within(r.trace_context):
                self.rt.bus.send_advance(r.saga_id)
        return len(rows)

    def _diverged(self) -> int:
        """Flows held on a divergence, replayed again at most every
        SAGAWORKER_DIVERGED_RETRY seconds: after a rollback or a fixed deploy they move on
        with nobody running ``flows resume``. Each is taken by a compare-and-set on its
        time, so two sweepers send one advance."""
        rows = self.rt.journal.stale(
            select(sagas.c.saga_id, sagas.c.diverged_at, sagas.c.trace_context).where(
                sagas.c.flow.is_not(None), sagas.c.status.in_(_OPEN),
                sagas.c.fail_requested_at.is_(None), sagas.c.divergence.is_not(None),
                sagas.c.diverged_at < self.resends.ago(self.rt.settings.diverged_retry))
            .limit(_BATCH))
        n = 0
        for r in rows:
            with self.rt.journal.engine.begin() as conn:
                got = conn.execute(update(sagas).where(
                    sagas.c.saga_id == r.saga_id, sagas.c.diverged_at == r.diverged_at)
                    .values(diverged_at=db_now())).rowcount
            if got:
                n += 1
                with tracing.within(r.trace_context):
                    self.rt.bus.send_advance(r.saga_id)
        return n

    def _idle(self) -> int:
        """Asynchronous sagas nobody drives: RUNNING, no step in flight, no write for
        SAGAWORKER_IDLE_AFTER seconds. Logged once per idle spell (its producer is gone
        and its effects are live: an operator completes or aborts it)."""
        busy = select(entries.c.saga_id).where(
            entries.c.saga_id == sagas.c.saga_id,
            (entries.c.phase.in_([Phase.INTENT.value, Phase.AWAITING_APPROVAL.value]))
            | (entries.c.updated_at > self.resends.ago(self.rt.settings.idle_after)))
        rows = self.rt.journal.stale(
            select(sagas.c.saga_id, sagas.c.updated_at).where(  # no user data: nothing to open
                sagas.c.flow.is_(None), sagas.c.status == SagaStatus.RUNNING.value,
                sagas.c.fail_requested_at.is_(None),
                sagas.c.updated_at < self.resends.ago(self.rt.settings.idle_after),
                or_(sagas.c.idle_reported_at.is_(None),
                    sagas.c.idle_reported_at < sagas.c.updated_at),
                ~busy.exists()).limit(_BATCH))
        n = 0
        t = self._clock() if rows else None
        for r in rows:
            with self.rt.journal.engine.begin() as conn:
                got = conn.execute(update(sagas).where(
                    sagas.c.saga_id == r.saga_id, sagas.c.updated_at == r.updated_at,
                    or_(sagas.c.idle_reported_at.is_(None),
                        sagas.c.idle_reported_at < sagas.c.updated_at))
                    .values(idle_reported_at=db_now())).rowcount
            if got:
                n += 1
                idle = (t - aware(r.updated_at)).total_seconds()  # type: ignore[operator]
                log.error("saga_idle", saga_id=r.saga_id, idle_s=round(idle, 1),
                          detail=f"RUNNING with no step in flight and no write for "
                                 f"{round(idle)} s: complete it, or run `sagaworker abort "
                                 f"{r.saga_id} --reason R`")
        return n

    def _open_saga(self) -> Any:
        return entries.c.saga_id.in_(select(sagas.c.saga_id).where(
            sagas.c.status.in_(_OPEN), sagas.c.fail_requested_at.is_(None),
            sagas.c.divergence.is_(None)))  # (held: refused, sent again once released)

    def _relay(self) -> int:
        """The outbox relay: INTENT journaled but never started (publish lost or refused).

        A step not started after ``relay_after`` is either lost or still waiting in a
        queue behind others. Resending the waiting ones would multiply a backlog (every
        copy is one more message and one more claim to refuse), so rows of a queue the
        broker says holds messages are left until it drains, or for an hour at most.
        """
        since = func.coalesce(entries.c.published_at, entries.c.created_at)
        lost = and_(entries.c.phase == Phase.INTENT.value, entries.c.started_at.is_(None),
                    since < self.resends.ago(self.rt.settings.relay_after))
        found = self._unqueued(and_(lost, self._open_saga()), since, "relay_deferred")
        # the take re-checks the row, not the saga (a subquery per row), as _take does
        return self._resend(self.resends.claim(entries, ["saga_id", "seq"], found, lost),
                            "step_relayed")

    def _unqueued(self, where: Any, since: Any, event: str) -> list[Any]:
        """Rows matching ``where`` due for a resend, but none of a queue the broker says
        holds messages (the step's message may be waiting there: a copy would multiply the
        backlog) unless ``since`` is an hour old; ``event`` logged for the queues held."""
        keys = ["saga_id", "seq"]
        old = since < self.resends.ago(MAX_BACKOFF)
        held: list[Any] = []
        routes: dict[tuple[str, str | None], str | None] = {}  # (tool, queue) -> broker queue
        depth: dict[str, int] = {}  # broker queue -> messages ready, asked once a pass
        # the batch's queues are asked; rows of a busy one are set aside and the batch
        # taken again (the next rows may be of other queues), until every queue the
        # batch holds has been asked: one round in the usual case, a few at most
        for _ in range(_ASK_ROUNDS):
            found = self.resends.due(entries, keys, and_(where, *held))
            busy = _busy(self.rt.bus, {(r.tool_name, r.queue) for r in found} - routes.keys(),
                         routes, depth, event)
            if not busy:
                break
            # NOT DISTINCT FROM: a NULL queue compared with "=" would make the condition
            # NULL and set aside rows of other queues too
            held += [or_(old, ~and_(entries.c.tool_name == t,
                                    entries.c.queue.is_not_distinct_from(q)))
                     for t, q in busy]
        else:  # rounds used up: rows of queues not asked about wait for the next pass
            found = [r for r in self.resends.due(entries, keys, and_(where, *held))
                     if (r.tool_name, r.queue) in routes]
        return found

    def _retries(self) -> int:
        """Attempts that raised whose Celery retry message never came (lost with a worker
        that held it, a purged queue): sent again with their retry count. Not while the
        step's queue holds messages, as the relay: the retry may be waiting there, or in a
        busy worker, its ETA past (a copy would run the step once more per resend: each
        copy's run asked for a retry of its own)."""
        since = func.coalesce(entries.c.retry_due_at, entries.c.updated_at)
        waiting = and_(entries.c.phase == Phase.INTENT.value,
                       entries.c.started_at.is_not(None), entries.c.lease_until.is_(None),
                       since < self.resends.ago(self.rt.settings.relay_after))
        found = self._unqueued(and_(waiting, self._open_saga()), since, "retry_deferred")
        # the take re-checks the row, not the saga (a subquery per row)
        return self._resend(self.resends.claim(entries, ["saga_id", "seq"], found, waiting),
                            "step_retry_resent")

    def _in_doubt(self, requests: bool = False) -> int:
        """Started attempts whose lease lapsed with no outcome: delivered again, the claim
        decides (re-run an idempotent tool, or journal it in doubt). ``requests``: agents'
        model requests instead, which are never in doubt: their flows are advanced again
        and they are re-sent (``requests``, also on a timer of its own)."""
        asked = entries.c.tool_name.like(_MODEL_REQUESTS, escape="\\")
        rows = self.resends.entries(and_(entries.c.phase == Phase.INTENT.value,
                                  entries.c.lease_until.is_not(None),
                                  entries.c.lease_until < db_now(),
                                  asked if requests else ~asked))
        return self._resend(rows, None)

    def requests(self) -> int:
        """Agents' model requests whose worker stopped beating (SAGAWORKER_UNIT_LEASE):
        a worker runs this every lease, so a killed worker's run goes on in seconds."""
        return self._in_doubt(requests=True)

    def _resend(self, rows: list[Any], event: str | None) -> int:
        publish: Callable[..., bool] = self.rt.bus.publish_step
        rows = _readable(rows, self.rt, ("args", "kwargs"))
        for r in rows:
            if event:
                log.warning(event, saga_id=r.saga_id, seq=r.seq, tool=r.tool_name,
                            task_id=r.task_id, resends=r.resends + 1)
            if is_unit(r.tool_name):  # run by a flow's replay: its flow is advanced again
                with tracing.within(r.trace_context):
                    self.rt.bus.send_advance(r.saga_id)
                continue
            with tracing.within(r.trace_context):  # a traced publish joins the saga's trace
                publish(r.saga_id, r.seq, r.tool_name, list(r.args), dict(r.kwargs),
                        r.task_id, r.queue, retries=r.celery_retries)
        return len(rows)


def _busy(bus: Any, pairs: set[tuple[str, str | None]],
          routes: dict[tuple[str, str | None], str | None], depth: dict[str, int],
          event: str) -> list[tuple[str, str | None]]:
    """Of ``pairs`` (tool, queue), those whose broker queue has messages waiting; the
    broker is asked only about queues this pass has not asked about yet (``routes`` and
    ``depth`` hold what it knows); ``event`` is logged with the busy queues."""
    for p in pairs:
        routes[p] = bus.queue_of(*p)
    ask = {q for p in pairs if (q := routes[p]) is not None} - depth.keys()
    if ask:  # a queue the broker cannot tell about counts as empty
        depth.update(dict.fromkeys(ask, 0) | bus.ready(ask))
    busy = sorted((p for p in pairs if depth.get(routes[p] or "", 0) > 0), key=str)
    if busy:
        log.info(event, queues=sorted({str(routes[p]) for p in busy}),
                 detail="their queues hold messages: the steps may be waiting there")
    return busy


def _each_stage(stages: dict[str, Callable[[], int]]) -> dict[str, int]:
    """Run each stage on its own: one that fails is logged (``sweep_stage_failed``) and
    counts 0, the others still run (no row of one kind stops the relay on every worker)."""
    counts = {}
    for name, stage in stages.items():
        try:
            counts[name] = stage()
        except Exception as exc:  # a database blip, a row no read expected
            counts[name] = 0
            log.error("sweep_stage_failed", stage=name, error=f"{type(exc).__name__}: {exc}")
    return counts


def _readable(rows: list[Any], rt: Runtime, only: tuple[str, ...] | None = None) -> list[Any]:
    """Entry rows fetched as stored (``raw_select``), opened (the columns ``only`` names,
    if given); one that cannot be is logged and skipped, the pass goes on (a step the relay
    took stays on its backoff)."""
    out = []
    for raw in rows:
        try:
            out.append(opened(raw, entries, rt.journal.engine.dialect, only))
        except Exception as exc:
            _unreadable(exc, saga_id=raw.saga_id, seq=raw.seq, tool=raw.tool_name)
    return out


def _fail_overdue(rt: Runtime, saga_id: str) -> Any:
    """``fail_overdue``; a saga whose row cannot be read is logged and skipped (None), so
    one such saga never stops the deadlines of the others, nor the stages after them."""
    try:
        return rt.machine.fail_overdue(saga_id)
    except Exception as exc:
        _unreadable(exc, saga_id=saga_id)
        return None


def _unreadable(exc: Exception, **row: Any) -> None:
    """A row the sweeper skipped: logged, the pass goes on."""
    log.warning("sweep_row_unreadable", error=why_unreadable(exc), **row)

