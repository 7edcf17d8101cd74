"""Stock: a hold is placed (REVERSIBLE: releasing it erases the effect)."""

from __future__ import annotations

from sagaworker import CompensationContext, Reversibility

from . import _store as store
from ._app import sw


class OutOfStock(Exception):
    pass


@sw.tool(compensable_by="release_inventory", reversibility=Reversibility.REVERSIBLE)
def reserve_inventory(sku: str, quantity: int) -> str:
    """Hold ``quantity`` of ``sku``; returns the hold id."""
    if quantity <= 0 or sku.startswith("sold-out"):
        raise OutOfStock(f"{sku}: cannot hold {quantity}")
    hold = store.new_id("hold")
    store.write(store.insert(store.holds).values(id=hold, sku=sku, quantity=quantity,
                                                 state="held", at=store.now()))
    return hold


@sw.compensation
def release_inventory(ctx: CompensationContext) -> None:
    """Release the hold (idempotent: releasing twice is a no-op)."""
    store.write(store.update(store.holds).where(store.holds.c.id == ctx.result)
                .values(state="released"))
