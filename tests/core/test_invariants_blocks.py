"""Invariants of device slots, jobs and the log: I1-I4 and I14-I18 of DESIGN.md.

Every test drives the real pure core (CoordinatorCore.execute) and checks the emitted events and
the folded state. Tier-side invariants (I5-I13) live in test_invariants_tiers.py.
"""

from __future__ import annotations

from collections.abc import Sequence

from coordinator.core import CoordinatorCore
from coordinator.core.commands import (
    AllocateBlocks,
    AllocateEncoderEntry,
    DeclareEngine,
    EndStep,
    FinishOwner,
    FreeBlocks,
    FreeEncoderEntry,
    LoadRequest,
    LookupPrefix,
    MarkComputed,
    Move,
    PlanStateCopy,
    ReportRank,
    ResetCache,
    ReuseBlocks,
    StartLoad,
    StartOwner,
    StartStore,
)
from coordinator.core.copy_plan import parallel_assignment_on_bytes, run_plan_on_bytes
from coordinator.core.projector import project
from coordinator.core.state import SlotStatus, decode_state, encode_state
from events import (
    BlockRef,
    BlocksAllocated,
    BlocksReused,
    EngineReset,
    FencedRankDone,
    JobFenced,
    JobSucceeded,
    KeyEvicted,
    KeyPublished,
    LoadJobStarted,
    NoticeDropped,
    OwnerStarted,
    PrefixLookedUp,
    Reason,
    Refused,
    StateCopyPlanned,
    StepEnded,
    StoreJobStarted,
)
from tests.kit.builders import (
    ENGINE,
    TIER,
    allocate,
    attention_pool,
    begin,
    checksum,
    compute,
    end,
    namespace,
    new_core,
    ok,
    owner,
    publish,
    rejected,
    replay_matches,
    report_all,
    start_store,
    state_pool,
)

TOKENS = list(range(100, 116))  # four attention blocks of 4 tokens


def end_events(core: CoordinatorCore) -> tuple[StepEnded, list[NoticeDropped]]:
    """End the step (dropped notices allowed) and return its StepEnded and dropped notices."""
    events = core.execute(EndStep(engine_id=ENGINE))
    assert isinstance(events[-1], StepEnded), events
    return events[-1], [e for e in events if isinstance(e, NoticeDropped)]


# --- I1 generations --------------------------------------------------------------------------------


def test_I1_every_allocation_bumps_the_generation() -> None:
    """The same slot handed out twice carries two generations, in managed and reported pools
    (seed 000: without them a late message cannot tell the old owner from the new one)."""
    core = new_core([attention_pool(num_blocks=2), attention_pool(pool_id=1, managed=False)])
    begin(core)
    first_owner, second_owner = owner(core, "req-1"), owner(core, "req-2")
    [first] = allocate(core, first_owner, 1)
    ok(core.execute(FreeBlocks(engine_id=ENGINE, owner_id=first_owner, blocks=[first])))
    [second] = allocate(core, second_owner, 1)
    assert (second.block_id, second.generation) == (first.block_id, first.generation + 1)

    generations = []
    for _ in range(3):
        event = ok(core.execute(AllocateBlocks(engine_id=ENGINE, owner_id=first_owner, pool_id=1, count=1, block_ids=[5])))[0]
        assert isinstance(event, BlocksAllocated)
        generations.append(event.blocks[0].generation)
        ok(core.execute(FreeBlocks(engine_id=ENGINE, owner_id=first_owner, blocks=event.blocks)))
    assert generations == [1, 2, 3]
    assert core.state.engines[ENGINE].pools[1].generations[5] == 3
    assert replay_matches(core)


def test_I1_command_naming_a_stale_generation_is_refused() -> None:
    """A decision about a recycled slot must name its current lifetime (seed 000)."""
    core = new_core([attention_pool(num_blocks=2)])
    begin(core)
    old_owner, new_owner = owner(core, "req-1"), owner(core, "req-2")
    [old] = allocate(core, old_owner, 1)
    compute(core, old_owner, [old], TOKENS[:4])
    ok(core.execute(FreeBlocks(engine_id=ENGINE, owner_id=old_owner, blocks=[old])))
    [new] = allocate(core, new_owner, 1)
    assert new.block_id == old.block_id

    mark = MarkComputed(engine_id=ENGINE, owner_id=new_owner, blocks=[old], token_ids=TOKENS[:4])
    rejected(core, mark, Refused, Reason.STALE_GENERATION)
    rejected(core, StartStore(engine_id=ENGINE, tier=TIER, blocks=[old]), Refused, Reason.STALE_GENERATION)
    reuse = ReuseBlocks(engine_id=ENGINE, owner_id=old_owner, blocks=[old])
    rejected(core, reuse, Refused, Reason.STALE_GENERATION)
    assert replay_matches(core)


def test_I1_notice_naming_a_stale_generation_is_dropped() -> None:
    """A late FreeBlocks for a block already recycled must not free the new owner's block."""
    core = new_core([attention_pool(num_blocks=2)])
    begin(core)
    old_owner, new_owner = owner(core, "req-1"), owner(core, "req-2")
    [old] = allocate(core, old_owner, 1)
    ok(core.execute(FreeBlocks(engine_id=ENGINE, owner_id=old_owner, blocks=[old])))
    [new] = allocate(core, new_owner, 1)

    late = FreeBlocks(engine_id=ENGINE, owner_id=old_owner, blocks=[old])
    rejected(core, late, NoticeDropped, Reason.STALE_GENERATION)
    pool = core.state.engines[ENGINE].pools[0]
    assert pool.status(new.block_id) is SlotStatus.ALLOCATED
    assert core.state.owners[new_owner].blocks == {0: {new.block_id: new.generation}}
    assert replay_matches(core)


def test_I1_resumed_request_is_a_new_owner() -> None:
    """req_id is metadata: a preempted request that resumes gets a new owner id (seed 000)."""
    core = new_core()
    begin(core)
    first = owner(core, "req-1")
    allocate(core, first, 1)
    ok(core.execute(FinishOwner(engine_id=ENGINE, owner_id=first, reason="preempted")))
    resumed = ok(core.execute(StartOwner(engine_id=ENGINE, req_id="req-1", resumed=True)))[0]
    assert isinstance(resumed, OwnerStarted) and resumed.resumed
    assert resumed.owner_id != first
    rejected(core, AllocateBlocks(engine_id=ENGINE, owner_id=first, pool_id=0, count=1), Refused, Reason.UNKNOWN_OWNER)
    assert replay_matches(core)


# --- I2 null block ---------------------------------------------------------------------------------


def test_I2_managed_pool_never_allocates_the_null_block() -> None:
    """Exhausting a managed pool hands out blocks 1..n-1 only, then refuses."""
    core = new_core([attention_pool(num_blocks=6)])
    begin(core)
    own = owner(core)
    blocks = [ref for _ in range(5) for ref in allocate(core, own, 1)]
    assert sorted(ref.block_id for ref in blocks) == [1, 2, 3, 4, 5]
    rejected(core, AllocateBlocks(engine_id=ENGINE, owner_id=own, pool_id=0, count=1), Refused, Reason.POOL_EXHAUSTED)
    assert core.state.engines[ENGINE].pools[0].generations[0] == 0
    assert replay_matches(core)


def test_I2_reported_allocation_naming_the_null_block_is_refused() -> None:
    """vLLM's NULL_BLOCK_ID is never a real allocation (seed 004), even next to a valid one."""
    core = new_core([attention_pool(managed=False)])
    begin(core)
    own = owner(core)
    for block_ids in ([0], [2, 0]):
        command = AllocateBlocks(engine_id=ENGINE, owner_id=own, pool_id=0, count=len(block_ids), block_ids=block_ids)
        rejected(core, command, Refused, Reason.NULL_BLOCK)
    assert core.state.engines[ENGINE].pools[0].status(2) is SlotStatus.FREE
    assert replay_matches(core)


def test_I2_store_load_and_copy_naming_the_null_block_are_refused() -> None:
    """No job ever reads or writes block 0 (seed 004: state copied from the null block)."""
    core = new_core([attention_pool(), state_pool()])
    begin(core)
    [key] = publish(core, TOKENS[:4])
    own = owner(core)
    [state_block] = allocate(core, own, 1, pool_id=1)
    null_attention, null_state = BlockRef(0, 0, 0), BlockRef(1, 0, 0)

    rejected(core, StartStore(engine_id=ENGINE, tier=TIER, blocks=[null_attention]), Refused, Reason.NULL_BLOCK)
    load = StartLoad(engine_id=ENGINE, tier=TIER, items=[LoadRequest(key, null_attention)])
    rejected(core, load, Refused, Reason.NULL_BLOCK)
    for move in (Move(null_state, 0, state_block, 0, 16), Move(state_block, 0, null_state, 0, 16)):
        rejected(core, PlanStateCopy(engine_id=ENGINE, pool_id=1, moves=[move]), Refused, Reason.NULL_BLOCK)
    mark = MarkComputed(engine_id=ENGINE, owner_id=own, blocks=[null_attention], token_ids=TOKENS[:4])
    rejected(core, mark, Refused, Reason.NULL_BLOCK)
    assert replay_matches(core)


def test_I2_lookup_never_resumes_where_the_state_group_has_no_key() -> None:
    """Seed 004: attention keys reach boundary 16 but the state group has a key only at 8; the
    hit is 8, never 16 (which would resume from the null state block); with no state key, 0."""
    core = new_core([attention_pool(), state_pool()])
    begin(core)
    attention_keys = publish(core, TOKENS, pool_id=0)
    state_keys = publish(core, TOKENS[:8], pool_id=1)

    [looked] = ok(core.execute(LookupPrefix(engine_id=ENGINE, tier=TIER, token_ids=TOKENS)))
    assert isinstance(looked, PrefixLookedUp)
    assert looked.boundary == 8
    assert {hit.pool_id: hit.keys for hit in looked.hits} == {0: attention_keys[:2], 1: state_keys}

    other = list(range(500, 516))
    publish(core, other, pool_id=0)  # attention only
    [looked] = ok(core.execute(LookupPrefix(engine_id=ENGINE, tier=TIER, token_ids=other)))
    assert isinstance(looked, PrefixLookedUp)
    assert (looked.boundary, looked.hits) == (0, [])
    assert replay_matches(core)


# --- I3 pins ---------------------------------------------------------------------------------------


def test_I3_store_source_drains_and_is_never_reallocated() -> None:
    """Seed 000 (Mooncake store-job fix): the owner frees a block an async store still reads;
    it drains, is skipped under pool pressure, and is freed (and announced) only after every
    rank reported."""
    core = new_core([attention_pool(num_blocks=3)])
    begin(core)
    writer = owner(core, "req-1")
    stored, other = allocate(core, writer, 2)
    compute(core, writer, [stored, other], TOKENS[:8])
    job = start_store(core, [stored])
    ok(core.execute(FinishOwner(engine_id=ENGINE, owner_id=writer, reason="preempted")))
    pool = core.state.engines[ENGINE].pools[0]
    assert pool.status(stored.block_id) is SlotStatus.DRAINING
    step_ended, _ = end_events(core)
    assert step_ended.freed_blocks == [other]  # the draining block is not free yet

    begin(core)
    reader = owner(core, "req-2")
    assert [ref.block_id for ref in allocate(core, reader, 1)] == [other.block_id]
    rejected(core, AllocateBlocks(engine_id=ENGINE, owner_id=reader, pool_id=0, count=1), Refused, Reason.POOL_EXHAUSTED)
    ok(core.execute(ReportRank(job_id=job.job_id, rank=0, ok=True, checksums=[checksum(job.items[0].key, 0)])))
    assert pool.status(stored.block_id) is SlotStatus.DRAINING  # one rank is not every rank
    ok(core.execute(ReportRank(job_id=job.job_id, rank=1, ok=True, checksums=[checksum(job.items[0].key, 1)])))
    assert pool.status(stored.block_id) is SlotStatus.CACHED_FREE
    step_ended, _ = end_events(core)
    assert step_ended.freed_blocks == [stored]  # announced in the step it really became free

    begin(core)
    [again] = allocate(core, reader, 1)
    assert (again.block_id, again.generation) == (stored.block_id, stored.generation + 1)
    assert replay_matches(core)


def test_I3_reported_allocation_of_a_draining_block_is_refused() -> None:
    """The engine's own allocator recycling a block a job still reads is refused (seed 000)."""
    core = new_core([attention_pool(managed=False)])
    begin(core)
    writer, reader = owner(core, "req-1"), owner(core, "req-2")
    event = ok(core.execute(AllocateBlocks(engine_id=ENGINE, owner_id=writer, pool_id=0, count=1, block_ids=[3])))[0]
    assert isinstance(event, BlocksAllocated)
    compute(core, writer, event.blocks, TOKENS[:4])
    job = start_store(core, event.blocks)
    ok(core.execute(FreeBlocks(engine_id=ENGINE, owner_id=writer, blocks=event.blocks)))

    recycle = AllocateBlocks(engine_id=ENGINE, owner_id=reader, pool_id=0, count=1, block_ids=[3])
    rejected(core, recycle, Refused, Reason.SLOT_PINNED)
    report_all(core, job.job_id, [job.items[0].key])
    again = ok(core.execute(recycle))[0]
    assert isinstance(again, BlocksAllocated) and again.blocks == [BlockRef(0, 3, 2)]
    assert replay_matches(core)


def test_I3_cached_free_copy_source_is_not_reallocated_while_pinned() -> None:
    """A state copy may read a cached-free block; while the copy is in flight that block is
    pinned, so a managed allocation must not hand it out (it would be overwritten mid-copy)."""
    core = new_core([state_pool(pool_id=0, num_blocks=3)])
    begin(core)
    own = owner(core)
    source, dest = allocate(core, own, 2)
    compute(core, own, [source], TOKENS[:8])
    ok(core.execute(FreeBlocks(engine_id=ENGINE, owner_id=own, blocks=[source])))
    pool = core.state.engines[ENGINE].pools[0]
    assert pool.status(source.block_id) is SlotStatus.CACHED_FREE

    plan = core.execute(PlanStateCopy(engine_id=ENGINE, pool_id=0, moves=[Move(source, 0, dest, 0, 32)]))
    if not isinstance(plan[0], StateCopyPlanned):
        return  # refusing to read a cached-free block is a safe answer too
    assert pool.pins[source.block_id] == 1
    other = owner(core, "req-2")
    events = core.execute(AllocateBlocks(engine_id=ENGINE, owner_id=other, pool_id=0, count=1))
    allocated = [ref.block_id for e in events if isinstance(e, BlocksAllocated) for ref in e.blocks]
    assert source.block_id not in allocated, f"pinned copy source {source} was reallocated: {events}"
    assert replay_matches(core)


# --- I4 job identity -------------------------------------------------------------------------------


def _storing(core: CoordinatorCore, req_id: str = "req-1", tokens: Sequence[int] = TOKENS[:4]) -> tuple[StoreJobStarted, bytes]:
    """A new owner's one block, computed over `tokens` and being stored: its store job and key."""
    own = owner(core, req_id)
    blocks = allocate(core, own, 1)
    [key] = compute(core, own, blocks, tokens)
    return start_store(core, blocks), key


def test_I4_duplicate_and_conflicting_reports_change_nothing() -> None:
    """Reports count per (job_id, rank): a retry is idempotent, a contradiction is dropped."""
    core = new_core()
    begin(core)
    job, key = _storing(core)
    first = ReportRank(job_id=job.job_id, rank=0, ok=True, checksums=[checksum(key, 0)])
    ok(core.execute(first))
    rejected(core, first, NoticeDropped, Reason.DUPLICATE_REPORT)
    conflicting = ReportRank(job_id=job.job_id, rank=0, ok=True, checksums=[b"other"])
    rejected(core, conflicting, NoticeDropped, Reason.CONFLICTING_REPORT)
    rejected(core, ReportRank(job_id=job.job_id, rank=0, ok=False), NoticeDropped, Reason.CONFLICTING_REPORT)
    rejected(core, ReportRank(job_id=job.job_id, rank=2, ok=True), NoticeDropped, Reason.RANK_OUT_OF_RANGE)
    assert job.job_id in core.state.jobs  # rank 0 counted once: still waiting for rank 1

    events = ok(core.execute(ReportRank(job_id=job.job_id, rank=1, ok=True, checksums=[checksum(key, 1)])))
    [published] = [e for e in events if isinstance(e, KeyPublished)]
    assert published.checksums == [checksum(key, 0), checksum(key, 1)]
    assert replay_matches(core)


def test_I4_reports_for_unknown_or_finished_jobs_are_dropped() -> None:
    """A report naming no job, or a finished one, never touches any job's accounting."""
    core = new_core()
    begin(core)
    job, key = _storing(core)
    for job_id in (0, job.job_id + 1, 999):
        rejected(core, ReportRank(job_id=job_id, rank=0, ok=True), NoticeDropped, Reason.UNKNOWN_JOB)
    report_all(core, job.job_id, [key])
    assert job.job_id not in core.state.jobs
    late = ReportRank(job_id=job.job_id, rank=0, ok=True, checksums=[checksum(key, 0)])
    rejected(core, late, NoticeDropped, Reason.STALE_JOB)
    assert replay_matches(core)


def test_I4_a_report_on_another_engines_job_is_dropped_and_changes_nothing() -> None:
    """A report carries the engine whose worker sent it (the sidecar stamps it from the
    connection). On another engine's job, running or fenced, it is dropped FOREIGN_JOB and
    nothing changes: a job id made again for another engine (after a failed append's rebuild,
    in the very group the report was queued in) never takes a report meant for the first. A
    report of the job's own engine, or an unattributed one (the in-process core), counts."""
    core = new_core()
    begin(core)
    job, key = _storing(core)
    foreign = ReportRank(job_id=job.job_id, rank=0, ok=True, checksums=[checksum(key, 0)], engine_id="pod-other")
    dropped = rejected(core, foreign, NoticeDropped, Reason.FOREIGN_JOB)
    assert "pod-other" in str(dropped) and ENGINE in str(dropped)  # both engines named
    rejected(core, ReportRank(job_id=job.job_id, rank=1, ok=False, engine_id="pod-other"), NoticeDropped, Reason.FOREIGN_JOB)
    assert not core.state.jobs[job.job_id].reports
    ok(core.execute(ReportRank(job_id=job.job_id, rank=0, ok=True, checksums=[checksum(key, 0)], engine_id=ENGINE)))
    events = ok(core.execute(ReportRank(job_id=job.job_id, rank=1, ok=True, checksums=[checksum(key, 1)])))
    assert [e for e in events if isinstance(e, KeyPublished)], events

    # Fenced: another engine's report neither finishes a rank of it nor frees its slots.
    job, key = _storing(core, "req-2", TOKENS[4:8])
    ok(core.execute(ResetCache(engine_id=ENGINE)))
    assert job.job_id in core.state.fenced
    rejected(
        core,
        ReportRank(job_id=job.job_id, rank=0, ok=True, checksums=[checksum(key, 0)], engine_id="pod-other"),
        NoticeDropped,
        Reason.FOREIGN_JOB,
    )
    late = ReportRank(job_id=job.job_id, rank=0, ok=True, checksums=[checksum(key, 0)], engine_id=ENGINE)
    assert core.execute(late) == [FencedRankDone(job_id=job.job_id, rank=0)]
    assert replay_matches(core)


def test_I4_same_req_id_store_jobs_are_accounted_separately() -> None:
    """Seed 000: a preempted request resumes with the same req_id; its two store jobs are two
    jobs, and finishing one never releases the other's pin."""
    core = new_core()
    begin(core)
    first = owner(core, "req-1")
    first_blocks = allocate(core, first, 1)
    [first_key] = compute(core, first, first_blocks, TOKENS[:4])
    first_job = start_store(core, first_blocks)
    ok(core.execute(FinishOwner(engine_id=ENGINE, owner_id=first, reason="preempted")))
    second = ok(core.execute(StartOwner(engine_id=ENGINE, req_id="req-1", resumed=True)))[0]
    assert isinstance(second, OwnerStarted)
    second_blocks = allocate(core, second.owner_id, 1)
    [second_key] = compute(core, second.owner_id, second_blocks, TOKENS[4:8])
    second_job = start_store(core, second_blocks)
    assert second_job.job_id != first_job.job_id

    report_all(core, second_job.job_id, [second_key])
    tier = core.state.tiers[TIER]
    pool = core.state.engines[ENGINE].pools[0]
    assert first_job.job_id in core.state.jobs and second_job.job_id not in core.state.jobs
    assert pool.status(first_blocks[0].block_id) is SlotStatus.DRAINING
    assert tier.entry(0, second_key) is not None and tier.entry(0, first_key) is None

    report_all(core, first_job.job_id, [first_key])
    assert pool.status(first_blocks[0].block_id) is SlotStatus.CACHED_FREE
    assert tier.entry(0, first_key) is not None
    assert replay_matches(core)


# --- I14 end-of-step truth -------------------------------------------------------------------------


def test_I14_encoder_entry_freed_and_reallocated_in_step_is_not_announced() -> None:
    """Seed 000 (encoder cache fix): a freed notice for an entry cached again in the same step
    would make the consumer drop a live entry."""
    core = new_core(encoder_cache_tokens=100)
    begin(core)
    ok(core.execute(AllocateEncoderEntry(engine_id=ENGINE, entry_id="img-1", num_tokens=10)))
    end(core)

    begin(core)
    ok(core.execute(FreeEncoderEntry(engine_id=ENGINE, entry_id="img-1")))
    ok(core.execute(AllocateEncoderEntry(engine_id=ENGINE, entry_id="img-1", num_tokens=10)))
    step_ended, dropped = end_events(core)
    assert step_ended.freed_encoder_entries == []
    assert [(d.notice, d.reason) for d in dropped] == [("encoder_entry_freed", Reason.REALLOCATED_IN_STEP)]

    begin(core)
    ok(core.execute(FreeEncoderEntry(engine_id=ENGINE, entry_id="img-1")))
    step_ended, dropped = end_events(core)
    assert (step_ended.freed_encoder_entries, dropped) == (["img-1"], [])
    assert replay_matches(core)


def test_I14_block_freed_and_reallocated_in_step_is_not_announced() -> None:
    """With one usable block the reallocation is deterministic: the freed notice for the old
    generation is dropped; freed and kept free, the block is announced."""
    core = new_core([attention_pool(num_blocks=2)])
    begin(core)
    first, second = owner(core, "req-1"), owner(core, "req-2")
    [old] = allocate(core, first, 1)
    end(core)

    begin(core)
    ok(core.execute(FreeBlocks(engine_id=ENGINE, owner_id=first, blocks=[old])))
    [new] = allocate(core, second, 1)
    step_ended, dropped = end_events(core)
    assert step_ended.freed_blocks == []
    assert [(d.notice, d.reason) for d in dropped] == [("block_freed", Reason.REALLOCATED_IN_STEP)]

    begin(core)
    ok(core.execute(FreeBlocks(engine_id=ENGINE, owner_id=second, blocks=[new])))
    step_ended, dropped = end_events(core)
    assert (step_ended.freed_blocks, dropped) == ([new], [])
    assert replay_matches(core)


def test_I14_block_freed_twice_in_step_is_announced_once() -> None:
    """Freed, reused from the prefix cache and freed again in one step: the consumer gets one
    notice per freed block (a duplicate would free it twice in the engine's free queue)."""
    core = new_core()
    begin(core)
    first, second = owner(core, "req-1"), owner(core, "req-2")
    blocks = allocate(core, first, 1)
    compute(core, first, blocks, TOKENS[:4])
    ok(core.execute(FreeBlocks(engine_id=ENGINE, owner_id=first, blocks=blocks)))
    ok(core.execute(ReuseBlocks(engine_id=ENGINE, owner_id=second, blocks=blocks)))
    ok(core.execute(FreeBlocks(engine_id=ENGINE, owner_id=second, blocks=blocks)))
    step_ended, _ = end_events(core)
    assert step_ended.freed_blocks == blocks
    assert replay_matches(core)


def test_I14_removed_key_notice_describes_the_end_of_step() -> None:
    """An evicted key is announced; a key evicted and published again in the same step is not."""
    core = new_core(tier_slots=1)
    begin(core)
    [first_key] = publish(core, TOKENS[:4])
    end(core)

    begin(core)
    [second_key] = publish(core, TOKENS[4:8])  # evicts first_key
    step_ended, _ = end_events(core)
    assert step_ended.removed_keys == [first_key]

    begin(core)
    [third_key] = publish(core, TOKENS[8:12])  # evicts second_key
    publish(core, TOKENS[4:8])  # evicts third_key, publishes second_key again
    step_ended, dropped = end_events(core)
    assert step_ended.removed_keys == [third_key]
    assert [(d.notice, d.reason) for d in dropped] == [("key_removed", Reason.REALLOCATED_IN_STEP)]
    assert core.state.tiers[TIER].entry(0, second_key) is not None
    assert replay_matches(core)


# --- I15 ordered copies ----------------------------------------------------------------------------


def copy_setup(count: int) -> tuple[CoordinatorCore, list[BlockRef], dict[int, bytearray]]:
    """A state pool (64-byte blocks) with `count` allocated blocks and distinct contents."""
    core = new_core([state_pool(pool_id=0)])
    begin(core)
    blocks = allocate(core, owner(core), count)
    contents = {ref.block_id: bytearray((ref.block_id * 64 + i) % 251 for i in range(64)) for ref in blocks}
    return core, blocks, contents


def plan(core: CoordinatorCore, moves: list[Move]) -> StateCopyPlanned:
    events = ok(core.execute(PlanStateCopy(engine_id=ENGINE, pool_id=0, moves=moves)))
    assert isinstance(events[0], StateCopyPlanned), events
    return events[0]


def check_against_oracle(planned: StateCopyPlanned, moves: list[Move], contents: dict[int, bytearray]) -> None:
    """The plan, run in list order and reversed inside each batch, equals parallel assignment."""
    expected = {k: bytearray(v) for k, v in contents.items()}
    parallel_assignment_on_bytes(expected, [(m.src, m.src_offset, m.dst, m.dst_offset, m.length) for m in moves])
    for reverse in (False, True):
        actual = {k: bytearray(v) for k, v in contents.items()}
        run_plan_on_bytes(actual, [batch.ops() for batch in planned.batches], planned.scratch_bytes, reverse=reverse)
        assert actual == expected


def test_I15_chain_runs_in_dependency_order() -> None:
    """Seed 000 (Mamba fix): A->B, B->C run naively lets B->C read A's bytes."""
    core, (a, b, c), contents = copy_setup(3)
    moves = [Move(a, 0, b, 0, 64), Move(b, 0, c, 0, 64)]
    planned = plan(core, moves)
    check_against_oracle(planned, moves, contents)
    assert planned.scratch_bytes == 0 and len(planned.batches) == 2

    naive = {k: bytearray(v) for k, v in contents.items()}
    for move in moves:
        naive[move.dst.block_id][move.dst_offset : move.dst_offset + move.length] = naive[move.src.block_id][
            move.src_offset : move.src_offset + move.length
        ]
    expected = {k: bytearray(v) for k, v in contents.items()}
    parallel_assignment_on_bytes(expected, [(m.src, m.src_offset, m.dst, m.dst_offset, m.length) for m in moves])
    assert naive != expected
    assert replay_matches(core)


def test_I15_swap_breaks_the_cycle_through_scratch() -> None:
    """A->B, B->A has no order without saving one source first."""
    core, (a, b), contents = copy_setup(2)
    moves = [Move(a, 0, b, 0, 64), Move(b, 0, a, 0, 64)]
    planned = plan(core, moves)
    assert planned.scratch_bytes == 64
    check_against_oracle(planned, moves, contents)
    assert replay_matches(core)


def test_I15_shift_inside_one_block_is_a_memmove() -> None:
    """A region moved left or right within one block overlaps itself: flagged ordered."""
    for src_offset, dst_offset in ((0, 8), (8, 0)):
        core, (a,), contents = copy_setup(1)
        moves = [Move(a, src_offset, a, dst_offset, 40)]
        planned = plan(core, moves)
        [[op]] = [batch.ops() for batch in planned.batches]
        assert op.ordered
        check_against_oracle(planned, moves, contents)
        assert replay_matches(core)


def test_I15_disjoint_copies_stay_in_one_batch() -> None:
    """Independent copies keep their parallelism: one batch, no scratch, no ordering."""
    core, (a, b, c, d), contents = copy_setup(4)
    moves = [Move(a, 0, b, 0, 64), Move(c, 0, d, 32, 32)]
    planned = plan(core, moves)
    assert len(planned.batches) == 1 and len(planned.batches[0]) == 2
    assert planned.scratch_bytes == 0 and not any(planned.batches[0].ordered)
    check_against_oracle(planned, moves, contents)
    for rank in range(2):
        ok(core.execute(ReportRank(job_id=planned.job_id, rank=rank, ok=True)))
    assert planned.job_id not in core.state.jobs
    assert not any(core.state.engines[ENGINE].pools[0].pins)
    assert replay_matches(core)


def test_I15_unsafe_copies_are_refused() -> None:
    """Overlapping destinations have no parallel meaning; out-of-block and null-block copies
    would read or write the wrong memory."""
    core, (a, b, c), _ = copy_setup(3)
    cases = [
        ([Move(a, 0, c, 0, 32), Move(b, 0, c, 16, 32)], Reason.OVERLAPPING_DESTINATIONS),
        ([Move(a, 40, b, 0, 32)], Reason.OUT_OF_BOUNDS),
        ([Move(a, 0, b, 48, 32)], Reason.OUT_OF_BOUNDS),
        ([Move(BlockRef(0, 0, 0), 0, b, 0, 32)], Reason.NULL_BLOCK),
    ]
    for moves, reason in cases:
        rejected(core, PlanStateCopy(engine_id=ENGINE, pool_id=0, moves=moves), Refused, reason)
    assert replay_matches(core)


# --- I16 fencing -----------------------------------------------------------------------------------


def test_I16_reset_fences_jobs_and_keeps_published_keys() -> None:
    """A reset aborts the old incarnation's store; its late report is dropped; old block
    references stay stale; keys published before the reset stay loadable."""
    core = new_core()
    begin(core)
    [published_key] = publish(core, TOKENS[:4])
    own = owner(core)
    blocks = allocate(core, own, 1)
    [key] = compute(core, own, blocks, TOKENS[4:8])
    job = start_store(core, blocks)
    ok(core.execute(ReportRank(job_id=job.job_id, rank=0, ok=True, checksums=[checksum(key, 0)])))
    free_slots = len(core.state.tiers[TIER].free)

    events = ok(core.execute(ResetCache(engine_id=ENGINE)))
    assert [type(e) for e in events] == [JobFenced, EngineReset]
    assert isinstance(events[0], JobFenced) and events[0].job_id == job.job_id
    assert core.state.engines[ENGINE].incarnation == 2
    tier = core.state.tiers[TIER]
    pool = core.state.engines[ENGINE].pools[0]
    # Rank 1 has not reported: its transfer may still be landing, so the block stays pinned and
    # the tier slot reserved, in the new incarnation too (I3, I16).
    assert pool.status(blocks[0].block_id) is SlotStatus.DRAINING and len(tier.free) == free_slots
    late = ReportRank(job_id=job.job_id, rank=1, ok=True, checksums=[checksum(key, 1)])
    assert core.execute(late) == [FencedRankDone(job_id=job.job_id, rank=1)]  # its result counts for nothing
    assert tier.entry(0, key) is None and len(tier.free) == free_slots + 1, "nothing published, the slot given back"
    assert pool.status(blocks[0].block_id) is SlotStatus.FREE
    rejected(core, late, NoticeDropped, Reason.STALE_JOB)  # a repeat is a plain stale report

    begin(core)
    fresh = owner(core)
    every_block = allocate(core, fresh, 15)
    [again] = [ref for ref in every_block if ref.block_id == blocks[0].block_id]
    assert again.generation == blocks[0].generation + 1
    mark = MarkComputed(engine_id=ENGINE, owner_id=fresh, blocks=blocks, token_ids=TOKENS[4:8])
    rejected(core, mark, Refused, Reason.STALE_GENERATION)
    [looked] = ok(core.execute(LookupPrefix(engine_id=ENGINE, tier=TIER, token_ids=TOKENS[:8])))
    assert isinstance(looked, PrefixLookedUp) and looked.boundary == 4
    assert looked.hits[0].keys == [published_key]
    assert replay_matches(core)


def test_I16_restart_fences_loads_and_releases_their_leases_when_every_rank_is_done() -> None:
    """Declaring the engine again is a restart: its load is fenced. Its ranks may still be
    reading the key and writing the destination, so the lease and the pin stay until each rank
    has reported; then both go, and nothing of the load counts."""
    core = new_core()
    begin(core)
    [key] = publish(core, TOKENS[:4])
    dest = allocate(core, owner(core), 1)
    [load] = ok(core.execute(StartLoad(engine_id=ENGINE, tier=TIER, items=[LoadRequest(key, dest[0])])))
    assert isinstance(load, LoadJobStarted)
    assert core.state.tiers[TIER].entry(0, key).leases  # type: ignore[union-attr]

    restart = DeclareEngine(engine_id=ENGINE, namespace=namespace(), pools=[attention_pool()], world_size=2, tiers=[TIER])
    events = ok(core.execute(restart))
    assert [type(e) for e in events][:2] == [JobFenced, EngineReset]
    assert core.state.engines[ENGINE].incarnation == 2
    pool = core.state.engines[ENGINE].pools[0]
    for rank in (0, 1):
        assert core.state.tiers[TIER].entry(0, key).leases  # type: ignore[union-attr]
        assert pool.status(dest[0].block_id) is SlotStatus.DRAINING
        late = ReportRank(job_id=load.job_id, rank=rank, ok=True, checksums=[checksum(key, rank)])
        assert core.execute(late) == [FencedRankDone(job_id=load.job_id, rank=rank)]
    assert core.state.tiers[TIER].entry(0, key).leases is None  # type: ignore[union-attr]
    assert pool.status(dest[0].block_id) is SlotStatus.FREE and pool.keys[dest[0].block_id] is None
    rejected(core, late, NoticeDropped, Reason.STALE_JOB)
    assert replay_matches(core)


# --- I17 visible only when complete ----------------------------------------------------------------


def test_I17_destination_being_loaded_is_not_computed_until_the_load_succeeds() -> None:
    """Nobody may reuse, store or overwrite a block whose load is still in flight."""
    core = new_core()
    begin(core)
    [key] = publish(core, TOKENS[:4])
    loader, other = owner(core, "req-1"), owner(core, "req-2")
    [dest] = allocate(core, loader, 1)
    [load] = ok(core.execute(StartLoad(engine_id=ENGINE, tier=TIER, items=[LoadRequest(key, dest)])))
    assert isinstance(load, LoadJobStarted)

    rejected(core, ReuseBlocks(engine_id=ENGINE, owner_id=other, blocks=[dest]), Refused, Reason.NOT_COMPUTED)
    rejected(core, StartStore(engine_id=ENGINE, tier=TIER, blocks=[dest]), Refused, Reason.NOT_COMPUTED)
    mark = MarkComputed(engine_id=ENGINE, owner_id=loader, blocks=[dest], token_ids=TOKENS[:4])
    rejected(core, mark, Refused, Reason.SLOT_PINNED)

    events = report_all(core, load.job_id, [key])
    assert isinstance(events[-1], JobSucceeded)
    assert core.state.engines[ENGINE].pools[0].keys[dest.block_id] == key
    assert isinstance(ok(core.execute(ReuseBlocks(engine_id=ENGINE, owner_id=other, blocks=[dest])))[0], BlocksReused)
    assert replay_matches(core)


def test_I17_state_copy_destination_is_no_longer_a_hit() -> None:
    """A computed block that a state copy is overwriting stops being reusable at once."""
    core = new_core([state_pool(pool_id=0)])
    begin(core)
    own, other = owner(core, "req-1"), owner(core, "req-2")
    source, dest = allocate(core, own, 2)
    compute(core, own, [source, dest], list(range(16)))
    ok(core.execute(PlanStateCopy(engine_id=ENGINE, pool_id=0, moves=[Move(source, 0, dest, 0, 64)])))
    rejected(core, ReuseBlocks(engine_id=ENGINE, owner_id=other, blocks=[dest]), Refused, Reason.NOT_COMPUTED)
    assert isinstance(ok(core.execute(ReuseBlocks(engine_id=ENGINE, owner_id=other, blocks=[source])))[0], BlocksReused)
    assert replay_matches(core)


# --- I18 determinism -------------------------------------------------------------------------------


def eventful_core() -> CoordinatorCore:
    """A run that touches most folds: stores, a load, a quarantine, a copy, evictions,
    encoder entries, refusals, dropped notices and a reset; it ends mid-step with jobs in flight."""
    core = new_core([attention_pool(), state_pool()], tier_slots=4, encoder_cache_tokens=64)
    begin(core, clock=1.0)
    keys = publish(core, TOKENS[:8])
    ok(core.execute(AllocateEncoderEntry(engine_id=ENGINE, entry_id="img", num_tokens=16)))
    own = owner(core)
    dest = allocate(core, own, 2)
    [load] = ok(core.execute(StartLoad(engine_id=ENGINE, tier=TIER, items=[LoadRequest(keys[0], dest[0])], lease_seconds=5)))
    assert isinstance(load, LoadJobStarted)
    core.execute(ReportRank(job_id=load.job_id, rank=0, ok=True, checksums=[b"bad"]))
    core.execute(ReportRank(job_id=load.job_id, rank=1, ok=True, checksums=[checksum(keys[0], 1)]))
    core.execute(ReportRank(job_id=load.job_id, rank=1, ok=True))  # stale
    ok(core.execute(FreeEncoderEntry(engine_id=ENGINE, entry_id="img")))
    end_events(core)
    begin(core, clock=2.0)
    publish(core, list(range(300, 316)))  # evicts
    states = allocate(core, own, 2, pool_id=1)
    ok(core.execute(PlanStateCopy(engine_id=ENGINE, pool_id=1, moves=[Move(states[0], 0, states[1], 0, 8)])))
    core.execute(AllocateBlocks(engine_id=ENGINE, owner_id=own, pool_id=0, count=99))  # refused
    ok(core.execute(FreeBlocks(engine_id=ENGINE, owner_id=own, blocks=dest)))
    end_events(core)
    ok(core.execute(ResetCache(engine_id=ENGINE)))
    begin(core, clock=3.0)
    after_reset = owner(core)
    blocks = allocate(core, after_reset, 1)
    compute(core, after_reset, blocks, TOKENS[:4])
    ok(core.execute(StartStore(engine_id=ENGINE, tier=TIER, blocks=blocks)))
    return core


def test_I18_the_same_events_always_project_to_the_same_bytes() -> None:
    """Replay is the audit: the live state, and every replay of its log, are byte-identical."""
    core = eventful_core()
    assert any(isinstance(e, (Refused, NoticeDropped)) for e in core.events)
    assert any(isinstance(e, KeyEvicted) for e in core.events)
    first = encode_state(project(core.events))
    second = encode_state(project(list(core.events)))
    assert first == second == encode_state(core.state)
    assert replay_matches(core)


def test_I18_snapshot_plus_tail_equals_a_full_replay() -> None:
    """A snapshot taken anywhere (mid-step, jobs in flight), decoded and folded with the rest
    of the log, gives the full replay byte for byte."""
    core = eventful_core()
    full = encode_state(project(core.events))
    assert core.state.jobs  # the run ends with work in flight
    for cut in range(len(core.events) + 1):
        snapshot = encode_state(project(core.events[:cut]))
        restored = decode_state(snapshot)
        assert encode_state(restored) == snapshot
        assert encode_state(project(core.events[cut:], restored)) == full, f"cut at event {cut}"


def test_compacting_a_free_list_keeps_its_order_and_the_snapshot_bytes() -> None:
    """coordinator.core.state.removed rebuilds a dict-as-ordered-set after many removals from its
    front (CPython's holes made each allocation walk them). The rebuild must change nothing a
    replay or a snapshot can see: the same slots in the same order, the same encoded bytes."""
    import msgspec

    from coordinator.core.state import PoolState, removed

    pool = PoolState.new(attention_pool(num_blocks=5000))
    expected = list(pool.free)
    rebuilt = 0
    for _ in range(4000):
        first = next(iter(pool.free))
        del pool.free[first]
        expected.pop(0)
        before = pool.free
        removed(pool, "free")
        rebuilt += pool.free is not before
        assert list(pool.free) == expected
    assert rebuilt >= 3, "the set was never rebuilt"
    twin = PoolState.new(attention_pool(num_blocks=5000))
    twin.free = dict.fromkeys(expected)
    assert msgspec.msgpack.encode(pool) == msgspec.msgpack.encode(twin)


def test_I16_a_job_fenced_by_an_older_log_lets_go_at_once() -> None:
    """JobFenced events written before `pending` existed fold as they did then: the job lets go
    of its slots at once (a newer fold must not pin them forever)."""
    core = new_core()
    begin(core)
    own = owner(core)
    blocks = allocate(core, own, 1)
    compute(core, own, blocks, TOKENS[4:8])
    job = start_store(core, blocks)
    old_style = [*core.events, JobFenced(job_id=job.job_id)]
    state = project(old_style)
    assert job.job_id not in state.jobs and job.job_id not in state.fenced
    assert state.engines[ENGINE].pools[0].pins[blocks[0].block_id] == 0
