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
from events.log._contract import LogError, LogUnavailable, NotALog, SchemaMismatch
from events.log._kafka import KafkaEventLog
from events.log._sql import SqlEventLog, make_blocking_sqlite_engine, make_engine
from events.log._urls import is_kafka, mask, normalize
from events.log.kafka_target import parse_kafka_url, probe

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


async def open_log(url: str | None = None, *, read_only: bool = False) -> SqlEventLog:
    """Open the log at `url` (a path, sqlite://, postgresql:// or kafka://; None: the default file).

    SQLite upgrades its own schema under a file lock. PostgreSQL behind head is refused with the
    command to run. A schema newer than this code is refused, naming both revisions. A Kafka log
    opens its state store by these rules, then reads its topic (KafkaEventLog.open): it is a
    SqlEventLog whose SQL side is that store, so this signature holds for every backend.

    `read_only` (the forensic commands that only read: verify, export, replay): a SQLite file is
    opened read-only, with no lock file, no directory made and no upgrade; one that is missing,
    not a SQLite database or without kvledger's schema is refused (NotALog) naming the path."""
    if read_only and not is_kafka(url) and normalize(url).get_backend_name() == "sqlite":
        return await _open_sqlite_read_only(normalize(url))
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


SQLITE_MAGIC = b"SQLite format 3\x00"


async def check_sqlite_file(path: Path) -> None:
    """That an existing SQLite log is at `path`, before anything opens it (and makes a lock file
    or a database beside or in place of what is there): LogUnavailable when nothing is there,
    NotALog when it is not a SQLite database."""

    def magic() -> bytes:
        with path.open("rb") as file:
            return file.read(len(SQLITE_MAGIC))

    try:
        header = await anyio.to_thread.run_sync(magic)
    except FileNotFoundError:
        raise LogUnavailable(f"no log at {path}") from None
    except IsADirectoryError:
        raise NotALog(f"{path} is a directory, not a kvledger log") from None
    except OSError as exc:
        raise LogUnavailable(f"cannot read log {path}: {exc.strerror or exc}") from exc
    if header != SQLITE_MAGIC:
        raise NotALog(f"{path} is not a kvledger log: not a SQLite database")


async def _open_sqlite_read_only(target: sa.URL) -> SqlEventLog:
    """A SQLite log opened read-only (`open_log(read_only=True)`): nothing is created beside it
    (`kvledger verify --log /etc/passwd` left /etc/passwd.lock, after which useradd refused to run)."""
    path = Path(str(target.database or ""))
    if not target.database or str(path) == ":memory:":
        raise NotALog("a read-only command needs a log file; none was named")
    await check_sqlite_file(path)
    # A log in WAL mode that no process has open has no -wal and -shm files, and a read-only
    # connection would create both (and leave them): such a file is read as immutable. One that a
    # sidecar has open (its -shm is there) is read through the WAL, seeing what it commits.
    live = any(Path(f"{path}{suffix}").exists() for suffix in ("-wal", "-shm"))
    flags = "mode=ro" if live else "mode=ro&immutable=1"
    read_only = target.set(database=f"file:{path.resolve()}?{flags}", query={"uri": "true"})
    engine = make_engine(read_only)
    masked = mask(target)
    try:
        async with engine.connect() as conn:
            revision: str | None = await conn.run_sync(migrations.current)
    except (OSError, sa.exc.OperationalError, sa.exc.InterfaceError, sa.exc.DatabaseError) as exc:
        await engine.dispose()
        raise NotALog(f"{path} is not a kvledger log: {_first_line(exc)}") from exc
    except BaseException:
        await engine.dispose()
        raise
    problem: LogError | None = None
    if revision is None:
        problem = NotALog(f"{path} is not a kvledger log: it has no kvledger schema")
    elif not migrations.known(revision):
        problem = SchemaMismatch(
            f"log {masked} was written by a newer kvledger (schema {revision}); this one knows up to {migrations.head()}"
        )
    elif revision != migrations.head():
        problem = SchemaMismatch(
            f"log {masked} is at schema {revision}, this kvledger reads {migrations.head()}: "
            f"run `kvledger db upgrade --log {masked}` (read-only commands change nothing)"
        )
    if problem is not None:
        await engine.dispose()
        raise problem
    return SqlEventLog(engine, masked, make_blocking_sqlite_engine(read_only))


async def _check_not_newer(engine: AsyncEngine, target: sa.URL) -> str | None:
    async with engine.connect() as conn:
        revision: str | None = await conn.run_sync(migrations.current)
    if revision is not None and not migrations.known(revision):
        raise SchemaMismatch(
            f"log {mask(target)} was written by a newer kvledger (schema {revision}); this one knows up to {migrations.head()}"
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
