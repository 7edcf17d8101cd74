"""The order saga: reserve inventory -> charge card -> dispatch (after approval)."""

from __future__ import annotations

from typing import Any

from sagaworker import SagaResult

from ._app import sw
from .inventory import reserve_inventory
from .payment import charge_card
from .shipping import dispatch_order, quote_shipping


def order_work(order_id: str, sku: str, quantity: int, card: str, amount_cents: int,
               postcode: str = "10115") -> Any:
    def work(s: Any) -> dict[str, Any]:
        hold = s.call(reserve_inventory, sku, quantity)
        shipping = s.call(quote_shipping, postcode)
        charge = s.call(charge_card, card, amount_cents + shipping)
        shipment = s.call(dispatch_order, order_id)
        return {"hold": hold, "charge": charge, "shipment": shipment}

    return work


def place_order(order_id: str, *, sku: str, quantity: int, card: str, amount_cents: int,
                timeout: float = 300) -> SagaResult:
    """Run the order saga synchronously (a script or a worker-side job)."""
    return sw.saga(f"order-{order_id}", order_work(order_id, sku, quantity, card, amount_cents),
                   metadata={"order_id": order_id}, timeout=timeout)
