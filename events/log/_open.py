"""Opening a log: reach the database, check its schema, upgrade SQLite by itself.

A kafka:// URL opens a KafkaEventLog (events/log/_kafka.py): the topic, plus its SQL state store
(checkpoints, projections, snapshots), which these functions open, check and upgrade as they do
any SQL log."""

from __future__ import annotations

from pathlib import Path

import anyio
import filelock
import sqlalchemy as sa
import structlog
from sqlalchemy.ext.asyncio import AsyncEngine

import migrations
from events.log._contract import LogUnavailable, SchemaMismatch
from events.log._kafka import KafkaEventLog
from events.log._kafka_target import parse_kafka_url, probe
from events.log._sql import SqlEventLog, make_blocking_sqlite_engine, make_engine
from events.log._urls import is_kafka, mask, normalize

log = structlog.get_logger("kvledger.log")


async def _prepare(url: str | None) -> sa.URL:
    """The normalized URL; for SQLite, its directory exists (or LogUnavailable says why).

    Checked before any engine exists: a failed aiosqlite connect leaves a thread behind that can
    outlive its event loop."""
    target = normalize(url)
    if target.get_backend_name() == "sqlite" and target.database:
        try:
            await anyio.to_thread.run_sync(lambda: Path(str(target.database)).parent.mkdir(parents=True, exist_ok=True))
        except OSError as exc:
            raise LogUnavailable(f"cannot open log {mask(target)}: {exc}") from exc
    return target


async def schema_revision(url: str | None) -> tuple[str | None, str]:
    """(the database's revision, this code's head) without changing anything. For a Kafka log:
    its state store's, once a broker has answered."""
    if is_kafka(url):
        kafka = parse_kafka_url(str(url))
        await probe(kafka)
        return await schema_revision(kafka.state_url)
    target = await _prepare(url)
    engine = make_engine(target)
    try:
        async with engine.connect() as conn:
            return await conn.run_sync(migrations.current), migrations.head()
    except (OSError, sa.exc.OperationalError, sa.exc.InterfaceError) as exc:
        raise LogUnavailable(f"cannot reach log {mask(target)}: {_first_line(exc)}") from exc
    finally:
        await engine.dispose()


async def upgrade_log(url: str | None) -> str:
    """Bring the log's schema to head (what `kvledger db upgrade` does); returns the revision.
    For a Kafka log: its state store's, once a broker has answered."""
    if is_kafka(url):
        kafka = parse_kafka_url(str(url))
        await probe(kafka)
        return await upgrade_log(kafka.state_url)
    target = await _prepare(url)
    engine = make_engine(target)
    try:
        await _check_not_newer(engine, target)
        async with engine.begin() as conn:
            await conn.run_sync(migrations.upgrade)
        log.info("log_upgraded", url=mask(target), revision=migrations.head())
        return migrations.head()
    except (OSError, sa.exc.OperationalError, sa.exc.InterfaceError) as exc:
        raise LogUnavailable(f"cannot reach log {mask(target)}: {_first_line(exc)}") from exc
    finally:
        await engine.dispose()


async def open_log(url: str | None = None) -> SqlEventLog:
    """Open the log at `url` (a path, sqlite://, postgresql:// or kafka://; None: the default file).

    SQLite upgrades its own schema under a file lock. PostgreSQL behind head is refused with the
    command to run. A schema newer than this code is refused, naming both revisions. A Kafka log
    opens its state store by these rules, then reads its topic (KafkaEventLog.open): it is a
    SqlEventLog whose SQL side is that store, so this signature holds for every backend."""
    if is_kafka(url):
        kafka = parse_kafka_url(str(url))
        state = await open_log(kafka.state_url)
        try:
            return await KafkaEventLog.open(kafka, state)
        except BaseException:
            with anyio.CancelScope(shield=True):
                await state.close()
            raise
    target = await _prepare(url)
    masked = mask(target)
    engine = make_engine(target)
    try:
        if target.get_backend_name() == "sqlite":
            await _open_sqlite(engine, target)
        else:
            revision = await _check_not_newer(engine, target)
            if revision != migrations.head():
                raise SchemaMismatch(
                    f"log {masked} is at schema {revision or 'none'}, this kvledger needs {migrations.head()}: "
                    f"run `kvledger db upgrade --log {masked}`"
                )
    except (OSError, sa.exc.OperationalError, sa.exc.InterfaceError) as exc:
        await engine.dispose()
        raise LogUnavailable(f"cannot open log {masked}: {_first_line(exc)}") from exc
    except BaseException:
        await engine.dispose()
        raise
    blocking = make_blocking_sqlite_engine(target) if target.get_backend_name() == "sqlite" else None
    return SqlEventLog(engine, masked, blocking)


async def _check_not_newer(engine: AsyncEngine, target: sa.URL) -> str | None:
    async with engine.connect() as conn:
        revision: str | None = await conn.run_sync(migrations.current)
    if revision is not None and not migrations.known(revision):
        raise SchemaMismatch(
            f"log {mask(target)} was written by a newer kvledger (schema {revision}); "
            f"this one knows up to {migrations.head()}"
        )
    return revision


async def _open_sqlite(engine: AsyncEngine, target: sa.URL) -> None:
    """Check the schema and upgrade it if it is behind, holding a file lock from before the first
    connection: several openers of one new file (tasks or processes) would otherwise race on
    switching it to WAL and creating the tables ("database is locked")."""
    # Not thread-local: acquire and release run in whichever worker threads anyio picks.
    lock = filelock.FileLock(f"{target.database}.lock", timeout=60, thread_local=False)
    try:
        await anyio.to_thread.run_sync(lock.acquire)
    except filelock.Timeout as error:
        raise LogUnavailable(f"cannot open log {mask(target)}: another process holds {lock.lock_file} for over 60 s") from error
    try:
        revision = await _check_not_newer(engine, target)
        if revision != migrations.head():
            async with engine.begin() as conn:
                await conn.run_sync(migrations.upgrade)
            log.info("log_upgraded", url=mask(target), revision=migrations.head())
    finally:
        await anyio.to_thread.run_sync(lock.release)


def _first_line(exc: BaseException) -> str:
    text = str(getattr(exc, "orig", None) or exc)
    return text.strip().splitlines()[0] if text.strip() else type(exc).__name__
