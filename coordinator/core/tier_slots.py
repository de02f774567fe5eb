"""Reserving tier slots for a store: free slots first, then least recently used keys that no
live lease holds (I12). One rule for kvledger's own stores (jobs.py) and an engine's own
(external.py). Pure."""

from __future__ import annotations

import itertools

from coordinator.core.checks import Refusal
from coordinator.core.protections import Protection, is_off
from coordinator.core.state import EngineState, TierState
from events import KeyEvicted, Reason


def reserve_tier_slots(
    tier: TierState, eng: EngineState, needed: int, keep: set[tuple[int, bytes]]
) -> tuple[list[int], list[KeyEvicted]]:
    """Free slots first, then evict least recently used keys that no live lease holds (I12)
    and that this very decision does not rely on (`keep`: keys it reports as published).
    Leases off (seed 002's offload path): a key being loaded is evicted like any other."""
    slots = list(itertools.islice(tier.free, needed))
    evictions: list[KeyEvicted] = []
    honour_leases = not is_off(Protection.LEASES)
    if len(slots) < needed:
        for slot, published in tier.lru.items():
            entry = tier.entries[published.pool_id][published.key]
            if (honour_leases and entry.leased_at(eng.clock)) or (published.pool_id, published.key) in keep:
                continue
            evictions.append(
                KeyEvicted(
                    tier=tier.spec.name,
                    pool_id=published.pool_id,
                    key=published.key,
                    tier_slot=slot,
                    engine_id=eng.engine_id,
                )
            )
            slots.append(slot)
            if len(slots) == needed:
                break
    if len(slots) < needed:
        raise Refusal(
            Reason.TIER_FULL,
            f"tier {tier.spec.name!r} can give {len(slots)} of {needed} slots: the rest are leased or being stored",
        )
    return slots, evictions
