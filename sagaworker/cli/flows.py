"""``sagaworker flows``: changing a flow's code.

``check`` replays every saga in flight against the app module's flows, read-only, before a
deploy; ``resume`` hands a held (diverged) flow back to the workers after one.
"""

from __future__ import annotations

import json
import sys

import click
from sqlalchemy.exc import SQLAlchemyError

from .._base.types import SagaStatus
from .._observe.visible import visible
from .context import Ctx, pass_ctx

__all__ = ["flows"]


@click.group()
def flows() -> None:
    """Changing a flow's code: check sagas in flight before a deploy, resume held ones."""


@flows.command()
@click.option("--flow", "flow", default=None, help="only the sagas of this flow (its name, "
              "as `sagaworker show` prints it)")
@click.option("--json", "as_json", is_flag=True, help="the findings as JSON")
@pass_ctx
def check(c: Ctx, flow: str | None, as_json: bool) -> None:
    """Replay every flow saga in flight (RUNNING, AWAITING_APPROVAL) against the flows of
    the app module (-A: the code about to ship), without running a tool, publishing or
    writing (a read replica works): one line per saga it would not carry on; exit 1 if
    any, 0 if none."""
    from .._worker.check import Finding, check_flows

    sw = c.sw
    found: list[Finding] = []
    checked = 0
    try:
        for got in check_flows(sw, flow):
            if isinstance(got, int):
                checked = got
            else:
                found.append(got)
                if not as_json:
                    click.echo(visible(got.line()))
    except SQLAlchemyError as exc:
        click.echo(f"error: cannot read the journal ({type(exc).__name__}: "
                   f"{visible(' '.join(str(exc).split())[:300])}); flows check only reads "
                   "(a read replica works): give --database-url a database it can read",
                   err=True)
        sys.exit(2)
    if as_json:
        click.echo(json.dumps({"checked": checked, "findings": [f.as_dict() for f in found]},
                              indent=2))
    else:
        click.echo(f"{checked} saga(s) in flight checked"
                   + (f", {len(found)} would not carry on under this code" if found
                      else ": this code carries every one on"), err=True)
    sys.exit(1 if found else 0)


@flows.command()
@click.argument("saga_id")
@pass_ctx
def resume(c: Ctx, saga_id: str) -> None:
    """Replay a held (diverged) flow again with the code the workers run now (after a
    fixed deploy or a rollback). If it still diverges it stays held, logged again only
    if the divergence changed."""
    from .._machine.divergence import resume_held

    sw = c.sw
    row = resume_held(sw.journal, saga_id)
    if row is None:
        click.echo(f"error: no saga {visible(saga_id)!r} in the journal", err=True)
        sys.exit(1)
    if row.flow is None:
        click.echo(f"error: saga {visible(saga_id)!r} is not a flow: nothing replays it",
                   err=True)
        sys.exit(1)
    if SagaStatus(row.status).terminal or row.status == SagaStatus.COMPENSATING.value \
            or row.fail_requested_at is not None:
        state = "finished" if SagaStatus(row.status).terminal else "failing"
        click.echo(f"error: saga {visible(saga_id)!r} is {row.status} ({state}): nothing "
                   "to resume", err=True)
        sys.exit(1)
    sw.rt.bus.send_advance(saga_id)
    if row.divergence is None:
        click.echo(f"saga {saga_id} was not held; sent it to the workers all the same "
                   f"(sagaworker show {saga_id})")
    else:
        click.echo(f"resumed {saga_id}: a worker replays it with the code it runs now; "
                   f"`sagaworker show {saga_id}` says whether it moved on or is still held")
