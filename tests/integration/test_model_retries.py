"""A durable agent run's model request that fails for a passing reason (a 503, a 429) is
tried again after a backoff the flow's next advance waits out (no thread sleeps), not
compensated; a lasting error (a 400) or spent tries fail the run, whose reason names the
provider's error. Real workers on PostgreSQL and a real broker; scripted models raising
the frameworks' own exceptions (tests/apps/agent_runs.py)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from sagaworker import Phase, SagaStatus
from tests.conftest import BROKERS, Cluster, _broker, need, new_settings, uid
from tests.integration.test_agent_units import charge, events, hotel, start
from tests.integration.test_durable_agents import effects, turns

pytest.importorskip("pydantic_ai")
pytestmark = [pytest.mark.services, pytest.mark.one_broker]
T = 60
REQUEST = "unit:mailer_plain__model.request"


def sends(c: Cluster, key: str, turn: str) -> list[Any]:
    """When each send of one turn reached the model (the ledger's database clock)."""
    return [r.at for r in c.ledger(key) if (r.kind, r.tool) == ("model", turn)]


def undone(c: Cluster, key: str) -> list[str]:
    return [r.tool for r in c.ledger(key) if r.kind == "undo"]


@pytest.mark.parametrize("flow", ["mail_run", "mail_run_oai"])
def test_two_503s_then_an_answer_complete_the_run_with_nothing_undone(
        crash_cluster: Cluster, flow: str) -> None:
    c, key = crash_cluster, uid("mr")
    res = start(c, key, flow, [[hotel(key)]],
                **({"errors": {"0": [[503, None], [503, None]]}}
                   | ({"kind": "plain"} if flow == "mail_run" else {}))).wait(timeout=T)
    assert res.status is SagaStatus.COMPLETED, res.error
    assert turns(c, key) == ["turn-0", "turn-0", "turn-0", "turn-1"]
    assert effects(c, key) == ["book_hotel"] and undone(c, key) == []
    first = c.sw.inspect(key).entries[0]
    assert first.phase is Phase.EXECUTED and first.attempts == 3  # every try counted
    retries = events(c, key, "model_request_retry")
    assert [e["attempts"] for e in retries] == [1, 2]
    assert all("status 503" in e["error"] for e in retries)


def test_a_429_with_retry_after_waits_at_least_that_long(crash_cluster: Cluster) -> None:
    c, key = crash_cluster, uid("ma")
    res = start(c, key, "mail_run", [[hotel(key)]], errors={"0": [[429, 2]]}).wait(timeout=T)
    assert res.status is SagaStatus.COMPLETED, res.error
    first, second = sends(c, key, "turn-0")
    assert (second - first).total_seconds() >= 2.0


def test_a_400_compensates_at_once_naming_the_providers_error(crash_cluster: Cluster) -> None:
    """The hotel is booked, then the next request is refused (400): sent once, the run
    fails, the hotel is cancelled, the reason names the status and the provider's body."""
    c, key = crash_cluster, uid("mb")
    res = start(c, key, "mail_run", [[hotel(key)], [charge(key)]],
                errors={"1": [[400, None]]}).wait(timeout=T)
    assert res.status is SagaStatus.COMPENSATED
    assert turns(c, key) == ["turn-0", "turn-1"]
    assert effects(c, key) == ["book_hotel"] and undone(c, key) == ["book_hotel"]
    assert not events(c, key, "model_request_retry")
    reason = c.sw.inspect(key).reason or ""
    assert "ModelHTTPError (status 400)" in reason and "scripted 400" in reason, reason


def test_spent_tries_compensate(crash_cluster: Cluster) -> None:
    """``Durability(sw, model_retries=2)``: two 503s on the turn after the hotel are its
    tries in all: the run fails and the hotel is cancelled; the reason says so."""
    c, key = crash_cluster, uid("ms")
    res = start(c, key, "mail_run", [[hotel(key)], [charge(key)]], "two_tries",
                errors={"1": [[503, None], [503, None]]}).wait(timeout=T)
    assert res.status is SagaStatus.COMPENSATED
    assert turns(c, key) == ["turn-0", "turn-1", "turn-1"]
    assert undone(c, key) == ["book_hotel"]
    reason = c.sw.inspect(key).reason or ""
    assert "ModelHTTPError (status 503)" in reason and "(try 2 of 2)" in reason, reason


@pytest.fixture(scope="module")
def single(pg_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    """One worker process (concurrency 1): a backoff that held it would hold every run."""
    need("rabbitmq", _broker(BROKERS["rabbitmq"]))
    tmp = tmp_path_factory.mktemp("single")
    c = Cluster(new_settings(pg_url, BROKERS["rabbitmq"], tmp, redeliver_after=4,
                             relay_after=2, sweep_interval=1), tmp, "rabbitmq")
    c.start_worker(concurrency=1)
    yield c
    c.close()


def test_no_worker_waits_out_a_backoff(single: Cluster) -> None:
    """Two runs on one worker process both meet a 429 asking for 4 s: the second run's
    first send does not wait for the first run's backoff (a backoff slept in the worker
    would have held the only process 4 s), each second send comes at least 4 s after its
    first, and both runs complete."""
    c, a, b = single, uid("mw"), uid("mw")
    sagas = [start(c, k, "mail_run", [[hotel(k)]], errors={"0": [[429, 4]]}) for k in (a, b)]
    for s in sagas:
        assert s.wait(timeout=T).status is SagaStatus.COMPLETED
    a1, a2 = sends(c, a, "turn-0")
    b1, b2 = sends(c, b, "turn-0")
    assert abs((b1 - a1).total_seconds()) < 2.0, (a1, b1)
    assert (a2 - a1).total_seconds() >= 4.0 and (b2 - b1).total_seconds() >= 4.0
