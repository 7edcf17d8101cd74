"""The trip's tools on a SQLite journal and kombu's memory transport, for the tests of the
MCP server in process (no worker runs the steps)."""

from __future__ import annotations

from typing import Any

import pytest

from sagaworker import CompensationContext, Reversibility, Sagaworker


@pytest.fixture
def sw(sqlite_sw: Sagaworker) -> Sagaworker:
    """A trip's three tools: a hotel (undo: cancel), a card charge (undo: refund, idempotent),
    a voucher mail (IRREVERSIBLE: gated)."""
    s = sqlite_sw

    @s.tool(compensable_by="cancel_hotel")
    def book_hotel(key: str, city: str, nights: int = 1) -> dict[str, Any]:
        """Book a hotel room in a city for a number of nights."""
        return {"booking": f"H-{city}"}

    @s.compensation
    def cancel_hotel(ctx: CompensationContext) -> None:
        """Cancel the booking."""

    @s.tool(compensable_by="refund_card", reversibility=Reversibility.REVERSIBLE,
            idempotent=True)
    def charge_card(key: str, card: str, amount_cents: int) -> str:
        """Charge a card."""
        return "charged"

    @s.compensation
    def refund_card(ctx: CompensationContext) -> None:
        """Refund it."""

    @s.tool(reversibility=Reversibility.IRREVERSIBLE)
    def send_voucher(key: str, email: str) -> str:
        """Mail the trip's voucher to a customer (cannot be unsent)."""
        return "sent"

    s.create_schema()
    return s
