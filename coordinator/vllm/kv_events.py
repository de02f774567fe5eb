"""vLLM's KV-event frames -> normalized values. Pure: bytes in, values out, no socket.

vLLM's ZMQ publisher (vllm/distributed/kv_events.py, ZmqEventPublisher) sends each batch as a
multipart message (topic, 8-byte big-endian sequence number, msgpack payload). The payload is a
KVEventBatch, an msgspec `array_like` struct `[ts, events, data_parallel_rank?]` (a map with those
keys is read too). Events come in two encodings:

- vLLM 0.32: maps tagged by a "type" key, `{"type": "BlockStored", "block_hashes": [...], ...}`,
  with fields at their default (None) left out;
- older vLLM (KVCacheEvent with `array_like=True`): tagged arrays
  `["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium,
  lora_name, extra_keys, group_idx, ...]`, `["BlockRemoved", block_hashes, medium, group_idx]`,
  `["AllBlocksCleared"]`. Fields were only ever appended, and trailing defaults are left out.

Fields this code does not know are ignored; a frame that cannot be read becomes `Unreadable` and an
event that cannot be read or is of an unknown type becomes an ObservedKvEvent of kind "malformed"
or "unknown": nothing here raises on bad input (the decider refuses them, coordinator/core/observe.py).

Normalization: block hashes are bytes (vLLM's ExternalBlockHash). An int hash (older vLLM, or
VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES) becomes its 8-byte big-endian two's complement: a signed
64-bit hash (Python's hash(), older vLLM) and the unsigned 64-bit one vLLM derives from the low 8
bytes of its bytes hash (`maybe_convert_block_hash`) both fit, and the latter gets back exactly
those 8 bytes. A wider int (never sent: msgpack holds 64 bits) takes as many signed bytes as it
needs. A missing medium is "GPU": vLLM's block pool publishes its own cache as MEDIUM_GPU, the
medium its events had before the field existed; a missing group_idx is group 0.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import msgspec

from coordinator.core.commands import ObservedKvEvent, ObserveKvEvents, ObserveMalformed

SEQ_BYTES = 8
END_SEQ = -1
"""The replay socket's end marker: a frame with sequence -1 and an empty payload."""
DEFAULT_MEDIUM = "GPU"
MAX_DETAIL = 300
_MASK64 = (1 << 64) - 1

_STORED_FIELDS = (
    "block_hashes",
    "parent_block_hash",
    "token_ids",
    "block_size",
    "lora_id",
    "medium",
    "lora_name",
    "extra_keys",
    "group_idx",
)
"""BlockStored's fields in array order (after the tag), as far as this code reads them."""
_REMOVED_FIELDS = ("block_hashes", "medium", "group_idx")
_REQUIRED = {"BlockStored": 4, "BlockRemoved": 1, "AllBlocksCleared": 0}
"""How many leading fields each known type must carry (the older ones had no medium)."""


class DecodedBatch(msgspec.Struct, frozen=True, kw_only=True):
    """One batch of KV events, normalized."""

    seq: int
    ts: float
    dp_rank: int | None
    events: list[ObservedKvEvent]

    def command(self, engine_id: str) -> ObserveKvEvents:
        return ObserveKvEvents(engine_id=engine_id, seq=self.seq, ts=self.ts, dp_rank=self.dp_rank, events=self.events)


class Unreadable(msgspec.Struct, frozen=True, kw_only=True):
    """A frame that could not be decoded; `seq` is -1 when even its sequence number was unreadable."""

    seq: int
    detail: str

    def command(self, engine_id: str) -> ObserveMalformed:
        return ObserveMalformed(engine_id=engine_id, seq=self.seq, detail=self.detail)


class _Bad(Exception):
    """A value that is not what vLLM sends; caught inside this module only."""


def hash_bytes(value: object) -> bytes:
    """A block hash as bytes (see the module's docstring for ints)."""
    if isinstance(value, bytes):
        return value
    if isinstance(value, int) and not isinstance(value, bool):
        if -(1 << 63) <= value <= _MASK64:
            return (value & _MASK64).to_bytes(8, "big")
        return value.to_bytes(max(8, (value.bit_length() + 8) // 8), "big", signed=True)
    raise _Bad(f"a block hash is a {type(value).__name__}, not bytes or an int")


def sequence(frame: bytes) -> int | None:
    """The sequence number in an 8-byte big-endian frame (signed: the replay's end is -1)."""
    if len(frame) != SEQ_BYTES:
        return None
    return int.from_bytes(frame, "big", signed=True)


def decode_frames(frames: Sequence[bytes]) -> DecodedBatch | Unreadable:
    """One multipart message as vLLM's PUB socket sends it: (topic, seq, payload)."""
    seq = sequence(frames[1]) if len(frames) >= 2 else None
    if len(frames) != 3:
        return Unreadable(
            seq=-1 if seq is None or seq < 0 else seq,
            detail=f"{len(frames)} frames, expected 3 (topic, sequence number, payload)",
        )
    if seq is None:
        return Unreadable(seq=-1, detail=f"a sequence-number frame of {len(frames[1])} bytes, expected {SEQ_BYTES}")
    if seq < 0:
        return Unreadable(seq=-1, detail=f"sequence number {seq} < 0")
    return decode_payload(seq, frames[2])


def decode_payload(seq: int, payload: bytes) -> DecodedBatch | Unreadable:
    """A KVEventBatch's msgpack bytes."""
    try:
        raw = msgspec.msgpack.decode(payload)
    except (msgspec.DecodeError, RecursionError, ValueError) as error:
        return Unreadable(seq=seq, detail=_short(f"not a msgpack batch of {len(payload)} bytes: {error}"))
    try:
        ts, raw_events, dp_rank = _batch_fields(raw)
    except _Bad as bad:
        return Unreadable(seq=seq, detail=_short(str(bad)))
    return DecodedBatch(seq=seq, ts=ts, dp_rank=dp_rank, events=[decode_event(item) for item in raw_events])


def _batch_fields(raw: Any) -> tuple[float, list[Any], int | None]:
    if isinstance(raw, list):
        if len(raw) < 2:
            raise _Bad(f"a batch array of {len(raw)} fields, expected [ts, events, data_parallel_rank?]")
        ts, raw_events, dp_rank = raw[0], raw[1], raw[2] if len(raw) > 2 else None
    elif isinstance(raw, dict):
        if "ts" not in raw or "events" not in raw:
            raise _Bad(f"a batch map without ts and events (keys {_keys(raw)})")
        ts, raw_events, dp_rank = raw["ts"], raw["events"], raw.get("data_parallel_rank")
    else:
        raise _Bad(f"a batch is a {type(raw).__name__}, not an array or a map")
    if isinstance(ts, bool) or not isinstance(ts, (int, float)) or not math.isfinite(ts):
        raise _Bad(f"the batch timestamp {_shown(ts)} is not a finite number")
    if not isinstance(raw_events, list):
        raise _Bad(f"the batch's events are a {type(raw_events).__name__}, not an array")
    if dp_rank is not None and (isinstance(dp_rank, bool) or not isinstance(dp_rank, int) or dp_rank < 0):
        raise _Bad(f"data_parallel_rank {_shown(dp_rank)} is not a rank")
    return float(ts), raw_events, dp_rank


def decode_event(raw: Any) -> ObservedKvEvent:
    """One event, in either encoding; never raises."""
    if isinstance(raw, dict):
        name = raw.get("type")
        fields = raw
    elif isinstance(raw, list) and raw and isinstance(raw[0], str):
        name = raw[0]
        fields = None
    else:
        return ObservedKvEvent(kind="malformed", detail=f"an event is a {type(raw).__name__}, not a tagged array or map")
    if not isinstance(name, str):
        return ObservedKvEvent(kind="malformed", detail=f"an event map without a string type (keys {_keys(raw)})")
    if name not in _REQUIRED:
        return ObservedKvEvent(kind="unknown", type_name=name[:80])
    if fields is None:
        values = raw[1:]
        if len(values) < _REQUIRED[name]:
            return ObservedKvEvent(
                kind="malformed", type_name=name, detail=f"{len(values)} fields, {name} has at least {_REQUIRED[name]}"
            )
        order = _STORED_FIELDS if name == "BlockStored" else _REMOVED_FIELDS
        fields = dict(zip(order, values, strict=False))
    try:
        return _KINDS[name](fields)
    except _Bad as bad:
        return ObservedKvEvent(kind="malformed", type_name=name, detail=_short(str(bad)))


def _stored(fields: dict[str, Any]) -> ObservedKvEvent:
    for name in _STORED_FIELDS[:4]:
        if name not in fields:
            raise _Bad(f"no {name}")
    parent = fields["parent_block_hash"]
    return ObservedKvEvent(
        kind="stored",
        type_name="BlockStored",
        medium=_medium(fields),
        group=_group(fields),
        block_hashes=_hashes(fields["block_hashes"]),
        parent_hash=None if parent is None else hash_bytes(parent),
        token_ids=_ints(fields["token_ids"], "token_ids"),
        block_size=_int(fields["block_size"], "block_size"),
        lora_id=None if fields.get("lora_id") is None else _int(fields["lora_id"], "lora_id"),
    )


def _removed(fields: dict[str, Any]) -> ObservedKvEvent:
    if "block_hashes" not in fields:
        raise _Bad("no block_hashes")
    return ObservedKvEvent(
        kind="removed",
        type_name="BlockRemoved",
        medium=_medium(fields),
        group=_group(fields),
        block_hashes=_hashes(fields["block_hashes"]),
    )


def _cleared(fields: dict[str, Any]) -> ObservedKvEvent:
    return ObservedKvEvent(kind="cleared", type_name="AllBlocksCleared", medium=_medium(fields))


_KINDS: dict[str, Callable[[dict[str, Any]], ObservedKvEvent]] = {
    "BlockStored": _stored,
    "BlockRemoved": _removed,
    "AllBlocksCleared": _cleared,
}


def _hashes(value: Any) -> list[bytes]:
    if not isinstance(value, list):
        raise _Bad(f"block_hashes is a {type(value).__name__}, not an array")
    return [hash_bytes(item) for item in value]


def _int(value: Any, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise _Bad(f"{what} {_shown(value)} is not an integer")
    return value


def _ints(value: Any, what: str) -> list[int]:
    if not isinstance(value, list):
        raise _Bad(f"{what} is a {type(value).__name__}, not an array")
    for item in value:
        if isinstance(item, bool) or not isinstance(item, int):
            raise _Bad(f"{what} holds {_shown(item)}, not an integer")
    return value


def _medium(fields: dict[str, Any]) -> str:
    medium = fields.get("medium")
    if medium is None:
        return DEFAULT_MEDIUM
    if not isinstance(medium, str):
        raise _Bad(f"medium {_shown(medium)} is not a string")
    return medium


def _group(fields: dict[str, Any]) -> int:
    group = fields.get("group_idx")
    return 0 if group is None else _int(group, "group_idx")


def is_replay_end(seq: int | None, payload: bytes) -> bool:
    """The replay socket's end-of-replay frame (vLLM: seq -1, empty payload)."""
    return seq == END_SEQ or not payload


def replay_request(start_seq: int) -> list[bytes]:
    """What a DEALER sends vLLM's ROUTER replay socket to get every buffered batch from
    `start_seq` on: an empty delimiter, then the sequence number (8 bytes, big-endian)."""
    return [b"", start_seq.to_bytes(SEQ_BYTES, "big")]


def _keys(raw: dict[Any, Any]) -> str:
    return ", ".join(sorted(repr(k)[:40] for k in raw)[:10])


def _shown(value: Any) -> str:
    return repr(value)[:60]


def _short(text: str) -> str:
    return text if len(text) <= MAX_DETAIL else text[: MAX_DETAIL - 3] + "..."
