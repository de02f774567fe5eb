"""How a step's events become a kvl_steps row and back, on both SQL logs: the row's contents
packed (`pack_batches`: schemas, header, payload, compressed from COMPRESS_FROM bytes), and a row
read (`stored_step`, its columns as STEP_COLUMNS lists them)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import lz4.block

from events.log._append_plan import PackedStep
from events.log._contract import AppendBatch, StoredStep, pack_step

STEP_COLUMNS = "first_seq, last_seq, stream_id, first_version, schemas, header, payload, step, recorded_at, codec"
"""kvl_steps' columns as a SELECT names them for `stored_step`."""

CODEC_RAW = 0
CODEC_LZ4 = 1
"""kvl_steps.codec: header and payload as they are, or each compressed with LZ4 (block format, its
size in front: lz4.block's default). Migration 0008."""
COMPRESS_FROM = 1_024
"""Header and payload of at least this many bytes together are stored compressed. A 256-event step
of the decider's mix (ops/bench/log.py) packs 51 KB into 17 KB in ~40 us: an append writes a
third of the pages, a checkpoint copies and syncs a third; a smaller step fits its page as it is."""


def stored_step(row: Sequence[Any]) -> StoredStep:
    """A kvl_steps row read as `STEP_COLUMNS` lists them, its header and payload as they were packed."""
    first_seq, last_seq, stream_id, first_version, schemas, header, payload, step, recorded_at, codec = row
    if codec == CODEC_LZ4:
        try:
            header, payload = _decompress(header), _decompress(payload)
        except lz4.block.LZ4BlockError as error:
            raise ValueError(
                f"step at global sequence {first_seq} of stream {stream_id!r}: its LZ4 bytes are corrupt ({error})"
            ) from None
    elif codec != CODEC_RAW:
        raise ValueError(
            f"step at global sequence {first_seq} of stream {stream_id!r} is stored with codec {codec}, "
            f"which this kvledger does not know (it reads {CODEC_RAW}: as they are, {CODEC_LZ4}: LZ4)"
        )
    return StoredStep(first_seq, last_seq, stream_id, first_version, schemas, header, payload, step, recorded_at)


_compress = lz4.block.compress
_decompress = lz4.block.decompress


def pack_batches(batches: Sequence[AppendBatch]) -> list[PackedStep | None]:
    """Every batch's row contents (None for a batch with no events). Pure Python, no statement:
    the SQLite log runs it on the event loop's thread before handing the append to a worker
    thread. The GIL keeps the loop from running beside it either way, and there the events are
    still warm in the loop's core's caches: 300k events appended 256 a step one after another
    (ops/bench/peer_eventsourcing.py's append) ran 3-6% faster, three runs alternated, and
    ops/bench/sidecar.py was unchanged (issue 22).

    The append itself then runs on the log's own thread (events/log/_writer_thread.py). Session 19
    tried one and saw `ops/bench/sidecar.py --engines 4 --commands 32 --steps 300` lose ~10%; the
    one kept (session 27: a SimpleQueue, the result handed back with call_soon_threadsafe) ran it
    as fast as anyio's pool in six pairs alternated (median ~525 steps/s each way), the appends one
    after another 22% faster and the sidecar's step at an engine's pace 10-20% sooner."""
    packed: list[PackedStep | None] = []
    for batch in batches:
        events = batch.events
        if not events:
            packed.append(None)
            continue
        schemas, header, payload = pack_step(events)
        codec = CODEC_RAW
        if len(header) + len(payload) >= COMPRESS_FROM:
            header, payload, codec = _compress(header), _compress(payload), CODEC_LZ4
        packed.append((schemas, header, payload, [event.event_id for event in events], codec))
    return packed
