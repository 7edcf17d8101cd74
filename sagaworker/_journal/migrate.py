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
    url = normalize_url(database_url)
    if url.startswith("sqlite"):
        # a journal `db upgrade` creates is its owner's only (0600), as the journal's own
        # engine makes it: Alembic's engine would create it with the umask's mode (0644)
        from sqlalchemy.engine import make_url

        from .dialect import private_file

        private_file(make_url(url).database)
    command.upgrade(alembic_config(database_url), revision)
