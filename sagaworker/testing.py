"""A pytest toolkit for sagaworker users: prove a saga's compensation without a broker.

    from sagaworker.testing import check_compensation

    def test_order_saga_compensates():
        check_compensation(sw, order_work("o-1", "sku", 1, "card", 100), crash=True)

    def test_order_flow_compensates():       # a flow: its arguments follow, as for sw.start
        check_compensation(sw, place_order, "o-1", "sku", 1, "card", 100, crash=True)

``check_compensation`` runs the work (or the flow, through ``sw.start``) once to learn its
steps, then once per step with that step failing, and asserts that every earlier EXECUTED
step was undone in strict reverse order and that nothing after the failing step ran. With
``crash=True`` it also simulates, for each step, a worker lost between the effect and its
EXECUTED commit, and asserts the step is reported in doubt (or, for ``idempotent=True``
tools, run again). A flow is also replayed (twice) after every step, and the check fails
if a replay diverges from the journal, asks for another next step than the replay before
it, or returns another value: what a flow that reads the clock, a random number or
anything outside the journal does.

Steps run in the test process on a throwaway SQLite journal (the real journal code, the
real compensation runner); gated steps are approved automatically.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import secrets
import shutil
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import SecretStr
from sqlalchemy import update

from ._base.patches import patch_id
from ._base.types import ENVELOPE, SagaResult, SagaStatus
from ._base.units import is_unit
from ._journal.dialect import db_later, make_engine
from ._journal.repository import Journal
from ._journal.schema import entries
from ._recovery.compensation import current_compensation
from ._worker.check import diverged_error, new_names
from ._worker.replay import replay as _replay

if TYPE_CHECKING:
    from ._core.sagaworker import Sagaworker

__all__ = ["CompensationCase", "InjectedFailure", "check_compensation", "harness",
           "replay", "replay_problem"]


class InjectedFailure(Exception):
    """Raised in place of the tool under test."""


class _Crash(BaseException):
    """The worker vanished right after the effect (BaseException: nothing catches it)."""


@dataclass
class CompensationCase:
    """What happened when step ``seq`` failed (or crashed)."""

    seq: int
    tool: str
    crashed: bool
    result: SagaResult
    tools_run: list[str] = field(default_factory=list)
    undos_run: list[str] = field(default_factory=list)


@dataclass
class _Plan:
    fail_at: int | None = None
    crash: bool = False
    calls: list[str] = field(default_factory=list)
    undos: list[str] = field(default_factory=list)
    #: what the replays after each step of a flow found wrong (see ``replay_problem``)
    divergences: list[str] = field(default_factory=list)


class _InProcessBus:
    """Runs every message in this process, at once: the harness's broker and workers."""

    def __init__(self, sw: Sagaworker, plan: _Plan, engine: Any) -> None:
        self.sw, self.plan, self.engine = sw, plan, engine

    def publish_step(self, saga_id: str, seq: int, tool: str, args: list[Any],
                     kwargs: dict[str, Any], task_id: str, queue: str | None, *,
                     retries: int = 0, countdown: float | None = None) -> bool:
        spec = self.sw.registry.tool(tool)
        assert spec is not None
        message = {**kwargs, ENVELOPE: {"saga_id": saga_id, "seq": seq}}
        try:
            spec.task.apply(args=list(args), kwargs=message, task_id=task_id)
        except _Crash:
            # the worker is gone: its lease lapses, and the message comes back
            with self.engine.begin() as conn:
                conn.execute(update(entries).where(entries.c.saga_id == saga_id,
                                                   entries.c.seq == seq)
                             .values(lease_until=db_later(-1)))
            self.plan.crash = False
            spec.task.apply(args=list(args), kwargs=message, task_id=task_id)
        return True

    def send_failure(self, saga_id: str, reason: str) -> None:
        self.sw.compensator.handle_failure(saga_id, reason)

    def send_compensate(self, saga_id: str, *, countdown: float | None = None) -> None:
        self.sw.compensator.run_chain(saga_id)

    def send_advance(self, saga_id: str, *, countdown: float | None = None) -> None:
        if countdown:  # (a model request's backoff: this toolkit runs in one process)
            time.sleep(countdown)
        self.sw.executor.eager.carry(saga_id)

    def queue_of(self, tool: str, queue: str | None) -> str | None:
        return None  # messages run at once here: no queue to wait in

    def ready(self, queues: set[str]) -> dict[str, int]:
        return {}


@contextlib.contextmanager
def harness(sw: Sagaworker) -> Iterator[_Plan]:
    """Run ``sw``'s sagas in-process on a throwaway journal for the duration of the block."""
    plan = _Plan()
    rt = sw.rt
    folder = Path(tempfile.mkdtemp(prefix="sagaworker-harness-"))
    saved_fns = {n: s.fn for n, s in sw.registry.tools.items()}
    saved_undos = {k: u.fn for k, u in sw.registry.undos.items()}
    real_enqueue = sw.producer.enqueue
    url = f"sqlite:///{folder / 'journal.db'}"
    engine = make_engine(url)
    journal = Journal(engine)
    journal.create_all()
    for hook in sw.upgrade_hooks:  # the app's own tables (sw.on_upgrade)
        hook(url)
    stack = contextlib.ExitStack()  # the runtime's journal, settings and bus, given back
    stack.enter_context(rt.borrowed(journal, sw.settings.model_copy(update={
        "compensation_backoff": 0.0, "database_url": url,
        "approval_secret": sw.settings.approval_secret
        or SecretStr(secrets.token_urlsafe(32))}), _InProcessBus(sw, plan, engine)))
    sw.ensure_valid()
    for name, spec in sw.registry.tools.items():
        spec.fn = _spy_tool(plan, name, spec.fn)
    for key, undo in sw.registry.undos.items():
        undo.fn = _spy_undo(plan, f"{key[0]}.{key[1]}", undo.fn, undo.takes_context)

    def enqueue(saga_id: str, calls: Any, **options: Any) -> Any:
        steps = real_enqueue(saga_id, calls, **options)
        for req in sw.pending_approvals():
            if req.saga_id == saga_id:
                sw.approve(req.token, approver="sagaworker.testing")
        return steps

    sw.producer.enqueue = enqueue  # type: ignore[method-assign]
    real_advance = sw.executor.advance

    def advance(saga_id: str, **options: Any) -> Any:
        """After every step of a flow: replay it (dry) and note any divergence first."""
        problem = replay_problem(sw, saga_id)
        if problem is not None:
            plan.divergences.append(problem)
        return (real_advance or sw.flows.advance)(saga_id, **options)

    sw.executor.advance = advance
    stack.enter_context(_divergence_fails(sw))
    try:
        yield plan
    finally:
        sw.executor.advance = real_advance
        for name, fn in saved_fns.items():
            sw.registry.tools[name].fn = fn
        for key, fn in saved_undos.items():
            sw.registry.undos[key].fn = fn
        del sw.producer.enqueue
        stack.close()
        engine.dispose()
        shutil.rmtree(folder, ignore_errors=True)  # one throwaway journal per call, not kept


@contextlib.contextmanager
def _divergence_fails(sw: Sagaworker) -> Iterator[None]:
    """A divergence in the harness is the flow's own fault (its replays found it): the
    saga fails, and the check says why, instead of waiting, held, for a deploy."""
    saved = dict(sw.flows.specs)
    sw.flows.specs.update({n: dataclasses.replace(f, on_divergence="compensate")
                           for n, f in saved.items()})
    try:
        yield
    finally:
        sw.flows.specs.update(saved)  # (a flow registered meanwhile stays)


def _spy_tool(plan: _Plan, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    def spy(*args: Any, **kwargs: Any) -> Any:
        plan.calls.append(name)
        if plan.fail_at == len(plan.calls):
            if not plan.crash:
                raise InjectedFailure(f"sagaworker.testing failed step {len(plan.calls)}")
            value = fn(*args, **kwargs)
            raise _Crash(value)
        return fn(*args, **kwargs)

    return spy


def _spy_undo(plan: _Plan, name: str, fn: Callable[..., Any],
              takes_ctx: bool) -> Callable[..., Any]:
    def spy(*args: Any) -> Any:
        ctx = current_compensation.get()
        if ctx is None or ctx.attempt == 1:  # retries of one undo count once
            plan.undos.append(name)
        return fn(*args)

    return spy


def replay(sw: Sagaworker, saga_id: str) -> None:
    """Replay one flow saga of ``sw``'s journal with the flows ``sw`` registered (the code
    under test), writing nothing, as a worker on that code would: returns if the code
    carries the saga on; raises ``sagaworker.FlowDiverged`` (``.seq``, ``.journaled``,
    ``.asked``) if it diverges from the journal, the flow's own exception if it raises,
    ``SagaNotFound``/``ConfigurationError`` for a saga that is missing or not a flow of
    this code. ``sagaworker flows check`` does this for every saga in flight."""
    from ._base.errors import ConfigurationError, SagaNotFound

    saga, rows = sw.journal.saga_and_entries(saga_id)
    if saga is None:
        raise SagaNotFound(f"no saga {saga_id!r} in the journal")
    spec = sw.flows.specs.get(saga.flow) if saga.flow is not None else None
    if spec is None:
        raise ConfigurationError(
            f"saga {saga_id!r} is not a flow of this code (its flow: {saga.flow!r}); import "
            "the module that declares it before replaying")
    from ._worker.check import check_one

    found = check_one(sw, saga, rows)
    if found is not None and found.kind == "diverged":
        raise diverged_error(found)
    run = _replay(sw.rt, sw.producer, spec, saga, rows)
    if run.kind == "raised" and run.error is not None and not run.ctx.from_journal(run.error):
        raise run.error


def replay_problem(sw: Sagaworker, saga_id: str) -> str | None:
    """Replay a flow saga against its journal, twice, writing nothing; what is wrong, or
    None. Wrong: a replay diverges (another tool or other arguments than the journal holds
    at a position), returns before asking for every journaled step, or asks for another
    next step or returns another value than the replay before it."""
    saga = sw.journal.saga_row(saga_id)
    if saga is None or saga.flow is None:
        return None
    spec = sw.flows.specs.get(saga.flow)
    if spec is None:
        return f"flow {saga.flow!r} is not registered on this Sagaworker"
    rows = sw.journal.saga_and_entries(saga_id)[1]
    seen: list[Any] = []
    for _ in range(2):
        run = _replay(sw.rt, sw.producer, spec, saga, rows)
        if run.kind == "diverged":
            return run.detail
        got: Any = ((run.kind, run.value) if run.kind == "returned" else
                    ("raised", type(run.error).__name__) if run.kind == "raised" else
                    ("waits",))
        asked = ", ".join(f"{new_names(sw, [(t, a, k)])}{_call(a, k)}"
                          for t, a, k in run.ctx.new)
        seen.append((asked or "no new step", got))
    if seen[0] != seen[1]:
        (asked1, got1), (asked2, got2) = seen
        what = (f"asked for {asked1}, then for {asked2}" if asked1 != asked2
                else f"came to {got1!r}, then to {got2!r}")
        return (f"flow {saga.flow} is not deterministic: replayed twice on the same journal "
                f"(through step {len(rows)}), it {what}; a flow may branch on results only, "
                "never on the clock, a random number or a read outside the journal")
    return None


def _call(args: Any, kwargs: Any) -> str:
    parts = [repr(a) for a in args] + [f"{k}={v!r}" for k, v in kwargs.items()]
    return f"({', '.join(parts)})"


def check_compensation(sw: Sagaworker, work: Callable[..., Any] | str, /, *args: Any,
                       crash: bool = False, allow_dirty: bool = False,
                       timeout: float = 30, **kwargs: Any) -> list[CompensationCase]:
    """Fail each step of ``work`` in turn and assert the undo ran in strict reverse order.

    ``work`` is a work function for ``sw.saga`` (``lambda s: ...``), or a registered flow
    followed by its arguments, as ``sw.start`` takes them (``args=(...)``, ``kwargs={...}``
    also do, for a flow with no parameters of those names): it then runs through
    ``sw.start`` and is replayed after every step, and a replay that diverges fails the
    check. Unless ``allow_dirty``, an undo that throws on every try (COMPENSATION_FAILED)
    fails the check too.
    """
    spec = next((f for f in sw.flows.specs.values() if f.fn is work or f.name == work), None)
    if spec is None:
        if isinstance(work, str):
            raise TypeError(f"{work!r} is not a flow registered on this Sagaworker")
        if args or kwargs:
            raise TypeError("arguments after the work are a flow's; this is no registered "
                            "flow (decorate it with @sw.flow()), and a work function for "
                            "sw.saga takes only the SyncSaga")
    elif kwargs and set(kwargs) <= {"args", "kwargs"} and not args and not (
            set(kwargs) & set(inspect.signature(spec.fn).parameters)):
        args, kwargs = tuple(kwargs.get("args", ())), dict(kwargs.get("kwargs", {}))

    def run(saga_id: str) -> SagaResult:
        if spec is None:
            assert not isinstance(work, str)
            return sw.saga(saga_id, work, timeout=timeout)
        return sw.start(saga_id, spec.fn, *args, **kwargs).wait(timeout=timeout)

    cases: list[CompensationCase] = []
    with harness(sw) as plan:
        dry = run(f"harness-dry-{uuid.uuid4().hex[:8]}")
        _assert_replays(sw, plan, dry.saga_id, "the run with no failure")
        assert dry.status is SagaStatus.COMPLETED, f"the work did not complete: {dry.error}"
        # the tool steps (a flow's patch markers and durable units, such as an agent's model
        # requests, are no tool: never failed here, never undone)
        steps = [e for e in sw.inspect(dry.saga_id).entries if _is_tool(e.tool_name)]
        for mode in ([False, True] if crash else [False]):
            for k, entry in enumerate(steps, start=1):
                plan.calls.clear()
                plan.undos.clear()
                plan.fail_at, plan.crash = k, mode
                res = run(f"harness-{k}-{uuid.uuid4().hex[:8]}")
                case = CompensationCase(seq=k, tool=entry.tool_name, crashed=mode, result=res,
                                        tools_run=list(plan.calls), undos_run=list(plan.undos))
                _assert_replays(sw, plan, res.saga_id, f"step {k} ({entry.tool_name})"
                                f"{' crashed' if mode else ' failed'}")
                _assert_case(sw, case, steps, allow_dirty)
                cases.append(case)
        plan.fail_at = None
    return cases


def _is_tool(name: str) -> bool:
    return patch_id(name) is None and not is_unit(name)


def _assert_replays(sw: Sagaworker, plan: _Plan, saga_id: str, where: str) -> None:
    """No replay after a step diverged, nor one of the finished journal."""
    final = replay_problem(sw, saga_id)
    found = [*plan.divergences, *([final] if final else [])]
    plan.divergences.clear()
    assert not found, f"{where}: {found[0]}"


def _assert_case(sw: Sagaworker, case: CompensationCase, steps: list[Any],
                 allow_dirty: bool) -> None:
    where = f"step {case.seq} ({case.tool}){' crashed' if case.crashed else ' failed'}"
    spec = sw.registry.tool(case.tool)
    rerun = case.crashed and spec is not None and spec.idempotent
    expected_tools = [e.tool_name for e in steps[: case.seq]]
    if rerun:
        expected_tools.append(case.tool)
        assert case.tools_run[: len(expected_tools)] == expected_tools, (
            f"{where}: tools ran {case.tools_run}, expected {expected_tools} first")
        return
    assert case.tools_run == expected_tools, (
        f"{where}: tools ran {case.tools_run}, expected only {expected_tools}")
    allowed = {SagaStatus.COMPENSATED, SagaStatus.COMPENSATION_FAILED} if allow_dirty else {
        SagaStatus.COMPENSATED}
    assert case.result.status in allowed, (
        f"{where}: saga ended {case.result.status.value}: "
        f"{[(o.tool_name, o.detail) for o in case.result.report.dirty]}")
    expected_undos = []
    for e in reversed(steps[: case.seq - 1]):
        s = sw.registry.tool(e.tool_name)
        undo = sw.registry.undo_for(s) if s is not None and not s.gated else None
        if undo is not None:
            expected_undos.append(f"{undo.module}.{undo.name}")
    assert case.undos_run == expected_undos, (
        f"{where}: undos ran {case.undos_run}, expected {expected_undos} (strict reverse)")
    outcome_seqs = [o.seq for o in case.result.report.outcomes if _is_tool(o.tool_name)]
    assert outcome_seqs == [e.seq for e in reversed(steps[: case.seq - 1])], (
        f"{where}: outcomes for steps {outcome_seqs}")
    if case.crashed:
        doubted = [e.seq for e in case.result.report.in_doubt]
        lost = steps[case.seq - 1].seq
        assert doubted == [lost], f"{where}: in doubt {doubted}, expected [{lost}]"
