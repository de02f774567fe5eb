"""A step row's header and payload as the SQL log stores them: LZ4 blocks (issue 22).

An append's time went mostly to SQLite writing pages: its commit copies every page the step
touched into the WAL, and a checkpoint copies them again into the database file. A step's row
(msgpack entries naming each event, event ids that share their time prefix, payloads that repeat
their shapes) shrinks about 3x under LZ4's block format, for ~0.2 us an event to compress and
~0.05 us to decompress (ops/bench/peer_eventsourcing.py's events: 200 B an event to 66). A row
LZ4 cannot shrink (a one-event report, say) is stored as it is.

The row's `compression` column (migration 0008) says which: NONE for rows kept as they are and
for every row written before 0008, LZ4 for both columns compressed. Readers get the bytes back
as `pack_step` made them (`StoredStep`); a row that does not decompress is read as an unreadable
step that names itself, so that replay refuses it and forensic readers skip it, and the rest of
the log still reads.
"""

from __future__ import annotations

import lz4.block

NONE = 0
"""The header and payload as pack_step made them."""
LZ4 = 1
"""Both are LZ4 blocks, each prefixed with its size (lz4.block's store_size)."""


class RowUnreadable(ValueError):
    """A step row's stored bytes cannot be turned back into its header and payload."""


def compress_row(header: bytes, payload: bytes) -> tuple[int, bytes, bytes]:
    """(compression, header, payload) as the row stores them."""
    packed_header = lz4.block.compress(header, store_size=True)
    packed_payload = lz4.block.compress(payload, store_size=True)
    if len(packed_header) + len(packed_payload) < len(header) + len(payload):
        return LZ4, packed_header, packed_payload
    return NONE, header, payload


def _decompress(block: bytes, column: str) -> bytes:
    # The stored size comes first; LZ4 never expands a block more than 255 times, so a larger
    # size is a corrupt prefix, refused before anything is allocated for it.
    size = int.from_bytes(block[:4], "little")
    if len(block) < 4 or size > 255 * len(block):
        raise RowUnreadable(f"its {column}'s LZ4 block says {size:,} bytes from {len(block):,}: corrupt")
    try:
        data: bytes = lz4.block.decompress(block)
    except lz4.block.LZ4BlockError as error:
        raise RowUnreadable(f"its {column}'s LZ4 block does not decompress ({error})") from error
    return data


def decompress_row(compression: int, header: bytes, payload: bytes) -> tuple[bytes, bytes]:
    """The header and payload as pack_step made them; RowUnreadable says why not."""
    if compression == NONE:
        return header, payload
    if compression == LZ4:
        return _decompress(header, "header"), _decompress(payload, "payload")
    raise RowUnreadable(f"its compression is {compression!r}, which this code does not know (written by newer code?)")
