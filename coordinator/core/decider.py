"""The decider: (state, command) -> events. Pure: it reads the state and never changes it.

Every handler validates everything before it returns; a `Refusal` raised anywhere becomes one
`Refused` event (or `NoticeDropped` for a notice) and the state stays exactly as it was. The
projector then folds the returned events; the state the next command sees is that fold.
"""

from __future__ import annotations

from collections.abc import Callable, Container
from typing import Any

import msgspec

from coordinator.core import checks as check
from coordinator.core import external, jobs, namespaces, observe
from coordinator.core.checks import Refusal
from coordinator.core.commands import (
    NOTICES,
    AllocateBlocks,
    AllocateEncoderEntry,
    AnyCommand,
    BeginStep,
    Command,
    DeclareEngine,
    DeclareTier,
    EndStep,
    FinishOwner,
    FreeBlocks,
    FreeEncoderEntry,
    LookupExternal,
    LookupPrefix,
    MarkComputed,
    ReportRank,
    ResetCache,
    ReuseBlocks,
    StartOwner,
    command_tag,
)
from coordinator.core.keys import content_key, namespace_id, namespace_problems
from coordinator.core.protections import Protection, is_off
from coordinator.core.state import EngineState, SlotStatus, State
from events import (
    NULL_BLOCK_ID,
    BlockRef,
    BlocksAllocated,
    BlocksComputed,
    BlocksReleased,
    BlocksReused,
    ComputedBlock,
    EncoderEntryAllocated,
    EncoderEntryFreed,
    EngineDeclared,
    EngineReset,
    Event,
    ExternalKeysLookedUp,
    JobFenced,
    NamespaceRegistered,
    NamespaceSpec,
    NoticeDropped,
    OwnerFinished,
    OwnerStarted,
    PrefixLookedUp,
    Reason,
    Refused,
    StepBegan,
    StepEnded,
    TierDeclared,
)

Handler = Callable[[State, Any], list[Event]]


def decide(state: State, command: AnyCommand) -> list[Event]:
    """Answer one command with the events it causes, or with a refusal event."""
    handler = _HANDLERS[type(command)]
    try:
        return handler(state, command)
    except Refusal as refusal:
        return [_refusal_event(state, command, refusal)]


def lookup(
    state: State, command: LookupPrefix, hashed: jobs.Chains | None = None, uncommitted: Container[bytes] = frozenset()
) -> PrefixLookedUp | Refused:
    """The read-only fast path of LookupPrefix: the same answer, outside any step, recorded
    nowhere (the sidecar's Lookup). A refusal comes back as the Refused event it would be.
    `hashed`: its chain keys, hashed beforehand (`jobs.hash_chains`), used if still right;
    a key in `uncommitted` (changed by a group not yet in the log) is not loadable."""
    try:
        return jobs.prefix_hit(state, command, check.engine(state, command.engine_id), hashed, uncommitted)
    except Refusal as refusal:
        event = _refusal_event(state, command, refusal)
        assert isinstance(event, Refused)
        return event


def lookup_keys(
    state: State, command: LookupExternal, uncommitted: Container[bytes] = frozenset()
) -> ExternalKeysLookedUp | Refused:
    """The read-only fast path of LookupExternal: the same answer, outside any step (the
    sidecar's LookupKeys, recorded in the log afterwards). A refusal comes back as the Refused
    event it would be."""
    try:
        return external.answer_lookup(state, command, uncommitted)
    except Refusal as refusal:
        event = _refusal_event(state, command, refusal)
        assert isinstance(event, Refused)
        return event


def _refusal_event(state: State, command: Command, refusal: Refusal) -> Event:
    tag = command_tag(command)
    engine_id = getattr(command, "engine_id", "")
    if isinstance(command, ReportRank):
        job = state.jobs.get(command.job_id)
        engine_id = job.decision.engine_id if job is not None else ""
    if isinstance(command, NOTICES):
        return NoticeDropped(engine_id=engine_id, notice=tag, reason=refusal.reason, detail=refusal.detail)
    return Refused(engine_id=engine_id, command=tag, reason=refusal.reason, detail=refusal.detail)


# --- declarations ------------------------------------------------------------------------------


def _declare_tier(state: State, command: DeclareTier) -> list[Event]:
    spec = command.spec
    check.stream_name(spec.name, "tier name")
    check.count(spec.num_slots, check.MAX_BLOCKS_PER_POOL, f"tier {spec.name!r} num_slots")
    check.count(spec.bytes_per_slot, 1 << 40, f"tier {spec.name!r} bytes_per_slot")
    known = state.tiers.get(spec.name)
    if known is not None:
        if known.spec != spec:
            raise Refusal(Reason.TIER_SPEC_CHANGED, f"tier {spec.name!r} was declared as {known.spec}")
        return []
    return [TierDeclared(spec=spec)]


def _declare_engine(state: State, command: DeclareEngine) -> list[Event]:
    name = command.engine_id
    check.stream_name(name, "engine_id")
    problems = namespace_problems(command.namespace)
    if problems:
        raise Refusal(Reason.INVALID_ARGUMENT, f"namespace: {'; '.join(problems)}")
    ns = command.namespace
    if command.world_size != ns.tensor_parallel_size * ns.pipeline_parallel_size:
        raise Refusal(
            Reason.NAMESPACE_MISMATCH,
            f"world_size {command.world_size} != tensor x pipeline parallel size of the namespace",
        )
    check.count(len(command.pools), 64, "number of pools")
    pool_ids = [p.pool_id for p in command.pools]
    if len(set(pool_ids)) != len(pool_ids):
        raise Refusal(Reason.INVALID_ARGUMENT, f"pool ids repeat: {pool_ids}")
    for spec in command.pools:
        if not 0 <= spec.pool_id <= check.MAX_POOL_ID:
            # In the core, not only at the sidecar's door: a pool id the audit index cannot hold
            # stopped every catch-up of the index (found by fuzzing the sidecar).
            raise Refusal(Reason.INVALID_ARGUMENT, f"pool id {spec.pool_id} is outside 0..{check.MAX_POOL_ID}")
        # Block 0 is the null block, so a usable pool has at least two.
        check.count(spec.num_blocks - 1, check.MAX_BLOCKS_PER_POOL, f"pool {spec.pool_id} usable blocks")
        check.count(spec.block_size, 1 << 20, f"pool {spec.pool_id} block_size")
        check.count(spec.bytes_per_block, 1 << 40, f"pool {spec.pool_id} bytes_per_block")
        if spec.sliding_window < 0:
            raise Refusal(Reason.INVALID_ARGUMENT, f"pool {spec.pool_id} sliding_window < 0")
    block_sizes = tuple(p.block_size for p in command.pools)
    if block_sizes != ns.block_sizes:
        raise Refusal(
            Reason.NAMESPACE_MISMATCH,
            f"pools have block sizes {block_sizes}, the namespace says {ns.block_sizes}",
        )
    if command.key_hash_algorithm and command.key_hash_algorithm != ns.hash_algorithm:
        # The engine names its keys itself (external keys): hashed another way, they are not the
        # namespace's keys, whatever their length.
        raise Refusal(
            Reason.NAMESPACE_MISMATCH,
            f"the engine hashes its blocks with {command.key_hash_algorithm!r}, the namespace says {ns.hash_algorithm!r}",
        )
    for tier_name in command.tiers:
        if tier_name not in state.tiers:
            raise Refusal(Reason.UNKNOWN_TIER, f"tier {tier_name!r} was never declared")
    if not 0 <= command.encoder_cache_tokens <= check.MAX_ENCODER_CACHE_TOKENS:
        raise Refusal(
            Reason.INVALID_COUNT,
            f"encoder_cache_tokens {command.encoder_cache_tokens:,} is outside 0..{check.MAX_ENCODER_CACHE_TOKENS:,}",
        )

    events: list[Event] = []
    ns_id = namespace_id(_weakened(ns))
    if ns_id not in state.namespaces:
        events.append(NamespaceRegistered(namespace_id=ns_id, spec=ns))
    known = state.engines.get(name)
    incarnation = 1
    if known is not None:
        if [p.spec for p in known.pools.values()] != command.pools:
            raise Refusal(
                Reason.POOL_LAYOUT_CHANGED,
                f"engine {name!r} restarted with other pools; use a new engine_id",
            )
        incarnation = known.incarnation + 1
        events += _reset_events(state, known, incarnation, "restart")
    events.append(
        EngineDeclared(
            engine_id=name,
            incarnation=incarnation,
            namespace_id=ns_id,
            pools=command.pools,
            world_size=command.world_size,
            tiers=command.tiers,
            encoder_cache_tokens=command.encoder_cache_tokens,
            takeover=command.takeover,
        )
    )
    return events


def _weakened(ns: NamespaceSpec) -> NamespaceSpec:
    """The namespace as its id is computed: whole, unless a simulator scenario switched off a
    part of it (the naive namespaces of seed 003, vLLM #56772, LMCache #4463)."""
    if is_off(Protection.NAMESPACE_WEIGHTS):
        ns = msgspec.structs.replace(ns, weights_revision="")
    if is_off(Protection.NAMESPACE_TENANT):
        ns = msgspec.structs.replace(ns, tenant="")
    if is_off(Protection.NAMESPACE_PARALLEL):
        ns = msgspec.structs.replace(ns, tensor_parallel_size=1, pipeline_parallel_size=1, kv_rank_layout="")
    if is_off(Protection.NAMESPACE_LAYOUT):
        ns = msgspec.structs.replace(ns, kv_layout_version=0, kv_dtype="")
    return ns


def _reset_events(state: State, eng: EngineState, incarnation: int, reason: str) -> list[Event]:
    """Fence the old incarnation's jobs (I16), then reset its device state."""
    events: list[Event] = [
        JobFenced(job_id=job.job_id, pending=[rank for rank in range(job.decision.world_size) if rank not in job.reports])
        for job in state.jobs.values()
        if job.decision.engine_id == eng.engine_id and not is_off(Protection.FENCING)
    ]
    events.append(
        EngineReset(engine_id=eng.engine_id, incarnation=incarnation, reason=reason, keep_pins=not is_off(Protection.FENCING))
    )
    return events


def _reset_cache(state: State, command: ResetCache) -> list[Event]:
    eng = check.engine(state, command.engine_id)
    events = _reset_events(state, eng, eng.incarnation + 1, command.reason or "reset_cache")
    # vLLM's reset_prefix_cache(reset_connector=True): the tier too (off: vLLM #57727)
    if command.drop_tier_keys and not is_off(Protection.TIER_RESET):
        events += namespaces.ended_by_reset(state, eng.engine_id, eng.namespace_id, eng.tiers)
    return events


# --- steps ---------------------------------------------------------------------------------------


def _begin_step(state: State, command: BeginStep) -> list[Event]:
    eng = check.engine(state, command.engine_id)
    if eng.step_open:
        raise Refusal(Reason.STEP_ALREADY_OPEN, f"step {eng.step} is still open")
    if command.step <= eng.step:
        raise Refusal(Reason.STEP_NOT_ADVANCING, f"step {command.step} after step {eng.step}")
    first = eng.step < 0  # the first step of this incarnation: a declaration starts steps afresh
    if first and command.step > check.MAX_FIRST_STEP:
        raise Refusal(
            Reason.STEP_JUMP, f"step {command.step} is above {check.MAX_FIRST_STEP:,}, the largest first step of an incarnation"
        )
    if not first and command.step - eng.step > check.MAX_STEP_JUMP:
        raise Refusal(Reason.STEP_JUMP, f"step {command.step} leaps more than {check.MAX_STEP_JUMP:,} past step {eng.step}")
    check.finite(command.clock, "clock", low=-1e18, high=1e18)
    if command.clock < eng.clock and not first:
        raise Refusal(Reason.CLOCK_REGRESSED, f"clock {command.clock} < {eng.clock}")
    if not first and command.clock - eng.clock > check.MAX_CLOCK_JUMP:
        raise Refusal(
            Reason.STEP_JUMP,
            f"clock {command.clock} leaps more than {check.MAX_CLOCK_JUMP:,.0f} s past the engine's clock {eng.clock}",
        )
    return [StepBegan(engine_id=eng.engine_id, step=command.step, clock=command.clock)]


END_OF_STEP_NOTICES = frozenset({"block_freed", "encoder_entry_freed", "key_removed"})
"""The notices end-of-step reconciliation drops (NoticeDropped before StepEnded, _end_step):
never a command's tag, so a step's events can be split again by them (coordinator.ledger.split_step)."""


def _end_step(state: State, command: EndStep) -> list[Event]:
    """End-of-step reconciliation (I14): a notice survives only if the end state agrees."""
    eng = check.engine_in_step(state, command.engine_id)
    events: list[Event] = []

    def drop(notice: str, detail: str) -> None:
        events.append(NoticeDropped(engine_id=eng.engine_id, notice=notice, reason=Reason.REALLOCATED_IN_STEP, detail=detail))

    freed_blocks = []
    for ref in dict.fromkeys(eng.pending_freed_blocks):  # freed, reused, freed: one notice
        pool = eng.pools[ref.pool_id]
        still_free = pool.generations[ref.block_id] == ref.generation and pool.status(ref.block_id) in (
            SlotStatus.FREE,
            SlotStatus.CACHED_FREE,
        )
        if still_free:
            freed_blocks.append(ref)
        else:
            drop("block_freed", f"block {ref.pool_id}/{ref.block_id} gen {ref.generation}")
    freed_entries = []
    naive = is_off(Protection.END_OF_STEP)  # seed 000's encoder cache: every free is announced
    for entry_id in dict.fromkeys(eng.pending_freed_encoder):
        if entry_id in eng.encoder_entries and not naive:
            drop("encoder_entry_freed", f"encoder entry {entry_id!r}")
        else:
            freed_entries.append(entry_id)
    removed_keys = []
    tiers = state.tiers
    name, group_id, group = None, None, None
    for tier_name, pool_id, key in eng.pending_removed_keys:  # one per key evicted: TierState.slot_of inlined
        if pool_id != group_id or tier_name != name:  # read once for a run of one tier and group
            name, group_id = tier_name, pool_id
            group = tiers[tier_name].published.get(pool_id)
        if group is not None and key in group:
            drop("key_removed", f"key {key.hex()} in tier {tier_name!r}")
        else:
            removed_keys.append(key)
    events.append(
        StepEnded(
            engine_id=eng.engine_id,
            step=eng.step,
            freed_blocks=freed_blocks,
            freed_encoder_entries=freed_entries,
            removed_keys=removed_keys,
        )
    )
    return events


# --- owners and blocks -----------------------------------------------------------------------


def _start_owner(state: State, command: StartOwner) -> list[Event]:
    eng = check.engine_in_step(state, command.engine_id)
    return [
        OwnerStarted(
            engine_id=eng.engine_id,
            owner_id=state.next_owner_id,
            req_id=command.req_id,
            resumed=command.resumed,
        )
    ]


def _finish_owner(state: State, command: FinishOwner) -> list[Event]:
    eng = check.engine_in_step(state, command.engine_id)
    if command.req_id and command.owner_id not in state.owners and is_off(Protection.JOB_IDENTITY):
        # The naive connector of seed 000: "req_id finished" finds whoever has that req_id now.
        current = [o for o in state.owners.values() if o.engine_id == eng.engine_id and o.req_id == command.req_id]
        if current:
            command = msgspec.structs.replace(command, owner_id=current[-1].owner_id)
    own = check.owner(state, eng, command.owner_id)
    held = [
        BlockRef(pool_id, block_id, generation)
        for pool_id, blocks in own.blocks.items()
        for block_id, generation in blocks.items()
    ]
    events: list[Event] = []
    if held:
        events.append(BlocksReleased(engine_id=eng.engine_id, owner_id=own.owner_id, blocks=held))
    events.append(OwnerFinished(engine_id=eng.engine_id, owner_id=own.owner_id, reason=command.reason))
    return events


def _allocate_blocks(state: State, command: AllocateBlocks) -> list[Event]:
    eng = check.engine_in_step(state, command.engine_id)
    own = check.owner(state, eng, command.owner_id)
    pool = check.pool(eng, command.pool_id)
    check.count(command.count, pool.spec.num_blocks - 1, f"blocks to allocate from pool {pool.spec.pool_id}")
    if pool.spec.managed:
        if command.block_ids is not None:
            raise Refusal(Reason.INVALID_ARGUMENT, f"pool {pool.spec.pool_id} is managed: do not name block_ids")
        available = len(pool.free) + len(pool.cached)
        if command.count > available:
            raise Refusal(Reason.POOL_EXHAUSTED, f"pool {pool.spec.pool_id} has {available} free, asked {command.count}")
        # Clean free slots first, then cached-free ones, least recently freed first (LRU).
        # Pinned, draining and null slots are in neither list, so they are never chosen (I2, I3).
        chosen: list[int] = []
        for candidates in (pool.free, pool.cached):
            for block_id in candidates:
                if len(chosen) == command.count:
                    break
                chosen.append(block_id)
    else:
        if command.block_ids is None or len(command.block_ids) != command.count:
            raise Refusal(Reason.INVALID_ARGUMENT, f"reported pool {pool.spec.pool_id} needs {command.count} block_ids")
        if len(set(command.block_ids)) != len(command.block_ids):
            raise Refusal(Reason.INVALID_ARGUMENT, "the same block_id appears twice")
        for block_id in command.block_ids:
            if block_id == NULL_BLOCK_ID:
                raise Refusal(Reason.NULL_BLOCK, f"block 0 of pool {pool.spec.pool_id} is the null block")
            if not 0 < block_id < pool.spec.num_blocks:
                raise Refusal(Reason.UNKNOWN_SLOT, f"pool {pool.spec.pool_id} has no block {block_id}")
            status = pool.status(block_id)
            if status is SlotStatus.DRAINING:
                # The engine's allocator recycled a block a job still reads (seed 000).
                raise Refusal(Reason.SLOT_PINNED, f"block {pool.spec.pool_id}/{block_id} is pinned by a job in flight")
            if status is SlotStatus.ALLOCATED:
                raise Refusal(Reason.SLOT_IN_USE, f"block {pool.spec.pool_id}/{block_id} is held by an owner")
        chosen = list(command.block_ids)
    refs = [BlockRef(pool.spec.pool_id, b, pool.generations[b] + 1) for b in chosen]
    return [BlocksAllocated(engine_id=eng.engine_id, owner_id=own.owner_id, blocks=refs)]


def _reuse_blocks(state: State, command: ReuseBlocks) -> list[Event]:
    eng = check.engine_in_step(state, command.engine_id)
    own = check.owner(state, eng, command.owner_id)
    check.unique_refs(command.blocks, "blocks to reuse")
    for ref in command.blocks:
        pool = check.block(eng, ref)
        if pool.keys[ref.block_id] is None and not is_off(Protection.VISIBLE_WHEN_COMPLETE):
            raise Refusal(Reason.NOT_COMPUTED, f"block {ref.pool_id}/{ref.block_id} holds no computed content")
        if ref.block_id in own.blocks.get(ref.pool_id, {}):
            raise Refusal(Reason.ALREADY_HELD, f"owner {own.owner_id} already holds {ref.pool_id}/{ref.block_id}")
    return [BlocksReused(engine_id=eng.engine_id, owner_id=own.owner_id, blocks=command.blocks)]


def _free_blocks(state: State, command: FreeBlocks) -> list[Event]:
    eng = check.engine_in_step(state, command.engine_id)
    own = check.owner(state, eng, command.owner_id)
    check.unique_refs(command.blocks, "blocks to free")
    for ref in command.blocks:
        check.block(eng, ref)
        if own.blocks.get(ref.pool_id, {}).get(ref.block_id) != ref.generation:
            raise Refusal(Reason.NOT_OWNER, f"owner {own.owner_id} holds no ref on {ref}")
    return [BlocksReleased(engine_id=eng.engine_id, owner_id=own.owner_id, blocks=command.blocks)]


def _mark_computed(state: State, command: MarkComputed) -> list[Event]:
    eng = check.engine_in_step(state, command.engine_id)
    own = check.owner(state, eng, command.owner_id)
    check.unique_refs(command.blocks, "blocks to mark computed")
    pool_ids = {ref.pool_id for ref in command.blocks}
    if len(pool_ids) != 1:
        raise Refusal(Reason.INVALID_ARGUMENT, f"blocks span pools {sorted(pool_ids)}")
    naive_nulls = is_off(Protection.NULL_STATES)
    for ref in command.blocks:
        pool = check.block(eng, ref, allow_null=naive_nulls)
        if ref.block_id == NULL_BLOCK_ID:
            continue  # only with the null-state protection off: a skipped state position gets a key
        if own.blocks.get(ref.pool_id, {}).get(ref.block_id) != ref.generation:
            raise Refusal(Reason.NOT_OWNER, f"owner {own.owner_id} holds no ref on {ref}")
        if pool.keys[ref.block_id] is not None:
            raise Refusal(Reason.ALREADY_COMPUTED, f"block {ref.pool_id}/{ref.block_id} is already computed")
        if pool.pins[ref.block_id]:
            raise Refusal(Reason.SLOT_PINNED, f"block {ref.pool_id}/{ref.block_id} is being written by a job")
    size = pool.spec.block_size
    if len(command.token_ids) != size * len(command.blocks):
        raise Refusal(
            Reason.INVALID_COUNT,
            f"{len(command.blocks)} blocks of {size} tokens need {size * len(command.blocks)} token ids, "
            f"got {len(command.token_ids)}",
        )
    computed = []
    parent = command.parent_key
    for index, ref in enumerate(command.blocks):
        tokens = command.token_ids[index * size : (index + 1) * size]
        parent = content_key(eng.namespace_id, parent, tokens, jobs.keyed_extras(command.extra_keys))
        computed.append(ComputedBlock(ref, parent))
    return [BlocksComputed(engine_id=eng.engine_id, blocks=computed)]


# --- encoder cache -------------------------------------------------------------------------------


def _allocate_encoder_entry(state: State, command: AllocateEncoderEntry) -> list[Event]:
    eng = check.engine_in_step(state, command.engine_id)
    if not 0 < len(command.entry_id) <= check.MAX_ENCODER_ENTRY_ID:
        raise Refusal(
            Reason.INVALID_ARGUMENT, f"entry_id has {len(command.entry_id):,} characters, not 1..{check.MAX_ENCODER_ENTRY_ID}"
        )
    check.count(command.num_tokens, max(eng.encoder_cache_tokens, 1), "encoder entry tokens")
    if command.entry_id in eng.encoder_entries:
        raise Refusal(Reason.ALREADY_HELD, f"encoder entry {command.entry_id!r} is cached")
    if len(eng.encoder_entries) >= check.MAX_ENCODER_ENTRIES:
        raise Refusal(
            Reason.ENCODER_CACHE_FULL, f"{len(eng.encoder_entries):,} entries cached, at most {check.MAX_ENCODER_ENTRIES:,}"
        )
    used = eng.encoder_used
    if used + command.num_tokens > eng.encoder_cache_tokens:
        raise Refusal(
            Reason.ENCODER_CACHE_FULL,
            f"{used} of {eng.encoder_cache_tokens} tokens used, entry needs {command.num_tokens}",
        )
    return [EncoderEntryAllocated(engine_id=eng.engine_id, entry_id=command.entry_id, num_tokens=command.num_tokens)]


def _free_encoder_entry(state: State, command: FreeEncoderEntry) -> list[Event]:
    eng = check.engine_in_step(state, command.engine_id)
    if command.entry_id not in eng.encoder_entries:
        raise Refusal(Reason.UNKNOWN_SLOT, f"encoder entry {command.entry_id!r} is not cached")
    return [EncoderEntryFreed(engine_id=eng.engine_id, entry_id=command.entry_id)]


_HANDLERS: dict[type[Command], Handler] = {
    DeclareTier: _declare_tier,
    DeclareEngine: _declare_engine,
    ResetCache: _reset_cache,
    BeginStep: _begin_step,
    EndStep: _end_step,
    StartOwner: _start_owner,
    FinishOwner: _finish_owner,
    AllocateBlocks: _allocate_blocks,
    ReuseBlocks: _reuse_blocks,
    FreeBlocks: _free_blocks,
    MarkComputed: _mark_computed,
    AllocateEncoderEntry: _allocate_encoder_entry,
    FreeEncoderEntry: _free_encoder_entry,
    **jobs.HANDLERS,
    **namespaces.HANDLERS,
    **observe.HANDLERS,
    **external.HANDLERS,
}
