"""The order saga: reserve inventory -> quote shipping -> charge card -> dispatch (gated).

``place_order`` is the order as a durable flow (SPEC 12): a web app starts it with
``sw.start(...)`` and returns; the workers carry it forward from the journal, across
restarts of every process, for as long as the approval gate waits. ``order_work`` is the
same saga for the synchronous form (``sw.saga``), where the caller's thread waits.
"""

from __future__ import annotations

from typing import Any

from sagaworker import FlowContext

from ._app import sw
from .inventory import reserve_inventory
from .payment import charge_card
from .shipping import dispatch_order, quote_shipping

__all__ = ["order_work", "place_order"]


@sw.flow()
def place_order(s: FlowContext, order_id: str, sku: str, quantity: int, card: str,
                amount_cents: int, postcode: str = "10115") -> dict[str, Any]:
    """The order flow: each ``s.call`` is a journaled step; the gated dispatch waits for
    its approval with no thread anywhere."""
    hold = s.call(reserve_inventory, sku, quantity)
    shipping = s.call(quote_shipping, postcode)
    charge = s.call(charge_card, card, amount_cents + shipping)
    shipment = s.call(dispatch_order, order_id)
    return {"hold": hold, "charge": charge, "shipment": shipment}


def order_work(order_id: str, sku: str, quantity: int, card: str, amount_cents: int,
               postcode: str = "10115") -> Any:
    """The same saga as a work function for the synchronous form, ``sw.saga(id, work)``."""
    def work(s: Any) -> dict[str, Any]:
        hold = s.call(reserve_inventory, sku, quantity)
        shipping = s.call(quote_shipping, postcode)
        charge = s.call(charge_card, card, amount_cents + shipping)
        shipment = s.call(dispatch_order, order_id)
        return {"hold": hold, "charge": charge, "shipment": shipment}

    return work
