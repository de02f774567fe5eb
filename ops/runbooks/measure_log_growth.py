"""Measure what the log costs on disk per event and per step, on SQLite and on PostgreSQL, before
and after the audit index is built: the figures in ops/runbooks/capacity-and-retention.md.

    .venv/bin/python ops/runbooks/measure_log_growth.py [--events 200000] [--seed 7]

The events come from the real decider driving a serving workload (ops/bench/workload.py: one
engine, 4,096 blocks, prefills, decodes, stores, loads, evictions), encoded as the sidecar
encodes them, and appended one engine step per append, as the sidecar does with no group
commit. SQLite is a file in a temporary directory; PostgreSQL is a database created on
$KVLEDGER_TEST_PG (default postgresql://postgres@127.0.0.1:5432/test) and dropped at the end
(skipped, saying why, when that server does not answer). Sizes are the pages each table and
index occupies (SQLite's dbstat; PostgreSQL's pg_total_relation_size, after VACUUM ANALYZE).
"""

from __future__ import annotations

import argparse
import os
import sqlite3
import sys
import tempfile
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path

import anyio
import asyncpg
import structlog
import uuid_utils

ROOT = Path(__file__).resolve().parent.parent.parent
sys.path.insert(0, str(ROOT / "ops" / "bench"))

from workload import ENGINE, Workload  # noqa: E402

from coordinator.audit.store import sync_index  # noqa: E402
from events import EventCodec, StepBegan  # noqa: E402
from events.log import AppendBatch, PendingEvent, SqlEventLog, open_log, upgrade_log  # noqa: E402

PG_URL = os.environ.get("KVLEDGER_TEST_PG", "postgresql://postgres@127.0.0.1:5432/test")


def steps_of(count: int, seed: int) -> list[list[PendingEvent]]:
    """At least `count` events from the decider, grouped by engine step (one append each)."""
    workload = Workload(seed=seed)
    for _ in workload.run(count):
        pass
    codec = EventCodec()
    steps: list[list[PendingEvent]] = []
    step, clock = 0, 0.0
    for event in workload.core.events:
        if isinstance(event, StepBegan) or not steps:
            steps.append([])
            if isinstance(event, StepBegan):
                step, clock = event.step, event.clock
        event_type, schema_version, payload = codec.encode(event)
        steps[-1].append(
            PendingEvent(
                event_id=uuid_utils.uuid7().hex,
                step=step,
                recorded_at=clock,
                event_type=event_type,
                schema_version=schema_version,
                payload=payload,
            )
        )
    return steps


async def fill(event_log: SqlEventLog, steps: list[list[PendingEvent]]) -> None:
    version = 0
    for events in steps:
        await event_log.append(
            [AppendBatch(stream_id=ENGINE, expected_version=version, events=events, command_id=uuid.uuid4().hex)]
        )
        version += len(events)


async def sqlite_sizes(url: str) -> tuple[int, int]:
    """(log tables and their indexes, audit index tables and theirs), in bytes of pages used."""
    with sqlite3.connect(url) as db:
        db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        rows = db.execute("SELECT name, SUM(pgsize) FROM dbstat GROUP BY name").fetchall()
    audit = sum(size for name, size in rows if "audit" in name)
    return sum(size for _, size in rows) - audit, audit


def sqlite_encoded(url: str, events: int) -> None:
    """The steps' encoded bytes alone: what one Kafka record carries, before its envelope."""
    with sqlite3.connect(url) as db:
        (encoded,) = db.execute("SELECT SUM(LENGTH(schemas) + LENGTH(header) + LENGTH(payload)) FROM kvl_steps").fetchone()
        # An event's id is a kvl_event_ids row, or inside its step's kvl_id_runs row (migration 0009).
        (ids,) = db.execute(
            "SELECT coalesce(SUM(pgsize), 0) FROM dbstat WHERE name LIKE '%kvl_event_ids%' OR name LIKE '%kvl_id_runs%'"
        ).fetchone()
    print(
        f"  encoded steps (schemas + header + payload): {encoded:,} B = {encoded / events:.0f} B/event; "
        f"the event-id tables (rows and runs): {ids:,} B = {ids / events:.0f} B/event"
    )


async def pg_sizes(url: str) -> tuple[int, int]:
    """The same on PostgreSQL: each table with its indexes and TOAST."""
    connection = await asyncpg.connect(url)
    try:
        await connection.execute("VACUUM ANALYZE")
        rows = await connection.fetch(
            "SELECT c.relname, pg_total_relation_size(c.oid) AS size FROM pg_class c "
            "JOIN pg_namespace n ON n.oid = c.relnamespace WHERE n.nspname = 'public' AND c.relkind = 'r'"
        )
    finally:
        await connection.close()
    audit = sum(row["size"] for row in rows if row["relname"].startswith("kvl_audit"))
    return sum(row["size"] for row in rows) - audit, audit


def report(backend: str, events: int, steps: int, log_bytes: int, index_bytes: int) -> None:
    print(f"{backend}: {events:,} events in {steps:,} appends ({events / steps:.1f} events a step)")
    print(
        f"  log (steps, event ids, commands, streams, snapshots): {log_bytes:,} B = {log_bytes / events:.0f} B/event, "
        f"{log_bytes / steps:,.0f} B/step"
    )
    print(
        f"  audit index (kvl_audit_*): {index_bytes:,} B = {index_bytes / events:.0f} B/event; "
        f"log + index {(log_bytes + index_bytes) / events:.0f} B/event"
    )


async def measure(
    backend: str, url: str, steps: list[list[PendingEvent]], sizes: Callable[[str], Awaitable[tuple[int, int]]]
) -> None:
    events = sum(len(s) for s in steps)
    await upgrade_log(url)
    event_log = await open_log(url)
    try:
        await fill(event_log, steps)
        before = await sizes(url)
        if backend == "sqlite":
            sqlite_encoded(url, events)
        await sync_index(event_log)
    finally:
        await event_log.close()
    after = await sizes(url)
    report(backend, events, len(steps), before[0], after[1])


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--events", type=int, default=200_000)
    parser.add_argument("--seed", type=int, default=7)
    args = parser.parse_args()
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(40))
    steps = steps_of(args.events, args.seed)
    with tempfile.TemporaryDirectory() as directory:
        path = Path(directory) / "log.sqlite"
        await measure("sqlite", str(path), steps, sqlite_sizes)
    try:
        admin = await asyncpg.connect(PG_URL)
    except (OSError, asyncpg.PostgresError) as error:
        print(f"postgresql: skipped, {PG_URL} does not answer ({error})")
        return
    database = f"kvl_size_{uuid.uuid4().hex[:12]}"
    await admin.execute(f'CREATE DATABASE "{database}"')
    try:
        await measure("postgresql", f"{PG_URL.rsplit('/', 1)[0]}/{database}", steps, pg_sizes)
    finally:
        await admin.execute(f'DROP DATABASE IF EXISTS "{database}" WITH (FORCE)')
        await admin.close()


if __name__ == "__main__":
    anyio.run(main)
