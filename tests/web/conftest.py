"""Fixtures: a Sagaworker on a temporary SQLite journal and the webapp over it."""

from __future__ import annotations

from pathlib import Path

import pytest
from flask import Flask
from flask.testing import FlaskClient

from sagaworker import Sagaworker
from webapp import create_app

from .journal import Tools, make_sw, order_flow


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
    app = create_app(sw, flow=order_flow)
    app.testing = True
    return app


@pytest.fixture
def client(app: Flask) -> FlaskClient:
    return app.test_client()
