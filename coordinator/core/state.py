"""The coordinator's domain state: pure data, folded from events by coordinator.core.projector.

Every type here is a msgspec Struct, so the whole state encodes to msgpack in one call; that
encoding is the snapshot, and its digest is what I18 compares. Containers are dicts and lists
only (insertion-ordered), never sets, so the same events always give the same bytes.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Iterator
from typing import Any

import blake3
import msgspec

from events import (
    NULL_BLOCK_ID,
    BlockRef,
    ExternalLoadStarted,
    ExternalStoreStarted,
    LoadJobStarted,
    NamespaceSpec,
    PoolSpec,
    RankReported,
    StateCopyPlanned,
    StoreJobStarted,
    TierSpec,
)


class SlotStatus(enum.StrEnum):
    FREE = "free"
    """No refs, no pins, no cached content."""
    CACHED_FREE = "cached_free"
    """No refs, no pins; keeps its computed content for reuse until reallocated (LRU)."""
    ALLOCATED = "allocated"
    """Held by at least one owner."""
    DRAINING = "draining"
    """No owner left, but a job in flight still pins it (I3)."""
    NULL = "null"


class PoolState(msgspec.Struct, kw_only=True, dict=True):
    """One pool's slots as parallel lists indexed by block_id (compact: well under 300 B/slot)."""

    spec: PoolSpec
    generations: list[int]
    refs: list[int]
    pins: list[int]
    keys: list[bytes | None]
    """The content key of a computed block, kept while cached-free."""
    free: dict[int, None]
    """Clean free slots in allocation order (an insertion-ordered set)."""
    cached: dict[int, None]
    """Cached-free slots, least recently freed first."""

    @classmethod
    def new(cls, spec: PoolSpec) -> PoolState:
        n = spec.num_blocks
        return cls(
            spec=spec,
            generations=[0] * n,
            refs=[0] * n,
            pins=[0] * n,
            keys=[None] * n,
            free=dict.fromkeys(range(1, n)),
            cached={},
        )

    def status(self, block_id: int) -> SlotStatus:
        if block_id == NULL_BLOCK_ID:
            return SlotStatus.NULL
        if self.refs[block_id] > 0:
            return SlotStatus.ALLOCATED
        if self.pins[block_id] > 0:
            return SlotStatus.DRAINING
        if self.keys[block_id] is not None:
            return SlotStatus.CACHED_FREE
        return SlotStatus.FREE

    def ref(self, block_id: int) -> BlockRef:
        return BlockRef(self.spec.pool_id, block_id, self.generations[block_id])


class OwnerState(msgspec.Struct, kw_only=True):
    """One lifetime of a request and the slots it holds refs on."""

    owner_id: int
    engine_id: str
    req_id: str
    blocks: dict[int, dict[int, int]] = msgspec.field(default_factory=dict)
    """pool_id -> block_id -> the generation the owner holds."""


class EngineState(msgspec.Struct, kw_only=True):
    engine_id: str
    incarnation: int
    namespace_id: bytes
    world_size: int
    pools: dict[int, PoolState]
    tiers: list[str]
    encoder_cache_tokens: int = 0
    encoder_entries: dict[str, int] = msgspec.field(default_factory=dict)
    """entry_id -> tokens it occupies."""
    step: int = -1
    """The last step begun."""
    clock: float = 0.0
    step_open: bool = False
    pending_freed_blocks: list[BlockRef] = msgspec.field(default_factory=list)
    pending_freed_encoder: list[str] = msgspec.field(default_factory=list)
    pending_removed_keys: list[tuple[str, int, bytes]] = msgspec.field(default_factory=list)
    """(tier, pool_id, key) evicted during the open step."""

    @property
    def encoder_used(self) -> int:
        return sum(self.encoder_entries.values())


_checksums_encoder = msgspec.msgpack.Encoder()
_checksums_decoder = msgspec.msgpack.Decoder(list[bytes])


pack_checksums: Callable[[list[bytes]], bytes] = _checksums_encoder.encode
"""A key's per-rank checksums as one object (TierState.packed_checksums). The encoder's own
method, with no function around it: the projector packs one per published key."""


unpack_checksums: Callable[[bytes], list[bytes]] = _checksums_decoder.decode
"""One checksum per rank (a new list each time), from `pack_checksums`: the decoder's own method,
as `pack_checksums` is the encoder's (a load unpacks one per key it reads)."""


class KeyEntry(msgspec.Struct, kw_only=True, gc=False):
    """A published key, as read from its tier's columns (TierState.entry): a copy, never stored,
    so changing it changes nothing. The hot paths (the projector, lookups, job completion) read
    the columns themselves and make none."""

    namespace_id: bytes
    tier_slot: int
    tier_generation: int
    packed_checksums: bytes
    """The checksums, one per rank, as reported by the store job that published it, packed in one
    msgpack array. Read them as `checksums`."""
    size_bytes: int
    source_job: int
    quarantined: bool = False
    leases: dict[int, float] | None = None
    """load job_id -> lease expiry (engine clock seconds); None when no load holds one."""

    @property
    def checksums(self) -> list[bytes]:
        """One per rank (a new list each time)."""
        return _checksums_decoder.decode(self.packed_checksums)


class TierState(msgspec.Struct, kw_only=True, dict=True):
    """A tier's slots (always managed by kvledger) and the keys published in them, stored as
    PoolState stores a pool's slots: parallel lists indexed by tier slot (the columns), made
    when the tier is declared, plus a dict from each published key to its slot.

    A published key is one entry in `published`, one in `lru` and its slot's row in the columns:
    no object of its own but its key and packed checksums (issue 22: a KeyEntry and a PublishedRef
    per key made it 301 B, this layout 189 B, ops/bench/memory.py at 200,000 keys; the columns cost
    40 B a slot more when the tier is declared). A slot holding no published key has its row
    cleared (None, b"", 0), so equal tiers encode to equal bytes (I18). A published key's
    generation is its slot's (`generations`): a store reserves the slot at the generation it
    publishes at, and the slot stays reserved while the key is published (verify flags a
    publication at another, I1). Leases and quarantines are rare: dicts of the slots that have
    one, not columns. `entry` reads a key back as a KeyEntry."""

    spec: TierSpec
    generations: list[int]
    free: dict[int, None]
    """Free slots in allocation order (an insertion-ordered set)."""
    lru: dict[int, int]
    """Published slot -> the pool_id (cache group) of its key, least recently used first: eviction
    takes the first unleased one."""
    published: dict[int, dict[bytes, int]]
    """pool_id (cache group) -> key -> the slot it is published in."""
    keys: list[bytes | None]
    """Column: the key published in the slot."""
    namespace_ids: list[bytes]
    """Column: that key's namespace (I9)."""
    packed_checksums: list[bytes]
    """Column: that key's checksums, one per rank, packed (`pack_checksums`)."""
    sizes: list[int]
    """Column: that key's size in bytes."""
    source_jobs: list[int]
    """Column: the store job that published it."""
    quarantined: dict[int, None]
    """Slots whose key is quarantined (I10, I13), in the order they were."""
    leases: dict[int, dict[int, float]]
    """Slot -> load job_id -> lease expiry (engine clock seconds), for the slots a load leases (I12)."""

    @classmethod
    def new(cls, spec: TierSpec) -> TierState:
        n = spec.num_slots
        return cls(
            spec=spec,
            generations=[0] * n,
            free=dict.fromkeys(range(n)),
            lru={},
            published={},
            keys=[None] * n,
            namespace_ids=[b""] * n,
            packed_checksums=[b""] * n,
            sizes=[0] * n,
            source_jobs=[0] * n,
            quarantined={},
            leases={},
        )

    @classmethod
    def declared(cls, spec: TierSpec) -> TierState:
        """A tier as the decider reads it before its declaration is folded: its spec, no slots."""
        return cls(
            spec=spec,
            generations=[],
            free={},
            lru={},
            published={},
            keys=[],
            namespace_ids=[],
            packed_checksums=[],
            sizes=[],
            source_jobs=[],
            quarantined={},
            leases={},
        )

    def slot_of(self, pool_id: int, key: bytes) -> int | None:
        """The slot `key` of `pool_id` is published in, or None."""
        group = self.published.get(pool_id)
        return None if group is None else group.get(key)

    def entry(self, pool_id: int, key: bytes) -> KeyEntry | None:
        """A published key read back from the columns (a copy), or None."""
        slot = self.slot_of(pool_id, key)
        return None if slot is None else self.entry_at(slot)

    def entries(self) -> Iterator[tuple[int, bytes, KeyEntry]]:
        """Every published key, (pool_id, key, entry), group by group in the order published (copies)."""
        for pool_id, group in self.published.items():
            for key, slot in group.items():
                yield pool_id, key, self.entry_at(slot)

    def entry_at(self, slot: int) -> KeyEntry:
        """The key published in `slot` (which must hold one), read back from the columns (a copy)."""
        leases = self.leases.get(slot)
        return KeyEntry(
            namespace_id=self.namespace_ids[slot],
            tier_slot=slot,
            tier_generation=self.generations[slot],
            packed_checksums=self.packed_checksums[slot],
            size_bytes=self.sizes[slot],
            source_job=self.source_jobs[slot],
            quarantined=slot in self.quarantined,
            leases=None if leases is None else dict(leases),
        )


JobDecision = StoreJobStarted | LoadJobStarted | StateCopyPlanned | ExternalStoreStarted | ExternalLoadStarted
"""External jobs (coordinator/core/external.py) move blocks the engine owns: they pin no kvledger slot."""


class JobState(msgspec.Struct, kw_only=True):
    """A job in flight: the decision that started it and the reports received per rank (I4)."""

    decision: JobDecision
    reports: dict[int, RankReported] = msgspec.field(default_factory=dict)

    @property
    def job_id(self) -> int:
        return self.decision.job_id


class FencedJob(msgspec.Struct, kw_only=True):
    """A job of an ended incarnation whose ranks have not all reported: its slots stay pinned."""

    job: JobState
    pending: list[int]
    """Ranks not heard from yet."""


class ObservedEngine(msgspec.Struct, kw_only=True):
    """An engine kvledger observes but does not coordinate (vLLM, from its KV events): the
    hashes its current incarnation holds, per medium and group."""

    engine_id: str
    incarnation: int
    namespace_id: bytes
    source: str = ""
    next_seq: int = 0
    """The engine's sequence number the next batch should carry (one past the last recorded)."""
    complete: bool = True
    """False once a batch of this incarnation was missed (a gap, an unreadable frame, or
    ingestion that joined mid-life): the view may lack blocks, so parent-chain and removal
    checks are off until the next incarnation."""
    stored: dict[str, dict[bytes, None]] = msgspec.field(default_factory=dict)
    """"medium/group" -> the hashes stored there now, in the order they were stored (an
    insertion-ordered set: a dict, never a set, so the snapshot bytes are fixed, I18)."""


def observed_place(medium: str, group: int) -> str:
    """The key of a medium and group in `ObservedEngine.stored`."""
    return f"{medium}/{group}"


class State(msgspec.Struct, kw_only=True, dict=True):
    """Everything the coordinator knows. Finished jobs leave `jobs`; ids below `next_job_id`
    that are not in flight are stale (finished or fenced). Its __dict__ (msgspec `dict=True`,
    never encoded) keeps what is derived from the rest: each engine's jobs in flight
    (`jobs_in_flight`)."""

    namespaces: dict[bytes, NamespaceSpec] = msgspec.field(default_factory=dict)
    tiers: dict[str, TierState] = msgspec.field(default_factory=dict)
    engines: dict[str, EngineState] = msgspec.field(default_factory=dict)
    owners: dict[int, OwnerState] = msgspec.field(default_factory=dict)
    jobs: dict[int, JobState] = msgspec.field(default_factory=dict)
    fenced: dict[int, FencedJob] = msgspec.field(default_factory=dict)
    """Fenced jobs still draining (I16): by job id."""
    observed: dict[str, ObservedEngine] = msgspec.field(default_factory=dict)
    """Engines kvledger observes (coordinator/core/observe.py), by engine id."""
    next_owner_id: int = 1
    next_job_id: int = 1
    last_event: int = 0
    """How many events have been folded in."""


_IN_FLIGHT = "in_flight"
"""The key in State.__dict__ of engine id -> [jobs, items] in flight (fenced jobs included)."""


def _items_of(decision: JobDecision) -> int:
    items = getattr(decision, "items", None)
    return 0 if items is None else len(items)


def jobs_in_flight(state: State, engine_id: str) -> tuple[int, int]:
    """The engine's jobs in flight, fenced ones waiting for their ranks included, and their items
    (blocks or keys to move). Kept by the projector as jobs begin and end (`count_job`), counted
    afresh here from `jobs` and `fenced` when the state has no count yet (a state decoded from a
    snapshot): O(1) a question, not a walk of every job (checks.room_for_a_job asks at each)."""
    counts: dict[str, list[int]] | None = state.__dict__.get(_IN_FLIGHT)
    if counts is None:
        counts = {}
        for job in [*state.jobs.values(), *(fenced.job for fenced in state.fenced.values())]:
            counted = counts.setdefault(job.decision.engine_id, [0, 0])
            counted[0] += 1
            counted[1] += _items_of(job.decision)
        state.__dict__[_IN_FLIGHT] = counts
    held = counts.get(engine_id)
    return (0, 0) if held is None else (held[0], held[1])


def count_job(state: State, decision: JobDecision, sign: int) -> None:
    """A job began (`sign` 1) or ended (-1): its engine's count in flight follows, once counted."""
    counts: dict[str, list[int]] | None = state.__dict__.get(_IN_FLIGHT)
    if counts is None:
        return  # counted afresh when first asked (jobs_in_flight)
    held = counts.get(decision.engine_id)
    if held is None:
        held = counts[decision.engine_id] = [0, 0]
    held[0] += sign
    held[1] += sign * _items_of(decision)


SNAPSHOT_SCHEMA_VERSION = 7
"""Snapshots of another version are not decoded: recovery replays the log instead (a snapshot is a
cache, always rebuildable), and verify does not compare them with a replay.

v7: a copy job in flight holds its StateCopyPlanned v2 (each batch a CopyBatch of columns). v6 stores a tier's published keys in columns (TierState: per-slot lists, a key -> slot dict, the
LRU as a dict of slots; issue 22), where v5 held a KeyEntry per key and a PublishedRef per LRU
place. v5 folds a new incarnation's declaration as starting its steps and clock afresh (issue 17):
a v4 snapshot's engines could hold the old incarnation's step. v4 packs a key's checksums in one
bytes object. v3 added `State.observed` (a v2 snapshot still decodes, the field has a default, but
its bytes, and so its digest, lack the field)."""
_snapshot_encoder = msgspec.msgpack.Encoder()
_snapshot_decoder = msgspec.msgpack.Decoder(State)


def removed(holder: PoolState | TierState, name: str, count: int = 1) -> None:
    """Note that `count` items left the insertion-ordered set `holder.<name>` (a dict used as
    one: free, cached, lru, whose values are its slots' pool ids); rebuild it once its holes cost more than a copy.

    CPython leaves a hole in a dict's entry table for each deleted key and only compacts when
    the table grows. These sets lose keys at the front (the oldest slot is taken first), and
    finding the first live key walks every hole before it: with 65,536 slots an allocation cost
    about 20 us (ops/bench/sidecar.py, profiled). Rebuilding after H removals, H ~ sqrt(f n),
    balances the walk against the copy: a copy costs ~20 ns a live key, a walk ~0.6 ns a hole,
    so f ~ 70 x the removals between two walks. A free list is walked at every allocation
    (f = 150); the LRU only by a store that evicts, which then evicts a dozen keys or more and
    loads touch more (f = 600: ops/bench/trace.py rebuilt its 20,000-slot LRU every 1,700
    removals, 4% of its time). The count lives in the instance's __dict__ (msgspec `dict=True`),
    which is never encoded: the snapshot bytes and the order are unchanged."""
    # Hot (every allocation, eviction and LRU touch): the counter's key is looked up, not
    # formatted, and the set itself is read only once the holes could be worth a rebuild.
    key, factor = _HOLES[name]
    counters = holder.__dict__
    holes = counters.get(key, 0) + count
    if holes > 64:
        items: dict[Any, Any] = getattr(holder, name)
        if holes * holes > factor * len(items):
            setattr(holder, name, dict(items))
            holes = 0
    counters[key] = holes


_HOLES = {"free": ("holes_free", 150), "cached": ("holes_cached", 150), "lru": ("holes_lru", 600)}
"""Per set: the key of its hole count in the holder's __dict__, and its rebuild factor f."""


def encode_state(state: State) -> bytes:
    """The canonical bytes of a state: equal states, equal bytes (I18)."""
    return _snapshot_encoder.encode(state)


def decode_state(data: bytes) -> State:
    return _snapshot_decoder.decode(data)


def state_digest(state: State) -> str:
    return blake3.blake3(encode_state(state)).hexdigest()
