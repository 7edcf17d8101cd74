"""``step.result()`` as users call it, on every step of a saga in turn: an outcome is
final, so the steps of one handle share what one read of the journal found. A saga's
finished steps cost one read (two past ``NEAR`` steps), not one read each."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from celery import Celery
from sqlalchemy import event

from sagaworker import SagaNotFound, Sagaworker, Settings, ToolFailed
from sagaworker._journal.reads import NEAR
from tests.conftest import UNIT_SECRET


@pytest.fixture
def sw(tmp_path: Path) -> Iterator[Sagaworker]:
    app = Celery("reads", broker="memory://")
    app.conf.task_always_eager = True  # (a unit test: the steps run inline)
    s = Sagaworker(app, settings=Settings(
        database_url=f"sqlite:///{tmp_path / 'j.db'}", broker_url="memory://",
        approval_secret=UNIT_SECRET, broker_folder=str(tmp_path / "b"), sweep_interval=0))

    @s.tool()
    def double(n: int) -> int:
        return 2 * n

    @s.tool()
    def boom() -> None:
        raise ValueError("declined")

    s.validate()
    yield s


def entry_reads(sw: Sagaworker) -> list[str]:
    seen: list[str] = []

    @event.listens_for(sw.journal.engine, "before_cursor_execute")
    def _read(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        if statement.lstrip().upper().startswith("SELECT") and \
                "FROM sagaworker_entries" in statement:
            seen.append(statement)
    return seen


def tool(sw: Sagaworker, name: str) -> Any:
    return next(t.task for t in sw.registry.tools.values() if t.name.endswith(f".{name}"))


def test_a_sagas_finished_steps_cost_one_read(sw: Sagaworker) -> None:
    saga = sw.begin("r-1")
    steps = [saga.enqueue(tool(sw, "double"), i) for i in range(30)]
    reads = entry_reads(sw)
    assert [s.result() for s in steps] == [2 * i for i in range(30)]
    assert len(reads) == 1


def test_past_near_steps_a_read_brings_the_next_ones(sw: Sagaworker) -> None:
    saga = sw.begin("r-2")
    steps = [saga.enqueue(tool(sw, "double"), i) for i in range(NEAR + 10)]
    reads = entry_reads(sw)
    assert [s.result() for s in steps] == [2 * i for i in range(NEAR + 10)]
    assert len(reads) == 2


def test_a_failed_step_read_with_the_others_raises_as_before(sw: Sagaworker) -> None:
    saga = sw.begin("r-3")
    first = saga.enqueue(tool(sw, "double"), 1)
    failed = saga.enqueue(tool(sw, "boom"))
    reads = entry_reads(sw)
    assert first.result() == 2
    with pytest.raises(ToolFailed, match="declined"):
        failed.result()
    assert len(reads) == 1


def test_awaited_in_turn_the_same(sw: Sagaworker) -> None:
    saga = sw.begin("r-4")
    steps = [saga.enqueue(tool(sw, "double"), i) for i in range(10)]
    reads = entry_reads(sw)

    async def each() -> list[int]:
        return [await s.aresult() for s in steps]

    assert asyncio.run(each()) == [2 * i for i in range(10)]
    assert len(reads) == 1


def test_a_step_not_in_the_journal_is_still_not_found(sw: Sagaworker) -> None:
    step = sw.begin("r-5").enqueue(tool(sw, "double"), 1)
    step.seq = 99
    with pytest.raises(SagaNotFound):
        step.result()
