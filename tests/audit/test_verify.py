"""`verify`: replaying a log and checking every invariant it can show (coordinator/audit/verify.py).

Unit tests drive the real pure core (tests/kit/builders.py), with one protection switched off where
the coordinator must be made to write the faulty event (coordinator/core/protections.py), or edit one
event of an honest run where no protection produces the fault; each asserts the check fires with
its invariant at the offending event's sequence, and stays quiet on the honest variant.

Golden logs: every simulator scenario (coordinator/simulator/scenarios.py) verifies clean with
its protection on, apart from what its baseline switches off in both runs (LEASES off in
eviction-under-store-pressure leaves a real I12 violation: a leased key is evicted; the checksum
it tests then catches the wrong read). With the protection off, verify finds the incident under
the scenario's invariant, except in the runs that leave no trace in the log (`NO_TRACE`):

* req-id-reuse-after-preemption (I4): the naive connector resolves "chat-7 finished" to the
  resumed owner before its command reaches the decider; the log records a well-formed finish
  of owner 2, indistinguishable from the resumed request really finishing.
* duplicate-keys-in-batch-load (I11): a worker-side fault. The naive batch get fills only the
  first destination of a repeated key and reports the read's checksum for every item: the
  reports are complete and match the published checksums.
* partial-hash-hit (I7): the scenario's lookup uses the read-only fast path (the sidecar's
  Lookup), which is recorded nowhere, and a content key does not record how many tokens it
  covers, so the load's mix of boundaries (attention to 48 tokens, state at 32) is invisible.
  The same lookup made as a LookupPrefix command in a step is recorded and caught (I7 below).
* store-reported-before-copy-fence (I5): a worker-side fault. Each rank reported success with
  the checksum of the source as it was; the copy that ran later is nowhere in the log.
* reset-keeps-offloaded-blocks (I16): the log holds the reset (EngineReset), but not that it
  asked for the tier's keys too (ResetCache.drop_tier_keys is a command's field): a reset that
  keeps the tier is a legitimate choice, and a later load of a key published before it looks
  like one.
* truncated-multimodal-hash (I8): extra keys are hashed into the content key and never logged,
  so two images' keys that collide look like one prompt's.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import anyio
import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from coordinator.audit.verify import Verifier, copy_plan_problems
from coordinator.audit.verify_run import VerifyProgress, VerifyReport, verify_log
from coordinator.core import CoordinatorCore
from coordinator.core.commands import (
    AllocateBlocks,
    AllocateEncoderEntry,
    EndStep,
    FinishOwner,
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
    StartStore,
)
from coordinator.core.copy_plan import PlannedMove, overlapping_destinations, plan_copies
from coordinator.core.describe import describe
from coordinator.core.protections import Protection
from coordinator.core.state import state_digest
from coordinator.simulator.report import ALL_SCENARIOS, mixed_workload
from coordinator.simulator.scenarios import run_scenario
from events import (
    BlockRef,
    BlocksAllocated,
    BlocksComputed,
    BlocksReused,
    CopyOp,
    EngineReset,
    Event,
    EventCodec,
    FencedRankDone,
    JobFailed,
    JobSucceeded,
    KeyEvicted,
    KeyPublished,
    KeyQuarantined,
    LoadItem,
    LoadJobStarted,
    NamespaceRegistered,
    NoticeDropped,
    PoolSpec,
    PrefixLookedUp,
    RankReported,
    Refused,
    Region,
    StateCopyPlanned,
    StepEnded,
    StoreJobStarted,
)
from events.log import AppendBatch, PendingEvent, open_log
from tests.kit import external
from tests.kit.builders import (
    ENGINE,
    TIER,
    allocate,
    attention_pool,
    begin,
    checksum,
    compute,
    end,
    new_core,
    ok,
    owner,
    publish,
    report_all,
    start_store,
    state_pool,
)

TOKENS = list(range(100, 116))  # four attention blocks of 4 tokens, two state blocks of 8
NO_TRACE = {
    "req-id-reuse-after-preemption",
    "duplicate-keys-in-batch-load",
    "partial-hash-hit",
    "store-reported-before-copy-fence",
    "reset-keeps-offloaded-blocks",
    "truncated-multimodal-hash",
}


# --- helpers -----------------------------------------------------------------------------------------


def verified(events: Sequence[Event], *, snapshot_at: int = 0, max_violations: int = 10_000) -> Verifier:
    """Every event at global sequence index + 1, on the test engine's stream; then finish()."""
    verifier = Verifier(snapshot_at=snapshot_at, max_violations=max_violations)
    for seq, event in enumerate(events, 1):
        verifier.event(event, seq, ENGINE)
    verifier.finish()
    return verifier


def found(events: Sequence[Event]) -> list[tuple[str, int]]:
    return [(v.invariant, v.seq) for v in verified(events).violations]


def seq_of(events: Sequence[Event], kind: type[Event], nth: int = 0) -> int:
    """The global sequence (1-based) of the nth event of this type."""
    return [index for index, event in enumerate(events, 1) if isinstance(event, kind)][nth]


def core_with(
    *off: Protection, pools: Sequence[PoolSpec] | None = None, tier_slots: int = 16, encoder_cache_tokens: int = 0
) -> CoordinatorCore:
    """A core (tests/builders.new_core) deciding with these protections off."""
    return new_core(
        pools,
        tier_slots=tier_slots,
        encoder_cache_tokens=encoder_cache_tokens,
        core=CoordinatorCore(protections_off=frozenset(off)),
    )


def off_unless(protection_on: bool, protection: Protection, *baseline: Protection) -> tuple[Protection, ...]:
    """What a run switches off: the baseline, and `protection` unless it is on."""
    return baseline if protection_on else (*baseline, protection)


def recorded(core: CoordinatorCore) -> set[str]:
    """What kvledger did instead, as the simulator's tally names it ("Refused:pool_exhausted")."""
    return {
        f"{type(e).__name__}:{e.reason}" if not isinstance(e, FencedRankDone) else "FencedRankDone"
        for e in core.events
        if isinstance(e, Refused | NoticeDropped | JobFailed | KeyQuarantined | FencedRankDone)
    }


def replaced(events: Sequence[Event], seq: int, event: Event) -> list[Event]:
    return [event if index == seq else e for index, e in enumerate(events, 1)]


def computed(
    core: CoordinatorCore, tokens: list[int], req_id: str = "req", pool_id: int = 0
) -> tuple[int, list[BlockRef], list[bytes]]:
    size = core.state.engines[ENGINE].pools[pool_id].spec.block_size
    own = owner(core, req_id)
    blocks = allocate(core, own, len(tokens) // size, pool_id)
    return own, blocks, compute(core, own, blocks, tokens)


def load(core: CoordinatorCore, keys: list[bytes], dests: list[BlockRef], lease_seconds: float = 30.0) -> LoadJobStarted:
    items = [LoadRequest(key, dest) for key, dest in zip(keys, dests, strict=True)]
    [event] = ok(core.execute(StartLoad(engine_id=ENGINE, tier=TIER, items=items, lease_seconds=lease_seconds)))
    assert isinstance(event, LoadJobStarted)
    return event


# --- a clean run -------------------------------------------------------------------------------------


def test_an_honest_run_touching_every_kind_of_event_verifies_clean_and_replays_byte_for_byte() -> None:
    core = new_core([attention_pool(), state_pool()], encoder_cache_tokens=16)
    begin(core)
    attention_keys = publish(core, TOKENS, pool_id=0)
    state_keys = publish(core, TOKENS, pool_id=1)
    [looked] = ok(core.execute(LookupPrefix(engine_id=ENGINE, tier=TIER, token_ids=TOKENS)))
    assert isinstance(looked, PrefixLookedUp) and looked.boundary == 16
    reader = owner(core, "reader")
    dests = allocate(core, reader, 4)
    job = load(core, attention_keys, dests)
    report_all(core, job.job_id, attention_keys)
    other = owner(core, "other")
    ok(core.execute(ReuseBlocks(engine_id=ENGINE, owner_id=other, blocks=dests[:2])))
    a, b, c = allocate(core, other, 3)
    ok(core.execute(PlanStateCopy(engine_id=ENGINE, pool_id=0, moves=[Move(a, 0, b, 0, 64), Move(b, 0, c, 0, 64)])))
    copy = core.state.next_job_id - 1
    for rank in (0, 1):
        ok(core.execute(ReportRank(job_id=copy, rank=rank, ok=True)))
    ok(core.execute(AllocateEncoderEntry(engine_id=ENGINE, entry_id="img", num_tokens=8)))
    ok(core.execute(FinishOwner(engine_id=ENGINE, owner_id=other)))
    end(core)
    begin(core, clock=1.0)
    ok(core.execute(FreeEncoderEntry(engine_id=ENGINE, entry_id="img")))
    in_flight = start_store(core, computed(core, TOKENS[:8], "late")[1])
    end(core)
    ok(core.execute(ResetCache(engine_id=ENGINE)))  # fences the store
    report_all(core, in_flight.job_id, [item.key for item in in_flight.items])  # late: FencedRankDone
    begin(core, clock=2.0)
    load(core, state_keys[1:], allocate(core, owner(core, "again"), 1, pool_id=1))
    end(core)

    verifier = verified(core.events, snapshot_at=len(core.events) // 2)
    assert verifier.violations == []
    assert verifier.events_checked == len(core.events)
    assert state_digest(verifier.state) == state_digest(core.state)
    assert verifier.finish().ok


# --- I1 generations, I2 the null block ------------------------------------------------------------------


def test_I1_an_allocation_that_does_not_bump_the_generation_by_one_is_flagged() -> None:
    core = new_core()
    begin(core)
    computed(core, TOKENS[:4])
    events = core.events
    at = seq_of(events, BlocksAllocated)
    honest = events[at - 1]
    assert isinstance(honest, BlocksAllocated)
    assert found(events) == []
    skipped = msgspec.structs.replace(honest, blocks=[BlockRef(0, 1, 2)])
    # The compute that follows names generation 1, now stale: flagged too.
    assert found(replaced(events, at, skipped)) == [("I1", at), ("I1", at + 1)]


def test_I1_a_reuse_naming_a_stale_generation_is_flagged() -> None:
    core = new_core()
    begin(core)
    _, blocks, _ = computed(core, TOKENS[:4])
    ok(core.execute(ReuseBlocks(engine_id=ENGINE, owner_id=owner(core, "second"), blocks=blocks)))
    events = core.events
    at = seq_of(events, BlocksReused)
    assert found(events) == []
    stale = msgspec.structs.replace(events[at - 1], blocks=[BlockRef(0, blocks[0].block_id, 0)])
    assert found(replaced(events, at, stale)) == [("I1", at)]


def test_I1_a_key_published_at_another_generation_than_its_slots_or_outside_the_tier_is_flagged() -> None:
    """The state keeps one generation a tier slot (TierState.generations): a publication names the
    one its store reserved the slot at, and a slot the tier has."""
    core = new_core()
    begin(core)
    publish(core, TOKENS[:4])
    events = core.events
    at = seq_of(events, KeyPublished)
    assert found(events) == []
    other_generation = msgspec.structs.replace(events[at - 1], tier_generation=7)
    assert found(replaced(events, at, other_generation)) == [("I1", at)]
    outside = msgspec.structs.replace(events[at - 1], tier_slot=10_000)
    assert [v for v in found(replaced(events, at, outside)) if v[1] == at] == [("I5", at), ("I1", at)]
    negative = msgspec.structs.replace(events[at - 1], tier_slot=-1)  # never a row counted from the end
    assert ("I1", at) in found(replaced(events, at, negative))


def test_I2_a_null_state_computed_stored_and_published_is_flagged_at_each_event() -> None:
    for protection_on in (True, False):
        core = core_with(*off_unless(protection_on, Protection.NULL_STATES), pools=[state_pool(pool_id=0)])
        begin(core)
        own = owner(core)
        [last] = allocate(core, own, 1)
        null = BlockRef(0, 0, 0)
        events = core.execute(MarkComputed(engine_id=ENGINE, owner_id=own, blocks=[null, last], token_ids=TOKENS))
        if any(isinstance(e, BlocksComputed) for e in events):
            store = start_store(core, [null, last])
            report_all(core, store.job_id, [item.key for item in store.items])
        got = found(core.events)
        if protection_on:
            assert got == []
            assert "Refused:null_block" in recorded(core)
        else:
            assert got == [
                ("I2", seq_of(core.events, BlocksComputed)),
                ("I2", seq_of(core.events, StoreJobStarted)),
                ("I2", seq_of(core.events, KeyPublished)),
            ]


def test_I2_allocating_the_null_block_is_flagged() -> None:
    core = new_core()
    begin(core)
    computed(core, TOKENS[:4])
    at = seq_of(core.events, BlocksAllocated)
    null = msgspec.structs.replace(core.events[at - 1], blocks=[BlockRef(0, 0, 1)])
    assert ("I2", at) in found(replaced(core.events, at, null))


# --- I3 pins ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("protection_on", [True, False])
def test_I3_a_slot_under_a_store_in_flight_allocated_again_is_flagged(protection_on: bool) -> None:
    core = core_with(*off_unless(protection_on, Protection.PINS), pools=[attention_pool(num_blocks=3)])
    begin(core)
    own, blocks, _ = computed(core, TOKENS[:8])
    store = start_store(core, blocks)
    ok(core.execute(FinishOwner(engine_id=ENGINE, owner_id=own, reason="preempted")))
    core.execute(AllocateBlocks(engine_id=ENGINE, owner_id=owner(core, "next"), pool_id=0, count=2))  # refused if pinned
    report_all(core, store.job_id, [item.key for item in store.items])
    assert ("Refused:pool_exhausted" in recorded(core)) == protection_on
    assert found(core.events) == ([] if protection_on else [("I3", seq_of(core.events, BlocksAllocated, 1))])


# --- I4 job identity, I16 fencing ---------------------------------------------------------------------------


def test_I4_reports_for_finished_jobs_duplicates_and_early_successes_are_flagged() -> None:
    core = new_core()
    begin(core)
    _, [a, b], _ = computed(core, TOKENS[:8])
    ok(core.execute(PlanStateCopy(engine_id=ENGINE, pool_id=0, moves=[Move(a, 0, b, 0, 64)])))
    job = core.state.next_job_id - 1
    for rank in (0, 1):
        ok(core.execute(ReportRank(job_id=job, rank=rank, ok=True)))
    events = list(core.events)
    assert found(events) == []
    first, second = seq_of(events, RankReported, 0), seq_of(events, RankReported, 1)
    late = [*events, RankReported(job_id=job, rank=1, ok=True, checksums=[])]
    assert found(late) == [("I4", len(late))]
    twice = [*events[:first], events[first - 1], *events[first:]]
    assert found(twice) == [("I4", first + 1)]
    early = [*events[: second - 1], *events[second:]]  # rank 1 never reported
    assert found(early) == [("I4", seq_of(early, JobSucceeded))]


@pytest.mark.parametrize("protection_on", [True, False])
def test_I16_an_unfenced_reset_and_the_old_jobs_late_results_are_flagged(protection_on: bool) -> None:
    core = core_with(*off_unless(protection_on, Protection.FENCING))
    begin(core)
    store = start_store(core, computed(core, TOKENS[:8])[1])
    end(core)
    ok(core.execute(ResetCache(engine_id=ENGINE)))
    begin(core, clock=1.0)
    allocate(core, owner(core, "fresh"), 2)  # the same slots when the reset dropped the pins
    report_all(core, store.job_id, [item.key for item in store.items])
    events = core.events
    got = found(events)
    if protection_on:
        assert got == [] and "FencedRankDone" in recorded(core)
        return
    reports = [seq_of(events, RankReported, n) for n in (0, 1)]
    published = [seq_of(events, KeyPublished, n) for n in (0, 1)]
    assert got == [
        ("I16", seq_of(events, EngineReset)),
        ("I3", seq_of(events, BlocksAllocated, 1)),
        *(("I16", seq) for seq in reports),
        *(("I16", seq) for seq in published),
        ("I16", seq_of(events, JobSucceeded)),
    ]


def test_I16_a_fenced_jobs_report_that_counts_is_flagged() -> None:
    core = new_core()
    begin(core)
    store = start_store(core, computed(core, TOKENS[:4])[1])
    end(core)
    ok(core.execute(ResetCache(engine_id=ENGINE)))
    counted = [*core.events, RankReported(job_id=store.job_id, rank=0, ok=True, checksums=[b"x"])]
    assert found(counted) == [("I16", len(counted))]


# --- I5 publish after success, I10 idempotent store -----------------------------------------------------------


def test_I5_a_publication_that_does_not_match_the_reports_is_flagged() -> None:
    core = new_core()
    begin(core)
    publish(core, TOKENS[:4])
    events = core.events
    at = seq_of(events, KeyPublished)
    assert found(events) == []
    forged = msgspec.structs.replace(events[at - 1], checksums=[b"forged", b"forged"])
    assert found(replaced(events, at, forged)) == [("I5", at)]
    early = [*events[: at - 2], events[at - 1], events[at - 2], *events[at:]]  # published before rank 1 reported
    assert ("I5", at - 1) in found(early)


@pytest.mark.parametrize("protection_on", [True, False])
def test_I10_a_re_store_with_other_bytes_that_replaces_the_key_is_flagged(protection_on: bool) -> None:
    core = core_with(*off_unless(protection_on, Protection.IDEMPOTENT_STORE))
    begin(core)
    first = start_store(core, computed(core, TOKENS[:4], "a")[1])
    second = start_store(core, computed(core, TOKENS[:4], "b")[1])  # the same key, stored again at once
    [key] = [item.key for item in first.items]
    report_all(core, first.job_id, [key])
    for rank in (0, 1):
        core.execute(ReportRank(job_id=second.job_id, rank=rank, ok=True, checksums=[b"other bytes"]))
    got = found(core.events)
    assert got == ([] if protection_on else [("I10", seq_of(core.events, KeyPublished, 1))])
    assert ("KeyQuarantined:checksum_mismatch" in recorded(core)) == protection_on


# --- I12 leases, I13 checksums, I11 every destination verified ------------------------------------------------


@pytest.mark.parametrize("protection_on", [True, False])
def test_I12_a_load_that_completes_after_its_lease_is_flagged(protection_on: bool) -> None:
    core = core_with(*off_unless(protection_on, Protection.LEASES, Protection.CHECKSUMS))
    begin(core)
    [key] = publish(core, TOKENS[:4])
    job = load(core, [key], allocate(core, owner(core, "reader"), 1), lease_seconds=1.0)
    end(core)
    begin(core, clock=5.0)
    report_all(core, job.job_id, [key])
    assert found(core.events) == ([] if protection_on else [("I12", seq_of(core.events, JobSucceeded, 1))])
    assert ("JobFailed:lease_expired" in recorded(core)) == protection_on


@pytest.mark.parametrize("protection_on", [True, False])
def test_I12_an_eviction_of_a_leased_key_is_flagged(protection_on: bool) -> None:
    core = core_with(*off_unless(protection_on, Protection.LEASES, Protection.CHECKSUMS), tier_slots=1)
    begin(core)
    [key] = publish(core, TOKENS[:4])
    load(core, [key], allocate(core, owner(core, "reader"), 1))
    core.execute(StartStore(engine_id=ENGINE, tier=TIER, blocks=computed(core, TOKENS[4:8], "writer")[1]))
    assert found(core.events) == ([] if protection_on else [("I12", seq_of(core.events, KeyEvicted))])
    assert ("Refused:tier_full" in recorded(core)) == protection_on


@pytest.mark.parametrize("expired", [True, False], ids=["expired on its engine", "live on its engine"])
def test_I12_a_lease_is_read_on_the_clock_of_the_engine_whose_load_holds_it(expired: bool) -> None:
    """Engines' clocks have bases of their own (an adversarial review, session 31). Another
    engine's eviction of the key is flagged I12 exactly when the lease is live on the loading
    engine's clock, whatever the evicting engine's clock says; the decider evicts exactly then
    (coordinator/core/tier_slots.py lease_live). A log of kvledger before session 31, which read
    leases on the evicting engine's clock, can be flagged here where it was not."""
    core = new_core(tier_slots=1)
    new_core(core=core, engine_id="engine-b", tenant="tenant-b")
    begin(core, clock=1e6)
    [leased] = publish(core, TOKENS[:4])
    load(core, [leased], allocate(core, owner(core, "reader"), 1))
    end(core)
    begin(core, clock=1e6 + (31.0 if expired else 1.0))
    end(core)
    begin(core, clock=1e9 if not expired else 1.0, engine_id="engine-b")  # far ahead, or far behind
    own = owner(core, "writer", engine_id="engine-b")
    blocks = allocate(core, own, 1, engine_id="engine-b")
    compute(core, own, blocks, [7] * 4, engine_id="engine-b")
    events = core.execute(StartStore(engine_id="engine-b", tier=TIER, blocks=blocks))
    evicted = [e.key for e in events if isinstance(e, KeyEvicted)]
    assert evicted == ([leased] if expired else []), events
    assert found(core.events) == []  # the decider's eviction is never flagged
    if not expired:  # the same eviction forced into the log: live on the loader's clock, flagged
        [refused] = events
        slot = core.state.tiers[TIER].published[0][leased]
        forced = KeyEvicted(tier=TIER, pool_id=0, key=leased, tier_slot=slot, engine_id="engine-b")
        at = core.events.index(refused) + 1
        assert found(replaced(core.events, at, forced)) == [("I12", at)]


@pytest.mark.parametrize("protection_on", [True, False])
def test_I13_a_load_whose_reads_differ_from_the_published_checksums_is_flagged(protection_on: bool) -> None:
    core = core_with(*off_unless(protection_on, Protection.CHECKSUMS))
    begin(core)
    [key] = publish(core, TOKENS[:4])
    job = load(core, [key], allocate(core, owner(core, "reader"), 1))
    for rank in (0, 1):
        core.execute(ReportRank(job_id=job.job_id, rank=rank, ok=True, checksums=[b"what the slot held"]))
    assert found(core.events) == ([] if protection_on else [("I13", seq_of(core.events, JobSucceeded, 1))])
    assert ("JobFailed:checksum_mismatch" in recorded(core)) == protection_on


def test_I11_a_load_that_succeeds_with_a_destination_unverified_is_flagged() -> None:
    core = new_core()
    begin(core)
    [key] = publish(core, TOKENS[:4])
    job = load(core, [key, key], allocate(core, owner(core, "reader"), 2))  # one key, two destinations
    report_all(core, job.job_id, [key, key])
    events = core.events
    assert found(events) == []
    at = seq_of(events, RankReported, 3)
    short = msgspec.structs.replace(events[at - 1], checksums=[checksum(key, 1)])
    assert found(replaced(events, at, short)) == [("I11", seq_of(events, JobSucceeded, 1))]


# --- I14 end-of-step truth ------------------------------------------------------------------------------


@pytest.mark.parametrize("protection_on", [True, False])
def test_I14_a_freed_notice_for_an_entry_allocated_again_in_the_step_is_flagged(protection_on: bool) -> None:
    core = core_with(*off_unless(protection_on, Protection.END_OF_STEP), encoder_cache_tokens=16)
    begin(core)
    entry = AllocateEncoderEntry(engine_id=ENGINE, entry_id="img", num_tokens=8)
    ok(core.execute(entry))
    end(core)
    begin(core)
    ok(core.execute(FreeEncoderEntry(engine_id=ENGINE, entry_id="img")))
    ok(core.execute(entry))
    core.execute(EndStep(engine_id=ENGINE))
    assert found(core.events) == ([] if protection_on else [("I14", seq_of(core.events, StepEnded, 1))])
    assert ("NoticeDropped:reallocated_in_step" in recorded(core)) == protection_on


def test_I14_a_freed_block_notice_for_a_block_allocated_again_is_flagged() -> None:
    core = new_core()
    begin(core)
    own, blocks, _ = computed(core, TOKENS[:4])
    ok(core.execute(FinishOwner(engine_id=ENGINE, owner_id=own)))
    allocate(core, owner(core, "next"), 1)  # takes a clean free slot, not the cached one
    end(core)
    events = core.events
    at = seq_of(events, StepEnded)
    assert found(events) == []
    honest = events[at - 1]
    assert isinstance(honest, StepEnded)
    taken = core.state.owners[max(core.state.owners)].blocks[0]
    [(block_id, generation)] = taken.items()
    lying = msgspec.structs.replace(honest, freed_blocks=[*honest.freed_blocks, BlockRef(0, block_id, generation)])
    assert found(replaced(events, at, lying)) == [("I14", at)]


# --- I6, I7 lookups, I9 namespaces, I17 visible when complete ------------------------------------------------


@pytest.mark.parametrize("protection_on", [True, False])
def test_I7_a_recorded_lookup_that_stops_inside_a_reuse_unit_is_flagged(protection_on: bool) -> None:
    core = core_with(*off_unless(protection_on, Protection.WHOLE_UNITS), pools=[attention_pool(), state_pool()])
    begin(core)
    publish(core, TOKENS[:12], pool_id=0)
    publish(core, TOKENS[:8], pool_id=1)
    [looked] = ok(core.execute(LookupPrefix(engine_id=ENGINE, tier=TIER, token_ids=TOKENS[:12])))
    assert isinstance(looked, PrefixLookedUp) and looked.boundary == (8 if protection_on else 12)
    assert found(core.events) == ([] if protection_on else [("I7", len(core.events))])


def test_I6_a_recorded_hit_missing_a_group_or_naming_an_unpublished_key_is_flagged() -> None:
    core = new_core([attention_pool(), state_pool()])
    begin(core)
    publish(core, TOKENS, pool_id=0)
    publish(core, TOKENS, pool_id=1)
    [looked] = ok(core.execute(LookupPrefix(engine_id=ENGINE, tier=TIER, token_ids=TOKENS)))
    assert isinstance(looked, PrefixLookedUp) and found(core.events) == []
    at = len(core.events)
    attention_only = msgspec.structs.replace(looked, hits=[hit for hit in looked.hits if hit.pool_id == 0])
    assert found(replaced(core.events, at, attention_only)) == [("I6", at)]
    forged = msgspec.structs.replace(
        looked, hits=[msgspec.structs.replace(looked.hits[0], keys=[b"unknown"] * 4), looked.hits[1]]
    )
    assert found(replaced(core.events, at, forged)) == [("I6", at)] * 4


@pytest.mark.parametrize("protection", [None, Protection.NAMESPACE_TENANT, Protection.NAMESPACE_WEIGHTS])
def test_I9_a_namespace_id_that_leaves_out_the_tenant_or_the_weights_is_flagged(protection: Protection | None) -> None:
    core = core_with(*([] if protection is None else [protection]))
    verifier = verified(core.events)
    if protection is None:
        assert verifier.violations == []
        return
    [violation] = verifier.violations
    assert (violation.invariant, violation.seq) == ("I9", seq_of(core.events, NamespaceRegistered))
    assert ("tenant" if protection is Protection.NAMESPACE_TENANT else "weights_revision") in violation.message


def test_I9_a_load_of_another_namespaces_key_is_flagged() -> None:
    core = new_core()
    new_core(core=core, engine_id="engine-b", tenant="tenant-b")
    begin(core)
    [key] = publish(core, TOKENS[:4])
    begin(core, engine_id="engine-b")
    dest = allocate(core, owner(core, "b", "engine-b"), 1, engine_id="engine-b")[0]
    foreign = LoadJobStarted(
        job_id=core.state.next_job_id,
        engine_id="engine-b",
        incarnation=1,
        tier=TIER,
        world_size=2,
        items=[LoadItem(key, 0, 1, dest, [checksum(key, 0), checksum(key, 1)])],
        lease_expires_at=30.0,
    )
    events = [*core.events, foreign]
    assert found(events) == [("I9", len(events))]


@pytest.mark.parametrize("protection_on", [True, False])
def test_I17_a_ref_on_a_block_whose_load_has_not_landed_is_flagged(protection_on: bool) -> None:
    core = core_with(*off_unless(protection_on, Protection.VISIBLE_WHEN_COMPLETE))
    begin(core)
    [key] = publish(core, TOKENS[:4])
    [dest] = allocate(core, owner(core, "reader"), 1)
    load(core, [key], [dest])
    core.execute(ReuseBlocks(engine_id=ENGINE, owner_id=owner(core, "early"), blocks=[dest]))
    assert found(core.events) == ([] if protection_on else [("I17", seq_of(core.events, BlocksReused))])
    assert ("Refused:not_computed" in recorded(core)) == protection_on


# --- I15 ordered copies -----------------------------------------------------------------------------------


def _region(block: int | None, offset: int, length: int) -> Region:
    return Region(None if block is None else BlockRef(0, block, 1), offset, length)


def test_I15_sound_plans_pass_and_each_kind_of_unsound_plan_is_named() -> None:
    chain = [PlannedMove(_region(1, 0, 32), _region(2, 0, 32)), PlannedMove(_region(2, 0, 32), _region(3, 0, 32))]
    swap = [PlannedMove(_region(1, 0, 32), _region(2, 0, 32)), PlannedMove(_region(2, 0, 32), _region(1, 0, 32))]
    shift = [PlannedMove(_region(1, 4, 24), _region(1, 0, 24))]
    for moves in (chain, swap, shift):
        assert copy_plan_problems(plan_copies(moves)[0]) == []
    naive = [[CopyOp(move.src, move.dst, False)] for move in chain]
    assert "reads" in copy_plan_problems(naive)[0]
    together = [[CopyOp(move.src, move.dst, False) for move in chain]]
    assert "another copy of the same batch" in copy_plan_problems(together)[0]
    assert "memmove" in copy_plan_problems([[CopyOp(shift[0].src, shift[0].dst, False)]])[0]
    assert "scratch" in copy_plan_problems([[CopyOp(_region(None, 0, 32), _region(2, 0, 32), False)]])[0]
    clash = [[CopyOp(_region(1, 0, 32), _region(3, 0, 32), False)], [CopyOp(_region(2, 0, 32), _region(3, 16, 16), False)]]
    assert "writes" in copy_plan_problems(clash)[0]


@st.composite
def _move_sets(draw: st.DrawFn) -> list[PlannedMove]:
    moves: list[PlannedMove] = []
    for _ in range(draw(st.integers(1, 8))):
        length = draw(st.integers(1, 16))
        move = PlannedMove(
            _region(draw(st.integers(1, 4)), draw(st.integers(0, 32 - length)), length),
            _region(draw(st.integers(1, 4)), draw(st.integers(0, 32 - length)), length),
        )
        if overlapping_destinations([*moves, move]) is None:
            moves.append(move)
    return moves


@settings(max_examples=100, deadline=None)
@given(_move_sets())
def test_I15_every_plan_the_planner_makes_passes(moves: list[PlannedMove]) -> None:
    assert copy_plan_problems(plan_copies(moves)[0]) == []


@pytest.mark.parametrize("protection_on", [True, False])
def test_I15_a_plan_run_in_the_given_order_is_flagged(protection_on: bool) -> None:
    core = core_with(*off_unless(protection_on, Protection.ORDERED_COPIES))
    begin(core)
    _, [a, b, c], _ = computed(core, TOKENS[:12])
    ok(core.execute(PlanStateCopy(engine_id=ENGINE, pool_id=0, moves=[Move(a, 0, b, 0, 64), Move(b, 0, c, 0, 64)])))
    assert found(core.events) == ([] if protection_on else [("I15", seq_of(core.events, StateCopyPlanned))])


# --- I18 determinism, and the verifier's own limits ----------------------------------------------------------


def test_I18_the_resumed_replay_matches_and_a_stored_snapshot_that_differs_is_flagged() -> None:
    core = new_core()
    begin(core)
    publish(core, TOKENS[:8])
    end(core)
    events = core.events
    for snapshot_at in (0, 1, len(events) // 2, len(events), len(events) + 10):
        verifier = verified(events, snapshot_at=snapshot_at)
        assert verifier.violations == [] and verifier.finish().ok
    middle = len(events) // 2
    right = Verifier(stored_digests={middle: state_digest(verified(events[:middle]).state)})
    wrong = Verifier(stored_digests={middle: "0" * 64})
    for verifier in (right, wrong):
        for seq, event in enumerate(events, 1):
            verifier.event(event, seq, ENGINE)
    assert right.violations == [] and right.finish().stored_snapshots_checked == 1
    assert [(v.invariant, v.seq) for v in wrong.violations] == [("I18", middle)]


def test_I18_an_event_the_projector_cannot_fold_is_flagged_and_verification_goes_on() -> None:
    core = new_core()
    begin(core)
    publish(core, TOKENS[:4])
    ghost = KeyEvicted(tier=TIER, pool_id=0, key=b"never published", tier_slot=7, engine_id=ENGINE)
    events = [*core.events, ghost, *core.events[-1:]]
    verifier = verified(events)
    assert [(v.invariant, v.seq) for v in verifier.violations][0] == ("I18", len(events) - 1)
    assert verifier.events_checked == len(events)


def test_violations_beyond_the_limit_are_counted_not_kept() -> None:
    core = new_core()
    begin(core)
    events = [*core.events, *(RankReported(job_id=99, rank=0, ok=True, checksums=[]) for _ in range(5))]
    verifier = verified(events, max_violations=2)
    assert len(verifier.violations) == 2 and verifier.violation_count == 5
    assert verifier.violations[0].evidence[0].startswith(f"seq {len(core.events) + 1}: ")


# --- verify_log over a real log --------------------------------------------------------------------------------


def test_verify_log_streams_a_log_names_each_violation_and_skips_what_it_cannot_decode(tmp_path: Path) -> None:
    core = core_with(Protection.PINS, pools=[attention_pool(num_blocks=3)])
    begin(core)
    own, blocks, _ = computed(core, TOKENS[:8])
    start_store(core, blocks)
    ok(core.execute(FinishOwner(engine_id=ENGINE, owner_id=own)))
    allocate(core, owner(core, "next"), 2)
    core.execute(EndStep(engine_id=ENGINE))  # the freed notices are dropped: the slots are taken again
    codec = EventCodec()

    def pending(index: int, event_type: str, payload: bytes) -> PendingEvent:
        return PendingEvent(
            event_id=f"e{index}", step=1, recorded_at=0.0, event_type=event_type, schema_version=1, payload=payload
        )

    rows = []
    for index, event in enumerate(core.events):
        event_type, _, payload = codec.encode(event)
        rows.append(pending(index, event_type, payload))
    rows.insert(3, pending(99, "from_the_future", b"\x80"))

    async def run() -> tuple[VerifyReport, list[VerifyProgress]]:
        event_log = await open_log(str(tmp_path / "log.sqlite"))
        try:
            for version, row in enumerate(rows):
                await event_log.append([AppendBatch(stream_id=f"engine/{ENGINE}", expected_version=version, events=[row])])
            progress: list[VerifyProgress] = []
            return await verify_log(event_log, on_progress=progress.append), progress
        finally:
            await event_log.close()

    report, progress = anyio.run(run)
    assert report.undecodable == [4] and report.events_checked == len(core.events) == report.head - 1
    allocation = seq_of(core.events, BlocksAllocated, 1) + 1  # one sequence later: the skipped event
    assert [(v.invariant, v.seq, v.engine, v.step) for v in report.violations] == [("I3", allocation, ENGINE, 1)]
    [store] = [e for e in core.events if isinstance(e, StoreJobStarted)]
    assert report.violations[0].evidence[1].endswith(describe(store))
    assert not report.ok and report.replay.ok and report.by_invariant() == {"I3": 1}
    assert progress[-1] == VerifyProgress(report.head, report.head, 1)


# --- golden simulator logs ----------------------------------------------------------------------------------


def _verify_file(path: Path) -> VerifyReport:
    async def run() -> VerifyReport:
        event_log = await open_log(str(path))
        try:
            return await verify_log(event_log)
        finally:
            await event_log.close()

    return anyio.run(run)


@pytest.mark.parametrize("name", sorted(ALL_SCENARIOS))
def test_golden_each_scenario_verifies_clean_on_and_its_incident_is_found_off(name: str, tmp_path: Path) -> None:
    scenario = ALL_SCENARIOS[name]
    reports = {}
    for protection_on in (True, False):
        where = tmp_path / ("on" if protection_on else "off")
        where.mkdir()
        outcome = anyio.run(lambda: run_scenario(scenario, protection_on=protection_on, directory=where))
        reports[protection_on] = _verify_file(Path(outcome.log))
    on, off = reports[True], reports[False]
    # On: nothing, except what the baseline (off in both runs) lets through, never the scenario's own.
    allowed = {ALL_SCENARIOS[p.value].invariant for p in scenario.baseline}
    assert on.replay.ok and off.replay.ok and on.replay.stored_snapshots_checked == 1
    assert {v.invariant for v in on.violations} <= allowed, on.violations
    assert scenario.invariant not in {v.invariant for v in on.violations}
    if not scenario.baseline:
        assert on.ok
    seen = {v.invariant for v in off.violations}
    if name in NO_TRACE:
        assert scenario.invariant not in seen, f"verify now sees {name} off: take it out of NO_TRACE"
    else:
        assert scenario.invariant in seen, f"{name} off: {off.violations}"
        assert all(v.evidence and v.evidence[0].startswith(f"seq {v.seq}: ") for v in off.violations)


def test_golden_the_mixed_workload_verifies_clean(tmp_path: Path) -> None:
    report = anyio.run(lambda: mixed_workload(engines=2, steps=60, keep=tmp_path))
    assert report.wrong_reads == 0
    verified_log = _verify_file(tmp_path / "log.sqlite")
    assert verified_log.violations == [] and verified_log.ok, verified_log.violations[:5]
    assert verified_log.events_checked == verified_log.head == report.events
    assert verified_log.replay.snapshot_seq == verified_log.head // 2


# --- an external engine's jobs (vLLM's offloading: issue 19, item 6) ------------------------------------


def _external_run(*off: Protection) -> tuple[CoordinatorCore, list[Event]]:
    """An engine that owns its blocks (tests/kit/external.py) on a 3-slot tier: stores that publish,
    a load that verifies, a load whose rank read other bytes, a store that evicts, a load whose
    lease runs out, and a store still in flight when the engine resets its cache and the tier's."""
    core = external.core_with(tier_slots=3, core=CoordinatorCore(protections_off=frozenset(off)))
    external.publish(core, 1, 2)
    good = external.load(core, 1)
    for rank in range(external.WORLD):
        external.report(core, good, rank)
    bad = external.load(core, 2)
    external.report(core, bad, 0)
    external.report(core, bad, 1, checksums=[b"other bytes"])  # a mismatch: I13
    end(core)
    begin(core, clock=1.0)
    external.publish(core, 3, 4)  # the tier is full: the least recently used unleased key goes
    slow = external.load(core, 3, lease_seconds=5.0)
    end(core)
    begin(core, clock=10.0)
    for rank in range(external.WORLD):  # after the lease expired
        external.report(core, slow, rank)
    late = external.store(core, 5)
    external.report(core, late, 0)
    end(core)
    core.execute(ResetCache(engine_id=ENGINE, drop_tier_keys=True))  # the tier's keys end too
    begin(core, clock=11.0)
    external.report(core, late, 1)  # after the reset: fenced (I16)
    end(core)
    return core, core.events


def test_an_external_engines_stores_and_loads_verify_clean() -> None:
    """`kvledger verify` after a vLLM run: the stores and loads of an engine that owns its blocks
    are stores and loads in flight (verify flagged every key they published as an I5 violation)."""
    core, events = _external_run()
    assert {type(e) for e in events} >= {KeyPublished, KeyEvicted, KeyQuarantined, JobSucceeded, JobFailed, EngineReset}
    verifier = verified(events)
    assert verifier.violations == []
    assert state_digest(verifier.state) == state_digest(core.state)


@pytest.mark.parametrize(
    ("off", "invariant"),
    [(Protection.CHECKSUMS, "I13"), (Protection.LEASES, "I12"), (Protection.FENCING, "I16")],
)
def test_an_external_engines_unsafe_jobs_are_flagged(off: Protection, invariant: str) -> None:
    """The same run with one protection off: what it lets through is found in the log."""
    _, events = _external_run(off, *((Protection.CHECKSUMS,) if off is Protection.LEASES else ()))
    assert invariant in {v.invariant for v in verified(events).violations}


def test_a_failed_load_keeps_only_what_every_rank_verified() -> None:
    """JobFailed.kept (issue 19, item 7): the first item verified on both ranks and is kept, the
    second did not. The log as decided verifies clean; the same log claiming both kept does not."""
    core = external.core_with()
    external.publish(core, 1, 2)
    job = external.load(core, 1, 2)
    external.report(core, job, 0)
    external.report(core, job, 1, ok_=False, checksums=[job.items[0].checksums[1], b"other bytes"])
    [failed] = [e for e in core.events if isinstance(e, JobFailed)]
    assert failed.kept == 1
    assert verified(core.events).violations == []
    forged = [msgspec.structs.replace(e, kept=2) if e is failed else e for e in core.events]
    assert [(v.invariant, "keeps item 1" in v.message) for v in verified(forged).violations] == [("I13", True)]
