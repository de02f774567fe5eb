"""A step's row: its events' payloads stored back to back with a header (events/log/_contract.py),
and replay's two ways of decoding it (events/log/reading.py, decode_step).

The fast path decodes a whole step in one call; it must give exactly what decoding one event at
a time gives, and must step aside (never guess) for an old schema, an unknown type or a corrupt
byte, so that upcasting still runs and an error still names its global sequence.
"""

from __future__ import annotations

from typing import ClassVar

import msgspec
import pytest

from events import EVENT_TYPES, Event, EventCodec, EventDecodeError, UnknownEventType
from events.log import PendingEvent, StoredStep
from events.log._contract import pack_step, schemas_of
from events.log.reading import decode, decode_step
from tests.log.test_codec import _sample_events


def pending(codec: EventCodec, event: Event, index: int) -> PendingEvent:
    event_type, version, payload = codec.encode(event)
    return PendingEvent(
        event_id=f"id-{index}",
        step=100 + index,
        recorded_at=5.0 + index,
        event_type=event_type,
        schema_version=version,
        payload=payload,
    )


def stored_step(events: list[PendingEvent], first_seq: int = 41, first_version: int = 7) -> StoredStep:
    schemas, header, payload = pack_step(events)
    return StoredStep(first_seq, first_seq + len(events) - 1, "engine/e", first_version, schemas, header, payload)


def test_a_step_splits_back_into_its_events_byte_for_byte() -> None:
    codec = EventCodec()
    appended = [pending(codec, event, index) for index, event in enumerate(_sample_events())]
    step = stored_step(appended)
    stored = step.events()
    assert [s.global_seq for s in stored] == list(range(41, 41 + len(appended)))
    assert [s.stream_version for s in stored] == list(range(7, 7 + len(appended)))
    for original, back in zip(appended, stored, strict=True):
        assert (back.event_id, back.step, back.recorded_at, back.event_type, back.schema_version, back.payload) == (
            original.event_id,
            original.step,
            original.recorded_at,
            original.event_type,
            original.schema_version,
            original.payload,
        )
        assert back.stream_id == "engine/e"


def test_opaque_payloads_are_kept_as_written() -> None:
    """The log does not parse payloads: bytes that are not msgpack come back unchanged."""
    raw = [
        PendingEvent(event_id=f"r{i}", step=1, recorded_at=0.0, event_type="x", schema_version=1, payload=data)
        for i, data in enumerate([b"\x00\xff", b"", b"\xc1\xc1\xc1", b"plain"])
    ]
    assert [s.payload for s in stored_step(raw).events()] == [b"\x00\xff", b"", b"\xc1\xc1\xc1", b"plain"]


def test_the_fast_path_decodes_exactly_what_one_at_a_time_decodes() -> None:
    codec = EventCodec()
    sample = _sample_events()
    step = stored_step([pending(codec, event, index) for index, event in enumerate(sample)])
    assert codec.all_current(step.schemas)
    assert codec.decode_concatenated(step.payload, step.count) == sample
    assert decode_step(codec, step) == [decode(codec, s) for s in step.events()] == sample


@pytest.mark.parametrize("count", [1, 15, 16, 300, 70_000])
def test_the_fast_path_handles_every_array_size(count: int) -> None:
    """msgpack arrays have three header sizes (fixarray, array16, array32)."""
    codec = EventCodec()
    event = _sample_events()[0]
    step = stored_step([pending(codec, event, index) for index in range(count)])
    assert decode_step(codec, step) == [event] * count


def test_a_step_read_from_the_middle_yields_only_the_later_events() -> None:
    """Replay may resume inside a step (after a snapshot taken elsewhere): nothing twice."""
    codec = EventCodec()
    sample = _sample_events()
    step = stored_step([pending(codec, event, index) for index, event in enumerate(sample)], first_seq=41)
    assert decode_step(codec, step, after_seq=40) == sample
    assert decode_step(codec, step, after_seq=43) == sample[3:]
    assert decode_step(codec, step, after_seq=40 + len(sample)) == []


class _PriceV2(Event, frozen=True, tag="price_set"):
    schema_version: ClassVar[int] = 2
    amount: float
    currency: str = "EUR"


def test_an_old_schema_in_a_step_is_upcast_not_decoded_as_current() -> None:
    codec = EventCodec((*EVENT_TYPES, _PriceV2))
    codec.register_upcaster("price_set", 1, lambda f: {"amount": f.pop("cents") / 100, **f})
    current = pending(codec, _PriceV2(amount=1.0, currency="USD"), 0)
    old = PendingEvent(
        event_id="old",
        step=1,
        recorded_at=0.0,
        event_type="price_set",
        schema_version=1,
        payload=msgspec.msgpack.encode({"type": "price_set", "cents": 1250}),
    )
    step = stored_step([current, old])
    assert schemas_of([current, old]) == "price_set@1,price_set@2"
    assert not codec.all_current(step.schemas)
    assert decode_step(codec, step) == [_PriceV2(amount=1.0, currency="USD"), _PriceV2(amount=12.5)]


def test_a_corrupt_event_inside_a_step_is_named_by_its_global_sequence() -> None:
    codec = EventCodec()
    sample = _sample_events()[:5]
    events = [pending(codec, event, index) for index, event in enumerate(sample)]
    events[2] = PendingEvent(
        event_id="bad", step=1, recorded_at=0.0, event_type=events[2].event_type, schema_version=1, payload=b"\xc1\xc1"
    )
    step = stored_step(events, first_seq=41)
    assert codec.all_current(step.schemas), "the schemas look current: only the bytes are bad"
    with pytest.raises(EventDecodeError) as refused:
        decode_step(codec, step)
    assert refused.value.position == 43
    skipped: list[EventDecodeError] = []
    assert decode_step(codec, step, on_skip=skipped.append) == sample[:2] + sample[3:]
    assert [error.position for error in skipped] == [43]


def test_an_unknown_type_inside_a_step_is_refused_by_name() -> None:
    codec = EventCodec()
    good = pending(codec, _sample_events()[0], 0)
    alien = PendingEvent(
        event_id="alien",
        step=1,
        recorded_at=0.0,
        event_type="block_teleported",
        schema_version=1,
        payload=msgspec.msgpack.encode({"type": "block_teleported"}),
    )
    step = stored_step([good, alien], first_seq=10)
    assert not codec.all_current(step.schemas)
    with pytest.raises(UnknownEventType) as refused:
        decode_step(codec, step)
    assert refused.value.position == 11 and "block_teleported" in str(refused.value)


def test_a_header_that_disagrees_with_the_row_is_an_error_naming_the_step() -> None:
    codec = EventCodec()
    schemas, header, payload = pack_step([pending(codec, _sample_events()[0], 0)])
    with pytest.raises(ValueError, match="global sequence 5"):
        StoredStep(5, 6, "engine/e", 1, schemas, header, payload).events()
