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
    from sagaworker.web import create_app
    from tests.web.journal import make_sw

    sw, _ = make_sw(tmp_path / "j.db")
    client = create_app(sw).test_client()
    for raw in ("a%00b", "a%ED%A0%80b"):
        resp = client.get(f"/sagas/{raw}", headers={"Accept": "application/json"})
        assert resp.status_code in (400, 404), resp.data
        assert resp.status_code != 500
    resp = client.get("/sagas/a%00b", headers={"Accept": "application/json"})
    assert resp.status_code == 400 and "saga id" in resp.get_json()["error"]
