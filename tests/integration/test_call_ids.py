"""Adversarial review of ``enqueue_call`` (one tool-call id never journals a
second step; a resumed or replayed run gets the first step's outcome), on SQLite and
PostgreSQL."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from sagaworker import BadInput, Sagaworker
from tests.integration.test_clocks import ON_BOTH, bus, journal_only
from tests.integration.test_lost_commit import lose_commit_reply


@pytest.fixture(params=ON_BOTH)
def sw(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Sagaworker]:
    sw = journal_only(request, tmp_path)

    @sw.tool()
    def plain(n: int) -> int:
        return n

    @sw.tool()
    def other(n: int) -> int:
        return n

    yield sw
    sw.rt.journal.engine.dispose()


def _tool(sw: Sagaworker, name: str) -> Any:
    return sw.registry.tool(f"{__name__}.{name}").task


def test_a_retry_after_a_lost_commit_reply_publishes_the_step(sw: Sagaworker) -> None:
    """The COMMIT of enqueue_call's INTENT is applied but its reply lost: the journal finds
    the row by its task id once the server is done with the transaction, and the call
    answers as if the reply had come (the step, published). A caller retrying anyway (an
    agent framework, a resumed run) with the same call id gets that step: one step, and
    it was published, so its aresult does not wait for the relay."""
    saga = sw.begin("c-lost")
    with lose_commit_reply(sw) as left:
        first = saga.enqueue_call("call_1", _tool(sw, "plain"), [1])
    assert left[0] == 0  # the fault hit
    step = saga.enqueue_call("call_1", _tool(sw, "plain"), [1])  # the retry
    assert step.seq == first.seq
    rec = sw.inspect("c-lost")
    assert [(e.seq, e.call_id) for e in rec.entries] == [(1, "call_1")]  # one step: holds
    published = [m for m in bus(sw).sent if m[0] == "step"]
    assert published[0] == ("step", "c-lost", step.seq), (
        "the step journaled for call_1 was not published by the call that journaled it")
    assert set(published) == {("step", "c-lost", step.seq)}


def test_racing_callers_with_one_call_id_journal_one_step(sw: Sagaworker) -> None:
    """Eight threads call enqueue_call with one id at once (the IntegrityError path on
    both databases): one step, every caller gets it."""
    saga = sw.begin("c-race")
    got: list[int] = []
    errors: list[BaseException] = []
    gate = threading.Barrier(8)

    def call() -> None:
        try:
            gate.wait()
            got.append(saga.enqueue_call("call_r", _tool(sw, "plain"), [5]).seq)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=call) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    assert got == [1] * 8
    assert [e.call_id for e in sw.inspect("c-race").entries] == ["call_r"]
    # the inserting caller publishes; a caller that found the step still queued sends it
    # again (a retry after a lost COMMIT reply must not wait for the relay): duplicates
    # of one step, which its claim absorbs
    sent = [m for m in bus(sw).sent if m[0] == "step"]
    assert sent and set(sent) == {("step", "c-race", 1)}


def test_a_call_id_with_another_tool_or_arguments_is_refused(sw: Sagaworker) -> None:
    saga = sw.begin("c-other")
    saga.enqueue_call("call_1", _tool(sw, "plain"), [1])
    with pytest.raises(BadInput, match="already journaled step 1"):
        saga.enqueue_call("call_1", _tool(sw, "other"), [1])
    with pytest.raises(BadInput, match="already journaled step 1"):
        saga.enqueue_call("call_1", _tool(sw, "plain"), [], {"n": 2})
    # the same call, arguments spelt by keyword: the same digest? (positional vs keyword)
    again = saga.enqueue_call("call_1", _tool(sw, "plain"), [1])
    assert again.seq == 1
    # one id per saga: another saga may reuse it
    assert sw.begin("c-other-2").enqueue_call("call_1", _tool(sw, "plain"), [1]).seq == 1

    async def main() -> Any:
        return await saga.aenqueue_call("call_1", _tool(sw, "plain"), [1])

    assert asyncio.run(main()).seq == 1


def test_an_embedded_journal_of_an_earlier_release_gets_the_call_id_index(tmp_path: Path
                                                                          ) -> None:
    """An embedded journal an earlier release made (tables, no revision) is completed at
    start: ``_add_missing_columns`` adds ``call_id``, and the journal is stamped at the head
    (0007). ``metadata.create_all`` skips existing tables with their indexes, so the unique
    index ``ux_sagaworker_entries_call_id`` is never made, and ``db upgrade`` sees the head
    and makes nothing either. Racing callers with one tool-call id then journal several
    steps ("one tool-call id never journals a second step")."""
    from celery import Celery
    from sqlalchemy import create_engine, inspect, text

    from sagaworker import Settings
    from sagaworker._journal.migrate import upgrade
    from tests.integration.test_clocks import Bus

    url = f"sqlite:///{tmp_path / 'old.db'}"
    upgrade(url, "0006")  # the release before call ids...
    engine = create_engine(url)
    with engine.begin() as conn:  # ...made by a release before the stamp
        conn.execute(text("DROP TABLE sagaworker_alembic_version"))
    sw = Sagaworker(Celery("old", broker="memory://"), settings=Settings(
        database_url=url, broker_url="memory://"))

    @sw.tool()
    def plain(n: int) -> int:
        return n

    sw.rt.bus = Bus()  # type: ignore[assignment]
    saga = sw.begin("old-1")
    ids = [f"call_{i}" for i in range(20)]
    gate = threading.Barrier(8)

    def call() -> None:
        for call_id in ids:
            gate.wait()
            saga.enqueue_call(call_id, plain, [1])

    threads = [threading.Thread(target=call) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    try:
        indexes = {i["name"] for i in inspect(engine).get_indexes("sagaworker_entries")}
        per_id = [e.call_id for e in sw.inspect("old-1").entries]
        twice = sorted({c for c in per_id if per_id.count(c) > 1})
        assert twice == [], f"call ids journaled more than once: {twice} ({len(per_id)} steps)"
        assert "ux_sagaworker_entries_call_id" in indexes, indexes
    finally:
        sw.rt.journal.engine.dispose()
        engine.dispose()
