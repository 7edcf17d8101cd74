"""An app whose tool names an undo that does not exist: its worker must refuse to boot."""

from __future__ import annotations

from celery import Celery

from sagaworker import CompensationContext, Sagaworker

app = Celery("tests.apps.bad")
sw = Sagaworker(app)


@sw.tool(compensable_by="relase_inventory")
def reserve_inventory(sku: str) -> str:
    return sku


@sw.compensation
def release_inventory(ctx: CompensationContext) -> None:
    pass
