"""The SQL log backend on SQLAlchemy 2 (async): SQLite (aiosqlite) and PostgreSQL (asyncpg).

Commit order: every append runs serialized (`BEGIN IMMEDIATE` on SQLite, a transaction-scoped
advisory lock on PostgreSQL) and assigns `global_seq` explicitly as max + 1. So sequences are
gapless and a reader can never see N + 1 before N commits: the skipped-row bug of logs that
take ids from a sequence and commit out of order (eventsourcing's comment on table locking).
SQLite work never runs on the event loop: appends and reads (the hot paths) run on a pysqlite
engine in worker threads, one hop per call (appends on a thread of the log's own, in order); projections,
snapshots and small queries go through aiosqlite's thread.

Storage: one `kvl_steps` row per stream per append, holding the step's events' payloads
concatenated, with a header naming each event (id, type, schema version, length). Event ids stay
unique: a step whose ids ascend above every id the log holds is one `kvl_id_runs` row (its first
and last id; the ledger's UUIDv7s nearly always do), and any other step's ids go to
`kvl_event_ids`, whose primary key keeps them unique, each checked against the runs (migration
0009 on SQLite, 0010 on PostgreSQL). A step of 1 KiB or more is stored with its header and
payload compressed (LZ4, `kvl_steps.codec`; events/log/_step_rows.py packs and reads either). A
reader splits a step back into events (`StoredStep.events`), or replay decodes the whole payload
in one call. Each backend's append statements are a module of their own:
events/log/_sqlite_append.py and events/log/_postgres_append.py.
"""

from __future__ import annotations

import os
import sqlite3
import threading
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from typing import Any

import anyio
import sqlalchemy as sa
import structlog
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine, create_async_engine

from events.log import schema as t
from events.log._append_plan import PackedStep
from events.log._command_filter import CommandFilter
from events.log._contract import (
    AppendBatch,
    AppendRejected,
    AppendResult,
    LogUnavailable,
    Snapshot,
    StoredEvent,
    StoredStep,
)
from events.log._postgres_append import append_postgresql
from events.log._sqlite_append import HEAD_SQL, SqliteRows, append_rows
from events.log._step_rows import STEP_COLUMNS, pack_batches, stored_step
from events.log._writer_thread import WriterThread

log = structlog.get_logger("kvledger.log")

ADVISORY_LOCK_KEY = 0x6B766C6564676572  # "kvledger": serializes appends on PostgreSQL
NOTIFY_CHANNEL = "kvl_events"
WRITE_OPTION = "kvledger_write"
"""Execution option marking a transaction that writes (SQLite: BEGIN IMMEDIATE)."""
POLL_SECONDS = 0.2


def _as_null(value: None) -> None:
    return value


# sqlite3 binds only exact int, float, str and bytearray parameters directly; a bytes or None
# parameter first goes through its adapter registry, and on a miss asks the protocol type for
# `__adapt__`, which raises (and formats) an AttributeError it then clears. That was 6% of the
# instructions of building the audit index (callgrind, ops/bench/audit.py's 200k-event log: 398k
# failed lookups); inserting 89k kvl_audit_keys rows took 0.26 s of CPU without these adapters and
# 0.19 s with them. Both are the identity: the values bound, and so every row, are the same. The
# registry is sqlite3's, one per process: it holds for every SQLite connection here.
sqlite3.register_adapter(bytes, bytes)
sqlite3.register_adapter(type(None), _as_null)

PAGE_CACHE_KIB = 8192
"""SQLite's page cache per connection. ops/bench/log.py appends and replays as fast with 8 MiB as
with 64 MiB; a sidecar's memory grew by the cache as its log grew (ops/bench/hostile.py: +36 MiB
at 64 MiB under a flood of refused steps, +13 MiB at 8 MiB)."""
CHECKPOINT_EVERY = 0.25
"""Seconds between the background WAL checkpoints while appends come in (`_Checkpointer`)."""
RESTART_FRAMES = 2_500
"""WAL frames (pages: 10 MB) past which `_Checkpointer` lets the next append start the WAL afresh:
a quarter of `wal_autocheckpoint`, SQLite's own bound, which then comes due only if it falls behind."""
CATCH_UP_TRIES = 4
FINISH_FRAMES = 300
"""`_Checkpointer` copies again (at most CATCH_UP_TRIES times) until fewer than this many frames
came in during a copy, then copies the rest with the appends held."""


def is_outage(error: BaseException) -> bool:
    """Whether `error` says the database is unreachable or dropped the connection (worth a retry),
    rather than refused what was asked of it (a bug or a schema problem)."""
    if isinstance(error, (sa.exc.OperationalError, sa.exc.InterfaceError, OSError, TimeoutError)):
        return True
    if isinstance(error, sa.exc.DBAPIError) and bool(error.connection_invalidated):
        return True
    return _lost_postgres_connection(error)


def _lost_postgres_connection(error: BaseException) -> bool:
    """asyncpg's "connection was closed in the middle of operation" (ConnectionDoesNotExistError, a
    PostgresConnectionError) reaches SQLAlchemy as a plain dbapi Error, not flagged as a
    disconnect: seen ending `kvledger fleet` when its audit database's connection was cut mid-query
    (tests/audit/test_fleet.py). It is found in the chain of causes."""
    import asyncpg

    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, (asyncpg.PostgresConnectionError, asyncpg.InterfaceError, ConnectionError)):
            return True
        orig = getattr(current, "orig", None)
        current = orig if isinstance(orig, BaseException) else current.__cause__
    return False


KEEP_SNAPSHOTS = 5
"""Snapshots kept in the log's database: the newest, and four older in case it fails its digest."""


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
        # Fewer, larger WAL checkpoints (ops/bench/log.py measured about 2x on raw SQLite), and
        # a page cache of PAGE_CACHE_KIB on each connection.
        cursor.execute("PRAGMA wal_autocheckpoint=10000")
        cursor.execute(f"PRAGMA cache_size=-{PAGE_CACHE_KIB}")
        cursor.close()

    @sa.event.listens_for(sync_engine, "begin")
    def _on_begin(connection: sa.Connection) -> None:
        # Writers take the write lock up front, so appends serialize in commit order; readers
        # begin deferred and never wait for a writer (WAL gives them a snapshot).
        writing = connection.get_execution_options().get(WRITE_OPTION, False)
        connection.exec_driver_sql("BEGIN IMMEDIATE" if writing else "BEGIN")


_READ_STEPS_SQL = (
    # The step holding after + 1 starts at the greatest first_seq <= after + 1; every step that
    # starts up to after + limit holds some of the events asked for. Both bounds use the primary key.
    f"SELECT {STEP_COLUMNS} FROM kvl_steps WHERE first_seq >= "
    "coalesce((SELECT max(first_seq) FROM kvl_steps WHERE first_seq <= :after + 1), 0) "
    "AND first_seq <= :after + :limit ORDER BY first_seq"
)
_READ_STEPS = sa.text(_READ_STEPS_SQL).bindparams(
    sa.bindparam("after", type_=sa.BigInteger), sa.bindparam("limit", type_=sa.BigInteger)
)
_READ_STREAM_STEPS_SQL = (
    # ix_kvl_steps_stream_last: the stream's steps in order from the one ending after `after`.
    f"SELECT {STEP_COLUMNS} FROM kvl_steps WHERE stream_id = :stream AND last_seq > :after ORDER BY last_seq LIMIT :limit"
)
_READ_STREAM_STEPS = sa.text(_READ_STREAM_STEPS_SQL).bindparams(
    sa.bindparam("after", type_=sa.BigInteger), sa.bindparam("limit", type_=sa.BigInteger)
)


def events_of(steps: Sequence[StoredStep], after_seq: int, limit: int) -> list[StoredEvent]:
    """The events after `after_seq` in `steps`, at most `limit` of them."""
    stored = [event for step in steps for event in step.events() if event.global_seq > after_seq]
    return stored[:limit]


class _Checkpointer:
    """Copies SQLite's WAL into the database file in a thread of its own, and starts the WAL
    afresh at the cost of a short pause of the appends, not a long one.

    SQLite checkpoints on the commit that takes the WAL past `wal_autocheckpoint` pages: under
    ops/bench/hostile.py's load that was one append every ~15 s taking 40-55 ms, and every
    engine's step waited for it. Appends one after another (ops/bench/peer_eventsourcing.py)
    met it every ~360 appends, 50-150 ms each: a fifth to a third of their time. The WAL starts
    afresh only when an append begins with every frame copied, which a checkpoint beside the
    appends never sees: frames come in while it copies.

    So, while appends come in, this thread:

    * copies the WAL at most every CHECKPOINT_EVERY seconds (PASSIVE: no lock, appends go on
      beside it), then syncs the database file itself. SQLite syncs it only when a checkpoint
      reaches the WAL's end, so otherwise every page copied since the WAL last started afresh
      waited for the one checkpoint that did: the 26-45 ms of a sync inside each pause (strace);
    * once the WAL holds RESTART_FRAMES frames, copies again until few frames came in meanwhile,
      then copies the rest holding `lock`, which every append holds through its transaction:
      no append beside it, the copy reaches the WAL's end, and the next append starts the WAL
      afresh. That pause is the last few frames and their syncs: 2.5-10 ms, against 50-150 ms
      for SQLite's own on the commit (ops/bench/peer_eventsourcing.py's appends, timed).

    A reader's snapshot can keep a checkpoint from the WAL's end (PASSIVE never waits for it): the
    WAL then starts afresh on a later try. `wal_autocheckpoint` stays as the bound if this
    thread falls behind. Started by the first append: a log only read never starts it."""

    def __init__(self, engine: sa.Engine, url: str) -> None:
        self._engine = engine
        self._url = url
        self._due = threading.Event()
        self._closing = threading.Event()
        self._thread: threading.Thread | None = None
        self._start = threading.Lock()
        self.lock = threading.Lock()
        """Held by each append through its transaction, and by this thread to finish a checkpoint."""
        self.restarts = 0
        """Checkpoints finished holding `lock` (each lets the next append start the WAL afresh)."""

    def appended(self) -> None:
        if self._thread is None:
            with self._start:
                if self._thread is None and not self._closing.is_set():
                    self._thread = threading.Thread(target=self._run, name="kvledger-wal-checkpoint", daemon=True)
                    self._thread.start()
        self._due.set()

    def _run(self) -> None:
        while not self._closing.is_set():
            self._due.wait()
            if self._closing.is_set():
                return
            self._due.clear()
            try:
                with self._engine.connect() as conn:
                    # The driver's own connection: SQLAlchemy would begin a transaction first, and
                    # a checkpoint inside one cannot copy past the snapshot it holds.
                    self._checkpoint(conn.connection.driver_connection)
            except (sqlite3.Error, sa.exc.DBAPIError, OSError) as error:
                # A checkpoint is housekeeping: the next one (or SQLite's own) copies what this did not.
                log.warning("wal_checkpoint_failed", url=self._url, error=str(error).splitlines()[0])
            self._closing.wait(CHECKPOINT_EVERY)

    def _checkpoint(self, driver: Any) -> None:
        frames = self._copy(driver)
        if frames < RESTART_FRAMES:
            return
        for _ in range(CATCH_UP_TRIES):  # each copy is shorter than the one before: fewer frames came in
            more = self._copy(driver)
            if more - frames < FINISH_FRAMES or self._closing.is_set():
                break
            frames = more
        with self.lock:
            self._copy(driver)
            self.restarts += 1

    def _copy(self, driver: Any) -> int:
        """A PASSIVE checkpoint, then the database file synced: the frames the WAL held (-1: no WAL)."""
        _busy, frames, _copied = driver.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchone()
        database = self._engine.url.database
        if frames > 0 and database and database != ":memory:":
            descriptor = os.open(database, os.O_RDONLY)
            try:
                _sync(descriptor)
            finally:
                os.close(descriptor)
        return int(frames)

    def close(self) -> None:
        self._closing.set()
        self._due.set()
        if self._thread is not None:
            self._thread.join()


_sync = getattr(os, "fdatasync", os.fsync)
"""Flushes a file's data to disk (fdatasync where the platform has it)."""


class SqlEventLog:
    """EventLog on a SQL database. Open it with events.log.open_log."""

    def __init__(self, engine: AsyncEngine, url: str, blocking: sa.Engine | None = None) -> None:
        self.engine = engine
        self.url = url
        """Masked: safe to print."""
        self.dialect = engine.dialect.name
        self.blocking_engine = blocking
        """SQLite only: the pysqlite engine that appends and reads run on, in worker threads."""
        self._writer = WriterThread(f"kvledger-append {url}")
        """SQLite only: the thread appends run on, one after another (events/log/_writer_thread.py)."""
        self._writer_connection: Any = None
        """SQLite only: the pooled connection appends run on, checked out by the first append and
        held until close (used only on `_writer`)."""
        self._checkpointer = _Checkpointer(blocking, url) if blocking is not None else None
        self._commands = CommandFilter()
        """The command ids the log holds, so most groups need no look-up (find_commands)."""
        self._appended = anyio.Event()
        self._listener: Any = None

    # --- writing ---------------------------------------------------------------------------

    async def append(self, batches: Sequence[AppendBatch], *, expected_head: int | None = None) -> list[AppendResult]:
        """Append every batch atomically; raises WrongExpectedVersion or HeadMoved and appends nothing."""
        self._commands.began()
        try:
            if self.blocking_engine is not None:
                packed = pack_batches(batches)
                results = await self._writer.run(self._append_blocking, batches, expected_head, packed)
            else:
                results = await self._append_async(batches, expected_head)
        except BaseException:
            self._commands.failed()
            raise
        self._commands.appended(expected_head, [batch.command_id for batch in batches], results)
        if self._checkpointer is not None:
            self._checkpointer.appended()
        self._wake()
        return results

    async def _append_async(self, batches: Sequence[AppendBatch], expected_head: int | None) -> list[AppendResult]:
        """One append transaction on PostgreSQL through SQLAlchemy's async engine: the lock, then
        two statements (events/log/_postgres_append.py)."""
        try:
            async with self._write() as conn:
                # The lock in a statement of its own: the look-up after it sees every append before.
                await conn.execute(sa.text("SELECT pg_advisory_xact_lock(:key)"), {"key": ADVISORY_LOCK_KEY})
                results = await append_postgresql(conn, batches, expected_head, pack_batches(batches), NOTIFY_CHANNEL)
        except AppendRejected as error:  # an event id a run holds (events/log/_postgres_append.py)
            raise AppendRejected(f"append refused by {self.url}: {error}") from None
        except sa.exc.IntegrityError as error:
            # PostgreSQL's DETAIL names the row (`Key (event_id)=(...) already exists.`).
            detail = getattr(error.orig, "__cause__", None)
            detail = getattr(detail, "detail", None)
            raise AppendRejected(f"append refused by {self.url}: {error.orig}" + (f" ({detail})" if detail else "")) from error
        except Exception as error:
            if is_outage(error):
                # As the Kafka log says it: callers retry an outage, and only an outage.
                first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
                raise LogUnavailable(
                    f"append to {self.url} failed ({type(error).__name__}: {first}): it may or may not "
                    "be committed; retry it with the same command id"
                ) from error
            raise
        return results

    def _append_blocking(
        self, batches: Sequence[AppendBatch], expected_head: int | None, packed: Sequence[PackedStep | None]
    ) -> list[AppendResult]:
        """One append transaction, straight on sqlite3: checking a connection out of SQLAlchemy's
        pool, its begin listener, commit and the pool's reset on return took ~80 us of the ~550 us
        an append of 256 events spent in its thread (ops/bench/peer_eventsourcing.py, timed)."""
        assert self.blocking_engine is not None
        if self._writer_connection is None:
            # Checked out here, in the first append, so it has every listener the engine has then
            # (the pragmas of _configure_sqlite: isolation_level None, WAL, busy timeout).
            self._writer_connection = self.blocking_engine.raw_connection()
        driver = self._writer_connection.driver_connection
        assert self._checkpointer is not None
        with self._checkpointer.lock:  # a checkpoint finishing holds it: the WAL then starts afresh
            return self._append_transaction(driver, batches, expected_head, packed)

    def _append_transaction(
        self,
        driver: sqlite3.Connection,
        batches: Sequence[AppendBatch],
        expected_head: int | None,
        packed: Sequence[PackedStep | None],
    ) -> list[AppendResult]:
        _driver_statement(driver, "BEGIN IMMEDIATE")  # the write lock up front: appends serialize
        try:
            results = append_rows(SqliteRows(driver), batches, expected_head, packed)
            _driver_statement(driver, "COMMIT")
        except BaseException as error:
            if driver.in_transaction:
                try:
                    driver.execute("ROLLBACK")
                except sqlite3.Error:
                    # A connection whose transaction could not end is never reused: the next
                    # append checks out a fresh one.
                    self._writer_connection.invalidate()
                    self._writer_connection = None
            if isinstance(error, (sqlite3.IntegrityError, sa.exc.IntegrityError)):
                raise AppendRejected(f"append refused by {self.url}: {error}") from error
            raise
        return results

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
        return events_of(await self.read_steps(after_seq, limit), after_seq, limit)

    async def read_steps(self, after_seq: int = 0, limit: int = 10_000) -> list[StoredStep]:
        if limit <= 0:
            return []
        if self.blocking_engine is not None:
            return await anyio.to_thread.run_sync(self._read_steps_blocking, after_seq, limit)
        async with self.engine.connect() as conn:
            rows = (await conn.execute(_READ_STEPS, {"after": after_seq, "limit": limit})).all()
        return [stored_step(row) for row in rows]

    def _read_steps_blocking(self, after_seq: int, limit: int) -> list[StoredStep]:
        assert self.blocking_engine is not None
        with self.blocking_engine.connect() as conn:
            driver = conn.connection.driver_connection
            cursor = driver.execute(_READ_STEPS_SQL, {"after": after_seq, "limit": limit})  # type: ignore[union-attr]
            return [stored_step(row) for row in cursor.fetchall()]

    async def read_stream_steps(self, stream_id: str, after_seq: int = 0, limit: int = 1_000) -> list[StoredStep]:
        if limit <= 0:
            return []
        parameters = {"stream": stream_id, "after": after_seq, "limit": limit}
        if self.blocking_engine is not None:
            return await anyio.to_thread.run_sync(self._read_stream_steps_blocking, parameters)
        async with self.engine.connect() as conn:
            rows = (await conn.execute(_READ_STREAM_STEPS, parameters)).all()
        return [stored_step(row) for row in rows]

    def _read_stream_steps_blocking(self, parameters: dict[str, object]) -> list[StoredStep]:
        assert self.blocking_engine is not None
        with self.blocking_engine.connect() as conn:
            driver = conn.connection.driver_connection
            cursor = driver.execute(_READ_STREAM_STEPS_SQL, parameters)  # type: ignore[union-attr]
            return [stored_step(row) for row in cursor.fetchall()]

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
        if self.blocking_engine is not None:
            # One hop to a worker thread (~0.17 ms of the event loop's time, timed): through
            # SQLAlchemy's async engine and aiosqlite's thread a head took ~1 ms of it, and a
            # sidecar asks for it ten times a second (following the log) and at every health probe.
            head = await anyio.to_thread.run_sync(self._head_blocking)
            self._commands.saw_head(head)
            return head
        async with self.engine.connect() as conn:
            value = int((await conn.execute(sa.text(HEAD_SQL))).scalar() or 0)
        self._commands.saw_head(value)
        return value

    def _head_blocking(self) -> int:
        assert self.blocking_engine is not None
        with self.blocking_engine.connect() as conn:
            return SqliteRows(conn.connection.driver_connection).head()

    async def find_commands(self, command_ids: Sequence[str]) -> dict[str, AppendResult]:
        if not command_ids:
            return {}
        known = self._commands
        if known.ready and not known.may_hold_any(command_ids):
            return {}  # surely new: nothing asked of the database (most steps)
        build = not known.ready and not known.off
        appends, running = known.appends, known.appending
        found, fresh = await self._look_up_commands(list(command_ids), build)
        if fresh is not None and known.build_valid(appends, running):
            known.adopt(fresh)
        return found

    async def _look_up_commands(
        self, command_ids: list[str], build: bool
    ) -> tuple[dict[str, AppendResult], CommandFilter | None]:
        """The ids found in the log; with `build`, also a CommandFilter of every command id of the
        log and its head, read in one transaction."""
        if self.blocking_engine is not None:
            return await anyio.to_thread.run_sync(self._find_commands_blocking, command_ids, build)
        query = sa.select(t.commands).where(t.commands.c.command_id.in_(command_ids))
        async with self.engine.connect() as conn:
            rows = (await conn.execute(query)).all()
        found = {
            row.command_id: AppendResult(
                stream_id=row.stream_id,
                first_seq=row.first_seq,
                last_seq=row.last_seq,
                stream_version=row.stream_version,
                duplicate=True,
                digest=row.digest,
            )
            for row in rows
        }
        build = build and self.dialect == "postgresql"  # (a SQLite log always has its blocking engine)
        return found, (await self._read_command_filter() if build else None)

    async def _read_command_filter(self) -> CommandFilter:
        """Every command id of the log and its head, in one snapshot (REPEATABLE READ), streamed
        in chunks: a log of 1M commands is never a list of 1M strings in memory."""
        async with self.engine.connect() as conn:
            await conn.execution_options(isolation_level="REPEATABLE READ")
            async with conn.begin():
                head = int((await conn.execute(sa.text(HEAD_SQL))).scalar() or 0)
                expected = int((await conn.execute(sa.text("SELECT count(*) FROM kvl_commands"))).scalar() or 0)
                fresh = CommandFilter.read([], head, expected)
                result = await conn.stream(sa.text("SELECT command_id FROM kvl_commands"))
                async for chunk in result.partitions(65_536):
                    fresh.add_read([row[0] for row in chunk])
        return fresh

    def _find_commands_blocking(
        self, command_ids: list[str], build: bool
    ) -> tuple[dict[str, AppendResult], CommandFilter | None]:
        """The ids found; with `build`, also a CommandFilter of every command id of the log and
        its head, read in the same transaction (0.5-0.7 s and 4.7 MB for 1M commands, measured)."""
        assert self.blocking_engine is not None
        found = {}
        fresh = None
        with self.blocking_engine.connect() as conn:
            driver: Any = conn.connection.driver_connection
            rows = SqliteRows(driver)
            if build:
                driver.execute("BEGIN")  # one snapshot of the log for the head and the ids
            try:
                for command_id in command_ids:
                    result = rows.command(command_id)
                    if result is not None:
                        found[command_id] = result
                if build:
                    # Rows are insert-only: the largest rowid is about their count (and costs no scan).
                    expected = driver.execute("SELECT max(rowid) FROM kvl_commands").fetchone()[0] or 0
                    cursor = driver.execute("SELECT command_id FROM kvl_commands")
                    chunks = iter(lambda: [row[0] for row in cursor.fetchmany(65_536)], [])
                    fresh = CommandFilter.read(chunks, rows.head(), expected)
            finally:
                if build:
                    driver.execute("COMMIT")
        return found, fresh

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
        """Insert it, and keep only the newest KEEP_SNAPSHOTS (recovery tries them newest first:
        older ones are never read, and each is a whole state)."""
        newest = (
            sa.select(t.snapshots.c.snapshot_id)
            .order_by(t.snapshots.c.global_seq.desc(), t.snapshots.c.snapshot_id.desc())
            .limit(KEEP_SNAPSHOTS)
        )
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
            keep = (await conn.execute(newest)).scalars().all()
            await conn.execute(t.snapshots.delete().where(t.snapshots.c.snapshot_id.not_in(keep)))

    async def snapshots(self, limit: int = 5) -> list[Snapshot]:
        query = sa.select(t.snapshots).order_by(t.snapshots.c.global_seq.desc(), t.snapshots.c.snapshot_id.desc()).limit(limit)
        async with self.engine.connect() as conn:
            rows = (await conn.execute(query)).all()
        return [
            Snapshot(
                global_seq=r.global_seq,
                schema_version=r.schema_version,
                digest=r.digest,
                state=bytes(r.state),
                created_at=r.created_at,
            )
            for r in rows
        ]

    async def close(self) -> None:
        if self._listener:
            await self._listener.close()
        if self._checkpointer is not None:
            await anyio.to_thread.run_sync(self._checkpointer.close)
        if self._writer_connection is not None:
            await self._writer.run(self._writer_connection.close)
            self._writer_connection = None
        await self._writer.close()
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


def _driver_statement(driver: sqlite3.Connection, statement: str) -> None:
    """BEGIN or COMMIT on sqlite3, failing as it did through SQLAlchemy (sa.exc.OperationalError:
    a database locked past the busy timeout is an outage, which callers retry)."""
    try:
        driver.execute(statement)
    except sqlite3.OperationalError as error:
        raise sa.exc.OperationalError(statement, None, error) from error
