"""The projector: a pure fold `apply(state, event)` that builds the state from events.

It mutates the state in place for speed (the fold target is >= 1M events/s) but is otherwise a
function of (state, event): no I/O, no clock, no randomness, so the same log always projects to
the same bytes (I18). Refusals and dropped notices change nothing.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from coordinator.core.state import (
    EngineState,
    FencedJob,
    JobDecision,
    JobState,
    ObservedEngine,
    OwnerState,
    PoolState,
    State,
    TierState,
    count_job,
    observed_place,
    pack_checksums,
    removed,
)
from events import (
    NULL_BLOCK_ID,
    BlockRef,
    BlocksAllocated,
    BlocksComputed,
    BlocksReleased,
    BlocksReused,
    EncoderEntryAllocated,
    EncoderEntryFreed,
    EngineDeclared,
    EngineObserved,
    EngineReset,
    Event,
    ExternalItem,
    ExternalKeysLookedUp,
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
    ObservedBatch,
    ObservedBlocksRemoved,
    ObservedBlocksStored,
    ObservedCacheCleared,
    ObservedEventsMissed,
    OwnerFinished,
    OwnerStarted,
    PrefixLookedUp,
    RankReported,
    Refused,
    StateCopyPlanned,
    StepBegan,
    StepEnded,
    StoreItem,
    StoreJobStarted,
    TierDeclared,
)


class ProjectionError(RuntimeError):
    """The authoritative projector met an event it cannot fold (never silently skipped)."""


_KEY_CHANGES = (KeyPublished, KeyEvicted, KeyQuarantined)
_ENGINE_CHANGES = (EngineDeclared, EngineReset)


def read_effects(events: Iterable[Event]) -> tuple[set[bytes], set[str]]:
    """What of these events a read-only answer (a lookup) could show: the tier keys whose
    entries they change and the engines they declare or reset. A reader that answers before
    these events are committed answers those keys and engines as the log has them."""
    keys: set[bytes] = set()
    engines: set[str] = set()
    for event in events:
        if isinstance(event, _KEY_CHANGES):
            keys.add(event.key)
        elif isinstance(event, _ENGINE_CHANGES):
            engines.add(event.engine_id)
    return keys, engines


def apply(state: State, event: Event) -> State:
    """Fold one event into `state` and return it."""
    try:
        fold = _FOLDS[type(event)]
    except KeyError:
        raise ProjectionError(f"no fold for event type {type(event).__name__}") from None
    fold(state, event)
    state.last_event += 1
    return state


def project(events: Iterable[Event], state: State | None = None) -> State:
    """Fold a sequence of events, from an empty state unless one is given."""
    state = State() if state is None else state
    # Counted without a counter per event (enumerate cost ~3% of the fold): every event of a list
    # when all fold, else as many as its iterator had passed before the one that raised. Any
    # other iterable is listed first (every caller passes a list: a step's events, a log batch).
    listed = events if type(events) is list else list(events)
    remaining = iter(listed)
    try:
        _fold_each(state, remaining)
    except BaseException:
        state.last_event += len(listed) - operator.length_hint(remaining) - 1
        raise
    state.last_event += len(listed)
    return state


def _fold_each(state: State, events: Iterator[Event]) -> None:
    """Fold each event in order; a run of consecutive events of a type with a run fold
    (`_RUN_FOLDS`: a store's evictions, a job's publications, a dozen or more a step each) in one
    call that reads its tier once and reads the run's events from `events` itself, handing back
    the first event after the run (None at the end). The state is exactly the event-by-event
    fold's (I18); when a fold raises, `events` has passed exactly the events before the one that
    raised and that one (project's count)."""
    folds, runs = _FOLDS, _RUN_FOLDS
    kind: type = type(None)
    try:
        for event in events:
            kind = type(event)
            while kind in runs:
                after = runs[kind](state, event, events)
                if after is None:
                    break
                event, kind = after, type(after)
            else:
                folds[kind](state, event)
    except KeyError:
        if kind not in folds:
            raise ProjectionError(f"no fold for event type {kind.__name__}") from None
        raise


# --- slot bookkeeping --------------------------------------------------------------------------


def _release_slot(engine: EngineState, pool: PoolState, block_id: int) -> None:
    """A slot with no refs and no pins is free again; the freed notice waits for step end."""
    if pool.keys[block_id] is None:
        pool.free[block_id] = None
    else:
        pool.cached[block_id] = None
    engine.pending_freed_blocks.append(BlockRef(pool.spec.pool_id, block_id, pool.generations[block_id]))


def _pin(pool: PoolState, block_id: int) -> None:
    """A job holds the slot: whatever its refs, it leaves the free lists until unpinned (I3)."""
    if block_id == NULL_BLOCK_ID:
        return  # never pinned, never freed (I2); named by a job only in the null-state scenario
    pool.pins[block_id] += 1
    if block_id in pool.cached:  # a copy may read a cached-free block
        del pool.cached[block_id]
        removed(pool, "cached")


def _unpin(engine: EngineState, pool: PoolState, block_id: int) -> None:
    """A job lets go of a slot; the slot frees if no owner holds it either (I3)."""
    if block_id == NULL_BLOCK_ID or not pool.pins[block_id]:
        # Nothing to let go: the null block is never pinned, and a reset with keep_pins=False
        # (only the simulator's unfenced scenario) already dropped this job's pins.
        return
    pool.pins[block_id] -= 1
    if pool.pins[block_id] == 0 and pool.refs[block_id] == 0:
        _release_slot(engine, pool, block_id)


# --- declarations ------------------------------------------------------------------------------


def _namespace_registered(state: State, event: NamespaceRegistered) -> None:
    state.namespaces[event.namespace_id] = event.spec


def _tier_declared(state: State, event: TierDeclared) -> None:
    state.tiers[event.spec.name] = TierState.new(event.spec)


def _engine_declared(state: State, event: EngineDeclared) -> None:
    known = state.engines.get(event.engine_id)
    if known is None:
        state.engines[event.engine_id] = EngineState(
            engine_id=event.engine_id,
            incarnation=event.incarnation,
            namespace_id=event.namespace_id,
            world_size=event.world_size,
            pools={spec.pool_id: PoolState.new(spec) for spec in event.pools},
            tiers=list(event.tiers),
            encoder_cache_tokens=event.encoder_cache_tokens,
        )
        return
    # Declared again: a new incarnation (a restarted engine), which starts its steps and clock
    # afresh: a step number or clock the old one poisoned (issue 17) does not outlive it.
    known.step, known.clock, known.step_open = -1, 0.0, False
    known.incarnation = event.incarnation
    known.namespace_id = event.namespace_id
    known.world_size = event.world_size
    known.tiers = list(event.tiers)
    known.encoder_cache_tokens = event.encoder_cache_tokens


def _engine_reset(state: State, event: EngineReset) -> None:
    engine = state.engines[event.engine_id]
    engine.incarnation = event.incarnation
    for owner_id in [o.owner_id for o in state.owners.values() if o.engine_id == event.engine_id]:
        del state.owners[owner_id]
    for pool in engine.pools.values():
        # Generations are kept: references from the old incarnation stay stale (I1).
        # Slots pinned by fenced jobs stay pinned (draining) until those jobs' ranks are done:
        # their transfers may still land (I3, I16). Every other slot is free and clean.
        n = pool.spec.num_blocks
        pool.refs = [0] * n
        pool.keys = [None] * n
        if not event.keep_pins:
            pool.pins = [0] * n  # the naive reset of the simulator's unfenced scenario
        pins = pool.pins
        pool.free = dict.fromkeys(block_id for block_id in range(1, n) if not pins[block_id])
        pool.cached = {}
    engine.encoder_entries = {}
    engine.step_open = False
    engine.pending_freed_blocks = []
    engine.pending_freed_encoder = []
    engine.pending_removed_keys = []


# --- steps -------------------------------------------------------------------------------------


def _step_began(state: State, event: StepBegan) -> None:
    engine = state.engines[event.engine_id]
    engine.step = event.step
    engine.clock = event.clock
    engine.step_open = True


def _step_ended(state: State, event: StepEnded) -> None:
    engine = state.engines[event.engine_id]
    engine.step_open = False
    engine.pending_freed_blocks = []
    engine.pending_freed_encoder = []
    engine.pending_removed_keys = []


# --- owners and blocks ---------------------------------------------------------------------------


def _owner_started(state: State, event: OwnerStarted) -> None:
    state.owners[event.owner_id] = OwnerState(owner_id=event.owner_id, engine_id=event.engine_id, req_id=event.req_id)
    state.next_owner_id = event.owner_id + 1


def _owner_finished(state: State, event: OwnerFinished) -> None:
    del state.owners[event.owner_id]


def _blocks_allocated(state: State, event: BlocksAllocated) -> None:
    # Hot path: one event, one pool (the decider allocates from one pool per command).
    if not event.blocks:
        return
    pool_id = event.blocks[0].pool_id
    pool = state.engines[event.engine_id].pools[pool_id]
    free, cached, generations, refs, keys = pool.free, pool.cached, pool.generations, pool.refs, pool.keys
    owner_blocks = state.owners[event.owner_id].blocks
    held = owner_blocks.get(pool_id)
    if held is None:
        held = owner_blocks[pool_id] = {}
    from_cached = 0  # counted in the rarer branch; most slots come from the free list
    for ref in event.blocks:
        block_id = ref.block_id
        if block_id in free:
            del free[block_id]
        else:  # a cached-free slot: its old content key goes with it
            del cached[block_id]
            from_cached += 1
        generations[block_id] = held[block_id] = ref.generation
        refs[block_id] = 1
        keys[block_id] = None
    if from_cached != len(event.blocks):
        removed(pool, "free", len(event.blocks) - from_cached)
    if from_cached:
        removed(pool, "cached", from_cached)


def _blocks_reused(state: State, event: BlocksReused) -> None:
    pools = state.engines[event.engine_id].pools
    held = state.owners[event.owner_id].blocks
    for ref in event.blocks:
        pool = pools[ref.pool_id]
        if pool.cached.pop(ref.block_id, True) is None:
            removed(pool, "cached")
        pool.refs[ref.block_id] += 1
        held.setdefault(ref.pool_id, {})[ref.block_id] = ref.generation


def _blocks_released(state: State, event: BlocksReleased) -> None:
    engine = state.engines[event.engine_id]
    held = state.owners[event.owner_id].blocks
    pending = engine.pending_freed_blocks
    pool_id = -1
    for ref in event.blocks:
        if ref.pool_id != pool_id:
            pool_id = ref.pool_id
            pool = engine.pools[pool_id]
            held_in_pool, refs, pins, keys = held[pool_id], pool.refs, pool.pins, pool.keys
        block_id = ref.block_id
        del held_in_pool[block_id]
        count = refs[block_id] - 1
        refs[block_id] = count
        if count == 0 and pins[block_id] == 0:
            if keys[block_id] is None:
                pool.free[block_id] = None
            else:
                pool.cached[block_id] = None
            pending.append(ref)  # the owner held exactly this generation


def _blocks_computed(state: State, event: BlocksComputed) -> None:
    pools = state.engines[event.engine_id].pools
    pool_id = -1
    for computed in event.blocks:
        block = computed.block
        if block.pool_id != pool_id:
            pool_id = block.pool_id
            keys = pools[pool_id].keys
        keys[block.block_id] = computed.key


# --- jobs --------------------------------------------------------------------------------------------


def _store_job_started(state: State, event: StoreJobStarted) -> None:
    state.jobs[event.job_id] = JobState(decision=event)
    count_job(state, event, 1)
    state.next_job_id = event.job_id + 1
    items = event.items
    if event.pinned:
        pools = state.engines[event.engine_id].pools
        for item in items:
            source = item.source
            _pin(pools[source.pool_id], source.block_id)
    _reserve(state.tiers[event.tier], items)


def _reserve(tier: TierState, items: list[StoreItem] | list[ExternalItem]) -> None:
    """A store's tier slots leave the free list, at the generation the store writes."""
    free, generations = tier.free, tier.generations
    for item in items:
        slot = item.tier_slot
        del free[slot]
        generations[slot] = item.tier_generation
    if items:
        removed(tier, "free", len(items))


def _load_job_started(state: State, event: LoadJobStarted) -> None:
    job_id = event.job_id
    state.jobs[job_id] = JobState(decision=event)
    count_job(state, event, 1)
    state.next_job_id = job_id + 1
    items = event.items
    if event.pinned:
        pools = state.engines[event.engine_id].pools
        for item in items:
            dest = item.dest
            _pin(pools[dest.pool_id], dest.block_id)
    tier, expires = state.tiers[event.tier], event.lease_expires_at
    published, leases = tier.published, tier.leases
    for item in items:  # I12: each key read is leased, on the slot it is published in (the item's tier_slot)
        slot = published[item.dest.pool_id][item.key]
        held = leases.get(slot)
        if held is None:
            leases[slot] = {job_id: expires}
        else:
            held[job_id] = expires


def _state_copy_planned(state: State, event: StateCopyPlanned) -> None:
    state.jobs[event.job_id] = JobState(decision=event)
    count_job(state, event, 1)
    state.next_job_id = event.job_id + 1
    pool = state.engines[event.engine_id].pools[event.pool_id]
    for ref in event.blocks:
        _pin(pool, ref.block_id)
    for ref in event.destinations:
        pool.keys[ref.block_id] = None  # I17: being written, so no longer a hit


def _external_store_started(state: State, event: ExternalStoreStarted) -> None:
    """Tier slots are reserved for the new keys; the engine's blocks are its own (no pins here:
    vLLM keeps them until the job completes)."""
    state.jobs[event.job_id] = JobState(decision=event)
    count_job(state, event, 1)
    state.next_job_id = event.job_id + 1
    _reserve(state.tiers[event.tier], event.items)


def _external_load_started(state: State, event: ExternalLoadStarted) -> None:
    job_id = event.job_id
    state.jobs[job_id] = JobState(decision=event)
    count_job(state, event, 1)
    state.next_job_id = job_id + 1
    tier, expires = state.tiers[event.tier], event.lease_expires_at
    published, leases = tier.published, tier.leases
    for item in event.items:  # I12: each key read is leased, on the slot it is published in (the item's tier_slot)
        slot = published[item.pool_id][item.key]
        held = leases.get(slot)
        if held is None:
            leases[slot] = {job_id: expires}
        else:
            held[job_id] = expires


def _rank_reported(state: State, event: RankReported) -> None:
    state.jobs[event.job_id].reports[event.rank] = event


# Ending a job: what it held goes (pins, I3; reserved tier slots; leases, I12). One function per
# decision type, dispatched on the type as the folds are (no isinstance chain per job).


def _end_store(state: State, decision: StoreJobStarted, succeeded: bool, kept: int) -> None:
    """Unpin the sources; a reserved slot whose key was not published (by this job) is free again."""
    tier = state.tiers[decision.tier]
    published, tier_free = tier.published, tier.free
    engine = state.engines[decision.engine_id]
    pools = engine.pools
    pinned = decision.pinned
    for item in decision.items:
        source = item.source
        if pinned:
            _unpin(engine, pools[source.pool_id], source.block_id)
        group = published.get(source.pool_id)
        slot = item.tier_slot
        if group is None or group.get(item.key) != slot:
            tier_free[slot] = None  # reserved but not published: give it back


def _end_load(state: State, decision: LoadJobStarted, succeeded: bool, kept: int) -> None:
    """Drop the leases and unpin the destinations, which count as computed when the load
    succeeded, or up to `kept` when it failed from there (and touch their keys in the LRU)."""
    engine = state.engines[decision.engine_id]
    pools = engine.pools
    tier = state.tiers[decision.tier]
    lru, leased = tier.lru, tier.leases
    job_id, pinned = decision.job_id, decision.pinned
    touched = 0
    for index, item in enumerate(decision.items):
        dest, slot = item.dest, item.tier_slot
        held = leased.get(slot) if leased else None  # the load leased the slot it read (_load_job_started)
        if held is not None and held.pop(job_id, None) is not None and not held:
            del leased[slot]
        pool = pools[dest.pool_id]
        if succeeded or index < kept:
            pool.keys[dest.block_id] = item.key
            if slot in lru:  # touch: most recently used
                lru[slot] = lru.pop(slot)
                touched += 1
        if pinned:
            _unpin(engine, pool, dest.block_id)
    if touched:  # once, after the loop: a rebuild of `lru` must not happen under it
        removed(tier, "lru", touched)


def _end_copy(state: State, decision: StateCopyPlanned, succeeded: bool, kept: int) -> None:
    engine = state.engines[decision.engine_id]
    pool = engine.pools[decision.pool_id]
    for ref in decision.blocks:
        _unpin(engine, pool, ref.block_id)


def _end_external_store(state: State, decision: ExternalStoreStarted, succeeded: bool, kept: int) -> None:
    """Reserved tier slots whose key was not published (by this job) are free again."""
    tier = state.tiers[decision.tier]
    published, tier_free = tier.published, tier.free
    for item in decision.items:
        group = published.get(item.pool_id)
        slot = item.tier_slot
        if group is None or group.get(item.key) != slot:
            tier_free[slot] = None  # reserved but not published: give it back


def _end_external_load(state: State, decision: ExternalLoadStarted, succeeded: bool, kept: int) -> None:
    """The leases go (I12); a load that succeeded touches its keys in the LRU."""
    tier = state.tiers[decision.tier]
    lru, leased = tier.lru, tier.leases
    job_id = decision.job_id
    touched = 0
    for item in decision.items:
        slot = item.tier_slot
        held = leased.get(slot) if leased else None  # the load leased the slot it read (_external_load_started)
        if held is not None and held.pop(job_id, None) is not None and not held:
            del leased[slot]
        if succeeded and slot in lru:  # touch: most recently used
            lru[slot] = lru.pop(slot)
            touched += 1
    if touched:  # once, after the loop: a rebuild of `lru` must not happen under it
        removed(tier, "lru", touched)


_ENDS: dict[type[JobDecision], Callable[[State, Any, bool, int], None]] = {
    StoreJobStarted: _end_store,
    LoadJobStarted: _end_load,
    StateCopyPlanned: _end_copy,
    ExternalStoreStarted: _end_external_store,
    ExternalLoadStarted: _end_external_load,
}


def _end_job(state: State, job: JobState, succeeded: bool, kept: int = 0) -> None:
    """Release what the job held: pins (I3), reserved tier slots, leases (I12). A load's
    destinations count as computed when it succeeded, or up to `kept` when it failed from there.
    External jobs (an engine's own blocks) pin nothing and count nothing as computed."""
    decision = job.decision
    count_job(state, decision, -1)
    _ENDS[type(decision)](state, decision, succeeded, kept)


def _job_succeeded(state: State, event: JobSucceeded) -> None:
    decision = state.jobs.pop(event.job_id).decision
    count_job(state, decision, -1)
    _ENDS[type(decision)](state, decision, True, 0)


def _job_fenced(state: State, event: JobFenced) -> None:
    """The job ends for the coordinator, but its transfers may still be landing: what it holds
    stays held until every rank it has not heard from reports (FencedRankDone)."""
    job = state.jobs.pop(event.job_id)
    if event.pending:
        state.fenced[event.job_id] = FencedJob(job=job, pending=list(event.pending))
    else:
        _end_job(state, job, succeeded=False)


def _fenced_rank_done(state: State, event: FencedRankDone) -> None:
    fenced = state.fenced[event.job_id]
    fenced.pending.remove(event.rank)
    if not fenced.pending:
        del state.fenced[event.job_id]
        _end_job(state, fenced.job, succeeded=False)


def _job_failed(state: State, event: JobFailed) -> None:
    _end_job(state, state.jobs.pop(event.job_id), succeeded=False, kept=event.kept)


# --- tiers ---------------------------------------------------------------------------------------------


def _keys_published(state: State, event: KeyPublished, rest: Iterator[Event]) -> Event | None:
    """A run of KeyPublished (a job's publications): `event`, then each KeyPublished `rest` reads
    next. Each key's slot row is written whole (a re-publication, possible with
    PUBLISH_WHEN_COMPLETE off, starts with no lease and no quarantine) and the slot becomes the
    most recently used; the tier and its columns are read once while the run names one tier.
    Returns the first event after the run, not folded, or None."""
    tiers = state.tiers
    name = None
    while True:
        if event.tier != name:
            name = event.tier
            tier = tiers[name]
            published, lru, keys = tier.published, tier.lru, tier.keys
            namespace_ids, packed, sizes, source_jobs = tier.namespace_ids, tier.packed_checksums, tier.sizes, tier.source_jobs
            quarantined, leases = tier.quarantined, tier.leases
            pool_id, group = -1, None
        if event.pool_id != pool_id:
            pool_id = event.pool_id
            group = published.get(pool_id)
            if group is None:
                group = published[pool_id] = {}
        key, slot = event.key, event.tier_slot
        group[key] = slot  # type: ignore[index]
        keys[slot] = key
        namespace_ids[slot] = event.namespace_id
        packed[slot] = pack_checksums(event.checksums)
        sizes[slot] = event.size_bytes
        source_jobs[slot] = event.source_job
        if quarantined:
            quarantined.pop(slot, None)
        if leases:
            leases.pop(slot, None)
        lru[slot] = pool_id
        after = next(rest, None)
        if type(after) is not KeyPublished:
            return after
        event = after


def _keys_evicted(state: State, event: KeyEvicted, rest: Iterator[Event]) -> Event | None:
    """A run of KeyEvicted (a store's evictions): `event`, then each KeyEvicted `rest` reads next.
    Each key leaves the tier, its slot's row is cleared (I18: a free slot holds nothing) and the
    slot is free again; the tier and its columns are read once while the run names one tier, and
    the LRU's holes are counted once a tier (`removed`: the LRU is not rebuilt under the loop).
    Returns the first event after the run, not folded, or None."""
    tiers, engines = state.tiers, state.engines
    tier: TierState | None = None
    name, engine_id, pending = None, None, None
    evicted = 0
    after: Event | None = None
    while True:
        if event.tier != name:
            if tier is not None:
                removed(tier, "lru", evicted)
            name, evicted = event.tier, 0
            tier = tiers[name]
            published, lru, keys, free = tier.published, tier.lru, tier.keys, tier.free
            namespace_ids, packed, sizes, source_jobs = tier.namespace_ids, tier.packed_checksums, tier.sizes, tier.source_jobs
            quarantined, leases = tier.quarantined, tier.leases
        pool_id, key, slot = event.pool_id, event.key, event.tier_slot
        del published[pool_id][key]
        del lru[slot]
        evicted += 1
        keys[slot] = None
        namespace_ids[slot] = b""
        packed[slot] = b""
        sizes[slot] = 0
        source_jobs[slot] = 0
        if quarantined:
            quarantined.pop(slot, None)
        if leases:
            leases.pop(slot, None)
        free[slot] = None
        if event.engine_id != engine_id:
            engine_id = event.engine_id
            engine = engines.get(engine_id)
            pending = None if engine is None else engine.pending_removed_keys
        if pending is not None:
            pending.append((name, pool_id, key))
        after = next(rest, None)
        if type(after) is not KeyEvicted:
            break
        event = after
    removed(tier, "lru", evicted)  # type: ignore[arg-type]
    return after


_NO_EVENTS: Iterator[Event] = iter(())
"""An iterator that is over: a run fold given it folds its one event."""


def _key_published(state: State, event: KeyPublished) -> None:
    """One KeyPublished (`apply`): `_keys_published`, the rule written once, of a run of one."""
    _keys_published(state, event, _NO_EVENTS)


def _key_evicted(state: State, event: KeyEvicted) -> None:
    """One KeyEvicted (`apply`): `_keys_evicted`, the rule written once, of a run of one."""
    _keys_evicted(state, event, _NO_EVENTS)


def _key_quarantined(state: State, event: KeyQuarantined) -> None:
    tier = state.tiers[event.tier]
    tier.quarantined[tier.published[event.pool_id][event.key]] = None


# --- encoder cache -------------------------------------------------------------------------------------


def _encoder_entry_allocated(state: State, event: EncoderEntryAllocated) -> None:
    state.engines[event.engine_id].encoder_entries[event.entry_id] = event.num_tokens


def _encoder_entry_freed(state: State, event: EncoderEntryFreed) -> None:
    engine = state.engines[event.engine_id]
    del engine.encoder_entries[event.entry_id]
    engine.pending_freed_encoder.append(event.entry_id)


# --- observed engines (coordinator/core/observe.py) ---------------------------------------------------


def _engine_observed(state: State, event: EngineObserved) -> None:
    """A new observed incarnation starts with nothing stored and expects the engine's batch 0."""
    state.observed[event.engine_id] = ObservedEngine(
        engine_id=event.engine_id, incarnation=event.incarnation, namespace_id=event.namespace_id, source=event.source
    )


def _observed_batch(state: State, event: ObservedBatch) -> None:
    state.observed[event.engine_id].next_seq = event.source_seq + 1


def _observed_blocks_stored(state: State, event: ObservedBlocksStored) -> None:
    stored = state.observed[event.engine_id].stored
    place = observed_place(event.medium, event.group)
    hashes = stored.get(place)
    if hashes is None:
        hashes = stored[place] = {}
    for block_hash in event.block_hashes:
        hashes[block_hash] = None  # a hash stored again keeps its place: the order is the first store's


def _observed_blocks_removed(state: State, event: ObservedBlocksRemoved) -> None:
    stored = state.observed[event.engine_id].stored
    place = observed_place(event.medium, event.group)
    hashes = stored.get(place)
    if hashes is None:
        return  # an incomplete view: the engine removed what kvledger never saw stored
    for block_hash in event.block_hashes:
        hashes.pop(block_hash, None)
    if not hashes:
        del stored[place]


def _observed_cache_cleared(state: State, event: ObservedCacheCleared) -> None:
    stored = state.observed[event.engine_id].stored
    for place in [p for p in stored if p.rsplit("/", 1)[0] == event.medium]:
        del stored[place]


def _observed_events_missed(state: State, event: ObservedEventsMissed) -> None:
    engine = state.observed[event.engine_id]
    engine.complete = False
    engine.next_seq = max(engine.next_seq, event.last_seq + 1)


def _nothing(state: State, event: Event) -> None:
    """Refusals, dropped notices, lookups and namespace release decisions are records for
    forensics, not state (what a decision changes comes as KeyQuarantined / KeyEvicted events)."""


_FOLDS: dict[type[Event], Callable[[State, Any], None]] = {
    NamespaceRegistered: _namespace_registered,
    TierDeclared: _tier_declared,
    EngineDeclared: _engine_declared,
    EngineReset: _engine_reset,
    StepBegan: _step_began,
    StepEnded: _step_ended,
    OwnerStarted: _owner_started,
    OwnerFinished: _owner_finished,
    BlocksAllocated: _blocks_allocated,
    BlocksReused: _blocks_reused,
    BlocksReleased: _blocks_released,
    BlocksComputed: _blocks_computed,
    PrefixLookedUp: _nothing,
    StoreJobStarted: _store_job_started,
    LoadJobStarted: _load_job_started,
    StateCopyPlanned: _state_copy_planned,
    RankReported: _rank_reported,
    JobSucceeded: _job_succeeded,
    JobFailed: _job_failed,
    JobFenced: _job_fenced,
    FencedRankDone: _fenced_rank_done,
    KeyPublished: _key_published,
    KeyEvicted: _key_evicted,
    KeyQuarantined: _key_quarantined,
    NamespaceDecided: _nothing,
    NamespaceReleased: _nothing,
    EncoderEntryAllocated: _encoder_entry_allocated,
    EncoderEntryFreed: _encoder_entry_freed,
    Refused: _nothing,
    NoticeDropped: _nothing,
    EngineObserved: _engine_observed,
    ObservedBatch: _observed_batch,
    ObservedBlocksStored: _observed_blocks_stored,
    ObservedBlocksRemoved: _observed_blocks_removed,
    ObservedCacheCleared: _observed_cache_cleared,
    ObservedEventsMissed: _observed_events_missed,
    ExternalKeysLookedUp: _nothing,
    ExternalStoreStarted: _external_store_started,
    ExternalLoadStarted: _external_load_started,
    FencedRankReleased: _nothing,  # a record: the FencedRankDone events after it release
}


_RUN_FOLDS: dict[type[Event], Callable[[State, Any, Iterator[Event]], Event | None]] = {
    KeyPublished: _keys_published,
    KeyEvicted: _keys_evicted,
}
"""Folds of a whole run of consecutive events of one type (`_fold_each`); `apply` folds one event
with `_FOLDS`, which has a fold for every type."""
