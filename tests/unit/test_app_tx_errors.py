"""``connection=`` on the app's own engine: an error of a journal statement run on it
quotes none of the statement's parameters (a tool's arguments: a card)."""

from __future__ import annotations

import pytest
from sqlalchemy import create_engine, text
from sqlalchemy.exc import StatementError
from sqlalchemy.orm import Session

from sagaworker import Sagaworker


def test_a_journal_error_on_the_apps_engine_hides_its_parameters(
        sqlite_sw: Sagaworker) -> None:
    """The app's engine shows parameters in its errors; the journal's write on it fails
    (its table is gone in this transaction): the error names the statement, not the card."""
    @sqlite_sw.tool()
    def charge(card: str, amount: int) -> str:
        return "ok"

    sqlite_sw.journal.create_all()
    app_engine = create_engine(sqlite_sw.settings.database_url)
    try:
        with Session(app_engine) as s:
            saga = sqlite_sw.begin("o-1", connection=s)
            s.execute(text("DROP TABLE sagaworker_entries"))
            with pytest.raises(StatementError) as err:
                saga.enqueue(charge, "4111111111111111", 500, connection=s)
            s.rollback()
    finally:
        app_engine.dispose()
    assert "sagaworker_entries" in str(err.value)
    assert "4111111111111111" not in str(err.value)
