"""Building the audit index from the log: read committed steps after the "audit" checkpoint, turn
them into rows (coordinator/audit/index.py) and insert them with the new checkpoint in one
transaction, so the index is exactly once whatever stops it.

The index lives in the log's own database (tables kvl_audit_*, migrations 0003, 0004 and 0007). Building it never
touches the log's rows: a copied log file can be indexed and audited offline.
"""

from __future__ import annotations

import gc
import operator
from collections.abc import Callable
from typing import Any

import msgspec
import sqlalchemy as sa
import structlog

from coordinator.audit.index import SLOT_WINDOW_BITS, AuditRows, Indexer, engine_of_stream
from events import EventCodec, EventDecodeError
from events.log import PAGE_CACHE_KIB, SqlEventLog, StoredStep
from events.log import schema as t
from events.log.reading import decode, stored_steps

log = structlog.get_logger("kvledger.audit")

CHECKPOINT = "audit"
BATCH_WINDOWS = 4
BATCH = BATCH_WINDOWS << SLOT_WINDOW_BITS
"""Events per transaction by default: four windows of slot rows. The slots, owners and keys a batch
touches get one row each however often it touches them (coordinator/audit/index.py), so larger
batches write fewer rows; and a batch ends at a window's end (but for the rest of the step holding
it) whenever one falls within it, so a slot's touches in a window are one row when the index is
built in one go. Four windows, not one (issue 22): once a log's index outgrows the page cache, a
batch dirties about a page of each random-key index (keys, key blocks, slots) per row, up to the
whole index, and writes each dirty page to the WAL at its commit; fewer, larger batches write
those pages fewer times. The last 1M events of ops/bench/audit.py's 10M-event log indexed onto the
first 9M: 1,700 MiB written instead of 3,810 (/proc/self/io wchar), 13.8-16.6 s of CPU against
16.2-20.0; the price is memory, a peak of 572 MiB against 255 (two windows: 2,551 MiB written,
362 MiB). The audit API and the fleet service pass smaller batches of their own."""
INDEX_CACHE_KIB = 65536
"""SQLite's page cache while a batch is inserted (the log's connections keep PAGE_CACHE_KIB). A
batch dirties about a page of each random-key index (keys, key blocks, slots) per row; once a
log's index outgrows the log's cache, SQLite spilled dirty pages to the WAL in mid-transaction and
read pages back. The bench's 10M-event log, its last 1M events indexed onto the first 9M (strace
-c): 2.08M page writes and 1.64M page reads with 8 MiB, 1.46M and 0.98M with 64 MiB (256 MiB
writes no fewer). Set back before the commit: dirty pages stay until written, and the clean ones
beyond the log's cache are freed, so a batch's cache is its own."""
AUDIT_LOCK_KEY = 0x6B766C6175646974  # "kvlaudit": one indexer at a time on PostgreSQL

_TABLES: dict[str, sa.Table] = {
    "slots": t.audit_slots,
    "owner_blocks": t.audit_owner_blocks,
    "key_blocks": t.audit_key_blocks,
    "owners": t.audit_owners,
    "jobs": t.audit_jobs,
    "keys": t.audit_keys,
    "refusals": t.audit_refusals,
    "engines": t.audit_engines,
    "namespaces": t.audit_namespaces,
    "decisions": t.audit_decisions,
    "steps": t.audit_steps,
    "observed": t.audit_observed,
}
_COLUMNS = {name: [c.name for c in table.columns] for name, table in _TABLES.items()}


class IndexProgress(msgspec.Struct, frozen=True):
    indexed_seq: int
    head: int
    rows: int


async def indexed_seq(event_log: SqlEventLog) -> int:
    """The last global sequence the audit index holds."""
    return await event_log.checkpoint(CHECKPOINT)


async def sync_index(
    event_log: SqlEventLog,
    *,
    until_seq: int | None = None,
    batch: int = BATCH,
    on_progress: Callable[[IndexProgress], None] | None = None,
    codec: EventCodec | None = None,
) -> int:
    """Index every committed event after the checkpoint (up to the end of the step holding
    `until_seq`, default the head now); returns the new checkpoint. Safe to run from several processes: a batch whose checkpoint
    moved meanwhile is dropped and read again from the new one."""
    codec = codec or EventCodec()
    head = await event_log.head() if until_seq is None else until_seq
    after = await indexed_seq(event_log)
    rows_total = 0
    while after < head:
        indexer = Indexer(await _namespaces(event_log))
        until = min(head, batch_end(after, batch))
        steps = [step async for found in stored_steps(event_log, after, until) for step in found]
        if not steps:
            break
        last = steps[-1].last_seq
        tables = _fold(indexer, codec, steps, after)
        async with event_log.projection_transaction(CHECKPOINT) as tx:
            if event_log.dialect == "postgresql":
                await tx.connection.execute(sa.text("SELECT pg_advisory_xact_lock(:key)"), {"key": AUDIT_LOCK_KEY})
            current = (
                await tx.connection.execute(sa.select(t.checkpoints.c.global_seq).where(t.checkpoints.c.name == CHECKPOINT))
            ).scalar() or 0
            if current != after:  # another indexer got there first: start again from where it is
                after = int(current)
                continue
            if event_log.dialect == "sqlite":  # see INDEX_CACHE_KIB
                await tx.connection.exec_driver_sql(f"PRAGMA cache_size=-{INDEX_CACHE_KIB}")
            await tx.connection.run_sync(_insert, tables)
            await tx.advance(last)
            if event_log.dialect == "sqlite":  # the pooled connection goes back with the log's cache
                await tx.connection.exec_driver_sql(f"PRAGMA cache_size=-{PAGE_CACHE_KIB}")
        rows_total += sum(map(len, tables.values()))
        after = last
        if on_progress is not None:
            on_progress(IndexProgress(after, head, rows_total))
    log.debug("audit_index_synced", indexed_seq=after, rows=rows_total)
    return after


def batch_end(after: int, batch: int) -> int:
    """The last sequence of the batch after `after`: the last window end within `batch` events,
    or `after + batch` when no window ends within them. So no window is split between batches (but
    where a step crosses its end: a batch ends with a whole step)."""
    limit = after + batch
    window_end = ((limit + 1) >> SLOT_WINDOW_BITS << SLOT_WINDOW_BITS) - 1  # the last one at or before `limit`
    return window_end if window_end > after else limit


def _fold(indexer: Indexer, codec: EventCodec, steps: list[StoredStep], after: int) -> dict[str, list[tuple[Any, ...]]]:
    """The rows of one batch: each table's, packed (AuditRows.tables).

    The cyclic garbage collector is paused meanwhile, as in coordinator.ledger.recovery.replay:
    the fold makes no cycles, and its collections rescanned the batch's growing rows (decoding
    took 4x longer with it on; ops/bench/audit.py). Nothing awaits in here, so no other task runs
    without it."""
    collecting = gc.isenabled()
    gc.disable()
    try:
        rows = AuditRows()
        for step in steps:
            _index_step(indexer, codec, rows, step, after)
            after = step.last_seq
        return rows.tables()
    finally:
        if collecting:
            gc.enable()


def _index_step(indexer: Indexer, codec: EventCodec, rows: AuditRows, step: StoredStep, after: int) -> None:
    """One stored step's events after `after`. An event this code cannot decode (a newer kvledger
    wrote it) is logged and skipped: forensic readers list and skip (DESIGN.md, "The log")."""
    first = max(step.first_seq, after + 1)
    if codec.all_current(step.schemas):
        try:
            events = codec.decode_concatenated(step.payload, step.count)
        except msgspec.DecodeError:
            pass
        else:
            indexer.step(
                rows,
                events[first - step.first_seq :],
                first_seq=first,
                last_seq=step.last_seq,
                stream_id=step.stream_id,
                step=step.step,
                recorded_at=step.recorded_at,
            )
            return
    indexer.step(
        rows, [], first_seq=first, last_seq=step.last_seq, stream_id=step.stream_id, step=step.step, recorded_at=step.recorded_at
    )
    engine = engine_of_stream(step.stream_id)
    for stored in step.events():
        if stored.global_seq < first:
            continue
        try:
            indexer.event(rows, decode(codec, stored), stored.global_seq, engine)
        except EventDecodeError as error:
            log.warning("audit_event_skipped", global_seq=stored.global_seq, event_type=stored.event_type, error=str(error))


_INSERT_ORDER: dict[str, Callable[[tuple[Any, ...]], Any]] = {
    "keys": operator.itemgetter(0),
    "key_blocks": operator.itemgetter(0),
    "slots": operator.itemgetter(0, 1, 2),
}
"""The tables whose index leads with a random key (a content key; a slot, scattered over the
pool), and that key: their rows are inserted in its order. A batch dirties a page of such an index
per row, up to the whole index; past INDEX_CACHE_KIB SQLite spills dirty pages mid-transaction, and
rows in log order came back to a spilled page and read it again. In key order each page is
finished before the next: the last 1M events of the bench's 10M-event log read 1,650 MiB instead
of 2,364 MiB (/proc/self/io rchar, ops/bench/audit.py). The sort is stable, so a key's rows keep
their log order; no query reads rows in rowid order (each orders by its sequences, and the
bench's sample of published keys scans the (key, kind, seq) index)."""


def _insert(conn: sa.Connection, tables: dict[str, list[tuple[Any, ...]]]) -> None:
    """Plain tuples through the driver's executemany: one call per table, no per-row dicts."""
    postgresql = conn.dialect.name == "postgresql"
    for name, found in tables.items():
        if found:
            if postgresql:
                found = _without_nul(found)
            order = _INSERT_ORDER.get(name)
            conn.exec_driver_sql(_insert_sql(name, conn.dialect.paramstyle), found if order is None else sorted(found, key=order))


def _without_nul(rows: list[tuple[Any, ...]]) -> list[tuple[Any, ...]]:
    """The rows with each NUL of their strings written as U+FFFD: PostgreSQL's text holds no NUL,
    and one request id "a\\x00b" (the core takes any string there) failed every catch-up of the
    index, so every tenant's audit answered 503 (an adversarial review, session 31). The log keeps
    the string as it was sent; the index shows the replacement character where the NUL was."""
    return [
        tuple(value.replace("\x00", "\ufffd") if type(value) is str and "\x00" in value else value for value in row)
        if any(type(value) is str and "\x00" in value for value in row)
        else row
        for row in rows
    ]


def _insert_sql(name: str, paramstyle: str) -> str:
    columns = _COLUMNS[name]
    marks = [f"${i}" for i in range(1, len(columns) + 1)] if paramstyle == "numeric_dollar" else ["?"] * len(columns)
    conflict = " ON CONFLICT (namespace_id) DO NOTHING" if name == "namespaces" else ""  # a namespace may be declared again
    return f"INSERT INTO {_TABLES[name].name} ({', '.join(columns)}) VALUES ({', '.join(marks)}){conflict}"


async def _namespaces(event_log: SqlEventLog) -> dict[str, bytes]:
    """Each engine's namespace as of the index's checkpoint (the Indexer's only memory)."""
    query = (
        sa.select(t.audit_engines.c.engine, t.audit_engines.c.namespace_id)
        .where(t.audit_engines.c.kind == "declared")
        .order_by(t.audit_engines.c.seq)
    )
    async with event_log.engine.connect() as conn:
        return {row.engine: bytes(row.namespace_id) for row in await conn.execute(query) if row.namespace_id is not None}
