"""The envelope: where an event sits in the log."""

from __future__ import annotations

import msgspec

from events._catalog import Event


class Envelope(msgspec.Struct, frozen=True, kw_only=True):
    """One event with its log position. `global_seq` is None until the log commits it."""

    event_id: str
    stream_id: str
    stream_version: int
    step: int
    recorded_at: float
    event: Event
    global_seq: int | None = None
