"""Failures users reported this year (issue 20), as fault scenarios built like the seeds'
(coordinator/simulator/scenarios.py): the same run with one protection off and on, wrong-KV
reads counted from the bytes the workers left in the pools. Each names its public report.

Some reports are new ways past a guard the seeds' scenarios already show (the pins, the
checksums, the leases): they switch the same protection off. The others have a protection of
their own (coordinator/core/protections.py), whose value is their name.

What no scenario here covers, and why: reports about the observed side (an engine restart whose
event sequence went back to 0, AllBlocksCleared ignored, hints after an event gap: llm-d-router
#2853, llm-d-kv-cache #626, Dynamo #14627) are about a router's index, where a wrong answer is a
wasted route rather than wrong KV read from bytes; `kvledger ingest vllm` and its tests cover
them (tests/vllm/). A rewind under the recompute policy (vLLM #49250), a full hit at an exact
chunk multiple (LMCache #5151) and a cache salt dropped on the external path (SGLang #37160: the
salt keeps a tenant's timing private, the KV is the same) are not modelled.
"""

from __future__ import annotations

import hashlib
import itertools
from collections.abc import Sequence

import msgspec

from coordinator.core.commands import FinishOwner, LoadRequest, MarkComputed, ResetCache, StartLoad, StartStore
from coordinator.core.protections import Protection
from coordinator.simulator.harness import TIER, SimEngine, Simulation
from coordinator.simulator.scenarios import (
    BLOCK,
    Scenario,
    _foreign_namespace,
    _slow_load_under_store_pressure,
    admit,
    allocate,
    attention,
    compute,
    compute_and_store,
    freed_under_store,
    load_prefix,
    namespace,
    produce,
    prompt,
    use_or_recompute,
)
from events import PrefixLookedUp, StoreJobStarted
from gpu.mooncake import MooncakeTier, SegmentHolder
from gpu.tiers import DiskTier


async def request_finished_during_offload(sim: Simulation) -> None:
    """vLLM #46951: through MultiConnector, a request that finished while its offload store
    still ran had its blocks freed at once (one sub-connector's "free later" answer was lost).
    The next request took and wrote them; the store saved that request's KV under the first
    one's keys, and a request with the first prompt loaded it. On: the finished request's blocks
    stay pinned by the store, the next allocation is refused until it lands."""
    await freed_under_store(sim, "finished", prompt(20, 2), prompt(21, 2))


async def abort_during_load_back(sim: Simulation) -> None:
    """SGLang #35769: a request aborted while its load-back from the host tier was still copying;
    its slots were freed and given to the next request, which computed into them, and the late
    copy then overwrote that request's KV with the aborted one's. On: a load's destinations stay
    pinned until every rank reports; the next allocation is refused until the load lands."""
    engine = await sim.engine("pod-a", namespace(), [attention(num_blocks=3)])  # two usable blocks
    tokens, others = prompt(22, 2), prompt(23, 2)
    stored = await produce(engine, "r1", tokens)
    reader = await admit(engine, "r2")
    dests = await allocate(engine, reader, 2)
    assert dests is not None
    items = [LoadRequest(item.key, dest) for item, dest in zip(stored.items, dests, strict=True)]
    load = await engine.step([StartLoad(engine_id=engine.engine_id, tier=TIER, items=items)])
    [decision] = load.decisions  # the copy is slow: it has not run yet
    slow = frozenset({decision.event.job_id})
    await engine.step([FinishOwner(engine_id=engine.engine_id, owner_id=reader, reason="aborted")])
    other = await admit(engine, "r3")
    taken = await allocate(engine, other, 2)
    if taken is None:  # refused: the destinations are pinned by the load (I3); it lands first
        await engine.execute(only=slow)
        taken = await allocate(engine, other, 2)
        assert taken is not None
    await compute(engine, other, taken, others)
    await engine.execute()  # the (late) load lands now if it has not yet
    engine.check([(taken[0], others[:BLOCK]), (taken[1], others)])  # r3 decodes on its blocks


async def store_reported_before_copy_fence(sim: Simulation) -> None:
    """vLLM #45704, #46278, #47282: the offload store was reported complete when its copy was
    queued, before the copy stream's data fence. The request finished, its blocks went to the
    next request, and the copy then read that request's KV: the CPU tier held garbled blocks
    under the first prompt's keys. Baseline: CHECKSUMS off (vLLM's CPU tier has none; with them
    on, the load would find the bytes differ from the source's checksum and fail). On: a rank
    reports only after its copy landed, with the checksum of the bytes written."""
    engine = await sim.engine("pod-a", namespace(), [attention(num_blocks=3)])  # two usable blocks
    tokens, others = prompt(24, 2), prompt(25, 2)
    stored = await produce(engine, "r1", tokens)  # reported done; r1 finishes
    writer = await admit(engine, "r2")
    blocks = await allocate(engine, writer, 2)  # r1's blocks: the only two
    assert blocks is not None
    await compute(engine, writer, blocks, others)
    await engine.step([FinishOwner(engine_id=engine.engine_id, owner_id=writer)])
    reader = await admit(engine, "r3")
    await load_prefix(engine, reader, [item.key for item in stored.items], tokens)


async def reset_keeps_offloaded_blocks(sim: Simulation) -> None:
    """vLLM #57727: `POST /reset_prefix_cache` returned success while the CPU offload tier kept
    serving the same blocks. A reset is how an RL trainer that pushed new weights into a
    running engine says every cached block is stale: here the engine's compute changes with the
    update (its declared namespace cannot, short of a new declaration), and it resets its cache
    and the tier's (ResetCache.drop_tier_keys, vLLM's reset_connector=True). On: the reset ends
    the namespace's keys in the tier; the lookup misses and the engine recomputes."""
    engine = await sim.engine("pod-a", namespace(), [attention()])
    tokens = prompt(26, 2)
    await produce(engine, "r1", tokens)
    engine.namespace = msgspec.structs.replace(engine.namespace, weights_revision="sha256:weights-1+rl-update-1")
    reset = await engine.client.execute(ResetCache(engine_id=engine.engine_id, reason="reset_prefix_cache", drop_tier_keys=True))
    sim.tally.record(reset.events)
    reader = await admit(engine, "r2")
    await lookup_and_load(engine, reader, tokens, tokens)


async def lookup_and_load(
    engine: SimEngine, owner: int, tokens: Sequence[int], content: Sequence[int], extra_keys: Sequence[str] = ()
) -> None:
    """The engine looks `tokens` up and loads the hit, or computes on a miss; what its blocks
    then hold is checked against recompute of `content` (what the tokens stand for)."""
    hit = await engine.client.lookup(TIER, tokens, extra_keys)
    keys = [key for group in hit.answer.hits for key in group.keys] if isinstance(hit.answer, PrefixLookedUp) else []
    if keys:
        await load_prefix(engine, owner, keys, content)
        return
    blocks = await allocate(engine, owner, len(tokens) // BLOCK)
    assert blocks is not None
    engine.compute(blocks, content)
    engine.check([(ref, content[: (index + 1) * BLOCK]) for index, ref in enumerate(blocks)])


async def parallel_layouts_share_keys(sim: Simulation) -> None:
    """vLLM #56772: engines that split a block's KV across their ranks differently (there, TP1
    and TP2) shared keys, and completions differed. Here both engines have two ranks, one
    splitting by heads and one by tokens: every rank's shard has the published checksum, so the
    checksums cannot tell; only the namespace can. (TP1 against TP2 is caught by the checksums
    too: the lists differ in length.) On: the namespace ids differ, the load is refused."""
    await _foreign_namespace(sim, namespace(rank_layout="tokens"))


async def packed_layout_missing_from_identity(sim: Simulation) -> None:
    """LMCache #4463, #4247; Dynamo #14416: a new packed KV layout was missing from the cache
    identity, so KV stored in the old layout was read as the new one. On: the layout version is
    part of the namespace, the load is refused."""
    await _foreign_namespace(sim, namespace(layout=2))


IMAGE_PLACEHOLDER = 32_000
"""The token id an image's placeholder positions carry: the same for every image."""


def colliding_images() -> tuple[str, str]:
    """Two images' hashes (sha256, hex) that share their first 16 bits, found by search."""
    first = hashlib.sha256(b"image-a").hexdigest()
    for attempt in itertools.count():
        other = hashlib.sha256(f"image-b-{attempt}".encode()).hexdigest()
        if other[:4] == first[:4]:
            return first, other
    raise AssertionError("unreachable")


def image_content(image: str) -> list[int]:
    """What the model sees at an image's placeholders: two blocks that depend on the image."""
    return prompt(int(image[:12], 16) % 1_000_003, 2)


async def truncated_multimodal_hash(sim: Simulation) -> None:
    """LMCache #4086: a multimodal hash truncated to 16 bits went into the cache key, so a
    request with another image whose hash shared those bits hit the first image's KV. Two
    requests whose prompts are one image each (the same placeholder tokens, other pixels).
    On: the key covers the image hash whole; the second image misses and is computed."""
    engine = await sim.engine("pod-a", namespace(), [attention()])
    first, second = colliding_images()
    placeholders = [IMAGE_PLACEHOLDER] * (2 * BLOCK)
    owner = await admit(engine, "r1")
    blocks = await allocate(engine, owner, 2)
    assert blocks is not None
    engine.compute(blocks, image_content(first))
    await engine.step(
        [
            MarkComputed(engine_id=engine.engine_id, owner_id=owner, blocks=blocks, token_ids=placeholders, extra_keys=[first]),
            StartStore(engine_id=engine.engine_id, tier=TIER, blocks=blocks),
        ]
    )
    await engine.execute()
    await engine.step([FinishOwner(engine_id=engine.engine_id, owner_id=owner)])
    reader = await admit(engine, "r2")
    await lookup_and_load(engine, reader, placeholders, image_content(second), [second])


async def corrupted_bytes_in_file_tier(sim: Simulation) -> None:
    """vLLM RFC #54363, PR #57912: a file tier accepted a file of the right length with other
    bytes (a flipped bit on disk, a torn overwrite) as valid KV. Here one rank's file of a
    stored block has one bit flipped. On: the worker checks what it read against the published
    checksum before copying: the load fails, the key is quarantined, the engine recomputes."""
    engine = await sim.engine("pod-a", namespace(), [attention()])
    tokens = prompt(27, 2)
    stored = await produce(engine, "r1", tokens)
    tier = sim.tiers[1][TIER]
    assert isinstance(tier, DiskTier)
    path = tier.path(stored.items[1].key)
    data = bytearray(path.read_bytes())
    data[17] ^= 0x08
    path.write_bytes(bytes(data))
    reader = await admit(engine, "r2")
    await load_prefix(engine, reader, [item.key for item in stored.items], tokens)


async def batch_get_skips_lease_check(sim: Simulation) -> None:
    """Mooncake #4239: a batch get skipped the lease-expiry check a single get made. A batch
    load of two prompts' keys outlives its lease; a store under pressure evicts the first
    prompt's keys and reuses their slots before the load runs. Baseline: CHECKSUMS off, as for
    lease-expiry-during-slow-load. On: kvledger checks one lease per load job, however many keys
    it names: the late batch fails (LEASE_EXPIRED) and the engine recomputes."""
    await _slow_load_under_store_pressure(sim, lease_seconds=1.0, pause=5.0, prompts=2)


async def exists_without_value(sim: Simulation) -> None:
    """Mooncake #1374, #2827: two instances put the same keys at once. The master marked them as
    existing at put_start; the second put was skipped as a duplicate; the first put then failed
    on one replica's segment, and the key stayed "existing" with no value behind it: a get
    returned whatever the segment held. Here the tier has two slots, which an earlier prompt's
    store filled: pod-a's put evicts it and takes them, and pod-b's put of the same keys finds
    no room. On: a key is published only when every rank of a store reported success with a
    checksum: after pod-a's failed put, nothing is published and the load is refused."""
    a = await sim.engine("pod-a", namespace(), [attention()])
    b = await sim.engine("pod-b", namespace(), [attention()])
    await produce(a, "a-0", prompt(29, 2))  # what the segment held before
    tokens = prompt(28, 2)
    owners = [await admit(a, "a-1"), await admit(b, "b-1")]
    blocks = [await allocate(a, owners[0], 2), await allocate(b, owners[1], 2)]
    assert blocks[0] is not None and blocks[1] is not None
    first = await compute_and_store(a, owners[0], blocks[0], tokens)
    b.compute(blocks[1], tokens)
    await b.step(  # off: every key "exists" already: the put is skipped, nothing is stored
        [
            MarkComputed(engine_id=b.engine_id, owner_id=owners[1], blocks=blocks[1], token_ids=tokens),
            StartStore(engine_id=b.engine_id, tier=TIER, blocks=blocks[1]),
        ]
    )
    await b.execute()
    await a.execute(failing=frozenset({(first.job_id, 1)}))  # pod-a's put fails on rank 1
    await a.step([FinishOwner(engine_id=a.engine_id, owner_id=owners[0])])
    await b.step([FinishOwner(engine_id=b.engine_id, owner_id=owners[1])])
    reader = await admit(b, "b-2")
    await load_prefix(b, reader, [item.key for item in first.items], tokens)


async def mooncake_silent_eviction(sim: Simulation) -> None:
    """Issue 21 (Mooncake Store, seen with 0.3.13.post1): the store evicts on its own past ~90% of
    a segment, with no notice, and a put that returned 0 can be gone seconds later; a get then
    returns nothing. Here, on a real Mooncake Store, r1's prompt is stored and its objects are
    then evicted behind kvledger's back (removed: an eviction at a chosen moment); r2's blocks,
    recycled, still hold another request's KV when it loads the prompt. Baseline: CHECKSUMS off.
    On: the worker finds the objects gone, the load fails (OBJECT_LOST), the keys leave the tier
    and the engine recomputes."""
    engine = await sim.engine("pod-a", namespace(), [attention()])
    tokens = prompt(30, 2)
    stored = await produce(engine, "r1", tokens)
    for tier in _mooncake_tiers(sim):
        for item in stored.items:
            removed = tier.remove(item.key, slot=item.tier_slot, generation=item.tier_generation, force=True)
            assert removed == 0, f"Mooncake's remove returned {removed}"
    await _load_into_recycled_blocks(engine, stored, tokens)


def _mooncake_tiers(sim: Simulation) -> list[MooncakeTier]:
    tiers = [tiers[TIER] for tiers in sim.tiers]
    mooncake = [tier for tier in tiers if isinstance(tier, MooncakeTier)]
    assert len(mooncake) == len(tiers), "this scenario runs on a Mooncake Store tier"
    return mooncake


async def _load_into_recycled_blocks(engine: SimEngine, stored: StoreJobStarted, tokens: list[int]) -> None:
    """A new request loads the stored prompt into blocks that still hold another request's KV
    (a recycled block), and uses what the load left there, or recomputes when it failed."""
    reader = await admit(engine, "r2")
    dests = await allocate(engine, reader, len(stored.items))
    assert dests is not None
    engine.compute(dests, prompt(98, len(stored.items)))  # what the recycled blocks held before
    load = await engine.step(
        [
            StartLoad(
                engine_id=engine.engine_id,
                tier=TIER,
                items=[LoadRequest(i.key, d) for i, d in zip(stored.items, dests, strict=True)],
            )
        ]
    )
    if load.decisions:
        use_or_recompute(engine, dests, tokens, await engine.execute())


async def mooncake_dead_client_segment(sim: Simulation) -> None:
    """Issue 21 (Mooncake Store, seen with 0.3.13.post1): a client killed with SIGKILL takes its
    segment's objects with it, while for ~10 s the master still says they exist (`is_exist` 1)
    and a get returns nothing. Here r1's prompt is stored in another client's segment (a process
    of its own, as another engine's worker would be), which is then killed; r2's blocks, recycled,
    still hold another request's KV when it loads the prompt. Baseline: CHECKSUMS off. On: the
    worker finds the objects empty, the load fails (OBJECT_LOST), the keys leave the tier and the
    engine recomputes; a lookup no longer offers them."""
    engine = await sim.engine("pod-a", namespace(), [attention()])
    tiers = _mooncake_tiers(sim)
    assert tiers[0].master, "this scenario starts a client of its own: the tier must say where its master is"
    holder = SegmentHolder.start(tiers[0].master, tiers[0].metadata_url)
    tokens = prompt(33, 2)
    try:
        for tier in tiers:
            tier.preferred_segment = holder.segment
        stored = await produce(engine, "r1", tokens)
    finally:
        for tier in tiers:
            tier.preferred_segment = None
        holder.kill()
    await _load_into_recycled_blocks(engine, stored, tokens)


async def mooncake_duplicate_put_keeps_first_value(sim: Simulation) -> None:
    """Issue 21 (Mooncake Store, seen with 0.3.13.post1): a put of a name that exists returns 0
    and keeps the FIRST value. Here the tier has 2 slots: r1's prompt is stored in them, then
    r2's prompt evicts it and is stored in the same slots. Off: objects are named by slot and
    rank, so r2's puts return 0 and the store keeps r1's bytes; r2's keys are published with the
    checksums of the bytes the workers sent, and a load of them copies r1's KV. Baseline:
    CHECKSUMS off (with them the load fails and r2's keys are quarantined: no wrong read, but
    every key that slot holds from then on is lost). On: r2's objects are new names (the slot's
    generation is in them), nothing is refused, the right bytes are read; r1's objects are
    removed as r2's store begins (MooncakeTier.retire)."""
    engine = await sim.engine("pod-a", namespace(), [attention()])
    first = await produce(engine, "r1", prompt(31, 2))
    tokens = prompt(32, 2)
    stored = await produce(engine, "r2", tokens)
    reused = {(i.tier_slot, i.tier_generation - 1) for i in stored.items}
    assert reused == {(i.tier_slot, i.tier_generation) for i in first.items}, "r2 must be stored in r1's slots"
    reader = await admit(engine, "r3")
    await load_prefix(engine, reader, [item.key for item in stored.items], tokens)


MOONCAKE = {
    scenario.name: scenario
    for scenario in (
        Scenario(
            "mooncake-silent-eviction",
            Protection.LOST_OBJECTS,
            "I13",
            mooncake_silent_eviction,
            "JobFailed:object_lost",
            baseline=frozenset({Protection.CHECKSUMS}),
            report="issue 21 (Mooncake Store 0.3.13.post1, seen here)",
        ),
        Scenario(
            "mooncake-dead-client-segment",
            Protection.LOST_OBJECTS,
            "I13",
            mooncake_dead_client_segment,
            "JobFailed:object_lost",
            baseline=frozenset({Protection.CHECKSUMS}),
            report="issue 21 (Mooncake Store 0.3.13.post1, seen here)",
        ),
        Scenario(
            "mooncake-duplicate-put-keeps-first-value",
            Protection.OBJECT_GENERATIONS,
            "I13",
            mooncake_duplicate_put_keeps_first_value,
            "",
            baseline=frozenset({Protection.CHECKSUMS}),
            tier_slots=2,
            report="issue 21 (Mooncake Store 0.3.13.post1, seen here)",
        ),
    )
}
"""Scenarios that need a real Mooncake Store (run_scenario(tier=...)): tests/gpu/test_mooncake_tier.py
runs them; `kvledger demo` does not (a fresh machine has no Mooncake Store)."""


REPORTED = {
    scenario.name: scenario
    for scenario in (
        Scenario(
            "request-finished-during-offload",
            Protection.PINS,
            "I3",
            request_finished_during_offload,
            "Refused:pool_exhausted",
            report="vLLM #46951",
        ),
        Scenario(
            "abort-during-load-back",
            Protection.PINS,
            "I3",
            abort_during_load_back,
            "Refused:pool_exhausted",
            report="SGLang #35769",
        ),
        Scenario(
            "store-reported-before-copy-fence",
            Protection.STORE_FENCE,
            "I5",
            store_reported_before_copy_fence,
            "store reported after its copy landed",
            baseline=frozenset({Protection.CHECKSUMS}),
            report="vLLM #45704, #46278, #47282",
        ),
        Scenario(
            "reset-keeps-offloaded-blocks",
            Protection.TIER_RESET,
            "I16",
            reset_keeps_offloaded_blocks,
            "tier keys ended by the reset: a miss",
            report="vLLM #57727",
        ),
        Scenario(
            "parallel-layouts-share-keys",
            Protection.NAMESPACE_PARALLEL,
            "I9",
            parallel_layouts_share_keys,
            "Refused:key_not_published",
            report="vLLM #56772",
        ),
        Scenario(
            "packed-layout-missing-from-identity",
            Protection.NAMESPACE_LAYOUT,
            "I9",
            packed_layout_missing_from_identity,
            "Refused:key_not_published",
            report="LMCache #4463, #4247; Dynamo #14416",
        ),
        Scenario(
            "truncated-multimodal-hash",
            Protection.FULL_WIDTH_EXTRAS,
            "I8",
            truncated_multimodal_hash,
            "the other image misses",
            report="LMCache #4086",
        ),
        Scenario(
            "corrupted-bytes-in-file-tier",
            Protection.CHECKSUMS,
            "I13",
            corrupted_bytes_in_file_tier,
            "JobFailed:checksum_mismatch",
            report="vLLM RFC #54363, PR #57912",
            disk_tier=True,
        ),
        Scenario(
            "batch-get-skips-lease-check",
            Protection.LEASES,
            "I12",
            batch_get_skips_lease_check,
            "JobFailed:lease_expired",
            baseline=frozenset({Protection.CHECKSUMS}),
            tier_slots=4,
            report="Mooncake #4239",
        ),
        Scenario(
            "exists-without-value",
            Protection.PUBLISH_WHEN_COMPLETE,
            "I5",
            exists_without_value,
            "Refused:key_not_published",
            tier_slots=2,
            report="Mooncake #1374, #2827",
        ),
    )
}
