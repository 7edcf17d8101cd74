"""sagaworker's Celery settings hold however and whenever the app is configured."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from celery import Celery, signals
from kombu import Queue  # type: ignore[attr-defined]

from sagaworker import Sagaworker, Settings

ROOT = Path(__file__).resolve().parents[2]


class UserConfig:
    """What an app's celeryconfig typically holds."""

    broker_url = "memory://"
    task_queues = (Queue("orders"), Queue("reports"))
    task_routes = {"reports.*": {"queue": "reports"}}
    worker_prefetch_multiplier = 8
    beat_schedule = {"nightly": {"task": "reports.nightly", "schedule": 86400.0}}
    broker_transport_options = {"max_retries": 3}


class Sender:
    """Stands in for the worker or beat service a signal is sent by."""

    def __init__(self, app: Celery, prefetch_multiplier: int = 1) -> None:
        self.app, self.prefetch_multiplier = app, prefetch_multiplier


def settings(tmp_path: Path, **over: Any) -> Settings:
    return Settings(database_url=f"sqlite:///{tmp_path / 'j.db'}", broker_url="memory://",
                    broker_folder=str(tmp_path / "b"), **over)


def assert_ours_and_theirs(app: Celery, queue: str = "sagaworker") -> None:
    conf = app.conf
    names = [q.name for q in conf.task_queues]
    assert {"orders", "reports", queue, conf.task_default_queue} <= set(names)
    assert len(names) == len(set(names))
    assert conf.worker_prefetch_multiplier == 1
    assert conf.broker_transport_options["visibility_timeout"] == 60
    assert conf.broker_transport_options["max_retries"] == 3
    assert {"nightly", "sagaworker-sweep", "sagaworker-orphans"} == set(conf.beat_schedule)
    assert conf.worker_cancel_long_running_tasks_on_connection_loss is False
    assert conf.task_acks_on_failure_or_timeout is True
    routes = conf.task_routes
    assert routes[0] == {"reports.*": {"queue": "reports"}}
    assert routes[-1] == {"sagaworker.*": {"queue": queue}}
    # what a worker consumes comes from app.amqp.queues, built from the merged settings
    assert {"orders", "reports", queue} <= set(app.amqp.queues.consume_from)


def test_config_from_object_after_sagaworker(tmp_path: Path) -> None:
    """The order most apps are written in: Celery reloads the whole configuration; the
    settings come back and the app's own queues, routes and beat entries are kept."""
    app = Celery("cfg-after")
    Sagaworker(app, settings=settings(tmp_path))
    app.config_from_object(UserConfig)
    assert_ours_and_theirs(app)


def test_config_from_object_before_sagaworker_is_read_lazily(tmp_path: Path) -> None:
    """config_from_object only records the object; reading the configuration loads it,
    and the settings are there at once, whichever is read first."""
    app = Celery("cfg-before")
    app.config_from_object(UserConfig)
    assert not app.configured
    Sagaworker(app, settings=settings(tmp_path))
    assert app.conf.worker_prefetch_multiplier == 1
    assert_ours_and_theirs(app)


def test_config_from_object_after_sagaworker_on_an_unconfigured_app(tmp_path: Path) -> None:
    """Lazy load, then the first read is the caller's (not sagaworker's)."""
    app = Celery("cfg-lazy")
    sw = Sagaworker(app, settings=settings(tmp_path, queue="sw-own"))
    app.config_from_object(UserConfig)
    assert "sw-own" in [q.name for q in app.conf.task_queues]
    assert_ours_and_theirs(app, queue=sw.settings.queue)


def test_conf_update_after_sagaworker_then_finalize(tmp_path: Path) -> None:
    """app.conf.update(...) replacing task_queues and beat_schedule: finalize restores ours."""
    app = Celery("cfg-update")
    Sagaworker(app, settings=settings(tmp_path))
    app.conf.update({k: v for k, v in vars(UserConfig).items() if not k.startswith("_")})
    app.finalize()
    assert_ours_and_theirs(app)


def test_changes_after_finalize_are_reasserted_when_a_worker_or_beat_starts(
        tmp_path: Path) -> None:
    """Settings replaced after the last app signal (and after Celery cached its queue
    table) come back at worker_init / beat_init; a -Q selection is respected."""
    app = Celery("cfg-late")
    Sagaworker(app, settings=settings(tmp_path))
    app.finalize()
    assert "sagaworker" in app.amqp.queues  # the table is cached from here on
    app.conf.update(task_queues=[Queue("orders")], worker_prefetch_multiplier=8,
                    beat_schedule={"nightly": {"task": "n", "schedule": 1.0}})
    signals.beat_init.send(sender=Sender(app))
    assert {"sagaworker-sweep", "sagaworker-orphans", "nightly"} == set(app.conf.beat_schedule)
    worker = Sender(app, 8)
    signals.worker_init.send(sender=worker)
    assert worker.prefetch_multiplier == 1 and app.conf.worker_prefetch_multiplier == 1
    assert {"orders", "sagaworker"} <= set(app.amqp.queues.consume_from)

    app2 = Celery("cfg-late-q")
    Sagaworker(app2, settings=settings(tmp_path, queue="sw-q"))
    app2.finalize()
    app2.amqp.queues.select(["celery"])  # `celery worker -Q celery`
    app2.conf.task_queues = [Queue("orders")]
    signals.worker_init.send(sender=Sender(app2))
    assert set(app2.amqp.queues.consume_from) == {"celery"}
    assert {"orders", "sw-q"} <= set(app2.amqp.queues)  # routable, not consumed


def test_merging_is_idempotent_and_keeps_the_apps_own_declarations(tmp_path: Path) -> None:
    """A queue the app declares under sagaworker's name is the app's; dict-shaped
    task_queues stay dicts; re-applying adds nothing twice."""
    app = Celery("cfg-dict")
    sw = Sagaworker(app, settings=settings(tmp_path))
    theirs = Queue("sagaworker", routing_key="custom")
    app.conf.task_queues = {"sagaworker": theirs, "orders": {"routing_key": "orders"}}
    for _ in range(3):
        sw.wiring.apply_settings()
    queues = app.conf.task_queues
    assert isinstance(queues, dict)
    assert set(queues) == {"sagaworker", "orders", "celery"}
    assert queues["sagaworker"] is theirs
    assert len(app.conf.task_routes) == 1
    app.conf.task_default_queue = "tools"
    sw.wiring.apply_settings()
    assert set(app.conf.task_queues) == {"sagaworker", "orders", "tools"}


def test_tool_queues_are_added(tmp_path: Path) -> None:
    app = Celery("cfg-tools")
    sw = Sagaworker(app, settings=settings(tmp_path))

    @sw.tool(queue="payments")
    def charge(card: str) -> str:
        return card

    app.config_from_object(UserConfig)
    assert "payments" in [q.name for q in app.conf.task_queues]


@pytest.mark.parametrize(("update", "named"), [
    ({"task_serializer": "pickle"}, "task_serializer"),
    ({"result_serializer": "pickle"}, "result_serializer"),
    ({"accept_content": ["json", "pickle"]}, "accept_content"),
    ({"accept_content": ["application/x-python-serialize"]}, "accept_content"),
    ({"worker_cancel_long_running_tasks_on_connection_loss": True},
     "worker_cancel_long_running_tasks_on_connection_loss"),
])
def test_settings_that_break_a_guarantee_are_named(tmp_path: Path, update: dict[str, Any],
                                                   named: str) -> None:
    app = Celery(f"cfg-bad-{named}")
    sw = Sagaworker(app, settings=settings(tmp_path))
    assert sw.wiring.guarantee_problems() == []
    app.conf.update(update)
    sw.wiring.apply_settings()  # re-applying does not paper over the app's choice
    problems = sw.wiring.guarantee_problems()
    assert len(problems) == 1 and problems[0].startswith(named), problems


def test_early_acks_refused_only_where_they_reach_tool_tasks(tmp_path: Path) -> None:
    """task_acks_late=False is the app's business: tool tasks set acks_late themselves.
    A tool declared with acks_late=False, reject_on_worker_lost=False or a pickle
    serializer is refused."""
    app = Celery("cfg-acks")
    sw = Sagaworker(app, settings=settings(tmp_path))
    app.conf.update(task_acks_late=False, task_reject_on_worker_lost=False)

    @sw.tool()
    def fine(x: int) -> int:
        return x

    app.finalize()
    assert fine.acks_late is True and fine.reject_on_worker_lost is True
    assert sw.wiring.guarantee_problems() == []

    @sw.tool(acks_late=False)
    def early(x: int) -> int:
        return x

    @sw.tool(reject_on_worker_lost=False)
    def dropped(x: int) -> int:
        return x

    @sw.tool(serializer="pickle")
    def pickled(x: int) -> int:
        return x

    problems = sw.wiring.guarantee_problems()
    assert len(problems) == 3
    assert "acks_late=False" in problems[0] and "early" in problems[0]
    assert "reject_on_worker_lost=False" in problems[1] and "dropped" in problems[1]
    assert "serializer='pickle'" in problems[2] and "pickled" in problems[2]


def test_queues_are_routes_not_task_attributes(tmp_path: Path) -> None:
    """Celery 5.7 warns that the ``queue`` task attribute goes in Celery 6: no task is
    declared with one. sagaworker's own tasks are routed through ``task_routes``; a tool's
    ``queue=`` is journaled with each of its steps, whose every publish names it."""
    import warnings

    app = Celery("cfg-routes", broker="memory://")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        sw = Sagaworker(app, settings=settings(tmp_path, queue="sw-own"))

        @sw.tool(queue="payments")
        def charge(card: str) -> str:
            return card

        app.finalize(auto=True)
        tasks = {name: app.tasks[name] for name in ("sagaworker.saga_failed", charge.name)}
    assert [str(w.message).split(" is ")[0].strip() for w in caught
            if "task attribute" in str(w.message)] == []
    assert [name for name, task in tasks.items() if "queue" in vars(type(task))] == []
    assert app.amqp.router.route({}, "sagaworker.saga_failed")["queue"].name == "sw-own"
    saga = sw.begin("routed")
    saga.enqueue(charge, "card-1")
    assert (sw.registry.tool(charge.name).queue, sw.inspect("routed").entries[0].queue) == (
        "payments", "payments")
