"""Observed engines: an engine kvledger does not coordinate (vLLM with its own allocator), read
from the KV events it publishes. Pure, like the rest of the decider.

kvledger records what the engine says it cached and evicted, per medium and group, checked
against the engine's declared namespace and against what it said before:

- a batch at or below the last one recorded in this incarnation is a duplicate (DUPLICATE_BATCH);
  a batch beyond the next expected one means batches were missed: ObservedEventsMissed is
  recorded first and the view is no longer complete;
- a stored block whose size differs from the namespace's for its group is NAMESPACE_MISMATCH
  (both sizes named);
- on a complete view only: a GPU block stored under a parent hash that is not stored now is
  BROKEN_PARENT_CHAIN (vLLM's block pool caches a block only while its request holds the
  parent; offload tiers store chunks on their own: "Events are self-contained (own parent)",
  vllm/distributed/kv_transfer/kv_connector/v1/offloading/events.py), and a removal of a hash
  not stored is UNKNOWN_BLOCK_HASH. After a gap the view may lack blocks, so both checks are
  off for the rest of the incarnation rather than refusing what the engine really did;
- an event type kvledger does not know is refused naming it (UNKNOWN_EVENT_TYPE), an event it
  could not read is MALFORMED_EVENT.

A refused event leaves the state as it was; the rest of its batch is still recorded, each event
checked against the batch's earlier events (`_View`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from coordinator.core.checks import Refusal, stream_name
from coordinator.core.commands import (
    Command,
    ObservedKvEvent,
    ObserveEngine,
    ObserveGap,
    ObserveKvEvents,
    ObserveMalformed,
    command_tag,
)
from coordinator.core.keys import namespace_id, namespace_problems
from coordinator.core.state import ObservedEngine, State, observed_place
from events import (
    EngineObserved,
    Event,
    NamespaceRegistered,
    ObservedBatch,
    ObservedBlocksRemoved,
    ObservedBlocksStored,
    ObservedCacheCleared,
    ObservedEventsMissed,
    Reason,
    Refused,
)

Handler = Callable[[State, Any], list[Event]]

GPU = "GPU"
"""vLLM's name for the engine's own device cache (vllm/distributed/kv_events.py MEDIUM_GPU)."""
MAX_TEXT = 2000
MAX_MEDIUM_CHARS = 64
MAX_HASH_BYTES = 128
"""vLLM's hashes are 32 bytes (sha256) or 8 (an int); anything much longer is not a block hash."""
MAX_EVENTS_PER_BATCH = 1 << 16

MAX_SOURCE_SEQ = (1 << 63) - 2
"""The largest batch sequence number recorded: the next one expected (one more) must fit the
state's and the log's signed 64-bit integers (msgpack, kvl_audit_observed.source_seq). One of
2**64-1 left the state unable to be encoded: every snapshot failed, and with it the group it rode
on, and the audit index stopped (an adversarial review, session 31)."""
MAX_DP_RANK = (1 << 31) - 1
"""Data-parallel ranks are 32-bit in the audit index (kvl_audit_observed.dp_rank)."""


def observed(state: State, engine_id: str) -> ObservedEngine:
    found = state.observed.get(engine_id)
    if found is None:
        raise Refusal(Reason.UNKNOWN_ENGINE, f"engine {engine_id!r} is not observed (no ObserveEngine before its events)")
    return found


def _observe_engine(state: State, command: ObserveEngine) -> list[Event]:
    stream_name(command.engine_id, "engine_id")
    problems = namespace_problems(command.namespace)
    if problems:
        raise Refusal(Reason.INVALID_ARGUMENT, f"namespace: {'; '.join(problems)}")
    for text, what in ((command.source, "source"), (command.reason, "reason")):
        if len(text) > MAX_TEXT:
            raise Refusal(Reason.INVALID_ARGUMENT, f"{what} has {len(text)} characters, at most {MAX_TEXT}")
    known = state.observed.get(command.engine_id)
    events: list[Event] = []
    ns_id = namespace_id(command.namespace)
    if ns_id not in state.namespaces:
        events.append(NamespaceRegistered(namespace_id=ns_id, spec=command.namespace))
    events.append(
        EngineObserved(
            engine_id=command.engine_id,
            incarnation=1 if known is None else known.incarnation + 1,
            namespace_id=ns_id,
            source=command.source,
            reason=command.reason or ("first_seen" if known is None else "restart"),
        )
    )
    return events


def _observe_gap(state: State, command: ObserveGap) -> list[Event]:
    """The gap recorded starts at the first batch not yet recorded, whatever `first_seq` says:
    those before it are recorded, those between are missing too."""
    eng = observed(state, command.engine_id)
    if command.first_seq < 0 or command.last_seq < command.first_seq or command.last_seq > MAX_SOURCE_SEQ:
        raise Refusal(
            Reason.INVALID_ARGUMENT,
            f"gap {command.first_seq}..{command.last_seq} is not a range of sequence numbers in 0..{MAX_SOURCE_SEQ}",
        )
    if command.last_seq < eng.next_seq:
        raise Refusal(
            Reason.DUPLICATE_BATCH,
            f"gap {command.first_seq}..{command.last_seq}: batches up to "
            f"{eng.next_seq - 1} of incarnation {eng.incarnation} are recorded",
        )
    if len(command.reason) > MAX_TEXT:
        raise Refusal(Reason.INVALID_ARGUMENT, f"reason has {len(command.reason)} characters, at most {MAX_TEXT}")
    return [
        ObservedEventsMissed(
            engine_id=eng.engine_id,
            incarnation=eng.incarnation,
            first_seq=eng.next_seq,
            last_seq=command.last_seq,
            reason=command.reason,
        )
    ]


def _observe_malformed(state: State, command: ObserveMalformed) -> list[Event]:
    """A refusal and nothing else: what the frame held is unknown. Its batch counts as missed
    when the next one arrives (its sequence number is never recorded)."""
    observed(state, command.engine_id)
    where = f"batch {command.seq}" if command.seq >= 0 else "a frame with no readable sequence number"
    raise Refusal(Reason.MALFORMED_EVENT, f"{where}: {command.detail[:MAX_TEXT]}")


def _observe_kv_events(state: State, command: ObserveKvEvents) -> list[Event]:
    eng = observed(state, command.engine_id)
    if not 0 <= command.seq <= MAX_SOURCE_SEQ:
        raise Refusal(Reason.INVALID_ARGUMENT, f"batch sequence number {command.seq} is outside 0..{MAX_SOURCE_SEQ}")
    if command.seq < eng.next_seq:
        raise Refusal(
            Reason.DUPLICATE_BATCH,
            f"batch {command.seq}: batches up to {eng.next_seq - 1} of incarnation {eng.incarnation} are recorded",
        )
    if not math.isfinite(command.ts):
        raise Refusal(Reason.INVALID_ARGUMENT, f"batch {command.seq}: timestamp {command.ts} is not finite")
    if command.dp_rank is not None and not 0 <= command.dp_rank <= MAX_DP_RANK:
        # The audit index holds it as a 32-bit integer: a larger one stopped every catch-up of it.
        raise Refusal(
            Reason.INVALID_ARGUMENT, f"batch {command.seq}: data-parallel rank {command.dp_rank} is outside 0..{MAX_DP_RANK}"
        )
    if len(command.events) > MAX_EVENTS_PER_BATCH:
        raise Refusal(
            Reason.INVALID_COUNT, f"batch {command.seq} has {len(command.events)} events, at most {MAX_EVENTS_PER_BATCH}"
        )
    events: list[Event] = []
    complete = eng.complete
    if command.seq > eng.next_seq:
        events.append(
            ObservedEventsMissed(
                engine_id=eng.engine_id,
                incarnation=eng.incarnation,
                first_seq=eng.next_seq,
                last_seq=command.seq - 1,
                reason=f"not received before batch {command.seq}",
            )
        )
        complete = False
    events.append(
        ObservedBatch(
            engine_id=eng.engine_id,
            incarnation=eng.incarnation,
            source_seq=command.seq,
            ts=command.ts,
            dp_rank=command.dp_rank,
            events=len(command.events),
        )
    )
    view = _View(state, eng, complete, command)
    for index, observed_event in enumerate(command.events):
        try:
            events += view.apply(index, observed_event)
        except Refusal as refusal:
            events.append(view.refused(index, observed_event, refusal.reason, refusal.detail))
    return events


class _View:
    """The engine's stored hashes as this batch's earlier events left them: the state plus an
    overlay (the state itself changes only when the projector folds the decided events)."""

    def __init__(self, state: State, eng: ObservedEngine, complete: bool, command: ObserveKvEvents) -> None:
        self.eng = eng
        self.block_sizes = state.namespaces[eng.namespace_id].block_sizes
        self.complete = complete
        self.command = command
        self.added: dict[str, dict[bytes, None]] = {}
        self.removed: dict[str, dict[bytes, None]] = {}
        self.cleared: dict[str, None] = {}

    def has(self, place: str, block_hash: bytes) -> bool:
        if block_hash in self.added.get(place, {}):
            return True
        if block_hash in self.removed.get(place, {}) or place.rsplit("/", 1)[0] in self.cleared:
            return False
        return block_hash in self.eng.stored.get(place, {})

    def refused(self, index: int, event: ObservedKvEvent, reason: Reason, detail: str) -> Refused:
        name = event.type_name or event.kind
        return Refused(
            engine_id=self.eng.engine_id,
            command=command_tag(ObserveKvEvents),
            reason=reason,
            detail=f"batch {self.command.seq} event {index} ({name[:80]}): {detail}",
        )

    def apply(self, index: int, event: ObservedKvEvent) -> list[Event]:
        """The events recording the batch's `index`th event, or a Refusal raised."""
        if event.kind == "unknown":
            raise Refusal(Reason.UNKNOWN_EVENT_TYPE, f"event type {event.type_name[:80]!r} is not one kvledger knows")
        if event.kind == "malformed":
            raise Refusal(Reason.MALFORMED_EVENT, event.detail[:MAX_TEXT] or "unreadable")
        if not event.medium or len(event.medium) > MAX_MEDIUM_CHARS:
            raise Refusal(Reason.MALFORMED_EVENT, f"medium {event.medium[:80]!r} is not a medium's name")
        if event.kind == "cleared":
            return self._cleared(event)
        if not event.block_hashes:
            raise Refusal(Reason.MALFORMED_EVENT, "names no block hash")
        for block_hash in [*event.block_hashes, *([event.parent_hash] if event.parent_hash is not None else [])]:
            if not 0 < len(block_hash) <= MAX_HASH_BYTES:
                raise Refusal(Reason.MALFORMED_EVENT, f"a block hash of {len(block_hash)} bytes (1..{MAX_HASH_BYTES})")
        if event.kind == "stored":
            return self._stored(event)
        return self._removed(index, event)

    def _common(self) -> dict[str, Any]:
        return {
            "engine_id": self.eng.engine_id,
            "incarnation": self.eng.incarnation,
            "source_seq": self.command.seq,
            "dp_rank": self.command.dp_rank,
        }

    def _group(self, event: ObservedKvEvent) -> str:
        if not 0 <= event.group < len(self.block_sizes):
            raise Refusal(
                Reason.NAMESPACE_MISMATCH,
                f"group {event.group}, but the namespace declares "
                f"{len(self.block_sizes)} groups (block sizes {list(self.block_sizes)})",
            )
        return observed_place(event.medium, event.group)

    def _stored(self, event: ObservedKvEvent) -> list[Event]:
        place = self._group(event)
        declared = self.block_sizes[event.group]
        placeholder = event.block_size == 0 and not event.token_ids  # vLLM's offload events without metadata
        if not placeholder and event.block_size != declared:
            raise Refusal(
                Reason.NAMESPACE_MISMATCH, f"block size {event.block_size} in group {event.group}, the namespace says {declared}"
            )
        parent = event.parent_hash
        if self.complete and event.medium == GPU and parent is not None and not self.has(place, parent):
            raise Refusal(
                Reason.BROKEN_PARENT_CHAIN, f"parent {parent.hex()} of {event.block_hashes[0].hex()} is not stored in {place}"
            )
        added = self.added.setdefault(place, {})
        removed = self.removed.get(place, {})
        for block_hash in event.block_hashes:
            added[block_hash] = None
            removed.pop(block_hash, None)
        return [
            ObservedBlocksStored(
                **self._common(),
                medium=event.medium,
                group=event.group,
                block_hashes=list(event.block_hashes),
                parent_hash=parent,
                token_ids=list(event.token_ids),
                block_size=event.block_size,
                lora_id=event.lora_id,
            )
        ]

    def _removed(self, index: int, event: ObservedKvEvent) -> list[Event]:
        place = self._group(event)
        hashes = list(dict.fromkeys(event.block_hashes))
        missing = [h for h in hashes if not self.has(place, h)] if self.complete else []
        if len(missing) == len(hashes):
            raise Refusal(Reason.UNKNOWN_BLOCK_HASH, f"{_hexes(missing)} not stored in {place}")
        known = [h for h in hashes if h not in missing] if missing else hashes
        added = self.added.get(place, {})
        removed = self.removed.setdefault(place, {})
        for block_hash in known:
            added.pop(block_hash, None)
            removed[block_hash] = None
        events: list[Event] = [
            ObservedBlocksRemoved(**self._common(), medium=event.medium, group=event.group, block_hashes=known)
        ]
        if missing:
            events.append(
                self.refused(
                    index, event, Reason.UNKNOWN_BLOCK_HASH, f"{_hexes(missing)} not stored in {place} (the others were removed)"
                )
            )
        return events

    def _cleared(self, event: ObservedKvEvent) -> list[Event]:
        for place in [p for p in self.added if p.rsplit("/", 1)[0] == event.medium]:
            del self.added[place]
        self.cleared[event.medium] = None
        return [ObservedCacheCleared(**self._common(), medium=event.medium)]


def _hexes(hashes: list[bytes], shown: int = 4) -> str:
    text = ", ".join(h.hex() for h in hashes[:shown])
    more = f" and {len(hashes) - shown} more" if len(hashes) > shown else ""
    return f"{'hash' if len(hashes) == 1 else 'hashes'} {text}{more}"


HANDLERS: dict[type[Command], Handler] = {
    ObserveEngine: _observe_engine,
    ObserveKvEvents: _observe_kv_events,
    ObserveGap: _observe_gap,
    ObserveMalformed: _observe_malformed,
}
