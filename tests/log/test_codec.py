"""The event codec: round trips, unknown types, newer schemas, upcasting, corrupt payloads."""

from __future__ import annotations

import gc
from typing import ClassVar

import msgspec
import pytest

import events
from events import EVENT_TYPES, Event, EventCodec, EventDecodeError, UnknownEventType, event_tag
from tests.kit import builders as b


def _sample_events() -> list[Event]:
    """Real events from a run that touches every kind of decision."""
    from coordinator.core.commands import LoadRequest, LookupPrefix, Move, PlanStateCopy, ResetCache, StartLoad

    core = b.new_core([b.attention_pool(), b.state_pool()], encoder_cache_tokens=8)
    b.begin(core)
    keys = b.publish(core, list(range(16)))
    own = b.owner(core)
    dest = b.allocate(core, own, 2)
    core.execute(LookupPrefix(engine_id=b.ENGINE, tier=b.TIER, token_ids=list(range(16))))
    core.execute(StartLoad(engine_id=b.ENGINE, tier=b.TIER, items=[LoadRequest(keys[0], dest[0])]))
    core.execute(PlanStateCopy(engine_id=b.ENGINE, pool_id=0, moves=[Move(dest[1], 0, dest[1], 8, 16)]))
    core.execute(ResetCache(engine_id=b.ENGINE))
    return core.events


def test_every_event_type_has_a_unique_stable_tag() -> None:
    tags = [event_tag(t) for t in EVENT_TYPES]
    assert len(tags) == len(set(tags))
    assert all(tag.islower() and " " not in tag for tag in tags)
    assert set(tags) == set(EventCodec().known_types())


def test_round_trip_of_real_events_is_exact() -> None:
    codec = EventCodec()
    sample = _sample_events()
    assert len({type(e) for e in sample}) >= 15
    for event in sample:
        tag, version, payload = codec.encode(event)
        assert tag == event_tag(type(event)) and version == type(event).schema_version
        assert codec.decode(tag, version, payload) == event


def _structs_within(info: msgspec.inspect.Type, found: dict[type[msgspec.Struct], None]) -> None:
    """Every Struct type `info` is or holds (its fields', items', keys' and values' types), once."""
    if isinstance(info, msgspec.inspect.StructType):
        if info.cls in found:
            return
        found[info.cls] = None
        for field in info.fields:
            _structs_within(field.type, found)
    for name in ("item_type", "key_type", "value_type", "types", "item_types"):
        inner = getattr(info, name, None)
        for one in inner if isinstance(inner, tuple) else () if inner is None else (inner,):
            _structs_within(one, found)


def test_no_event_or_value_within_one_is_tracked_by_the_cyclic_collector() -> None:
    """Events and the frozen values they hold (BlockRef, the items of jobs, the specs) are
    gc=False: a replay decodes hundreds of thousands, and the collector tracking each cost ~10% of
    decode (ops/bench/log.py). A new value type must say gc=False too; a decoded one is untracked."""
    found: dict[type[msgspec.Struct], None] = {}
    for event_type in EVENT_TYPES:
        _structs_within(msgspec.inspect.type_info(event_type), found)
    assert len(found) > len(EVENT_TYPES)  # the values within were reached, not only the events
    tracked = [cls.__name__ for cls in found if cls.__struct_config__.gc]
    assert tracked == []
    codec = EventCodec()
    for event in _sample_events():
        decoded = codec.decode(*codec.encode(event))
        fields = msgspec.structs.astuple(decoded)
        within = [value for value in fields if isinstance(value, msgspec.Struct)]
        within += [item for value in fields if isinstance(value, list) for item in value if isinstance(item, msgspec.Struct)]
        assert not gc.is_tracked(decoded) and not any(map(gc.is_tracked, within)), type(decoded).__name__


def test_unknown_event_type_names_the_type_and_position() -> None:
    with pytest.raises(UnknownEventType) as error:
        EventCodec().decode("block_teleported", 1, b"\x80", position=4242)
    assert "block_teleported" in str(error.value) and "4242" in str(error.value)
    assert error.value.position == 4242


def test_newer_schema_version_is_refused_naming_both_versions() -> None:
    tag, _, payload = EventCodec().encode(events.JobSucceeded(job_id=1))
    with pytest.raises(EventDecodeError) as error:
        EventCodec().decode(tag, 7, payload, position=9)
    assert "v7" in str(error.value) and "v1" in str(error.value) and "9" in str(error.value)


def test_corrupt_payload_names_its_position() -> None:
    with pytest.raises(EventDecodeError) as error:
        EventCodec().decode("job_succeeded", 1, b"\xc1garbage", position=77)
    assert "77" in str(error.value) and "job_succeeded" in str(error.value)


class _PriceV2(Event, frozen=True, tag="price_set"):
    """A test-only event at schema v2: v1 had `cents`, v2 has `amount` and `currency`."""

    schema_version: ClassVar[int] = 2
    amount: float
    currency: str = "EUR"


def test_old_versions_are_upcast_in_order() -> None:
    codec = EventCodec((*EVENT_TYPES, _PriceV2))
    codec.register_upcaster("price_set", 1, lambda f: {"amount": f.pop("cents") / 100, **f})
    old_payload = msgspec.msgpack.encode({"type": "price_set", "cents": 1250})
    assert codec.decode("price_set", 1, old_payload) == _PriceV2(amount=12.5)
    current = codec.encode(_PriceV2(amount=1.0, currency="USD"))
    assert codec.decode(*current) == _PriceV2(amount=1.0, currency="USD")


def test_missing_upcaster_is_an_error_not_a_guess() -> None:
    codec = EventCodec((*EVENT_TYPES, _PriceV2))
    with pytest.raises(EventDecodeError, match="no upcaster from v1"):
        codec.decode("price_set", 1, msgspec.msgpack.encode({"cents": 1}), position=3)


def test_registering_an_upcaster_twice_is_refused() -> None:
    codec = EventCodec()
    codec.register_upcaster("job_succeeded", 0, lambda f: f)
    with pytest.raises(ValueError):
        codec.register_upcaster("job_succeeded", 0, lambda f: f)


def test_fields_added_with_defaults_read_old_payloads() -> None:
    """The log rule: fields are only added, with defaults; an old payload without them reads."""
    old = msgspec.msgpack.encode({"type": "job_failed", "job_id": 3, "reason": "rank_failed"})
    decoded = EventCodec().decode("job_failed", 1, old)
    assert decoded == events.JobFailed(job_id=3, reason=events.Reason.RANK_FAILED, detail="")


def test_every_event_type_is_in_the_union_that_messages_carry() -> None:
    """A message field typed AnyEvent must decode every event the log can hold (a new event type
    missing from the union made the sidecar's replies undecodable to its clients)."""
    import typing

    from events import EVENT_TYPES, AnyEvent

    assert set(typing.get_args(AnyEvent)) == set(EVENT_TYPES)


_V1_COPY_PLAN = bytes.fromhex(
    "8aa474797065b273746174655f636f70795f706c616e6e6564a66a6f625f696401a9656e67696e655f6964a8656e67696e652d61ab696e63"
    "61726e6174696f6e01a7706f6f6c5f696400aa776f726c645f73697a6502a7626174636865739491939393000101002093c00020c2919393"
    "93000301001093930003010810c391939393000201002093930001010020c2919393c0002093930002010020c2ad736372617463685f6279"
    "74657320a6626c6f636b7393930001019300020193000301ac64657374696e6174696f6e7393930002019300010193000301"
)
"""A StateCopyPlanned v1 payload (batches as lists of CopyOps), written by kvledger at 3f29064
for the plan of `_copy_plan_now`: a swap of blocks 1 and 2 through 32 bytes of scratch and
a shift inside block 3."""


def _copy_plan_now() -> events.StateCopyPlanned:
    from coordinator.core.commands import Move, PlanStateCopy

    core = b.new_core([b.attention_pool(), b.state_pool()])
    b.begin(core)
    x, y, z = b.allocate(core, b.owner(core), 3)
    moves = [Move(x, 0, y, 0, 32), Move(y, 0, x, 0, 32), Move(z, 0, z, 8, 16)]
    plan = core.execute(PlanStateCopy(engine_id=b.ENGINE, pool_id=0, moves=moves))[0]
    assert isinstance(plan, events.StateCopyPlanned)
    return plan


def test_a_v1_copy_plan_is_upcast_to_columns() -> None:
    """An old log still replays: the v1 event reads as the v2 event this code decides for the
    same moves (each batch a CopyBatch; scratch as block SCRATCH_BLOCK)."""
    codec = EventCodec()
    assert not codec.all_current("state_copy_planned@1")  # a step holding it skips the fast path
    decoded = codec.decode("state_copy_planned", 1, _V1_COPY_PLAN, position=5)
    assert decoded == _copy_plan_now()
    assert isinstance(decoded, events.StateCopyPlanned)
    assert [batch.src_block for batch in decoded.batches] == [[1], [3], [2], [events.SCRATCH_BLOCK]]
    assert decoded.batches[1].ordered == [True] and decoded.scratch_bytes == 32
    assert codec.decode(*codec.encode(decoded)) == decoded


def test_a_v1_copy_plan_its_columns_cannot_say_is_corrupt() -> None:
    """Ops of unequal sizes, or of another pool than the event's: the decider never wrote them,
    and the upcaster refuses them rather than guess."""
    old = msgspec.msgpack.decode(_V1_COPY_PLAN)
    resized = {**old, "batches": [[[[[0, 1, 1], 0, 32], [None, 0, 16], False]]]}
    moved = {**old, "batches": [[[[[1, 1, 1], 0, 32], [None, 0, 32], False]]]}
    for fields, needle in ((resized, "src has 32 bytes, dst 16"), (moved, "leaves pool 0")):
        with pytest.raises(EventDecodeError, match=needle):
            EventCodec().decode("state_copy_planned", 1, msgspec.msgpack.encode(fields), position=8)
