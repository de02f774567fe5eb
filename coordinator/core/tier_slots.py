"""Reserving tier slots for a store: free slots first, then least recently used keys that no
live lease holds (I12). One rule for kvledger's own stores (jobs.py) and an engine's own
(external.py). Pure."""

from __future__ import annotations

import itertools
from collections.abc import Collection

from coordinator.core.checks import Refusal
from coordinator.core.protections import Protection, is_off
from coordinator.core.state import EngineState, TierState
from events import KeyEvicted, Reason


def reserve_tier_slots(
    tier: TierState, eng: EngineState, needed: int, keep: Collection[int]
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
        clock, name, engine_id = eng.clock, tier.spec.name, eng.engine_id
        keys, leased = tier.keys, tier.leases
        wanted = needed - len(slots)
        for slot, pool_id in tier.lru.items():
            # KeyEntry.leased_at inlined, asked only of a key some load leased (most have none)
            if leased and honour_leases:
                leases = leased.get(slot)
                if leases and any(expiry > clock for expiry in leases.values()):
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
