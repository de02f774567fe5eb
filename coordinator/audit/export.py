"""`kvledger export`: every committed event as one JSON object per line, for other tools.

Each line: {"seq", "stream", "version", "step", "recorded_at", "type", "schema_version", "event"}.
Bytes (keys, checksums, namespace ids) are hex strings. Events this code cannot decode (written by
a newer kvledger) are exported with "event": null and an "error", never dropped silently.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import msgspec

from events import EventCodec, EventDecodeError
from events.log import EventLog, StoredEvent
from events.log.reading import decode, stored_steps


def _hexed(value: Any) -> Any:
    if isinstance(value, bytes):
        return value.hex()
    if isinstance(value, dict):
        return {(k.hex() if isinstance(k, bytes) else k): _hexed(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_hexed(v) for v in value]
    return value


def export_line(codec: EventCodec, stored: StoredEvent) -> bytes:
    line: dict[str, Any] = {
        "seq": stored.global_seq,
        "stream": stored.stream_id,
        "version": stored.stream_version,
        "step": stored.step,
        "recorded_at": stored.recorded_at,
        "type": stored.event_type,
        "schema_version": stored.schema_version,
    }
    try:
        event = decode(codec, stored)
    except EventDecodeError as error:
        line["event"], line["error"] = None, str(error)
    else:
        fields = msgspec.to_builtins(event, builtin_types=(bytes,))
        fields.pop("type", None)
        line["event"] = _hexed(fields)
    return msgspec.json.encode(line)


async def export_jsonl(event_log: EventLog, *, after_seq: int = 0, until_seq: int | None = None) -> AsyncIterator[list[bytes]]:
    """Batches of JSON lines (without newlines), in log order."""
    codec = EventCodec()
    async for steps in stored_steps(event_log, after_seq, until_seq):
        lines = []
        for step in steps:
            for stored in step.events():
                if stored.global_seq <= after_seq or (until_seq is not None and stored.global_seq > until_seq):
                    continue
                lines.append(export_line(codec, stored))
        yield lines
