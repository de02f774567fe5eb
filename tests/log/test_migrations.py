"""Schema migrations keep every committed event: revision 0002 moves the row-per-event log of
0001 into step rows, and its downgrade moves them back, byte for byte, on every backend."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import sqlalchemy as sa
from sqlalchemy.ext.asyncio import create_async_engine

import migrations
from coordinator.core.projector import project
from coordinator.core.state import state_digest
from coordinator.ledger.recovery import replay
from events import EventCodec
from events.log import AppendBatch, PendingEvent, normalize, open_log, upgrade_log
from tests.log.test_codec import _sample_events

pytestmark = pytest.mark.anyio

_COLUMNS = (
    "global_seq",
    "event_id",
    "stream_id",
    "stream_version",
    "step",
    "recorded_at",
    "event_type",
    "schema_version",
    "payload",
)
Row = tuple[int, str, str, int, int, float, str, int, bytes]


def _old_rows() -> list[Row]:
    """Real events as revision 0001 stored them: a row each, two streams interleaved."""
    codec = EventCodec()
    rows: list[Row] = []
    versions = {"engine/e": 0, "tier/host": 0}
    for seq, event in enumerate(_sample_events(), start=1):
        stream = "tier/host" if seq % 5 == 0 else "engine/e"
        versions[stream] += 1
        event_type, version, payload = codec.encode(event)
        rows.append((seq, f"id-{seq}", stream, versions[stream], seq // 3, 1000.0 + seq, event_type, version, payload))
    return rows


async def _on_connection(url: str, work: Callable[[sa.Connection], object]) -> None:
    engine = create_async_engine(normalize(url))
    try:
        async with engine.begin() as conn:
            await conn.run_sync(work)
    finally:
        await engine.dispose()


async def test_0002_moves_row_per_event_logs_into_steps_and_back_byte_for_byte(log_url: str) -> None:
    rows = _old_rows()
    events_0001 = sa.table("kvl_events", *(sa.column(c) for c in _COLUMNS))

    def write_0001(conn: sa.Connection) -> None:
        migrations.upgrade(conn, "0001")
        conn.execute(events_0001.insert(), [dict(zip(_COLUMNS, row, strict=True)) for row in rows])
        streams = sa.table("kvl_streams", sa.column("stream_id"), sa.column("version"))
        conn.execute(
            streams.insert(), [{"stream_id": s, "version": sum(r[2] == s for r in rows)} for s in ("engine/e", "tier/host")]
        )

    await _on_connection(log_url, write_0001)
    assert await upgrade_log(log_url) == migrations.head()
    event_log = await open_log(log_url)
    try:
        stored = await event_log.read(0, 10_000)
        assert [tuple(getattr(s, c) for c in _COLUMNS) for s in stored] == rows
        state, last = await replay(event_log, EventCodec())
        assert last == len(rows)
        assert state_digest(state) == state_digest(project(_sample_events()))
        # The upgraded log goes on: the next append continues the global sequence and the stream.
        engine_version = sum(r[2] == "engine/e" for r in rows)
        new = PendingEvent(
            event_id="after-upgrade", step=99, recorded_at=2000.0, event_type=rows[0][6], schema_version=1, payload=rows[0][8]
        )
        [result] = await event_log.append([AppendBatch(stream_id="engine/e", expected_version=engine_version, events=[new])])
        assert (result.first_seq, result.stream_version) == (len(rows) + 1, engine_version + 1)
    finally:
        await event_log.close()

    back: list[tuple[object, ...]] = []

    def read_0001(conn: sa.Connection) -> None:
        migrations.downgrade(conn, "0001")
        back.extend(tuple(r) for r in conn.execute(sa.select(events_0001).order_by(events_0001.c.global_seq)))

    await _on_connection(log_url, read_0001)
    assert back[: len(rows)] == rows
    assert back[-1][:4] == (len(rows) + 1, "after-upgrade", "engine/e", engine_version + 1)
