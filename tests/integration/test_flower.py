"""A real Flower 2.x against a real worker (events on, ``-E``) on RabbitMQ and PostgreSQL:
with SAGAWORKER_REDACT=card in the worker and the producer, Flower lists sagaworker's tool
tasks with the redacted arguments, and the secrets appear nowhere in its API's answers
(task events carry the redacted form, so Flower shows no secret).
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import urllib.request
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from sagaworker import REDACTED, SagaStatus
from tests.conftest import (
    BROKERS,
    Cluster,
    _broker,
    need,
    new_settings,
    uid,
    wait_for,
    worker_env,
)

pytestmark = pytest.mark.services
T = 60


class FlowerCluster(Cluster):
    flower_url = ""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def get_json(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=10) as resp:  # 127.0.0.1 only
        return json.loads(resp.read().decode())


def _flower() -> None:
    import flower

    if not flower.__version__.startswith("2."):
        raise RuntimeError(f"flower {flower.__version__} is not 2.x")


@pytest.fixture(scope="module")
def flower_cluster(pg_url: str,
                   tmp_path_factory: pytest.TempPathFactory) -> Iterator[FlowerCluster]:
    """A prefork worker with task events (-E) and Flower on 127.0.0.1, both (and the
    producer, this process) with SAGAWORKER_REDACT=card."""
    need("flower 2.x", _flower)
    broker = BROKERS["rabbitmq"]
    need("rabbitmq", _broker(broker))
    tmp = tmp_path_factory.mktemp("flower")
    c = FlowerCluster(new_settings(pg_url, broker, tmp, redact="card"), tmp, "rabbitmq")
    port = free_port()
    c.flower_url = f"http://127.0.0.1:{port}"
    env = worker_env(c.settings, c.default_queue, SAGAWORKER_REDACT="card",
                     FLOWER_UNAUTHENTICATED_API="true")
    log = tmp / "flower.log"
    with open(log, "ab") as out:
        flower = subprocess.Popen(
            [sys.executable, "-m", "celery", "-A", "tests.apps.cluster", "flower",
             "--address=127.0.0.1", f"--port={port}"],
            env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        def up() -> bool:
            assert flower.poll() is None, f"flower exited; see {log}"
            try:
                with urllib.request.urlopen(f"{c.flower_url}/healthcheck", timeout=2) as r:
                    return r.status == 200
            except OSError:
                return False

        wait_for(up, T, f"Flower to answer (see {log})")
        c.start_worker(args=("-E",), SAGAWORKER_REDACT="card")
        # Flower's event receiver is connected once it has seen the worker's heartbeat
        wait_for(lambda: get_json(f"{c.flower_url}/api/workers?status=true"), T,
                 "Flower to see the worker online")
        yield c
    finally:
        c.stop_workers()
        flower.terminate()
        try:
            flower.wait(20)
        except subprocess.TimeoutExpired:
            flower.kill()
            flower.wait(5)
        c.cleanup_queues()


def secret() -> str:
    return "4" + str(uuid.uuid4().int)[:15]


def run_pay_saga(c: FlowerCluster, fail_quoting_card: bool) -> tuple[str, str, str, set[str]]:
    """A saga with a pay step given its card by position, then one given it by keyword
    that fails (its error text quotes the card, so the saga compensates) or succeeds.
    Waits until Flower lists both tasks, finished; returns (saga, positional card,
    keyword card, task ids)."""
    pay = c.tool("pay")
    positional, keyword = secret(), secret()
    key = uid("k")

    def work(s: Any) -> None:
        s.call(pay, key, positional, 1000)
        s.call(pay, key=key, card=keyword, amount_cents=2000, fail=fail_quoting_card)

    res = c.sw.saga(key, work, timeout=T)
    want = SagaStatus.COMPENSATED if fail_quoting_card else SagaStatus.COMPLETED
    assert res.status is want
    ids = {e.task_id for e in c.sw.inspect(key).entries if e.task_id}
    assert len(ids) == 2

    def listed() -> bool:
        tasks = get_json(f"{c.flower_url}/api/tasks")
        return all(tasks.get(t, {}).get("state") in ("SUCCESS", "FAILURE") for t in ids)

    wait_for(listed, T, "Flower to list both pay tasks, finished")
    return key, positional, keyword, ids


def flower_answers(c: FlowerCluster, ids: set[str]) -> list[Any]:
    return [get_json(f"{c.flower_url}/api/tasks"),
            get_json(f"{c.flower_url}/api/workers?refresh=1"),
            *(get_json(f"{c.flower_url}/api/task/info/{t}") for t in sorted(ids))]


def where(answers: list[Any], value: str) -> list[str]:
    """The fields of Flower's task answers (task name.field) whose text holds ``value``."""
    tasks = {**answers[0], **{a["uuid"]: a for a in answers[2:]}}
    found = sorted({f"{t.get('name')}.{k}" for t in tasks.values() for k, v in t.items()
                    if value in json.dumps(v)})
    if value in json.dumps(answers[1]):
        found.append("/api/workers")
    return found


def test_flower_lists_tool_tasks_with_redacted_arguments(flower_cluster: FlowerCluster) -> None:
    """A card passed by position and one by keyword: Flower lists both pay tasks, their
    args/kwargs show [REDACTED] where the card was, and neither card is anywhere in
    /api/tasks, /api/task/info or /api/workers."""
    c = flower_cluster
    key, positional, keyword, ids = run_pay_saga(c, fail_quoting_card=False)
    answers = flower_answers(c, ids)
    tasks = answers[0]
    by_pos, by_kw = sorted((tasks[t] for t in ids), key=lambda t: t["args"] == "[]")
    for t in (by_pos, by_kw):
        assert t["name"] == "tests.apps.cluster.pay" and t["state"] == "SUCCESS"
        assert REDACTED in t["args"] + t["kwargs"]
    # redacted where it was passed: by position in args, by name in kwargs; the rest shows
    assert by_pos["args"] == f"['{key}', '{REDACTED}', 1000]"
    assert f"'card': '{REDACTED}'" in by_kw["kwargs"] and "'amount_cents': 2000" in by_kw[
        "kwargs"]
    for s in (positional, keyword):
        assert where(answers, s) == [], "a secret is in Flower's API"


def test_a_failing_tool_quoting_its_card_leaves_no_trace_in_flower(
        flower_cluster: FlowerCluster) -> None:
    """The failing tool's error quotes the card (given by keyword): its args/kwargs are
    redacted, and the card is not in Flower's exception or traceback fields either."""
    c = flower_cluster
    _, positional, keyword, ids = run_pay_saga(c, fail_quoting_card=True)
    answers = flower_answers(c, ids)
    failed = next(answers[0][t] for t in ids if answers[0][t]["state"] == "FAILURE")
    assert f"'card': '{REDACTED}'" in failed["kwargs"]
    assert where(answers, positional) == []
    assert where(answers, keyword) == [], "a secret is in Flower's API"
