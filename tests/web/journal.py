"""A test Sagaworker on SQLite with order-like tools, and helpers that write journal state
directly (through the journal's transitions) so no Celery worker is needed."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

from celery import Celery
from sqlalchemy import update

from sagaworker import CompensationContext, FlowContext, Reversibility, Sagaworker, Settings
from sagaworker._journal.repository import now
from sagaworker._journal.schema import audit, entries
from sagaworker.web.auth import WebAuth, hash_token

SECRET = "web-tests-approval-secret-0123456789abcdef"
#: operator tokens of the test apps (``operators()``): the journal records these names
ALICE_TOKEN = "swop_alice-web-tests-0123456789abcdefghijklmnopq"
BOB_TOKEN = "swop_bob-web-tests-0123456789abcdefghijklmnopqrs"


def operators() -> WebAuth:
    """Operator tokens for alice and bob, stored hashed as SAGAWORKER_WEB_TOKENS would be,
    and anonymous reads on (SAGAWORKER_WEB_ANONYMOUS_READS=true, as an operator may choose):
    the ``client`` fixture reads as anyone who reaches the app."""
    return WebAuth(tokens=[("alice", hash_token(ALICE_TOKEN)), ("bob", hash_token(BOB_TOKEN))],
                   anonymous_reads=True)


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def audit_rows(sw: Sagaworker, saga_id: str) -> list[tuple[str, str | None, str | None]]:
    """The saga's operator actions (abort, retry_compensation) as (action, actor, detail)."""
    from sqlalchemy import select

    with sw.journal.engine.connect() as conn:
        rows = conn.execute(select(audit.c.action, audit.c.actor, audit.c.detail)
                            .where(audit.c.saga_id == saga_id).order_by(audit.c.at)).all()
    return [(r.action, r.actor, r.detail) for r in rows]


class Declined(Exception):
    pass


@dataclass(frozen=True)
class Tools:
    reserve: Any
    quote: Any
    charge: Any
    dispatch: Any


def make_sw(db: Path, *, eager: bool = False) -> tuple[Sagaworker, Tools]:
    """A Sagaworker on a SQLite file with reserve/quote/charge/dispatch tools.

    ``charge`` fails for cards starting with ``declined``; its undo (a refund) fails for
    cards starting with ``stuck``, which leaves the saga dirty. ``eager`` runs every task
    inline (Celery's ``task_always_eager``), so whole sagas run without a worker.
    """
    app = Celery("t", broker="memory://")
    app.conf.task_always_eager = eager
    sw = Sagaworker(app, database_url=f"sqlite:///{db}",
                    settings=Settings(approval_secret=SECRET, compensation_retries=0,
                                      compensation_backoff=0, sweep_interval=0))

    @sw.tool(compensable_by="release", reversibility=Reversibility.REVERSIBLE)
    def reserve(sku: str, quantity: int) -> str:
        return f"hold-{sku}-{quantity}"

    @sw.compensation
    def release(ctx: CompensationContext) -> None:
        pass

    @sw.tool()
    def quote(postcode: str) -> int:
        return 299

    @sw.tool(compensable_by="refund")
    def charge(card: str, amount_cents: int) -> str:
        if card.startswith("declined"):
            raise Declined(f"card {card} declined {amount_cents} cents")
        return f"ch-{card}"

    @sw.compensation
    def refund(ctx: CompensationContext) -> None:
        if str(ctx.args[0]).startswith("stuck"):
            raise ConnectionError("payment API timed out (HTTP 504) refunding "
                                  f"{ctx.result}")

    @sw.tool(reversibility=Reversibility.IRREVERSIBLE)
    def dispatch(order_id: str) -> str:
        return f"ship-{order_id}"

    sw.flow()(order_flow)
    sw.validate()
    return sw, Tools(reserve, quote, charge, dispatch)


def order_flow(s: FlowContext, order_id: str, sku: str, quantity: int, card: str,
               amount_cents: int) -> dict[str, Any]:
    """The webapp's order flow over the test tools (the shape of tasks.orders.place_order),
    registered on every test Sagaworker by ``make_sw``."""
    hold = s.call(f"{__name__}.reserve", sku, quantity)
    shipping = s.call(f"{__name__}.quote", "10115")
    charge = s.call(f"{__name__}.charge", card, amount_cents + shipping)
    return {"hold": hold, "charge": charge,
            "shipment": s.call(f"{__name__}.dispatch", order_id)}


# -- writing journal state by hand ----------------------------------------------------------

def run_step(sw: Sagaworker, saga_id: str, seq: int, result: Any) -> None:
    """The worker's part of one step: claim the attempt, journal EXECUTED."""
    tool = sw.journal.entry_row(saga_id, seq).tool_name
    sw.machine.claim_start(saga_id, seq, tool, token=f"t{seq}", worker="test|0",
                           idempotent=False, task_id=None)
    sw.machine.executed(saga_id, seq, f"t{seq}", result, 12.5)


def fail_step(sw: Sagaworker, saga_id: str, seq: int, error: str) -> None:
    tool = sw.journal.entry_row(saga_id, seq).tool_name
    sw.machine.claim_start(saga_id, seq, tool, token=f"t{seq}", worker="test|0",
                           idempotent=False, task_id=None)
    sw.machine.failed(saga_id, seq, f"t{seq}", error)


def lose_worker(sw: Sagaworker, saga_id: str, seq: int) -> None:
    """The step started and its worker vanished: a lapsed lease and no outcome."""
    tool = sw.journal.entry_row(saga_id, seq).tool_name
    sw.machine.claim_start(saga_id, seq, tool, token=f"t{seq}", worker="gone-host|1",
                           idempotent=False, task_id=None)
    with sw.journal.engine.begin() as conn:  # its lease lapsed
        conn.execute(update(entries).where(entries.c.saga_id == saga_id, entries.c.seq == seq)
                     .values(lease_until=now() - timedelta(seconds=1)))


def completed(sw: Sagaworker, tools: Tools, saga_id: str) -> None:
    saga = sw.begin(saga_id, metadata={"order_id": saga_id})
    for seq, (tool, args) in enumerate([(tools.reserve, ("sku-1", 1)),
                                        (tools.quote, ("10115",)),
                                        (tools.charge, ("card-4242", 3299))], start=1):
        saga.enqueue(tool, *args)
        run_step(sw, saga_id, seq, f"r{seq}")
    saga.complete()


def compensated(sw: Sagaworker, tools: Tools, saga_id: str, *, card: str = "declined-1",
                in_doubt: bool = False) -> None:
    """reserve + quote EXECUTED, then charge FAILED (or lost: in doubt); compensation runs.

    With ``card`` starting ``stuck`` the charge EXECUTES and a later step fails, so the
    refund runs and fails: the saga ends COMPENSATION_FAILED (dirty).
    """
    saga = sw.begin(saga_id, metadata={"order_id": saga_id, "card_last4": card[-4:]})
    saga.enqueue(tools.reserve, "sku-7", 2)
    run_step(sw, saga_id, 1, "hold-sku-7-2")
    saga.enqueue(tools.quote, "10115")
    run_step(sw, saga_id, 2, 299)
    saga.enqueue(tools.charge, card, 1799)
    if card.startswith("stuck"):
        run_step(sw, saga_id, 3, "ch-stuck")
        saga.enqueue(tools.reserve, "sku-8", 1)
        fail_step(sw, saga_id, 4, "OutOfStock: sku-8: cannot hold 1")
        reason = "step 4 (reserve) failed: OutOfStock: sku-8: cannot hold 1"
    elif in_doubt:
        lose_worker(sw, saga_id, 3)
        reason = "step 3 (charge) in doubt"
        sw.machine.request_failure(saga_id, reason)
    else:
        fail_step(sw, saga_id, 3, f"Declined: card {card} declined 2098 cents")
        reason = f"step 3 (charge) failed: Declined: card {card} declined 2098 cents"
    sw.compensator.handle_failure(saga_id, reason)


def awaiting_approval(sw: Sagaworker, tools: Tools, saga_id: str) -> None:
    saga = sw.begin(saga_id, metadata={"order_id": saga_id})
    saga.enqueue(tools.reserve, "sku-3", 1)
    run_step(sw, saga_id, 1, "hold-sku-3-1")
    saga.enqueue(tools.dispatch, saga_id)


def running(sw: Sagaworker, tools: Tools, saga_id: str) -> None:
    saga = sw.begin(saga_id)
    saga.enqueue(tools.reserve, "sku-9", 4)
