"""Benchmark: audit point-query latency on a large log (issue 7's target: p99 <= 50 ms on a log
of at least 10,000,000 events).

    .venv/bin/python ops/bench/audit.py [--events 10000000] [--queries 300] [--log PATH]

1. Builds a SQLite log of `--events` events with the real decider (ops/bench/workload.py: one
   engine, shared prompts, stores, loads, preemptions, reports), appended a step at a time, in
   chunks so memory stays flat. With `--log PATH` an existing file is reused (and kept).
2. Builds the audit index (coordinator/audit/store.py) from scratch: rows/s.
3. Runs `--queries` point queries of each kind at random points: `audit block` at a random
   sequence, `audit key`, `audit request`, and `audit refusals --since-seq` (100 rows); prints
   p50/p99/max per kind, and whether p99 <= 50 ms. `--reuse-index` keeps an index built by an
   earlier run.

Figures go to stdout, progress to stderr. The load average is printed: a busy machine is slow.
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
import time
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import anyio  # noqa: E402
import sqlalchemy as sa  # noqa: E402
import structlog  # noqa: E402
import uuid_utils  # noqa: E402
from figures import core_build, load, out, percentile, progress  # noqa: E402
from workload import ENGINE, Workload  # noqa: E402

from coordinator.audit.queries import Audit  # noqa: E402
from coordinator.audit.store import IndexProgress, sync_index  # noqa: E402
from events import EventCodec, StepBegan  # noqa: E402
from events.log import AppendBatch, PendingEvent, SqlEventLog, open_log  # noqa: E402
from events.log.schema import metadata  # noqa: E402

TARGET_MS = 50.0
AUDIT_TABLES = sorted(name for name in metadata.tables if name.startswith("kvl_audit_"))
CHUNK = 200_000


async def build_log(event_log: SqlEventLog, count: int, seed: int) -> None:
    """Decide `count` events with the real decider and append them, one engine step an append."""
    workload = Workload(seed=seed)
    codec = EventCodec()
    version, written, step, clock = 0, 0, 0, 0.0
    with progress() as bar:
        task = bar.add_task("deciding and appending", total=count)
        while written < count:
            while len(workload.core.events) < CHUNK:
                workload.step_once()
            events, workload.core.events = workload.core.events, []
            batch: list[PendingEvent] = []
            for event in events:
                if isinstance(event, StepBegan) and batch:
                    version = await _append(event_log, batch, version)
                    batch = []
                if isinstance(event, StepBegan):
                    step, clock = event.step, event.clock
                event_type, schema_version, payload = codec.encode(event)
                batch.append(
                    PendingEvent(
                        event_id=uuid_utils.uuid7().hex,
                        step=step,
                        recorded_at=1.8e9 + clock,
                        event_type=event_type,
                        schema_version=schema_version,
                        payload=payload,
                    )
                )
            if batch:
                version = await _append(event_log, batch, version)
            written += len(events)
            bar.update(task, completed=min(written, count))


async def _append(event_log: SqlEventLog, batch: list[PendingEvent], version: int) -> int:
    await event_log.append(
        [AppendBatch(stream_id=f"engine/{ENGINE}", expected_version=version, events=batch, command_id=uuid.uuid4().hex)]
    )
    return version + len(batch)


async def timed_queries(name: str, count: int, make: Callable[[random.Random], Awaitable[Any]], rng: random.Random) -> None:
    latencies = []
    for _ in range(count):
        start = time.perf_counter()
        await make(rng)
        latencies.append((time.perf_counter() - start) * 1000)
    latencies.sort()
    p99 = percentile(latencies, 0.99)
    out(
        f"audit {name:<9} {count} queries: p50 {percentile(latencies, 0.5):.2f} ms, p99 {p99:.2f} ms, "
        f"max {latencies[-1]:.2f} ms; target p99 <= {TARGET_MS:.0f} ms: {'met' if p99 <= TARGET_MS else 'MISSED'}"
    )


async def run(args: argparse.Namespace) -> None:
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(30))
    directory = tempfile.TemporaryDirectory(prefix="kvl-bench-audit-")
    path = Path(args.log) if args.log else Path(directory.name) / "log.sqlite"
    event_log = await open_log(str(path))
    try:
        head = await event_log.head()
        if head < args.events:
            started = time.perf_counter()
            await build_log(event_log, args.events - head, args.seed)
            head = await event_log.head()
            out(f"log: {head:,} events built in {time.perf_counter() - started:.0f} s ({path})")
        else:
            out(f"log: {head:,} events, reused ({path})")
        if args.build_only:
            return
        if not args.reuse_index:
            async with event_log.engine.begin() as conn:  # index from scratch
                for table in AUDIT_TABLES:
                    await conn.execute(sa.text(f"DELETE FROM {table}"))
                await conn.execute(sa.text("DELETE FROM kvl_checkpoints WHERE name = 'audit'"))
        rows = 0
        with progress() as bar:
            task = bar.add_task("building the audit index", total=head)

            def advanced(done: IndexProgress) -> None:
                nonlocal rows
                rows = done.rows
                bar.update(task, completed=done.indexed_seq)

            started = time.perf_counter()
            await sync_index(event_log, on_progress=advanced)
            elapsed = time.perf_counter() - started
        if rows:
            out(f"index: {rows:,} rows for {head:,} events in {elapsed:.0f} s: {head / elapsed:,.0f} events/s")
            out(f"index build {head / elapsed:.0f} events/s")
        await queries(event_log, head, args.queries, args.seed)
    finally:
        await event_log.close()
        directory.cleanup()
    out(load())
    out(core_build())


async def queries(event_log: SqlEventLog, head: int, count: int, seed: int) -> None:
    audit = Audit(event_log)
    rng = random.Random(seed)
    async with event_log.engine.connect() as conn:
        # Sampled with the seeded generator, not SQLite's random(): each run asks about the same
        # keys and requests, so query figures compare between runs and commits.
        async def sample(table: str, column: str, kind: str) -> list[Any]:
            rowids = [r[0] for r in await conn.execute(sa.text(f"SELECT rowid FROM {table} WHERE kind = :kind"), {"kind": kind})]
            chosen = rng.sample(rowids, min(count, len(rowids)))
            if not chosen:
                return []
            listed = ",".join(map(str, chosen))
            rows = await conn.execute(sa.text(f"SELECT rowid, {column} FROM {table} WHERE rowid IN ({listed})"))
            found = {rowid: value for rowid, value in rows}
            return [found[rowid] for rowid in chosen]

        keys = [bytes(key).hex() for key in await sample("kvl_audit_keys", "key", "published")]
        req_ids = await sample("kvl_audit_owners", "req_id", "started")
        pools = {
            int(r[0]): int(r[1])
            for r in await conn.execute(sa.text("SELECT pool, max(block) FROM kvl_audit_slots GROUP BY pool"))
        }

    async def block(r: random.Random) -> Any:
        pool = r.choice(sorted(pools))
        return await audit.block(ENGINE, pool, r.randint(1, pools[pool]), r.randint(1, head))

    async def key(r: random.Random) -> Any:
        return await audit.key(r.choice(keys))

    async def request(r: random.Random) -> Any:
        return await audit.request(r.choice(req_ids))

    async def refusals(r: random.Random) -> Any:
        return await audit.refusals(since_seq=r.randint(0, head), limit=100)

    for name, make in (("block", block), ("key", key), ("request", request), ("refusals", refusals)):
        await timed_queries(name, count, make, rng)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--events", type=int, default=10_000_000)
    parser.add_argument("--queries", type=int, default=300)
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--log", help="Reuse (and keep) this SQLite log; it is extended to --events if shorter.")
    parser.add_argument("--build-only", action="store_true", help="Only build the log (with --log: to reuse it later).")
    parser.add_argument(
        "--reuse-index", action="store_true", help="Keep the log's audit index (only catch it up) instead of rebuilding it."
    )
    args = parser.parse_args()
    anyio.run(run, args)


if __name__ == "__main__":
    main()
