"""Payment: a charge is a fact; its undo is a new fact, a refund (COMPENSATABLE)."""

from __future__ import annotations

from sagaworker import CompensationContext

from . import _store as store
from ._app import sw


class CardDeclined(Exception):
    """The card was declined. Its text never carries the card number: an error's text is
    journaled and logged (``step_failed``, the saga's reason, Celery's failure line)."""


@sw.tool(compensable_by="refund_card", autoretry_for=(ConnectionError,), max_retries=3,
         retry_backoff=True)
def charge_card(card: str, amount_cents: int) -> str:
    """Charge the card; returns the charge id. Cards starting with 'declined' fail."""
    if card.startswith("declined"):
        raise CardDeclined(f"card declined for {amount_cents} cents")
    charge = store.new_id("ch")
    store.write(store.insert(store.charges).values(id=charge, card=card,
                                                   amount_cents=amount_cents, state="charged",
                                                   at=store.now()))
    return charge


@sw.compensation
def refund_card(ctx: CompensationContext) -> None:
    """Refund the charge. The idempotency key makes a retried refund a no-op upstream."""
    store.write(store.update(store.charges)
                .where(store.charges.c.id == ctx.result, store.charges.c.refund_key.is_(None))
                .values(state="refunded", refund_key=ctx.idempotency_key))
