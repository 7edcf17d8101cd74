"""Text no journal can hold (a NUL, a lone surrogate) in ids, values and reasons: a
BadInput naming the field, never a raw database or encoding error; nothing journaled."""

from __future__ import annotations

from pathlib import Path

import pytest

from sagaworker import BadInput, Sagaworker


def test_saga_ids_with_a_lone_surrogate_or_a_nul_are_refused_naming_the_id(
        sqlite_sw: Sagaworker) -> None:
    """begin/inspect/get/abort of such an id: BadInput naming the saga id."""
    with pytest.raises(BadInput, match=r"saga id .*lone surrogate"):
        sqlite_sw.begin("a\ud800b")
    for call in (sqlite_sw.inspect, sqlite_sw.get):
        with pytest.raises(BadInput, match=r"saga id .*NUL"):
            call("a\x00b")
        with pytest.raises(BadInput, match=r"saga id .*lone surrogate"):
            call("a\udfffb")
    assert sqlite_sw.sagas() == []


def test_values_with_a_lone_surrogate_are_refused_and_nothing_is_journaled(
        sqlite_sw: Sagaworker) -> None:
    """Metadata, an argument, a nested key: BadInput naming what holds it."""
    @sqlite_sw.tool()
    def note(text: str, extra: dict | None = None) -> str:
        return text

    with pytest.raises(BadInput, match=r"metadata .*lone surrogate"):
        sqlite_sw.begin("s-1", metadata={"who": "x\ud800"})
    saga = sqlite_sw.begin("s-2")
    with pytest.raises(BadInput, match="argument 'text' holds a string with a lone surrogate"):
        saga.enqueue(note, "x\ud800")
    with pytest.raises(BadInput, match="dict key with a lone surrogate"):
        saga.enqueue(note, "x", extra={"k\udc00": 1})
    assert sqlite_sw.inspect("s-2").entries == []
    assert [r.saga_id for r in sqlite_sw.sagas()] == ["s-2"]


def test_free_text_with_a_lone_surrogate_is_stored_escaped_or_refused(
        sqlite_sw: Sagaworker) -> None:
    """A failure reason is kept, escaped; an actor or approver is refused by name."""
    saga = sqlite_sw.begin("s-3")
    with pytest.raises(BadInput, match="the actor holds a lone surrogate"):
        sqlite_sw.abort("s-3", reason="r", actor="op\ud800")
    saga.fail("broken \ud800 text")
    assert sqlite_sw.journal.saga_row("s-3").reason == "broken \\ud800 text"


def test_an_unknown_status_filter_is_bad_input(sqlite_sw: Sagaworker) -> None:
    """``sw.sagas(status=...)`` with no such status names the statuses there are."""
    with pytest.raises(BadInput, match="RUNNING"):
        sqlite_sw.sagas(status="RUN\x00")


def test_the_api_answers_400_for_an_id_no_saga_can_have(tmp_path: Path) -> None:
    """``GET /sagas/<id with a NUL>``: 400 naming the id, not a 500."""
    from sagaworker.web import WebAuth, create_app
    from tests.web.journal import make_sw

    sw, _ = make_sw(tmp_path / "j.db")
    client = create_app(sw, auth=WebAuth(anonymous_reads=True)).test_client()
    for raw in ("a%00b", "a%ED%A0%80b"):
        resp = client.get(f"/sagas/{raw}", headers={"Accept": "application/json"})
        assert resp.status_code in (400, 404), resp.data
        assert resp.status_code != 500
    resp = client.get("/sagas/a%00b", headers={"Accept": "application/json"})
    assert resp.status_code == 400 and "saga id" in resp.get_json()["error"]


def test_abort_of_an_id_no_saga_can_have_is_bad_input(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``sw.abort``, ``POST /sagas/<id>/abort`` and ``sagaworker abort`` of an id with a NUL
    or a lone surrogate: BadInput naming the id (the API's 400, the CLI's error line),
    never a raw database or encoding error (a 500, a traceback)."""
    from click.testing import CliRunner

    from sagaworker.cli.commands import main
    from sagaworker.web import WebAuth, create_app
    from sagaworker.web.auth import hash_token
    from tests.web.journal import make_sw

    sw, _ = make_sw(tmp_path / "j.db")
    with pytest.raises(BadInput, match=r"^saga id 'a\\x00b' holds a NUL character: no saga "):
        sw.abort("a\x00b", reason="stop", actor="op")
    with pytest.raises(BadInput, match=r"^saga id 'a\\ud800b' holds a lone surrogate"):
        sw.abort("a\ud800b", reason="stop", actor="op")
    token = "t" * 40
    client = create_app(sw, auth=WebAuth(tokens=[("op", hash_token(token))])).test_client()
    resp = client.post("/sagas/a%00b/abort", json={"reason": "stop"},
                       headers={"Authorization": f"Bearer {token}"})
    assert (resp.status_code, resp.get_json()["error"]) == (
        400, "saga id 'a\\x00b' holds a NUL character: no saga has such an id; check it")
    db = f"sqlite:///{tmp_path / 'j.db'}"
    (tmp_path / "abortapp.py").write_text(
        "from celery import Celery\nfrom sagaworker import Sagaworker\n"
        f"sw = Sagaworker(Celery('a', broker='memory://'), database_url={db!r})\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    got = CliRunner().invoke(main, ["-A", "abortapp", "abort", "a\udcffb", "--reason", "stop",
                                    "--actor", "op"])
    assert (got.exit_code, got.output) == (
        1, "error: saga id 'a\\udcffb' holds a lone surrogate (not valid Unicode): no saga "
           "has such an id; check it\n")


@pytest.mark.parametrize("bad", ["a\x85b", "csi\x9b2J", "a\x80", "\x9f"])
def test_ids_with_a_c1_control_character_are_refused(sqlite_sw: Sagaworker, bad: str) -> None:
    """A C1 control character (U+0080 to U+009F: NEL, a terminal's CSI) in a saga id, a
    tool-call id or a patch id is refused as C0 ones are: a terminal that shows the id
    would act on it."""
    from sagaworker._base.patches import PatchMarker

    @sqlite_sw.tool()
    def note(text: str) -> str:
        return text

    with pytest.raises(BadInput, match=r"^saga id .* holds a control character"):
        sqlite_sw.begin(bad)
    saga = sqlite_sw.begin("s-c1")
    with pytest.raises(BadInput, match=r"^call id .* holds a control character"):
        saga.enqueue_call(bad, note, ("x",))
    with pytest.raises(BadInput, match=r"^patch id .* holds a control character"):
        PatchMarker(bad)
    assert [r.saga_id for r in sqlite_sw.sagas()] == ["s-c1"]
    assert sqlite_sw.inspect("s-c1").entries == []
