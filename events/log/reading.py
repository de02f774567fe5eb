"""Reading the log back: committed steps in batches, and their events decoded. Recovery, the
decision hub's catch-ups, the audit index, export, verify and the benchmarks all read this way.

The authoritative path refuses an event it cannot decode, naming its type and global sequence;
forensic readers pass `on_skip` to list and skip such events instead.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable

import msgspec

from events import Event, EventCodec, EventDecodeError
from events.log._contract import EventLog, StoredEvent, StoredStep

READ_BATCH = 20_000


def decode(codec: EventCodec, stored: StoredEvent) -> Event:
    """One stored event, decoded; errors name its global sequence."""
    return codec.decode(stored.event_type, stored.schema_version, stored.payload, position=stored.global_seq)


async def stored_steps(event_log: EventLog, after_seq: int = 0, until_seq: int | None = None) -> AsyncIterator[list[StoredStep]]:
    """Batches of committed steps holding the events after `after_seq`, up to `until_seq`
    (default: the head now). The first step may begin at or before `after_seq`."""
    last = after_seq
    end = await event_log.head() if until_seq is None else until_seq
    while last < end:
        batch = await event_log.read_steps(last, min(READ_BATCH, end - last))
        if not batch:
            return
        yield batch
        last = batch[-1].last_seq


def decode_step(
    codec: EventCodec, step: StoredStep, after_seq: int = 0, on_skip: Callable[[EventDecodeError], None] | None = None
) -> list[Event]:
    """The step's events after `after_seq`: in one decode call when every schema in it is current
    and no byte is corrupt; otherwise one event at a time, so an error names its global sequence.
    With `on_skip`, an undecodable event is reported to it and skipped instead of raised."""
    events: list[Event] | None = None
    if codec.all_current(step.schemas):
        try:
            events = codec.decode_concatenated(step.payload, step.count)
        except msgspec.DecodeError:
            events = None  # find and name the culprit below
    if events is not None:
        return events if step.first_seq > after_seq else events[after_seq - step.first_seq + 1 :]
    decoded = []
    for stored in step.events():
        if stored.global_seq <= after_seq:
            continue
        try:
            decoded.append(decode(codec, stored))
        except EventDecodeError as error:
            if on_skip is None:
                raise
            on_skip(error)
    return decoded
