"""The ``sagaworker`` command line (click). Exit codes: 0 done, 1 not found/refused, 2 usage."""

from __future__ import annotations

import getpass
import json
import os
import sys

import click

from .._base.errors import SagaworkerError
from .._base.types import SagaStatus
from .._observe.records import Redaction
from .._observe.visible import visible
from .context import OWN_LOGGING, Ctx, Group, app_name, log_lines, pass_ctx, use_database
from .flows import flows
from .mcp_command import mcp
from .render import approval_line, console, redacted, render_saga, render_sagas, saga_json, to_json

__all__ = ["main"]


@click.group(cls=Group, context_settings={"help_option_names": ["-h", "--help"]})
@click.option("-A", "--app", "app", default=None, help="module holding the Celery app and "
              "the Sagaworker (default: $SAGAWORKER_APP; required)")
@click.option("--database-url", default=None, help="journal database to use instead of the "
              "one the app's Sagaworker was given")
@click.option("-v", "--verbose", is_flag=True, help="print sagaworker's log lines (JSON) on "
              "stderr")
@click.pass_context
def main(ctx: click.Context, app: str | None, database_url: str | None,
         verbose: bool) -> None:
    """sagaworker: journaled, compensable tool tasks on Celery.

    Every command uses the database of the app's Sagaworker (-A MODULE or SAGAWORKER_APP),
    unless --database-url names another.
    """
    ctx.obj = Ctx(app, database_url)
    if ctx.invoked_subcommand not in OWN_LOGGING:
        log_lines(verbose)


def refuse(msg: str) -> None:
    click.echo(f"error: {visible(msg)}", err=True)  # it may quote a journal value
    sys.exit(1)


@main.command(context_settings={"ignore_unknown_options": True, "allow_extra_args": True})
@click.argument("celery_args", nargs=-1, type=click.UNPROCESSED)
@pass_ctx
def worker(c: Ctx, celery_args: tuple[str, ...]) -> None:
    """A Celery worker for the configured app (extra arguments go to `celery worker`)."""
    if c.database_url:
        # the app's Sagaworker names its own database: run the worker in this process,
        # on the loaded app, so that --database-url replaces it
        c.sw.app.worker_main(["worker", *celery_args])
        return
    app = app_name(c.app)
    os.execvp(sys.executable, [sys.executable, "-m", "celery", "-A", app, "worker",
                               *celery_args])


@main.command()
@click.argument("saga_id")
@click.option("--json", "as_json", is_flag=True, help="machine-readable output")
@pass_ctx
def show(c: Ctx, saga_id: str, as_json: bool) -> None:
    """The journal and the compensation report of one saga."""
    try:
        rec = c.sw.inspect(saga_id)
    except SagaworkerError as exc:  # not found; a value no key opens, or copied in with SQL
        refuse(str(exc))
    red = Redaction.of(c.sw)  # the app's tools and flows: their arguments redacted by name
    if as_json:
        click.echo(json.dumps(saga_json(rec, red), indent=2, default=str))
    else:
        render_saga(rec, red)


@main.command("list")
@click.option("--status", type=click.Choice([s.value for s in SagaStatus]), default=None)
@click.option("--limit", type=int, default=50, show_default=True)
@click.option("--json", "as_json", is_flag=True, help="machine-readable output")
@pass_ctx
def list_(c: Ctx, status: str | None, limit: int, as_json: bool) -> None:
    """Sagas, newest first."""
    recs, unreadable = c.sw.journal.scan_sagas(status, limit)
    red = Redaction.of(c.sw)
    if not as_json:
        render_sagas(recs, red, unreadable)
        return
    click.echo(to_json(recs, red))
    for u in unreadable:  # the JSON stays a list of sagas; the skipped ones are named here
        click.echo(f"saga {visible(u.saga_id)!r} ({u.status}) is unreadable and was left "
                   f"out: {u.error}", err=True)


@main.command()
@click.option("--older-than", type=float, default=None, help="seconds (default: "
              "SAGAWORKER_ORPHAN_AFTER)")
@click.option("--json", "as_json", is_flag=True)
@pass_ctx
def orphans(c: Ctx, older_than: float | None, as_json: bool) -> None:
    """INTENT entries with no outcome, older than a threshold."""
    found = c.sw.orphans(older_than=older_than)
    if as_json:
        click.echo(to_json(found))
        return
    for e in found:
        click.echo(f"{e.seq}\t{e.tool_name}\t{e.task_id}")
    if not found:
        click.echo("no orphans")


@main.command()
@click.option("--json", "as_json", is_flag=True)
@pass_ctx
def approvals(c: Ctx, as_json: bool) -> None:
    """Steps waiting behind the approval gate, with their tokens."""
    try:
        pending = c.sw.pending_approvals()
    except SagaworkerError as exc:
        refuse(str(exc))
    if as_json:
        click.echo(to_json(pending))
        return
    for p in redacted(pending, Redaction.of(c.sw)):
        console.print(approval_line(p), markup=False, soft_wrap=True)
        # the token whole on one line, never wrapped or styled: it is copied and pasted
        click.echo(f"  token: {p.token}")
    if not pending:
        click.echo("nothing awaits approval")


def _token(raw: str) -> str:
    """A token as pasted: ``-`` reads it on stdin (kept out of the process list); spaces
    and line breaks a terminal or a mail put into it are removed."""
    text = sys.stdin.read() if raw == "-" else raw
    return "".join(text.split())


@main.command()
@click.argument("token")
@click.option("--approver", default=None, help="who decides (default: your login name)")
@pass_ctx
def approve(c: Ctx, token: str, approver: str | None) -> None:
    """Approve a gated step: it is published to the workers (TOKEN - reads it on stdin)."""
    try:
        c.sw.approve(_token(token), approver=approver or getpass.getuser())
    except SagaworkerError as exc:
        refuse(str(exc))
    click.echo("approved")


@main.command()
@click.argument("token")
@click.option("--reason", required=True)
@click.option("--approver", default=None, help="who decides (default: your login name)")
@pass_ctx
def reject(c: Ctx, token: str, reason: str, approver: str | None) -> None:
    """Reject a gated step: the saga fails and compensates (TOKEN - reads it on stdin)."""
    try:
        c.sw.reject(_token(token), approver=approver or getpass.getuser(), reason=reason)
    except SagaworkerError as exc:
        refuse(str(exc))
    click.echo("rejected")


@main.command("retry-compensation")
@click.argument("saga_id")
@click.option("--wait", "wait", is_flag=True, help="wait for the new status")
@click.option("--timeout", type=float, default=300)
@pass_ctx
def retry_compensation(c: Ctx, saga_id: str, wait: bool, timeout: float) -> None:
    """Operator re-drive: re-run only the COMPENSATION_FAILED undos."""
    try:
        seqs = c.sw.retry_compensation(saga_id, actor=getpass.getuser())
    except SagaworkerError as exc:
        refuse(str(exc))
    if not seqs:
        refuse(f"saga {saga_id!r} has no COMPENSATION_FAILED undo to re-run")
    click.echo(f"re-running undos of steps {seqs}")
    if wait:
        res = c.sw.get(saga_id).wait(timeout)
        click.echo(res.status.value)
        sys.exit(0 if res.status is SagaStatus.COMPENSATED else 1)


@main.command()
@click.argument("saga_id")
@click.option("--reason", required=True, help="why the saga is failed (journaled, logged)")
@click.option("--actor", default=None, help="who decides (default: your login name)")
@pass_ctx
def abort(c: Ctx, saga_id: str, reason: str, actor: str | None) -> None:
    """An operator fails a running saga: its gates close and it compensates."""
    if not reason.strip():
        raise click.BadParameter("give a non-empty reason", param_hint="--reason")
    who = actor if actor is not None else getpass.getuser()
    if not who.strip():
        raise click.BadParameter("give a non-empty actor", param_hint="--actor")
    try:
        c.sw.abort(saga_id, reason=reason.strip(), actor=who.strip())
    except SagaworkerError as exc:
        refuse(str(exc))
    click.echo(f"aborted {saga_id}: it compensates (sagaworker show {saga_id})")


@main.group()
def db() -> None:
    """Journal schema and retention."""


@db.command()
@click.option("--database-url", default=None, help="the database to migrate (default: the "
              "one the app's Sagaworker was given)")
@pass_ctx
def upgrade(c: Ctx, database_url: str | None) -> None:
    """Apply the schema migrations (Alembic) to the app's journal database."""
    from .._journal.migrate import upgrade as run
    from .._journal.urls import masked

    url = database_url or c.database_url
    try:
        sw = c.sw
    except click.UsageError:
        if url is None:
            raise
        sw = None  # no app module: the journal alone, on the URL given
    if sw is None:
        assert url is not None
        run(url)
    else:
        url = url or sw.settings.database_url
        sw.create_schema(url)  # the journal, then the app's own tables (sw.on_upgrade)
    click.echo(f"journal schema is up to date in {masked(url)}")


@db.command("rotate-key")
@click.option("--database-url", default=None, help="the journal to re-encrypt (default: the "
              "one the app's Sagaworker was given)")
@click.option("--batch", type=click.IntRange(min=1), default=100, show_default=True,
              help="sagas (with their entries) per transaction")
@pass_ctx
def rotate_key(c: Ctx, database_url: str | None, batch: int) -> None:
    """Re-encrypt the journal with the first of SAGAWORKER_ENCRYPTION_KEYS.

    Run it after putting a new key first (the old ones listed after it) on every process;
    then the old keys can be dropped. Clear values (written before the keys were set) are
    encrypted too; values already under the first key are left as they are.
    """
    sw = c.sw
    if database_url:
        use_database(sw, database_url)
    try:
        n = sw.rotate_key(batch=batch)
    except SagaworkerError as exc:
        refuse(str(exc))
    click.echo(f"re-encrypted {n} rows with the first key of SAGAWORKER_ENCRYPTION_KEYS")


@db.command()
@click.option("--older-than", "older_than", required=True, metavar="AGE",
              help="age of the sagas to delete: 30d, 12h, 90m, 45s or seconds")
@click.option("--include-dirty", is_flag=True, help="also COMPENSATION_FAILED sagas and "
              "sagas with an in-doubt step (kept by default: someone must look at them)")
@click.option("--batch", type=click.IntRange(min=1), default=1000, show_default=True,
              help="sagas deleted per transaction")
@click.option("--json", "as_json", is_flag=True, help="machine-readable output")
@pass_ctx
def prune(c: Ctx, older_than: str, include_dirty: bool, batch: int, as_json: bool) -> None:
    """Delete terminal sagas older than AGE, with their entries, in short batches."""
    from .._journal.retention import parse_age

    try:
        seconds = parse_age(older_than)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--older-than") from exc
    n = c.sw.prune(seconds, include_dirty=include_dirty, batch=batch)
    if as_json:
        click.echo(to_json({"pruned": n, "older_than_s": seconds,
                            "include_dirty": include_dirty}))
    else:
        click.echo(f"pruned {n} saga(s) finished more than {older_than} ago"
                   + ("" if include_dirty else " (dirty and in-doubt sagas kept)"))


@main.command()
@click.option("--keep", is_flag=True, help="keep the demo's folder (journal, broker, "
              "worker log)")
@click.option("--agent", is_flag=True, help="the example's trip-booking LLM agent (Pydantic "
              "AI, extra [pydantic-ai]) instead of the order saga")
def demo(keep: bool, agent: bool) -> None:
    """The example order saga (or trip agent) end to end on the embedded defaults (in a
    checkout of the repository: the example is not part of the installed library)."""
    if agent:
        from .agent_demo import run_agent_demo

        sys.exit(run_agent_demo(keep=keep))
    from .demo import run_demo

    sys.exit(run_demo(keep=keep))


@main.command()
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option("--port", type=click.IntRange(0, 65535), default=5000, show_default=True)
@pass_ctx
def web(c: Ctx, host: str, port: int) -> None:
    """The on-call dashboard and JSON API for the app (extra [web]); for production, mount
    sagaworker.web.create_app(sw) in your WSGI server."""
    from ..web import create_app  # ConfigurationError naming the extra without Flask

    app = create_app(c.sw)
    click.echo(f"dashboard of {app_name(c.app)} on http://{host}:{port}/", err=True)
    app.run(host=host, port=port, threaded=True)


main.add_command(flows)
main.add_command(mcp)

if __name__ == "__main__":
    main()
