"""The audit index projection: committed events -> insert-only rows for forensics. Pure.

Every row names the global sequences of the events it came from, so "what held this slot at
sequence N" is a range scan over an index ("the last allocation of the slot at or before N"),
never a replay. Rows are only ever inserted: a lifetime's end is an entry of its own (`freed`,
`finished`, `evicted`), which is what makes indexing resumable from a checkpoint and its writes
cheap. The tables are declared in events/log/schema.py (kvl_audit_*); coordinator/audit/store.py
writes these rows and coordinator/audit/queries.py answers from them.

Most events become one row each (a job's report, a publication, an eviction, a refusal). The
events that name many slots or keys at once (allocations, frees, computed blocks, stores, loads)
are *packed*: building the index is bound by row inserts, and a row per touched slot made about
four rows per event (ops/bench/audit.py). Their entries are grouped per *batch*, what one
`sync_index` transaction writes:

- kvl_audit_slots: one row per slot per batch (and per window of 2**16 sequences), the slot's
  touches (`SlotTouch`) in log order;
- kvl_audit_owner_blocks: one row per owner per batch, the slots it was allocated or reused
  (`OwnerBlock`);
- kvl_audit_key_blocks: one row per content key (and namespace) per batch, the device blocks of
  the key: where it was computed, which block each store read it from and each load wrote it
  into (`KeyBlock`).

A packed column is one flat msgpack array: the entries' fields one after another, in the order
their type names (a touch is 6 values, an owner's block 5, a key's block 11). Flat rather than an
array per entry: the build makes no object per entry, and half of its time was making and freeing
them. Where the batches fall decides which row holds an entry, never what the entries say: a
query reads entries (`unpack_*`), and rows only to find them. The rows of one slot (owner, key)
never overlap in sequences, so "the row with the last allocation at or before N" is the last row
whose first allocation is at or before N.

The only memory the projection keeps is each engine's namespace (from its declarations), so that
computed, stored and loaded keys carry their namespace; `Indexer(namespaces=...)` restores it
from the index when indexing resumes.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterator, Sequence
from typing import Any, NamedTuple

import msgspec

from events import (
    BlockRef,
    BlocksAllocated,
    BlocksComputed,
    BlocksReleased,
    BlocksReused,
    EngineDeclared,
    EngineObserved,
    EngineReset,
    Event,
    ExternalLoadStarted,
    ExternalStoreStarted,
    FencedRankDone,
    FencedRankReleased,
    JobFailed,
    JobFenced,
    JobSucceeded,
    KeyEvicted,
    KeyPublished,
    KeyQuarantined,
    LoadJobStarted,
    NamespaceDecided,
    NamespaceRegistered,
    NamespaceReleased,
    NoticeDropped,
    ObservedBlocksRemoved,
    ObservedBlocksStored,
    ObservedCacheCleared,
    ObservedEventsMissed,
    OwnerFinished,
    OwnerStarted,
    RankReported,
    Refused,
    StateCopyPlanned,
    StepEnded,
    StoreJobStarted,
)

SLOT_WINDOW_BITS = 16
"""A slot row's touches lie in one window of 2**16 sequences (`seq >> SLOT_WINDOW_BITS`), so
the rows holding the touches of a range of sequences start at or after the window of its start
(coordinator/audit/timeline.py reads a pool's range that way)."""

# Packed entries, their fields in the order a packed column holds them; a kind is packed as its
# index in SLOT_KINDS or KEY_BLOCK_KINDS (a byte, not its name: the slot rows are most of the
# index's bytes) and unpacked as its name.
SlotTouch = tuple[int, str, int, int | None, int | None, bytes | None]
"""seq, kind, generation, owner_id, job_id, key: one event's touch of one slot. Kinds: allocated,
reused (a ref taken), released (a ref dropped), freed, computed (with its key), stored_from and
loaded_into (with the job and the key), copied (with the job)."""
SLOT_KINDS = ("allocated", "reused", "released", "freed", "computed", "stored_from", "loaded_into", "copied")
ALLOCATED, REUSED, RELEASED, FREED, COMPUTED, STORED_FROM, LOADED_INTO, COPIED = range(len(SLOT_KINDS))
OwnerBlock = tuple[int, str, int, int, int]
"""seq, kind (allocated or reused), pool, block, generation"""
KEY_BLOCK_KINDS = ("computed", "stored", "loaded")
KEY_COMPUTED, KEY_STORED, KEY_LOADED = range(len(KEY_BLOCK_KINDS))


class KeyBlock(NamedTuple):
    """A device block of a content key: the one it was `computed` in, the one a job `stored` it
    from, or the one a job `loaded` it into. For an engine that owns its blocks (vLLM's
    offloading) there is no block: `detail` names the engine's own key. Packed without
    `namespace_id`, which its row holds."""

    seq: int
    kind: str
    engine: str
    tier: str
    """The job's tier ("" for computed)."""
    pool: int
    job_id: int | None
    block: int | None
    generation: int | None
    tier_slot: int | None
    checksums: str
    """A load's published checksum of each rank, comma-separated ("" otherwise)."""
    detail: str
    namespace_id: bytes | None
    """The engine's namespace then."""


# Row tuples, in the column order of their tables (events/log/schema.py).
SlotRow = tuple[str, int, int, int, int, int | None, int, bytes]
"""engine, pool, block, first_seq, last_seq, first_allocated (the sequence of its first
`allocated` touch, None without one), allocations (how many), packed touches"""
OwnerBlocksRow = tuple[str, int, int, bytes]
"""engine, owner_id, first_seq, packed OwnerBlock entries"""
KeyBlocksRow = tuple[bytes, bytes | None, int, int, int, int, int | None, bytes]
"""key, namespace_id, first_seq, computed, stored and loaded (how many of each), last_loaded (the
sequence of its last load, None without one), packed KeyBlock entries"""
OwnerRow = tuple[str, int, str, int, str, str]
"""engine, owner_id, req_id, seq, kind, detail"""
JobRow = tuple[int, str, int, str, int | None, str]
"""job_id, engine, seq, kind, rank, detail"""
KeyRow = tuple[bytes, int, str, str, str, int, bytes | None, int | None, int | None, int | None, int | None, int | None, str, str]
"""key, seq, kind, engine, tier, pool, namespace_id, job_id, block, generation, tier_slot, size_bytes, checksums, detail
(kinds published, evicted and quarantined, one event each: computed, stored and loaded are in
kvl_audit_key_blocks)"""
RefusalRow = tuple[int, str, str, str, str, str]
"""seq, engine, kind, subject, reason, detail"""
EngineRow = tuple[str, int, bytes | None, int, str, str]
"""engine, incarnation, namespace_id, seq, kind, detail"""
NamespaceRow = tuple[bytes, str, str, str, int]
"""namespace_id, tenant, model_id, spec (JSON), seq"""
StepRow = tuple[str, int, int, int, float]
"""engine, step (-1 for an append outside a step: a worker's report, a reset), first_seq, last_seq,
recorded_at"""
DecisionRow = tuple[int, str, bytes, bytes | None, int, str, str]
"""seq, outcome (new, compatible, clear or released), from_namespace, to_namespace, affected_keys,
evidence, reason"""
ObservedRow = tuple[bytes, int, str, str, int, str, int, int | None, int]
"""hash (empty for cleared), seq, kind (stored, removed, cleared), engine, incarnation, medium, group
(-1 for cleared), dp_rank, source_seq"""

_pack = msgspec.msgpack.Encoder().encode
_unpack = msgspec.msgpack.Decoder(list[Any]).decode
TOUCH_FIELDS = 6
OWNER_BLOCK_FIELDS = 5
KEY_BLOCK_FIELDS = len(KeyBlock._fields) - 1  # its row holds the namespace


def _split(packed: bytes, width: int) -> Iterator[tuple[Any, ...]]:
    """A packed column's entries: its values `width` at a time (a short last entry is an error)."""
    values = iter(_unpack(packed))
    return zip(*[values] * width, strict=True)


def unpack_touches(packed: bytes) -> list[SlotTouch]:
    """A kvl_audit_slots row's touches, in log order."""
    return [
        (seq, SLOT_KINDS[kind], generation, owner_id, job_id, key)
        for seq, kind, generation, owner_id, job_id, key in _split(packed, TOUCH_FIELDS)
    ]


def unpack_owner_blocks(packed: bytes) -> list[OwnerBlock]:
    """A kvl_audit_owner_blocks row's entries, in log order."""
    return [
        (seq, SLOT_KINDS[kind], pool, block, generation)
        for seq, kind, pool, block, generation in _split(packed, OWNER_BLOCK_FIELDS)
    ]


def unpack_key_blocks(packed: bytes, namespace_id: bytes | None) -> list[KeyBlock]:
    """A kvl_audit_key_blocks row's entries, in log order, with the row's namespace."""
    return [
        KeyBlock._make((seq, KEY_BLOCK_KINDS[kind], *rest, namespace_id)) for seq, kind, *rest in _split(packed, KEY_BLOCK_FIELDS)
    ]


PACKED = {"slots": 3, "owner_blocks": 2, "key_blocks": 1}
"""The packed tables (names without `kvl_audit_`), and how many leading columns name the row's
slot, owner or key."""


def entries(table: str, row: Sequence[Any]) -> list[tuple[Any, ...]]:
    """What one row of `table` (its name without `kvl_audit_`) says, one tuple per entry, whatever
    batch packed it: a packed row's entries each after the columns naming its slot, owner or key;
    any other row as it is. The same log indexed in other batches has the same entries."""
    subject = PACKED.get(table)
    if subject is None:
        return [tuple(row)]
    packed = bytes(row[-1])
    unpacked: list[tuple[Any, ...]] = (
        list(unpack_touches(packed))
        if table == "slots"
        else list(unpack_owner_blocks(packed))
        if table == "owner_blocks"
        else list(unpack_key_blocks(packed, None if row[1] is None else bytes(row[1])))
    )
    return [(*row[:subject], *entry) for entry in unpacked]


def _flat_lists() -> defaultdict[Any, list[Any]]:
    return defaultdict(list)


class AuditRows(msgspec.Struct, kw_only=True):
    """One batch of the index: its rows, and the entries it packs per slot, owner and key (each
    a flat list of their fields, as packed)."""

    touches: dict[tuple[str, int], defaultdict[tuple[int, int], list[Any]]] = msgspec.field(default_factory=dict)
    """(engine, window) -> (pool, block) -> the slot's touches in the batch, in log order. Two
    levels: an event's touches share their engine and window, and a pair hashes faster than the
    four values did (the fold is half of the build, ops/bench/audit.py)."""
    owner_blocks: defaultdict[tuple[str, int], list[Any]] = msgspec.field(default_factory=_flat_lists)
    """(engine, owner_id) -> the slots it was allocated or reused in the batch."""
    key_blocks: defaultdict[tuple[bytes, bytes | None], list[Any]] = msgspec.field(default_factory=_flat_lists)
    """(key, namespace_id) -> where it was computed, stored from and loaded into in the batch."""
    owners: list[OwnerRow] = msgspec.field(default_factory=list)
    jobs: list[JobRow] = msgspec.field(default_factory=list)
    keys: list[KeyRow] = msgspec.field(default_factory=list)
    refusals: list[RefusalRow] = msgspec.field(default_factory=list)
    engines: list[EngineRow] = msgspec.field(default_factory=list)
    namespaces: list[NamespaceRow] = msgspec.field(default_factory=list)
    steps: list[StepRow] = msgspec.field(default_factory=list)
    decisions: list[DecisionRow] = msgspec.field(default_factory=list)
    observed: list[ObservedRow] = msgspec.field(default_factory=list)

    def slot_touches(self, engine: str, seq: int) -> defaultdict[tuple[int, int], list[Any]]:
        """The touches in this batch of `engine`'s slots in the window of `seq`, by (pool, block)."""
        window = (engine, seq >> SLOT_WINDOW_BITS)
        found = self.touches.get(window)
        if found is None:
            found = self.touches[window] = defaultdict(list)
        return found

    def tables(self) -> dict[str, list[tuple[Any, ...]]]:
        """Each table's rows (by its name without `kvl_audit_`), the packed tables' packed. The
        kinds are counted and found with list.count and list.index (in C), not a loop per entry."""
        slots: list[SlotRow] = []
        for (engine, _), of_window in self.touches.items():
            for (pool, block), touches in of_window.items():
                kinds = touches[1::TOUCH_FIELDS]
                allocations = kinds.count(ALLOCATED)
                first_allocated = touches[kinds.index(ALLOCATED) * TOUCH_FIELDS] if allocations else None
                slots.append(
                    (engine, pool, block, touches[0], touches[-TOUCH_FIELDS], first_allocated, allocations, _pack(touches))
                )
        owner_blocks: list[OwnerBlocksRow] = [
            (engine, owner, blocks[0], _pack(blocks)) for (engine, owner), blocks in self.owner_blocks.items()
        ]
        key_blocks: list[KeyBlocksRow] = []
        for (key, namespace), blocks in self.key_blocks.items():
            kinds = blocks[1::KEY_BLOCK_FIELDS]
            loads = kinds.count(KEY_LOADED)
            last_loaded = blocks[(len(kinds) - 1 - kinds[::-1].index(KEY_LOADED)) * KEY_BLOCK_FIELDS] if loads else None
            counts = (kinds.count(KEY_COMPUTED), kinds.count(KEY_STORED), loads)
            key_blocks.append((key, namespace, blocks[0], *counts, last_loaded, _pack(blocks)))
        return {
            "slots": slots,
            "owner_blocks": owner_blocks,
            "key_blocks": key_blocks,
            "owners": self.owners,
            "jobs": self.jobs,
            "keys": self.keys,
            "refusals": self.refusals,
            "engines": self.engines,
            "namespaces": self.namespaces,
            "steps": self.steps,
            "decisions": self.decisions,
            "observed": self.observed,
        }


def engine_of_stream(stream_id: str) -> str:
    """Engine streams are "engine/<id>"; other streams (tiers) keep their whole id."""
    return stream_id.removeprefix("engine/")


def checksums_text(checksums: Sequence[bytes]) -> str:
    """Each rank's checksum in hex, comma-separated in rank order."""
    return ",".join(map(bytes.hex, checksums))


class Indexer:
    """Folds committed steps into AuditRows. Feed steps in log order, each once."""

    def __init__(self, namespaces: dict[str, bytes] | None = None) -> None:
        self.namespaces: dict[str, bytes] = dict(namespaces or {})
        """engine id -> its current namespace id."""

    def step(
        self,
        rows: AuditRows,
        events: Sequence[Event],
        *,
        first_seq: int,
        last_seq: int,
        stream_id: str,
        step: int,
        recorded_at: float,
    ) -> None:
        """Add the rows of one stored step's events; `first_seq` is the first event's sequence
        (the events may be a tail of the step: then pass the tail's first sequence)."""
        engine = engine_of_stream(stream_id)
        rows.steps.append((engine, step, first_seq, last_seq, recorded_at))  # every append: its time
        handlers, seq = _HANDLERS, first_seq
        for event in events:  # Indexer.event, inlined: a call less per event
            handler = handlers.get(type(event))
            if handler is not None:
                handler(self, rows, event, seq, engine)
            seq += 1

    def event(self, rows: AuditRows, event: Event, seq: int, engine: str) -> None:
        """Add the rows of one event at global sequence `seq`, from `engine`'s stream. Steps
        began, lookups, encoder entries and tiers: nothing a forensic query asks for."""
        handler = _HANDLERS.get(type(event))
        if handler is not None:
            handler(self, rows, event, seq, engine)

    def _blocks_allocated(self, rows: AuditRows, event: BlocksAllocated, seq: int, engine: str) -> None:
        owner, blocks = event.owner_id, event.blocks
        self._held(rows, engine, seq, ALLOCATED, owner, blocks)

    def _blocks_reused(self, rows: AuditRows, event: BlocksReused, seq: int, engine: str) -> None:
        owner, blocks = event.owner_id, event.blocks
        self._held(rows, engine, seq, REUSED, owner, blocks)

    def _blocks_released(self, rows: AuditRows, event: BlocksReleased, seq: int, engine: str) -> None:
        owner, blocks = event.owner_id, event.blocks
        touches = rows.slot_touches(engine, seq)
        for b in blocks:
            touches[b.pool_id, b.block_id].extend((seq, RELEASED, b.generation, owner, None, None))

    def _step_ended(self, rows: AuditRows, event: StepEnded, seq: int, engine: str) -> None:
        freed = event.freed_blocks
        touches = rows.slot_touches(engine, seq)
        for b in freed:
            touches[b.pool_id, b.block_id].extend((seq, FREED, b.generation, None, None, None))

    def _blocks_computed(self, rows: AuditRows, event: BlocksComputed, seq: int, engine: str) -> None:
        computed = event.blocks
        namespace = self.namespaces.get(engine)
        touches, key_blocks = rows.slot_touches(engine, seq), rows.key_blocks
        for c in computed:
            b, key = c.block, c.key
            touches[b.pool_id, b.block_id].extend((seq, COMPUTED, b.generation, None, None, key))
            key_blocks[(key, namespace)].extend(
                (seq, KEY_COMPUTED, engine, "", b.pool_id, None, b.block_id, b.generation, None, "", "")
            )

    def _store_job_started(self, rows: AuditRows, event: StoreJobStarted, seq: int, engine: str) -> None:
        job = event.job_id
        tier = event.tier
        items = event.items
        skipped = event.already_published
        pinned = event.pinned
        namespace = self.namespaces.get(engine)
        rows.jobs.append(
            (
                job,
                engine,
                seq,
                "store",
                None,
                f"tier {tier}: {len(items)} keys, {len(skipped)} already published or on their way in{'' if pinned else ', NOT pinned'}",
            )
        )
        touches, key_blocks = rows.slot_touches(engine, seq), rows.key_blocks
        for item in items:
            s = item.source
            touches[s.pool_id, s.block_id].extend((seq, STORED_FROM, s.generation, None, job, item.key))
            key_blocks[(item.key, namespace)].extend(
                (seq, KEY_STORED, engine, tier, s.pool_id, job, s.block_id, s.generation, item.tier_slot, "", "")
            )

    def _load_job_started(self, rows: AuditRows, event: LoadJobStarted, seq: int, engine: str) -> None:
        job = event.job_id
        tier = event.tier
        items = event.items
        expiry = event.lease_expires_at
        namespace = self.namespaces.get(engine)
        rows.jobs.append((job, engine, seq, "load", None, f"tier {tier}: {len(items)} items, lease to t={expiry:g}"))
        touches, key_blocks = rows.slot_touches(engine, seq), rows.key_blocks
        for load in items:
            d = load.dest
            touches[d.pool_id, d.block_id].extend((seq, LOADED_INTO, d.generation, None, job, load.key))
            key_blocks[(load.key, namespace)].extend(
                (
                    seq,
                    KEY_LOADED,
                    engine,
                    tier,
                    d.pool_id,
                    job,
                    d.block_id,
                    d.generation,
                    load.tier_slot,
                    checksums_text(load.checksums),
                    "",
                )
            )

    def _external_store_started(self, rows: AuditRows, event: ExternalStoreStarted, seq: int, engine: str) -> None:
        job = event.job_id
        tier = event.tier
        ext_items = event.items
        skipped = event.already_published
        namespace = self.namespaces.get(engine)
        rows.jobs.append(
            (
                job,
                engine,
                seq,
                "store",
                None,
                f"tier {tier}: {len(ext_items)} external keys, {len(skipped)} already published or on their way in",
            )
        )
        for ext in ext_items:
            rows.key_blocks[(ext.key, namespace)].extend(
                (
                    seq,
                    KEY_STORED,
                    engine,
                    tier,
                    ext.pool_id,
                    job,
                    None,
                    None,
                    ext.tier_slot,
                    "",
                    f"engine key {ext.engine_key.hex()}",
                )
            )

    def _external_load_started(self, rows: AuditRows, event: ExternalLoadStarted, seq: int, engine: str) -> None:
        job = event.job_id
        tier = event.tier
        ext_items = event.items
        expiry = event.lease_expires_at
        namespace = self.namespaces.get(engine)
        rows.jobs.append((job, engine, seq, "load", None, f"tier {tier}: {len(ext_items)} external keys, lease to t={expiry:g}"))
        for ext in ext_items:
            rows.key_blocks[(ext.key, namespace)].extend(
                (
                    seq,
                    KEY_LOADED,
                    engine,
                    tier,
                    ext.pool_id,
                    job,
                    None,
                    None,
                    ext.tier_slot,
                    checksums_text(ext.checksums),
                    f"engine key {ext.engine_key.hex()}",
                )
            )

    def _state_copy_planned(self, rows: AuditRows, event: StateCopyPlanned, seq: int, engine: str) -> None:
        job = event.job_id
        pool = event.pool_id
        blocks = event.blocks
        batches = event.batches
        rows.jobs.append(
            (job, engine, seq, "copy", None, f"pool {pool}: {sum(map(len, batches))} moves in {len(batches)} batches")
        )
        touches = rows.slot_touches(engine, seq)
        for b in blocks:
            touches[b.pool_id, b.block_id].extend((seq, COPIED, b.generation, None, job, None))

    def _rank_reported(self, rows: AuditRows, event: RankReported, seq: int, engine: str) -> None:
        job = event.job_id
        rank = event.rank
        ok = event.ok
        error = event.error
        rows.jobs.append((job, engine, seq, "reported", rank, "ok" if ok else f"failed: {error}"))

    def _job_succeeded(self, rows: AuditRows, event: JobSucceeded, seq: int, engine: str) -> None:
        job = event.job_id
        rows.jobs.append((job, engine, seq, "succeeded", None, ""))

    def _job_failed(self, rows: AuditRows, event: JobFailed, seq: int, engine: str) -> None:
        job, reason, detail = event.job_id, event.reason, event.detail
        rows.jobs.append((job, engine, seq, "failed", None, f"{reason}: {detail}"))
        rows.refusals.append((seq, engine, "job_failed", f"job {job}", str(reason), detail))

    def _job_fenced(self, rows: AuditRows, event: JobFenced, seq: int, engine: str) -> None:
        job, pending = event.job_id, event.pending
        rows.jobs.append((job, engine, seq, "fenced", None, f"ranks pending: {pending}" if pending else ""))

    def _fenced_rank_released(self, rows: AuditRows, event: FencedRankReleased, seq: int, engine: str) -> None:
        rank, released, reason = event.rank, event.job_ids, event.reason
        rows.jobs += [
            (job, engine, seq, "released", rank, f"the rank's worker is gone (an operator): {reason}") for job in released
        ]

    def _fenced_rank_done(self, rows: AuditRows, event: FencedRankDone, seq: int, engine: str) -> None:
        job, rank = event.job_id, event.rank
        rows.jobs.append((job, engine, seq, "fenced_rank_done", rank, "late report dropped"))

    def _key_published(self, rows: AuditRows, event: KeyPublished, seq: int, engine: str) -> None:
        tier = event.tier
        namespace = event.namespace_id
        pool = event.pool_id
        key = event.key
        slot = event.tier_slot
        checksums = event.checksums
        size = event.size_bytes
        job = event.source_job
        rows.keys.append(
            (
                key,
                seq,
                "published",
                engine,
                tier,
                pool,
                namespace,
                job,
                None,
                None,
                slot,
                size,
                checksums_text(checksums),
                "",
            )
        )

    def _key_evicted(self, rows: AuditRows, event: KeyEvicted, seq: int, engine: str) -> None:
        tier = event.tier
        pool = event.pool_id
        key = event.key
        slot = event.tier_slot
        by = event.engine_id
        rows.keys.append((key, seq, "evicted", by, tier, pool, None, None, None, None, slot, None, "", ""))

    def _key_quarantined(self, rows: AuditRows, event: KeyQuarantined, seq: int, engine: str) -> None:
        tier = event.tier
        pool = event.pool_id
        key = event.key
        reason = event.reason
        job = event.job_id
        detail = event.detail
        rows.keys.append(
            (key, seq, "quarantined", engine, tier, pool, None, job, None, None, None, None, "", f"{reason}: {detail}")
        )
        rows.refusals.append((seq, engine, "quarantined", f"key {key.hex()}", str(reason), detail))

    def _refused(self, rows: AuditRows, event: Refused, seq: int, engine: str) -> None:
        by = event.engine_id
        command = event.command
        reason = event.reason
        detail = event.detail
        rows.refusals.append((seq, by or engine, "refused", command, str(reason), detail))

    def _notice_dropped(self, rows: AuditRows, event: NoticeDropped, seq: int, engine: str) -> None:
        by = event.engine_id
        notice = event.notice
        reason = event.reason
        detail = event.detail
        rows.refusals.append((seq, by or engine, "dropped", notice, str(reason), detail))

    def _owner_started(self, rows: AuditRows, event: OwnerStarted, seq: int, engine: str) -> None:
        by = event.engine_id
        owner = event.owner_id
        req_id = event.req_id
        resumed = event.resumed
        rows.owners.append((by, owner, req_id, seq, "started", "resumed" if resumed else ""))

    def _owner_finished(self, rows: AuditRows, event: OwnerFinished, seq: int, engine: str) -> None:
        by, owner, reason = event.engine_id, event.owner_id, event.reason
        rows.owners.append((by, owner, "", seq, "finished", reason))

    def _engine_declared(self, rows: AuditRows, event: EngineDeclared, seq: int, engine: str) -> None:
        by = event.engine_id
        incarnation = event.incarnation
        namespace = event.namespace_id
        takeover = event.takeover
        self.namespaces[by] = namespace
        rows.engines.append((by, incarnation, namespace, seq, "declared", "takeover" if takeover else ""))

    def _engine_reset(self, rows: AuditRows, event: EngineReset, seq: int, engine: str) -> None:
        by, incarnation, reason = event.engine_id, event.incarnation, event.reason
        rows.engines.append((by, incarnation, self.namespaces.get(by), seq, "reset", reason))

    def _namespace_registered(self, rows: AuditRows, event: NamespaceRegistered, seq: int, engine: str) -> None:
        namespace, spec = event.namespace_id, event.spec
        rows.namespaces.append((namespace, spec.tenant, spec.model_id, msgspec.json.encode(spec).decode(), seq))

    def _namespace_decided(self, rows: AuditRows, event: NamespaceDecided, seq: int, engine: str) -> None:
        source = event.from_namespace
        target = event.to_namespace
        outcome = event.outcome
        rationale = event.rationale
        evidence = event.evidence
        affected = event.affected_keys
        rows.decisions.append((seq, outcome, source, target, affected, evidence, rationale))

    def _namespace_released(self, rows: AuditRows, event: NamespaceReleased, seq: int, engine: str) -> None:
        namespace, rationale, evicted = event.namespace_id, event.rationale, event.evicted_keys
        rows.decisions.append((seq, "released", namespace, None, evicted, "", rationale))

    def _observed_blocks_stored(self, rows: AuditRows, event: ObservedBlocksStored, seq: int, engine: str) -> None:
        self._observed_blocks(rows, event, seq, "stored")

    def _observed_blocks_removed(self, rows: AuditRows, event: ObservedBlocksRemoved, seq: int, engine: str) -> None:
        self._observed_blocks(rows, event, seq, "removed")

    @staticmethod
    def _observed_blocks(rows: AuditRows, event: ObservedBlocksStored | ObservedBlocksRemoved, seq: int, kind: str) -> None:
        """One row a distinct hash the observed engine stored or removed."""
        by, incarnation, medium, group = event.engine_id, event.incarnation, event.medium, event.group
        rank, source = event.dp_rank, event.source_seq
        rows.observed += [(h, seq, kind, by, incarnation, medium, group, rank, source) for h in dict.fromkeys(event.block_hashes)]

    def _observed_cache_cleared(self, rows: AuditRows, event: ObservedCacheCleared, seq: int, engine: str) -> None:
        by = event.engine_id
        incarnation = event.incarnation
        medium = event.medium
        rank = event.dp_rank
        source = event.source_seq
        rows.observed.append((b"", seq, "cleared", by, incarnation, medium, -1, rank, source))

    def _engine_observed(self, rows: AuditRows, event: EngineObserved, seq: int, engine: str) -> None:
        by = event.engine_id
        incarnation = event.incarnation
        namespace = event.namespace_id
        source = event.source
        reason = event.reason
        rows.engines.append((by, incarnation, namespace, seq, "observed", f"{reason} ({source})" if source else reason))

    def _observed_events_missed(self, rows: AuditRows, event: ObservedEventsMissed, seq: int, engine: str) -> None:
        by = event.engine_id
        incarnation = event.incarnation
        first = event.first_seq
        last = event.last_seq
        reason = event.reason
        rows.engines.append(
            (
                by,
                incarnation,
                None,
                seq,
                "events_missed",
                f"engine batches {first}..{last}" + (f": {reason}" if reason else ""),
            )
        )

    @staticmethod
    def _held(rows: AuditRows, engine: str, seq: int, kind: int, owner: int, blocks: Sequence[BlockRef]) -> None:
        """An owner took `blocks` (allocated or reused): a touch of each slot, and the owner's entries."""
        if not blocks:
            return
        touches, entries = rows.slot_touches(engine, seq), rows.owner_blocks[(engine, owner)]
        for b in blocks:
            pool, block, generation = b.pool_id, b.block_id, b.generation
            touches[pool, block].extend((seq, kind, generation, owner, None, None))
            entries.extend((seq, kind, pool, block, generation))


_HANDLERS: dict[type[Event], Callable[[Indexer, AuditRows, Any, int, str], None]] = {
    BlocksAllocated: Indexer._blocks_allocated,
    BlocksReused: Indexer._blocks_reused,
    BlocksReleased: Indexer._blocks_released,
    StepEnded: Indexer._step_ended,
    BlocksComputed: Indexer._blocks_computed,
    StoreJobStarted: Indexer._store_job_started,
    LoadJobStarted: Indexer._load_job_started,
    ExternalStoreStarted: Indexer._external_store_started,
    ExternalLoadStarted: Indexer._external_load_started,
    StateCopyPlanned: Indexer._state_copy_planned,
    RankReported: Indexer._rank_reported,
    JobSucceeded: Indexer._job_succeeded,
    JobFailed: Indexer._job_failed,
    JobFenced: Indexer._job_fenced,
    FencedRankReleased: Indexer._fenced_rank_released,
    FencedRankDone: Indexer._fenced_rank_done,
    KeyPublished: Indexer._key_published,
    KeyEvicted: Indexer._key_evicted,
    KeyQuarantined: Indexer._key_quarantined,
    Refused: Indexer._refused,
    NoticeDropped: Indexer._notice_dropped,
    OwnerStarted: Indexer._owner_started,
    OwnerFinished: Indexer._owner_finished,
    EngineDeclared: Indexer._engine_declared,
    EngineReset: Indexer._engine_reset,
    NamespaceRegistered: Indexer._namespace_registered,
    NamespaceDecided: Indexer._namespace_decided,
    NamespaceReleased: Indexer._namespace_released,
    ObservedBlocksStored: Indexer._observed_blocks_stored,
    ObservedBlocksRemoved: Indexer._observed_blocks_removed,
    ObservedCacheCleared: Indexer._observed_cache_cleared,
    EngineObserved: Indexer._engine_observed,
    ObservedEventsMissed: Indexer._observed_events_missed,
}
"""The rows of each event type (a dict, not a match statement over every type: the build is bound
by the fold, ops/bench/audit.py)."""
