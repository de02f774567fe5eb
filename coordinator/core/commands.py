"""Commands: what engines and workers ask of the coordinator. The decider answers each with
events, or with a `Refused` / `NoticeDropped` event naming the reason.

A *notice* (FreeBlocks, FreeEncoderEntry, ReportRank) tells the coordinator something that
already happened; a stale one is dropped. Every other command asks for a decision; an unsafe one
is refused. Both are recorded (I1).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import msgspec

from events import BlockRef, NamespaceSpec, PoolSpec, TierSpec


class Command(msgspec.Struct, frozen=True, kw_only=True, tag_field="command"):
    pass


class DeclareTier(Command, frozen=True, tag="declare_tier"):
    spec: TierSpec


class DeclareEngine(Command, frozen=True, tag="declare_engine"):
    """Hello from an engine. Declaring a known engine again is a restart: a new incarnation."""

    engine_id: str
    namespace: NamespaceSpec
    pools: list[PoolSpec]
    world_size: int
    tiers: list[str] = []
    encoder_cache_tokens: int = 0
    key_hash_algorithm: str = ""
    """The algorithm the engine's own block keys are made with, when it names its keys itself
    (external keys: vLLM's prefix_caching_hash_algo, as "vllm:sha256"). Given, it must equal the
    namespace's hash_algorithm: keys hashed another way never meet the namespace's (refused, naming
    both)."""
    takeover: bool = False
    """Set by the sidecar when this declaration replaced an engine that was still connected (a
    deliberate takeover, Hello's `takeover`): recorded on EngineDeclared, for the audit."""


class ResetCache(Command, frozen=True, tag="reset_cache"):
    engine_id: str
    reason: str = "reset_cache"
    drop_tier_keys: bool = False
    """Also end the keys of the engine's namespace in its tiers (vLLM's
    `reset_prefix_cache(reset_connector=True)`): none is found or loaded afterwards
    (coordinator/core/namespaces.py, `ended_by_reset`)."""


class BeginStep(Command, frozen=True, tag="begin_step"):
    engine_id: str
    step: int
    clock: float


class EndStep(Command, frozen=True, tag="end_step"):
    engine_id: str


class StartOwner(Command, frozen=True, tag="start_owner"):
    engine_id: str
    req_id: str
    resumed: bool = False


class FinishOwner(Command, frozen=True, tag="finish_owner"):
    """The request finished, was preempted or aborted: its refs are released."""

    engine_id: str
    owner_id: int
    reason: str = "finished"
    req_id: str = ""
    """What the engine calls the request. Informational: kvledger accounts by owner_id (I4)."""


class AllocateBlocks(Command, frozen=True, tag="allocate_blocks"):
    """Managed pools: the coordinator picks `count` slots. Reported pools: the engine names
    the slots it allocated in `block_ids` and the coordinator checks and records them."""

    engine_id: str
    owner_id: int
    pool_id: int
    count: int
    block_ids: list[int] | None = None


class ReuseBlocks(Command, frozen=True, tag="reuse_blocks"):
    """Take a ref on computed blocks (a device prefix-cache hit)."""

    engine_id: str
    owner_id: int
    blocks: list[BlockRef]


class FreeBlocks(Command, frozen=True, tag="free_blocks"):
    """Notice: the owner no longer needs these blocks."""

    engine_id: str
    owner_id: int
    blocks: list[BlockRef]


class MarkComputed(Command, frozen=True, tag="mark_computed"):
    """The blocks (consecutive, in one pool) now hold the state of `token_ids`; the
    coordinator assigns each its chained content key (I8)."""

    engine_id: str
    owner_id: int
    blocks: list[BlockRef]
    token_ids: list[int]
    parent_key: bytes | None = None
    extra_keys: list[str] = []


class LookupPrefix(Command, frozen=True, tag="lookup_prefix"):
    engine_id: str
    tier: str
    token_ids: Sequence[int]
    """A list, or the sidecar's packed array (coordinator.sidecar.protocol.lookup_tokens)."""
    extra_keys: list[str] = []


class StartStore(Command, frozen=True, tag="start_store"):
    """Store computed blocks into a tier under their content keys."""

    engine_id: str
    tier: str
    blocks: list[BlockRef]


class LoadRequest(msgspec.Struct, frozen=True, array_like=True, gc=False):
    key: bytes
    dest: BlockRef


class StartLoad(Command, frozen=True, tag="start_load"):
    """Load published keys into allocated, not yet computed blocks; the same key may appear
    more than once (I11)."""

    engine_id: str
    tier: str
    items: list[LoadRequest]
    lease_seconds: float = 30.0


class Move(msgspec.Struct, frozen=True, array_like=True, gc=False):
    """Copy `length` bytes from src block at src_offset to dst block at dst_offset."""

    src: BlockRef
    src_offset: int
    dst: BlockRef
    dst_offset: int
    length: int


class PlanStateCopy(Command, frozen=True, tag="plan_state_copy"):
    """A batch of state moves with parallel-assignment meaning: every move reads the content
    as it was before the batch (I15)."""

    engine_id: str
    pool_id: int
    moves: list[Move]


class ReportRank(Command, frozen=True, tag="report_rank"):
    """Notice from one worker rank: its part of a job is done (ok) or failed."""

    job_id: int
    rank: int
    ok: bool
    checksums: list[bytes] = []
    error: str = ""
    lost: list[int] = []
    """A failed load's items whose bytes the tier no longer holds (a Mooncake Store evicts on
    its own): their keys leave kvledger's tier, so no lookup offers them again."""
    engine_id: str = ""
    """The engine whose worker sent the report, as the sidecar knows it from the connection (it
    stamps every report; a report naming another engine is refused at the door). The decider
    refuses a report on another engine's job (FOREIGN_JOB), so a report the door let in counts for
    no other job whatever happened before its decision. Empty: a report of the in-process core,
    whose callers are the engine."""


class AllocateEncoderEntry(Command, frozen=True, tag="allocate_encoder_entry"):
    engine_id: str
    entry_id: str
    num_tokens: int


class FreeEncoderEntry(Command, frozen=True, tag="free_encoder_entry"):
    """Notice: the scheduler evicted this encoder-cache entry."""

    engine_id: str
    entry_id: str


class DecideNamespace(Command, frozen=True, tag="decide_namespace"):
    """An operator's release decision from namespace A to namespace B (seed 003): `new`,
    `compatible` (needs `evidence`: the id of a verification run comparing cached and uncached
    outputs) or `clear` (A's published keys are quarantined). Namespace ids are hex, as
    `kvledger audit namespaces` lists them; the decider refuses bad hex and unknown ids."""

    from_namespace: str
    to_namespace: str
    outcome: str
    """new, compatible or clear (checked by the decider: a typo is a refusal, not a frame error)."""
    reason: str
    evidence: str = ""


class ReleaseNamespace(Command, frozen=True, tag="release_namespace"):
    """Clean up an abandoned namespace (`kvledger namespace gc`): evict every key it published."""

    namespace: str
    """Hex, as `kvledger audit namespaces` lists it."""
    reason: str


class ReleaseFencedRank(Command, frozen=True, tag="release_fenced_rank"):
    """An operator says one rank's worker of an engine is gone (its process dead: nothing it
    started can still land), so the fenced jobs that wait on that rank's late report (I16) will
    never hear from it: release what they hold (`kvledger jobs release`)."""

    engine_id: str
    rank: int
    reason: str


# --- observed engines: an engine kvledger does not coordinate, read from its own KV events --------
# (coordinator/vllm/ decodes vLLM's; coordinator/core/observe.py decides these)

ObservedKind = Literal["stored", "removed", "cleared", "unknown", "malformed"]


class ObservedKvEvent(msgspec.Struct, frozen=True, kw_only=True):
    """One of the engine's KV events, normalized: hashes as bytes, the medium named, the group a
    number, whatever the engine's version encoded (coordinator/vllm/kv_events.py)."""

    kind: ObservedKind
    """stored, removed, cleared; unknown (a type this kvledger does not know: `type_name`) or
    malformed (an event of a known type that could not be read: `detail`)."""
    medium: str = "GPU"
    group: int = 0
    block_hashes: list[bytes] = []
    parent_hash: bytes | None = None
    token_ids: list[int] = []
    block_size: int = 0
    lora_id: int | None = None
    type_name: str = ""
    """The engine's name for the event type (BlockStored, BlockRemoved, AllBlocksCleared...)."""
    detail: str = ""


class ObserveEngine(Command, frozen=True, tag="observe_engine"):
    """Begin observing an engine (first sight), or note that it restarted: a new observed
    incarnation. `namespace` is what the operator declares the engine runs."""

    engine_id: str
    namespace: NamespaceSpec
    source: str
    reason: str


class ObserveKvEvents(Command, frozen=True, tag="observe_kv_events"):
    """One batch of the engine's KV events, with the engine's sequence number and timestamp."""

    engine_id: str
    seq: int
    ts: float
    dp_rank: int | None
    events: list[ObservedKvEvent]


class ObserveGap(Command, frozen=True, tag="observe_gap"):
    """Batches first_seq..last_seq were never received and replay could not fill them."""

    engine_id: str
    first_seq: int
    last_seq: int
    reason: str = ""


class ObserveMalformed(Command, frozen=True, tag="observe_malformed"):
    """A frame of the engine's that could not be decoded (seq -1: not even its sequence)."""

    engine_id: str
    seq: int
    detail: str


# --- external keys: the engine owns its device blocks and names its keys (vLLM's offloading) -------
# (coordinator/core/external.py decides these; the tier key is made from the engine's key by kvledger)


class ExternalKey(msgspec.Struct, frozen=True, array_like=True, gc=False):
    pool_id: int
    """The cache group the key belongs to."""
    engine_key: bytes
    """The key as the engine names it (vLLM: the block hash + group_idx)."""


class LookupExternal(Command, frozen=True, tag="lookup_external"):
    """Which of these keys are loadable now, in this engine's namespace (recorded)."""

    engine_id: str
    tier: str
    keys: list[ExternalKey]


class StoreExternal(Command, frozen=True, tag="store_external"):
    """Store blocks the engine holds in memory kvledger does not manage, under its own keys:
    kvledger admits the new ones, gives each a tier slot (evicting by LRU, never a leased key,
    I12) and names the job."""

    engine_id: str
    tier: str
    keys: list[ExternalKey]


class LoadExternal(Command, frozen=True, tag="load_external"):
    """Load published keys into the engine's blocks; the keys are leased until the job ends or
    `lease_seconds` pass (I12)."""

    engine_id: str
    tier: str
    keys: list[ExternalKey]
    lease_seconds: float = 30.0


AnyCommand = (
    DeclareTier
    | DeclareEngine
    | ResetCache
    | BeginStep
    | EndStep
    | StartOwner
    | FinishOwner
    | AllocateBlocks
    | ReuseBlocks
    | FreeBlocks
    | MarkComputed
    | LookupPrefix
    | StartStore
    | StartLoad
    | PlanStateCopy
    | ReportRank
    | AllocateEncoderEntry
    | FreeEncoderEntry
    | DecideNamespace
    | ReleaseNamespace
    | ObserveEngine
    | ObserveKvEvents
    | ObserveGap
    | ObserveMalformed
    | LookupExternal
    | StoreExternal
    | LoadExternal
    | ReleaseFencedRank
)

NOTICES: tuple[type[Command], ...] = (FreeBlocks, FreeEncoderEntry, ReportRank)
OPERATOR_COMMANDS: tuple[type[Command], ...] = (DecideNamespace, ReleaseNamespace, ReleaseFencedRank)
"""Commands an operator gives (`kvledger namespace ...`), never an engine: they name no engine
and go to the log's "namespaces" stream."""


def command_tag(command: Command | type[Command]) -> str:
    """The stable string tag of a command (what `Refused.command` records)."""
    command_type = command if isinstance(command, type) else type(command)
    tag = command_type.__struct_config__.tag
    assert isinstance(tag, str)
    return tag
