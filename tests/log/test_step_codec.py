"""A SQL log stores a step of 1 KiB or more with its header and payload compressed (LZ4,
kvl_steps.codec, migration 0008) and reads back every byte as it was appended; rows stored as
they are (every row before 0008, and small steps) read as before; a codec it does not know, or
corrupt compressed bytes, is an error naming the step; a downgrade keeps every byte."""

from __future__ import annotations

import pytest
import sqlalchemy as sa
from sqlalchemy.ext.asyncio import create_async_engine

import migrations
from coordinator.core.state import state_digest
from coordinator.ledger.recovery import replay
from events import EventCodec
from events.log import AppendBatch, PendingEvent, normalize, open_log, upgrade_log
from events.log._contract import pack_step
from events.log._step_rows import CODEC_LZ4, CODEC_RAW, COMPRESS_FROM
from tests.kit.log_writer import append_steps, pending_event, step_batch
from tests.log.test_codec import _sample_events
from tests.log.test_command_filter import _open
from tests.log.test_migrations import _on_connection

pytestmark = pytest.mark.anyio

STREAM = "engine/a"


async def _rows(url: str) -> list[tuple[int, int, int, int]]:
    """(first_seq, codec, header bytes, payload bytes) of every kvl_steps row, as stored."""
    engine = create_async_engine(normalize(url))
    try:
        async with engine.connect() as conn:
            query = "SELECT first_seq, codec, length(header), length(payload) FROM kvl_steps ORDER BY first_seq"
            return [tuple(row) for row in (await conn.execute(sa.text(query))).all()]
    finally:
        await engine.dispose()


def _packed_sizes(per_step: int) -> int:
    """Header and payload bytes of one step of `per_step` events, as packed before any codec."""
    _, header, payload = pack_step(step_batch(STREAM, 1, per_step).events)
    return len(header) + len(payload)


async def test_a_large_step_is_stored_compressed_and_reads_back_byte_for_byte(log_url: str) -> None:
    assert _packed_sizes(2) < COMPRESS_FROM <= _packed_sizes(64)
    event_log = await _open(log_url)
    try:
        await append_steps(event_log, STREAM, 1, 2)  # small: stored as it is
        await append_steps(event_log, STREAM, 1, 2)
        big = AppendBatch(stream_id=STREAM, expected_version=4, events=[pending_event(STREAM, 3, i) for i in range(64)])
        await event_log.append([big])
        rows = await _rows(log_url)
        assert [(seq, codec) for seq, codec, _, _ in rows] == [(1, CODEC_RAW), (3, CODEC_RAW), (5, CODEC_LZ4)]
        assert rows[2][2] + rows[2][3] < _packed_sizes(64) / 2  # the step's bytes, compressed
        for steps in (await event_log.read_steps(0, 100), await event_log.read_stream_steps(STREAM, 0, 100)):
            assert [step.first_seq for step in steps] == [1, 3, 5]
            stored = steps[2].events()
            assert [(event.event_id, event.payload, event.global_seq) for event in stored] == [
                (event.event_id, event.payload, 5 + index) for index, event in enumerate(big.events)
            ]
        assert [event.payload for event in await event_log.read(4, 3)] == [e.payload for e in big.events[:3]]
    finally:
        await event_log.close()


async def test_a_replay_of_compressed_steps_folds_what_it_folds_from_steps_stored_as_they_are(
    log_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    codec = EventCodec()
    encoded = [codec.encode(event) for event in _sample_events()]
    digests = []
    for compress_from in (COMPRESS_FROM, 10**12):
        pending = [
            PendingEvent(
                event_id=f"id-{index}-{compress_from}",
                step=1,
                recorded_at=1.0,
                event_type=kind,
                schema_version=version,
                payload=payload,
            )
            for index, (kind, version, payload) in enumerate(encoded)
        ]
        monkeypatch.setattr("events.log._step_rows.COMPRESS_FROM", compress_from)
        event_log = await _open(log_url)
        try:
            stream = f"engine/{compress_from}"
            [result] = await event_log.append([AppendBatch(stream_id=stream, expected_version=0, events=pending)])
            state, last = await replay(event_log, codec, after_seq=result.first_seq - 1)
            assert last == result.last_seq
            digests.append(state_digest(state))
        finally:
            await event_log.close()
    assert [codec for _, codec, _, _ in await _rows(log_url)] == [CODEC_LZ4, CODEC_RAW]
    assert digests[0] == digests[1]


@pytest.mark.parametrize(
    ("change", "error"),
    [
        ("codec = 7", "stored with codec 7, which this kvledger does not know"),
        ("payload = substr(payload, 1, 40)", "its LZ4 bytes are corrupt"),
    ],
)
async def test_a_step_this_kvledger_cannot_read_is_an_error_naming_it(log_url: str, change: str, error: str) -> None:
    event_log = await _open(log_url)
    try:
        await event_log.append([step_batch(STREAM, 1, 64)])
        await append_steps(event_log, STREAM, 1, 64)
    finally:
        await event_log.close()
    await _on_connection(log_url, lambda conn: conn.execute(sa.text(f"UPDATE kvl_steps SET {change} WHERE first_seq = 65")))
    event_log = await _open(log_url)
    try:
        assert [step.first_seq for step in await event_log.read_steps(0, 64)] == [1]  # the step before still reads
        with pytest.raises(ValueError, match=f"step at global sequence 65 of stream 'engine/a'.*{error}"):
            await event_log.read_steps(0, 200)
        with pytest.raises(ValueError, match="step at global sequence 65"):
            await event_log.read_stream_steps(STREAM, 0, 10)
    finally:
        await event_log.close()


async def test_0008_downgrade_writes_compressed_steps_back_as_they_were_packed(log_url: str) -> None:
    event_log = await _open(log_url)
    try:
        await append_steps(event_log, STREAM, 3, 64)
        await append_steps(event_log, STREAM, 1, 1)
        before = [(step.header, step.payload) for step in await event_log.read_steps(0, 1_000)]
    finally:
        await event_log.close()
    assert [codec for _, codec, _, _ in await _rows(log_url)] == [CODEC_LZ4] * 3 + [CODEC_RAW]
    stored: list[tuple[bytes, bytes]] = []

    def down_and_read(conn: sa.Connection) -> None:
        migrations.downgrade(conn, "0007")
        assert "codec" not in {column["name"] for column in sa.inspect(conn).get_columns("kvl_steps")}
        stored.extend(tuple(row) for row in conn.execute(sa.text("SELECT header, payload FROM kvl_steps ORDER BY first_seq")))

    await _on_connection(log_url, down_and_read)
    assert stored == before
    assert await upgrade_log(log_url) == migrations.head()  # and up again: the rows read as they are
    event_log = await open_log(log_url)
    try:
        assert [(step.header, step.payload) for step in await event_log.read_steps(0, 1_000)] == before
    finally:
        await event_log.close()
