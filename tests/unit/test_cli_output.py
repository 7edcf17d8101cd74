"""The command line as an operator meets it: no app is ever guessed, tables are never cut,
tokens are copied whole, journal text is shown as text."""

from __future__ import annotations

import io
import sys
from datetime import UTC, datetime
from pathlib import Path

import pytest
from click.testing import CliRunner
from rich.console import Console

from sagaworker import CompensationReport, Outcome, OutcomeResult, SagaRecord, SagaStatus
from sagaworker.cli import render
from sagaworker.cli.commands import main

APP = '''
from celery import Celery
from sagaworker import Reversibility, Sagaworker, Settings

app = Celery("cliapp", broker="memory://")
sw = Sagaworker(app, settings=Settings(
    database_url=DB, approval_secret="cli-tests-approval-secret-0123456789abcdef"))


@sw.tool(reversibility=Reversibility.IRREVERSIBLE)
def dispatch_a_parcel_to_a_customer_far_away(order_id: str, note: str) -> str:
    return "shipped"
'''


@pytest.fixture
def app_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A folder with the app module ``cliapp`` (a gated tool), as the working directory."""
    (tmp_path / "cliapp.py").write_text(
        APP.replace("DB", repr(f"sqlite:///{tmp_path / 'j.db'}")))
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "cliapp", raising=False)
    for k in [k for k in __import__("os").environ if k.startswith("SAGAWORKER_")]:
        monkeypatch.delenv(k)
    return tmp_path


@pytest.mark.parametrize("args", [["list"], ["show", "x"], ["approvals"], ["db", "upgrade"],
                                  ["worker"], ["web"]])
def test_a_command_without_an_app_exits_2_naming_the_fix(
        app_dir: Path, args: list[str]) -> None:
    """With neither -A nor SAGAWORKER_APP a command says how to name the app and exits 2;
    it never falls back to a module of its own choosing (an example's empty journal)."""
    r = CliRunner().invoke(main, args)
    assert r.exit_code == 2, r.output
    assert "-A MODULE" in r.output and "SAGAWORKER_APP" in r.output


def _record(reason: str) -> SagaRecord:
    at = datetime(2026, 1, 2, 3, 4, 5, tzinfo=UTC)
    long_tool = "tasks.payment.refund_the_card_of_a_customer_who_cancelled"
    report = CompensationReport(outcomes=[Outcome(
        seq=1, tool_name=long_tool, result=OutcomeResult.COMPENSATION_FAILED,
        detail="the refund API answered 503 three times in a row, try again later",
        attempts=4)], in_doubt=[])
    return SagaRecord(saga_id="order-with-a-rather-long-identifier-0001",
                      status=SagaStatus.COMPENSATION_FAILED, reason=reason, metadata={},
                      created_at=at, updated_at=at, entries=[], report=report)


def _rendered(fn: object, *args: object, width: int = 80) -> str:
    out = io.StringIO()
    saved = render.console
    render.console = Console(file=out, width=width, highlight=False)  # piped: 80 columns
    try:
        fn(*args)  # type: ignore[operator]
    finally:
        render.console = saved
    return out.getvalue()


def _words(text: str) -> str:
    """The text with spaces and line breaks taken out."""
    return "".join(text.split())


def _columns(out: str, title: str) -> list[str]:
    """The body cells of the table under ``title`` (or the first), column by column, each
    column's folded lines joined again."""
    lines = out.splitlines()
    start = next((i for i, ln in enumerate(lines) if title in ln), 0)
    cols: list[str] = []
    for ln in lines[start:]:
        if ln.startswith("└"):
            break
        if ln.startswith("│"):
            cells = ln.split("│")[1:-1]
            cols += [""] * (len(cells) - len(cols))
            for i, cell in enumerate(cells):
                cols[i] += cell.strip()
    return cols


def test_tables_are_never_cut_when_piped() -> None:
    """At 80 columns every value is there in full, folded over lines, never ``…``."""
    reason = "step 3 (tasks.payment.charge_card) failed: CardDeclined: insufficient funds"
    listing = _rendered(render.render_sagas, [_record(reason)])
    saga = _rendered(render.render_saga, _record(reason))
    for out in (listing, saga):
        assert "…" not in out
        assert "COMPENSATION_FAILED" in out  # a status is never folded either
        assert max(len(ln) for ln in out.splitlines()) <= 80
    # the listing's saga id is never folded: too wide for a table here, one block a row
    assert listing.splitlines()[0].split()[:3] == [
        "-", "saga", "order-with-a-rather-long-identifier-0001"]
    assert "statusCOMPENSATION_FAILEDsteps0created2026-01-0203:04:05" in _words(listing)
    assert _words(reason) in _words(listing)
    seq, tool, outcome, attempts, detail = _columns(saga, "compensation report")
    assert (seq, attempts) == ("1", "4")
    assert tool == "refund_the_card_of_a_customer_who_cancelled"
    assert outcome == "COMPENSATION_FAILED"
    assert _words(detail) == _words("the refund API answered 503 three times in a row, try again "
                            "later")


def test_journal_text_is_not_markup() -> None:
    """A reason holding rich markup (``[/]``, a hyperlink) is shown as written."""
    reason = "bad [/] input [link=https://evil.example]click[/link]"
    for fn, arg in ((render.render_sagas, [_record(reason)]),
                    (render.render_saga, _record(reason))):
        out = _rendered(fn, arg, width=200)
        assert "[/]" in out and "[link=https://evil.example]" in out


def _gate(app_dir: Path) -> str:
    import cliapp  # type: ignore[import-not-found]

    saga = cliapp.sw.begin("gate-1")
    saga.enqueue(cliapp.dispatch_a_parcel_to_a_customer_far_away, "o-1", "leave at door")
    return str(cliapp.sw.pending_approvals()[0].token)


def test_an_approval_token_is_printed_whole_on_one_line(app_dir: Path) -> None:
    """`approvals` at 80 columns: the token is one line, exactly as the journal signs it."""
    token = _gate(app_dir)
    assert len(token) > 80
    r = CliRunner().invoke(main, ["-A", "cliapp", "approvals"], terminal_width=80)
    assert r.exit_code == 0, r.output
    assert f"  token: {token}" in r.output.splitlines()


@pytest.mark.parametrize("paste", ["wrapped", "stdin"])
def test_a_pasted_token_is_accepted_with_its_line_breaks(app_dir: Path, paste: str) -> None:
    """A token pasted with the line breaks and spaces of a narrow terminal, or given on
    stdin (``approve -``, out of the process list), approves the step."""
    import cliapp

    token = _gate(app_dir)
    wrapped = "\n".join(token[i:i + 40] for i in range(0, len(token), 40)) + " \n"
    if paste == "stdin":
        r = CliRunner().invoke(main, ["-A", "cliapp", "approve", "-", "--approver", "alice"],
                               input=wrapped)
    else:
        r = CliRunner().invoke(main, ["-A", "cliapp", "approve", wrapped,
                                      "--approver", "alice"])
    assert r.exit_code == 0, r.output
    assert cliapp.sw.pending_approvals() == []


def test_web_serves_the_dashboard_of_the_named_app(app_dir: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """`sagaworker -A MODULE web` serves sagaworker.web's dashboard and API over that app's
    journal (the Flask app it would run is taken and asked instead)."""
    import flask

    served: list[flask.Flask] = []
    monkeypatch.setattr(flask.Flask, "run", lambda self, **kw: served.append(self))
    _gate(app_dir)
    monkeypatch.setenv("SAGAWORKER_WEB_ANONYMOUS_READS", "true")  # (the operator's choice)
    r = CliRunner().invoke(main, ["-A", "cliapp", "web", "--port", "8123"])
    assert r.exit_code == 0, r.output
    client = served[0].test_client()
    assert [s["saga_id"] for s in client.get("/sagas").get_json()["sagas"]] == ["gate-1"]
    assert client.get("/").status_code == 200


@pytest.mark.parametrize("width", [30, 40, 50, 60])
def test_a_narrow_terminal_gets_every_column_whole(width: int) -> None:
    """Too narrow for the table's columns, each row is printed as a block: no column
    vanishes, no status or phase is cut, no value is shortened."""
    reason = "step 3 (tasks.payment.charge_card) failed: CardDeclined: insufficient funds"
    for fn, arg in ((render.render_sagas, [_record(reason)]),
                    (render.render_saga, _record(reason))):
        out = _rendered(fn, arg, width=width)
        assert "…" not in out and "COMPENSATION_FAILED" in out
        assert max(len(ln) for ln in out.splitlines()) <= width
        assert _words("order-with-a-rather-long-identifier-0001") in _words(out)
    saga = _words(_rendered(render.render_saga, _record(reason), width=width))
    assert _words("refund_the_card_of_a_customer_who_cancelled") in saga
    assert _words("the refund API answered 503 three times in a row, try again later") in saga


#: formatting characters that reorder or hide text: right-to-left override and its kin,
#: isolates, marks, zero-width characters, a terminal escape
HIDDEN = ["\u202e", "\u202a", "\u202b", "\u202c", "\u202d", "\u2066", "\u2067", "\u2068",
          "\u2069", "\u200e", "\u200f", "\u200b", "\u200c", "\u200d", "\u2060", "\ufeff",
          "\x1b"]


def _shown(out: str) -> None:
    """No hidden character reached the terminal; each is there as its escape."""
    for ch in HIDDEN:
        assert ch not in out, repr(ch)
    assert "\\u202e" in out and "\\u2066" in out and "\\u200b" in out


def test_hidden_formatting_characters_are_shown_escaped() -> None:
    """A reason, a saga id or a value with a right-to-left override or a zero-width
    character is printed with each such character as ``\\uXXXX``: the text an operator
    reads is the text the journal holds."""
    rec = _record("refund to IBAN \u202e0987\u202c ok\u200b \u2066x\u2069 \x1b[31mred")
    rec = SagaRecord(**{**rec.__dict__, "saga_id": "order-\u202e1001\u200b\u2066"})
    for fn, arg in ((render.render_sagas, [rec]), (render.render_saga, rec)):
        _shown(_rendered(fn, arg, width=200))


def test_approvals_show_the_arguments_an_approver_approves(app_dir: Path) -> None:
    """`approvals` escapes hidden characters in the saga id and the arguments, so an
    approver sees that the address reads differently from how it renders."""
    import cliapp

    saga = cliapp.sw.begin("gate-\u202eevil\u200b\u2066")
    saga.enqueue(cliapp.dispatch_a_parcel_to_a_customer_far_away, "o-\u202e1",
                 "ship to \u2066acct 1234\u2069 \u200b\u200f\u200e\ufeff")
    r = CliRunner().invoke(main, ["-A", "cliapp", "approvals"], terminal_width=200)
    assert r.exit_code == 0, r.output
    _shown(r.output)
    assert "gate-\\u202eevil\\u200b\\u2066" in r.output



@pytest.mark.parametrize("width", [200, 100, 60])
def test_list_never_wraps_a_saga_id(app_dir: Path, width: int) -> None:
    """`list` shows each saga id whole on one line, whatever the terminal's width (a
    table, or one block a row when the table cannot fit): it can be copied as it is."""
    import cliapp

    long_id = "order-2026-12-06-customer-4711-attempt-0003-retry-7"
    cliapp.sw.begin(long_id)
    r = CliRunner().invoke(main, ["-A", "cliapp", "list"], terminal_width=width)
    assert r.exit_code == 0, r.output
    assert any(long_id in line for line in r.output.splitlines()), r.output


def test_the_cli_imports_what_the_worker_imports(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A flow in a module only Celery's ``include=`` names (the worker imports it, the app
    module does not): ``show`` knows its parameters, so only the one SAGAWORKER_REDACT
    names is redacted, not every argument."""
    (tmp_path / "shopapp.py").write_text(
        "from celery import Celery\nfrom sagaworker import Sagaworker, Settings\n"
        "app = Celery('shopapp', broker='memory://', include=['shopflows'])\n"
        f"sw = Sagaworker(app, settings=Settings(database_url="
        f"{'sqlite:///' + str(tmp_path / 'j.db')!r}))\n")
    (tmp_path / "shopflows.py").write_text(
        "from sagaworker import FlowContext\nfrom shopapp import sw\n\n\n"
        "@sw.flow()\ndef checkout(s: FlowContext, card: str, sku: str) -> None:\n"
        "    return None\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    for k in [k for k in __import__("os").environ if k.startswith("SAGAWORKER_")]:
        monkeypatch.delenv(k)
    monkeypatch.setenv("SAGAWORKER_REDACT", "card")
    import shopapp  # type: ignore[import-not-found]
    import shopflows  # type: ignore[import-not-found]

    shopapp.sw.start("shop-1", shopflows.checkout, "card-4242", "sku-9")
    shopapp.sw.rt.reset_engine()
    for name in ("shopapp", "shopflows"):  # the CLI's own import, as a fresh process
        monkeypatch.delitem(sys.modules, name)
    r = CliRunner().invoke(main, ["-A", "shopapp", "show", "shop-1"],
                           env={"COLUMNS": "200"})
    assert r.exit_code == 0, r.output
    assert 'flow: shopflows.checkout("[REDACTED]", "sku-9")' in r.output
    assert "card-4242" not in r.output


@pytest.mark.parametrize("args", [[], ["show"], ["db", "upgrade"]])
def test_dash_h_is_help(args: list[str]) -> None:
    """``sagaworker -h`` (and a command's ``-h``) prints what ``--help`` prints, exit 0."""
    long, short = (CliRunner().invoke(main, [*args, flag]) for flag in ("--help", "-h"))
    assert (short.exit_code, short.output) == (0, long.output)
    assert long.output.startswith("Usage: ")
