"""SAGAWORKER_REDACT: parameters named there never leave the library, positional or not.

One function (``redact_call``) binds the arguments through the tool's signature; every
exit point uses it: sagaworker's events, Celery's argsrepr/kwargsrepr, Celery's own log
lines (a logging filter), error texts, the CLI's tables and JSON, the API, the dashboard.
"""

from __future__ import annotations

import inspect
import io
import json
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import structlog
from celery import Celery, signals
from celery.concurrency.base import BasePool
from celery.worker.consumer.consumer import INVALID_TASK_ERROR, UNKNOWN_TASK_ERROR, dump_body
from structlog.testing import capture_logs

from sagaworker import (
    REDACTED,
    CompensationContext,
    Redaction,
    SagaStatus,
    Sagaworker,
    Settings,
    configure_logging,
    redact_call,
)
from sagaworker._observe import celery_logs, process
from sagaworker._observe import redact as _redact
from sagaworker._observe.celery_logs import RedactedRequest
from sagaworker._observe.redact import error_text, secret_values
from sagaworker._worker.execution import ENVELOPE
from sagaworker.cli.render import console, render_saga, render_sagas, to_json

SECRET = "4242424242424242"


def charge_card(card: str, amount_cents: int, *extra: Any, meta: Any = None,
                **more: Any) -> str:
    return "ch"


SIG = inspect.signature(charge_card)


class Declined(Exception):
    pass


# -- the one function ----------------------------------------------------------------


def test_positional_and_keyword_arguments_are_bound_by_name() -> None:
    """``card`` is redacted whether passed positionally or by keyword; the rest stays."""
    assert redact_call(SIG, [SECRET, 1000], {}, ["card"]) == ([REDACTED, 1000], {})
    assert redact_call(SIG, [], {"card": SECRET, "amount_cents": 5}, ["card"]) == (
        [], {"card": REDACTED, "amount_cents": 5})


def test_nested_keys_envelope_and_unbindable_calls() -> None:
    """Dict values under a listed key are redacted at any depth; sagaworker's envelope is
    kept; arguments that do not bind (or no signature) hide every positional argument."""
    env = {"saga_id": "s-1", "seq": 1}
    args, kwargs = redact_call(SIG, [SECRET, 1, {"card": SECRET}],
                               {"meta": [{"card": SECRET, "ok": 1}], ENVELOPE: env}, ["card"])
    assert args == [REDACTED, 1, {"card": REDACTED}]
    assert kwargs == {"meta": [{"card": REDACTED, "ok": 1}], ENVELOPE: env}

    def two(a: str, b: str) -> None: ...

    assert redact_call(inspect.signature(two), [SECRET, "x", "y"], {}, ["card"]) == (
        [REDACTED] * 3, {})
    assert redact_call(None, [SECRET, 5], {"card": SECRET, "n": 1}, ["card"]) == (
        [REDACTED, REDACTED], {"card": REDACTED, "n": 1})
    assert redact_call(SIG, [SECRET], {}, []) == ([SECRET], {})


def test_error_text_scrubs_the_bound_values() -> None:
    """A tool's exception that quotes its card is journaled and logged without it."""
    exc = Declined(f"card {SECRET} declined")
    assert error_text(exc, SIG, [SECRET, 5], {ENVELOPE: {}}, ["card"]) == (
        f"Declined: card {REDACTED} declined")
    assert error_text(exc, SIG, [SECRET, 5], {}, []) == f"Declined: card {SECRET} declined"
    # short values would shred every message: not scrubbed out of free text
    assert secret_values(SIG, ["12", 5], {}, ["card"]) == []


@pytest.mark.parametrize("value", [
    __import__("uuid").UUID("8c2d6a3e-1f4b-4c9a-9b1e-2f3a4b5c6d7e"),
    __import__("decimal").Decimal("123456789.25"),
    __import__("datetime").datetime(2026, 12, 6, 4, 58, 13),
    b"raw-secret-bytes-0001",
], ids=["uuid", "decimal", "datetime", "bytes"])
def test_secret_values_that_are_not_strings_are_scrubbed_from_free_text(value: Any) -> None:
    """A redacted argument that is a UUID, a Decimal, a datetime or bytes is scrubbed
    from an error's text however the text quotes it (str, repr, ISO form)."""
    import inspect as _inspect

    def tool(token: Any, n: int) -> None: ...

    sig = _inspect.signature(tool)
    quoted = [str(value), repr(value)]
    if hasattr(value, "isoformat"):
        quoted.append(value.isoformat())
    for text in quoted:
        out = error_text(ValueError(f"refused {text} now"), sig, [value, 5], {}, ["token"])
        assert out.startswith("ValueError: refused ") and "now" in out
        assert str(value) not in out and text not in out, out


# -- a Sagaworker with SAGAWORKER_REDACT=card ---------------------------------------------


@pytest.fixture
def red_sw(tmp_path: Path) -> Iterator[Sagaworker]:
    """A Sagaworker on SQLite whose tasks run inline (eager), redacting ``card``."""
    app = Celery("redact", broker="memory://")
    app.conf.task_always_eager = True
    s = Settings(database_url=f"sqlite:///{tmp_path / 'j.db'}", broker_url="memory://",
                 approval_secret="unit-secret-" + "u" * 32, broker_folder=str(tmp_path / "b"),
                 redact="card", compensation_retries=0, compensation_backoff=0,
                 sweep_interval=0)
    sw = Sagaworker(app, settings=s)

    @sw.tool(compensable_by="refund")
    def charge(card: str, amount_cents: int) -> str:
        if card.startswith("declined"):
            raise Declined(f"card {card} declined for {amount_cents} cents")
        return f"ch-{card}"

    @sw.compensation
    def refund(ctx: CompensationContext) -> None:
        pass

    @sw.tool(compensable_by="unhold")
    def hold(card: str) -> str:
        return "held"

    @sw.compensation
    def unhold(ctx: CompensationContext) -> None:
        raise RuntimeError(f"the bank kept the hold on card {ctx.args[0]}")

    sw.validate()
    yield sw


def charge_of(sw: Sagaworker) -> Any:
    return next(s.task for s in sw.registry.tools.values() if s.name.endswith(".charge"))


def test_step_intent_is_redacted_positional_and_keyword(red_sw: Sagaworker) -> None:
    """The producer's ``step_intent`` never carries the card, however it was passed."""
    red_sw.app.conf.task_always_eager = False
    charge = charge_of(red_sw)
    saga = red_sw.begin("o-1")
    with capture_logs() as logs:
        saga.enqueue(charge, SECRET, 100)
        saga.enqueue(charge, card=SECRET, amount_cents=100)
    assert [e["event"] for e in logs] == ["step_intent", "step_intent"]
    assert logs[1]["kwargs"] == {"card": REDACTED, "amount_cents": 100}
    assert SECRET not in repr(logs)
    entries = red_sw.inspect("o-1").entries
    assert (entries[0].args, entries[1].kwargs["card"]) == ([SECRET, 100], SECRET)


def test_an_app_that_configured_structlog_itself_still_gets_redaction(
        red_sw: Sagaworker) -> None:
    """Redaction does not depend on sagaworker's chain: our logger redacts first."""
    red_sw.app.conf.task_always_eager = False
    buf = io.StringIO()
    old = structlog.get_config()
    structlog.configure(processors=[structlog.processors.JSONRenderer()],
                        logger_factory=structlog.PrintLoggerFactory(file=buf))
    try:
        saga = red_sw.begin("o-2")
        saga.enqueue(charge_of(red_sw), card=SECRET, amount_cents=1)
        structlog.get_logger("sagaworker").info("x")  # the app's own chain is in use
    finally:
        structlog.configure(**old)
    out = buf.getvalue()
    assert "step_intent" in out and REDACTED in out and SECRET not in out


def test_published_messages_carry_redacted_argsrepr(red_sw: Sagaworker) -> None:
    """Celery's argsrepr/kwargsrepr (the task events, Flower, ``celery inspect``) are
    redacted on every publish, a retry's included; the body keeps the real values."""
    red_sw.app.conf.task_always_eager = False
    seen: list[tuple[Any, dict[str, Any]]] = []

    def spy(body: Any = None, headers: Any = None, **_: Any) -> None:
        seen.append((body, dict(headers)))

    signals.before_task_publish.connect(spy, weak=False, dispatch_uid="redact-spy")
    try:
        charge = charge_of(red_sw)
        red_sw.begin("o-3").enqueue(charge, SECRET, 7)
        # a publish that passes no argsrepr (a Celery retry, say) is redacted too
        charge.apply_async(args=[SECRET, 7], kwargs={ENVELOPE: {"saga_id": "o-3", "seq": 9}})
    finally:
        signals.before_task_publish.disconnect(dispatch_uid="redact-spy")
    assert len(seen) == 2
    for body, headers in seen:
        assert body[0] == [SECRET, 7]
        assert SECRET not in headers["argsrepr"] + headers["kwargsrepr"]
        assert REDACTED in headers["argsrepr"] and ENVELOPE in headers["kwargsrepr"]


def test_a_failing_tool_journals_its_error_without_the_secret(red_sw: Sagaworker) -> None:
    """The error text (``step_failed``, the saga's reason) loses the card; the journal
    keeps the real arguments, which the undo needs."""
    charge = charge_of(red_sw)
    card = f"declined-{SECRET}"
    with capture_logs() as logs:
        res = red_sw.saga("o-4", lambda s: s.call(charge, card, 100), timeout=20)
    assert res.status is SagaStatus.COMPENSATED
    rec = red_sw.inspect("o-4")
    assert rec.entries[0].args == [card, 100]
    assert rec.entries[0].error == f"Declined: card {REDACTED} declined for 100 cents"
    assert card not in (rec.reason or "") and REDACTED in (rec.reason or "")
    assert card not in repr(logs) and SECRET not in repr(logs)
    failed = [e for e in logs if e["event"] == "step_failed"]
    assert failed and REDACTED in failed[0]["error"]


def test_a_failing_undo_journals_and_pages_its_error_without_the_secret(
        red_sw: Sagaworker) -> None:
    """An undo raising with the card in its message: the detail journaled with its
    COMPENSATION_FAILED, ``compensation_failed`` (the page) and the retry's line lose the
    card (they held it in clear, even with encryption on)."""
    hold = next(s.task for s in red_sw.registry.tools.values() if s.name.endswith(".hold"))
    charge = charge_of(red_sw)

    def work(s: Any) -> None:
        s.call(hold, SECRET)
        s.call(charge, f"declined-{SECRET}", 1)

    with capture_logs() as logs:
        res = red_sw.saga("o-undo", work, timeout=20)
    assert res.status is SagaStatus.COMPENSATION_FAILED
    row = red_sw.journal.entry_row("o-undo", 1)
    assert row.compensation_detail == f"RuntimeError: the bank kept the hold on card {REDACTED}"
    failed = [e for e in logs if e["event"] == "compensation_failed"]
    assert [e["detail"] for e in failed] == [row.compensation_detail]
    assert SECRET not in repr(logs)


# -- records shown to people: CLI tables, --json, the API ---------------------------------


def test_cli_tables_and_json_are_redacted(red_sw: Sagaworker) -> None:
    """``show``/``list`` tables and ``--json`` print the redacted form."""
    charge = charge_of(red_sw)
    red_sw.saga("o-5", lambda s: s.call(charge, SECRET, 1), timeout=20)
    red_sw.saga("o-6", lambda s: s.call(charge, card=f"declined-{SECRET}", amount_cents=1),
                timeout=20)
    red = Redaction.of(red_sw)
    recs = [red_sw.inspect("o-5"), red_sw.inspect("o-6")]
    assert recs[0].entries[0].result == f"ch-{SECRET}"  # the journal: real values
    out = to_json(recs, red)
    assert SECRET not in out and REDACTED in out
    assert json.loads(out)[0]["entries"][0]["result"] == f"ch-{REDACTED}"
    with console.capture() as cap:
        for r in recs:
            render_saga(r, red)
        render_sagas(recs, red)
    assert SECRET not in cap.get() and "REDACTED" in cap.get()
    # without an explicit Redaction: what this process's Sagaworker configured
    assert SECRET not in to_json(recs) and SECRET not in to_json(recs[0].entries)


def test_api_and_dashboard_are_redacted(red_sw: Sagaworker) -> None:
    """The JSON API and the dashboard never show a redacted argument or its value."""
    from sagaworker.web import WebAuth, create_app

    charge = charge_of(red_sw)
    red_sw.saga("o-7", lambda s: s.call(charge, SECRET, 1), timeout=20)
    app = create_app(red_sw, auth=WebAuth(anonymous_reads=True))
    app.testing = True
    client = app.test_client()
    for url in ("/sagas/o-7", "/sagas", "/", "/ui/sagas/o-7"):
        resp = client.get(url)
        assert resp.status_code == 200, url
        assert SECRET not in resp.get_data(as_text=True), url
    assert client.get("/sagas/o-7").get_json()["entries"][0]["args"] == [REDACTED, 1]


def test_celery_inspect_shows_only_the_redacted_repr(red_sw: Sagaworker) -> None:
    """A tool task's worker request answers ``celery inspect active/reserved`` (and so
    Flower's worker pages) with the redacted argsrepr, never the real arguments."""
    from kombu.message import Message

    charge = charge_of(red_sw)
    assert charge.Request == "sagaworker._observe.celery_logs:RedactedRequest"
    argsrepr, kwargsrepr = _redact.call_reprs(SIG, [SECRET, 5], {ENVELOPE: {}}, ["card"])
    tm = red_sw.app.amqp.as_task_v2("id-1", charge.name, args=[SECRET, 5],
                                    kwargs={ENVELOPE: {}}, argsrepr=argsrepr,
                                    kwargsrepr=kwargsrepr)
    msg = Message(body=json.dumps(tm.body), headers=tm.headers, delivery_info={},
                  content_type="application/json", content_encoding="utf-8")
    req = RedactedRequest(msg, app=red_sw.app, task=charge)
    assert req.args == [SECRET, 5]  # the tool gets the real values
    for info in (req.info(), req.info(safe=False)):
        assert SECRET not in repr(info) and info["args"] == argsrepr


# -- Celery's own log lines: the logging filter ---------------------------------------------


class Msg:
    body = json.dumps([[SECRET, 3], {"card": SECRET, "n": 1}, {"callbacks": None}]).encode()


@pytest.fixture
def keys() -> Iterator[None]:
    process.register(["card"])
    celery_logs.install_celery_filters()
    yield


def test_unknown_and_invalid_task_errors_lose_the_body_secrets(
        keys: None, caplog: pytest.LogCaptureFixture) -> None:
    """Celery prints a whole message body at ERROR for an unknown or invalid task: with
    no signature to bind, every positional argument is redacted, keywords by name."""
    log = logging.getLogger("celery.worker.consumer.consumer")
    headers = {"task": "no.such.task", "argsrepr": repr([SECRET, 3]),
               "kwargsrepr": repr({"card": SECRET, "n": 1})}
    with caplog.at_level(logging.DEBUG):
        try:
            raise KeyError("no.such.task")
        except KeyError as exc:
            log.error(UNKNOWN_TASK_ERROR, exc, dump_body(Msg, None), headers, {}, exc_info=True)
        try:  # an error whose text quotes the body: its values are scrubbed out of it
            raise ValueError(f"cannot handle {SECRET!r}")
        except ValueError as exc:
            log.error(INVALID_TASK_ERROR, exc, dump_body(Msg, None), exc_info=True)
        big = type("Big", (), {"body": json.dumps([[SECRET * 100], {}, {}]).encode()})
        log.error(INVALID_TASK_ERROR, "bad", dump_body(big, None))  # truncated: withheld
    assert SECRET not in caplog.text
    assert "Received unregistered task of type" in caplog.text
    assert '"n": 1' in caplog.text and "message body withheld" in caplog.text


def test_debug_taskpool_apply_line_loses_the_body(
        keys: None, caplog: pytest.LogCaptureFixture) -> None:
    """The DEBUG ``TaskPool: Apply`` line prints the raw body: withheld."""
    pool = BasePool(1)
    pool._does_debug = True
    with caplog.at_level(logging.DEBUG, logger="celery.pool"):
        pool.apply_async(print, args=("t.charge", "id-1", {}, Msg.body, "application/json",
                                      "utf-8"))
    assert "TaskPool: Apply" in caplog.text and SECRET not in caplog.text


def test_running_task_values_are_scrubbed_from_any_line_and_traceback(
        keys: None, caplog: pytest.LogCaptureFixture) -> None:
    """While a tool runs, its secret values leave no trace in Celery's failure line,
    its traceback, or any other line of the process."""
    process.hold("task-1", secret_values(SIG, [SECRET, 1], {}, ["card"]))
    log = logging.getLogger("celery.app.trace")
    try:
        with caplog.at_level(logging.INFO):
            try:
                raise Declined(f"card {SECRET} declined")
            except Declined as exc:
                log.error("Task %(name)s[%(id)s] %(description)s: %(exc)s",
                          {"name": "t.charge", "id": "task-1", "description": "raised",
                           "exc": repr(exc), "args": repr([SECRET]), "kwargs": "{}"},
                          exc_info=True)
            logging.getLogger("celery.redirected").warning("print %s", SECRET)
    finally:
        process.release("task-1")
    assert "raised: Declined" in caplog.text and SECRET not in caplog.text
    assert all(SECRET not in repr(r.args) for r in caplog.records)


def test_configure_logging_scrubs_tracebacks_and_structured_fields(keys: None) -> None:
    """The worker's JSON lines: keys redacted, running values scrubbed (tracebacks too)."""
    buf = io.StringIO()
    configure_logging(fmt="json", level="INFO", redact_keys=["card"], stream=buf)
    process.hold("task-2", [SECRET])
    try:
        try:
            raise Declined(f"card {SECRET} declined")
        except Declined:
            logging.getLogger("celery.app.trace").exception("boom")
        structlog.get_logger("sagaworker").warning("step_failed", error=f"x {SECRET}",
                                                   card=SECRET)
        process.release("task-2")
        try:  # no task holds it now: the unknown body's own values are scrubbed
            raise ValueError(f"cannot handle {SECRET!r}")
        except ValueError as exc:
            logging.getLogger("celery.worker.consumer.consumer").error(
                INVALID_TASK_ERROR, exc, dump_body(Msg, None), exc_info=True)
    finally:
        process.release("task-2")
        logging.getLogger().handlers.clear()
    out = buf.getvalue()
    lines = [json.loads(x) for x in out.splitlines()]
    assert SECRET not in out and len(lines) == 3
    assert "exception" in lines[0] and "exception" in lines[2]
    assert "ValueError: cannot handle" in lines[2]["exception"]
    assert lines[1]["card"] == REDACTED


def test_a_journal_error_quotes_neither_its_parameters_nor_its_detail(tmp_path: Path) -> None:
    """A failing journal statement's error (which reaches log lines) does not carry the
    values bound to it, and a logged error keeps only its first line (a driver's DETAIL
    line quotes a key's value)."""
    from sqlalchemy import text
    from sqlalchemy.exc import OperationalError

    from sagaworker import make_engine
    from sagaworker._worker.eager import brief

    card = "4000123412341234"
    engine = make_engine(f"sqlite:///{tmp_path / 'x.db'}")
    with pytest.raises(OperationalError) as err, engine.connect() as conn:
        conn.execute(text("SELECT nope FROM nowhere WHERE x = :card"), {"card": card})
    assert "nowhere" in str(err.value) and card not in str(err.value)
    assert brief(err.value) == "OperationalError: no such table: nowhere"
    detailed = ValueError(f"duplicate key\nDETAIL:  Key (card)=({card}) already exists.")
    assert brief(detailed) == "ValueError: duplicate key"


def test_an_approver_sees_a_fingerprint_of_each_redacted_argument(tmp_path: Path) -> None:
    """A gated step's redacted argument shows, to its approver, as its last characters
    and a fingerprint keyed with the approval secret: the same card, the same mark; another
    card, another mark; never the value (and nothing at all of a short one)."""
    import re

    from sagaworker import Redaction, Reversibility

    sw = Sagaworker(Celery("approver", broker="memory://"), settings=Settings(
        database_url=f"sqlite:///{tmp_path / 'j.db'}", broker_url="memory://",
        approval_secret="unit-secret-" + "u" * 32, redact="card,pin",
        broker_folder=str(tmp_path / "b")))
    sw.rt.bus.publish_step = lambda *a, **k: True  # type: ignore[method-assign]

    @sw.tool(reversibility=Reversibility.IRREVERSIBLE)
    def pay_out(card: str, amount: int, pin: str = "") -> str:
        return "paid"

    sw.journal.create_all()
    for sid, card in (("a-1", "4111111111111111"), ("a-2", "4111111111111111"),
                      ("a-3", "5500000000000004")):
        sw.begin(sid).enqueue(pay_out, card, 5, pin="1234")
    red = Redaction.of(sw)
    shown = {r.saga_id: red.approval(r) for r in sw.pending_approvals()}
    marks = {sid: a.args[0] for sid, a in shown.items()}
    assert re.fullmatch(r"\[REDACTED …1111 #[0-9a-f]{8}\]", marks["a-1"]), marks
    assert marks["a-1"] == marks["a-2"] != marks["a-3"]
    assert marks["a-3"].startswith("[REDACTED …0004 #")
    assert re.fullmatch(r"\[REDACTED #[0-9a-f]{8}\]", shown["a-1"].kwargs["pin"])
    assert shown["a-1"].args[1] == 5
    assert "4111111111111111" not in repr(shown) and "1234" not in repr(shown)
