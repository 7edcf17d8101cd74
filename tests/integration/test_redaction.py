"""SAGAWORKER_REDACT against a real worker (DEBUG logging), PostgreSQL and RabbitMQ.

A card passed positionally and by keyword to a failing tool, and an unknown-task message
carrying one, leave no trace in the worker's log (its JSON lines, Celery's own lines,
tracebacks, the DEBUG ``TaskPool: Apply`` line) nor in the producer's output; the journal
keeps the real values for the undo.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from sagaworker import REDACTED, SagaStatus
from tests.conftest import BROKERS, Cluster, _broker, need, new_settings, uid, wait_for

pytestmark = pytest.mark.services
T = 60


@pytest.fixture(scope="module")
def red_cluster(pg_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    """One prefork worker at DEBUG with SAGAWORKER_REDACT=card; the producer redacts too."""
    broker = BROKERS["rabbitmq"]
    need("rabbitmq", _broker(broker))
    tmp = tmp_path_factory.mktemp("redact")
    c = Cluster(new_settings(pg_url, broker, tmp, redact="card"), tmp, "rabbitmq")
    c.start_worker(SAGAWORKER_REDACT="card", SAGAWORKER_LOG_LEVEL="DEBUG")
    yield c
    c.close()


def worker_log(c: Cluster) -> str:
    return "".join(log.read_text(errors="replace") for _, log in c.workers)


def secret() -> str:
    return "4" + str(uuid.uuid4().int)[:15]


def test_secrets_leave_no_trace_in_any_process_output(
        red_cluster: Cluster, capfd: pytest.CaptureFixture[str],
        caplog: pytest.LogCaptureFixture) -> None:
    """Positional and keyword secrets to a failing tool, a succeeding one, and an
    unknown task's message: nowhere in the worker log nor the producer's output."""
    caplog.set_level(logging.DEBUG)
    c = red_cluster
    step, pay = c.tool("step"), c.tool("pay")
    positional, keyword, ok, unknown = secret(), secret(), secret(), secret()

    def by_position(s: Any) -> None:
        s.call(step, k1, "a")
        s.call(pay, k1, positional, 1000, True)

    def by_keyword(s: Any) -> None:
        s.call(pay, key=k2, card=ok, amount_cents=5)
        s.call(pay, key=k2, card=keyword, amount_cents=1000, fail=True)

    k1, k2 = uid("k"), uid("k")
    res1 = c.sw.saga(k1, by_position, timeout=T)
    res2 = c.sw.saga(k2, by_keyword, timeout=T)
    assert res1.status is SagaStatus.COMPENSATED and res2.status is SagaStatus.COMPENSATED
    c.app.send_task("no.such.task", args=[unknown], kwargs={"card": unknown},
                    queue=c.default_queue)
    wait_for(lambda: "no.such.task" in worker_log(c), T, "the unknown-task error")
    wait_for(lambda: worker_log(c).count('"event": "saga_compensated"') >= 2, T,
             "both chains logged")

    # the journal keeps the real values: the undo needs them
    rec1, rec2 = c.sw.inspect(k1), c.sw.inspect(k2)
    assert rec1.entries[1].args == [k1, positional, 1000, True]
    assert rec2.entries[0].kwargs["card"] == ok and rec2.entries[1].kwargs["card"] == keyword
    # ... but not in the error texts, which are journaled and logged
    assert rec1.entries[1].error == f"Boom: card {REDACTED} declined for 1000 cents"
    assert positional not in (rec1.reason or "") and keyword not in (rec2.reason or "")

    text = worker_log(c)
    # the lines that used to print them are there, redacted
    assert "Received unregistered task of type" in text
    assert "TaskPool: Apply" in text, "the worker did not log at DEBUG"
    assert "raised unexpected" in text and '"event": "step_failed"' in text
    assert REDACTED in text
    produced = capfd.readouterr()
    for s in (positional, keyword, ok, unknown):
        assert s not in text, f"a secret is in the worker log ({c.workers[0][1]})"
        assert s not in produced.out + produced.err
        assert s not in caplog.text


def test_a_work_or_flow_exception_quoting_a_secret_leaves_it_out_of_the_reason(
        red_cluster: Cluster) -> None:
    """``sw.saga``'s work and a flow raise quoting a card they paid with (and, for the
    work, a dict with another card under the redacted key): the journaled reason and
    the ``saga_failed`` event keep the exception's type and text, the cards scrubbed."""
    from tests.apps.cluster import pays_then_raises

    c = red_cluster
    pay = c.tool("pay")
    paid, other, flowed = secret(), secret(), secret()
    k1, k2 = uid("k"), uid("k")

    def work(s: Any) -> None:
        s.call(pay, k1, paid, 700)
        raise RuntimeError(f"order failed after paying with {paid}", {"card": other})

    res = c.sw.saga(k1, work, timeout=T)
    assert res.status is SagaStatus.COMPENSATED
    c.sw.start(k2, pays_then_raises, k2, flowed)
    res2 = c.sw.get(k2).wait(T)
    assert res2.status is SagaStatus.COMPENSATED
    wait_for(lambda: all(any(e.get("event") == "saga_compensated" for e in c.events(k))
                         for k in (k1, k2)), T, "both chains logged")
    reasons = [c.sw.inspect(k1).reason or "", c.sw.inspect(k2).reason or ""]
    assert reasons[0] == (f"RuntimeError: ('order failed after paying with {REDACTED}', "
                          f"{{'card': '{REDACTED}'}})")
    assert reasons[1] == ("the flow raised RuntimeError: shipping failed after paying with "
                          f"{REDACTED}")
    logged = [e["reason"] for k in (k1, k2) for e in c.events(k)
              if e.get("event") == "saga_failed"]
    assert len(logged) == 2
    for s in (paid, other, flowed):
        assert s not in " ".join(reasons + logged)
        assert s not in worker_log(c)


def test_an_eager_flow_step_logging_its_secret_is_scrubbed(red_cluster: Cluster) -> None:
    """A flow's step run eagerly (no delivery of its own) logs its card: the worker's line
    is there, the card is not, as for a step delivered by the broker."""
    from tests.apps.cluster import pays_noisily

    c = red_cluster
    card, k = secret(), uid("k")
    res = c.sw.start(k, pays_noisily, k, card).wait(T)
    assert res.status is SagaStatus.COMPLETED, res.error
    done = wait_for(lambda: [e for e in c.events(k) if e.get("event") == "step_executed"],
                    T, "the step's executed line")
    assert done[0].get("eager") is True, "the step was not run eagerly"
    text = worker_log(c)
    assert f"charging card {REDACTED}" in text
    assert card not in text


def test_a_flow_logging_or_printing_its_secret_argument_is_scrubbed(
        red_cluster: Cluster) -> None:
    """A flow logs and print()s its own card argument while it replays (a model SDK logs
    inside the flow the same way): the lines are there, the card is not."""
    from tests.apps.cluster import logs_its_card

    c = red_cluster
    card, k = secret(), uid("fl")
    res = c.sw.start(k, logs_its_card, k, card).wait(T)
    assert res.status is SagaStatus.COMPLETED, res.error
    wait_for(lambda: "flow printing card" in worker_log(c)
             and "to stderr" in worker_log(c), T, "the flow's printed lines")
    text = worker_log(c)
    assert f"flow charging card {REDACTED}" in text
    assert f"flow printing card {REDACTED}" in text
    assert card not in text


def test_a_tool_printing_its_secret_is_scrubbed(red_cluster: Cluster) -> None:
    """A tool that print()s its card (stdout and stderr, which the worker redirects to its
    log): the lines are there, the card is not."""
    c = red_cluster
    key, card = uid("p"), secret()
    saga = c.sw.begin(key)
    assert saga.enqueue(c.tool("chatty_pay"), key, card).result(timeout=T) == "paid"
    wait_for(lambda: "charging card" in worker_log(c) and " charged" in worker_log(c), T,
             "the printed lines in the worker's log")
    assert card not in worker_log(c)
