"""Reserving tier slots for a store: free slots first, then least recently used keys that no
live lease holds (I12). One rule for kvledger's own stores (jobs.py) and an engine's own
(external.py), and one for when a lease is live (`lease_live`). Pure."""

from __future__ import annotations

import itertools
from collections.abc import Collection

from coordinator.core.checks import Refusal
from coordinator.core.protections import Protection, is_off
from coordinator.core.state import EngineState, State, TierState
from events import BlockRef, KeyEvicted, Reason, StoreJobStarted


def lease_live(state: State, job_id: int, expiry: float) -> bool:
    """Whether the lease load job `job_id` holds until `expiry` is live (I12): while the clock of
    the engine that made the load is before it. A lease is read on its holder's clock, never on
    the clock of the engine asking: engines' clocks have bases of their own, and an engine whose
    clock was far ahead evicted every key other engines' loads still read (an adversarial review,
    session 31). A lease whose job or engine is unknown counts as live."""
    job = state.jobs.get(job_id)
    if job is None:
        fenced = state.fenced.get(job_id)
        if fenced is None:
            return True
        job = fenced.job
    engine = state.engines.get(job.decision.engine_id)
    return engine is None or engine.clock < expiry


def blocks_in_flight(state: State, tier: TierState, engine_id: str) -> set[BlockRef]:
    """The source blocks (each at its generation) of the engine's store jobs in flight to this
    tier (a BlockRef names no engine: another engine's block 3 is another block).
    A store skips such a block as it skips a published key (I10): one computed block named by 64
    StartStore commands of one step took 64 slots of a shared tier, and every other tenant's store
    was refused TIER_FULL for as long as its engine did not report (an adversarial review, session
    31). Two blocks of the same content still race, as I10 has them (their checksums compared)."""
    name = tier.spec.name
    return {
        item.source
        for job in state.jobs.values()
        if isinstance(job.decision, StoreJobStarted) and job.decision.tier == name and job.decision.engine_id == engine_id
        for item in job.decision.items
    }


def reserve_tier_slots(
    state: State, tier: TierState, eng: EngineState, needed: int, keep: Collection[int]
) -> tuple[list[int], list[KeyEvicted]]:
    """Free slots first, then evict least recently used keys that no live lease holds (I12)
    and that this very decision does not rely on (`keep`: the slots of the keys it reports as
    published; a slot, not a (pool, key) pair: only a published key is a candidate, and it has
    one slot, so no pair is made per candidate). Leases off (seed 002's offload path): a key
    being loaded is evicted like any other."""
    slots = list(itertools.islice(tier.free, needed))
    evictions: list[KeyEvicted] = []
    if len(slots) < needed:
        honour_leases = not is_off(Protection.LEASES)
        name, engine_id = tier.spec.name, eng.engine_id
        keys, leased = tier.keys, tier.leases
        wanted = needed - len(slots)
        for slot, pool_id in tier.lru.items():
            # Asked only of a key some load leased (most have none).
            if leased and honour_leases:
                leases = leased.get(slot)
                if leases and any(lease_live(state, job_id, expiry) for job_id, expiry in leases.items()):
                    continue
            if keep and slot in keep:
                continue
            key = keys[slot]
            assert key is not None  # a slot in the LRU holds a published key
            evictions.append(KeyEvicted(tier=name, pool_id=pool_id, key=key, tier_slot=slot, engine_id=engine_id))
            slots.append(slot)
            wanted -= 1
            if not wanted:
                break
    if len(slots) < needed:
        raise Refusal(
            Reason.TIER_FULL,
            f"tier {tier.spec.name!r} can give {len(slots)} of {needed} slots: the rest are leased or being stored",
        )
    return slots, evictions
