"""Celery wiring, by job: the configuration merge (``celery_config``), the settings
that would break a guarantee (``celery_guarantees``), sagaworker's own tasks
(``celery_tasks``) and a worker's start-up (``celery_worker``)."""

from __future__ import annotations

from typing import Any

from celery import Celery

from .celery_config import DEAD_LETTER_QUEUE, REDIS_TRANSPORT, CeleryConfig
from .celery_guarantees import guarantee_problems
from .celery_tasks import register_tasks
from .celery_worker import WorkerStartup

__all__ = ["DEAD_LETTER_QUEUE", "REDIS_TRANSPORT", "CeleryWiring"]


class CeleryWiring:
    """One Sagaworker on its Celery app."""

    def __init__(self, sw: Any) -> None:
        """``sw``: the Sagaworker (what ``celery_tasks.Parts`` and
        ``celery_worker.Host`` say it offers)."""
        self.app: Celery = sw.app
        self.config = CeleryConfig(sw.app, lambda: sw.settings)
        self.config.apply_settings()
        self.tasks: dict[str, Any] = register_tasks(sw.app, sw)
        self.startup = WorkerStartup(sw, self.config)
        self._registry = sw.registry

    def apply_settings(self) -> None:
        self.config.apply_settings()

    def add_queue(self, name: str) -> None:
        self.config.add_queue(name)

    def guarantee_problems(self) -> list[str]:
        return guarantee_problems(self.app.conf, self._registry)
