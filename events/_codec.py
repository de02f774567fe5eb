"""msgpack codec for events, with upcasting of old schema versions.

An event is stored as (type tag, schema version, payload). The payload is the msgpack map of the
event's fields. Reading an older version decodes the payload untyped, runs the registered
upcasters (type, from_version) -> from_version + 1 in order, then converts to the current Struct.
"""

from __future__ import annotations

from typing import Any, Union

import msgspec

from events._catalog import EVENT_TYPES, Event, event_tag
from events._upcasts import UPCASTERS, Upcaster


class EventDecodeError(ValueError):
    """A stored event could not be decoded. Names the type and its position in the log."""

    def __init__(self, message: str, *, event_type: str, position: int | None) -> None:
        where = f" at position {position}" if position is not None else ""
        super().__init__(f"{message}: event type {event_type!r}{where}")
        self.event_type = event_type
        self.position = position


class UnknownEventType(EventDecodeError):
    """The log holds an event type this code does not know (written by newer code?)."""

    def __init__(self, event_type: str, position: int | None) -> None:
        super().__init__("unknown event type", event_type=event_type, position=position)


class EventCodec:
    """Encodes events to (tag, version, payload) and back; holds the upcaster registry, which
    starts with the upcasters of this code's own schema changes (events._upcasts.UPCASTERS)."""

    def __init__(self, event_types: tuple[type[Event], ...] = EVENT_TYPES) -> None:
        self._types: dict[str, type[Event]] = {event_tag(t): t for t in event_types}
        self._decoders = {tag: msgspec.msgpack.Decoder(t) for tag, t in self._types.items()}
        self._encoder = msgspec.msgpack.Encoder()
        self._untyped = msgspec.msgpack.Decoder(dict[str, Any])
        self._upcasters: dict[tuple[str, int], Upcaster] = dict(UPCASTERS)
        self._all = msgspec.msgpack.Decoder(list[Union[event_types]])  # type: ignore[valid-type]  # noqa: UP007
        self._current = {f"{tag}@{t.schema_version}" for tag, t in self._types.items()}
        self._checked: dict[str, bool] = {}

    def register_upcaster(self, event_type: str, from_version: int, upcaster: Upcaster) -> None:
        """Register the step from `from_version` to `from_version + 1` of one event type."""
        key = (event_type, from_version)
        if key in self._upcasters:
            raise ValueError(f"upcaster already registered for {event_type!r} v{from_version}")
        self._upcasters[key] = upcaster

    def encode(self, event: Event) -> tuple[str, int, bytes]:
        """Return (type tag, schema version, msgpack payload); the payload carries the tag too."""
        event_type = type(event)
        payload = self._encoder.encode(event)
        return event_tag(event_type), event_type.schema_version, payload

    def decode(self, event_type: str, schema_version: int, payload: bytes, position: int | None = None) -> Event:
        """Decode one stored event; `position` (a global sequence) goes into any error."""
        current = self._types.get(event_type)
        if current is None:
            raise UnknownEventType(event_type, position)
        if schema_version > current.schema_version:
            raise EventDecodeError(
                f"written by a newer schema (v{schema_version}, this code reads up to v{current.schema_version})",
                event_type=event_type,
                position=position,
            )
        try:
            if schema_version == current.schema_version:
                return self._decoders[event_type].decode(payload)
            fields = self._untyped.decode(payload)
            for version in range(schema_version, current.schema_version):
                upcaster = self._upcasters.get((event_type, version))
                if upcaster is None:
                    raise EventDecodeError(f"no upcaster from v{version}", event_type=event_type, position=position)
                fields = upcaster(fields)
            fields["type"] = event_type
            return msgspec.convert(fields, current)
        except msgspec.DecodeError as exc:  # covers ValidationError
            raise EventDecodeError(f"corrupt payload ({exc})", event_type=event_type, position=position) from exc

    def all_current(self, schemas: str) -> bool:
        """True when every "type@version" in a step's comma-joined `schemas` is a type this code
        knows, at the version it writes: then `decode_concatenated` may decode the step."""
        answer = self._checked.get(schemas)
        if answer is None:
            answer = self._checked[schemas] = all(item in self._current for item in schemas.split(",") if item)
        return answer

    def decode_concatenated(self, payload: bytes, count: int) -> list[Event]:
        """Decode `count` current-version payloads stored back to back, in one msgspec call (the
        fast path of replay). Raises msgspec.DecodeError on any corrupt byte: the caller falls
        back to `decode`, one event at a time, to name the event that failed."""
        return self._all.decode(_array_header(count) + payload)

    def known_types(self) -> list[str]:
        return sorted(self._types)


def _array_header(count: int) -> bytes:
    """The msgpack header of an array of `count` elements."""
    if count < 16:
        return bytes((0x90 | count,))
    if count < 1 << 16:
        return b"\xdc" + count.to_bytes(2, "big")
    return b"\xdd" + count.to_bytes(4, "big")
