"""Where the log lives: the default data directory, URL normalisation, password masking."""

from __future__ import annotations

import os
from pathlib import Path

import platformdirs
import sqlalchemy as sa

DEFAULT_FILE = "kvledger.sqlite"


def data_dir() -> Path:
    """$KVLEDGER_DATA_DIR, else the platform's user data directory for kvledger."""
    configured = os.environ.get("KVLEDGER_DATA_DIR")
    return Path(configured) if configured else Path(platformdirs.user_data_dir("kvledger"))


def normalize(url: str | None) -> sa.URL:
    """A SQLAlchemy async URL for a path, a sqlite:// or a postgresql:// URL (None: default)."""
    if not url:
        url = str(data_dir() / DEFAULT_FILE)
    if "://" not in url:
        return sa.make_url(f"sqlite+aiosqlite:///{Path(url).expanduser().resolve()}")
    parsed = sa.make_url(url)
    if parsed.get_backend_name() == "sqlite":
        return parsed.set(drivername="sqlite+aiosqlite")
    if parsed.get_backend_name() == "postgresql":
        return parsed.set(drivername="postgresql+asyncpg")
    raise ValueError(f"unsupported log URL {mask(url)!r}: use a file path, sqlite:// or postgresql://")


def mask(url: str | sa.URL) -> str:
    """The URL with any password replaced by ***."""
    try:
        parsed = url if isinstance(url, sa.URL) else sa.make_url(url)
    except sa.exc.ArgumentError:
        return "<unparseable URL>"
    return parsed.render_as_string(hide_password=True)
