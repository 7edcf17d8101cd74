"""Shipping: a dispatched parcel cannot be called back (IRREVERSIBLE, approval-gated)."""

from __future__ import annotations

from sagaworker import Reversibility

from . import _store as store
from ._app import sw


@sw.tool(reversibility=Reversibility.IRREVERSIBLE)
def dispatch_order(order_id: str) -> str:
    """Hand the parcel to the carrier; returns the shipment id."""
    shipment = store.new_id("ship")
    store.write(store.insert(store.shipments).values(id=shipment, order_id=order_id,
                                                     at=store.now()))
    return shipment


@sw.tool()
def quote_shipping(postcode: str) -> int:
    """A read-only lookup: declares no undo, so it is SKIPPED at compensation time."""
    return 499 if postcode.startswith("9") else 299
