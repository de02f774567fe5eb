"""The SQL log backend on SQLAlchemy 2 (async): SQLite (aiosqlite) and PostgreSQL (asyncpg).

Commit order: every append runs serialized (`BEGIN IMMEDIATE` on SQLite, a transaction-scoped
advisory lock on PostgreSQL) and assigns `global_seq` explicitly as max + 1. So sequences are
gapless and a reader can never see N + 1 before N commits: the skipped-row bug of logs that
take ids from a sequence and commit out of order (eventsourcing's comment on table locking).
SQLite work never runs on the event loop: appends and reads (the hot paths) run on a pysqlite
engine in worker threads, one hop per call (writes through a one-slot limiter); projections,
snapshots and small queries go through aiosqlite's thread.
"""

from __future__ import annotations

import sqlite3
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from typing import Any

import anyio
import sqlalchemy as sa
import structlog
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine, create_async_engine

from events.log import _schema as t
from events.log._contract import (
    AppendBatch,
    AppendRejected,
    AppendResult,
    Snapshot,
    StoredEvent,
    WrongExpectedVersion,
)
from events.log._urls import mask

log = structlog.get_logger("kvledger.log")

ADVISORY_LOCK_KEY = 0x6B766C6564676572  # "kvledger": serializes appends on PostgreSQL
NOTIFY_CHANNEL = "kvl_events"
WRITE_OPTION = "kvledger_write"
"""Execution option marking a transaction that writes (SQLite: BEGIN IMMEDIATE)."""
POLL_SECONDS = 0.2


def make_engine(url: sa.URL) -> AsyncEngine:
    """An async engine configured for the log: WAL and BEGIN IMMEDIATE on SQLite."""
    if url.get_backend_name() == "sqlite":
        engine = create_async_engine(url, connect_args={"timeout": 30})
        _configure_sqlite(engine.sync_engine)
        return engine
    return create_async_engine(url, pool_size=5, max_overflow=5)


def make_blocking_sqlite_engine(url: sa.URL) -> sa.Engine:
    """A plain pysqlite engine for the append and read hot paths, used only from worker threads:
    one thread hop per call instead of one per statement through aiosqlite."""
    engine = sa.create_engine(url.set(drivername="sqlite+pysqlite"), connect_args={"timeout": 30, "check_same_thread": False})
    _configure_sqlite(engine)
    return engine


def _configure_sqlite(sync_engine: sa.Engine) -> None:
    """WAL, crash-safe syncing, and appends serialized with BEGIN IMMEDIATE."""

    @sa.event.listens_for(sync_engine, "connect")
    def _on_connect(dbapi_connection: Any, _record: Any) -> None:
        # Let SQLAlchemy issue BEGIN itself (below), as SQLAlchemy's pysqlite docs advise.
        dbapi_connection.isolation_level = None
        cursor = dbapi_connection.cursor()
        cursor.execute("PRAGMA journal_mode=WAL")
        # NORMAL in WAL mode survives a killed process (the contract's crash case); only a
        # power cut can lose the last commits.
        cursor.execute("PRAGMA synchronous=NORMAL")
        cursor.execute("PRAGMA busy_timeout=30000")
        # Fewer, larger WAL checkpoints and a 64 MiB page cache: appends touch the same
        # index pages again and again (ops/bench/log.py measured about 2x on raw SQLite).
        cursor.execute("PRAGMA wal_autocheckpoint=10000")
        cursor.execute("PRAGMA cache_size=-65536")
        cursor.close()

    @sa.event.listens_for(sync_engine, "begin")
    def _on_begin(connection: sa.Connection) -> None:
        # Writers take the write lock up front, so appends serialize in commit order; readers
        # begin deferred and never wait for a writer (WAL gives them a snapshot).
        writing = connection.get_execution_options().get(WRITE_OPTION, False)
        connection.exec_driver_sql("BEGIN IMMEDIATE" if writing else "BEGIN")


_READ_SQL = (
    "SELECT global_seq, event_id, stream_id, stream_version, step, recorded_at, event_type, "
    "schema_version, payload FROM kvl_events WHERE global_seq > ? ORDER BY global_seq LIMIT ?"
)
_COLUMNS = ("global_seq", "event_id", "stream_id", "stream_version", "step", "recorded_at", "event_type", "schema_version", "payload")
_INSERT_SQL = (
    "INSERT INTO kvl_events (global_seq, event_id, stream_id, stream_version, step, recorded_at, "
    "event_type, schema_version, payload) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)"
)


class SqlEventLog:
    """EventLog on a SQL database. Open it with events.log.open_log."""

    def __init__(self, engine: AsyncEngine, url: str, blocking: sa.Engine | None = None) -> None:
        self.engine = engine
        self.url = url
        """Masked: safe to print."""
        self.dialect = engine.dialect.name
        self.blocking_engine = blocking
        """SQLite only: the pysqlite engine that appends and reads run on, in worker threads."""
        self._writer = anyio.CapacityLimiter(1)
        self._appended = anyio.Event()
        self._listener: Any = None

    # --- writing ---------------------------------------------------------------------------

    async def append(self, batches: Sequence[AppendBatch]) -> list[AppendResult]:
        """Append every batch atomically; raises WrongExpectedVersion and appends nothing."""
        if self.blocking_engine is not None:
            results = await anyio.to_thread.run_sync(self._append_blocking, batches, limiter=self._writer)
            self._wake()
            return results
        try:
            async with self._write() as conn:
                if self.dialect == "postgresql":
                    await conn.execute(sa.text("SELECT pg_advisory_xact_lock(:key)"), {"key": ADVISORY_LOCK_KEY})
                results = await conn.run_sync(_append_sync, batches)
                if self.dialect == "postgresql" and any(not r.duplicate and r.last_seq for r in results):
                    await conn.execute(sa.text(f"NOTIFY {NOTIFY_CHANNEL}"))
        except sa.exc.IntegrityError as error:
            raise AppendRejected(f"append refused by {self.url}: {error.orig}") from error
        self._wake()
        return results

    def _append_blocking(self, batches: Sequence[AppendBatch]) -> list[AppendResult]:
        assert self.blocking_engine is not None
        with self.blocking_engine.connect() as conn:
            conn.execution_options(**{WRITE_OPTION: True})
            try:
                with conn.begin():
                    return _append_sync(conn, batches)
            except (sqlite3.IntegrityError, sa.exc.IntegrityError) as error:
                raise AppendRejected(f"append refused by {self.url}: {error}") from error

    @asynccontextmanager
    async def _write(self) -> AsyncIterator[AsyncConnection]:
        """A transaction that writes: on SQLite it takes the write lock when it begins."""
        async with self.engine.connect() as conn:
            await conn.execution_options(**{WRITE_OPTION: True})
            async with conn.begin():
                yield conn

    def _wake(self) -> None:
        event, self._appended = self._appended, anyio.Event()
        event.set()

    # --- reading ---------------------------------------------------------------------------

    async def read(self, after_seq: int = 0, limit: int = 10_000) -> list[StoredEvent]:
        if self.blocking_engine is not None:
            return await anyio.to_thread.run_sync(self._read_blocking, after_seq, limit)
        query = sa.select(t.events).where(t.events.c.global_seq > after_seq).order_by(t.events.c.global_seq).limit(limit)
        async with self.engine.connect() as conn:
            rows = (await conn.execute(query)).all()
        return [StoredEvent(*row) for row in rows]

    def _read_blocking(self, after_seq: int, limit: int) -> list[StoredEvent]:
        assert self.blocking_engine is not None
        with self.blocking_engine.connect() as conn:
            cursor = conn.connection.driver_connection.execute(_READ_SQL, (after_seq, limit))  # type: ignore[union-attr]
            return [StoredEvent(*row) for row in cursor.fetchall()]

    async def tail(self, after_seq: int = 0, batch: int = 10_000) -> AsyncIterator[StoredEvent]:
        """Every committed event after `after_seq`, in order, forever: woken by appends in this
        process, by NOTIFY on PostgreSQL, and by polling as the fallback."""
        await self._listen()
        last = after_seq
        while True:
            waiter = self._appended
            rows = await self.read(last, batch)
            for row in rows:
                yield row
                last = row.global_seq
            if len(rows) < batch:
                with anyio.move_on_after(POLL_SECONDS):
                    await waiter.wait()

    async def _listen(self) -> None:
        if self.dialect != "postgresql" or self._listener is not None:
            return
        try:
            conn = await self.engine.connect()
            raw = await conn.get_raw_connection()
            await raw.driver_connection.add_listener(NOTIFY_CHANNEL, lambda *_: self._wake())  # type: ignore[union-attr]
            self._listener = conn
        except Exception as exc:  # noqa: BLE001 - any failure here only costs latency
            log.warning("log_listen_failed", url=self.url, error=str(exc), fallback="polling")
            self._listener = False

    async def head(self) -> int:
        async with self.engine.connect() as conn:
            value = (await conn.execute(sa.select(sa.func.max(t.events.c.global_seq)))).scalar()
        return int(value or 0)

    async def stream_version(self, stream_id: str) -> int:
        async with self.engine.connect() as conn:
            value = (await conn.execute(sa.select(t.streams.c.version).where(t.streams.c.stream_id == stream_id))).scalar()
        return int(value or 0)

    async def stream_versions(self) -> dict[str, int]:
        async with self.engine.connect() as conn:
            rows = (await conn.execute(sa.select(t.streams.c.stream_id, t.streams.c.version))).all()
        return {row.stream_id: row.version for row in rows}

    # --- checkpoints and snapshots ------------------------------------------------------------

    async def checkpoint(self, name: str) -> int:
        async with self.engine.connect() as conn:
            value = (await conn.execute(sa.select(t.checkpoints.c.global_seq).where(t.checkpoints.c.name == name))).scalar()
        return int(value or 0)

    @asynccontextmanager
    async def projection_transaction(self, name: str) -> AsyncIterator[SqlProjectionTransaction]:
        """Projection rows and their checkpoint commit together, or neither does."""
        async with self._write() as conn:
            yield SqlProjectionTransaction(conn, name, self.dialect)

    async def save_snapshot(self, snapshot: Snapshot) -> None:
        async with self._write() as conn:
            await conn.execute(
                t.snapshots.insert().values(
                    global_seq=snapshot.global_seq,
                    schema_version=snapshot.schema_version,
                    digest=snapshot.digest,
                    state=snapshot.state,
                    created_at=snapshot.created_at,
                )
            )

    async def snapshots(self, limit: int = 5) -> list[Snapshot]:
        query = sa.select(t.snapshots).order_by(t.snapshots.c.global_seq.desc(), t.snapshots.c.snapshot_id.desc()).limit(limit)
        async with self.engine.connect() as conn:
            rows = (await conn.execute(query)).all()
        return [
            Snapshot(global_seq=r.global_seq, schema_version=r.schema_version, digest=r.digest, state=bytes(r.state), created_at=r.created_at)
            for r in rows
        ]

    async def close(self) -> None:
        if self._listener:
            await self._listener.close()
        if self.blocking_engine is not None:
            await anyio.to_thread.run_sync(self.blocking_engine.dispose)
        await self.engine.dispose()


class SqlProjectionTransaction:
    def __init__(self, conn: AsyncConnection, name: str, dialect: str) -> None:
        self.connection = conn
        self._name = name
        self._dialect = dialect

    async def advance(self, global_seq: int) -> None:
        insert = (postgresql.insert if self._dialect == "postgresql" else sqlite.insert)(t.checkpoints)
        statement = insert.values(name=self._name, global_seq=global_seq).on_conflict_do_update(
            index_elements=[t.checkpoints.c.name], set_={"global_seq": global_seq}
        )
        await self.connection.execute(statement)


def _append_sync(conn: sa.Connection, batches: Sequence[AppendBatch]) -> list[AppendResult]:
    """The body of one append transaction (runs with the append serialized)."""
    results = []
    next_seq = int(conn.execute(sa.select(sa.func.max(t.events.c.global_seq))).scalar() or 0) + 1
    for batch in batches:
        if batch.command_id is not None:
            done = conn.execute(sa.select(t.commands).where(t.commands.c.command_id == batch.command_id)).first()
            if done is not None:
                results.append(
                    AppendResult(
                        stream_id=done.stream_id,
                        first_seq=done.first_seq,
                        last_seq=done.last_seq,
                        stream_version=done.stream_version,
                        duplicate=True,
                    )
                )
                continue
        current = conn.execute(sa.select(t.streams.c.version).where(t.streams.c.stream_id == batch.stream_id)).scalar()
        actual = int(current or 0)
        if actual != batch.expected_version:
            raise WrongExpectedVersion(batch.stream_id, batch.expected_version, actual)
        rows = [
            (next_seq + index, event.event_id, batch.stream_id, actual + index + 1, event.step,
             event.recorded_at, event.event_type, event.schema_version, event.payload)
            for index, event in enumerate(batch.events)
        ]
        if rows:
            if conn.dialect.name == "sqlite":
                # Straight to the DBAPI: SQLAlchemy's per-row parameter handling cost ~10%.
                conn.connection.driver_connection.executemany(_INSERT_SQL, rows)  # type: ignore[union-attr]
            else:
                conn.execute(t.events.insert(), [dict(zip(_COLUMNS, row, strict=True)) for row in rows])
            version = actual + len(rows)
            if current is None:
                conn.execute(t.streams.insert().values(stream_id=batch.stream_id, version=version))
            else:
                conn.execute(t.streams.update().where(t.streams.c.stream_id == batch.stream_id).values(version=version))
        first, last = (next_seq, next_seq + len(rows) - 1) if rows else (0, 0)
        next_seq += len(rows)
        result = AppendResult(stream_id=batch.stream_id, first_seq=first, last_seq=last, stream_version=actual + len(rows))
        if batch.command_id is not None:
            conn.execute(
                t.commands.insert().values(
                    command_id=batch.command_id,
                    stream_id=batch.stream_id,
                    first_seq=first,
                    last_seq=last,
                    stream_version=result.stream_version,
                )
            )
        results.append(result)
    return results
