"""The example application: an order saga of inventory, payment and shipping.

``celery -A tasks worker`` (or ``sagaworker worker``) consumes its tools and
sagaworker's own queue.
"""

from __future__ import annotations

from celery import Celery

from sagaworker import Sagaworker

app = Celery("tasks")
app.config_from_object("config.celery")
sw = Sagaworker(app)

from . import inventory, payment, shipping  # noqa: E402  (the tools need `sw`)
from .orders import place_order  # noqa: E402

__all__ = ["app", "inventory", "payment", "place_order", "shipping", "sw"]
