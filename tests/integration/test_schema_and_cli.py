"""The Alembic migration matches the tables; the CLI answers with the SPEC's exit codes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from click.testing import CliRunner
from sqlalchemy import create_engine, inspect, text

from sagaworker._journal.migrate import upgrade
from sagaworker._journal.schema import metadata
from sagaworker.cli.commands import main

ROOT = Path(__file__).resolve().parents[2]


def test_migration_matches_the_schema(tmp_path: Path) -> None:
    """`db upgrade` builds exactly the tables the code uses (no drift)."""
    url = f"sqlite:///{tmp_path / 'm.db'}"
    upgrade(url)
    engine = create_engine(url)
    with engine.connect() as conn:
        ctx = MigrationContext.configure(conn, opts={"version_table": "sagaworker_alembic_version"})
        diff = [d for d in compare_metadata(ctx, metadata)
                if not (d[0] == "remove_table" and d[1].name == "sagaworker_alembic_version")]
    assert diff == []


def test_upgrade_keeps_an_index_built_beforehand(tmp_path: Path) -> None:
    """Migration 0005's index, built by an operator ahead of the upgrade (CONCURRENTLY on
    a busy PostgreSQL journal, as its docstring says): the upgrade goes through."""
    url = f"sqlite:///{tmp_path / 'pre.db'}"
    upgrade(url, "0004")
    engine = create_engine(url)
    with engine.begin() as conn:
        conn.execute(text("CREATE INDEX ix_sagaworker_entries_in_doubt ON sagaworker_entries "
                          "(saga_id) WHERE in_doubt IS 1"))
    upgrade(url, "0005")
    with engine.connect() as conn:
        assert conn.execute(text("SELECT version_num FROM sagaworker_alembic_version")
                            ).scalar() == "0005"
    assert "ix_sagaworker_entries_in_doubt" in {
        ix["name"] for ix in inspect(engine).get_indexes("sagaworker_entries")}


def _env(tmp_path: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SAGAWORKER_")}
    env.update(SAGAWORKER_DATABASE_URL=f"sqlite:///{tmp_path / 'c.db'}",
               SAGAWORKER_BROKER_FOLDER=str(tmp_path / "broker"), SAGAWORKER_APP="tasks",
               PYTHONPATH=str(ROOT))
    return env


def test_cli_read_commands_and_exit_codes(tmp_path: Path,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """show/list print JSON with --json; an unknown saga exits 1, bad usage exits 2."""
    env = _env(tmp_path)
    for name in [m for m in sys.modules if m.split(".")[0] in ("tasks", "config")]:
        monkeypatch.delitem(sys.modules, name)  # the CLI loads the example on this journal
    run = CliRunner().invoke
    for k, v in env.items():
        os.environ[k] = v
    try:
        code = ("from tasks import sw; s = sw.begin('cli-1', metadata={'a': 1}); "
                "s.complete()")
        subprocess.run([sys.executable, "-c", code], env=env, check=True, cwd=tmp_path)
        r = run(main, ["show", "cli-1", "--json"])
        assert r.exit_code == 0, r.output
        assert json.loads(r.output)["status"] == "COMPLETED"
        r = run(main, ["list", "--json"])
        assert [s["saga_id"] for s in json.loads(r.output)] == ["cli-1"]
        r = run(main, ["show", "nope"])
        assert r.exit_code == 1 and "no saga" in r.output
        r = run(main, ["list", "--status", "BOGUS"])
        assert r.exit_code == 2
        r = run(main, ["retry-compensation", "cli-1"])
        assert r.exit_code == 1
        r = run(main, ["orphans", "--older-than", "0", "--json"])
        assert r.exit_code == 0 and json.loads(r.output) == []
    finally:
        for k in env:
            os.environ.pop(k, None)


def test_console_script_help(tmp_path: Path) -> None:
    """Every command documented in the SPEC answers --help."""
    for cmd in ([], ["demo"], ["worker"], ["show"], ["list"], ["orphans"], ["approvals"], ["abort"],
                ["approve"], ["reject"], ["retry-compensation"], ["db", "upgrade"]):
        r = CliRunner().invoke(main, [*cmd, "--help"])
        assert r.exit_code == 0, (cmd, r.output)


def test_db_upgrade_command(tmp_path: Path) -> None:
    """`sagaworker db upgrade` migrates the configured database."""
    r = CliRunner().invoke(main, ["db", "upgrade", "--database-url",
                                  f"sqlite:///{tmp_path / 'u.db'}"])
    assert r.exit_code == 0 and "up to date" in r.output


def test_db_upgrade_creates_the_examples_own_tables(tmp_path: Path) -> None:
    """The release step creates the example's tables (``sw.on_upgrade``), so no tool call
    creates them lazily; it is idempotent."""
    env = _bare_env(tmp_path)
    url = f"sqlite:///{tmp_path / 'rel.db'}"
    for _ in range(2):
        r = _cli(["-A", "tasks", "--database-url", url, "db", "upgrade"], tmp_path, env)
        assert r.returncode == 0, r.stderr
    engine = create_engine(url)
    assert {"example_holds", "example_charges", "example_shipments",
            *metadata.tables} <= set(inspect(engine).get_table_names())
    engine.dispose()


def _app_module(folder: Path, name: str, database_url: str) -> None:
    """A module holding a Celery app and a Sagaworker given its database explicitly."""
    (folder / f"{name}.py").write_text(
        "from celery import Celery\n"
        "from sagaworker import Sagaworker\n"
        f"app = Celery({name!r})\n"
        f"sw = Sagaworker(app, database_url={database_url!r})\n")


def _bare_env(tmp_path: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SAGAWORKER_")}
    env.update(SAGAWORKER_BROKER_FOLDER=str(tmp_path / "broker"), PYTHONPATH=str(ROOT))
    return env


def _cli(args: list[str], cwd: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "sagaworker.cli", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=120)


def test_db_upgrade_migrates_the_apps_database(tmp_path: Path) -> None:
    """`-A module db upgrade` migrates the database the module's Sagaworker was given, not
    the settings' default ./sagaworker.db; --database-url overrides it."""
    app_db, other_db = tmp_path / "app.db", tmp_path / "other.db"
    _app_module(tmp_path, "cliapp_db", f"sqlite:///{app_db}")
    env = _bare_env(tmp_path)
    r = _cli(["-A", "cliapp_db", "db", "upgrade"], tmp_path, env)
    assert r.returncode == 0, r.stderr
    assert str(app_db) in r.stdout
    engine = create_engine(f"sqlite:///{app_db}")
    assert {"sagaworker_alembic_version", *metadata.tables} <= set(
        inspect(engine).get_table_names())
    engine.dispose()
    assert not (tmp_path / "sagaworker.db").exists()
    r = _cli(["-A", "cliapp_db", "--database-url", f"sqlite:///{other_db}", "db", "upgrade"],
             tmp_path, env)
    assert r.returncode == 0 and other_db.exists(), r.stderr


def test_commands_use_the_apps_database_or_database_url(tmp_path: Path) -> None:
    """Read commands see the app's journal; --database-url points them elsewhere."""
    app_db = tmp_path / "app.db"
    _app_module(tmp_path, "cliapp_read", f"sqlite:///{app_db}")
    env = _bare_env(tmp_path)
    code = "import cliapp_read; s = cliapp_read.sw.begin('in-app-db'); s.complete()"
    subprocess.run([sys.executable, "-c", code], env=env, cwd=tmp_path, check=True)
    r = _cli(["-A", "cliapp_read", "list", "--json"], tmp_path, env)
    assert [s["saga_id"] for s in json.loads(r.stdout)] == ["in-app-db"], r.stderr
    r = _cli(["-A", "cliapp_read", "--database-url", f"sqlite:///{tmp_path / 'empty.db'}",
              "list", "--json"], tmp_path, env)
    assert json.loads(r.stdout) == [], r.stderr
    env["SAGAWORKER_APP"] = "cliapp_read"
    r = _cli(["show", "in-app-db", "--json"], tmp_path, env)
    assert json.loads(r.stdout)["status"] == "COMPLETED", r.stderr


def test_db_upgrade_without_an_app_is_a_usage_error(tmp_path: Path) -> None:
    """No importable app and no --database-url: exit 2 naming the ways to say which
    database, and no ./sagaworker.db migrated behind the user's back."""
    env = _bare_env(tmp_path)
    env["SAGAWORKER_APP"] = "no_such_app_module"
    r = _cli(["db", "upgrade"], tmp_path, env)
    assert r.returncode == 2
    for hint in ("no_such_app_module", "-A", "SAGAWORKER_APP", "--database-url"):
        assert hint in r.stderr, r.stderr
    assert not (tmp_path / "sagaworker.db").exists()


def test_show_a_flow_and_abort_it(tmp_path: Path) -> None:
    """`show` (table and --json) gives a flow's name, its arguments (redacted by name), the
    step it waits on and its deadline; `abort` fails it (the actor defaults to the login
    name), exit 1 for an unknown or finished saga, 2 for bad usage."""
    import getpass

    env = {**_env(tmp_path), "SAGAWORKER_APPROVAL_SECRET": "x" * 40}
    code = ("from tasks import sw, place_order\n"
            "sw.create_schema()\n"
            "sw.start('flow-1', place_order, '1', 'sku-1', 1, 'card-secret-99', 100,\n"
            "         deadline=3600)\n"
            "sw.flows.advance('flow-1')  # what a worker does: the first step is journaled\n"
            "s = sw.begin('done-1'); s.complete()\n")
    subprocess.run([sys.executable, "-c", code], env=env, check=True, cwd=tmp_path)
    r = _cli(["show", "flow-1", "--json"], tmp_path, env)
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout)
    assert d["flow"] == "tasks.orders.place_order"
    assert d["flow_args"] == ["1", "sku-1", 1, "[REDACTED]", 100] and d["flow_kwargs"] == {}
    assert d["deadline_at"] and d["status"] == "RUNNING"
    assert d["waiting_on"] == {"seq": 1, "tool_name": "tasks.inventory.reserve_inventory",
                               "phase": "INTENT"}
    r = _cli(["show", "flow-1"], tmp_path, env)
    out = " ".join(r.stdout.split())
    assert r.returncode == 0 and "card-secret-99" not in r.stdout, r.stdout
    assert 'flow: tasks.orders.place_order("1", "sku-1", 1, "[REDACTED]", 100)' in out
    assert "waiting on: step 1 reserve_inventory (INTENT" in out and "deadline: " in out

    assert CliRunner().invoke(main, ["abort", "flow-1"]).exit_code == 2  # --reason required
    assert CliRunner().invoke(main, ["abort", "flow-1", "--reason", " "]).exit_code == 2
    r = _cli(["abort", "nope", "--reason", "x"], tmp_path, env)
    assert r.returncode == 1 and "no saga" in r.stderr
    r = _cli(["abort", "done-1", "--reason", "x"], tmp_path, env)
    assert r.returncode == 1 and "COMPLETED" in r.stderr
    r = _cli(["abort", "flow-1", "--reason", "customer left"], tmp_path, env)
    assert r.returncode == 0, r.stderr
    d = json.loads(_cli(["show", "flow-1", "--json"], tmp_path, env).stdout)
    assert d["reason"] == f"aborted by {getpass.getuser()}: customer left"


def test_an_embedded_journal_of_an_earlier_release_carries_on(tmp_path: Path) -> None:
    """The embedded journal an earlier release made (its tables, no revision: it was never
    migrated) is completed at start (the columns it lacks, the revision stamped): steps run,
    the sweeper sweeps, and `db upgrade` works on it afterwards. One stamped with an
    earlier revision is refused at start, naming `db upgrade`, which then works."""
    from celery import Celery

    from sagaworker import ConfigurationError, Sagaworker, Settings
    from sagaworker._journal.readiness import _revisions
    from tests.integration.test_clocks import Bus

    head = _revisions()[0]
    for name, stamped in (("made.db", False), ("stamped.db", True)):
        url = f"sqlite:///{tmp_path / name}"
        upgrade(url, "0005")
        engine = create_engine(url)
        if not stamped:
            with engine.begin() as conn:
                conn.execute(text("DROP TABLE sagaworker_alembic_version"))
        sw = Sagaworker(Celery("old", broker="memory://"), settings=Settings(
            database_url=url, broker_url="memory://"))
        if stamped:
            with pytest.raises(ConfigurationError, match=r"older than .* db upgrade"):
                sw.check_ready()
            upgrade(url)

        @sw.tool()
        def plain(n: int) -> int:
            return n

        sw.rt.bus = Bus()  # type: ignore[assignment]
        sw.begin("e-1").enqueue(plain, 1)
        tool = sw.inspect("e-1").entries[0].tool_name
        assert sw.machine.claim_start("e-1", 1, tool, token="t", worker="w",
                                      idempotent=False, task_id=None).attempt == 1
        assert sw.machine.executed("e-1", 1, "t", 1, 1.0).applied
        sw.sweeper.sweep()
        with engine.connect() as conn:
            assert conn.execute(text("SELECT version_num FROM sagaworker_alembic_version")
                                ).scalar() == head
        upgrade(url)
        sw.rt.journal.engine.dispose()
        engine.dispose()
