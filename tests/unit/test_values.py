"""Values as Celery's JSON carries them, refusals that name the argument, and a broker
that is down failing nobody once the journal has the work."""

from __future__ import annotations

import uuid
from datetime import UTC, date, datetime, time
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest
from celery import Celery
from structlog.testing import capture_logs

from sagaworker import FlowContext, Phase, Sagaworker, SagaworkerError, Settings
from tests.conftest import UNIT_SECRET


def _sw(tmp_path: Path, broker: str = "memory://") -> Sagaworker:
    app = Celery("values", broker=broker)
    return Sagaworker(app, settings=Settings(
        database_url=f"sqlite:///{tmp_path / 'j.db'}", broker_url=broker,
        approval_secret=UNIT_SECRET, broker_folder=str(tmp_path / "b")))


def book(s: FlowContext, when: datetime, seats: set[str] | None = None) -> None:
    """A flow for the refusal test (module level, as flows must be)."""


def test_celerys_json_types_are_journaled_and_read_back(tmp_path: Path) -> None:
    """datetime, date, time, Decimal, UUID and bytes in arguments and metadata come back
    from the journal as the same values (kombu's JSON), not as text."""
    sw = _sw(tmp_path)

    @sw.tool()
    def stamp(at: datetime, day: date, clock: time, amount: Decimal, ref: uuid.UUID,
              raw: bytes) -> None: ...

    values: list[Any] = [datetime(2026, 12, 4, 10, 0, tzinfo=UTC), date(2026, 12, 4),
                         time(10, 30), Decimal("19.99"), uuid.uuid4(), b"\x00\xffraw"]
    saga = sw.begin("typed", metadata={"at": values[0], "nested": [{"amount": values[3]}]})
    saga.enqueue(stamp, *values)
    rec = sw.inspect("typed")
    assert rec.metadata == {"at": values[0], "nested": [{"amount": values[3]}]}
    assert rec.entries[0].args == values
    assert [type(v) for v in rec.entries[0].args] == [type(v) for v in values]


@pytest.mark.parametrize(("call", "named"), [
    (lambda sw, tool: sw.begin("bad-1").enqueue(tool, "o-1", {"a", "b"}),
     "argument 'seats' holds a set"),
    (lambda sw, tool: sw.begin("bad-2").enqueue(tool, "o-1", seats=object()),
     "argument 'seats' holds a object"),
    (lambda sw, tool: sw.begin("bad-3").enqueue(tool, float("nan")),
     "argument 'order' holds a float (NaN or infinity)"),
    (lambda sw, tool: sw.start("bad-4", book, datetime.now(UTC), seats={"1a"}),
     "argument 'seats' holds a set"),
])
def test_a_value_celery_cannot_carry_is_refused_naming_it(
        tmp_path: Path, call: Any, named: str) -> None:
    """Refused at enqueue/start with a SagaworkerError naming the argument and its type;
    no step is journaled."""
    sw = _sw(tmp_path)
    sw.flow()(book)

    @sw.tool()
    def reserve(order: Any, seats: Any = None) -> None: ...

    with pytest.raises(SagaworkerError, match="not JSON") as err:
        call(sw, reserve)
    assert named in str(err.value)
    assert all(not r.entries for r in sw.sagas())
    assert all(r.saga_id != "bad-4" for r in sw.sagas())


def test_a_broker_that_is_down_fails_nobody(tmp_path: Path) -> None:
    """enqueue, start and fail return once the journal holds the work (a web app answers
    202, not 500): the step stays INTENT for the relay, `publish_deferred` says why."""
    sw = _sw(tmp_path, broker="amqp://guest:guest@127.0.0.1:1//")  # nothing listens there

    @sw.tool()
    def reserve(sku: str) -> None: ...

    sw.flow()(book)
    with capture_logs() as logs:
        step = sw.begin("down-1").enqueue(reserve, "sku-1")
        sw.start("down-2", book, datetime(2026, 1, 1, tzinfo=UTC))
    assert step.phase is Phase.INTENT
    assert sw.inspect("down-2").flow is not None
    deferred = [e for e in logs if e["event"] == "publish_deferred"]
    assert [(e["log_level"], e["saga_id"]) for e in deferred] == [
        ("warning", "down-1"), ("warning", "down-2")]
    assert all("Error" in e["error"] for e in deferred)


@pytest.mark.parametrize("saga_id", [".", ".."])
def test_a_saga_id_no_url_can_name_is_refused(tmp_path: Path, saga_id: str) -> None:
    """'.' and '..' cannot be one URL path segment (browsers resolve them even encoded):
    the dashboard could never act on such a saga."""
    sw = _sw(tmp_path)
    with pytest.raises(SagaworkerError, match="path step"):
        sw.begin(saga_id)
    assert sw.sagas() == []


@pytest.mark.parametrize(("value", "named"), [
    ({1: "a", "b": 2}, "dict whose keys are not all str"),
    ({"__type__": "nothing-kombu-knows", "__value__": 1}, "kombu's type tag"),
    ([{"deep": {"__type__": "datetime", "__value__": "not a date"}}], "kombu's type tag"),
])
def test_values_the_journal_could_not_read_back_are_refused(
        tmp_path: Path, value: Any, named: str) -> None:
    """A dict with keys of mixed types, or one shaped like kombu's type tag that kombu
    cannot decode, is refused at enqueue and as metadata (a SagaworkerError, not a raw
    TypeError, and never a row no read could open)."""
    sw = _sw(tmp_path)

    @sw.tool()
    def note(body: Any) -> None: ...

    with pytest.raises(SagaworkerError, match=named):
        sw.begin("tag-1").enqueue(note, value)
    with pytest.raises(SagaworkerError, match=named):
        sw.begin("tag-2", metadata={"x": value})
    assert [r.entries for r in sw.sagas()] == [[]]


def test_an_unjournalable_result_asks_the_saga_to_fail_in_the_same_move(
        tmp_path: Path) -> None:
    """EXECUTED with ``result is not JSON`` and the failure request commit together: a
    worker lost between them cannot leave the effect live with nobody told (the sweeper
    sends a failure request it finds)."""
    from sagaworker._machine.machine import new_token

    sw = _sw(tmp_path)

    @sw.tool()
    def reserve(sku: str) -> None: ...

    sw.begin("nj-1").enqueue(reserve, "sku-1")
    token = new_token()
    claim = sw.rt.machine.claim_start("nj-1", 1, reserve.name, token=token, worker="w",
                                      idempotent=False, task_id=None)
    assert claim.attempt == 1
    out = sw.rt.machine.executed("nj-1", 1, token, None, 1.0,
                                 error="result is not JSON: set",
                                 fail_reason="step 1 (reserve) failed: result is not JSON: set")
    assert out.applied
    row = sw.journal.saga_row("nj-1")
    assert row.fail_requested_at is not None
    assert row.reason == "step 1 (reserve) failed: result is not JSON: set"
    entry = sw.inspect("nj-1").entries[0]
    assert (entry.phase, entry.result, entry.error) == (Phase.EXECUTED, None,
                                                        "result is not JSON: set")


def test_the_json_api_and_dashboard_show_every_journaled_type(tmp_path: Path) -> None:
    """A saga holding a time, bytes, a date, a Decimal and a UUID is served (200, ISO
    text), not a 500 for the whole listing."""
    from sagaworker.web import WebAuth, create_app

    sw = _sw(tmp_path)

    @sw.tool()
    def stamp(clock: time, raw: bytes, day: date, amount: Decimal, ref: uuid.UUID) -> None:
        ...

    ref = uuid.uuid4()
    sw.begin("web-1").enqueue(stamp, time(10, 30), b"\xff\x00", date(2026, 12, 4),
                              Decimal("1.50"), ref)
    client = create_app(sw, auth=WebAuth(anonymous_reads=True)).test_client()
    one = client.get("/sagas/web-1")
    assert one.status_code == 200
    assert one.get_json()["entries"][0]["args"] == ["10:30:00", "/wA=", "2026-12-04", "1.50",
                                                    str(ref)]
    assert client.get("/sagas").status_code == 200
    assert client.get("/ui/sagas/web-1").status_code == 200
    assert client.get("/").status_code == 200


def test_only_a_broker_error_is_deferred(tmp_path: Path) -> None:
    """An error that is not the broker's (here a tool run eagerly that raises) is not
    taken for a broker that is down: it raises, and nothing says `publish_deferred`."""
    sw = _sw(tmp_path)
    sw.app.conf.task_always_eager = True
    sw.app.conf.task_eager_propagates = True

    @sw.tool()
    def explode() -> None:
        raise RuntimeError("the tool's own error")

    with capture_logs() as logs, pytest.raises(RuntimeError, match="the tool's own error"):
        sw.begin("eager-1").enqueue(explode)
    assert [e for e in logs if e["event"] == "publish_deferred"] == []


@pytest.mark.parametrize("deadline", [float("nan"), float("inf"), -1, 0, 1e12])
def test_a_deadline_that_is_no_number_of_seconds_is_refused(tmp_path: Path,
                                                            deadline: float) -> None:
    """NaN, infinite, negative and absurd deadlines: a ConfigurationError saying the range,
    no saga journaled (they raised raw errors)."""
    sw = _sw(tmp_path)
    with pytest.raises(SagaworkerError, match="ten years"):
        sw.begin("dl-1", deadline=deadline)
    assert sw.sagas() == []


@pytest.mark.parametrize("saga_id", ["a\x00b", "two\nlines", "tab\there"])
def test_a_saga_id_with_a_control_character_is_refused(tmp_path: Path, saga_id: str) -> None:
    sw = _sw(tmp_path)
    with pytest.raises(SagaworkerError, match="control character"):
        sw.begin(saga_id)
    assert sw.sagas() == []


@pytest.mark.parametrize(("value", "named"), [
    ("card\x00number", "string with a NUL character"),
    ({"$sagaworker_enc": "gAAAA"}, "which the journal reserves"),
    ({"k\x00": 1}, "dict key with a NUL character"),
])
def test_what_postgresql_or_the_journal_could_not_hold_is_refused(
        tmp_path: Path, value: Any, named: str) -> None:
    """A NUL (PostgreSQL's JSON has none) and the journal's encrypted-value key (the
    dashboard, `list` and rotate-key failed on it) are refused at write time."""
    sw = _sw(tmp_path)

    @sw.tool()
    def note(body: Any) -> None: ...

    with pytest.raises(SagaworkerError, match=named):
        sw.begin("res-1").enqueue(note, value)
    with pytest.raises(SagaworkerError, match=named):
        sw.begin("res-2", metadata={"m": value})
    assert [r.entries for r in sw.sagas()] == [[]]
