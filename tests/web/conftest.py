"""Fixtures: a Sagaworker on a temporary SQLite journal and the webapp over it."""

from __future__ import annotations

from pathlib import Path

import pytest
from flask import Flask
from flask.testing import FlaskClient

from sagaworker import Sagaworker
from tasks.web import create_app

from .journal import ALICE_TOKEN, BOB_TOKEN, Tools, make_sw, operators, order_flow


@pytest.fixture
def journal(tmp_path: Path) -> tuple[Sagaworker, Tools]:
    return make_sw(tmp_path / "journal.db")


@pytest.fixture
def sw(journal: tuple[Sagaworker, Tools]) -> Sagaworker:
    return journal[0]


@pytest.fixture
def tools(journal: tuple[Sagaworker, Tools]) -> Tools:
    return journal[1]


@pytest.fixture
def app(sw: Sagaworker) -> Flask:
    """The app with two operators, alice and bob (bearer tokens)."""
    app = create_app(sw, flow=order_flow, auth=operators())
    app.testing = True
    return app


@pytest.fixture
def client(app: Flask) -> FlaskClient:
    """An anonymous client."""
    return app.test_client()


def _as(app: Flask, token: str) -> FlaskClient:
    c = app.test_client()
    c.environ_base["HTTP_AUTHORIZATION"] = f"Bearer {token}"
    return c


@pytest.fixture
def alice(app: Flask) -> FlaskClient:
    """A client sending alice's operator token with every request."""
    return _as(app, ALICE_TOKEN)


@pytest.fixture
def bob(app: Flask) -> FlaskClient:
    return _as(app, BOB_TOKEN)
