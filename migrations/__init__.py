"""Alembic migrations for every SQL table of the log. Run them through `upgrade`, which hands
alembic the caller's connection (`kvledger db upgrade` and SQLite's self-upgrade both do)."""

from __future__ import annotations

from pathlib import Path

import sqlalchemy as sa
from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory

LOCATION = Path(__file__).resolve().parent


def config(connection: sa.Connection | None = None) -> Config:
    cfg = Config()
    cfg.set_main_option("script_location", str(LOCATION))
    if connection is not None:
        cfg.attributes["connection"] = connection
    return cfg


def head() -> str:
    revision = ScriptDirectory.from_config(config()).get_current_head()
    assert revision is not None
    return revision


def known(revision: str) -> bool:
    try:
        return ScriptDirectory.from_config(config()).get_revision(revision) is not None
    except Exception:  # noqa: BLE001 - alembic raises several kinds for an unknown id
        return False


def current(connection: sa.Connection) -> str | None:
    """The revision the database is at; None for an empty database."""
    return MigrationContext.configure(connection).get_current_revision()


def upgrade(connection: sa.Connection, revision: str = "head") -> None:
    command.upgrade(config(connection), revision)


def downgrade(connection: sa.Connection, revision: str) -> None:
    command.downgrade(config(connection), revision)
