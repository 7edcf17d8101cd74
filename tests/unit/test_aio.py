"""The asyncio twins on the embedded SQLite journal: no notifications there, so the
loop's hub reads, on the synchronous calls' backoff, once for all its waits."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import pytest
from sqlalchemy import update

from sagaworker import Sagaworker, ToolFailed
from sagaworker._base.crypto import Placed
from sagaworker._journal.schema import entries
from sagaworker._producer import aio
from tests.conftest import uid


def unpublished(sw: Sagaworker) -> Any:
    @sw.tool()
    def thing(x: int) -> int:
        return x

    sw.rt.bus.publish_step = lambda *a, **k: True  # type: ignore[method-assign]
    return thing


def settle(sw: Sagaworker, saga_id: str, phase: str, **values: Any) -> None:
    """Step 1 of the saga journaled as ``phase`` (what a worker would write)."""
    if "result" in values:
        values["result"] = Placed(values["result"], (saga_id, 1))
    with sw.journal.engine.begin() as conn:
        conn.execute(update(entries).where(entries.c.saga_id == saga_id)
                     .values(phase=phase, **values))


def test_aresult_on_sqlite_reads_once_for_every_wait(sqlite_sw: Sagaworker) -> None:
    """Twenty waits on twenty sagas: each poll of the hub is one ``settled`` read for all
    of them (not one per wait), and each wait returns its own step's value."""
    thing = unpublished(sqlite_sw)
    sagas = [sqlite_sw.begin(uid("q")) for _ in range(20)]
    steps = [s.enqueue(thing, i) for i, s in enumerate(sagas)]
    reads: list[int] = []
    real = sqlite_sw.journal.settled

    def counted(st: Any, sg: Any) -> Any:
        reads.append(len(st))
        return real(st, sg)

    sqlite_sw.journal.settled = counted  # type: ignore[method-assign]

    async def main() -> list[Any]:
        waits = asyncio.gather(*(s.aresult(timeout=30) for s in steps))
        while not reads or reads[-1] < len(steps):  # every wait is in the hub
            await asyncio.sleep(0.01)
        for i, s in enumerate(sagas):
            await asyncio.to_thread(settle, sqlite_sw, s.saga_id, "EXECUTED", result=i * 2)
        return list(await waits)

    assert asyncio.run(main()) == [i * 2 for i in range(20)]
    assert max(reads) == 20  # one read held all twenty


def test_a_cancelled_wait_leaves_nothing_behind(sqlite_sw: Sagaworker) -> None:
    """A wait cancelled (a timeout, a client gone) is dropped from the hub, which then
    stops reading; a FAILED step's aresult raises ToolFailed as result() does."""
    thing = unpublished(sqlite_sw)
    saga = sqlite_sw.begin(uid("c"))
    step = saga.enqueue(thing, 1)

    async def main() -> aio.Hub:
        with pytest.raises(TimeoutError, match=r"did not finish within 0\.05 s"):
            await step.aresult(timeout=0.05)
        hub = await aio.hub_of(sqlite_sw.rt)
        assert (hub._steps, hub._sagas, hub._watches) == ({}, {}, {})
        await asyncio.to_thread(settle, sqlite_sw, saga.saga_id, "FAILED", error="Boom: no")
        with pytest.raises(ToolFailed, match="failed: Boom: no"):
            await step.aresult(timeout=5)
        return hub

    hub = asyncio.run(main())
    assert hub._task is None or hub._task.done()


def test_the_blocking_parts_run_on_sagaworkers_own_pool(sqlite_sw: Sagaworker) -> None:
    """abegin and aenqueue run their journal writes off the loop, on the sagaworker-aio
    threads (not the loop's default executor), with the caller's context variables."""
    import contextvars

    thing = unpublished(sqlite_sw)
    var: contextvars.ContextVar[str] = contextvars.ContextVar("request_id")
    seen: list[tuple[str, str]] = []
    real = sqlite_sw.machine.create_saga

    def spy(*a: Any, **k: Any) -> Any:
        seen.append((threading.current_thread().name, var.get("-")))
        return real(*a, **k)

    sqlite_sw.machine.create_saga = spy  # type: ignore[method-assign]

    async def main() -> int:
        var.set("req-7")
        saga = await sqlite_sw.abegin(uid("p"))
        return (await saga.aenqueue(thing, 3)).seq

    assert asyncio.run(main()) == 1
    assert len(seen) == 1 and seen[0][0].startswith("sagaworker-aio") and seen[0][1] == "req-7"


def test_an_app_session_writes_sealed_values(tmp_path: Any) -> None:
    """With encryption on, the rows written through the app's own engine (another engine
    on the journal's database) are sealed as the journal's own writes are."""
    from celery import Celery
    from cryptography.fernet import Fernet
    from sqlalchemy import create_engine, text
    from sqlalchemy.orm import Session

    from sagaworker import Settings
    from sagaworker._base.crypto import is_sealed
    from tests.conftest import UNIT_SECRET

    url = f"sqlite:///{tmp_path / 'j.db'}"
    sw = Sagaworker(Celery("enc", broker="memory://"), settings=Settings(
        database_url=url, broker_url="memory://", approval_secret=UNIT_SECRET,
        broker_folder=str(tmp_path / "b"), encryption_keys=Fernet.generate_key().decode()))
    thing = unpublished(sw)
    app = create_engine(url)
    with Session(app) as s:
        sw.begin("enc-1", connection=s, metadata={"card": "4242"}).enqueue(thing, 42,
                                                                          connection=s)
        s.commit()
    with app.connect() as c:
        meta = c.execute(text("SELECT metadata FROM sagaworker_sagas")).scalar_one()
        args = c.execute(text("SELECT args FROM sagaworker_entries")).scalar_one()
    import json

    assert is_sealed(json.loads(args)) and "4242" not in meta
    assert sw.inspect("enc-1").entries[0].args == [42]
    app.dispose()


def test_the_hubs_read_brings_the_outcome_it_wakes_a_wait_with(sqlite_sw: Sagaworker) -> None:
    """A wait on the last step of a long saga: the hub's read brings that step's row, of
    the steps waited on only (not every entry of the saga), and ``aresult`` answers from
    it: no read of the entry after the wake."""
    thing = unpublished(sqlite_sw)
    saga = sqlite_sw.begin(uid("long"))
    steps = saga.enqueue_many([(thing, (i,), {}) for i in range(40)])
    last = steps[-1]
    with sqlite_sw.journal.engine.begin() as conn:
        conn.execute(update(entries).where(entries.c.saga_id == saga.saga_id,
                                           entries.c.seq < last.seq)
                     .values(phase="EXECUTED"))
    brought: list[Any] = []
    real = sqlite_sw.journal.settled

    def counted(st: Any, sg: Any) -> Any:
        got = real(st, sg)
        brought.append(got[0])
        return got

    sqlite_sw.journal.settled = counted  # type: ignore[method-assign]

    async def main() -> Any:
        wait = asyncio.ensure_future(last.aresult(timeout=30))
        while not brought:  # the wait is in the hub
            await asyncio.sleep(0.01)
        reread: list[Any] = []
        sqlite_sw.journal.entry_row = lambda *a: reread.append(a)  # type: ignore[method-assign]
        with sqlite_sw.journal.engine.begin() as conn:
            conn.execute(update(entries).where(entries.c.saga_id == saga.saga_id,
                                               entries.c.seq == last.seq)
                         .values(phase="EXECUTED",
                                 result=Placed(84, (saga.saga_id, last.seq))))
        value = await wait
        assert reread == [], "aresult read the entry again after the hub's read"
        return value

    assert asyncio.run(main()) == 84
    assert all(set(got) <= {(saga.saga_id, last.seq)} for got in brought), (
        "the hub's read brought steps nobody waits on")
    assert brought[-1][(saga.saga_id, last.seq)].result == 84
