"""Completing a job once every rank reported: one path for the jobs kvledger decides on its own
blocks (StoreJobStarted, LoadJobStarted, StateCopyPlanned) and for an engine's own blocks
(ExternalStoreStarted, ExternalLoadStarted: vLLM's, coordinator/core/external.py).

Both kinds keep the same invariants and honour the same protection switches: a key is published
only when every rank reported success with a checksum (I5, I11); a re-store with other bytes
quarantines the key (I10; with IDEMPOTENT_STORE off the last writer wins, as in seed 002); a load
counts only while its lease holds (I12; LEASES off: no lease check), its keys were not evicted
meanwhile, and every rank read the published bytes (I13; CHECKSUMS off: nothing is compared). A
load that fails verification keeps the items before the first one some rank did not verify
(JobFailed.kept): they hold the published bytes, and the engine recomputes from there on.
Reached from ReportRank (coordinator/core/jobs.py). Pure.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Sequence
from typing import Any

from coordinator.core.protections import Protection, is_off
from coordinator.core.state import KeyEntry, State, TierState, pack_checksums
from events import (
    Event,
    ExternalItem,
    ExternalLoadStarted,
    ExternalStoreStarted,
    JobFailed,
    JobSucceeded,
    KeyEvicted,
    KeyPublished,
    KeyQuarantined,
    LoadItem,
    LoadJobStarted,
    RankReported,
    Reason,
    StateCopyPlanned,
    StoreItem,
    StoreJobStarted,
)

Store = StoreJobStarted | ExternalStoreStarted
Load = LoadJobStarted | ExternalLoadStarted
Completed = Store | Load | StateCopyPlanned
"""A decision that waits for every rank's report."""


def pool_of(item: StoreItem | LoadItem | ExternalItem) -> int:
    """The pool (cache group) an item's key belongs to."""
    return _POOL_OF[type(item)](item)


_POOL_OF: dict[type, Callable[[Any], int]] = {
    StoreItem: operator.attrgetter("source.pool_id"),
    LoadItem: operator.attrgetter("dest.pool_id"),
    ExternalItem: operator.attrgetter("pool_id"),
}
"""pool_of by the item's type: a dict lookup, not an isinstance chain, and a getter made in C, not
a lambda (it runs once per item)."""


def complete(state: State, decision: Completed, reports: dict[int, RankReported]) -> list[Event]:
    """What every rank's report decides: the job succeeded (and what it published), or failed."""
    job_id = decision.job_id
    failed = sorted([rank for rank, report in reports.items() if not report.ok])
    if failed and isinstance(decision, LoadJobStarted | ExternalLoadStarted):
        lost = sorted({index for report in reports.values() for index in report.lost})
        if lost and isinstance(decision, LoadJobStarted):
            return _lost(state, decision, lost, reports)
        # A worker that found a checksum mismatch reports failure with what it read: the keys
        # whose bytes differ are quarantined all the same (I13).
        mismatched = _load_mismatches(state, decision, reports)
        if mismatched:
            return mismatched
    if failed:
        return [JobFailed(job_id=job_id, reason=Reason.RANK_FAILED, detail=f"ranks {failed} failed")]
    if isinstance(decision, StateCopyPlanned):
        return [JobSucceeded(job_id=job_id)]
    per_rank = [reports[rank].checksums for rank in range(decision.world_size)]
    items = len(decision.items)
    for sums in per_rank:
        if len(sums) != items or not all(sums):
            # I5 / I11: every item needs a checksum from every rank, duplicates included.
            return [JobFailed(job_id=job_id, reason=Reason.MISSING_CHECKSUM, detail="a rank left items unverified")]
    tier = state.tiers[decision.tier]
    if isinstance(decision, StoreJobStarted | ExternalStoreStarted):
        return [*_publish(state, tier, decision, per_rank), JobSucceeded(job_id=job_id)]
    return _verify_load(state, tier, decision, per_rank)


def _publish(state: State, tier: TierState, decision: Store, per_rank: list[list[bytes]]) -> list[Event]:
    engine = state.engines[decision.engine_id]
    events: list[Event] = []
    items: Sequence[StoreItem | ExternalItem] = decision.items
    if not items:
        return events
    # Read once for the job, not per item: every item of a store has the same type.
    pool_ids = list(map(_POOL_OF[type(items[0])], items))
    sizes = {pool_id: engine.pools[pool_id].spec.bytes_per_block for pool_id in set(pool_ids)}
    name, namespace, job_id, published = tier.spec.name, engine.namespace_id, decision.job_id, tier.published
    # Each item's checksums, one per rank: with one rank, one list each (a transpose otherwise).
    by_item = (
        [[checksum] for checksum in per_rank[0]] if len(per_rank) == 1 else [list(sums) for sums in zip(*per_rank, strict=True)]
    )
    for item, pool_id, checksums in zip(items, pool_ids, by_item, strict=True):
        key = item.key
        publication = KeyPublished(
            tier=name,
            namespace_id=namespace,
            pool_id=pool_id,
            key=key,
            tier_slot=item.tier_slot,
            tier_generation=item.tier_generation,
            checksums=checksums,
            size_bytes=sizes[pool_id],
            source_job=job_id,
        )
        group = published.get(pool_id)
        slot = None if group is None else group.get(key)
        if slot is None:  # the common case: a new key
            events.append(publication)
            continue
        existing = tier.entry_at(slot)  # a re-store: rare
        if existing.source_job == decision.job_id and not existing.checksums:
            # (Only with PUBLISH_WHEN_COMPLETE off: the store's own early entry.)
            events.append(publication)
        elif existing.checksums != checksums and is_off(Protection.IDEMPOTENT_STORE):
            # The naive store of seed 002: the last writer wins.
            events += [
                KeyEvicted(
                    tier=tier.spec.name, pool_id=pool_id, key=item.key, tier_slot=existing.tier_slot, engine_id=decision.engine_id
                ),
                publication,
            ]
        elif existing.checksums != checksums and not existing.quarantined:
            # I10: the same key with other bytes. Someone stored the wrong KV; trust neither.
            events.append(
                KeyQuarantined(
                    tier=tier.spec.name,
                    pool_id=pool_id,
                    key=item.key,
                    reason=Reason.CHECKSUM_MISMATCH,
                    job_id=decision.job_id,
                    detail=f"re-store by job {decision.job_id} differs from job {existing.source_job}",
                )
            )
    return events


def _verify_load(state: State, tier: TierState, decision: Load, per_rank: list[list[bytes]]) -> list[Event]:
    """A load counts only if the lease held (I12), the keys were not evicted meanwhile and every
    destination verified against the published checksums (I11, I13)."""
    job_id = decision.job_id
    naive_leases = is_off(Protection.LEASES)  # seed 002's offload read path: no lease check
    clock = state.engines[decision.engine_id].clock
    if clock >= decision.lease_expires_at and not naive_leases:  # a lease is live while clock < expiry
        return [
            JobFailed(
                job_id=job_id,
                reason=Reason.LEASE_EXPIRED,
                detail=f"completed at {clock}, lease expired at {decision.lease_expires_at}",
            )
        ]
    verify = not is_off(Protection.CHECKSUMS)  # off: MOONCAKE_STORE_CHECKSUM unset (seed 002)
    to_quarantine: dict[tuple[int, bytes], None] = {}
    unverified = 0
    kept: int | None = None
    items: Sequence[LoadItem | ExternalItem] = decision.items
    if not items:
        return [JobSucceeded(job_id=job_id)]
    item_pool = _POOL_OF[type(items[0])]  # every item of a load has the same type
    published, generations, quarantined, packed = tier.published, tier.generations, tier.quarantined, tier.packed_checksums
    # What the ranks read of each item, packed as the published checksums are (TierState.
    # packed_checksums): one bytes comparison per item, no decoding of what was published.
    reads: list[bytes] = []
    if verify:
        reads = (
            [pack_checksums([checksum]) for checksum in per_rank[0]]
            if len(per_rank) == 1
            else [pack_checksums(list(sums)) for sums in zip(*per_rank, strict=True)]
        )
    for index, item in enumerate(items):
        group = published.get(item_pool(item))  # current_entry, inlined: the key's slot, if it is the one loaded
        slot = None if group is None else group.get(item.key)
        if slot is not None and (slot != item.tier_slot or generations[slot] != item.tier_generation):
            slot = None
        if slot is None and not naive_leases:
            return [JobFailed(job_id=job_id, reason=Reason.KEY_EVICTED, detail=f"key {item.key.hex()} left the tier")]
        if slot is not None and slot in quarantined:
            return [JobFailed(job_id=job_id, reason=Reason.KEY_QUARANTINED, detail=f"key {item.key.hex()}")]
        if not verify:
            continue
        if slot is not None:
            differs = packed[slot] != _NO_CHECKSUMS and reads[index] != packed[slot]
        else:  # a key that left the tier (only with leases off): against what was published when the load was decided
            differs = bool(item.checksums) and [sums[index] for sums in per_rank] != item.checksums
        if differs:
            unverified += 1
            kept = index if kept is None else kept
            if slot is not None:
                to_quarantine[(item_pool(item), item.key)] = None
    if not unverified:
        return [JobSucceeded(job_id=job_id)]
    return [
        *(
            KeyQuarantined(
                tier=tier.spec.name,
                pool_id=pool_id,
                key=key,
                reason=Reason.CHECKSUM_MISMATCH,
                job_id=job_id,
                detail="loaded bytes differ from the published checksum",
            )
            for pool_id, key in to_quarantine
        ),
        JobFailed(
            job_id=job_id,
            reason=Reason.CHECKSUM_MISMATCH,
            detail=f"{unverified} items failed verification",
            kept=kept or 0,
        ),
    ]


_NO_CHECKSUMS = pack_checksums([])
"""What a key published without checksums holds (PUBLISH_WHEN_COMPLETE off): nothing to verify."""


def _lost(state: State, decision: LoadJobStarted, lost: list[int], reports: dict[int, RankReported]) -> list[Event]:
    """A load some rank could not read because the tier lost the bytes (a Mooncake Store evicts
    on its own, with no notice): the job fails, then each lost key that is still the entry the
    load read leaves the tier, evicted, or quarantined while another load's lease holds it (I12),
    so no lookup offers it again and the engine recomputes."""
    tier = state.tiers[decision.tier]
    errors = "; ".join(f"rank {rank}: {report.error}" for rank, report in sorted(reports.items()) if not report.ok)
    events: list[Event] = [JobFailed(job_id=decision.job_id, reason=Reason.OBJECT_LOST, detail=errors[:2000])]
    for index in lost:
        item = decision.items[index]
        entry = current_entry(tier, item)
        if entry is None:
            continue
        others = sorted(job for job in entry.leases or {} if job != decision.job_id)
        if not others:
            events.append(
                KeyEvicted(
                    tier=tier.spec.name,
                    pool_id=item.dest.pool_id,
                    key=item.key,
                    tier_slot=item.tier_slot,
                    engine_id=decision.engine_id,
                )
            )
        elif not entry.quarantined:
            events.append(
                KeyQuarantined(
                    tier=tier.spec.name,
                    pool_id=item.dest.pool_id,
                    key=item.key,
                    reason=Reason.OBJECT_LOST,
                    job_id=decision.job_id,
                    detail=f"the tier lost the bytes while load job(s) {others} hold the key",
                )
            )
    return events


def current_entry(tier: TierState, item: LoadItem | ExternalItem) -> KeyEntry | None:
    """The key's entry if it is still the one the load was decided on (same slot and
    generation); None when it left the tier or was stored again elsewhere."""
    entry = tier.entry(pool_of(item), item.key)
    if entry is None or (entry.tier_slot, entry.tier_generation) != (item.tier_slot, item.tier_generation):
        return None
    return entry


def _load_mismatches(state: State, decision: Load, reports: dict[int, RankReported]) -> list[Event]:
    """For a load some rank failed: KeyQuarantined for each key some rank read with other bytes
    than published, then the job's failure (CHECKSUM_MISMATCH); empty when no report carries a
    full, differing checksum list, or with checksums off. A key that left the tier (only
    possible with leases off) is compared with the checksums in the decision and, being gone,
    is not quarantined: the load fails all the same."""
    if is_off(Protection.CHECKSUMS):
        return []
    tier = state.tiers[decision.tier]
    keys: dict[tuple[int, bytes], None] = {}
    mismatched = 0
    items: Sequence[LoadItem | ExternalItem] = decision.items
    kept = len(items)  # the items before the first that some rank did not verify
    for rank in range(decision.world_size):
        report = reports.get(rank)
        if report is None or len(report.checksums) != len(items):
            kept = 0  # what a rank that says nothing of its reads copied is unknown
            continue
        for index, (item, read) in enumerate(zip(items, report.checksums, strict=True)):
            entry = current_entry(tier, item)
            published = entry.checksums if entry is not None else item.checksums
            if not read or rank >= len(published) or read != published[rank]:
                kept = min(kept, index)
            if read and rank < len(published) and read != published[rank]:
                mismatched += 1
                if entry is not None:
                    keys[(pool_of(item), item.key)] = None
    if not mismatched:
        return []
    return [
        *(
            KeyQuarantined(
                tier=tier.spec.name,
                pool_id=pool_id,
                key=key,
                reason=Reason.CHECKSUM_MISMATCH,
                job_id=decision.job_id,
                detail="a worker read other bytes than the published checksum",
            )
            for pool_id, key in keys
            if tier.published[pool_id][key] not in tier.quarantined
        ),
        JobFailed(
            job_id=decision.job_id,
            reason=Reason.CHECKSUM_MISMATCH,
            detail=f"{mismatched} reads differ from the published checksums",
            kept=kept,
        ),
    ]
