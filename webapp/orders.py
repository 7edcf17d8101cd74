"""The order endpoint's two halves: strict validation of the body, and the background driver.

``POST /orders`` journals the saga (``sw.begin``) in the request, so a taken id is a 409
at once, and hands the rest of the order saga to a thread that runs it the way
``sw.saga`` does: each step enqueued and awaited, ``fail`` on any error, ``complete``
at the end. The journal is the state: ``GET /sagas/<id>`` reads it from any process.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import structlog

from sagaworker import Sagaworker, SagaworkerError, SyncSaga

if TYPE_CHECKING:  # the handles sw.begin() gives; only their public methods are used
    from sagaworker import Saga

__all__ = ["Order", "OrderFlow", "Runner", "ValidationFailed",
           "default_flow", "parse_order", "saga_id_for"]

log = structlog.get_logger("sagaworker.web")

#: ``flow(order)`` gives the work function, called with a :class:`sagaworker.SyncSaga`
OrderFlow = Callable[["Order"], Callable[[Any], Any]]

_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
_FIELDS = ("order_id", "sku", "quantity", "card", "amount_cents")
MAX_QUANTITY = 10_000
MAX_AMOUNT_CENTS = 100_000_000


class ValidationFailed(ValueError):
    """The body is not a valid order; ``reasons`` maps each bad field to why."""

    def __init__(self, reasons: dict[str, str]) -> None:
        super().__init__("; ".join(f"{k}: {v}" for k, v in reasons.items()))
        self.reasons = reasons


@dataclass(frozen=True)
class Order:
    order_id: str
    sku: str
    quantity: int
    card: str
    amount_cents: int

    @property
    def metadata(self) -> dict[str, Any]:
        """What the journal keeps about the order (never the full card number)."""
        return {"order_id": self.order_id, "sku": self.sku, "quantity": self.quantity,
                "amount_cents": self.amount_cents, "card_last4": self.card[-4:]}


def saga_id_for(order_id: str) -> str:
    return f"order-{order_id}"


def _text(body: dict[str, Any], key: str, reasons: dict[str, str], *, limit: int,
          pattern: re.Pattern[str] | None = None) -> str:
    value = body.get(key)
    if not isinstance(value, str):
        reasons[key] = f"must be a string, got {type(value).__name__}"
        return ""
    if not value.strip() or value != value.strip():
        reasons[key] = "must be non-empty, without leading or trailing spaces"
    elif len(value) > limit:
        reasons[key] = f"must be at most {limit} characters"
    elif pattern is not None and not pattern.match(value):
        reasons[key] = "must be letters, digits, '-', '_' or '.', starting with a letter or digit"
    return value


def _int(body: dict[str, Any], key: str, reasons: dict[str, str], *, low: int,
         high: int) -> int:
    value = body.get(key)
    if isinstance(value, bool) or not isinstance(value, int):
        reasons[key] = f"must be an integer, got {type(value).__name__}"
        return 0
    if not low <= value <= high:
        reasons[key] = f"must be between {low} and {high}"
    return value


def parse_order(body: Any) -> Order:
    """The order in ``body`` (decoded JSON), or ValidationFailed saying every problem."""
    if not isinstance(body, dict):
        raise ValidationFailed({"body": "must be a JSON object with the fields "
                                        + ", ".join(_FIELDS)})
    reasons: dict[str, str] = {}
    for key in sorted(set(body) - set(_FIELDS)):
        reasons[str(key)] = "unknown field"
    for key in _FIELDS:
        if key not in body:
            reasons[key] = "is required"
    order = Order(
        order_id=_text(body, "order_id", reasons, limit=64, pattern=_ID),
        sku=_text(body, "sku", reasons, limit=80),
        quantity=_int(body, "quantity", reasons, low=1, high=MAX_QUANTITY),
        card=_text(body, "card", reasons, limit=80),
        amount_cents=_int(body, "amount_cents", reasons, low=1, high=MAX_AMOUNT_CENTS),
    )
    if reasons:
        raise ValidationFailed({k: reasons[k] for k in sorted(reasons)})
    return order


def default_flow(order: Order) -> Callable[[Any], Any]:
    """The example's order saga: reserve -> quote shipping -> charge -> dispatch (gated)."""
    from tasks.orders import order_work

    return order_work(order.order_id, order.sku, order.quantity, order.card,  # type: ignore[no-any-return]
                      order.amount_cents)


@dataclass
class Runner:
    """Starts order sagas and drives each in its own thread."""

    sw: Sagaworker
    flow: OrderFlow = default_flow
    step_timeout: float = 300.0
    threads: dict[str, threading.Thread] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def start(self, order: Order) -> str:
        """Journal the saga (SagaExists when taken) and drive it in the background."""
        work = self.flow(order)
        saga = self.sw.begin(saga_id_for(order.order_id), metadata=order.metadata)
        t = threading.Thread(target=self.drive, args=(saga, work), daemon=True,
                             name=f"saga:{saga.saga_id}")
        with self._lock:
            self.threads = {k: v for k, v in self.threads.items() if v.is_alive()}
            self.threads[saga.saga_id] = t
        t.start()
        return saga.saga_id

    def drive(self, saga: Saga, work: Callable[[Any], Any]) -> None:
        """Run ``work`` like ``sw.saga`` does: any error fails the saga, which compensates."""
        with structlog.contextvars.bound_contextvars(saga_id=saga.saga_id):
            try:
                try:
                    work(SyncSaga(saga, self.step_timeout))
                except Exception as exc:
                    saga.fail(f"{type(exc).__name__}: {exc}")
                    return
                try:
                    saga.complete()
                except SagaworkerError as exc:  # a step FAILED even though work carried on
                    saga.fail(str(exc))
            except Exception:
                log.exception("order_saga_driver_crashed")

    def join(self, timeout: float = 30.0) -> None:
        """Wait for every running driver (tests, and a graceful shutdown)."""
        with self._lock:
            threads = list(self.threads.values())
        for t in threads:
            t.join(timeout)
