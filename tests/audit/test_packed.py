"""The packed rows of the audit index (coordinator/audit/index.py): one row per slot, owner or key
per batch, its entries packed. Where the batches and the slot windows fall decides which row holds
an entry, never an answer: the golden log indexed in one go and indexed in 53-event batches with
64-sequence windows (most slots then have many rows, and allocations sit at the start, in the
middle and at the end of rows) answers every query the same. Migration 0007 empties an index of
the older format, and the next catch-up rebuilds it."""

from __future__ import annotations

import random
import shutil
from pathlib import Path
from typing import Any

import anyio
import pytest
import sqlalchemy as sa
from sqlalchemy.ext.asyncio import create_async_engine

import migrations
from coordinator.audit import _packed, index, store
from coordinator.audit.index import AuditRows, Indexer, entries, unpack_owner_blocks, unpack_touches
from coordinator.audit.queries import Audit
from coordinator.audit.store import indexed_seq, sync_index
from coordinator.audit.timeline import load_timeline
from coordinator.simulator.report import mixed_workload
from events import BlockRef, BlocksAllocated, BlocksReleased, StepEnded
from events.log import PAGE_CACHE_KIB, SqlEventLog, normalize, open_log
from events.log.schema import metadata

pytestmark = pytest.mark.anyio

PACKED_TABLES = ("slots", "owner_blocks", "key_blocks")
AUDIT_TABLES = sorted(name for name in metadata.tables if name.startswith("kvl_audit_"))


@pytest.fixture(scope="module")
def golden(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("golden")
    anyio.run(lambda: mixed_workload(engines=2, steps=60, keep=directory))
    return directory / "log.sqlite"


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def copy_of(golden: Path, directory: Path) -> Path:
    directory.mkdir()
    target = directory / "log.sqlite"
    shutil.copy(golden, target)
    return target


# --- the rows of one batch (pure) ---------------------------------------------------------------


def test_a_batch_packs_one_row_per_slot_and_window_and_per_owner() -> None:
    rows, indexer = AuditRows(), Indexer()
    window_end = (1 << index.SLOT_WINDOW_BITS) - 1
    first, second = BlockRef(0, 5, 1), BlockRef(0, 6, 3)
    indexer.event(rows, BlocksAllocated(engine_id="e", owner_id=7, blocks=[first, second]), window_end - 1, "e")
    indexer.event(rows, BlocksReleased(engine_id="e", owner_id=7, blocks=[first]), window_end, "e")
    indexer.event(
        rows,
        StepEnded(engine_id="e", step=1, freed_blocks=[first], freed_encoder_entries=[], removed_keys=[]),
        window_end + 1,
        "e",
    )
    tables = rows.tables()
    slots = {(row[2], row[3]): row for row in tables["slots"]}
    # Block 5: allocated and released in one window, freed in the next: two rows.
    assert sorted(slots) == [(5, window_end - 1), (5, window_end + 1), (6, window_end - 1)]
    allocated = slots[(5, window_end - 1)]
    assert allocated[3:7] == (window_end - 1, window_end, window_end - 1, 1)  # first, last, first allocated, allocations
    assert unpack_touches(allocated[7]) == [
        (window_end - 1, "allocated", 1, 7, None, None),
        (window_end, "released", 1, 7, None, None),
    ]
    freed = slots[(5, window_end + 1)]
    assert freed[5:7] == (None, 0) and unpack_touches(freed[7]) == [(window_end + 1, "freed", 1, None, None, None)]
    [owner] = tables["owner_blocks"]
    assert owner[:3] == ("e", 7, window_end - 1)
    assert unpack_owner_blocks(owner[3]) == [(window_end - 1, "allocated", 0, 5, 1), (window_end - 1, "allocated", 0, 6, 3)]
    assert entries("owner_blocks", owner) == [
        ("e", 7, window_end - 1, "allocated", 0, 5, 1),
        ("e", 7, window_end - 1, "allocated", 0, 6, 3),
    ]


def test_an_event_with_no_blocks_makes_no_row() -> None:
    rows = AuditRows()
    Indexer().event(rows, BlocksAllocated(engine_id="e", owner_id=7, blocks=[]), 3, "e")
    assert not any(rows.tables()[name] for name in PACKED_TABLES)


# --- batches and windows change rows, not answers ------------------------------------------------


def test_a_batch_ends_at_the_last_window_end_within_it_and_never_crosses_one() -> None:
    window = 1 << index.SLOT_WINDOW_BITS
    # Four windows from a window's start (the default batch): they end together.
    assert store.batch_end(0, store.BATCH) == store.BATCH - 1
    assert store.batch_end(window - 1, 4 * window) == 5 * window - 1
    # A batch that began inside a window (its step crossed the window's end) ends at the last
    # window end within it, not beyond: the windows after stay whole for the next batch.
    assert store.batch_end(window + 5, 4 * window) == 5 * window - 1
    # A batch smaller than a window ends at the window's end when it falls within it, else at its size.
    assert store.batch_end(window - 10, 53) == window - 1
    assert store.batch_end(window + 3, 53) == window + 56
    for after in random.Random(3).sample(range(10 * window), 200):
        for batch in (53, window, 3 * window + 7):
            end = store.batch_end(after, batch)
            assert after < end <= after + batch
            # It ends at a window's end, or lies within one window: no window is split.
            assert (end + 1) % window == 0 or (after + 1) // window == end // window


async def answers(event_log: SqlEventLog) -> dict[str, Any]:
    """Every kind of answer, on points and subjects drawn the same way from any index of the log."""
    audit = Audit(event_log)
    head = await event_log.head()
    found: dict[str, Any] = {"blocks": [], "histories": [], "keys": [], "requests": [], "timelines": []}
    async with event_log.engine.connect() as conn:
        slots = sorted(
            {tuple(r) for r in await conn.execute(sa.text("SELECT DISTINCT engine, pool, block FROM kvl_audit_slots"))}
        )
        keys = sorted({bytes(r[0]).hex() for r in await conn.execute(sa.text("SELECT key FROM kvl_audit_key_blocks"))})
        keys += sorted({bytes(r[0]).hex() for r in await conn.execute(sa.text("SELECT key FROM kvl_audit_keys"))})
        req_ids = sorted(
            {r[0] for r in await conn.execute(sa.text("SELECT req_id FROM kvl_audit_owners WHERE kind = 'started'"))}
        )
    rng = random.Random(11)
    for engine, pool, block in slots:
        found["histories"].append(await audit.history(engine, pool, block))
        for seq in sorted(rng.sample(range(1, head + 1), 12)) + [head]:
            found["blocks"].append(await audit.block(engine, pool, block, seq))
    for key in keys:
        found["keys"].append(await audit.key(key))
    for req_id in req_ids:
        found["requests"].append(await audit.request(req_id))
    for engine in await audit.engines():
        for first_step, last_step in ((1, 60), (7, 9), (20, 45), (59, 60)):
            found["timelines"].append(
                await load_timeline(event_log, pool=0, first_step=first_step, last_step=last_step, engine=engine)
            )
    found["namespaces"] = await audit.namespaces(now=0.0)
    found["refusals"] = await audit.refusals()
    return found


async def index_entries(event_log: SqlEventLog) -> dict[str, list[tuple[Any, ...]]]:
    async with event_log.engine.connect() as conn:
        return {
            table: sorted(
                (entry for row in await conn.execute(sa.text(f"SELECT * FROM {table}")) for entry in entries(table[10:], row)),
                key=repr,
            )
            for table in AUDIT_TABLES
        }


async def test_answers_do_not_depend_on_where_batches_and_windows_fall(
    golden: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    whole = await open_log(str(copy_of(golden, tmp_path / "whole")))
    try:
        await sync_index(whole)
        expected, expected_entries = await answers(whole), await index_entries(whole)
        async with whole.engine.connect() as conn:
            whole_rows = int((await conn.execute(sa.text("SELECT count(*) FROM kvl_audit_slots"))).scalar() or 0)
    finally:
        await whole.close()
    for module in (index, store, _packed):
        monkeypatch.setattr(module, "SLOT_WINDOW_BITS", 6)
    pieces = await open_log(str(copy_of(golden, tmp_path / "pieces")))
    try:
        assert await sync_index(pieces, batch=53) == await pieces.head()
        async with pieces.engine.connect() as conn:
            shape = (
                await conn.execute(
                    sa.text(
                        "SELECT count(*), sum(first_allocated > first_seq), sum(allocations > 1),"
                        " max(last_seq - first_seq) FROM kvl_audit_slots"
                    )
                )
            ).one()
        # Many more rows, allocations inside rows and rows with several, no row past its window.
        assert shape[0] > 3 * whole_rows and shape[1] > 0 and shape[2] > 0 and shape[3] < 64, shape
        assert await index_entries(pieces) == expected_entries
        got = await answers(pieces)
        assert all(got[kind] for kind in ("blocks", "histories", "keys", "requests", "timelines"))
        for kind, answered in expected.items():
            assert got[kind] == answered, kind
    finally:
        await pieces.close()


# --- migration 0007 -----------------------------------------------------------------------------


async def _on_connection(url: str, work: Any) -> Any:
    engine = create_async_engine(normalize(url))
    try:
        async with engine.begin() as conn:
            return await conn.run_sync(work)
    finally:
        await engine.dispose()


async def test_0007_empties_an_older_index_and_the_next_catch_up_rebuilds_it(golden: Path, tmp_path: Path) -> None:
    path = copy_of(golden, tmp_path / "log")
    event_log = await open_log(str(path))
    try:
        head = await sync_index(event_log)
        before = await answers(event_log)
    finally:
        await event_log.close()

    def downgrade(conn: sa.Connection) -> tuple[list[str], int, int]:
        migrations.downgrade(conn, "0006")
        columns = [c["name"] for c in sa.inspect(conn).get_columns("kvl_audit_slots")]
        checkpoint = conn.execute(sa.text("SELECT count(*) FROM kvl_checkpoints WHERE name = 'audit'")).scalar()
        keys = conn.execute(sa.text("SELECT count(*) FROM kvl_audit_keys")).scalar()
        return columns, int(checkpoint or 0), int(keys or 0)

    columns, checkpoint, keys = await _on_connection(str(path), downgrade)
    assert columns == ["engine", "pool", "block", "generation", "seq", "kind", "owner_id", "job_id", "key"]  # 0003's
    assert (checkpoint, keys) == (0, 0)
    # What an older kvledger's index would hold: rows and a checkpoint, in the row-per-touch format.
    await _on_connection(
        str(path),
        lambda conn: (
            conn.execute(sa.text("INSERT INTO kvl_audit_slots VALUES ('wl-0', 0, 1, 1, 5, 'allocated', 1, NULL, NULL)")),
            conn.execute(sa.text("INSERT INTO kvl_checkpoints (name, global_seq) VALUES ('audit', 5)")),
        ),
    )
    event_log = await open_log(str(path))  # SQLite upgrades itself to 0007
    try:
        assert await indexed_seq(event_log) == 0
        async with event_log.engine.connect() as conn:
            for table in AUDIT_TABLES:
                assert (await conn.execute(sa.text(f"SELECT count(*) FROM {table}"))).scalar() == 0, table
        assert await sync_index(event_log) == head
        assert await answers(event_log) == before
    finally:
        await event_log.close()


# --- the page cache of a batch -------------------------------------------------------------------


async def test_a_batch_leaves_its_connection_with_the_log_s_page_cache(golden: Path, tmp_path: Path) -> None:
    """A batch inserts with INDEX_CACHE_KIB of page cache; the pooled connection goes back with
    the log's own PAGE_CACHE_KIB (a query after a catch-up holds no more memory than before)."""
    event_log = await open_log(str(copy_of(golden, tmp_path / "log")))
    try:
        assert await sync_index(event_log, batch=97) == await event_log.head()
        async with event_log.engine.connect() as conn:
            assert (await conn.exec_driver_sql("PRAGMA cache_size")).scalar() == -PAGE_CACHE_KIB
    finally:
        await event_log.close()
