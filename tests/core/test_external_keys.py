"""External keys (coordinator/core/external.py): an engine that owns its device blocks and names its own
keys (vLLM's offloading manager) still gets every tier decision from kvledger, under I5, I8-I10,
I12, I13, I17 and I18. On the real pure core, no fakes."""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest

from coordinator.core.checks import MAX_ITEMS_PER_COMMAND, MAX_ITEMS_PER_ENGINE, MAX_JOBS_PER_ENGINE
from coordinator.core.commands import (
    DeclareEngine,
    ExternalKey,
    LoadExternal,
    LookupExternal,
    ReportRank,
    ResetCache,
    StoreExternal,
)
from coordinator.core.completion import complete
from coordinator.core.external import RECENT_EXTERNAL_KEYS, external_key, tier_keys
from coordinator.core.keys import namespace_id
from coordinator.core.protections import Protection, switched_off
from coordinator.core.state import decode_state, encode_state, jobs_in_flight
from events import (
    Event,
    ExternalLoadStarted,
    ExternalStoreStarted,
    FencedRankDone,
    JobFailed,
    JobSucceeded,
    KeyEvicted,
    KeyPublished,
    KeyQuarantined,
    NoticeDropped,
    RankReported,
    Reason,
    Refused,
)
from tests.kit.builders import ENGINE, TIER, attention_pool, begin, end, namespace, new_core, ok, rejected, replay_matches
from tests.kit.external import WORLD, core_with, load, loadable, publish, refs, report, store, sums, vllm_key


def test_tier_key_is_the_engine_key_in_the_namespace() -> None:
    """I8/I9, seed 003: vLLM's hash ignores the weights revision; the tier key does not."""
    a = namespace_id(namespace(weights_revision="sha256:aaaa"))
    b = namespace_id(namespace(weights_revision="sha256:bbbb"))
    assert external_key(a, 0, vllm_key(1)) != external_key(b, 0, vllm_key(1))
    assert external_key(a, 0, vllm_key(1)) != external_key(a, 1, vllm_key(1))
    assert external_key(a, 0, vllm_key(1)) == external_key(a, 0, vllm_key(1))  # fixed seed: every process agrees
    assert len(external_key(a, 0, vllm_key(1))) == 16


# external_key's answers, pinned (I8: keys agree across processes, versions and machines): a
# namespace id of bytes 0..15 and engine keys of `length` bytes (i * 7 + length) % 256.
PINNED_TIER_KEYS = [
    (0, 1, "d4eb6851ca60bac37466ab4d786999d1"),
    (0, 8, "5e1b0b9625974972a8f28eabd39c8440"),
    (3, 36, "30ec9fc616dd6ee2674df2b5ca042cb2"),
    (70000, 255, "b736a196b6592049e817333dde2a4323"),
    (1, 256, "791924ab78057fef107db2b3f3996b30"),
    ((1 << 31) - 1, 36, "7e1547378ba74ae4024047f62adfb8ee"),
]


def test_tier_keys_are_pinned_and_the_memo_answers_as_the_formula() -> None:
    """I8: the tier key of an engine key never changes; `tier_keys` (the decider's, remembered,
    hashing from a prefix fed once per group) answers exactly what `external_key` does, for one
    group or several, a key asked twice, and across the memo's generations."""
    ns = bytes(range(16))
    engine_keys = [bytes((i * 7 + length) % 256 for i in range(length)) for _, length, _ in PINNED_TIER_KEYS]
    pool_ids = [pool_id for pool_id, _, _ in PINNED_TIER_KEYS]
    expected = [bytes.fromhex(key) for _, _, key in PINNED_TIER_KEYS]
    assert [external_key(ns, p, k) for p, k in zip(pool_ids, engine_keys, strict=True)] == expected
    assert tier_keys(ns, pool_ids, engine_keys) == expected  # several groups
    for pool_id, engine_key, key in zip(pool_ids, engine_keys, expected, strict=True):
        assert tier_keys(ns, [pool_id, pool_id], [engine_key, engine_key]) == [key, key]  # one group, twice
    many = [n.to_bytes(8, "big") for n in range(RECENT_EXTERNAL_KEYS + 7)]  # past both generations
    for _ in range(2):
        assert tier_keys(ns, [2] * len(many), many) == [external_key(ns, 2, k) for k in many]


def test_another_weights_revision_never_sees_the_key() -> None:
    """Two engines on one tier whose vLLM hashes are equal: only the same namespace loads (I9)."""
    core = core_with(engine_id="old-weights")
    publish(core, 1, engine_id="old-weights")
    core.execute(
        DeclareEngine(
            engine_id="new-weights",
            namespace=namespace(tp=WORLD, weights_revision="sha256:9999"),
            pools=[attention_pool(managed=False)],
            world_size=WORLD,
            tiers=[TIER],
        )
    )
    begin(core, engine_id="new-weights")
    assert loadable(core, 1, engine_id="old-weights") == [True]
    assert loadable(core, 1, engine_id="new-weights") == [False]
    rejected(core, LoadExternal(engine_id="new-weights", tier=TIER, keys=refs(1)), Refused, Reason.KEY_NOT_PUBLISHED)


def test_published_only_when_every_rank_reported_a_checksum() -> None:
    """I5 / I17: not loadable while a rank is missing; loadable once all reported."""
    core = core_with()
    job = store(core, 1, 2)
    assert [item.engine_key for item in job.items] == [vllm_key(1), vllm_key(2)]
    assert loadable(core, 1, 2) == [False, False]
    report(core, job, 0)
    assert loadable(core, 1, 2) == [False, False]
    events = report(core, job, 1)
    assert [type(e) for e in events[1:]] == [KeyPublished, KeyPublished, JobSucceeded]
    assert loadable(core, 1, 2, 3) == [True, True, False]
    assert replay_matches(core)


def test_a_failed_or_unverified_store_publishes_nothing_and_frees_its_slots() -> None:
    core = core_with(tier_slots=2)
    job = store(core, 1, 2)
    report(core, job, 0)
    events = report(core, job, 1, ok_=False, checksums=[])
    assert isinstance(events[-1], JobFailed) and events[-1].reason is Reason.RANK_FAILED
    assert loadable(core, 1, 2) == [False, False]
    assert len(core.state.tiers[TIER].free) == 2
    job = store(core, 1, 2)
    report(core, job, 0)
    events = report(core, job, 1, checksums=[b"only-one"])
    assert isinstance(events[-1], JobFailed) and events[-1].reason is Reason.MISSING_CHECKSUM
    assert len(core.state.tiers[TIER].free) == 2
    assert replay_matches(core)


def test_keys_there_or_on_their_way_are_skipped() -> None:
    """I10: vLLM offers keys it stored before; kvledger admits only new ones, once."""
    core = core_with()
    first = store(core, 1, 2)
    second = store(core, 2, 3, 3)
    assert [item.engine_key for item in second.items] == [vllm_key(3)]
    assert second.already_published == [vllm_key(2), vllm_key(3)]
    for rank in range(WORLD):
        report(core, first, rank)
    events = ok(core.execute(StoreExternal(engine_id=ENGINE, tier=TIER, keys=refs(1, 2))))
    assert [type(e) for e in events] == [ExternalStoreStarted, JobSucceeded]
    assert isinstance(events[0], ExternalStoreStarted) and not events[0].items


def test_eviction_takes_the_least_recently_used_and_never_a_leased_key() -> None:
    """I12: a key a load holds is never evicted; with nothing evictable the store is refused."""
    core = core_with(tier_slots=2)
    publish(core, 1)
    publish(core, 2)
    held = load(core, 1)  # leases key 1 (the least recently used)
    events = ok(core.execute(StoreExternal(engine_id=ENGINE, tier=TIER, keys=refs(3))))
    evicted = [e for e in events if isinstance(e, KeyEvicted)]
    assert [e.key for e in evicted] == [external_key(core.state.engines[ENGINE].namespace_id, 0, vllm_key(2))]
    assert loadable(core, 1, 2) == [True, False]
    rejected(core, StoreExternal(engine_id=ENGINE, tier=TIER, keys=refs(4)), Refused, Reason.TIER_FULL)
    for rank in range(WORLD):
        report(core, held, rank)  # the load ends: its lease goes
    assert core.state.tiers[TIER].entry(0, held.items[0].key).leases is None  # type: ignore[union-attr]
    end(core)
    assert replay_matches(core)


def test_a_load_carries_the_published_checksums_and_succeeds_when_they_match() -> None:
    core = core_with()
    stored = publish(core, 1, 2)
    job = load(core, 2, 1)
    assert [item.checksums for item in job.items] == [
        [sums(stored, rank)[1] for rank in range(WORLD)],
        [sums(stored, rank)[0] for rank in range(WORLD)],
    ]
    report(core, job, 0, checksums=[item.checksums[0] for item in job.items])
    events = report(core, job, 1, checksums=[item.checksums[1] for item in job.items])
    assert isinstance(events[-1], JobSucceeded)
    assert replay_matches(core)


def test_a_checksum_mismatch_on_load_quarantines_the_key() -> None:
    """I13: a rank that read other bytes fails the load and quarantines the key, which is then
    neither loadable nor offered again."""
    core = core_with()
    publish(core, 1, 2)
    job = load(core, 1, 2)
    report(core, job, 0, checksums=[item.checksums[0] for item in job.items])
    events = report(core, job, 1, ok_=False, checksums=[job.items[0].checksums[1], b"other bytes"])
    assert [type(e) for e in events[1:]] == [KeyQuarantined, JobFailed]
    assert isinstance(events[1], KeyQuarantined) and events[1].key == job.items[1].key
    assert isinstance(events[2], JobFailed) and events[2].reason is Reason.CHECKSUM_MISMATCH
    assert events[2].kept == 1  # the first key verified on both ranks: the engine keeps its block
    assert loadable(core, 1, 2) == [True, False]
    rejected(core, LoadExternal(engine_id=ENGINE, tier=TIER, keys=refs(2)), Refused, Reason.KEY_QUARANTINED)
    # A worker that reports success with other checksums is caught all the same.
    job = load(core, 1)
    report(core, job, 0, checksums=[b"wrong"])
    events = report(core, job, 1, checksums=[job.items[0].checksums[1]])
    assert [type(e) for e in events[1:]] == [KeyQuarantined, JobFailed]
    assert replay_matches(core)


def test_a_load_completing_after_its_lease_fails() -> None:
    """I12: the lease is on the engine's clock (its steps); a late completion never counts."""
    core = core_with()
    publish(core, 1)
    job = load(core, 1, lease_seconds=5.0)
    end(core)
    begin(core, clock=10.0)
    report(core, job, 0, checksums=[job.items[0].checksums[0]])
    events = report(core, job, 1, checksums=[job.items[0].checksums[1]])
    assert isinstance(events[-1], JobFailed) and events[-1].reason is Reason.LEASE_EXPIRED
    assert core.state.tiers[TIER].entry(0, job.items[0].key).leases is None  # type: ignore[union-attr]
    assert replay_matches(core)


def test_reports_are_counted_per_job_and_rank() -> None:
    """I4: a second report of a rank is dropped; a report for a finished job is stale."""
    core = core_with()
    job = store(core, 1)
    report(core, job, 0)
    rejected(core, ReportRank(job_id=job.job_id, rank=0, ok=True, checksums=sums(job, 0)), NoticeDropped, Reason.DUPLICATE_REPORT)
    report(core, job, 1)
    rejected(core, ReportRank(job_id=job.job_id, rank=1, ok=True, checksums=sums(job, 1)), NoticeDropped, Reason.STALE_JOB)


def test_bad_external_commands_are_refused_and_change_nothing() -> None:
    core = core_with()
    rejected(core, StoreExternal(engine_id=ENGINE, tier=TIER, keys=[ExternalKey(7, vllm_key(1))]), Refused, Reason.UNKNOWN_POOL)
    rejected(core, StoreExternal(engine_id=ENGINE, tier=TIER, keys=[ExternalKey(0, b"")]), Refused, Reason.INVALID_ARGUMENT)
    rejected(core, StoreExternal(engine_id=ENGINE, tier="nowhere", keys=refs(1)), Refused, Reason.UNKNOWN_TIER)
    rejected(core, StoreExternal(engine_id=ENGINE, tier=TIER, keys=[]), Refused, Reason.INVALID_COUNT)
    rejected(core, LoadExternal(engine_id=ENGINE, tier=TIER, keys=refs(1)), Refused, Reason.KEY_NOT_PUBLISHED)
    publish(core, 1)
    rejected(core, LoadExternal(engine_id=ENGINE, tier=TIER, keys=refs(1), lease_seconds=0), Refused, Reason.INVALID_ARGUMENT)
    end(core)
    rejected(core, LookupExternal(engine_id=ENGINE, tier=TIER, keys=refs(1)), Refused, Reason.NO_OPEN_STEP)


def test_a_managed_pool_is_not_external() -> None:
    """kvledger's own blocks have kvledger's content keys: an engine does not name them."""
    core = new_core([attention_pool(managed=True)], world_size=WORLD)
    begin(core)
    rejected(core, StoreExternal(engine_id=ENGINE, tier=TIER, keys=refs(1)), Refused, Reason.INVALID_ARGUMENT)


def test_hello_with_another_hash_algorithm_or_block_size_is_refused_naming_both() -> None:
    core = new_core([attention_pool(managed=False)], world_size=WORLD)
    declared = namespace(tp=WORLD, hash_algorithm="vllm:sha256")
    events = core.execute(
        DeclareEngine(
            engine_id="vllm-1",
            namespace=declared,
            pools=[attention_pool(managed=False)],
            world_size=WORLD,
            tiers=[TIER],
            key_hash_algorithm="vllm:xxhash",
        )
    )
    assert [type(e) for e in events] == [Refused]
    assert isinstance(events[0], Refused) and events[0].reason is Reason.NAMESPACE_MISMATCH
    assert "'vllm:xxhash'" in events[0].detail and "'vllm:sha256'" in events[0].detail
    events = core.execute(
        DeclareEngine(
            engine_id="vllm-1",
            namespace=namespace(tp=WORLD, block_sizes=(32,)),
            pools=[attention_pool(managed=False)],
            world_size=WORLD,
            tiers=[TIER],
        )
    )
    assert isinstance(events[0], Refused) and events[0].reason is Reason.NAMESPACE_MISMATCH
    assert "(4,)" in events[0].detail and "(32,)" in events[0].detail
    ok(
        core.execute(
            DeclareEngine(
                engine_id="vllm-1",
                namespace=declared,
                pools=[attention_pool(managed=False)],
                world_size=WORLD,
                tiers=[TIER],
                key_hash_algorithm="vllm:sha256",
            )
        )
    )


@pytest.mark.anyio
async def test_audit_key_shows_an_external_keys_store_and_load(tmp_path: Path, anyio_backend: str) -> None:
    """`kvledger audit key` on a tier key of an engine that owns its blocks (vLLM): the store job it
    came from (with the engine's own key, as there is no kvledger slot to name) and each load."""
    from coordinator.audit.queries import Audit
    from coordinator.audit.store import sync_index
    from coordinator.core.commands import DeclareTier
    from coordinator.ledger.ledger import Ledger
    from events import TierSpec
    from events.log import SqlEventLog, open_log

    event_log = await open_log(str(tmp_path / "external.sqlite"))
    try:
        ledger = await Ledger.open(event_log)
        await ledger.execute(DeclareTier(spec=TierSpec(name=TIER, num_slots=8, bytes_per_slot=64)))
        await ledger.execute(
            DeclareEngine(
                engine_id=ENGINE,
                namespace=namespace(block_sizes=(4,), tp=WORLD),
                pools=[attention_pool(managed=False)],
                world_size=WORLD,
                tiers=[TIER],
            )
        )
        commit = await ledger.run_step(ENGINE, 1, 1.0, [StoreExternal(engine_id=ENGINE, tier=TIER, keys=refs(7))])
        (stored,) = [e for e in commit.events if isinstance(e, ExternalStoreStarted)]
        for rank in range(WORLD):
            await ledger.execute(ReportRank(job_id=stored.job_id, rank=rank, ok=True, checksums=sums(stored, rank)))
        commit = await ledger.run_step(
            ENGINE, 2, 2.0, [LoadExternal(engine_id=ENGINE, tier=TIER, keys=refs(7), lease_seconds=30.0)]
        )
        (loaded,) = [e for e in commit.events if isinstance(e, ExternalLoadStarted)]
        for rank in range(WORLD):
            await ledger.execute(ReportRank(job_id=loaded.job_id, rank=rank, ok=True, checksums=sums(loaded, rank)))
        assert isinstance(event_log, SqlEventLog)
        await sync_index(event_log)
        answer = await Audit(event_log).key(stored.items[0].key.hex())
        [publication] = answer.publications
        assert publication.source_job == stored.job_id
        assert publication.source == f"{ENGINE} pool 0 (engine key {vllm_key(7).hex()})", publication.source
        [load_] = answer.loads
        assert (load_.job_id, load_.engine, load_.outcome) == (loaded.job_id, ENGINE, "succeeded"), load_
    finally:
        await event_log.close()


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.mark.parametrize("off", [Protection.LEASES, Protection.CHECKSUMS, Protection.IDEMPOTENT_STORE])
def test_an_engines_own_jobs_complete_as_kvledgers_do_under_every_protection_switch(off: Protection) -> None:
    """External jobs completed through a copy of the completion rule that ignored the LEASES and
    CHECKSUMS switches (and IDEMPOTENT_STORE), so a scenario switching one off saw vLLM's jobs
    still protected. One completion path (coordinator/core/completion.py) now serves both kinds: with
    the switch on the job is refused as kvledger's own would be, with it off it goes through."""

    def outcome(switched: frozenset[Protection]) -> list[type[Event]]:
        core = core_with()
        with switched_off(switched):
            first = publish(core, 1)
            if off is Protection.IDEMPOTENT_STORE:
                # The same key stored again with other bytes (the decider skips a key already
                # there, so only the completion rule itself can be asked).
                again = msgspec.structs.replace(first, job_id=first.job_id + 100)
                differing = {
                    rank: RankReported(job_id=again.job_id, rank=rank, ok=True, checksums=[b"other" + bytes([rank])])
                    for rank in range(WORLD)
                }
                return [type(e) for e in complete(core.state, again, differing)]
            job = load(core, 1, lease_seconds=5.0)
            if off is Protection.LEASES:
                end(core)
                begin(core, clock=10.0)  # past the lease
                checksums = [job.items[0].checksums[rank] for rank in range(WORLD)]
            else:
                checksums = [b"other bytes"] * WORLD
            events = [e for rank in range(WORLD) for e in report(core, job, rank, checksums=[checksums[rank]])]
            return [type(e) for e in events if not isinstance(e, RankReported)]

    on, switched = outcome(frozenset()), outcome(frozenset({off}))
    if off is Protection.IDEMPOTENT_STORE:
        assert on == [KeyQuarantined, JobSucceeded]  # I10: trust neither
        assert switched == [KeyEvicted, KeyPublished, JobSucceeded]  # seed 002: the last writer wins
    else:
        assert on[-1] is JobFailed and switched == [JobSucceeded]


def test_a_reset_that_reaches_the_tier_ends_the_namespaces_keys() -> None:
    """Issue 19, item 5 (vLLM's reset_prefix_cache(reset_connector=True)): the engine's keys end
    in its tier. An unleased key is evicted; one a load in flight holds is quarantined (I12: never
    evicted under a lease), and that load, fenced by the reset, never counts (I16). Afterwards no
    lookup finds either; another tenant's key on the same tier stays."""
    core = core_with()
    other = "engine-b"
    new_core([attention_pool(managed=False)], world_size=WORLD, engine_id=other, tenant="tenant-b", core=core)
    begin(core, engine_id=other)
    publish(core, 7, engine_id=other)
    end(core, engine_id=other)
    publish(core, 1, 2)
    in_flight = load(core, 2)
    report(core, in_flight, 0)
    end(core)
    plain = ok(core.execute(ResetCache(engine_id=ENGINE)))
    assert not [e for e in plain if isinstance(e, KeyEvicted | KeyQuarantined)]  # a plain reset keeps the tier
    events = ok(core.execute(ResetCache(engine_id=ENGINE, reason="reset_prefix_cache", drop_tier_keys=True)))
    evicted = [e for e in events if isinstance(e, KeyEvicted)]
    quarantined = [e for e in events if isinstance(e, KeyQuarantined)]
    assert [e.key for e in evicted] == [external_key(core.state.engines[ENGINE].namespace_id, 0, vllm_key(1))]
    assert [(e.key, e.reason) for e in quarantined] == [(in_flight.items[0].key, Reason.ENGINE_RESET)]
    begin(core, clock=1.0)
    assert loadable(core, 1, 2) == [False, False]
    late = report(core, in_flight, 1)
    assert [type(e) for e in late] == [FencedRankDone]  # fenced by the reset: its rank is done, nothing counts
    end(core)
    begin(core, engine_id=other)
    assert loadable(core, 7, engine_id=other) == [True]
    assert replay_matches(core)


def test_an_engines_jobs_in_flight_are_bounded_in_number() -> None:
    """Jobs never reported held state without end (150 loads of one key named 20,000 times kept
    464 MiB), slowed every engine's stores and made one ResetCache fence them all at once (an
    adversarial review, session 31). An engine has at most MAX_JOBS_PER_ENGINE jobs in flight; as
    they end it starts more, and another engine is counted on its own."""
    core = core_with()
    publish(core, 1)
    started = [load(core, 1) for _ in range(MAX_JOBS_PER_ENGINE)]
    assert jobs_in_flight(core.state, ENGINE) == (MAX_JOBS_PER_ENGINE, MAX_JOBS_PER_ENGINE)
    one_more = LoadExternal(engine_id=ENGINE, tier=TIER, keys=refs(1), lease_seconds=30.0)
    refused = rejected(core, one_more, Refused, Reason.TOO_MANY_JOBS)
    assert f"{MAX_JOBS_PER_ENGINE:,} jobs" in str(refused) and repr(ENGINE) in str(refused)
    other = core_with(engine_id="engine-b", core=core)
    assert jobs_in_flight(other.state, "engine-b") == (0, 0)
    publish(other, 2, engine_id="engine-b")  # not held back by engine-a's count
    for job in started[:2]:  # two loads end: two more may start
        for rank in range(WORLD):
            report(core, job, rank, checksums=[item.checksums[rank] for item in job.items])
    assert jobs_in_flight(core.state, ENGINE) == (MAX_JOBS_PER_ENGINE - 2, MAX_JOBS_PER_ENGINE - 2)
    ok(core.execute(one_more))
    assert jobs_in_flight(core.state, ENGINE) == jobs_in_flight(decode_state(encode_state(core.state)), ENGINE)
    assert replay_matches(core)


def test_an_engines_items_in_flight_are_bounded() -> None:
    """A job of one key named 65,536 times is 65,536 items: at most MAX_ITEMS_PER_ENGINE in flight."""
    core = core_with()
    publish(core, 1)
    wide = LoadExternal(engine_id=ENGINE, tier=TIER, keys=refs(1) * MAX_ITEMS_PER_COMMAND, lease_seconds=30.0)
    for _ in range(MAX_ITEMS_PER_ENGINE // MAX_ITEMS_PER_COMMAND):
        ok(core.execute(wide))
    assert jobs_in_flight(core.state, ENGINE)[1] == MAX_ITEMS_PER_ENGINE
    refused = rejected(core, msgspec.structs.replace(wide, keys=refs(1)), Refused, Reason.TOO_MANY_JOBS)
    assert f"{MAX_ITEMS_PER_ENGINE:,} items" in str(refused)
