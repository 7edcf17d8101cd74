"""A pytest toolkit for sagaworker users: prove a saga's compensation without a broker.

    from sagaworker.testing import check_compensation

    def test_order_saga_compensates(tmp_path):
        cases = check_compensation(sw, order_work("o-1", "sku", 1, "card", 100),
                                   crash=True)

``check_compensation`` runs the work once to learn its steps, then once per step with
that step failing, and asserts that every earlier EXECUTED step was undone in strict
reverse order and that nothing after the failing step ran. With ``crash=True`` it also
simulates, for each step, a worker lost between the effect and its EXECUTED commit, and
asserts the step is reported in doubt (or, for ``idempotent=True`` tools, run again).

Steps run in the test process on a throwaway SQLite journal (the real journal code, the
real compensation runner); gated steps are approved automatically.
"""

from __future__ import annotations

import contextlib
import secrets
import tempfile
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import SecretStr
from sqlalchemy import update

from ._compensation import current_compensation
from ._dialect import make_engine
from ._execution import ENVELOPE
from ._journal import Journal, now
from ._schema import entries
from ._types import SagaResult, SagaStatus

if TYPE_CHECKING:
    from ._core import Sagaworker
    from ._saga import SyncSaga

__all__ = ["CompensationCase", "InjectedFailure", "check_compensation", "harness"]


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


class _InProcessBus:
    """Runs every message in this process, at once: the harness's broker and workers."""

    def __init__(self, sw: Sagaworker, plan: _Plan, engine: Any) -> None:
        self.sw, self.plan, self.engine = sw, plan, engine

    def publish_step(self, saga_id: str, seq: int, tool: str, args: list[Any],
                     kwargs: dict[str, Any], task_id: str, queue: str | None, *,
                     retries: int = 0) -> bool:
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
                             .values(lease_until=now() - timedelta(seconds=1)))
            self.plan.crash = False
            spec.task.apply(args=list(args), kwargs=message, task_id=task_id)
        return True

    def send_failure(self, saga_id: str, reason: str) -> None:
        self.sw.compensator.handle_failure(saga_id, reason)

    def send_compensate(self, saga_id: str, *, countdown: float | None = None) -> None:
        self.sw.compensator.run_chain(saga_id)

    def send_advance(self, saga_id: str) -> None:
        self.sw.flows.advance(saga_id)


@contextlib.contextmanager
def harness(sw: Sagaworker) -> Iterator[_Plan]:
    """Run ``sw``'s sagas in-process on a throwaway journal for the duration of the block."""
    plan = _Plan()
    rt = sw.rt
    folder = Path(tempfile.mkdtemp(prefix="sagaworker-harness-"))
    saved = (rt._engine, rt._journal, rt._machine, rt.settings, rt.bus)
    saved_fns = {n: s.fn for n, s in sw.registry.tools.items()}
    saved_undos = {k: u.fn for k, u in sw.registry.undos.items()}
    real_enqueue = sw.producer.enqueue
    url = f"sqlite:///{folder / 'journal.db'}"
    engine = make_engine(url)
    journal = Journal(engine)
    journal.create_all()
    for hook in sw.upgrade_hooks:  # the app's own tables (sw.on_upgrade)
        hook(url)
    rt.use(journal, sw.settings.model_copy(update={
        "compensation_backoff": 0.0, "database_url": url,
        "approval_secret": sw.settings.approval_secret
        or SecretStr(secrets.token_urlsafe(32))}))
    rt.bus = _InProcessBus(sw, plan, engine)
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
    try:
        yield plan
    finally:
        for name, fn in saved_fns.items():
            sw.registry.tools[name].fn = fn
        for key, fn in saved_undos.items():
            sw.registry.undos[key].fn = fn
        del sw.producer.enqueue
        rt._engine, rt._journal, rt._machine, rt.settings, rt.bus = saved
        engine.dispose()


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


def check_compensation(sw: Sagaworker, work: Callable[[SyncSaga], Any], *,
                       crash: bool = False, allow_dirty: bool = False,
                       timeout: float = 30) -> list[CompensationCase]:
    """Fail each step of ``work`` in turn and assert the undo ran in strict reverse order.

    Unless ``allow_dirty``, an undo that throws on every try (COMPENSATION_FAILED) fails
    the check too.
    """
    cases: list[CompensationCase] = []
    with harness(sw) as plan:
        dry = sw.saga(f"harness-dry-{uuid.uuid4().hex[:8]}", work, timeout=timeout)
        assert dry.status is SagaStatus.COMPLETED, f"the work did not complete: {dry.error}"
        steps = sw.inspect(dry.saga_id).entries
        for mode in ([False, True] if crash else [False]):
            for k, entry in enumerate(steps, start=1):
                plan.calls.clear()
                plan.undos.clear()
                plan.fail_at, plan.crash = k, mode
                res = sw.saga(f"harness-{k}-{uuid.uuid4().hex[:8]}", work, timeout=timeout)
                case = CompensationCase(seq=k, tool=entry.tool_name, crashed=mode, result=res,
                                        tools_run=list(plan.calls), undos_run=list(plan.undos))
                _assert_case(sw, case, steps, allow_dirty)
                cases.append(case)
        plan.fail_at = None
    return cases


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
    outcome_seqs = [o.seq for o in case.result.report.outcomes]
    assert outcome_seqs == list(range(case.seq - 1, 0, -1)), (
        f"{where}: outcomes for steps {outcome_seqs}")
    if case.crashed:
        doubted = [e.seq for e in case.result.report.in_doubt]
        assert doubted == [case.seq], f"{where}: in doubt {doubted}, expected [{case.seq}]"
