"""Poison keys: the journal's encrypted-value key and kombu's type-tag shape, refused where
they would get in (a keyword's name, the metadata, a flow's arguments, any nested dict), and
rows that got in before (or that no key opens) skipped and flagged by listings and the
sweeper instead of failing them."""

from __future__ import annotations

import asyncio
import collections
import json
import sys
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from celery import Celery
from click.testing import CliRunner
from cryptography.fernet import Fernet
from sqlalchemy import select, text, update
from structlog.testing import capture_logs

from sagaworker import (
    ConfigurationError,
    FlowContext,
    Sagaworker,
    SagaworkerError,
    Settings,
)
from sagaworker._base.errors import BadInput
from sagaworker._journal.repository import now
from sagaworker._journal.schema import entries, sagas
from tests.conftest import UNIT_SECRET

RESERVED = "$sagaworker_enc"
WHEN = "2026-12-04T10:00:00"


def loose(s: FlowContext, *items: Any, **extra: Any) -> None:
    """A flow taking any arguments (module level, as flows must be)."""


def _note_tool(sw: Sagaworker) -> Any:
    @sw.tool()
    def note(*items: Any, **extra: Any) -> None: ...

    return note


def _foreign_token() -> str:
    """A real Fernet token, sealed with a key this journal never had."""
    return Fernet(Fernet.generate_key()).encrypt(b'{"secret": 1}').decode()


def _set_raw(sw: Sagaworker, table: str, column: str, value: Any, saga_id: str) -> None:
    """Write a JSON column as stored, bypassing every check (data from before the fix)."""
    with sw.journal.engine.begin() as conn:
        conn.execute(text(f"UPDATE {table} SET {column} = :v WHERE saga_id = :s"),
                     {"v": json.dumps(value), "s": saga_id})


# -- refused at the producer ---------------------------------------------------------------

ENQUEUES: list[tuple[str, Callable[[Sagaworker, Any], Any], str]] = [
    ("reserved keyword name",
     lambda sw, note: sw.begin("p").enqueue(note, **{RESERVED: "x"}),
     r"keyword argument '\$sagaworker_enc'"),
    ("tag-shaped keywords",
     lambda sw, note: sw.begin("p").enqueue(note, __type__="datetime", __value__=WHEN),
     "keyword arguments '__type__' and '__value__'"),
    ("tag-shaped keywords kombu cannot decode",
     lambda sw, note: sw.begin("p").enqueue(note, __type__="nothing", __value__=1),
     "keyword arguments '__type__' and '__value__'"),
    ("a decodable tag nested in a value",
     lambda sw, note: sw.begin("p").enqueue(
         note, x=[{"__type__": "datetime", "__value__": WHEN}]),
     r"argument 'x' holds a dict shaped like kombu's type tag"),
    ("a dict subclass holding the reserved key",
     lambda sw, note: sw.begin("p").enqueue(note, collections.OrderedDict({RESERVED: "x"})),
     r"holds a dict with the key '\$sagaworker_enc'"),
    ("enqueue_many",
     lambda sw, note: sw.begin("p").enqueue_many([(note, (1,), {}),
                                                  (note, (), {RESERVED: "x"})]),
     r"keyword argument '\$sagaworker_enc'"),
    ("aenqueue",
     lambda sw, note: asyncio.run(sw.begin("p").aenqueue(note, **{RESERVED: "x"})),
     r"keyword argument '\$sagaworker_enc'"),
    ("enqueue_call",
     lambda sw, note: sw.begin("p").enqueue_call("c-1", note, (), {RESERVED: "x"}),
     r"keyword argument '\$sagaworker_enc'"),
]


@pytest.mark.parametrize(("call", "named"), [c[1:] for c in ENQUEUES],
                         ids=[c[0] for c in ENQUEUES])
def test_a_step_whose_arguments_would_read_back_as_something_else_is_refused(
        sqlite_sw: Sagaworker, call: Callable[[Sagaworker, Any], Any], named: str) -> None:
    """A keyword named like the encrypted-value key or kombu's tag, or such a dict nested
    in a value, is BadInput naming the argument and saying to rename it; no step is
    journaled."""
    note = _note_tool(sqlite_sw)
    with pytest.raises(BadInput, match=named) as got:
        call(sqlite_sw, note)
    assert "rename" in str(got.value)
    assert [r.entries for r in sqlite_sw.sagas()] == [[]]


STARTS: list[tuple[str, Callable[[Sagaworker], Any], str]] = [
    ("metadata with the reserved key (a dict subclass)",
     lambda sw: sw.begin("m", metadata=collections.OrderedDict({RESERVED: "x"})),
     "saga metadata"),
    ("metadata shaped like a decodable tag",
     lambda sw: sw.begin("m", metadata={"__type__": "datetime", "__value__": WHEN}),
     "saga metadata"),
    ("flow keyword named like the reserved key",
     lambda sw: sw.start("m", loose, **{RESERVED: "x"}), r"keyword argument '\$sagaworker_enc'"),
    ("flow keywords shaped like a tag",
     lambda sw: sw.start("m", loose, __type__="datetime", __value__=WHEN),
     "keyword arguments '__type__' and '__value__'"),
    ("a tag nested in a flow's positional argument",
     lambda sw: sw.start("m", loose, {"__type__": "datetime", "__value__": WHEN}),
     "kombu's type tag"),
    ("flow metadata shaped like a tag",
     lambda sw: sw.start("m", loose, metadata={"__type__": "datetime", "__value__": WHEN}),
     "saga metadata"),
]


@pytest.mark.parametrize(("call", "named"), [c[1:] for c in STARTS],
                         ids=[c[0] for c in STARTS])
def test_metadata_and_flow_arguments_that_would_read_back_otherwise_are_refused(
        sqlite_sw: Sagaworker, call: Callable[[Sagaworker], Any], named: str) -> None:
    """``begin``/``start`` refuse such metadata and flow arguments (BadInput naming them,
    saying to rename the key); no saga is journaled."""
    sqlite_sw.flow()(loose)
    with pytest.raises(BadInput, match=named) as got:
        call(sqlite_sw)
    assert "rename" in str(got.value)
    assert sqlite_sw.sagas() == []


def test_poison_metadata_is_refused_with_encryption_on(tmp_path: Path) -> None:
    """With SAGAWORKER_ENCRYPTION_KEYS set the same shapes are refused (sealing hid them
    from nothing: the dashboard read them back wrong)."""
    app = Celery("enc", broker="memory://")
    sw = Sagaworker(app, settings=Settings(
        database_url=f"sqlite:///{tmp_path / 'j.db'}", broker_url="memory://",
        approval_secret=UNIT_SECRET, broker_folder=str(tmp_path / "b"),
        encryption_keys=Fernet.generate_key().decode()))
    note = _note_tool(sw)
    with pytest.raises(SagaworkerError, match="rename"):
        sw.begin("e-1", metadata={"__type__": "datetime", "__value__": WHEN})
    with pytest.raises(SagaworkerError, match="rename"):
        sw.begin("e-2").enqueue(note, **{RESERVED: "x"})
    assert [r.entries for r in sw.sagas()] == [[]]


# -- read back as stored -----------------------------------------------------------------

def test_a_marker_holding_no_token_reads_as_the_value_it_is(sqlite_sw: Sagaworker) -> None:
    """A reserved-key dict whose value is no Fernet token (journaled before the fix) is
    clear data: inspect, sagas() and a step's kwargs read it as it is, no keys asked."""
    note = _note_tool(sqlite_sw)
    sqlite_sw.begin("r-1").enqueue(note, 1)
    _set_raw(sqlite_sw, "sagaworker_sagas", "metadata", {RESERVED: "x"}, "r-1")
    _set_raw(sqlite_sw, "sagaworker_entries", "kwargs", {RESERVED: "not a token"}, "r-1")
    rec = sqlite_sw.inspect("r-1")
    assert rec.metadata == {RESERVED: "x"}
    assert rec.entries[0].kwargs == {RESERVED: "not a token"}
    assert [r.saga_id for r in sqlite_sw.sagas()] == ["r-1"]


def test_a_tag_shaped_kwargs_or_metadata_reads_as_the_dict_it_was(
        sqlite_sw: Sagaworker) -> None:
    """kwargs and metadata are dicts: one whose keys are kombu's tag reads back as that
    dict, not as a datetime (which broke every listing) nor a kombu error."""
    note = _note_tool(sqlite_sw)
    sqlite_sw.begin("r-2").enqueue(note, 1)
    tag = {"__type__": "datetime", "__value__": WHEN}
    _set_raw(sqlite_sw, "sagaworker_sagas", "metadata", tag, "r-2")
    _set_raw(sqlite_sw, "sagaworker_entries", "kwargs",
             {"__type__": "nothing-kombu-knows", "__value__": 1}, "r-2")
    rec = sqlite_sw.inspect("r-2")
    assert rec.metadata == tag
    assert rec.entries[0].kwargs == {"__type__": "nothing-kombu-knows", "__value__": 1}
    assert [r.saga_id for r in sqlite_sw.sagas()] == ["r-2"]


# -- listings skip and flag what no key opens ---------------------------------------------

def _with_unreadable(sw: Sagaworker) -> None:
    """Sagas ok-1 and ok-2, and bad-1 between them whose metadata no key of ours opens."""
    note = _note_tool(sw)
    sw.begin("ok-1").enqueue(note, 1)
    sw.begin("bad-1").enqueue(note, 2)
    sw.begin("ok-2").enqueue(note, 3)
    _set_raw(sw, "sagaworker_sagas", "metadata", {RESERVED: _foreign_token()}, "bad-1")


def test_sagas_skips_a_saga_it_cannot_read_and_flags_it(sqlite_sw: Sagaworker) -> None:
    """sw.sagas() lists every other saga and logs ``saga_unreadable`` (warning) for the
    one it skipped; inspect of that one still says which setting to fix."""
    _with_unreadable(sqlite_sw)
    with capture_logs() as logs:
        listed = [r.saga_id for r in sqlite_sw.sagas()]
    assert listed == ["ok-2", "ok-1"]
    flagged = [e for e in logs if e["event"] == "saga_unreadable"]
    assert [(e["log_level"], e["saga_id"]) for e in flagged] == [("warning", "bad-1")]
    assert "SAGAWORKER_ENCRYPTION_KEYS" in flagged[0]["error"]
    with pytest.raises(ConfigurationError, match="SAGAWORKER_ENCRYPTION_KEYS"):
        sqlite_sw.inspect("bad-1")


def test_the_api_and_dashboard_list_the_rest_and_show_the_unreadable_one(
        sqlite_sw: Sagaworker) -> None:
    """GET /sagas answers 200 with the readable sagas and the unreadable one under
    ``unreadable``; the dashboard answers 200 and names it."""
    from sagaworker.web import WebAuth, create_app

    _with_unreadable(sqlite_sw)
    client = create_app(sqlite_sw, auth=WebAuth(anonymous_reads=True)).test_client()
    got = client.get("/sagas")
    assert got.status_code == 200
    body = got.get_json()
    assert [s["saga_id"] for s in body["sagas"]] == ["ok-2", "ok-1"]
    assert [u["saga_id"] for u in body["unreadable"]] == ["bad-1"]
    assert "SAGAWORKER_ENCRYPTION_KEYS" in body["unreadable"][0]["error"]
    page = client.get("/")
    assert page.status_code == 200
    html = page.get_data(as_text=True)
    assert "ok-1" in html and "bad-1" in html and "unreadable" in html


def test_the_api_and_dashboard_say_why_a_saga_holding_a_copied_value_is_not_shown(
        tmp_path: Path) -> None:
    """GET /sagas/<id> and its dashboard page of a saga whose metadata was copied from
    another with SQL (encryption on): 409 saying so, not a 500."""
    from celery import Celery

    from sagaworker.web import WebAuth, create_app

    sw = Sagaworker(Celery("copied", broker="memory://"), settings=Settings(
        database_url=f"sqlite:///{tmp_path / 'j.db'}", broker_url="memory://",
        approval_secret=UNIT_SECRET, encryption_keys=Fernet.generate_key().decode()))
    for saga_id in ("from-1", "to-1"):
        sw.begin(saga_id, metadata={"customer": saga_id})
    with sw.journal.engine.begin() as conn:
        conn.execute(text("UPDATE sagaworker_sagas SET metadata = (SELECT metadata FROM "
                          "sagaworker_sagas WHERE saga_id = 'from-1') WHERE saga_id = 'to-1'"))
    client = create_app(sw, auth=WebAuth(anonymous_reads=True)).test_client()
    got = client.get("/sagas/to-1")
    assert got.status_code == 409
    assert "copied there with SQL" in got.get_json()["error"]
    page = client.get("/ui/sagas/to-1")
    assert page.status_code == 409 and "copied there with SQL" in page.get_data(as_text=True)
    assert client.get("/sagas/from-1").status_code == 200


CLI_APP = '''
from celery import Celery
from sagaworker import Sagaworker, Settings

app = Celery("poisonapp", broker="memory://")
sw = Sagaworker(app, settings=Settings(
    database_url=DB, approval_secret="cli-tests-approval-secret-0123456789abcdef"))


@sw.tool()
def note(*items, **extra):
    return None
'''


def _split_streams() -> CliRunner:
    """A runner whose ``stdout`` holds stdout only: click 8.2 keeps the streams apart by
    itself, click 8.1 (pyproject's lower bound) only when told (``mix_stderr=False``)."""
    try:
        return CliRunner(**{"mix_stderr": False})
    except TypeError:
        return CliRunner()


def test_the_cli_list_shows_the_rest_and_marks_the_unreadable_one(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`sagaworker list` prints every other saga and a row marking the unreadable one;
    `--json` lists the readable ones and names the other on stderr; `show` of it says why
    in one line."""
    from sagaworker.cli.commands import main

    (tmp_path / "poisonapp.py").write_text(
        CLI_APP.replace("DB", repr(f"sqlite:///{tmp_path / 'j.db'}")))
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "poisonapp", raising=False)
    import poisonapp  # type: ignore[import-not-found]

    _with_unreadable(poisonapp.sw)
    r = CliRunner().invoke(main, ["-A", "poisonapp", "list"], terminal_width=200)
    assert r.exit_code == 0, r.output
    assert "ok-1" in r.output and "ok-2" in r.output
    assert "bad-1" in r.output and "unreadable" in r.output
    r = _split_streams().invoke(main, ["-A", "poisonapp", "list", "--json"])
    assert r.exit_code == 0, r.output
    assert [s["saga_id"] for s in json.loads(r.stdout)] == ["ok-2", "ok-1"]
    assert "bad-1" in r.stderr and "unreadable" in r.stderr


def test_the_cli_show_of_a_saga_holding_a_copied_value_says_why_in_one_line(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`sagaworker show` of a saga whose metadata was copied from another saga with SQL
    (encryption on): exit 1 and one line saying so, not a traceback."""
    from sagaworker.cli.commands import main

    monkeypatch.setenv("SAGAWORKER_ENCRYPTION_KEYS", Fernet.generate_key().decode())
    (tmp_path / "copyapp.py").write_text(
        CLI_APP.replace("DB", repr(f"sqlite:///{tmp_path / 'j.db'}")))
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "copyapp", raising=False)
    import copyapp  # type: ignore[import-not-found]

    for saga_id in ("from-1", "to-1"):
        copyapp.sw.begin(saga_id, metadata={"customer": saga_id})
    with copyapp.sw.journal.engine.begin() as conn:
        conn.execute(text("UPDATE sagaworker_sagas SET metadata = (SELECT metadata FROM "
                          "sagaworker_sagas WHERE saga_id = 'from-1') WHERE saga_id = 'to-1'"))
    r = _split_streams().invoke(main, ["-A", "copyapp", "show", "to-1"])
    assert (r.exit_code, type(r.exception)) == (1, SystemExit), r.exception
    assert r.stderr.startswith("error: the value in sagaworker_sagas.metadata (saga 'to-1')")
    assert "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1
    assert _split_streams().invoke(main, ["-A", "copyapp", "show", "from-1"]).exit_code == 0


# -- the sweeper isolates each stage and each row -----------------------------------------

def _lost_steps(sw: Sagaworker, monkeypatch: pytest.MonkeyPatch,
                ids: list[str]) -> list[tuple[str, int]]:
    """One step in each saga of ``ids`` whose publish was lost long ago; returns what the
    relay publishes."""
    note = _note_tool(sw)
    monkeypatch.setattr(sw.producer, "publish", lambda *a: False)
    for saga_id in ids:
        sw.begin(saga_id).enqueue(note, saga_id)
    with sw.journal.engine.begin() as conn:
        conn.execute(update(entries).values(
            created_at=now() - timedelta(seconds=sw.settings.relay_after + 60)))
    sent: list[tuple[str, int]] = []

    def publish(saga_id: str, seq: int, *a: Any, **k: Any) -> bool:
        sent.append((saga_id, seq))
        return True

    monkeypatch.setattr(sw.rt.bus, "ready", lambda queues: {})
    monkeypatch.setattr(sw.rt.bus, "publish_step", publish)
    return sent


def test_a_failing_stage_does_not_stop_the_others(
        sqlite_sw: Sagaworker, monkeypatch: pytest.MonkeyPatch) -> None:
    """A stage that raises is logged (``sweep_stage_failed``, error) and the pass goes on:
    the relay still publishes a lost step."""
    sent = _lost_steps(sqlite_sw, monkeypatch, ["s-1"])

    def broken() -> int:
        raise RuntimeError("the database said no")

    monkeypatch.setattr(sqlite_sw.sweeper, "_deadlines", broken)
    with capture_logs() as logs:
        counts = sqlite_sw.sweeper.sweep()
    assert sent == [("s-1", 1)] and counts["relayed"] == 1
    failed = [e for e in logs if e["event"] == "sweep_stage_failed"]
    assert [(e["log_level"], e["stage"]) for e in failed] == [("error", "deadlines")]
    assert "RuntimeError" in failed[0]["error"]


def test_an_overdue_flow_no_key_opens_does_not_stop_the_relay(
        sqlite_sw: Sagaworker, monkeypatch: pytest.MonkeyPatch) -> None:
    """A flow past its deadline whose metadata no key opens is failed by the deadline
    stage all the same (its moves never open the metadata they do not use), and the relay
    of another saga's lost step runs in the same pass."""
    sent = _lost_steps(sqlite_sw, monkeypatch, ["s-2"])
    sqlite_sw.flow()(loose)
    sqlite_sw.start("f-poison", loose, deadline=60)
    _set_raw(sqlite_sw, "sagaworker_sagas", "metadata", {RESERVED: _foreign_token()},
             "f-poison")
    with sqlite_sw.journal.engine.begin() as conn:
        conn.execute(update(sagas).where(sagas.c.saga_id == "f-poison")
                     .values(deadline_at=now() - timedelta(seconds=5)))
    with capture_logs() as logs:
        counts = sqlite_sw.sweeper.sweep()
    assert sent == [("s-2", 1)] and counts["relayed"] == 1
    with sqlite_sw.journal.engine.connect() as conn:
        asked = conn.execute(select(sagas.c.fail_requested_at, sagas.c.reason)
                             .where(sagas.c.saga_id == "f-poison")).one()
    assert asked.fail_requested_at is not None and "deadline" in asked.reason
    assert not any(e["event"] == "sweep_stage_failed" for e in logs)


def test_a_lost_step_no_key_opens_is_skipped_and_the_others_relayed(
        sqlite_sw: Sagaworker, monkeypatch: pytest.MonkeyPatch) -> None:
    """The relay logs ``sweep_row_unreadable`` (warning) for a step whose kwargs no key
    opens and publishes the other lost steps of the batch."""
    sent = _lost_steps(sqlite_sw, monkeypatch, ["a-1", "b-poison", "c-1"])
    _set_raw(sqlite_sw, "sagaworker_entries", "kwargs", {RESERVED: _foreign_token()},
             "b-poison")
    with capture_logs() as logs:
        counts = sqlite_sw.sweeper.sweep()
    assert sorted(sent) == [("a-1", 1), ("c-1", 1)] and counts["relayed"] == 2
    skipped = [e for e in logs if e["event"] == "sweep_row_unreadable"]
    assert [(e["log_level"], e["saga_id"], e["seq"]) for e in skipped] == [
        ("warning", "b-poison", 1)]


def test_an_idle_saga_no_key_opens_is_still_reported_idle(
        sqlite_sw: Sagaworker, monkeypatch: pytest.MonkeyPatch) -> None:
    """The idle stage reads no user data: a saga whose metadata no key opens is reported
    ``saga_idle`` like the others, not a stage failure."""
    sqlite_sw.begin("idle-ok")
    sqlite_sw.begin("idle-poison")
    _set_raw(sqlite_sw, "sagaworker_sagas", "metadata", {RESERVED: _foreign_token()},
             "idle-poison")
    with sqlite_sw.journal.engine.begin() as conn:
        conn.execute(update(sagas).values(
            updated_at=now() - timedelta(seconds=sqlite_sw.settings.idle_after + 60)))
    with capture_logs() as logs:
        counts = sqlite_sw.sweeper.sweep()
    assert counts["idle"] == 2
    assert sorted(e["saga_id"] for e in logs if e["event"] == "saga_idle") == [
        "idle-ok", "idle-poison"]


def test_orphans_skip_a_step_no_key_opens_and_still_log_it(sqlite_sw: Sagaworker) -> None:
    """sw.orphans() lists the other orphans (the skipped one logged ``sweep_row_unreadable``)
    and the periodic ``orphan_intent`` log, which reads no user data, names both."""
    note = _note_tool(sqlite_sw)
    sqlite_sw.begin("o-1").enqueue(note, 1)
    sqlite_sw.begin("o-poison").enqueue(note, 2)
    _set_raw(sqlite_sw, "sagaworker_entries", "args", {RESERVED: _foreign_token()},
             "o-poison")
    with sqlite_sw.journal.engine.begin() as conn:
        conn.execute(update(entries).values(created_at=now() - timedelta(seconds=600)))
    with capture_logs() as logs:
        assert [o.saga_id for o in sqlite_sw.orphans(older_than=60)] == ["o-1"]
    assert [e["saga_id"] for e in logs if e["event"] == "sweep_row_unreadable"] == [
        "o-poison"]
    with capture_logs() as logs:
        assert sqlite_sw.sweeper.log_orphans() == 2
    assert sorted(e["saga_id"] for e in logs if e["event"] == "orphan_intent") == [
        "o-1", "o-poison"]


def test_a_marker_holding_no_token_does_not_stop_a_process_from_starting(
        sqlite_sw: Sagaworker) -> None:
    """The start-up key check takes such metadata for clear data: a process without keys
    starts (it refused, saying the journal was sealed with a key)."""
    from sagaworker._journal.readiness import check_keys

    sqlite_sw.begin("k-1")
    _set_raw(sqlite_sw, "sagaworker_sagas", "metadata", {RESERVED: "x"}, "k-1")
    check_keys(sqlite_sw.journal.engine, None)
