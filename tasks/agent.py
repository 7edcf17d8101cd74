"""The trip agent: an LLM agent (Pydantic AI) that runs durably inside a flow.

It books a hotel room, charges the card (the order saga's own ``charge_card``) and mails
the voucher, an IRREVERSIBLE mail behind an approval gate. The agent runs inside the flow
``trip_flow`` with sagaworker's ``Durability``: each model request is a journaled step of
the trip's saga (sent once: a worker killed mid-run is replayed by another from the
journal without asking the model again), each tool call a saga step. A declined card fails
the saga, which cancels the hotel; the voucher goes out only once a person approved it
with the gate's signed token (``sagaworker approve``, the dashboard), and while it waits
no process runs the agent.

The model: ``SAGAWORKER_AGENT_MODEL`` names a Pydantic AI model (``openai:gpt-4.1-mini``,
``anthropic:claude-sonnet-4-5``, ...), whose provider reads its own key from the
environment (``OPENAI_API_KEY``, ``ANTHROPIC_API_KEY``) and needs its package
(``pip install 'pydantic-ai-slim[openai]'``). Unset, a scripted model plays the agent,
offline: ``make agent-demo`` needs no key and no network.

Pydantic AI is imported only when the agent first runs, so a worker that never runs a
trip needs no agent framework.
"""

from __future__ import annotations

import os
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from sagaworker import CompensationContext, FlowContext, Reversibility, Saga

from . import _store as store
from ._app import sw
from .payment import charge_card

if TYPE_CHECKING:
    from pydantic_ai import Agent
    from pydantic_ai.messages import ModelMessage, ModelResponse
    from pydantic_ai.models import Model
    from pydantic_ai.models.function import AgentInfo

__all__ = ["TOOLS", "Trip", "book_hotel", "cancel_hotel", "real_model", "scripted_model",
           "send_voucher", "start_trip", "trip_agent", "trip_flow"]

#: what a night costs, in cents (the agent is told; the scripted model charges it)
NIGHT_CENTS = 12_000
INSTRUCTIONS = (
    "You are a travel agent. To book a trip: book the hotel room, then charge the card "
    f"{NIGHT_CENTS} cents a night, then mail the voucher for the booking. Use the tools, "
    "one at a time, and never make up a booking id.")


@sw.tool(compensable_by="cancel_hotel")
def book_hotel(guest: str, city: str, nights: int) -> str:
    """Book a hotel room for a guest in a city for a number of nights; returns the
    booking id."""
    booking = store.new_id("bk")
    store.write(store.insert(store.bookings).values(id=booking, guest=guest, city=city,
                                                    nights=nights, state="booked",
                                                    at=store.now()))
    return booking


@sw.compensation
def cancel_hotel(ctx: CompensationContext) -> None:
    """Cancel the booking (idempotent: cancelling twice changes nothing)."""
    store.write(store.update(store.bookings).where(store.bookings.c.id == ctx.result)
                .values(state="cancelled"))


@sw.tool(reversibility=Reversibility.IRREVERSIBLE)
def send_voucher(email: str, booking: str) -> str:
    """Mail the voucher of a booking to the guest's email address (a mail cannot be
    unsent); returns the voucher id."""
    voucher = store.new_id("vc")
    store.write(store.insert(store.vouchers).values(id=voucher, email=email, booking=booking,
                                                    at=store.now()))
    return voucher


TOOLS = (book_hotel, charge_card, send_voucher)


@dataclass(frozen=True)
class Trip:
    """What the guest asked for."""

    trip_id: str
    guest: str
    city: str
    nights: int
    card: str  # a card token, never a card number: the prompt goes to the model
    email: str

    @property
    def saga_id(self) -> str:
        return f"trip-{self.trip_id}"

    def prompt(self) -> str:
        return (f"Book {self.nights} nights in {self.city} for {self.guest}, pay with card "
                f"{self.card}, and mail the voucher to {self.email}.")


_PROMPT = re.compile(r"Book (\d+) nights in (.+) for (.+), pay with card (\S+), and mail "
                     r"the voucher to (\S+)\.$")


def scripted_model() -> Model:
    """The offline model: books, pays, mails the voucher, one call a turn, then says what
    it did. It reads the trip from the guest's request and where it stands from the
    conversation, so a replayed run carries on where the journal says."""
    from pydantic_ai.messages import (
        ModelResponse,
        TextPart,
        ToolCallPart,
        ToolReturnPart,
        UserPromptPart,
    )
    from pydantic_ai.models.function import FunctionModel

    def respond(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
        asked = next(str(p.content) for m in messages for p in m.parts
                     if isinstance(p, UserPromptPart))
        found = _PROMPT.match(asked)
        assert found is not None, asked
        nights, city, guest, card, email = found.groups()
        done = {p.tool_name: p.content for m in messages for p in m.parts
                if isinstance(p, ToolReturnPart) and p.outcome == "success"}
        _demo_request(guest, len(done))
        if "book_hotel" not in done:
            call = ToolCallPart("book_hotel", {"guest": guest, "city": city,
                                               "nights": int(nights)})
        elif "charge_card" not in done:
            call = ToolCallPart("charge_card", {"card": card,
                                                "amount_cents": int(nights) * NIGHT_CENTS})
        elif "send_voucher" not in done:
            call = ToolCallPart("send_voucher", {"email": email,
                                                 "booking": done["book_hotel"]})
        else:
            return ModelResponse(parts=[TextPart(
                f"Booked {nights} nights in {city} ({done['book_hotel']}), charged "
                f"{done['charge_card']}, mailed voucher {done['send_voucher']} to {email}.")])
        return ModelResponse(parts=[call])

    return FunctionModel(respond, model_name="scripted-trip-agent")


def _demo_request(guest: str, turn: int) -> None:
    """In ``make agent-demo`` (TRIP_DEMO_FOLDER set): every request the model serves is a
    line of ``model-requests.log``, and the first of the guest ``TRIP_DEMO_PAUSE`` names
    takes 60 s (the demo kills its worker meanwhile)."""
    folder = os.environ.get("TRIP_DEMO_FOLDER")
    if not folder:
        return
    log = Path(folder) / "model-requests.log"
    first = f"{guest} {turn}\n" not in (log.read_text() if log.exists() else "")
    with log.open("a") as f:
        f.write(f"{guest} {turn}\n")
    if first and turn == 0 and guest == os.environ.get("TRIP_DEMO_PAUSE"):
        time.sleep(60)


def real_model() -> str | None:
    """The Pydantic AI model ``SAGAWORKER_AGENT_MODEL`` names, if it is set."""
    return os.environ.get("SAGAWORKER_AGENT_MODEL", "").strip() or None


_AGENT: list[Agent[None, str]] = []


def trip_agent() -> Agent[None, str]:
    """The agent (one per process, built on first use): durable inside a flow, its tools
    steps of the flow's saga."""
    if not _AGENT:
        from pydantic_ai import Agent

        from sagaworker.agents.pydantic_ai import Durability, flow_toolset

        _AGENT.append(Agent(real_model() or scripted_model(), name="trip",
                            instructions=INSTRUCTIONS, output_type=str,
                            capabilities=[Durability(sw)], toolsets=[flow_toolset(TOOLS)]))
    return _AGENT[0]


@sw.flow()
async def trip_flow(s: FlowContext, trip_id: str, guest: str, city: str, nights: int,
                    card: str, email: str) -> str:
    """The trip as a durable flow: the agent's run lives in the journal."""
    trip = Trip(trip_id, guest, city, nights, card, email)
    result = await trip_agent().run(trip.prompt())
    return result.output


def start_trip(trip: Trip) -> Saga:
    """Hand the trip to the workers; returns at once (no process here runs the agent)."""
    return sw.start(trip.saga_id, trip_flow, trip.trip_id, trip.guest, trip.city, trip.nights,
                    trip.card, trip.email, metadata={"guest": trip.guest, "via": "agent"},
                    deadline=86400)
