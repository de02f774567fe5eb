"""Step rows stored as LZ4 blocks (events/log/_compression.py, migration 0008), on SQLite and
PostgreSQL: what a reader gets back is byte for byte what was appended; rows written before 0008
read as they are; a row whose stored bytes are corrupt is refused naming its global sequences,
and forensic replay skips exactly its events while the rest of the log still reads."""

from __future__ import annotations

import random
import re
from collections.abc import Callable
from typing import TypeVar

import lz4.block
import pytest
import sqlalchemy as sa
from sqlalchemy.ext.asyncio import create_async_engine

import migrations
from coordinator.core.projector import project
from coordinator.ledger.recovery import replay
from events import EventCodec, EventDecodeError, TierDeclared, TierSpec
from events.log import AppendBatch, PendingEvent, StoredEvent, normalize, open_log, upgrade_log
from events.log._compression import LZ4, NONE, RowUnreadable, compress_row, decompress_row
from events.log._contract import pack_step

pytestmark = pytest.mark.anyio
T = TypeVar("T")

STORED = ("event_id", "step", "recorded_at", "event_type", "schema_version", "payload")


def _tiers(prefix: str, count: int, step: int) -> list[PendingEvent]:
    """`count` real events (tier declarations: what the log's own tests fold), one step's worth."""
    codec = EventCodec()
    pending = []
    for index in range(count):
        event = TierDeclared(spec=TierSpec(name=f"{prefix}-{index}", num_slots=8 + index, bytes_per_slot=4096))
        event_type, version, payload = codec.encode(event)
        pending.append(
            PendingEvent(
                event_id=f"{prefix}-id-{index:04d}",
                step=step,
                recorded_at=1000.0 + step,
                event_type=event_type,
                schema_version=version,
                payload=payload,
            )
        )
    return pending


def _as_appended(stored: list[StoredEvent]) -> list[tuple[object, ...]]:
    return [tuple(getattr(event, name) for name in STORED) for event in stored]


async def _on_connection(url: str, work: Callable[[sa.Connection], T]) -> T:
    engine = create_async_engine(normalize(url))
    try:
        async with engine.begin() as conn:
            return await conn.run_sync(work)
    finally:
        await engine.dispose()


def _rows(conn: sa.Connection) -> list[tuple[int, int, bytes, bytes]]:
    query = "SELECT first_seq, compression, header, payload FROM kvl_steps ORDER BY first_seq"
    return [(row[0], row[1], bytes(row[2]), bytes(row[3])) for row in conn.exec_driver_sql(query)]


async def _open(log_url: str):  # type: ignore[no-untyped-def]
    if log_url.startswith("postgresql"):
        await upgrade_log(log_url)
    return await open_log(log_url)


def test_a_row_lz4_cannot_shrink_is_kept_as_it_is_and_a_compressible_one_comes_back_byte_for_byte() -> None:
    schemas, header, payload = pack_step(_tiers("host", 64, step=3))
    compression, stored_header, stored_payload = compress_row(header, payload)
    assert compression == LZ4
    assert len(stored_header) + len(stored_payload) < (len(header) + len(payload)) / 2
    assert decompress_row(compression, stored_header, stored_payload) == (header, payload)

    noise = random.Random(7).randbytes(300)  # nothing for LZ4 to find
    assert compress_row(b"\x91\x01", noise) == (NONE, b"\x91\x01", noise)
    assert decompress_row(NONE, b"\x91\x01", noise) == (b"\x91\x01", noise)


def test_corrupt_blocks_and_unknown_compressions_are_refused_naming_what_is_wrong() -> None:
    _, header, payload = pack_step(_tiers("host", 64, step=3))
    _, stored_header, stored_payload = compress_row(header, payload)

    with pytest.raises(RowUnreadable, match="compression is 7, which this code does not know"):
        decompress_row(7, stored_header, stored_payload)
    # A size prefix no LZ4 block can reach is refused before anything is allocated for it.
    huge = (2**31).to_bytes(4, "little") + stored_payload[4:]
    with pytest.raises(RowUnreadable, match=r"payload's LZ4 block says 2,147,483,648 bytes"):
        decompress_row(LZ4, stored_header, huge)
    with pytest.raises(RowUnreadable, match="header's LZ4 block does not decompress"):
        decompress_row(LZ4, stored_header[:4] + b"\xff" * (len(stored_header) - 4), stored_payload)
    with pytest.raises(RowUnreadable, match="header's LZ4 block says"):
        decompress_row(LZ4, b"\x01", stored_payload)


async def test_appended_steps_are_stored_compressed_and_read_back_byte_for_byte(log_url: str) -> None:
    big, small = _tiers("big", 64, step=1), _tiers("small", 1, step=2)
    event_log = await _open(log_url)
    try:
        await event_log.append([AppendBatch(stream_id="engine/e", expected_version=0, events=big)])
        await event_log.append([AppendBatch(stream_id="engine/e", expected_version=64, events=small)])
        assert _as_appended(await event_log.read(0, 1000)) == _as_appended_pending(big + small)
        rows = await _on_connection(log_url, _rows)
    finally:
        await event_log.close()

    assert [(first_seq, compression) for first_seq, compression, _, _ in rows] == [(1, LZ4), (65, NONE)]
    _, _, header, payload = rows[0]
    assert (lz4.block.decompress(header), lz4.block.decompress(payload)) == pack_step(big)[1:]
    assert rows[1][2:] == pack_step(small)[1:]


def _as_appended_pending(pending: list[PendingEvent]) -> list[tuple[object, ...]]:
    return [tuple(getattr(event, name) for name in STORED) for event in pending]


async def test_rows_written_before_0008_read_as_they_are_and_the_downgrade_decompresses_the_rest(log_url: str) -> None:
    old = _tiers("old", 32, step=1)
    schemas, header, payload = pack_step(old)

    def write_0007(conn: sa.Connection) -> None:
        migrations.upgrade(conn, "0007")
        conn.execute(
            sa.text(
                "INSERT INTO kvl_steps (first_seq, last_seq, stream_id, first_version, step, recorded_at, schemas, "
                "header, payload) VALUES (1, 32, 'engine/e', 1, 1, 1001.0, :schemas, :header, :payload)"
            ),
            {"schemas": schemas, "header": header, "payload": payload},
        )
        conn.execute(sa.text("INSERT INTO kvl_streams (stream_id, version) VALUES ('engine/e', 32)"))

    await _on_connection(log_url, write_0007)
    assert await upgrade_log(log_url) == migrations.head()
    new = _tiers("new", 32, step=2)
    event_log = await open_log(log_url)
    try:
        assert _as_appended(await event_log.read(0, 1000)) == _as_appended_pending(old)
        await event_log.append([AppendBatch(stream_id="engine/e", expected_version=32, events=new)])
        assert _as_appended(await event_log.read(0, 1000)) == _as_appended_pending(old + new)
        state, last = await replay(event_log, EventCodec())
    finally:
        await event_log.close()
    assert last == 64
    assert sorted(state.tiers) == sorted([f"old-{n}" for n in range(32)] + [f"new-{n}" for n in range(32)])
    assert [compression for _, compression, _, _ in await _on_connection(log_url, _rows)] == [NONE, LZ4]

    def back_to_0007(conn: sa.Connection) -> list[tuple[object, ...]]:
        migrations.downgrade(conn, "0007")
        query = "SELECT first_seq, header, payload FROM kvl_steps ORDER BY first_seq"
        return [(row[0], bytes(row[1]), bytes(row[2])) for row in conn.exec_driver_sql(query)]

    assert await _on_connection(log_url, back_to_0007) == [(1, header, payload), (33, *pack_step(new)[1:])]


async def test_a_corrupt_compressed_row_names_its_global_sequences_and_forensic_replay_skips_it(log_url: str) -> None:
    steps = [_tiers(f"s{n}", 16, step=n) for n in range(3)]
    event_log = await _open(log_url)
    try:
        version = 0
        for events in steps:
            await event_log.append([AppendBatch(stream_id="engine/e", expected_version=version, events=events)])
            version += len(events)

        def corrupt_the_middle_step(conn: sa.Connection) -> None:
            [(compression, payload)] = conn.exec_driver_sql("SELECT compression, payload FROM kvl_steps WHERE first_seq = 17")
            assert compression == LZ4
            broken = bytes(payload[:4]) + b"\xff" * (len(payload) - 4)
            conn.execute(sa.text("UPDATE kvl_steps SET payload = :payload WHERE first_seq = 17"), {"payload": broken})

        await _on_connection(log_url, corrupt_the_middle_step)

        with pytest.raises(EventDecodeError) as refused:
            await replay(event_log, EventCodec())
        message = str(refused.value)
        assert refused.value.position == 17
        assert "'engine/e'" in message and re.search(r"\b17-32\b", message), message
        assert "does not decompress" in message

        skipped: list[EventDecodeError] = []
        state, last = await replay(event_log, EventCodec(), skip_undecodable=True, on_skip=skipped.append)
        assert [error.position for error in skipped] == list(range(17, 33))
        assert last == 48
        expected = project([EventCodec().decode(e.event_type, e.schema_version, e.payload) for e in steps[0] + steps[2]])
        assert sorted(state.tiers) == sorted(expected.tiers)
        # The other steps still read, and the unreadable one is still in the log, as stored.
        readable = await event_log.read(0, 16)
        assert _as_appended(readable) == _as_appended_pending(steps[0])
        [unreadable] = await event_log.read_steps(16, 16)
        assert unreadable.unreadable and (unreadable.header, unreadable.payload) == (b"", b"")
    finally:
        await event_log.close()
