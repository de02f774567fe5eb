"""The event language: every fact kvledger records, as a msgspec Struct with a stable tag.

Rules (DESIGN.md, "The log"): tags never change; fields are only added, with defaults, and a
change that cannot be expressed that way bumps `schema_version` and registers an upcaster in
events._codec. Refusals and dropped notices are events too: forensics must see what was refused.
"""

from __future__ import annotations

from typing import ClassVar

import msgspec

from events._reasons import Reason
from events._values import BlockRef, CopyBatch, NamespaceOutcome, NamespaceSpec, PoolSpec, TierSpec


class Event(msgspec.Struct, frozen=True, kw_only=True, tag_field="type", gc=False):
    """Base of every event. `schema_version` is the version this code writes.

    gc=False: events are immutable values that never reference themselves, so the cyclic
    garbage collector need not track them (it was a large share of replay time)."""

    schema_version: ClassVar[int] = 1


# --- declarations -------------------------------------------------------------------------


class NamespaceRegistered(Event, frozen=True, tag="namespace_registered"):
    namespace_id: bytes
    spec: NamespaceSpec


class TierDeclared(Event, frozen=True, tag="tier_declared"):
    spec: TierSpec


class EngineDeclared(Event, frozen=True, tag="engine_declared"):
    """An engine's first incarnation, or a restart (a new incarnation, I16)."""

    engine_id: str
    incarnation: int
    namespace_id: bytes
    pools: list[PoolSpec]
    world_size: int
    tiers: list[str]
    encoder_cache_tokens: int = 0
    takeover: bool = False
    """This incarnation replaced one whose engine was still connected to the sidecar: a
    deliberate takeover (the Hello said so), never the side effect of a Hello."""


class EngineReset(Event, frozen=True, tag="engine_reset"):
    """The old incarnation ends: owners end, device slots free, jobs fenced (I16). Published
    keys in tiers survive, unless the reset reaches the tier (ResetCache.drop_tier_keys: the
    KeyEvicted and KeyQuarantined after this event end them); generations keep counting so old
    references stay stale (I1)."""

    engine_id: str
    incarnation: int
    """The new incarnation."""
    reason: str
    keep_pins: bool = True
    """Slots that fenced jobs still pin stay pinned. False only in a simulator run with the
    fencing protection off (coordinator.core.protections): the naive reset frees everything."""


# --- steps ---------------------------------------------------------------------------------


class StepBegan(Event, frozen=True, tag="step_began"):
    engine_id: str
    step: int
    clock: float
    """The engine's clock reading, seconds: time enters the pure core only as data."""


class StepEnded(Event, frozen=True, tag="step_ended"):
    """End-of-step truth (I14): the notices consumers get describe the state after the step."""

    engine_id: str
    step: int
    freed_blocks: list[BlockRef]
    freed_encoder_entries: list[str]
    removed_keys: list[bytes]


# --- owners and blocks ---------------------------------------------------------------------


class OwnerStarted(Event, frozen=True, tag="owner_started"):
    """One lifetime of a request. A resumed request is a new owner; req_id is metadata."""

    engine_id: str
    owner_id: int
    req_id: str
    resumed: bool = False


class OwnerFinished(Event, frozen=True, tag="owner_finished"):
    engine_id: str
    owner_id: int
    reason: str


class BlocksAllocated(Event, frozen=True, tag="blocks_allocated"):
    """Each block carries its new generation (I1)."""

    engine_id: str
    owner_id: int
    blocks: list[BlockRef]


class BlocksReused(Event, frozen=True, tag="blocks_reused"):
    """The owner takes a ref on computed blocks (a device prefix-cache hit)."""

    engine_id: str
    owner_id: int
    blocks: list[BlockRef]


class BlocksReleased(Event, frozen=True, tag="blocks_released"):
    """The owner drops its refs; a pinned slot drains instead of freeing (I3)."""

    engine_id: str
    owner_id: int
    blocks: list[BlockRef]


class ComputedBlock(msgspec.Struct, frozen=True, array_like=True, gc=False):
    block: BlockRef
    key: bytes


class BlocksComputed(Event, frozen=True, tag="blocks_computed"):
    """The blocks' content is complete; each now has its chained content key (I8, I17)."""

    engine_id: str
    blocks: list[ComputedBlock]


class GroupHit(msgspec.Struct, frozen=True, array_like=True, gc=False):
    pool_id: int
    keys: list[bytes]
    """The published keys to load for this group, in token order."""


class PrefixLookedUp(Event, frozen=True, tag="prefix_looked_up"):
    """A lookup's answer, kept for forensics: the boundary and what each group would load."""

    engine_id: str
    tier: str
    num_tokens: int
    reuse_unit: int
    boundary: int
    hits: list[GroupHit]


# --- jobs ------------------------------------------------------------------------------------


class StoreItem(msgspec.Struct, frozen=True, array_like=True, gc=False):
    source: BlockRef
    key: bytes
    tier_slot: int
    tier_generation: int


class StoreJobStarted(Event, frozen=True, tag="store_job_started"):
    """A decision: each rank copies each source block into its tier slot and reports a
    checksum. The source slots are pinned until every rank reports (I3)."""

    job_id: int
    engine_id: str
    incarnation: int
    tier: str
    world_size: int
    items: list[StoreItem]
    already_published: list[bytes] = []
    """Keys the command asked for that the tier already holds: an idempotent skip (I10)."""
    pinned: bool = True
    """False only in a simulator run with the pins protection off (coordinator.core.protections):
    recorded, so replay and forensics see the store ran unprotected."""


class LoadItem(msgspec.Struct, frozen=True, array_like=True, gc=False):
    key: bytes
    tier_slot: int
    tier_generation: int
    dest: BlockRef
    checksums: list[bytes] = []
    """The published checksum of each rank's shard, so a worker verifies before it reports (I13).
    Empty in events written before it was added."""


class LoadJobStarted(Event, frozen=True, tag="load_job_started", omit_defaults=True):
    """A decision: each rank fills every destination (duplicates included, I11), verifies it
    against the published checksum (I13) and reports. Keys are leased until `lease_expires_at`
    (I12). The destinations are pinned until every rank reports (I3)."""

    job_id: int
    engine_id: str
    incarnation: int
    tier: str
    world_size: int
    items: list[LoadItem]
    lease_expires_at: float
    pinned: bool = True
    """False only in the simulator's abort-during-load-back scenario (PINS off): the destinations
    can be allocated again while the load still writes them. Left out of the encoding when True,
    so a load decision's bytes are what they were before the field."""


class StateCopyPlanned(Event, frozen=True, tag="state_copy_planned"):
    """A decision: run `batches` in order; the copies inside one batch are independent (I15).

    v2 holds each batch in columns (CopyBatch); v1 held a list of CopyOps per batch and is
    upcast when read (events._upcasts)."""

    schema_version: ClassVar[int] = 2

    job_id: int
    engine_id: str
    incarnation: int
    pool_id: int
    world_size: int
    batches: list[CopyBatch]
    scratch_bytes: int
    blocks: list[BlockRef]
    """Every slot the plan reads or writes; pinned until the job ends."""
    destinations: list[BlockRef]


class RankReported(Event, frozen=True, tag="rank_reported"):
    job_id: int
    rank: int
    ok: bool
    checksums: list[bytes]
    """One per item of the job, in item order."""
    error: str = ""
    lost: list[int] = []
    """A failed load's items (indices) whose bytes the tier no longer holds (missing, empty or
    short): their keys leave the tier (JobFailed OBJECT_LOST)."""


class JobSucceeded(Event, frozen=True, tag="job_succeeded"):
    job_id: int


class JobFailed(Event, frozen=True, tag="job_failed"):
    job_id: int
    reason: Reason
    detail: str = ""
    kept: int = 0
    """A load that failed verification from its item `kept` on: the items before it read the
    published bytes on every rank and stay loaded (their destinations count as computed), as a
    recompute from the first bad block would keep them. 0 for every other failure."""


class JobFenced(Event, frozen=True, tag="job_fenced"):
    """The job's incarnation ended; its late reports will be dropped (I16). What it pins stays
    pinned until every rank in `pending` has reported: their transfers may still be landing."""

    job_id: int
    pending: list[int] = []
    """The ranks not heard from when it was fenced. Empty (and in events written before this
    field existed): the job lets go of everything at once."""


class FencedRankReleased(Event, frozen=True, tag="fenced_rank_released"):
    """An operator released one rank of an engine's fenced jobs (its worker is gone: nothing it
    started can land any more). A record: the FencedRankDone events that follow, one per job,
    release what those jobs hold."""

    engine_id: str
    rank: int
    job_ids: list[int]
    reason: str


class FencedRankDone(Event, frozen=True, tag="fenced_rank_done"):
    """A late report from one rank of a fenced job: its result is dropped (nothing of the job
    counts), but its transfer is over. When the last rank is done, the job's slots, reserved tier slots and leases go (I3,
    I16): a late load never lands in a block someone else holds by then."""

    job_id: int
    rank: int


# --- tiers -----------------------------------------------------------------------------------


class KeyPublished(Event, frozen=True, tag="key_published"):
    """The key is loadable: every rank stored it and reported a checksum (I5)."""

    tier: str
    namespace_id: bytes
    pool_id: int
    key: bytes
    tier_slot: int
    tier_generation: int
    checksums: list[bytes]
    """One per rank."""
    size_bytes: int
    source_job: int


class KeyEvicted(Event, frozen=True, tag="key_evicted"):
    tier: str
    pool_id: int
    key: bytes
    tier_slot: int
    engine_id: str
    """The engine whose step evicted it (its StepEnded carries the removal notice)."""


class KeyQuarantined(Event, frozen=True, tag="key_quarantined"):
    """A violation: the key is never loadable again until evicted (I10, I13)."""

    tier: str
    pool_id: int
    key: bytes
    reason: Reason
    job_id: int
    detail: str = ""


# --- namespace release decisions (seed 003) ---------------------------------------------------


class NamespaceDecided(Event, frozen=True, tag="namespace_decided"):
    """An operator's release decision from namespace A to namespace B, with its reason and
    evidence. `clear` is followed by a KeyQuarantined (NAMESPACE_CLEARED) for each key of A;
    `new` and `compatible` change no state: they are the record an auditor reads."""

    from_namespace: bytes
    to_namespace: bytes
    outcome: NamespaceOutcome
    rationale: str
    """The operator's reason (`kvledger namespace decide --reason`)."""
    evidence: str = ""
    """The id of the verification run that compared cached and uncached outputs; required for
    `compatible`."""
    affected_keys: int = 0
    """Keys of A quarantined by a `clear` (0 for the other outcomes)."""


class NamespaceReleased(Event, frozen=True, tag="namespace_released"):
    """An abandoned namespace is cleaned up: a KeyEvicted follows for each of its published keys
    (outside any engine's step: their `engine_id` is empty)."""

    namespace_id: bytes
    rationale: str
    """Why, e.g. `kvledger namespace gc`'s "last used ..., older than 7d"."""
    evicted_keys: int = 0


# --- encoder cache -----------------------------------------------------------------------------


class EncoderEntryAllocated(Event, frozen=True, tag="encoder_entry_allocated"):
    engine_id: str
    entry_id: str
    num_tokens: int


class EncoderEntryFreed(Event, frozen=True, tag="encoder_entry_freed"):
    engine_id: str
    entry_id: str


# --- observed engines (an engine kvledger does not coordinate: vLLM's KV events) ----------------


class EngineObserved(Event, frozen=True, tag="engine_observed"):
    """kvledger began observing an engine it does not coordinate (it reads the engine's own KV
    events), or saw it restart: a new observed incarnation, whose stored hashes start empty."""

    engine_id: str
    incarnation: int
    namespace_id: bytes
    source: str
    """Where the events come from, e.g. "vllm zmq tcp://127.0.0.1:5557 topic kv"."""
    reason: str
    """first_seen, or why a new incarnation began (a restart names both sequence numbers)."""


class ObservedBatch(Event, frozen=True, tag="observed_batch"):
    """One batch of the engine's KV events was received, whatever became of its events: the
    engine's sequence number moves on even for an empty batch or one whose every event was
    refused, so a batch delivered twice is recognised (DUPLICATE_BATCH)."""

    engine_id: str
    incarnation: int
    source_seq: int
    """The engine's own sequence number of the batch (vLLM's, restarting at 0 with the engine)."""
    ts: float
    """The engine's timestamp of the batch (its clock, seconds): data, never read as kvledger's."""
    dp_rank: int | None
    events: int
    """How many events the batch held."""


class ObservedBlocksStored(Event, frozen=True, tag="observed_blocks_stored"):
    """The engine cached full blocks under these hashes: `block_hashes` chain from `parent_hash`
    (the first block's parent), `token_ids` are the blocks' tokens."""

    engine_id: str
    incarnation: int
    source_seq: int
    dp_rank: int | None
    medium: str
    """GPU, CPU, STORAGE... as the engine names it."""
    group: int
    """The engine's KV-cache group (vLLM's group_idx)."""
    block_hashes: list[bytes]
    parent_hash: bytes | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None


class ObservedBlocksRemoved(Event, frozen=True, tag="observed_blocks_removed"):
    """The engine evicted these hashes from a medium and group."""

    engine_id: str
    incarnation: int
    source_seq: int
    dp_rank: int | None
    medium: str
    group: int
    block_hashes: list[bytes]


class ObservedCacheCleared(Event, frozen=True, tag="observed_cache_cleared"):
    """The engine dropped every block of a medium (vLLM's AllBlocksCleared: a prefix-cache reset)."""

    engine_id: str
    incarnation: int
    source_seq: int
    dp_rank: int | None
    medium: str


class ObservedEventsMissed(Event, frozen=True, tag="observed_events_missed"):
    """Batches first_seq..last_seq of the engine were never recorded (lost, unreadable, or before
    ingestion joined) and replay could not fill them: from here on this incarnation's view may
    lack blocks, so its parent-chain and removal checks are off."""

    engine_id: str
    incarnation: int
    first_seq: int
    last_seq: int
    reason: str = ""


# --- external keys (an engine that owns its device blocks and names its own keys: vLLM's offloading) --


class ExternalItem(msgspec.Struct, frozen=True, array_like=True, gc=False):
    """One block of an external job: the engine's own key for it, the tier key kvledger made of
    that key in the engine's namespace (coordinator/core/external.py, `external_key`: I8, I9), and the
    tier slot. The device block is the engine's: kvledger never names it."""

    pool_id: int
    """The cache group (vLLM's group_idx)."""
    engine_key: bytes
    """The key as the engine names it (vLLM: its block hash + the group, 4 bytes big-endian)."""
    key: bytes
    """The tier key: what the tier publishes, leases and quarantines."""
    tier_slot: int
    tier_generation: int
    checksums: list[bytes] = []
    """Loads: the published checksum of each rank's shard, for the worker to verify (I13)."""


class ExternalKeysLookedUp(Event, frozen=True, tag="external_keys_looked_up"):
    """An engine asked which of its keys are loadable (published, not quarantined, in its
    namespace: I9, I17); `loadable[i]` answers `engine_keys[i]`. A record, not state."""

    engine_id: str
    tier: str
    pool_ids: list[int]
    engine_keys: list[bytes]
    loadable: list[bool]
    answered_at: float = 0.0
    """Wall-clock seconds when the sidecar answered it on its read path (LookupKeys), which
    records it with a later group; 0.0 for an answer inside a step (its step's time is its own)."""
    head_seq: int = 0
    """The last committed global sequence the answer read (read path only; 0 inside a step)."""


class ExternalStoreStarted(Event, frozen=True, tag="external_store_started"):
    """A decision: each rank copies the engine's blocks of these keys into their tier slots and
    reports a checksum per item; a key is published only when every rank did (I5). Slots came
    free or from evicting unleased keys (I12); the KeyEvicted events come first."""

    job_id: int
    engine_id: str
    incarnation: int
    tier: str
    world_size: int
    items: list[ExternalItem]
    already_published: list[bytes] = []
    """Engine keys the tier already holds, or that a store in flight is writing: an idempotent skip (I10)."""


class ExternalLoadStarted(Event, frozen=True, tag="external_load_started"):
    """A decision: each rank reads each item's slot, verifies it against the published checksum
    (I13), fills the engine's block and reports. The keys are leased until `lease_expires_at` (I12)."""

    job_id: int
    engine_id: str
    incarnation: int
    tier: str
    world_size: int
    items: list[ExternalItem]
    lease_expires_at: float


# --- refusals and dropped notices ------------------------------------------------------------


class Refused(Event, frozen=True, tag="refused"):
    """A command the decider rejected. The state is unchanged."""

    engine_id: str
    command: str
    reason: Reason
    detail: str


class NoticeDropped(Event, frozen=True, tag="notice_dropped"):
    """A stale notice or report the decider dropped (I1, I4, I14, I16). The state is unchanged."""

    engine_id: str
    notice: str
    reason: Reason
    detail: str


EVENT_TYPES: tuple[type[Event], ...] = (
    NamespaceRegistered,
    TierDeclared,
    EngineDeclared,
    EngineReset,
    StepBegan,
    StepEnded,
    OwnerStarted,
    OwnerFinished,
    BlocksAllocated,
    BlocksReused,
    BlocksReleased,
    BlocksComputed,
    PrefixLookedUp,
    StoreJobStarted,
    LoadJobStarted,
    StateCopyPlanned,
    RankReported,
    JobSucceeded,
    JobFailed,
    JobFenced,
    FencedRankDone,
    KeyPublished,
    KeyEvicted,
    KeyQuarantined,
    NamespaceDecided,
    NamespaceReleased,
    EncoderEntryAllocated,
    EncoderEntryFreed,
    Refused,
    NoticeDropped,
    EngineObserved,
    ObservedBatch,
    ObservedBlocksStored,
    ObservedBlocksRemoved,
    ObservedCacheCleared,
    ObservedEventsMissed,
    ExternalKeysLookedUp,
    ExternalStoreStarted,
    ExternalLoadStarted,
    FencedRankReleased,
)


def event_tag(event_type: type[Event]) -> str:
    """The stable string tag of an event type."""
    tag = event_type.__struct_config__.tag
    assert isinstance(tag, str)
    return tag


AnyEvent = (
    NamespaceRegistered
    | TierDeclared
    | EngineDeclared
    | EngineReset
    | StepBegan
    | StepEnded
    | OwnerStarted
    | OwnerFinished
    | BlocksAllocated
    | BlocksReused
    | BlocksReleased
    | BlocksComputed
    | PrefixLookedUp
    | StoreJobStarted
    | LoadJobStarted
    | StateCopyPlanned
    | RankReported
    | JobSucceeded
    | JobFailed
    | JobFenced
    | FencedRankDone
    | KeyPublished
    | KeyEvicted
    | KeyQuarantined
    | NamespaceDecided
    | NamespaceReleased
    | EncoderEntryAllocated
    | EncoderEntryFreed
    | Refused
    | NoticeDropped
    | EngineObserved
    | ObservedBatch
    | ObservedBlocksStored
    | ObservedBlocksRemoved
    | ObservedCacheCleared
    | ObservedEventsMissed
    | ExternalKeysLookedUp
    | ExternalStoreStarted
    | ExternalLoadStarted
    | FencedRankReleased
)
"""Every event type, as one tagged union: what a message field holding any event is typed as."""
