"""The example application: an order saga of inventory, payment and shipping, and a
trip-booking LLM agent whose tool calls are saga steps (``agent``).

``celery -A tasks worker`` (or ``sagaworker worker``) consumes its tools and
sagaworker's own queue.
"""

from __future__ import annotations

from . import agent, inventory, payment, shipping
from ._app import app, sw
from .orders import place_order

__all__ = ["agent", "app", "inventory", "payment", "place_order", "shipping", "sw"]
