"""One trace follows a saga through every process: real workers, spans written to files.

The workers (tests/apps/cluster.py, TEST_SPANS_FILE) and this process (the producer) each
export every span they end to a file; a saga's trace is read back from both.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from typing import Any

import pytest

from sagaworker import SagaStatus
from tests.apps import spans
from tests.conftest import BROKERS, Cluster, _broker, need, new_settings, uid, wait_for

pytestmark = [pytest.mark.services, pytest.mark.one_broker]
T = 60
STEP = "tests.apps.cluster.step"
IDEM = "tests.apps.cluster.idem"
#: every workers' spans file of this module: the clusters share one database, so a step
#: may be relayed (and run) by another cluster's sweeper, into that cluster's file
FILES: list[str] = []


@pytest.fixture(scope="module")
def producer_spans(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """This process traces (to a file of its own) while the module's tests run."""
    switch = spans.switch()
    path = str(tmp_path_factory.mktemp("producer-spans") / "spans.jsonl")
    switch.exporter.path, switch.on = path, True
    yield path
    switch.exporter.path, switch.on = None, False


def _traced(request: pytest.FixtureRequest, pg_url: str,
            tmp_path_factory: pytest.TempPathFactory, label: str,
            **extra_env: str) -> Iterator[Cluster]:
    broker = BROKERS[request.param]
    need(request.param, _broker(broker))
    tmp = tmp_path_factory.mktemp(f"{label}-{request.param}")
    c = Cluster(new_settings(pg_url, broker, tmp, redeliver_after=4, relay_after=2,
                             sweep_interval=1), tmp, request.param)
    c.spans_file = str(tmp / "worker-spans.jsonl")  # type: ignore[attr-defined]
    FILES.append(c.spans_file)  # type: ignore[attr-defined]
    c.trace_env = {"TEST_SPANS_FILE": c.spans_file, **extra_env}  # type: ignore[attr-defined]
    c.start_worker(**c.trace_env)  # type: ignore[attr-defined]
    yield c
    c.close()


@pytest.fixture(scope="module", params=sorted(BROKERS))
def traced(request: pytest.FixtureRequest, pg_url: str, producer_spans: str,
           tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    """Workers that trace (prefork, 2 processes), short leases, a fast sweeper."""
    yield from _traced(request, pg_url, tmp_path_factory, "traced")


@pytest.fixture(params=sorted(BROKERS))
def instrumented(request: pytest.FixtureRequest, fresh_pg_url: str, producer_spans: str,
                 tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    """Workers that trace with opentelemetry-instrumentation-celery on, and this process
    instrumented too while the fixture lives; a database of their own (no other
    cluster's sweeper relays their steps)."""
    from opentelemetry.instrumentation.celery import CeleryInstrumentor

    from sagaworker._journal.migrate import upgrade

    upgrade(fresh_pg_url)
    inst = CeleryInstrumentor()
    inst.instrument()
    try:
        yield from _traced(request, fresh_pg_url, tmp_path_factory, "instrumented",
                           TEST_OTEL_CELERY="1")
    finally:
        inst.uninstrument()


def all_spans(c: Cluster, producer: str) -> list[dict[str, Any]]:
    assert c.spans_file in FILES  # type: ignore[attr-defined]
    return [s for path in [producer, *FILES] for s in spans.read(path)]


def saga_trace(c: Cluster, producer: str, saga_id: str) -> tuple[str, list[dict[str, Any]]]:
    """The trace id of a saga's start span, and every span of that trace."""
    every = all_spans(c, producer)
    begins = [s for s in every if s["name"] == "saga begin"
              and s["attributes"].get("sagaworker.saga_id") == saga_id]
    assert len(begins) == 1, begins
    trace_id = begins[0]["trace_id"]
    return trace_id, [s for s in every if s["trace_id"] == trace_id]


def named(trace: list[dict[str, Any]], name: str, seq: int | None = None) -> list[dict[str, Any]]:
    return [s for s in trace if s["name"] == name
            and (seq is None or s["attributes"].get("sagaworker.seq") == seq)]


def one(trace: list[dict[str, Any]], name: str, seq: int | None = None) -> dict[str, Any]:
    got = named(trace, name, seq)
    assert len(got) == 1, (name, seq, got)
    return got[0]


def assert_whole(trace: list[dict[str, Any]], root: dict[str, Any]) -> None:
    """One root, and every other span's parent is a span of the trace."""
    ids = {s["span_id"] for s in trace}
    assert len(ids) == len(trace), "a span was exported twice"
    assert [s["span_id"] for s in trace if s["parent_id"] is None] == [root["span_id"]]
    broken = [s for s in trace if s["parent_id"] is not None and s["parent_id"] not in ids]
    assert broken == []


def failed_saga(c: Cluster) -> str:
    """Two steps EXECUTED, a third that FAILS: the saga compensates the two."""
    key = uid("k")
    saga = c.sw.begin(key)
    assert saga.enqueue(c.tool("step"), key, "a").result(timeout=T) == "a-done"
    assert saga.enqueue(c.tool("step"), key, "b").result(timeout=T) == "b-done"
    saga.enqueue(c.tool("step"), key, "c", fail=True)
    assert saga.wait(timeout=T).status is SagaStatus.COMPENSATED
    return key


def wait_spans(c: Cluster, producer: str, key: str, name: str, n: int) -> None:
    """Spans are written as they end, a moment after the journal says the saga moved on."""
    wait_for(lambda: len(named(saga_trace(c, producer, key)[1], name)) >= n, T,
             f"{n} {name!r} spans")


def test_failed_saga_is_one_trace(traced: Cluster, producer_spans: str) -> None:
    """The saga's start, three enqueues, three runs (the FAILED one in error) and two
    undos linked to their forward runs: one trace across the processes."""
    c = traced
    key = failed_saga(c)
    wait_spans(c, producer_spans, key, f"compensate {STEP}", 2)
    trace_id, trace = saga_trace(c, producer_spans, key)
    root = one(trace, "saga begin")
    assert (root["kind"], root["pid"]) == ("INTERNAL", os.getpid())
    enq = {n: one(trace, f"enqueue {STEP}", n) for n in (1, 2, 3)}
    runs = {n: one(trace, f"step {STEP}", n) for n in (1, 2, 3)}
    for n in (1, 2, 3):
        assert (enq[n]["kind"], enq[n]["parent_id"], enq[n]["pid"]) == (
            "PRODUCER", root["span_id"], os.getpid())
        assert (runs[n]["kind"], runs[n]["parent_id"]) == ("CONSUMER", enq[n]["span_id"])
        assert runs[n]["pid"] != os.getpid()
        a = runs[n]["attributes"]
        assert (a["sagaworker.saga_id"], a["sagaworker.tool"], a["sagaworker.attempt"]) == (
            key, STEP, 1)
    assert [(runs[n]["attributes"]["sagaworker.outcome"], runs[n]["status"])
            for n in (1, 2, 3)] == [("executed", "UNSET"), ("executed", "UNSET"),
                                    ("failed", "ERROR")]
    undos = named(trace, f"compensate {STEP}")  # in the order they ended: the chain's
    assert [(u["attributes"]["sagaworker.seq"], u["attributes"]["sagaworker.outcome"],
             u["parent_id"], u["links"]) for u in undos] == [
        (2, "compensated", root["span_id"], [{"trace_id": trace_id,
                                              "span_id": runs[2]["span_id"]}]),
        (1, "compensated", root["span_id"], [{"trace_id": trace_id,
                                              "span_id": runs[1]["span_id"]}])]
    assert len(trace) == 1 + 3 + 3 + 2
    assert_whole(trace, root)
    assert len({s["pid"] for s in trace}) >= 2


def test_log_lines_carry_the_span_they_were_written_in(traced: Cluster,
                                                        producer_spans: str) -> None:
    """A step's, a failure's and an undo's JSON lines name their span and its trace."""
    c = traced
    key = failed_saga(c)
    wait_spans(c, producer_spans, key, f"compensate {STEP}", 2)
    trace_id, trace = saga_trace(c, producer_spans, key)
    events = c.events(key)
    executed = [(e["seq"], e["trace_id"], e["span_id"]) for e in events
                if e["event"] == "step_executed"]
    assert executed == [(n, trace_id, one(trace, f"step {STEP}", n)["span_id"]) for n in (1, 2)]
    failed = [(e["trace_id"], e["span_id"]) for e in events if e["event"] == "step_failed"]
    assert failed == [(trace_id, one(trace, f"step {STEP}", 3)["span_id"])]
    undone = [(e["seq"], e["trace_id"], e["span_id"]) for e in events
              if e["event"] == "compensated"]
    assert undone == [(n, trace_id, one(trace, f"compensate {STEP}", n)["span_id"])
                      for n in (2, 1)]


def test_step_sent_by_the_relay_stays_in_its_trace(traced: Cluster, producer_spans: str,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """A publish that was refused: the relay sends the step, whose run is still the child
    of its journaled enqueue span."""
    c = traced
    key = uid("k")
    saga = c.sw.begin(key)
    refused: list[str] = []

    def refuse(*args: Any, **kwargs: Any) -> bool:
        refused.append(args[5])  # the task id
        return False

    monkeypatch.setattr(c.sw.rt.bus, "publish_step", refuse)
    step = saga.enqueue(c.tool("step"), key, "relayed")
    monkeypatch.undo()
    assert refused == [step.task_id]
    assert step.result(timeout=T) == "relayed-done"
    assert [e["seq"] for e in c.events(key) if e["event"] == "step_relayed"] == [1]
    wait_spans(c, producer_spans, key, f"step {STEP}", 1)
    _, trace = saga_trace(c, producer_spans, key)
    root, enq, run = (one(trace, "saga begin"), one(trace, f"enqueue {STEP}", 1),
                      one(trace, f"step {STEP}", 1))
    assert (enq["parent_id"], run["parent_id"], run["kind"]) == (
        root["span_id"], enq["span_id"], "CONSUMER")
    assert run["pid"] != os.getpid()
    assert_whole(trace, root)


def test_celery_retry_is_a_second_run_of_the_same_enqueue(traced: Cluster,
                                                          producer_spans: str) -> None:
    """A tool Celery retries: its first run's span ends with the retry (error, outcome
    retried), the second is EXECUTED; both children of the one enqueue span."""
    c = traced
    key = uid("k")
    saga = c.sw.begin(key)
    assert saga.enqueue(c.tool("retried"), key, "r", 1).result(timeout=T) == "r"
    name = "step tests.apps.cluster.retried"
    wait_spans(c, producer_spans, key, name, 2)
    _, trace = saga_trace(c, producer_spans, key)
    enq = one(trace, "enqueue tests.apps.cluster.retried", 1)
    # (the second run may end before Celery's retry hook ends the first: by attempt)
    runs = {r["attributes"]["sagaworker.attempt"]: r for r in named(trace, name)}
    assert len(runs) == 2
    assert [(n, runs[n]["attributes"]["sagaworker.outcome"], runs[n]["status"],
             runs[n]["parent_id"]) for n in (1, 2)] == [
        (1, "retried", "ERROR", enq["span_id"]), (2, "executed", "UNSET", enq["span_id"])]
    assert_whole(trace, one(trace, "saga begin"))


def test_flow_is_one_trace(traced: Cluster, producer_spans: str) -> None:
    """A flow's start, each advance (in whichever worker) and its steps: one trace."""
    from tests.apps.cluster import three_steps

    c = traced
    key = uid("k")
    res = c.sw.start(key, three_steps, key).wait(timeout=T)
    assert res.status is SagaStatus.COMPLETED
    every = all_spans(c, producer_spans)
    start = [s for s in every if s["name"] == "saga start"
             and s["attributes"].get("sagaworker.saga_id") == key]
    assert len(start) == 1
    flow = "tests.apps.cluster.three_steps"
    wait_for(lambda: len([s for s in all_spans(c, producer_spans)
                          if s["trace_id"] == start[0]["trace_id"]
                          and s["name"] == f"advance {flow}"]) >= 4, T, "the advances")
    trace = [s for s in all_spans(c, producer_spans) if s["trace_id"] == start[0]["trace_id"]]
    advances = {a["span_id"]: a for a in named(trace, f"advance {flow}")}
    assert len(advances) == 4
    assert {a["parent_id"] for a in advances.values()} == {start[0]["span_id"]}
    # each step is enqueued by the advance (a replay that waits) that asked for it, and
    # run as the enqueue's child; the last replay returned the flow's value
    asked = [one(trace, f"enqueue {STEP}", n)["parent_id"] for n in (1, 2, 3)]
    assert [advances[a]["attributes"]["sagaworker.outcome"] for a in asked] == ["waits"] * 3
    assert [a["attributes"]["sagaworker.outcome"] for i, a in advances.items()
            if i not in asked] == ["returned"]
    for n in (1, 2, 3):
        enq = one(trace, f"enqueue {STEP}", n)
        assert one(trace, f"step {STEP}", n)["parent_id"] == enq["span_id"]
    assert_whole(trace, start[0])


def test_beside_celery_instrumentation_one_trace(instrumented: Cluster, producer_spans: str,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """With opentelemetry-instrumentation-celery in both processes: still one trace,
    sagaworker's runs the children of their enqueue spans, Celery's spans in between,
    also for a step the relay sent (its publish under the journaled context)."""
    c = instrumented
    relayed = uid("k")
    saga = c.sw.begin(relayed)
    monkeypatch.setattr(c.sw.rt.bus, "publish_step", lambda *a, **k: False)
    step = saga.enqueue(c.tool("step"), relayed, "relayed")
    monkeypatch.undo()
    assert step.result(timeout=T) == "relayed-done"
    wait_spans(c, producer_spans, relayed, f"step {STEP}", 1)
    # (Celery's run span ends after sagaworker's step span: written a moment later)
    wait_spans(c, producer_spans, relayed, f"run/{STEP}", 1)
    _, trace = saga_trace(c, producer_spans, relayed)
    enq, run = one(trace, f"enqueue {STEP}", 1), one(trace, f"step {STEP}", 1)
    assert run["parent_id"] == enq["span_id"]
    resend = one(trace, f"apply_async/{STEP}")  # the relay's publish, in a worker
    assert (resend["parent_id"], resend["pid"] != os.getpid()) == (enq["span_id"], True)
    assert one(trace, f"run/{STEP}")["parent_id"] == resend["span_id"]
    assert_whole(trace, one(trace, "saga begin"))

    key = failed_saga(c)
    wait_spans(c, producer_spans, key, f"compensate {STEP}", 2)
    wait_spans(c, producer_spans, key, "run/sagaworker.saga_failed", 1)
    _, trace = saga_trace(c, producer_spans, key)
    root = one(trace, "saga begin")
    by_id = {s["span_id"]: s for s in trace}
    for n in (1, 2, 3):
        enq, run = one(trace, f"enqueue {STEP}", n), one(trace, f"step {STEP}", n)
        assert run["parent_id"] == enq["span_id"]
        # Celery's own pair: apply_async (a child of the enqueue span) -> run/<task>
        publish = [s for s in trace if s["name"] == f"apply_async/{STEP}"
                   and s["parent_id"] == enq["span_id"]]
        assert [s["kind"] for s in publish] == ["PRODUCER"]
        consume = [s for s in trace if s["name"] == f"run/{STEP}"
                   and s["parent_id"] == publish[0]["span_id"]]
        assert [s["kind"] for s in consume] == ["CONSUMER"]
    # the failure message was published inside the FAILED run's span
    failure = one(trace, "apply_async/sagaworker.saga_failed")
    assert by_id[failure["parent_id"]]["name"] == f"step {STEP}"
    assert [u["attributes"]["sagaworker.seq"] for u in named(trace, f"compensate {STEP}")] == [
        2, 1]
    assert_whole(trace, root)


def test_worker_killed_mid_step_rerun_keeps_the_trace(traced: Cluster,
                                                      producer_spans: str) -> None:
    """A worker SIGKILLed inside an idempotent step: a restarted worker runs it again once
    the lease lapsed; that run is the child of the journaled enqueue span."""
    c = traced
    c.stop_workers()
    victim = c.start_worker(concurrency=1, pool="solo", **c.trace_env)  # type: ignore[attr-defined]
    key = uid("k")
    saga = c.sw.begin(key)
    assert saga.enqueue(c.tool("step"), key, "a").result(timeout=T) == "a-done"
    step = saga.enqueue(c.tool("idem"), key, "i", sleep=3)
    wait_for(lambda: [r for r in c.ledger(key) if r.kind == "try"], T, "the first try")
    victim.send_signal(signal.SIGKILL)
    assert victim.wait(10) == -signal.SIGKILL
    second = c.start_worker(concurrency=1, pool="solo", **c.trace_env)  # type: ignore[attr-defined]
    assert step.result(timeout=T) == "i"
    e = c.sw.inspect(key).entries[1]
    assert (e.attempts, e.in_doubt) == (2, False)
    wait_spans(c, producer_spans, key, f"step {IDEM}", 1)
    _, trace = saga_trace(c, producer_spans, key)
    root = one(trace, "saga begin")
    # the killed run never ended, so never exported: the re-run is the step's only span
    run, enq = one(trace, f"step {IDEM}", 2), one(trace, f"enqueue {IDEM}", 2)
    assert (run["parent_id"], run["pid"], run["attributes"]["sagaworker.attempt"],
            run["attributes"]["sagaworker.outcome"]) == (enq["span_id"], second.pid, 2,
                                                         "executed")
    assert one(trace, f"step {STEP}", 1)["pid"] == victim.pid
    rerun = [(e["trace_id"], e["span_id"]) for e in c.events(key) if e["event"] == "step_rerun"]
    assert rerun == [(run["trace_id"], run["span_id"])]
    assert_whole(trace, root)

