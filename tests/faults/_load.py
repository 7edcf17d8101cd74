"""Load and oracle for the fault suite: many concurrent sagas, then every invariant checked.

The oracle is the ledger the test tools write themselves (tests/apps/cluster.py): an effect row
when a tool's effect happens, an undo row when its undo is applied. The journal is checked
against it, never against itself.

The test undo is idempotent, as every undo must be: it applies under its
``idempotency_key``, and a try repeated after a crash (the undo ran, its worker died before
the outcome committed) is written as a ``repeat`` row and changes nothing. Repeats are
counted (``undo_retries``), never accepted as a second undo, and each must carry its own
journaled attempt number: two tries under one claim would mean two ran at once.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from typing import Any

from sagaworker import Phase, SagaStatus, SagaworkerError, ToolFailed
from tests.conftest import ROOT, Cluster, uid, wait_for

SCALE = {"small": 100, "large": 400}[os.environ.get("FAULT_SCALE", "small")]
OUTPUT = ROOT / "tests" / "output"
STEP_SLEEP = 0.05


@dataclass
class Figures:
    scenario: str
    broker: str
    sagas: int
    faults: int
    completed: int = 0
    compensated: int = 0
    compensation_failed: int = 0
    steps: int = 0
    effects: int = 0
    effects_lost: int = 0
    effects_duplicated: int = 0
    undos_duplicated: int = 0
    undo_retries: int = 0
    in_doubt: int = 0
    #: attempts that started and never finished (a second attempt, or in doubt): the
    #: proof that a kill hit a running tool, not just a process
    interrupted: int = 0
    seconds: float = 0.0
    problems: list[str] = field(default_factory=list)


def retry(fn: Callable[[], Any], seconds: float = 90) -> Any:
    """Producer calls ride out a database or broker restart (what a web app retries)."""
    deadline = time.monotonic() + seconds
    while True:
        try:
            return fn()
        except (ToolFailed, SagaworkerError, TimeoutError):
            raise
        except Exception:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)


def drive_flow(c: Cluster, saga_id: str, index: int) -> None:
    """One flow saga, started and left to the workers: a quarter fail in their last step,
    a quarter are aborted by an operator while they run."""
    from tests.apps.cluster import load_flow

    mode = index % 4
    saga = retry(lambda: c.sw.start(saga_id, load_flow, saga_id, fail=mode == 0,
                                    sleep=STEP_SLEEP))
    if mode == 1:
        time.sleep(random.uniform(0.05, 0.5))
        with contextlib.suppress(SagaworkerError):  # it finished first: nothing to abort
            retry(lambda: c.sw.abort(saga_id, reason="customer cancelled", actor="load"))
    # nobody needs to wait; the load does, so the faults land while flows run
    with contextlib.suppress(TimeoutError):
        retry(lambda: saga.wait(timeout=150))


def drive(c: Cluster, saga_id: str, index: int, *, duplicate_deliveries: bool = False,
          duplicate_failures: int = 1, flows: bool = False) -> None:
    """One saga: three sequential steps; a quarter fail in a tool, a quarter are cancelled."""
    if flows:
        drive_flow(c, saga_id, index)
        return
    step = c.sw.registry.tool("tests.apps.cluster.step").task
    saga = retry(lambda: c.sw.begin(saga_id))
    mode = index % 4
    try:
        for n in (1, 2, 3):
            s = retry(lambda n=n: saga.enqueue(step, saga_id, f"s{n}", sleep=STEP_SLEEP,
                                               fail=(mode == 0 and n == 3)))
            if duplicate_deliveries:
                row = retry(lambda s=s: c.sw.journal.entry_row(saga_id, s.seq))
                for _ in range(2):
                    c.sw.producer.publish(saga_id, s.seq, row.tool_name, list(row.args),
                                          dict(row.kwargs), row.task_id, row.queue)
            retry(lambda s=s: s.result(timeout=120))
            if mode == 1 and n == 2:
                for _ in range(duplicate_failures):
                    retry(lambda: saga.fail("customer cancelled"))
                return
        retry(saga.complete)
    except ToolFailed:
        for _ in range(duplicate_failures - 1):
            c.sw.send_failure(saga_id, "duplicate failure message")
    except (SagaworkerError, TimeoutError) as exc:
        why = f"driver: {exc}"
        retry(lambda: saga.fail(why))


def run_load(c: Cluster, scenario: str, *, inject: Callable[[threading.Event], int],
             sagas: int = SCALE, **drive_opts: Any) -> Figures:
    """Drive `sagas` concurrent sagas while `inject` injects faults; wait; check everything."""
    prefix = uid(scenario)
    ids = [f"{prefix}-{i:04d}" for i in range(sagas)]
    stop = threading.Event()
    injected: list[int] = []
    t0 = time.monotonic()
    injector = threading.Thread(target=lambda: injected.append(inject(stop)), daemon=True)
    injector.start()
    with ThreadPoolExecutor(max_workers=sagas) as pool:
        futures = [pool.submit(drive, c, sid, i, **drive_opts) for i, sid in enumerate(ids)]
        errors = [f.exception() for f in futures]
    stop.set()
    injector.join(120)
    for e in errors:
        if e is not None:
            raise e
    try:
        wait_for(lambda: all(retry(lambda sid=sid: c.sw.inspect(sid)).status.terminal
                             for sid in ids), 180, f"every {scenario} saga to be terminal")
    except AssertionError as exc:
        stuck = [c.sw.inspect(sid) for sid in ids]
        stuck = [r for r in stuck if not r.status.terminal]
        detail = "; ".join(
            f"{r.saga_id} {r.status.value} " + ",".join(
                f"{e.seq}:{e.phase.value}{'/lease' if e.attempts else ''}"
                f"{'/' + e.compensation.value if e.compensation else ''}" for e in r.entries)
            for r in stuck[:8])
        raise AssertionError(f"{exc}: {len(stuck)} stuck, e.g. {detail}") from None
    figures = check(c, scenario, ids, injected[0] if injected else 0)
    figures.seconds = round(time.monotonic() - t0, 1)
    save(figures)
    return figures


def check(c: Cluster, scenario: str, ids: list[str], faults: int) -> Figures:
    f = Figures(scenario=scenario, broker=c.broker, sagas=len(ids), faults=faults)
    for sid in ids:
        rec = retry(lambda sid=sid: c.sw.inspect(sid))
        ledger = retry(lambda sid=sid: c.ledger(sid))
        eff: dict[str, int] = {}
        und: dict[str, int] = {}
        tries: dict[str, list[int]] = {}
        for r in ledger:
            bucket = eff if r.kind == "effect" else und if r.kind == "undo" else None
            if bucket is not None:
                bucket[r.tool] = bucket.get(r.tool, 0) + 1
            if r.kind == "undo" or (r.kind == "repeat" and r.detail.get("of") == "undo"):
                tries.setdefault(r.tool, []).append(r.detail["attempt"])
        f.completed += rec.status is SagaStatus.COMPLETED
        f.compensated += rec.status is SagaStatus.COMPENSATED
        f.compensation_failed += rec.status is SagaStatus.COMPENSATION_FAILED
        f.steps += len(rec.entries)
        for e in rec.entries:
            name = e.args[1]
            n_eff, n_undo = eff.get(name, 0), und.get(name, 0)
            f.effects += n_eff
            where = f"{sid}#{e.seq} {e.phase.value}"
            if n_eff > 1:
                f.effects_duplicated += 1
                f.problems.append(f"{where}: effect ran {n_eff} times")
            if n_undo > 1:
                f.undos_duplicated += 1
                f.problems.append(f"{where}: undo ran {n_undo} times")
            attempts = tries.get(name, [])
            f.undo_retries += max(len(attempts) - 1, 0)
            if len(set(attempts)) != len(attempts):
                f.problems.append(f"{where}: two undo tries under one claim {attempts}")
            f.interrupted += e.in_doubt or e.attempts > 1
            if e.in_doubt:
                f.in_doubt += 1
                if n_undo:
                    f.problems.append(f"{where}: in doubt but undone")
                continue
            if e.phase is Phase.EXECUTED:
                if n_eff != 1:
                    f.effects_lost += 1
                    f.problems.append(f"{where}: EXECUTED but the effect ran {n_eff} times")
                compensating = rec.status is not SagaStatus.COMPLETED
                if compensating and n_undo != 1:
                    f.problems.append(f"{where}: saga {rec.status.value}, undo ran {n_undo}x")
                if not compensating and n_undo:
                    f.problems.append(f"{where}: COMPLETED saga but undone")
            elif n_eff:
                f.effects_lost += 1
                f.problems.append(f"{where}: effect happened but journaled {e.phase.value}, "
                                  "not in doubt")
            elif n_undo:
                f.problems.append(f"{where}: undone without being EXECUTED")
    return f


def save(f: Figures) -> None:
    OUTPUT.mkdir(parents=True, exist_ok=True)
    path = OUTPUT / "reliability.json"
    data = json.loads(path.read_text()) if path.exists() else {}
    data[f"{f.scenario}/{f.broker}"] = asdict(f)
    path.write_text(json.dumps(data, indent=2))


def every(stop: threading.Event, seconds: float, times: int, fault: Callable[[], None],
          first: float = 1.0) -> int:
    """Call `fault` up to `times` times, `seconds` apart, while the load runs."""
    n = 0
    if stop.wait(first):
        return n
    while n < times:
        fault()
        n += 1
        if stop.wait(seconds):
            break
    return n


def jitter() -> float:
    return random.uniform(0.0, 0.5)

