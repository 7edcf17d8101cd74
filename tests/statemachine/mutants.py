"""Guard mutations the model checker must catch (``make mutants``).

Each mutant breaks one guard of the journal's moves: an exact snippet of the current source
and its replacement. It is applied to a COPY of the tree (a temporary directory; the real
files are never touched) and the model checker is run against that copy (``PYTHONPATH``
pointing at it) with a small budget: it must FAIL on an invariant. A mutant the model lets
through, or a snippet no longer found in the source (the code moved on: update the
mutant), fails the run.

    python -m tests.statemachine.mutants [NAME ...] [--examples N] [--steps N] [--jobs N]
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
#: what a copy holds: the library, the model checker and what pytest needs to run it
COPIED = ("sagaworker", "tests/__init__.py", "tests/conftest.py", "tests/statemachine",
          "pyproject.toml")
STEP, UNDO, SAGA = ("sagaworker/_machine/step_moves.py", "sagaworker/_machine/undo_moves.py",
                    "sagaworker/_machine/saga_moves.py")
PGFAST, REPO = "sagaworker/_machine/pgfast.py", "sagaworker/_machine/intent_moves.py"
GATE = "sagaworker/_producer/approvals.py"
GATE_MOVES, MOVES_BASE = "sagaworker/_machine/gate_moves.py", "sagaworker/_machine/moves_base.py"
REPLAY, UNITS = "sagaworker/_worker/replay.py", "sagaworker/_worker/units.py"
SWEEPER = "sagaworker/_recovery/sweeper.py"
UNDO_NEXT = "sagaworker/_journal/migrations/versions/0009_undo_next.py"
DIVERGENCE = "sagaworker/_machine/divergence.py"


@dataclass(frozen=True)
class Edit:
    path: str   # relative to the repository
    old: str    # exactly once in the current source
    new: str


@dataclass(frozen=True)
class Mutant:
    name: str
    what: str                  # the guard it breaks, in one line
    edits: tuple[Edit, ...]
    database: str = "sqlite"   # "postgresql" for the PostgreSQL fast path's own SQL


def _m(name: str, what: str, path: str, old: str, new: str, *,
       database: str = "sqlite") -> Mutant:
    return Mutant(name, what, (Edit(path, old, new),), database)


MUTANTS: tuple[Mutant, ...] = (
    _m("executed-token", "EXECUTED accepted without the attempt-token check (SQLAlchemy path)",
       STEP, "entries.c.attempt_token == token,\n" + " " * 37 + "phase=_EXECUTE",
       "phase=_EXECUTE"),
    _m("executed-token-pg", "EXECUTED accepted without the attempt-token check (PostgreSQL)",
       PGFAST, "  AND attempt_token = %(token)s\nRETURNING (SELECT status",
       "RETURNING (SELECT status", database="postgresql"),
    _m("heartbeat-token", "a forward heartbeat ignores the attempt token (a dead lease revives)",
       STEP, "entries.c.phase == _INTENT, entries.c.attempt_token == token,",
       "entries.c.phase == _INTENT,"),
    _m("heartbeat-undo-token", "an undo's heartbeat ignores the undo token",
       STEP, "entries.c.compensation.is_(None), entries.c.undo_token == token,",
       "entries.c.compensation.is_(None),"),
    _m("awaiting-after-approval", "the saga stays AWAITING_APPROVAL after its last approval",
       GATE_MOVES, "if others is None and saga.status == SagaStatus.AWAITING_APPROVAL.value:",
       "if others is None and saga.status == 'never':"),
    _m("claim-failing-fast", "the one-statement claim runs a step of a saga asked to fail",
       STEP, "sagas.c.status.in_(_OPEN_VALUES), sagas.c.fail_requested_at.is_(None),",
       "sagas.c.status.in_(_OPEN_VALUES),"),
    _m("claim-failing-locked", "the locked claim runs a step of a saga asked to fail",
       STEP, "failing = status not in OPEN or saga.fail_requested_at is not None",
       "failing = status not in OPEN"),
    _m("claim-failing-pg", "the PostgreSQL claim runs a step of a saga asked to fail",
       PGFAST, "AND s.status IN ({_OPEN}) AND s.fail_requested_at IS NULL",
       "AND s.status IN ({_OPEN})", database="postgresql"),
    Mutant("lease-takeover", "a claim takes over an attempt whose lease is still live", (
        Edit(STEP, "    if row.alive:\n        return Claim(Start.BUSY",
             "    if False:\n        return Claim(Start.BUSY"),
        Edit(STEP, "return [same, entries.c.lease_until < db_now()]", "return [same]"))),
    _m("lease-takeover-fast", "the one-statement claim ignores a held lease",
       STEP, "entries.c.phase == _INTENT, entries.c.lease_until.is_(None),\n",
       "entries.c.phase == _INTENT,\n"),
    _m("lease-takeover-pg", "the PostgreSQL claim ignores a held lease",
       PGFAST, "AND e.lease_until IS NULL AND e.tool_name", "AND e.tool_name",
       database="postgresql"),
    _m("approved-gate-failing", "an approved gated step of a saga asked to fail is run "
       "instead of CANCELLED", STEP, "        if failing:\n            why = (",
       "        if failing and row.approved_by is None:\n            why = ("),
    _m("rerun-not-idempotent", "a non-idempotent step is re-run after its worker was lost",
       STEP, "if died and (failing or not idempotent or row.reruns",
       "if died and (failing or row.reruns"),
    _m("rerun-cap", "an idempotent step is re-run with no cap",
       STEP, "or row.reruns >= self.settings.max_reruns):", "):"),
    _m("release-token", "a release (the tool raised) ignores the attempt token",
       STEP, "entries.c.attempt_token == token,\n                             lease_until=None,",
       "lease_until=None,"),
    _m("failed-token", "FAILED accepted without the attempt-token check",
       STEP, "entries.c.attempt_token == token,\n                                 phase=move(",
       "phase=move("),
    _m("undo-order", "undos claimed earliest first instead of latest first",
       UNDO, ".order_by(entries.c.exec_order.desc()).limit(1).scalar_subquery())",
       ".order_by(entries.c.exec_order.asc()).limit(1).scalar_subquery())"),
    Mutant("undo-while-running", "an undo is claimed while a forward step of the saga runs", (
        Edit(UNDO, "if p.alive or not self._doubt(", "if not self._doubt("),
        Edit(MOVES_BASE, "entries.c.lease_until.is_(None) | (entries.c.lease_until < db_now()),\n",
             "\n"))),
    _m("two-undos", "a second undo of a saga is claimed beside a live one",
       UNDO, "if any(r.comp_alive for r in live):", "if False:"),
    _m("outcome-token", "an undo's outcome is journaled without the undo token (twice)",
       UNDO, "entries.c.undo_token == token,\n                             compensation=",
       "compensation="),
    _m("gate-failing", "approve and reject accepted for a saga asked to fail",
       GATE, "if saga.fail_requested_at is not None or SagaStatus(saga.status) not in OPEN:",
       "if SagaStatus(saga.status) not in OPEN:"),
    _m("enqueue-failing", "a step is journaled for a saga asked to fail",
       REPO, "sagas.c.fail_requested_at.is_(None), *guard)", "*guard)"),
    _m("compensation-cancels-running", "the failure handler cancels a step that is running",
       SAGA, "((entries.c.phase == _INTENT) & entries.c.lease_until.is_(None))",
       "(entries.c.phase == _INTENT)"),
    _m("complete-unexecuted", "complete() accepted with steps not EXECUTED",
       SAGA, "(entries.c.phase != _EXECUTED)\n                                      | ", ""),
    _m("complete-failing", "complete() accepted for a saga asked to fail",
       SAGA, "if saga.status != SagaStatus.RUNNING.value or saga.fail_requested_at is not None:",
       "if saga.status != SagaStatus.RUNNING.value:"),
    _m("abort-terminal", "abort accepted for a saga that is no longer open",
       SAGA, "            if status not in OPEN:\n                raise SagaworkerError(\n"
       "                    f\"saga {saga_id!r} is {status.value}; only a RUNNING",
       "            if False:\n                raise SagaworkerError(\n"
       "                    f\"saga {saga_id!r} is {status.value}; only a RUNNING"),
    _m("redrive-any", "a re-drive reopens a saga that is not COMPENSATION_FAILED",
       UNDO, "if saga is None or saga.status != SagaStatus.COMPENSATION_FAILED.value:\n"
       "                return []", "if saga is None:\n                return []"),
    _m("flow-stale-replay", "a flow's replay journals its steps though another replay did",
       REPO, "guard = [] if expect_seq is None else [sagas.c.last_seq == expect_seq]",
       "guard = []"),
    _m("doubt-unreported", "the chain finds a dead step in doubt and logs no step_in_doubt",
       UNDO, "            doubted.append(p)\n", "\n"),
    _m("retry-count", "a tool's own retry journals its due time without its count (the "
       "sweeper's resend lets it run past max_retries)", STEP,
       "retry_due_at=db_later(max(delay, 0.0)), celery_retries=retries)\n"
       "            return SagaStatus(saga.status)",
       "retry_due_at=db_later(max(delay, 0.0)))\n            return SagaStatus(saga.status)"),
    _m("retry-lease-kept", "a tool's own retry leaves its lease held (its retry is found "
       "busy, then in doubt)", STEP, "                             lease_until=None, error=error,\n"
       "                             retry_due_at=db_later(max(delay, 0.0)), celery_retries",
       "                             error=error,\n"
       "                             retry_due_at=db_later(max(delay, 0.0)), celery_retries"),
    _m("unit-asked-again", "a replay sends a model request whose response is journaled",
       REPLAY, "                return row.result\n", "                return await body()\n"),
    _m("unit-claim-ignored", "a replay sends a model request another worker's claim holds",
       UNITS, "                if not not_run(rt, got, self.saga_id, row.seq, op.tool_name):\n",
       "                if not not_run(rt, got, self.saga_id, row.seq, op.tool_name) "
       "and False:\n"),
    _m("unit-busy-goes-on", "a replay goes on past a model request in flight elsewhere",
       UNITS, "raise _Suspend()  # run by another replay, or decided (said and sent)",
       "return None"),
    _m("died-unreported", "an undo whose worker died on every try is given up unreported",
       UNDO, "died.append((row, self._died_every_try(conn, saga_id, row, token, tries)))",
       "self._died_every_try(conn, saga_id, row, token, tries)"),
    _m("claim-stale-retry", "the one-statement claim runs a copy of an earlier Celery retry "
       "(its count below the journal's)", STEP,
       "return [entries.c.celery_retries <= retries,\n            or_(", "return [or_("),
    _m("claim-stale-retry-locked", "the locked claim runs a copy of an earlier Celery retry",
       STEP, "    if retries < row.celery_retries:\n        return Claim(Start.SUPERSEDED",
       "    if False:\n        return Claim(Start.SUPERSEDED"),
    _m("claim-stale-retry-pg", "the PostgreSQL claim runs a copy of an earlier Celery retry",
       PGFAST, "  AND (%(retries)s::integer IS NULL OR e.celery_retries <= %(retries)s::integer)"
       "\n", "", database="postgresql"),
    _m("claim-early", "the one-statement claim runs a Celery retry before it is due", STEP,
       "            or_(entries.c.retry_due_at.is_(None), entries.c.retry_due_at <= db_now())]",
       "            ]"),
    _m("claim-early-locked", "the locked claim runs a Celery retry before it is due", STEP,
       "    if row.due_in is not None and row.due_in > 0:\n        return Claim(Start.NOT_DUE",
       "    if False:\n        return Claim(Start.NOT_DUE"),
    _m("claim-early-pg", "the PostgreSQL claim runs a Celery retry before it is due", PGFAST,
       "  AND (%(retries)s::integer IS NULL OR e.retry_due_at IS NULL\n"
       "       OR e.retry_due_at <= statement_timestamp())\n", "", database="postgresql"),
    _m("claim-past-deadline", "the one-statement claim runs a step delivered after its saga's "
       "deadline, before any sweep saw it pass", STEP,
       "                       or_(sagas.c.deadline_at.is_(None), sagas.c.deadline_at > "
       "db_now()),\n", ""),
    _m("retry-resent-queued", "the sweeper resends a lost Celery retry while its queue holds "
       "messages (a copy that runs the step once more)", SWEEPER,
       'found = self._unqueued(and_(waiting, self._open_saga()), since, "retry_deferred")',
       'found = self.resends.due(entries, ["saga_id", "seq"], and_(waiting, '
       'self._open_saga()))'),
    # (the migration is applied from the copy: each model-check session on PostgreSQL
    # makes a database of its own and migrates it with the copy's migrations)
    _m("undo-next-pg", "the PostgreSQL undo_next function journals a stale undo token's "
       "outcome (a late try fenced out by a retry's claim)", UNDO_NEXT,
       "compensation IS NULL\n       AND undo_token = p_token FOR UPDATE;",
       "compensation IS NULL FOR UPDATE;", database="postgresql"),
    _m("held-last-seq", "a replay that read an older journal position holds a saga another "
       "replay moved on", DIVERGENCE,
       "update(sagas).where(*_open(saga_id),\n" + " " * 53 + "sagas.c.last_seq == last_seq)",
       "update(sagas).where(*_open(saga_id))"),
    _m("undo-heartbeat-lease", "an undo's heartbeat takes back the lease its try released "
       "(its retry is found busy)", STEP,
       "entries.c.undo_token == token,\n            entries.c.comp_lease_until.is_not(None))",
       "entries.c.undo_token == token)"),
    _m("model-retry-uncounted", "a model request's passing failure is retried without its "
       "try counted on the request's step", UNITS,
       'retries=(getattr(row, "celery_retries", None) or 0) + 1)',
       'retries=getattr(row, "celery_retries", None) or 0)'),
    _m("unit-failover-live", "a failover takes over a model request whose stalled worker's "
       "heartbeat revived its claim after the takeover read it", STEP,
       "return [same, entries.c.lease_until < db_now()]", "return [same]",
       database="postgresql"),
    _m("unit-cancel-unshielded", "a unit whose call the framework cancels is cancelled with "
       "it (its claim held, no outcome journaled)", UNITS,
       "return await asyncio.shield(task)", "return await task"),
)


class Drift(Exception):
    """A mutant's snippet is not (exactly once) in the source any more."""


def drift(mutant: Mutant, root: Path = ROOT) -> list[str]:
    """What of the mutant no longer matches the source (empty when it applies)."""
    problems = []
    for e in mutant.edits:
        n = (root / e.path).read_text().count(e.old)
        if n != 1:
            problems.append(f"{mutant.name}: snippet found {n} times in {e.path}: {e.old!r}")
    return problems


def copy_tree(dest: Path, root: Path = ROOT) -> None:
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    for rel in COPIED:
        src, to = root / rel, dest / rel
        to.parent.mkdir(parents=True, exist_ok=True)
        if src.is_dir():
            shutil.copytree(src, to, ignore=ignore)
        else:
            shutil.copy2(src, to)


def apply(mutant: Mutant, dest: Path) -> None:
    """Apply the mutant's edits to the copy in ``dest``."""
    for e in mutant.edits:
        path = dest / e.path
        text = path.read_text()
        if text.count(e.old) != 1:
            raise Drift(f"{mutant.name}: snippet not found once in {e.path}: {e.old!r}")
        path.write_text(text.replace(e.old, e.new))


@dataclass(frozen=True)
class Outcome:
    mutant: Mutant
    verdict: str    # "killed", "SURVIVED", "DRIFT", "ERROR", "skipped"
    detail: str
    seconds: float

    @property
    def ok(self) -> bool:
        return self.verdict == "killed"  # (a skipped run caught nothing)


#: an invariant failed (also inside hypothesis's FlakyFailure: it failed once, and a
#: timing-dependent re-run passed)
_ASSERT = re.compile(r"AssertionError: (.*)$", re.MULTILINE)


def run(mutant: Mutant, *, examples: int, steps: int, timeout: float = 240.0) -> Outcome:
    """Run the model checker against a mutated copy; it must fail on an invariant."""
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix=f"mutant-{mutant.name}-") as tmp:
        dest = Path(tmp)
        copy_tree(dest)
        try:
            apply(mutant, dest)
        except Drift as exc:
            return Outcome(mutant, "DRIFT", str(exc), 0.0)
        env = {**os.environ, "PYTHONPATH": str(dest), "SAGAWORKER_FUZZ": "0",
               "SAGAWORKER_FUZZ_EXAMPLES": str(examples), "SAGAWORKER_FUZZ_STEPS": str(steps),
               "SAGAWORKER_FUZZ_SHRINK": "0", "PYTHONDONTWRITEBYTECODE": "1"}
        test = f"tests/statemachine/test_state_machine.py::test_state_machine_on_{mutant.database}"
        cmd = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider",
               "--timeout", str(int(timeout)), "-W", "ignore", test]
        try:
            proc = subprocess.run(cmd, cwd=dest, env=env, capture_output=True, text=True,
                                  timeout=timeout + 30, check=False)
        except subprocess.TimeoutExpired:
            return Outcome(mutant, "ERROR", "timed out", time.monotonic() - started)
        out = proc.stdout + proc.stderr
    seconds = time.monotonic() - started
    found = _ASSERT.search(out)
    if proc.returncode == 1 and found:
        return Outcome(mutant, "killed", found.group(1).strip()[:110], seconds)
    if proc.returncode == 0:
        verdict = "skipped" if " skipped" in out and " passed" not in out else "SURVIVED"
        return Outcome(mutant, verdict, "the model checker passed" if verdict == "SURVIVED"
                       else "database not reachable", seconds)
    log = Path(tempfile.gettempdir()) / f"mutant-{mutant.name}.log"
    log.write_text(out)
    errors = re.findall(r"^E\s+(\w+(?:Error|Exception)\b.*)$", out, re.MULTILINE)
    return Outcome(mutant, "ERROR", f"{(errors or ['no error line'])[0][:100]} (see {log})",
                   seconds)


def run_all(mutants: Iterable[Mutant], *, examples: int, steps: int,
            jobs: int = 2) -> list[Outcome]:
    with ThreadPoolExecutor(max_workers=jobs) as pool:
        return list(pool.map(lambda m: run(m, examples=examples, steps=steps), mutants))


def report(outcomes: list[Outcome]) -> str:
    lines = [f"{'mutant':30} {'db':10} {'verdict':9} {'s':>5}  caught by / detail"]
    for o in outcomes:
        lines.append(f"{o.mutant.name:30} {o.mutant.database:10} {o.verdict:9} "
                     f"{o.seconds:5.1f}  {o.detail}")
    bad = [o for o in outcomes if not o.ok]
    lines.append(f"{len(outcomes) - len(bad)} of {len(outcomes)} mutants caught"
                 + (f"; NOT caught: {', '.join(o.mutant.name for o in bad)}" if bad else ""))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("names", nargs="*", help="run only these mutants")
    parser.add_argument("--examples", type=int, default=400)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--jobs", type=int, default=2)
    args = parser.parse_args(argv)
    chosen = [m for m in MUTANTS if not args.names or m.name in args.names]
    unknown = set(args.names) - {m.name for m in MUTANTS}
    if unknown:
        parser.error(f"no mutant named {', '.join(sorted(unknown))}")
    problems = [p for m in chosen for p in drift(m)]
    for p in problems:
        print(f"DRIFT {p}")
    # the unmutated source first, at the same budget: it must pass (a model checker that
    # fails on the real code would "catch" every mutant)
    baselines = [Mutant(f"(none: the source as it is, {db})", "", (), db)
                 for db in sorted({m.database for m in chosen})]
    outcomes = run_all([*baselines, *chosen], examples=args.examples, steps=args.steps,
                       jobs=args.jobs)
    base, outcomes = outcomes[:len(baselines)], outcomes[len(baselines):]
    broken = [o for o in base if o.verdict != "SURVIVED"]  # (skipped: it never ran)
    for o in base:
        print(f"baseline {o.mutant.database}: "
              f"{'passed' if o not in broken else 'FAILED: ' + o.detail} ({o.seconds:.0f} s)")
    print(report(outcomes))
    return 0 if not problems and not broken and all(o.ok for o in outcomes) else 1


if __name__ == "__main__":
    sys.exit(main())
