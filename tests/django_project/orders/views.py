"""``POST /orders``: an Order and its saga in one transaction."""

import json

from django.db import transaction
from django.dispatch import Signal
from django.http import HttpRequest, HttpResponse, JsonResponse
from django.views.decorators.csrf import csrf_exempt
from django.views.decorators.http import require_POST

from sagaworker.contrib.django import begin, enqueue, start
from tests.apps.cluster import three_steps
from tests.django_project.orders.models import Order
from tests.django_project.shop import sagas

#: sent once an order's transaction committed (an on_commit hook the app registers before
#: it starts the saga, so it runs before sagaworker's own)
order_placed = Signal()


@csrf_exempt
@require_POST
def create_order(request: HttpRequest) -> HttpResponse:
    """Body: ``{"id", "quantity", "saga": "flow" | "steps", "fail": bool}``. A flow
    (``three_steps``), or a saga begun with one step enqueued; ``fail``: the view raises
    after both (the transaction rolls back)."""
    body = json.loads(request.body)
    key = body["id"]
    with transaction.atomic():
        order = Order.objects.create(id=key, quantity=int(body.get("quantity", 1)))
        transaction.on_commit(lambda: order_placed.send(Order, order=order))
        if body.get("saga", "flow") == "flow":
            start(sagas.sw, key, three_steps, key)
        else:
            saga = begin(sagas.sw, key, metadata={"order": key})
            enqueue(saga, "tests.apps.cluster.step", key, "a")
        if body.get("fail"):
            raise RuntimeError(f"the view failed after order {key} and its saga")
    return JsonResponse({"order": order.id, "saga": key}, status=201)
