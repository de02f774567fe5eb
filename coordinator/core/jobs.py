"""Decisions that involve tiers and workers: prefix lookup, store, load, state copy, reports."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Container, Iterator, Sequence
from typing import Any

import msgspec

from coordinator.core import checks as check
from coordinator.core.checks import Refusal
from coordinator.core.commands import Command, LookupPrefix, PlanStateCopy, ReleaseFencedRank, ReportRank, StartLoad, StartStore
from coordinator.core.completion import complete
from coordinator.core.copy_plan import PlannedMove, overlapping_destinations, plan_copies
from coordinator.core.keys import chain_keys, iter_chain_keys, reuse_unit
from coordinator.core.protections import Protection, is_off
from coordinator.core.state import EngineState, JobState, PoolState, SlotStatus, State, unpack_checksums
from coordinator.core.tier_slots import blocks_in_flight, reserve_tier_slots
from events import (
    NULL_BLOCK_ID,
    BlockRef,
    CopyBatch,
    CopyOp,
    Event,
    FencedRankDone,
    FencedRankReleased,
    GroupHit,
    JobSucceeded,
    KeyPublished,
    LoadItem,
    LoadJobStarted,
    PrefixLookedUp,
    RankReported,
    Reason,
    Region,
    StateCopyPlanned,
    StoreItem,
    StoreJobStarted,
)

Handler = Callable[[State, Any], list[Event]]


# --- lookup --------------------------------------------------------------------------------------


def _lookup_prefix(state: State, command: LookupPrefix) -> list[Event]:
    return [prefix_hit(state, command, check.engine_in_step(state, command.engine_id))]


class Chains(msgspec.Struct, frozen=True):
    """A lookup's chain keys, hashed before it is decided (`hash_chains`: the sidecar hashes a long
    lookup off its event loop). Used only if they were hashed for the engine's namespace and block
    sizes as the state has them when the lookup is decided."""

    namespace_id: bytes
    block_sizes: dict[int, int]
    """pool id -> block size, of every group a prefix hit restores."""
    keys: dict[int, list[bytes]]


def lookup_groups(eng: EngineState) -> dict[int, int]:
    """The groups a lookup hashes: pool id -> block size (every pool but the encoder's)."""
    return {pool.spec.pool_id: pool.spec.block_size for pool in eng.pools.values() if pool.spec.kind != "encoder"}


def keyed_extras(extra_keys: Sequence[str]) -> Sequence[str]:
    """The extra keys as a content key covers them: whole (I8). With FULL_WIDTH_EXTRAS off (the
    simulator's LMCache #4086), each by its first 16 bits (four hex digits)."""
    if is_off(Protection.FULL_WIDTH_EXTRAS):
        return [extra[:4] for extra in extra_keys]
    return extra_keys


def hash_chains(namespace_id: bytes, block_sizes: dict[int, int], token_ids: Sequence[int], extra_keys: Sequence[str]) -> Chains:
    """Pure, and touches no state: it can run on any thread."""
    return Chains(
        namespace_id,
        dict(block_sizes),
        {pool_id: chain_keys(namespace_id, token_ids, size, extra_keys) for pool_id, size in block_sizes.items()},
    )


def prefix_hit(
    state: State,
    command: LookupPrefix,
    eng: EngineState,
    hashed: Chains | None = None,
    uncommitted: Container[bytes] = frozenset(),
) -> PrefixLookedUp:
    """The longest boundary that is a whole reuse unit (I7) at which every group needed to
    resume has a loadable key (I6), in this engine's namespace only (I9)."""
    tier = check.tier(state, eng, command.tier)
    if len(command.token_ids) > check.MAX_LOOKUP_TOKENS:
        raise Refusal(
            Reason.INVALID_COUNT, f"a lookup hashes at most {check.MAX_LOOKUP_TOKENS:,} token ids, not {len(command.token_ids):,}"
        )
    if len(command.extra_keys) > check.MAX_EXTRA_KEYS:
        raise Refusal(
            Reason.INVALID_COUNT, f"a lookup takes at most {check.MAX_EXTRA_KEYS:,} extra keys, not {len(command.extra_keys):,}"
        )
    groups = [p for p in eng.pools.values() if p.spec.kind != "encoder"]
    unit = reuse_unit((p.spec.kind, p.spec.block_size) for p in groups)
    if is_off(Protection.WHOLE_UNITS) and groups:
        unit = min(p.spec.block_size for p in groups)  # the naive, finer granularity
    tokens = command.token_ids
    extras = keyed_extras(command.extra_keys)
    precomputed = (
        hashed.keys
        if hashed is not None
        and hashed.namespace_id == eng.namespace_id
        and hashed.block_sizes == lookup_groups(eng)
        and extras == command.extra_keys
        else None
    )

    published, quarantined, namespace_ids = tier.published, tier.quarantined, tier.namespace_ids

    def loadable(pool: PoolState, key: bytes) -> bool:
        """A key this engine may load (I9: this namespace), committed (not in `uncommitted`)."""
        slot = published.get(pool.spec.pool_id, {}).get(key)
        return slot is not None and slot not in quarantined and namespace_ids[slot] == eng.namespace_id and key not in uncommitted

    def keys_of(pool: PoolState, blocks: int | None = None) -> Iterator[bytes]:
        size = pool.spec.block_size
        if precomputed is not None:
            return iter(precomputed[pool.spec.pool_id][:blocks])
        upto = tokens if blocks is None else tokens[: blocks * size]
        return iter_chain_keys(eng.namespace_id, upto, size, extras)

    # A full-attention group needs every block before the boundary, so none lies past its first
    # unloadable block: its keys are hashed only up to there, and every other group's only up to
    # that bound (a miss costs one key, not the 16,384 of a 262,144-token lookup).
    top = len(tokens) // unit * unit if unit else 0
    chains: dict[int, list[bytes]] = {}
    for p in groups:
        if p.spec.kind == "attention":
            keys = list(itertools.takewhile(lambda key, p=p: loadable(p, key), keys_of(p)))  # type: ignore[misc]
            chains[p.spec.pool_id] = keys
            top = min(top, len(keys) * p.spec.block_size // unit * unit if unit else 0)
    for p in groups:
        if p.spec.kind != "attention":
            chains[p.spec.pool_id] = list(keys_of(p, top // p.spec.block_size))

    def needed(pool: PoolState, boundary: int) -> range:
        """Block indexes a group must load to resume at `boundary`."""
        size = pool.spec.block_size
        end = boundary // size
        if pool.spec.kind == "state":
            return range(end - 1, end)  # the state at the boundary, nothing before it
        if pool.spec.kind == "sliding_window" and pool.spec.sliding_window:
            return range(max(0, (boundary - pool.spec.sliding_window) // size), end)
        return range(0, end)

    def prefix_sums(pool: PoolState) -> list[int]:
        """sums[i] = how many of the first i blocks have a loadable key."""
        sums = [0]
        for key in chains[pool.spec.pool_id]:
            sums.append(sums[-1] + loadable(pool, key))
        return sums

    sums = {p.spec.pool_id: prefix_sums(p) for p in groups}

    def valid(pool: PoolState, boundary: int) -> bool:
        span = needed(pool, boundary)
        counts = sums[pool.spec.pool_id]
        return counts[span.stop] - counts[span.start] == len(span)

    boundary = 0
    if unit:
        for candidate in range(top, 0, -unit):
            if all(valid(p, candidate) for p in groups):
                boundary = candidate
                break
    hits = (
        [GroupHit(p.spec.pool_id, [chains[p.spec.pool_id][i] for i in needed(p, boundary)]) for p in groups] if boundary else []
    )
    return PrefixLookedUp(
        engine_id=eng.engine_id,
        tier=tier.spec.name,
        num_tokens=len(tokens),
        reuse_unit=unit,
        boundary=boundary,
        hits=hits,
    )


# --- store -----------------------------------------------------------------------------------------


def _start_store(state: State, command: StartStore) -> list[Event]:
    eng = check.engine_in_step(state, command.engine_id)
    check.room_for_a_job(state, eng, len(command.blocks))
    tier = check.tier(state, eng, command.tier)
    check.unique_refs(command.blocks, "blocks to store")
    to_store: list[tuple[BlockRef, bytes]] = []
    skipped: list[bytes] = []
    kept: set[int] = set()  # the slots of the published keys it skips (reserve_tier_slots keeps them)
    seen: set[tuple[int, bytes]] = set()
    writing: set[BlockRef] | None = None  # the engine's blocks in flight to the tier, read once if needed
    naive_nulls = is_off(Protection.NULL_STATES)
    for ref in command.blocks:
        pool = check.block(eng, ref, allow_null=naive_nulls)
        if pool.spec.kind == "encoder":
            raise Refusal(Reason.INVALID_ARGUMENT, f"pool {ref.pool_id} is an encoder pool")
        key = pool.keys[ref.block_id]
        held = pool.status(ref.block_id) is SlotStatus.ALLOCATED or (naive_nulls and ref.block_id == NULL_BLOCK_ID)
        if key is None or not held:
            # I17: content that is still being computed or loaded is not stored.
            raise Refusal(Reason.NOT_COMPUTED, f"block {ref.pool_id}/{ref.block_id} is not computed and held")
        published = tier.slot_of(ref.pool_id, key)
        if pool.pins[ref.block_id] and writing is None:
            # Only a pinned block can be a store's source in flight (a store pins its sources; with
            # pins off, the simulator's naive scenario, none is): the jobs are read for a command
            # naming one, not for every store.
            writing = blocks_in_flight(state, tier, eng.engine_id)
        if published is not None or (ref.pool_id, key) in seen or (writing is not None and ref in writing):
            skipped.append(key)  # I10: already there (or twice in this job, or this block on its way in): an idempotent skip
            if published is not None:
                kept.add(published)
            continue
        seen.add((ref.pool_id, key))
        to_store.append((ref, key))
    slots, evictions = reserve_tier_slots(state, tier, eng, len(to_store), kept)
    job_id = state.next_job_id
    items = [StoreItem(ref, key, slot, tier.generations[slot] + 1) for (ref, key), slot in zip(to_store, slots, strict=True)]
    events: list[Event] = [*evictions]
    events.append(
        StoreJobStarted(
            job_id=job_id,
            engine_id=eng.engine_id,
            incarnation=eng.incarnation,
            tier=tier.spec.name,
            world_size=eng.world_size,
            items=items,
            already_published=skipped,
            pinned=not is_off(Protection.PINS),
        )
    )
    if is_off(Protection.PUBLISH_WHEN_COMPLETE):  # Mooncake #1374: the key exists from put_start
        events += [
            KeyPublished(
                tier=tier.spec.name,
                namespace_id=eng.namespace_id,
                pool_id=item.source.pool_id,
                key=item.key,
                tier_slot=item.tier_slot,
                tier_generation=item.tier_generation,
                checksums=[],
                size_bytes=eng.pools[item.source.pool_id].spec.bytes_per_block,
                source_job=job_id,
            )
            for item in items
        ]
    if not items:
        events.append(JobSucceeded(job_id=job_id))
    return events


# --- load ------------------------------------------------------------------------------------------


def _start_load(state: State, command: StartLoad) -> list[Event]:
    eng = check.engine_in_step(state, command.engine_id)
    check.room_for_a_job(state, eng, len(command.items))
    tier = check.tier(state, eng, command.tier)
    check.count(len(command.items), check.MAX_ITEMS_PER_COMMAND, "number of load items")
    check.finite(command.lease_seconds, "lease_seconds", high=check.MAX_LEASE_SECONDS)
    if command.lease_seconds <= 0:
        raise Refusal(Reason.INVALID_ARGUMENT, "lease_seconds must be positive")
    dests = [item.dest for item in command.items]
    if len(set(dests)) != len(dests):
        raise Refusal(Reason.INVALID_ARGUMENT, "two items load into the same destination block")
    items = []
    for request in command.items:
        ref = request.dest
        pool = check.block(eng, ref)
        if pool.spec.kind == "encoder":
            raise Refusal(Reason.INVALID_ARGUMENT, f"pool {ref.pool_id} is an encoder pool")
        if pool.refs[ref.block_id] == 0:
            raise Refusal(Reason.INVALID_ARGUMENT, f"destination {ref.pool_id}/{ref.block_id} is not allocated")
        if pool.keys[ref.block_id] is not None:
            raise Refusal(Reason.ALREADY_COMPUTED, f"destination {ref.pool_id}/{ref.block_id} is already computed")
        if pool.pins[ref.block_id]:
            raise Refusal(Reason.SLOT_PINNED, f"destination {ref.pool_id}/{ref.block_id} is written by another job")
        slot = tier.slot_of(ref.pool_id, request.key)
        if slot is None or tier.namespace_ids[slot] != eng.namespace_id:
            # I9: another namespace's key reads exactly like an absent one.
            raise Refusal(
                Reason.KEY_NOT_PUBLISHED,
                f"key {request.key.hex()} of group {ref.pool_id} is not published in tier {tier.spec.name!r}",
            )
        if slot in tier.quarantined:
            raise Refusal(Reason.KEY_QUARANTINED, f"key {request.key.hex()} is quarantined")
        items.append(LoadItem(request.key, slot, tier.generations[slot], ref, unpack_checksums(tier.packed_checksums[slot])))
    return [
        LoadJobStarted(
            job_id=state.next_job_id,
            engine_id=eng.engine_id,
            incarnation=eng.incarnation,
            tier=tier.spec.name,
            world_size=eng.world_size,
            items=items,
            lease_expires_at=eng.clock + command.lease_seconds,
            pinned=not is_off(Protection.PINS),
        )
    ]


# --- state copies ---------------------------------------------------------------------------------


def _plan_state_copy(state: State, command: PlanStateCopy) -> list[Event]:
    eng = check.engine_in_step(state, command.engine_id)
    check.room_for_a_job(state, eng, 0)
    pool = check.pool(eng, command.pool_id)
    if pool.spec.kind == "encoder":
        raise Refusal(Reason.INVALID_ARGUMENT, f"pool {pool.spec.pool_id} is an encoder pool")
    check.count(len(command.moves), 4096, "number of moves")
    limit = pool.spec.bytes_per_block
    planned = []
    touched: dict[BlockRef, None] = {}
    destinations: dict[BlockRef, None] = {}
    for index, move in enumerate(command.moves):
        for ref, offset in ((move.src, move.src_offset), (move.dst, move.dst_offset)):
            if ref.pool_id != pool.spec.pool_id:
                raise Refusal(Reason.INVALID_ARGUMENT, f"move {index} leaves pool {pool.spec.pool_id}")
            check.block(eng, ref)  # I2: never from or to the null block (seed 004)
            if move.length <= 0 or offset < 0 or offset + move.length > limit:
                raise Refusal(
                    Reason.OUT_OF_BOUNDS,
                    f"move {index}: [{offset}, {offset + move.length}) outside block of {limit} bytes",
                )
        if pool.status(move.src.block_id) is SlotStatus.FREE:
            raise Refusal(Reason.INVALID_ARGUMENT, f"move {index} reads free block {move.src.block_id}")
        if pool.refs[move.dst.block_id] == 0:
            raise Refusal(Reason.INVALID_ARGUMENT, f"move {index} writes unowned block {move.dst.block_id}")
        if pool.pins[move.dst.block_id]:
            raise Refusal(Reason.SLOT_PINNED, f"move {index} writes block {move.dst.block_id}, which a job reads")
        planned.append(
            PlannedMove(Region(move.src, move.src_offset, move.length), Region(move.dst, move.dst_offset, move.length))
        )
        touched[move.src] = None
        touched[move.dst] = None
        destinations[move.dst] = None
    clash = overlapping_destinations(planned)
    if clash is not None:
        raise Refusal(Reason.OVERLAPPING_DESTINATIONS, f"moves {clash[0]} and {clash[1]} write the same bytes")
    if is_off(Protection.ORDERED_COPIES):
        # The naive executor of seed 000: each move in the order given, reading what earlier
        # moves wrote, no scratch.
        plan, scratch = [[CopyOp(m.src, m.dst, False)] for m in planned if m.src != m.dst], 0
    else:
        plan, scratch = plan_copies(planned)
    batches = [CopyBatch.from_ops(pool.spec.pool_id, ops) for ops in plan]
    job_id = state.next_job_id
    events: list[Event] = [
        StateCopyPlanned(
            job_id=job_id,
            engine_id=eng.engine_id,
            incarnation=eng.incarnation,
            pool_id=pool.spec.pool_id,
            world_size=eng.world_size,
            batches=batches,
            scratch_bytes=scratch,
            blocks=list(touched),
            destinations=list(destinations),
        )
    ]
    if not batches:
        events.append(JobSucceeded(job_id=job_id))
    return events


# --- reports -----------------------------------------------------------------------------------------


def _check_own_job(state: State, command: ReportRank, job: JobState | None) -> None:
    """A report attributed to an engine counts only for that engine's jobs, running or fenced.
    The sidecar's door checks this too, against the state then; here it holds whatever was decided
    in between (a job id freed by a failed append's rebuild and made again for another engine in
    the very group this report is decided in)."""
    if job is None:
        fenced = state.fenced.get(command.job_id)
        job = fenced.job if fenced is not None else None
    if job is not None and job.decision.engine_id != command.engine_id:
        raise Refusal(
            Reason.FOREIGN_JOB, f"job {command.job_id} belongs to engine {job.decision.engine_id!r}, not to {command.engine_id!r}"
        )


def _report_rank(state: State, command: ReportRank) -> list[Event]:
    """A rank's report (I4): counted per (job_id, rank); duplicates and stale ones dropped."""
    if not 0 < command.job_id < state.next_job_id:
        raise Refusal(Reason.UNKNOWN_JOB, f"job {command.job_id} was never started")
    job = state.jobs.get(command.job_id)
    if command.engine_id:
        _check_own_job(state, command, job)
    if job is None:
        fenced = state.fenced.get(command.job_id)
        if fenced is not None and command.rank in fenced.pending:
            # I16: the result is dropped, but this rank's transfer is over; the job's slots go
            # when every rank is done.
            return [FencedRankDone(job_id=command.job_id, rank=command.rank)]
        raise Refusal(Reason.STALE_JOB, f"job {command.job_id} already finished or was fenced")
    decision = job.decision
    if not 0 <= command.rank < decision.world_size:
        raise Refusal(Reason.RANK_OUT_OF_RANGE, f"rank {command.rank} of world size {decision.world_size}")
    if command.lost and (
        command.ok
        or not isinstance(decision, LoadJobStarted)
        or len(set(command.lost)) != len(command.lost)
        or not all(0 <= index < len(decision.items) for index in command.lost)
    ):
        raise Refusal(Reason.INVALID_ARGUMENT, "lost names distinct items of a failed load, by index")
    report = RankReported(
        job_id=command.job_id,
        rank=command.rank,
        ok=command.ok,
        checksums=command.checksums,
        error=command.error,
        lost=command.lost,
    )
    earlier = job.reports.get(command.rank)
    if earlier is not None:
        reason = Reason.DUPLICATE_REPORT if earlier == report else Reason.CONFLICTING_REPORT
        raise Refusal(reason, f"job {command.job_id} rank {command.rank} already reported")
    events: list[Event] = [report]
    reports = {**job.reports, command.rank: report}
    if len(reports) == decision.world_size:
        events += complete(state, job.decision, reports)
    return events


def _release_fenced_rank(state: State, command: ReleaseFencedRank) -> list[Event]:
    """An operator's word that a rank's worker is gone (I16): every fenced job of the engine still
    waiting on that rank's late report is done with it, as if it had reported, so its slots,
    reserved tier slots and leases go when its last rank is done. Refused when nothing waits on
    the rank, so a mistyped engine or rank is seen rather than recorded as a release."""
    check.engine(state, command.engine_id)  # an unknown engine is refused
    if command.rank < 0:
        raise Refusal(Reason.RANK_OUT_OF_RANGE, f"rank {command.rank} < 0")
    # No upper bound from the engine's world size now: a restart may have shrunk it, and the
    # fenced jobs of the old incarnation still wait on their own ranks (`waiting` below decides).
    if not command.reason.strip():
        raise Refusal(Reason.INVALID_ARGUMENT, "a release names its reason (the audit record of why the worker is gone)")
    waiting = [
        job_id
        for job_id, fenced in state.fenced.items()
        if fenced.job.decision.engine_id == command.engine_id and command.rank in fenced.pending
    ]
    if not waiting:
        raise Refusal(Reason.STALE_JOB, f"no fenced job of engine {command.engine_id!r} waits on rank {command.rank}")
    return [
        FencedRankReleased(engine_id=command.engine_id, rank=command.rank, job_ids=waiting, reason=command.reason),
        *(FencedRankDone(job_id=job_id, rank=command.rank) for job_id in waiting),
    ]


HANDLERS: dict[type[Command], Handler] = {
    ReleaseFencedRank: _release_fenced_rank,
    LookupPrefix: _lookup_prefix,
    StartStore: _start_store,
    StartLoad: _start_load,
    PlanStateCopy: _plan_state_copy,
    ReportRank: _report_rank,
}
