"""Alembic, run from the package: ``sagaworker db upgrade``."""

from __future__ import annotations

from pathlib import Path

from alembic import command
from alembic.config import Config

from .dialect import normalize_url

__all__ = ["alembic_config", "upgrade"]

HERE = Path(__file__).parent / "migrations"


def alembic_config(database_url: str) -> Config:
    cfg = Config()
    cfg.set_main_option("script_location", str(HERE))
    cfg.set_main_option("sqlalchemy.url", normalize_url(database_url).replace("%", "%%"))
    return cfg


def upgrade(database_url: str, revision: str = "head") -> None:
    command.upgrade(alembic_config(database_url), revision)
