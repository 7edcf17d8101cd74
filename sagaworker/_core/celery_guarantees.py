"""A worker refuses to start (a message on stderr naming the setting, exit code 3) when a
setting the app chose would break a guarantee:

- **a pickle serializer** in ``task_serializer``, ``result_serializer``,
  ``accept_content`` or ``result_accept_content`` (or a tool's ``serializer=``): a worker
  that accepts pickle runs whatever code a message carries, before sagaworker sees the
  message, so the bad-input guarantee (a poison message is journaled and dead-lettered)
  and the journal's JSON arguments no longer describe what ran.
- **``worker_cancel_long_running_tasks_on_connection_loss = True``**: every tool running
  when the broker connection drops would be cancelled mid-effect, turning each in-flight
  step into an in-doubt one instead of letting it finish and journal its
  outcome while the lease keeps the redelivered copy away.
- **early acks on a tool task**: ``sw.tool(acks_late=False)`` or
  ``reject_on_worker_lost=False``. A tool message acknowledged before the tool ran, or
  not requeued when its worker dies, is lost with the worker (late acks,
  requeued when a worker is lost).

Not refused: ``task_acks_late = False`` (and the other ``task_acks_*`` defaults) only
reach the app's own tasks. Tool tasks and sagaworker's internal tasks set ``acks_late``
and ``reject_on_worker_lost`` on the task itself, which Celery's configuration never
overrides.
"""

from __future__ import annotations

from typing import Any

from .._base.registry import Registry

__all__ = ["guarantee_problems"]

_SERIALIZER_SETTINGS = ("task_serializer", "result_serializer", "accept_content",
                        "result_accept_content")
_PICKLE = ("pickle", "application/x-python-serialize")


def _pickles(value: Any) -> bool:
    values = [value] if isinstance(value, str) else list(value or ())
    return any(str(v).strip().lower() in _PICKLE for v in values)


def guarantee_problems(conf: Any, registry: Registry) -> list[str]:
    """What in the app's settings would break a guarantee (see the module docstring)."""
    problems: list[str] = []
    for key in _SERIALIZER_SETTINGS:
        value = conf.get(key)
        if _pickles(value):
            fix = "['json']" if key.endswith("accept_content") else "'json'"
            problems.append(f"{key}={value!r} allows pickle, and a pickled message runs "
                            f"code before sagaworker can check it; set {key} = {fix}")
    if conf.get("worker_cancel_long_running_tasks_on_connection_loss"):
        problems.append(
            "worker_cancel_long_running_tasks_on_connection_loss=True cancels running "
            "tools when the broker connection drops, leaving their effects in doubt; "
            "remove it or set it to False")
    for spec in registry.tools.values():
        task = spec.task
        if task is None:
            continue
        serializer = getattr(task, "serializer", None)
        if _pickles(serializer) and not _pickles(conf.get("task_serializer")):
            problems.append(f"tool {spec.name!r} has serializer={serializer!r}; drop "
                            "that option from its @sw.tool(...) (tool messages are JSON)")
        for attr in ("acks_late", "reject_on_worker_lost"):
            if getattr(task, attr, True) is False:
                problems.append(
                    f"tool {spec.name!r} sets {attr}=False: its message would be lost "
                    f"with a worker that dies while running it; drop {attr}=False from "
                    "its @sw.tool(...) options")
    return problems
