"""A database URL as every message shows it: each form of its password masked (the
userinfo's, one after an unescaped ``@``, ``?password=``, ``?sslpassword=``), and no piece
of it left in a "cannot reach" line."""

from __future__ import annotations

import pytest

from sagaworker._journal.readiness import masked, unreachable


@pytest.mark.parametrize(("url", "shown"), [
    ("postgresql+psycopg://shop:hunter2@db:5432/shop",
     "postgresql+psycopg://shop:***@db:5432/shop"),
    ("postgresql+psycopg://shop@db/shop?password=hunter2",
     "postgresql+psycopg://shop@db/shop?password=***"),
    ("postgresql+psycopg://shop@db/shop?sslmode=verify-full&sslpassword=hunter2",
     "postgresql+psycopg://shop@db/shop?sslmode=verify-full&sslpassword=***"),
    ("postgresql+psycopg://shop:hun@ter2@db/shop", "postgresql+psycopg://shop:***@db/shop"),
    ("postgresql+psycopg://shop:hun%40ter2@db/shop", "postgresql+psycopg://shop:***@db/shop"),
    ("postgresql+psycopg://db/shop?user=shop&PASSWORD=hunter2&password=hunter3",
     "postgresql+psycopg://db/shop?user=shop&PASSWORD=***&password=***"),
    ("mysql+pymysql://shop@db/shop?passwd=hunter2", "mysql+pymysql://shop@db/shop?passwd=***"),
    ("postgresql+psycopg://shop@db/shop", "postgresql+psycopg://shop@db/shop"),
    ("sqlite:///./sagaworker.db", "sqlite:///./sagaworker.db"),
])
def test_every_password_form_is_masked(url: str, shown: str) -> None:
    """The URL keeps what tells a reader which database it is; no password survives."""
    assert masked(url) == shown


def test_a_cannot_reach_line_quotes_no_piece_of_the_password() -> None:
    """An unescaped ``@`` made the driver resolve the password's tail as a host, and its
    error quoted it: scrubbed from the line too."""
    url = "postgresql+psycopg://shop:hun@ter2-x@db/shop?sslpassword=key-pass-9"
    err = OSError("failed to resolve host 'ter2-x@db' (sslpassword=key-pass-9)")
    assert str(unreachable(url, err)) == (
        "cannot reach the journal database postgresql+psycopg://shop:***@db/shop"
        "?sslpassword=*** (failed to resolve host '***@db' (sslpassword=***)); check "
        "SAGAWORKER_DATABASE_URL (or the database_url your Sagaworker is given) and that the "
        "server accepts connections")
