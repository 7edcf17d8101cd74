"""The trip agent: an LLM agent (Pydantic AI) whose tools are saga steps.

It books a hotel room, charges the card (the order saga's own ``charge_card``) and mails
the voucher, an IRREVERSIBLE mail behind an approval gate. Each tool call the model makes
is one journaled step of the trip's saga; a declined card fails the saga, which cancels
the hotel; the voucher goes out only once a person approved it with the gate's signed
token (``sagaworker approve``, the dashboard), whatever the agent's own approval says.

The model: ``SAGAWORKER_AGENT_MODEL`` names a Pydantic AI model (``openai:gpt-4.1-mini``,
``anthropic:claude-sonnet-4-5``, ...), whose provider reads its own key from the
environment (``OPENAI_API_KEY``, ``ANTHROPIC_API_KEY``) and needs its package
(``pip install 'pydantic-ai-slim[openai]'``). Unset, a scripted model plays the agent,
offline: ``make agent-demo`` needs no key and no network.

The tools are declared with the rest of the example (the worker imports them); Pydantic
AI is imported only by the functions that run the agent, so a worker needs no agent
framework.
"""

from __future__ import annotations

import os
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from sagaworker import CompensationContext, Reversibility, Saga, SagaResult, ToolFailed

from . import _store as store
from ._app import sw
from .payment import charge_card

if TYPE_CHECKING:
    from pydantic_ai import Agent, DeferredToolRequests
    from pydantic_ai.messages import ModelMessage, ModelResponse
    from pydantic_ai.models import Model
    from pydantic_ai.models.function import AgentInfo

__all__ = ["TOOLS", "Trip", "book_hotel", "book_trip", "cancel_hotel", "chosen_model",
           "real_model", "scripted_model", "send_voucher", "trip_agent"]

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


def scripted_model(trip: Trip) -> Model:
    """The offline model: books, pays, mails the voucher, one call a turn, then says what
    it did. It reads where the trip stands from the conversation, so a resumed run (after
    the voucher's gate) carries on where the last one stopped."""
    from pydantic_ai.messages import ModelResponse, TextPart, ToolCallPart, ToolReturnPart
    from pydantic_ai.models.function import FunctionModel

    def respond(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
        done = {p.tool_name: p.content for m in messages for p in m.parts
                if isinstance(p, ToolReturnPart) and p.outcome == "success"}
        if "book_hotel" not in done:
            call = ToolCallPart("book_hotel", {"guest": trip.guest, "city": trip.city,
                                               "nights": trip.nights})
        elif "charge_card" not in done:
            call = ToolCallPart("charge_card", {"card": trip.card,
                                                "amount_cents": trip.nights * NIGHT_CENTS})
        elif "send_voucher" not in done:
            call = ToolCallPart("send_voucher", {"email": trip.email,
                                                 "booking": done["book_hotel"]})
        else:
            return ModelResponse(parts=[TextPart(
                f"Booked {trip.nights} nights in {trip.city} ({done['book_hotel']}), "
                f"charged {done['charge_card']}, mailed voucher {done['send_voucher']} "
                f"to {trip.email}.")])
        return ModelResponse(parts=[call])

    return FunctionModel(respond, model_name="scripted-trip-agent")


def real_model() -> str | None:
    """The Pydantic AI model ``SAGAWORKER_AGENT_MODEL`` names, if it is set."""
    return os.environ.get("SAGAWORKER_AGENT_MODEL", "").strip() or None


def chosen_model(trip: Trip) -> Model | str:
    """The real model if one is named, else the scripted one."""
    return real_model() or scripted_model(trip)


def trip_agent(saga: Saga, model: Model | str) -> Agent[None, str | DeferredToolRequests]:
    """The agent, its tools journaled as steps of ``saga`` (sagaworker's adapter); a run
    that reaches the voucher's gate ends with ``DeferredToolRequests``."""
    from pydantic_ai import Agent, DeferredToolRequests

    from sagaworker.agents.pydantic_ai import toolset

    return Agent(model, instructions=INSTRUCTIONS, output_type=[str, DeferredToolRequests],
                 toolsets=[toolset(saga, TOOLS)])


#: the person at the gate: returns once they decided (or not) on the deferred calls
Decide = Callable[[str, "DeferredToolRequests"], Awaitable[None]]


async def book_trip(trip: Trip, decide: Decide, *, model: Model | str | None = None,
                    say: Callable[[str], Any] = print, timeout: float = 60) -> SagaResult:
    """Book ``trip`` with the agent in a saga of its own; its SagaResult once it settled.

    A run that reaches the voucher's gate ends deferred: ``decide(saga_id, requests)`` is
    the person's turn (an approval or a rejection with the gate's signed token), then the
    run resumes with the calls approved in Pydantic AI's own terms. That approval alone
    decides nothing: a call whose gate holds no signed approval pends again, and the loop
    asks once more. A declined card or a rejected voucher ends the run with ToolFailed;
    the saga compensates (the hotel is cancelled)."""
    from pydantic_ai import DeferredToolRequests, DeferredToolResults

    saga = await sw.abegin(trip.saga_id, metadata={"guest": trip.guest, "via": "agent"},
                           deadline=3600)
    agent = trip_agent(saga, model or chosen_model(trip))
    try:
        result = await agent.run(trip.prompt())
        while isinstance(result.output, DeferredToolRequests):
            waiting = result.output
            say("the run paused at the gate of: " + ", ".join(
                f"{c.tool_name} (tool call {c.tool_call_id})" for c in waiting.approvals))
            await decide(saga.saga_id, waiting)
            result = await agent.run(message_history=result.all_messages(),
                                     deferred_tool_results=DeferredToolResults(approvals={
                                         c.tool_call_id: True for c in waiting.approvals}))
    except ToolFailed as exc:
        say(f"the run ended: {type(exc).__name__}: {exc}")
        return await saga.aresult(timeout)
    say(f"agent: {result.output}")
    await saga.acomplete()
    return await saga.aresult(timeout)
