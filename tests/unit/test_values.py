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
