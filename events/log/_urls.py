"""Where the log lives: the default data directory, URL normalisation, password masking."""

from __future__ import annotations

import os
import urllib.parse
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
    if is_kafka(url):
        raise ValueError(f"{mask(url)!r} is a Kafka log: it has no SQL URL (open it with open_log)")
    raise ValueError(f"unsupported log URL {mask(url)!r}: use a file path, sqlite://, postgresql:// or kafka://")


def is_kafka(url: str | None) -> bool:
    """Whether `url` names a Kafka log (kafka://HOST:PORT/TOPIC), which normalize does not take."""
    return bool(url) and str(url).startswith("kafka://")


def mask(url: str | sa.URL) -> str:
    """The URL with any password replaced by ***."""
    if isinstance(url, str) and is_kafka(url):
        parts = urllib.parse.urlsplit(url)
        if parts.password is not None:
            hosts = parts.netloc.rsplit("@", 1)[1]
            parts = parts._replace(netloc=f"{parts.username}:***@{hosts}")
        pairs = urllib.parse.parse_qsl(parts.query, keep_blank_values=True)
        if any(key == "state" and "://" in value for key, value in pairs):  # ?state=postgresql://user:pw@...
            masked = [(key, mask(value) if key == "state" and "://" in value else value) for key, value in pairs]
            parts = parts._replace(query=urllib.parse.urlencode(masked, safe=":/@*"))
        return urllib.parse.urlunsplit(parts)
    try:
        parsed = url if isinstance(url, sa.URL) else sa.make_url(url)
    except sa.exc.ArgumentError:
        return "<unparseable URL>"
    return parsed.render_as_string(hide_password=True)
