"""Invariants of tiers, keys and lookups: I5-I13 of DESIGN.md.

Every test drives the real pure core (CoordinatorCore.execute) and checks the emitted events and
the folded state. Device-slot and log invariants live in test_invariants_blocks.py.
"""

from __future__ import annotations

import os
import subprocess
import sys
from typing import TypeVar

import msgspec

from coordinator.core import CoordinatorCore
from coordinator.core.commands import (
    DeclareEngine,
    LoadRequest,
    LookupPrefix,
    ReleaseNamespace,
    ReportRank,
    ResetCache,
    StartLoad,
    StartStore,
)
from coordinator.core.keys import chain_keys, content_key, namespace_id
from coordinator.core.protections import Protection
from coordinator.core.state import SlotStatus, TierState
from events import (
    BlockRef,
    Event,
    JobFailed,
    JobSucceeded,
    KeyEvicted,
    KeyPublished,
    KeyQuarantined,
    LoadJobStarted,
    PoolSpec,
    PrefixLookedUp,
    RankReported,
    Reason,
    Refused,
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
    state_bytes,
    state_pool,
)

TOKENS = list(range(100, 116))  # four attention blocks of 4 tokens, two state blocks of 8
HYBRID = [attention_pool(), state_pool()]
E = TypeVar("E", bound=Event)


def lookup(core: CoordinatorCore, tokens: list[int], engine_id: str = ENGINE) -> PrefixLookedUp:
    [event] = ok(core.execute(LookupPrefix(engine_id=engine_id, tier=TIER, token_ids=tokens)))
    assert isinstance(event, PrefixLookedUp)
    return event


def load(core: CoordinatorCore, requests: list[tuple[bytes, BlockRef]], lease_seconds: float = 30.0) -> LoadJobStarted:
    items = [LoadRequest(key, dest) for key, dest in requests]
    [event] = ok(core.execute(StartLoad(engine_id=ENGINE, tier=TIER, items=items, lease_seconds=lease_seconds)))
    assert isinstance(event, LoadJobStarted)
    return event


def report(core: CoordinatorCore, job_id: int, rank: int, checksums: list[bytes], ok_: bool = True) -> list[Event]:
    return ok(core.execute(ReportRank(job_id=job_id, rank=rank, ok=ok_, checksums=checksums)))


def computed_blocks(core: CoordinatorCore, tokens: list[int], req_id: str = "req") -> tuple[list[BlockRef], list[bytes]]:
    own = owner(core, req_id)
    blocks = allocate(core, own, len(tokens) // 4)
    return blocks, compute(core, own, blocks, tokens)


def of_type(events: list[Event], kind: type[E]) -> list[E]:
    return [e for e in events if isinstance(e, kind)]


# --- I5 publish after success ----------------------------------------------------------------------


def test_I5_a_failed_rank_never_publishes() -> None:
    """A store that failed on one rank leaves the key absent: not loadable, not a hit."""
    core = new_core()
    begin(core)
    blocks, [key] = computed_blocks(core, TOKENS[:4])
    job = start_store(core, blocks)
    report(core, job.job_id, 0, [checksum(key, 0)])
    events = report(core, job.job_id, 1, [], ok_=False)
    assert [type(e) for e in events] == [RankReported, JobFailed]
    assert events[-1].reason == Reason.RANK_FAILED  # type: ignore[attr-defined]
    assert not of_type(core.events, KeyPublished)
    assert core.state.tiers[TIER].entry(0, key) is None and len(core.state.tiers[TIER].free) == 16
    assert lookup(core, TOKENS[:4]).boundary == 0
    dest = allocate(core, owner(core, "reader"), 1)[0]
    rejected(core, StartLoad(engine_id=ENGINE, tier=TIER, items=[LoadRequest(key, dest)]), Refused, Reason.KEY_NOT_PUBLISHED)
    assert core.state.engines[ENGINE].pools[0].pins[blocks[0].block_id] == 0
    assert replay_matches(core)


def test_I5_missing_checksums_never_publish() -> None:
    """ok=True without a checksum (none, or an empty one) is not a verified store."""
    for rank1_checksums in ([], [b""]):
        core = new_core()
        begin(core)
        blocks, [key] = computed_blocks(core, TOKENS[:4])
        job = start_store(core, blocks)
        report(core, job.job_id, 0, [checksum(key, 0)])
        events = report(core, job.job_id, 1, rank1_checksums)
        assert isinstance(events[-1], JobFailed) and events[-1].reason == Reason.MISSING_CHECKSUM
        assert core.state.tiers[TIER].entry(0, key) is None
        assert lookup(core, TOKENS[:4]).boundary == 0
        assert replay_matches(core)


def test_I5_partial_reports_do_not_publish() -> None:
    """With only rank 0 reported the key is invisible; the last rank's report publishes it."""
    core = new_core()
    begin(core)
    blocks, [key] = computed_blocks(core, TOKENS[:4])
    job = start_store(core, blocks)
    report(core, job.job_id, 0, [checksum(key, 0)])
    assert core.state.tiers[TIER].entry(0, key) is None
    assert lookup(core, TOKENS[:4]).boundary == 0
    events = report(core, job.job_id, 1, [checksum(key, 1)])
    [published] = of_type(events, KeyPublished)
    assert published.checksums == [checksum(key, 0), checksum(key, 1)]
    assert lookup(core, TOKENS[:4]).boundary == 4
    assert replay_matches(core)


# --- I6 all groups valid ---------------------------------------------------------------------------


def test_I6_a_hit_needs_a_key_in_every_group() -> None:
    """Hybrid engine: attention keys alone are no hit; with the state keys the longest
    boundary where both groups have keys is returned, with what each group would load."""
    core = new_core(HYBRID)
    begin(core)
    attention_keys = publish(core, TOKENS, pool_id=0)
    assert lookup(core, TOKENS).boundary == 0
    state_keys = publish(core, TOKENS, pool_id=1)
    looked = lookup(core, TOKENS)
    assert (looked.boundary, looked.reuse_unit) == (16, 8)
    assert {hit.pool_id: hit.keys for hit in looked.hits} == {0: attention_keys, 1: state_keys[1:]}
    assert replay_matches(core)


def test_I6_the_shortest_group_bounds_the_hit() -> None:
    """Attention keys reach 8 tokens and state keys 16: the hit is 8."""
    core = new_core(HYBRID)
    begin(core)
    attention_keys = publish(core, TOKENS[:8], pool_id=0)
    state_keys = publish(core, TOKENS, pool_id=1)
    looked = lookup(core, TOKENS)
    assert looked.boundary == 8
    assert {hit.pool_id: hit.keys for hit in looked.hits} == {0: attention_keys, 1: state_keys[:1]}
    assert replay_matches(core)


# --- I7 whole units --------------------------------------------------------------------------------


def test_I7_hits_are_whole_reuse_units() -> None:
    """Attention keys cover 12 tokens, state keys 8; the unit is lcm(4, 8) = 8, so 12 tokens
    give boundary 8, never 12."""
    core = new_core(HYBRID)
    begin(core)
    publish(core, TOKENS[:12], pool_id=0)
    publish(core, TOKENS[:8], pool_id=1)
    looked = lookup(core, TOKENS[:12])
    assert (looked.boundary, looked.reuse_unit) == (8, 8)
    assert replay_matches(core)


def test_I7_seed_002_partial_match_inside_a_unit_is_no_hit() -> None:
    """Seed 002 geometry (64-token hash blocks, 1152-token state blocks): a prompt that shares
    only part of a 1152-token unit with a stored one gets no hit for that unit."""
    pools = [
        PoolSpec(pool_id=0, kind="attention", num_blocks=40, block_size=64, bytes_per_block=64),
        PoolSpec(pool_id=1, kind="state", num_blocks=4, block_size=1152, bytes_per_block=64),
    ]
    core = new_core(pools, tier_slots=64)
    begin(core)
    stored = list(range(2304))
    publish(core, stored, pool_id=0)
    publish(core, stored, pool_id=1)
    assert lookup(core, stored).boundary == 2304

    diverges_in_second_unit = stored[: 1152 + 640] + [-1] * (2304 - 1152 - 640)
    looked = lookup(core, diverges_in_second_unit)
    assert (looked.boundary, looked.reuse_unit) == (1152, 1152)
    assert [len(hit.keys) for hit in looked.hits] == [18, 1]

    shares_one_hash_block = stored[:64] + [-1] * (1152 - 64)
    assert lookup(core, shares_one_hash_block).boundary == 0
    assert replay_matches(core)


# --- I8 chained identity ---------------------------------------------------------------------------


def test_I8_keys_chain_the_parent_and_include_extra_keys() -> None:
    """A block's key depends on every earlier token, on the namespace and on extra keys."""
    core = new_core()
    begin(core)
    own = owner(core)
    together = compute(core, own, allocate(core, own, 2), TOKENS[:8])
    [first] = compute(core, own, allocate(core, own, 1), TOKENS[:4])
    [second] = compute(core, own, allocate(core, own, 1), TOKENS[4:8], parent_key=first)
    assert together == [first, second]
    ns = core.state.engines[ENGINE].namespace_id
    assert second == content_key(ns, first, TOKENS[4:8])
    assert together == chain_keys(ns, TOKENS[:8], 4)
    assert chain_keys(ns, [0] + TOKENS[1:8], 4)[1] != second  # the parent changed
    assert content_key(ns, first, TOKENS[4:8], ["lora:adapter-1"]) != second
    assert content_key(ns, first, TOKENS[4:8], ["salt:x"]) != content_key(ns, first, TOKENS[4:8], ["salt:y"])
    assert replay_matches(core)


def test_I8_another_namespace_gives_other_keys() -> None:
    """The same tokens under another weights revision or tenant never share a key or a hit."""
    core = new_core()
    begin(core)
    keys = publish(core, TOKENS[:8])
    for engine_id, spec in (("engine-w", namespace(weights_revision="sha256:9999")), ("engine-t", namespace("tenant-b"))):
        ok(core.execute(DeclareEngine(engine_id=engine_id, namespace=spec, pools=[attention_pool()], world_size=2, tiers=[TIER])))
        begin(core, engine_id=engine_id)
        own = owner(core, engine_id=engine_id)
        other_keys = compute(core, own, allocate(core, own, 2, engine_id=engine_id), TOKENS[:8], engine_id=engine_id)
        assert not set(other_keys) & set(keys)
        assert lookup(core, TOKENS[:8], engine_id).boundary == 0
    assert replay_matches(core)


def test_I8_content_keys_agree_across_processes() -> None:
    """The chain seed is fixed: another interpreter (another hash seed) computes the same bytes."""
    script = (
        "from coordinator.core.keys import content_key, namespace_id; from tests.kit.builders import namespace; "
        "ns = namespace_id(namespace()); "
        "print(ns.hex(), content_key(ns, bytes(range(16)), [1, 2, 3, 4], ['lora:a']).hex())"
    )
    env = {**os.environ, "PYTHONHASHSEED": "12345"}
    result = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        check=True,
        env=env,
        cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
    )
    ns = namespace_id(namespace())
    assert result.stdout.split() == [ns.hex(), content_key(ns, bytes(range(16)), [1, 2, 3, 4], ["lora:a"]).hex()]


# --- I9 isolation ----------------------------------------------------------------------------------


def two_tenants() -> tuple[CoordinatorCore, list[bytes]]:
    """engine-a (tenant-a) has published TOKENS; engine-b (tenant-b) shares the tier."""
    core = new_core()
    new_core(core=core, tenant="tenant-b", engine_id="engine-b")
    begin(core)
    begin(core, engine_id="engine-b")
    return core, publish(core, TOKENS)


def test_I9_another_tenant_key_reads_exactly_like_an_absent_one() -> None:
    """Seed 003: tenant-b naming tenant-a's key learns nothing, not even that it exists."""
    core, keys = two_tenants()
    own = owner(core, engine_id="engine-b")
    [dest] = allocate(core, own, 1, engine_id="engine-b")
    absent = bytes(16)

    def refusal(key: bytes) -> Refused:
        command = StartLoad(engine_id="engine-b", tier=TIER, items=[LoadRequest(key, dest)])
        event = rejected(core, command, Refused, Reason.KEY_NOT_PUBLISHED)
        assert isinstance(event, Refused)
        return event

    foreign, missing = refusal(keys[0]), refusal(absent)
    assert foreign.reason == missing.reason
    assert foreign.detail.replace(keys[0].hex(), "<key>") == missing.detail.replace(absent.hex(), "<key>")
    assert replay_matches(core)


def test_I9_another_tenant_lookup_misses() -> None:
    """Identical tokens from another tenant are no hit."""
    core, _ = two_tenants()
    assert lookup(core, TOKENS).boundary == 4 * 4
    assert (lookup(core, TOKENS, "engine-b").boundary, lookup(core, TOKENS, "engine-b").hits) == (0, [])
    assert replay_matches(core)


def test_I9_quarantine_of_another_tenant_key_does_not_leak() -> None:
    """Even a quarantined foreign key reads as not published, not as quarantined."""
    core, keys = two_tenants()
    dest = allocate(core, owner(core), 1)[0]
    job = load(core, [(keys[0], dest)])
    report(core, job.job_id, 0, [b"wrong"])
    report(core, job.job_id, 1, [checksum(keys[0], 1)])
    assert core.state.tiers[TIER].entry(0, keys[0]).quarantined  # type: ignore[union-attr]
    foreign_dest = allocate(core, owner(core, engine_id="engine-b"), 1, engine_id="engine-b")[0]
    command = StartLoad(engine_id="engine-b", tier=TIER, items=[LoadRequest(keys[0], foreign_dest)])
    rejected(core, command, Refused, Reason.KEY_NOT_PUBLISHED)
    assert replay_matches(core)


# --- I10 idempotent store --------------------------------------------------------------------------


def test_I10_restoring_a_published_key_is_an_idempotent_skip() -> None:
    """Mooncake #3135: re-offloading a persisted key is a skip, not a second object."""
    core = new_core()
    begin(core)
    [key] = publish(core, TOKENS[:4])
    entry_before = core.state.tiers[TIER].entry(0, key)
    free_before = len(core.state.tiers[TIER].free)
    blocks, _ = computed_blocks(core, TOKENS[:4], "again")
    events = ok(core.execute(StartStore(engine_id=ENGINE, tier=TIER, blocks=blocks)))
    started, succeeded = events
    assert isinstance(started, StoreJobStarted) and (started.items, started.already_published) == ([], [key])
    assert isinstance(succeeded, JobSucceeded) and succeeded.job_id == started.job_id
    assert core.state.tiers[TIER].entry(0, key) == entry_before
    assert len(core.state.tiers[TIER].free) == free_before
    assert core.state.engines[ENGINE].pools[0].pins[blocks[0].block_id] == 0
    assert replay_matches(core)


def test_I10_racing_stores_with_the_same_checksums_are_a_no_op() -> None:
    """Two stores of one key in flight (Mooncake #2827): the second, with equal bytes, succeeds
    without touching the published entry and gives its reserved slot back."""
    core = new_core()
    begin(core)
    first_blocks, [key] = computed_blocks(core, TOKENS[:4], "req-1")
    second_blocks, _ = computed_blocks(core, TOKENS[:4], "req-2")
    first, second = start_store(core, first_blocks), start_store(core, second_blocks)
    assert len(first.items) == len(second.items) == 1
    report_all(core, first.job_id, [key])
    entry = core.state.tiers[TIER].entry(0, key)
    events = report_all(core, second.job_id, [key])
    assert [type(e) for e in events] == [RankReported, RankReported, JobSucceeded]
    assert core.state.tiers[TIER].entry(0, key) == entry and not entry.quarantined  # type: ignore[union-attr]
    assert len(core.state.tiers[TIER].free) == 15
    assert replay_matches(core)


def test_I10_racing_stores_with_other_checksums_quarantine_the_key() -> None:
    """Same key, other bytes: someone stored the wrong KV; the key is no longer served."""
    core = new_core()
    begin(core)
    first_blocks, [key] = computed_blocks(core, TOKENS[:4], "req-1")
    second_blocks, _ = computed_blocks(core, TOKENS[:4], "req-2")
    first, second = start_store(core, first_blocks), start_store(core, second_blocks)
    report_all(core, first.job_id, [key])
    report(core, second.job_id, 0, [checksum(key, 0)])
    events = report(core, second.job_id, 1, [b"other bytes"])
    [quarantined] = of_type(events, KeyQuarantined)
    assert quarantined.reason == Reason.CHECKSUM_MISMATCH and quarantined.key == key
    dest = allocate(core, owner(core, "reader"), 1)[0]
    rejected(core, StartLoad(engine_id=ENGINE, tier=TIER, items=[LoadRequest(key, dest)]), Refused, Reason.KEY_QUARANTINED)
    assert lookup(core, TOKENS[:4]).boundary == 0
    assert replay_matches(core)


def test_I10_a_skipped_key_is_not_evicted_by_the_same_store() -> None:
    """A store that reports a key as already published (idempotent success) must not evict
    that very key to make room for the rest of the job: the engine would trust a key that
    is gone."""
    core = new_core(tier_slots=2)
    begin(core)
    [kept, other] = publish(core, TOKENS[:8])  # `kept` is least recently used
    blocks, keys = computed_blocks(core, TOKENS[:4] + TOKENS[8:12], "again")
    assert keys[0] == kept
    events = ok(core.execute(StartStore(engine_id=ENGINE, tier=TIER, blocks=blocks)))
    [started] = of_type(events, StoreJobStarted)
    assert started.already_published == [kept]
    assert kept not in [e.key for e in of_type(events, KeyEvicted)]
    assert core.state.tiers[TIER].entry(0, kept) is not None
    assert core.state.tiers[TIER].entry(0, other) is None  # the only other candidate went
    assert replay_matches(core)


# --- I11 duplicate keys in one load ----------------------------------------------------------------


def test_I11_the_same_key_twice_fills_and_verifies_both_destinations() -> None:
    """Mooncake #3929: a batch get naming one key twice must write both buffers."""
    core = new_core()
    begin(core)
    [key] = publish(core, TOKENS[:4])
    first, second = allocate(core, owner(core, "reader"), 2)
    job = load(core, [(key, first), (key, second)])
    assert [(item.key, item.dest) for item in job.items] == [(key, first), (key, second)]
    events = report_all(core, job.job_id, [key, key])
    assert isinstance(events[-1], JobSucceeded)
    keys = core.state.engines[ENGINE].pools[0].keys
    assert keys[first.block_id] == keys[second.block_id] == key
    assert replay_matches(core)


def test_I11_a_checksum_for_only_the_first_occurrence_fails_the_load() -> None:
    """A rank that verified one occurrence of a duplicated key left the other unverified."""
    core = new_core()
    begin(core)
    [key] = publish(core, TOKENS[:4])
    first, second = allocate(core, owner(core, "reader"), 2)
    job = load(core, [(key, first), (key, second)])
    report(core, job.job_id, 0, [checksum(key, 0), checksum(key, 0)])
    events = report(core, job.job_id, 1, [checksum(key, 1)])
    assert isinstance(events[-1], JobFailed) and events[-1].reason == Reason.MISSING_CHECKSUM
    pool = core.state.engines[ENGINE].pools[0]
    assert pool.keys[first.block_id] is None and pool.keys[second.block_id] is None
    assert pool.pins[first.block_id] == pool.pins[second.block_id] == 0
    entry = core.state.tiers[TIER].entry(0, key)
    assert entry is not None and entry.leases is None and not entry.quarantined
    assert replay_matches(core)


# --- I12 leases ------------------------------------------------------------------------------------


def test_I12_eviction_skips_leased_keys_and_refuses_when_all_are_leased() -> None:
    """Seed 002: eviction under pressure takes the unleased key even when the leased one is
    older; with every published key leased (or being stored) the store is refused."""
    core = new_core(tier_slots=2)
    begin(core)
    [leased, unleased] = publish(core, TOKENS[:8])  # `leased` is least recently used
    end(core)
    begin(core, clock=1.0)
    dest = allocate(core, owner(core, "reader"), 1)[0]
    job = load(core, [(leased, dest)])
    blocks, [new_key] = computed_blocks(core, TOKENS[8:12])
    events = ok(core.execute(StartStore(engine_id=ENGINE, tier=TIER, blocks=blocks)))
    assert [e.key for e in of_type(events, KeyEvicted)] == [unleased]
    assert core.state.tiers[TIER].entry(0, leased) is not None

    more_blocks, _ = computed_blocks(core, TOKENS[12:16], "writer-2")
    rejected(core, StartStore(engine_id=ENGINE, tier=TIER, blocks=more_blocks), Refused, Reason.TIER_FULL)
    report_all(core, job.job_id, [leased])  # the load ends, its lease with it
    events = ok(core.execute(StartStore(engine_id=ENGINE, tier=TIER, blocks=more_blocks)))
    assert [e.key for e in of_type(events, KeyEvicted)] == [leased]
    assert core.state.tiers[TIER].entry(0, new_key) is None  # still being stored, never evicted
    assert replay_matches(core)


def test_I12_a_load_completing_after_its_lease_fails_loudly() -> None:
    """Reports arriving in a step whose clock is past the lease: the load never counts."""
    core = new_core()
    begin(core, clock=0.0)
    [key] = publish(core, TOKENS[:4])
    dest = allocate(core, owner(core, "reader"), 1)[0]
    job = load(core, [(key, dest)], lease_seconds=5.0)
    assert job.lease_expires_at == 5.0
    end(core)
    begin(core, clock=10.0)
    events = report_all(core, job.job_id, [key])
    assert isinstance(events[-1], JobFailed) and events[-1].reason == Reason.LEASE_EXPIRED
    pool = core.state.engines[ENGINE].pools[0]
    assert pool.keys[dest.block_id] is None and pool.status(dest.block_id) is SlotStatus.ALLOCATED
    assert core.state.tiers[TIER].entry(0, key).leases is None  # type: ignore[union-attr]
    assert replay_matches(core)


def test_I12_a_lease_is_read_on_the_clock_of_the_engine_whose_load_holds_it() -> None:
    """Engines' clocks have bases of their own. Another tenant's engine on the same tier, its
    clock far ahead, evicted every key a load of this engine still read (an adversarial review,
    session 31); and a lease that expired on its own engine's clock is not kept alive by an engine
    whose clock is behind."""
    core = new_core(tier_slots=2)
    new_core(core=core, engine_id="engine-b", tenant="tenant-b")
    begin(core, clock=0.0)
    [leased, unleased] = publish(core, TOKENS[:8])
    dest = allocate(core, owner(core, "reader"), 1)[0]
    job = load(core, [(leased, dest)], lease_seconds=30.0)
    end(core)
    begin(core, clock=1e17, engine_id="engine-b")  # a first step may set any finite clock
    own = owner(core, "writer", engine_id="engine-b")
    [first, second] = allocate(core, own, 2, engine_id="engine-b")
    compute(core, own, [first, second], [7] * 8, engine_id="engine-b")
    events = ok(core.execute(StartStore(engine_id="engine-b", tier=TIER, blocks=[first])))
    assert [e.key for e in of_type(events, KeyEvicted)] == [unleased]  # not the leased key
    rejected(core, StartStore(engine_id="engine-b", tier=TIER, blocks=[second]), Refused, Reason.TIER_FULL)
    end(core, engine_id="engine-b")
    begin(core, clock=31.0)  # the lease has expired on its own engine's clock
    end(core)
    begin(core, clock=1e17 + 1, engine_id="engine-b")
    events = ok(core.execute(StartStore(engine_id="engine-b", tier=TIER, blocks=[second])))
    assert [e.key for e in of_type(events, KeyEvicted)] == [leased]
    late = report_all(core, job.job_id, [leased])  # too late: the load fails (I12), it never counts
    assert isinstance(late[-1], JobFailed), late
    assert replay_matches(core)


def test_I10_a_block_stored_again_while_its_store_is_in_flight_takes_no_second_slot() -> None:
    """One computed block in 64 StartStore commands of one step took 64 slots of a shared tier
    until its engine reported (an adversarial review, session 31): a key on its way in is skipped,
    as a published one is."""
    core = new_core(tier_slots=16)
    new_core(core=core, engine_id="engine-b", tenant="tenant-b")
    begin(core)
    blocks, [key] = computed_blocks(core, TOKENS[:4])
    first = start_store(core, blocks)
    free = len(core.state.tiers[TIER].free)
    for _ in range(8):
        again = start_store(core, blocks)
        assert (again.items, again.already_published) == ([], [key])
    assert len(core.state.tiers[TIER].free) == free
    # Another engine's block of the same pool, id and generation is another block: it is stored.
    begin(core, engine_id="engine-b")
    own = owner(core, "b", engine_id="engine-b")
    theirs = allocate(core, own, 1, engine_id="engine-b")
    assert theirs == blocks
    compute(core, own, theirs, TOKENS[:4], engine_id="engine-b")
    assert len(start_store(core, theirs, engine_id="engine-b").items) == 1
    report_all(core, first.job_id, [key])
    assert core.state.tiers[TIER].entry(0, key) is not None
    assert replay_matches(core)


# --- I13 checksums always on -----------------------------------------------------------------------


def test_I13_a_load_checksum_mismatch_quarantines_the_key() -> None:
    """Seed 002 (checksum off by default): one rank's bytes differ from the published checksum;
    the load fails, the destination stays uncomputed and the key is never served again."""
    core = new_core()
    begin(core)
    [key] = publish(core, TOKENS[:4])
    reader = owner(core, "reader")
    dest, spare = allocate(core, reader, 2)
    job = load(core, [(key, dest)])
    report(core, job.job_id, 0, [checksum(key, 0)])
    events = report(core, job.job_id, 1, [b"corrupted"])
    assert [type(e) for e in events] == [RankReported, KeyQuarantined, JobFailed]
    assert events[1].reason == events[2].reason == Reason.CHECKSUM_MISMATCH  # type: ignore[attr-defined]
    assert core.state.engines[ENGINE].pools[0].keys[dest.block_id] is None
    rejected(core, StartLoad(engine_id=ENGINE, tier=TIER, items=[LoadRequest(key, spare)]), Refused, Reason.KEY_QUARANTINED)
    assert lookup(core, TOKENS[:4]).boundary == 0
    assert replay_matches(core)


def test_I13_a_load_that_fails_verification_keeps_the_blocks_before_the_first_bad_one() -> None:
    """Three keys loaded; one rank read other bytes for the second. The first stays loaded (it
    verified on every rank: JobFailed.kept = 1), the second is quarantined, and from it on the
    engine recomputes: vLLM's recovery is per block, and so is kvledger's answer."""
    core = new_core()
    begin(core)
    keys = publish(core, TOKENS[:12])
    dests = allocate(core, owner(core, "reader"), 3)
    job = load(core, list(zip(keys, dests, strict=True)))
    report(core, job.job_id, 0, [checksum(key, 0) for key in keys])
    events = report(core, job.job_id, 1, [checksum(keys[0], 1), b"corrupted", checksum(keys[2], 1)])
    [failed] = of_type(events, JobFailed)
    assert (failed.reason, failed.kept) == (Reason.CHECKSUM_MISMATCH, 1)
    assert [e.key for e in of_type(events, KeyQuarantined)] == [keys[1]]
    pool = core.state.engines[ENGINE].pools[0]
    assert [pool.keys[d.block_id] for d in dests] == [keys[0], None, None]
    assert replay_matches(core)


def test_I13_a_rank_that_fails_without_its_reads_keeps_nothing() -> None:
    """The other rank read other bytes for the last key, but this one failed without saying
    what it read (a tier file it could not open): what it copied is unknown, so nothing is kept."""
    core = new_core()
    begin(core)
    keys = publish(core, TOKENS[:8])
    dests = allocate(core, owner(core, "reader"), 2)
    job = load(core, list(zip(keys, dests, strict=True)))
    report(core, job.job_id, 0, [checksum(keys[0], 0), b"corrupted"], ok_=False)
    events = report(core, job.job_id, 1, [], ok_=False)
    [failed] = of_type(events, JobFailed)
    assert failed.kept == 0
    assert [core.state.engines[ENGINE].pools[0].keys[d.block_id] for d in dests] == [None, None]
    assert replay_matches(core)


# --- I12 / I13 layered: what each one alone still catches (the simulator's baselines) -------------


def _slow_load_of_an_evicted_key(off: frozenset[Protection]) -> tuple[CoordinatorCore, LoadJobStarted, bytes]:
    """A 2-slot tier full of r1's keys; a load of the first one (lease 5 s); at clock 1 another
    store needs both slots. Returns the core (step open at clock 1), the load, and its key."""
    core = new_core(tier_slots=2, core=CoordinatorCore(protections_off=off))
    begin(core)
    [key, other] = publish(core, TOKENS[:8])
    dest = allocate(core, owner(core, "reader"), 1)[0]
    job = load(core, [(key, dest)], lease_seconds=5.0)
    end(core)
    begin(core, clock=1.0)
    blocks, _ = computed_blocks(core, TOKENS[8:16], "writer")
    events = core.execute(StartStore(engine_id=ENGINE, tier=TIER, blocks=blocks))
    if Protection.LEASES in off:
        assert sorted(e.key for e in of_type(events, KeyEvicted)) == sorted([key, other])  # the lease is ignored
    else:
        assert [e.reason for e in of_type(events, Refused)] == [Reason.TIER_FULL]  # the leased key stays
    return core, job, key


def test_I12_off_a_load_of_a_key_evicted_under_it_counts_as_success_when_checksums_are_off_too() -> None:
    """Both layers down (seed 002's offload path, MOONCAKE_STORE_CHECKSUM unset): the key was
    evicted during the load, its slot reused, the lease is over and the bytes read are another
    key's, and still the load succeeds: the silent wrong read the scenarios show."""
    core, job, key = _slow_load_of_an_evicted_key(frozenset({Protection.LEASES, Protection.CHECKSUMS}))
    end(core)
    begin(core, clock=10.0)
    events = report_all(core, job.job_id, [b"another key's bytes"])
    assert isinstance(events[-1], JobSucceeded)
    assert core.state.engines[ENGINE].pools[0].keys[job.items[0].dest.block_id] == key
    assert replay_matches(core)


def test_I12_on_the_same_late_load_fails_with_lease_expired_even_with_checksums_off() -> None:
    core = new_core(tier_slots=2, core=CoordinatorCore(protections_off=frozenset({Protection.CHECKSUMS})))
    begin(core)
    [key] = publish(core, TOKENS[:4])
    dest = allocate(core, owner(core, "reader"), 1)[0]
    job = load(core, [(key, dest)], lease_seconds=5.0)
    end(core)
    begin(core, clock=10.0)
    events = report_all(core, job.job_id, [b"another key's bytes"])
    assert isinstance(events[-1], JobFailed) and events[-1].reason == Reason.LEASE_EXPIRED
    assert core.state.engines[ENGINE].pools[0].keys[dest.block_id] is None
    assert replay_matches(core)


def test_I13_with_leases_off_a_mismatch_on_an_evicted_key_fails_the_load_and_quarantines_nothing() -> None:
    """Leases off: the key left the tier during the load. Its read is checked against the
    checksums in the decision, by the worker (a failed report) or by the coordinator (an ok
    report with other checksums); either way the load fails with CHECKSUM_MISMATCH, and the
    key, gone, is not quarantined."""
    for worker_noticed in (True, False):
        core, job, key = _slow_load_of_an_evicted_key(frozenset({Protection.LEASES}))
        assert core.state.tiers[TIER].entry(0, key) is None
        events = report_all(core, job.job_id, [b"another key's bytes"], ok_=not worker_noticed)
        assert isinstance(events[-1], JobFailed) and events[-1].reason == Reason.CHECKSUM_MISMATCH
        assert not of_type(events, KeyQuarantined)
        assert core.state.engines[ENGINE].pools[0].keys[job.items[0].dest.block_id] is None
        assert replay_matches(core)


def test_I13_with_leases_off_a_load_of_an_evicted_key_that_read_the_right_bytes_succeeds() -> None:
    """The decision's checksums are the reference once the key is gone: bytes that match them
    are the key's bytes."""
    core, job, key = _slow_load_of_an_evicted_key(frozenset({Protection.LEASES}))
    events = report_all(core, job.job_id, [key])
    assert isinstance(events[-1], JobSucceeded)
    assert replay_matches(core)


def test_I12_on_a_live_lease_keeps_the_key_when_only_checksums_are_off() -> None:
    core, job, key = _slow_load_of_an_evicted_key(frozenset({Protection.CHECKSUMS}))
    assert core.state.tiers[TIER].entry(0, key) is not None
    events = report_all(core, job.job_id, [key])
    assert isinstance(events[-1], JobSucceeded)
    assert replay_matches(core)


def test_I13_off_a_load_reporting_other_checksums_than_published_succeeds() -> None:
    """Checksums off: the coordinator no longer compares; with them on the same reports fail
    the load and quarantine the key (test_I13_a_load_checksum_mismatch_quarantines_the_key)."""
    core = new_core(core=CoordinatorCore(protections_off=frozenset({Protection.CHECKSUMS})))
    begin(core)
    [key] = publish(core, TOKENS[:4])
    dest = allocate(core, owner(core, "reader"), 1)[0]
    job = load(core, [(key, dest)])
    events = report_all(core, job.job_id, [b"corrupted"])
    assert isinstance(events[-1], JobSucceeded) and not of_type(events, KeyQuarantined)
    assert replay_matches(core)


# --- I18 the tier's columns ------------------------------------------------------------------------


def test_I18_an_evicted_key_leaves_nothing_in_its_slot() -> None:
    """A tier keeps its published keys in per-slot columns (TierState): an eviction clears the
    slot's row, so two tiers that published different keys into the same slot and evicted them
    (a leased one quarantined first) hold equal state and encode to equal bytes."""

    def published_then_evicted(tokens: list[int], leased: bool) -> TierState:
        core = new_core(tier_slots=1)
        begin(core)
        [key] = publish(core, tokens)
        if leased:  # the reset quarantines the key a load holds; the load's end lets it be evicted
            job = load(core, [(key, allocate(core, owner(core, "reader"), 1)[0])])
            ok(core.execute(ResetCache(engine_id=ENGINE, drop_tier_keys=True)))
            begin(core, clock=1.0)
            report_all(core, job.job_id, [key])
            assert core.state.tiers[TIER].entry(0, key).quarantined  # type: ignore[union-attr]
            core.execute(ReleaseNamespace(namespace=core.state.engines[ENGINE].namespace_id.hex(), reason="gone"))
        else:
            ok(core.execute(ResetCache(engine_id=ENGINE, drop_tier_keys=True)))
        assert of_type(core.events, KeyEvicted) and replay_matches(core)
        tier = core.state.tiers[TIER]
        assert tier.entry(0, key) is None and tier.keys == [None] and tier.free == {0: None}
        return tier

    plain = published_then_evicted(TOKENS[:4], leased=False)
    assert msgspec.msgpack.encode(plain) == msgspec.msgpack.encode(published_then_evicted(TOKENS[4:8], leased=False))
    after_quarantine = published_then_evicted(TOKENS[8:12], leased=True)
    assert not after_quarantine.quarantined and not after_quarantine.leases
    assert msgspec.msgpack.encode(after_quarantine) == msgspec.msgpack.encode(plain)


def test_an_entry_is_a_copy_of_the_columns() -> None:
    """TierState.entry reads a key back: changing what it returns changes no state."""
    core = new_core()
    begin(core)
    [key] = publish(core, TOKENS[:4])
    load(core, [(key, allocate(core, owner(core, "reader"), 1)[0])])
    before = state_bytes(core)
    entry = core.state.tiers[TIER].entry(0, key)
    assert entry is not None and entry.leases and not entry.quarantined
    entry.leases.clear()
    entry.quarantined = True
    assert state_bytes(core) == before and core.state.tiers[TIER].entry(0, key).leases  # type: ignore[union-attr]
