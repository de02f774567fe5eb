"""Opening a log that must already exist: for forensics (the audit, verify, export, replay,
timeline and namespace commands) and for the fleet audit service. Never creating one, and never
writing next to what --log names: a missing SQLite file, a file that is not a log, a Kafka topic
that is not there are errors that name it."""

from __future__ import annotations

import logging
import urllib.parse
from pathlib import Path

import anyio
from aiokafka.admin import AIOKafkaAdminClient  # type: ignore[import-untyped]
from aiokafka.errors import KafkaError  # type: ignore[import-untyped]

from events.log._contract import LogError, LogUnavailable
from events.log._open import check_sqlite_file, open_log
from events.log._sql import SqlEventLog
from events.log._urls import is_kafka, mask, normalize
from events.log.kafka_target import CALL_TIMEOUT_S, REQUEST_TIMEOUT_MS, KafkaTarget, one_line, parse_kafka_url


class BadLogUrl(LogError, ValueError):
    """A Kafka log URL forensics cannot use as given: bad input (the CLI exits 2; commands that
    catch only LogError exit 1)."""


async def open_existing(log_url: str | None, *, read_only: bool = False) -> SqlEventLog:
    """The log to examine. Forensics never creates one: a SQLite file that is not there is an
    error naming the path (a typo must not answer "0 events, all fine"), and one that is not a
    SQLite database is refused before anything opens it (NotALog: `kvledger verify --log
    /etc/passwd` left /etc/passwd.lock). `read_only` (verify, export, a replay that needs no
    index): the file is opened read-only and nothing is created anywhere. A Kafka log's topic must
    exist, and its index lives in its state store (`open_for_audit`)."""
    if is_kafka(log_url):
        return await open_for_audit(str(log_url))
    target = normalize(log_url)
    if target.get_backend_name() == "sqlite" and target.database:
        await check_sqlite_file(Path(target.database))
    return await open_log(log_url, read_only=read_only)


async def open_for_audit(log_url: str) -> SqlEventLog:
    """A Kafka log for forensics: its topic must exist (never created), and the audit index needs
    a state store to live in: `?state=` (the fleet service's database, or a file), or this
    machine's default store for that topic if it exists."""
    try:
        target = parse_kafka_url(log_url)
        check_state_store(target.state_url, "the state store")
    except ValueError as error:
        raise BadLogUrl(f"--log {_shown_url(log_url)}: {error}") from None
    quiet_kafka_client()
    explicit = "state" in urllib.parse.parse_qs(urllib.parse.urlsplit(log_url).query, keep_blank_values=True)
    store = normalize(target.state_url)
    if not explicit and store.get_backend_name() == "sqlite" and not Path(str(store.database)).exists():
        raise BadLogUrl(
            f"--log {shown_target(target)} names no state store for the audit index (and this machine has none at "
            f"{store.database}): add ?state=postgresql://... (the fleet service's --db) or ?state=PATH"
        )
    await require_topic(target)
    return await open_log(log_url)


async def open_fleet_log(url: str) -> SqlEventLog:
    """The Kafka log at `url` (which names its state store), opened only if its topic exists."""
    await require_topic(parse_kafka_url(url))
    return await open_log(url)


def check_state_store(url: str, what: str) -> None:
    """ValueError unless `url` is a PostgreSQL URL, a sqlite:// URL or a file path."""
    try:
        backend = normalize(url).get_backend_name()
    except Exception:  # noqa: BLE001 - normalize's ValueError or SQLAlchemy's ArgumentError: not a database URL
        backend = ""
    if backend not in ("postgresql", "sqlite"):
        raise ValueError(
            f"{what} {mask(url)!r} is not a PostgreSQL or SQLite database (postgresql://..., sqlite:///PATH or a file path)"
        )


async def require_topic(target: KafkaTarget) -> None:
    """LogUnavailable unless a broker answers and the topic exists. Never creates it: opening a
    Kafka log creates a missing topic, and forensics must not create a log."""
    admin = AIOKafkaAdminClient(bootstrap_servers=target.bootstrap, request_timeout_ms=REQUEST_TIMEOUT_MS)
    try:
        with anyio.fail_after(CALL_TIMEOUT_S):
            await admin.start()
            topics = await admin.list_topics()
    except (KafkaError, OSError, TimeoutError) as error:
        raise LogUnavailable(f"cannot reach log {shown_target(target)}: {one_line(error)}") from error
    finally:
        await admin.close()
    if target.topic not in topics:
        raise LogUnavailable(
            f"no topic {target.topic!r} on {','.join(target.bootstrap)}: no Kafka log there (nothing is created)"
        )


def quiet_kafka_client() -> None:
    """aiokafka logs each failed connection attempt itself (stdlib logging, several lines): the
    errors that matter reach kvledger's own one-line messages and structured logs instead."""
    logging.getLogger("aiokafka").setLevel(logging.CRITICAL)


def shown_target(target: KafkaTarget) -> str:
    """The log's brokers and topic, without the query (its state store URL may hold a password)."""
    return f"kafka://{','.join(target.bootstrap)}/{target.topic}"


def _shown_url(url: str) -> str:
    parts = urllib.parse.urlsplit(url)
    return f"kafka://{parts.netloc.rsplit('@', 1)[-1]}{parts.path}"
