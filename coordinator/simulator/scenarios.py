"""The seeds' failures as named scenarios (../shared/seeds/). Each runs on a fresh simulation
with its protection on, then off (`Protection`'s value is the scenario's name). Off must show
wrong-KV reads (proof the scenario bites); on must show none, for the reason the scenario is
about (`evidence`: the refusal or decision kvledger recorded instead).

A scenario's `baseline` names protections switched off in both runs, to reproduce the
deployment of its seed where one protection backs up another (coordinator/core/protections.py): the
on/off comparison still toggles exactly one protection."""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path

import msgspec
import torch

from coordinator.core.commands import (
    AllocateBlocks,
    AllocateEncoderEntry,
    FinishOwner,
    FreeEncoderEntry,
    LoadRequest,
    MarkComputed,
    Move,
    PlanStateCopy,
    ResetCache,
    ReuseBlocks,
    StartLoad,
    StartOwner,
    StartStore,
)
from coordinator.core.keys import chain_keys, namespace_id
from coordinator.core.protections import Protection
from coordinator.simulator.content import kv_bytes
from coordinator.simulator.harness import TIER, SimEngine, Simulation, Tally
from events import (
    NULL_BLOCK_ID,
    BlockRef,
    BlocksAllocated,
    BlocksComputed,
    BlocksReused,
    Event,
    JobSucceeded,
    NamespaceSpec,
    OwnerStarted,
    PoolSpec,
    PrefixLookedUp,
    StepEnded,
    StoreJobStarted,
)
from gpu.tiers import Tier

BLOCK = 16
BLOCK_BYTES = 256
ENCODER_GROUP = 1 << 16
"""The group id the encoder outputs are hashed under (no pool has it)."""
Run = Callable[[Simulation], Awaitable[None]]


def namespace(
    *,
    weights: str = "sha256:weights-1",
    tenant: str = "tenant-a",
    tp: int = 2,
    blocks: int = 1,
    layout: int = 1,
    rank_layout: str = "heads",
) -> NamespaceSpec:
    return NamespaceSpec(
        model_id="org/model-7b",
        weights_revision=weights,
        tokenizer_digest="sha256:tokenizer-1",
        kv_dtype="bfloat16",
        kv_layout_version=layout,
        block_sizes=(BLOCK,) * blocks,
        tensor_parallel_size=tp,
        tenant=tenant,
        kv_rank_layout=rank_layout,
    )


def attention(num_blocks: int = 64) -> PoolSpec:
    return PoolSpec(pool_id=0, kind="attention", num_blocks=num_blocks, block_size=BLOCK, bytes_per_block=BLOCK_BYTES)


def prompt(seed: int, blocks: int) -> list[int]:
    return [(seed * 7919 + index * 31) % 50_000 for index in range(blocks * BLOCK)]


# --- request helpers --------------------------------------------------------------------------


async def admit(engine: SimEngine, req_id: str, *, advance: float = 0.01) -> int:
    """A new request; its step moves the engine's clock on by `advance` seconds."""
    engine.sim.tally.requests += 1
    result = await engine.step([StartOwner(engine_id=engine.engine_id, req_id=req_id)], advance=advance)
    return next(e for e in result.results[0] if isinstance(e, OwnerStarted)).owner_id


async def allocate(engine: SimEngine, owner: int, count: int, pool_id: int = 0) -> list[BlockRef] | None:
    """The blocks, or None when the coordinator refused (the refusal is in the tally)."""
    result = await engine.step([AllocateBlocks(engine_id=engine.engine_id, owner_id=owner, pool_id=pool_id, count=count)])
    allocated = [e for e in result.results[0] if isinstance(e, BlocksAllocated)]
    return allocated[0].blocks if allocated else None


async def compute(engine: SimEngine, owner: int, blocks: list[BlockRef], tokens: Sequence[int]) -> None:
    engine.compute(blocks, tokens)
    await engine.step([MarkComputed(engine_id=engine.engine_id, owner_id=owner, blocks=blocks, token_ids=list(tokens))])


async def compute_and_store(engine: SimEngine, owner: int, blocks: list[BlockRef], tokens: Sequence[int]) -> StoreJobStarted:
    engine.compute(blocks, tokens)
    result = await engine.step(
        [
            MarkComputed(engine_id=engine.engine_id, owner_id=owner, blocks=blocks, token_ids=list(tokens)),
            StartStore(engine_id=engine.engine_id, tier=TIER, blocks=blocks),
        ]
    )
    [decision] = result.decisions
    assert isinstance(decision.event, StoreJobStarted)
    return decision.event


async def produce(engine: SimEngine, req_id: str, tokens: Sequence[int]) -> StoreJobStarted:
    """A request computes its prompt and stores it; the workers publish it."""
    owner = await admit(engine, req_id)
    blocks = await allocate(engine, owner, len(tokens) // BLOCK)
    assert blocks is not None
    job = await compute_and_store(engine, owner, blocks, tokens)
    await engine.execute()
    await engine.step([FinishOwner(engine_id=engine.engine_id, owner_id=owner)])
    return job


async def load_prefix(
    engine: SimEngine, owner: int, keys: Sequence[bytes], tokens: Sequence[int], *, first_block: int = 0
) -> bool:
    """Load `keys` (the prompt's blocks from `first_block` on, in order) into new blocks, let the
    workers run, and check what landed against recompute. False when the coordinator refused."""
    dests = await allocate(engine, owner, len(keys))
    assert dests is not None
    result = await engine.step(
        [
            StartLoad(
                engine_id=engine.engine_id,
                tier=TIER,
                items=[LoadRequest(key, dest) for key, dest in zip(keys, dests, strict=True)],
            )
        ]
    )
    if not result.decisions:
        engine.compute(dests, tokens, first_block=first_block)  # refused: the engine recomputes instead
        return False
    use_or_recompute(engine, dests, tokens, await engine.execute(), first_block=first_block)
    return True


def use_or_recompute(
    engine: SimEngine, dests: Sequence[BlockRef], tokens: Sequence[int], events: Sequence[Event], *, first_block: int = 0
) -> None:
    """After a load into `dests` ran: if it succeeded the engine uses the blocks, so what landed
    is checked against recompute; if it failed (lease expired, key evicted, checksum mismatch)
    the engine recomputes them, whatever the worker left there."""
    if any(isinstance(e, JobSucceeded) for e in events):
        engine.check([(dest, tokens[: (first_block + index + 1) * BLOCK]) for index, dest in enumerate(dests)])
    else:
        engine.compute(dests, tokens, first_block=first_block)


# --- the scenarios ------------------------------------------------------------------------------


async def duplicate_keys_in_batch_load(sim: Simulation) -> None:
    """Seed 002 (#3929): a batch get naming one key twice filled only the first destination and
    still reported success. Two requests with one prompt load in one batch."""
    engine = await sim.engine("pod-a", namespace(), [attention()])
    tokens = prompt(1, 2)
    stored = await produce(engine, "r1", tokens)
    keys = [item.key for item in stored.items]
    first, second = await admit(engine, "r2"), await admit(engine, "r3")
    mine, theirs = await allocate(engine, first, 2), await allocate(engine, second, 2)
    assert mine is not None and theirs is not None
    engine.compute(theirs, prompt(99, 2))  # what the recycled blocks held before
    items = [LoadRequest(key, dest) for key, dest in zip(keys * 2, mine + theirs, strict=True)]
    await engine.step([StartLoad(engine_id=engine.engine_id, tier=TIER, items=items)])
    await engine.execute()
    engine.check([(dest, tokens[: (index % 2 + 1) * BLOCK]) for index, dest in enumerate(mine + theirs)])


async def _foreign_namespace(sim: Simulation, theirs: NamespaceSpec) -> None:
    """pod-b is told (by a router that does not know namespaces) to reuse pod-a's prefix."""
    a = await sim.engine("pod-a", namespace(), [attention()])
    b = await sim.engine("pod-b", theirs, [attention()])
    tokens = prompt(2, 2)
    stored = await produce(a, "a-1", tokens)
    owner = await admit(b, "b-1")
    await load_prefix(b, owner, [item.key for item in stored.items], tokens)


async def weights_revision_change(sim: Simulation) -> None:
    """Seed 003: a new checkpoint under the same model name; the namespace must change with it."""
    await _foreign_namespace(sim, namespace(weights="sha256:weights-2"))


async def cross_tenant_prefix(sim: Simulation) -> None:
    """Seed 003 / I9: another tenant's cached prefix is another request's KV."""
    await _foreign_namespace(sim, namespace(tenant="tenant-b"))


async def overlapping_state_copy(sim: Simulation) -> None:
    """Seed 000 (the Mamba fix): a chain of state copies run one by one reads a block an
    earlier copy already overwrote."""
    engine = await sim.engine("pod-a", namespace(), [attention()])
    tokens = prompt(3, 3)
    owner = await admit(engine, "r1")
    blocks = await allocate(engine, owner, 3)
    assert blocks is not None
    a, b, c = blocks
    await compute(engine, owner, blocks, tokens)
    moves = [Move(a, 0, b, 0, BLOCK_BYTES), Move(b, 0, c, 0, BLOCK_BYTES)]  # b := a, c := b, at once
    await engine.step([PlanStateCopy(engine_id=engine.engine_id, pool_id=0, moves=moves)])
    await engine.execute()
    engine.check([(b, tokens[:BLOCK]), (c, tokens[: 2 * BLOCK])])


async def preempt_during_async_store(sim: Simulation) -> None:
    """Seed 000: a request is preempted while its blocks are being stored asynchronously; the
    blocks go to another request, which writes them; the late store then saves that request's
    KV under the first one's keys, and a later hit serves it."""
    await freed_under_store(sim, "preempted", prompt(4, 2), prompt(5, 2))


async def freed_under_store(sim: Simulation, reason: str, first_prompt: list[int], second_prompt: list[int]) -> None:
    """The shape of the stores whose source blocks are freed under them: r1 ends (`reason`)
    while its store still runs, r2 takes and writes the blocks, the store lands late, and a
    request with r1's prompt loads what it published."""
    engine = await sim.engine("pod-a", namespace(), [attention(num_blocks=3)])  # two usable blocks
    owner = await admit(engine, "r1")
    blocks = await allocate(engine, owner, 2)
    assert blocks is not None
    store = await compute_and_store(engine, owner, blocks, first_prompt)
    await engine.step([FinishOwner(engine_id=engine.engine_id, owner_id=owner, reason=reason)])
    other = await admit(engine, "r2")
    taken = await allocate(engine, other, 2)
    if taken is None:  # refused: the slots are still pinned by the store (I3); it lands first
        await engine.execute(only=frozenset({store.job_id}))
        taken = await allocate(engine, other, 2)
        assert taken is not None
    await compute(engine, other, taken, second_prompt)
    await engine.execute()  # the (late) store runs now if it has not yet
    await engine.step([FinishOwner(engine_id=engine.engine_id, owner_id=other)])
    again = await admit(engine, "r1-resumed")
    await load_prefix(engine, again, [item.key for item in store.items], first_prompt)


async def duplicate_offload_with_different_bytes(sim: Simulation) -> None:
    """Seed 002 (#3135, #2827): two instances offload the same key at once; one computed a wrong
    byte. A store that silently takes the last writer's bytes serves them to everyone after."""
    a = await sim.engine("pod-a", namespace(), [attention()])
    b = await sim.engine("pod-b", namespace(), [attention()])
    tokens = prompt(6, 2)
    owners = [await admit(a, "a-1"), await admit(b, "b-1")]
    blocks = [await allocate(a, owners[0], 2), await allocate(b, owners[1], 2)]
    assert blocks[0] is not None and blocks[1] is not None
    await compute_and_store(a, owners[0], blocks[0], tokens)
    b.compute(blocks[1], tokens)
    b.workers[0].pools.block(blocks[1][1])[7] ^= 0x40  # a kernel wrote one wrong byte on rank 0
    await b.step(
        [
            MarkComputed(engine_id=b.engine_id, owner_id=owners[1], blocks=blocks[1], token_ids=tokens),
            StartStore(engine_id=b.engine_id, tier=TIER, blocks=blocks[1]),
        ]
    )
    await a.execute()
    await b.execute()  # the second store lands on the published keys with other bytes
    reader = await admit(a, "a-2")
    await load_prefix(a, reader, _keys(a, blocks[0]), tokens)


def _keys(engine: SimEngine, blocks: list[BlockRef]) -> list[bytes]:
    """The content keys the coordinator gave these blocks."""
    assert engine.sim.sidecar is not None
    pool = engine.sim.sidecar.ledger.state.engines[engine.engine_id].pools[blocks[0].pool_id]
    return [key for key in (pool.keys[ref.block_id] for ref in blocks) if key is not None]


async def load_before_compute_complete(sim: Simulation) -> None:
    """I17: a block whose load has not landed yet is claimed as a prefix-cache hit by a second
    request, which reads what the slot held before."""
    engine = await sim.engine("pod-a", namespace(), [attention()])
    tokens = prompt(7, 1)
    stored = await produce(engine, "r1", tokens)
    first = await admit(engine, "r2")
    [slot] = await allocate(engine, first, 1) or []
    engine.compute([slot], prompt(98, 1))  # what the recycled slot held before
    load = await engine.step([StartLoad(engine_id=engine.engine_id, tier=TIER, items=[LoadRequest(stored.items[0].key, slot)])])
    [decision] = load.decisions  # the load is slow: it has not run yet
    second = await admit(engine, "r3")
    reused = await engine.step([ReuseBlocks(engine_id=engine.engine_id, owner_id=second, blocks=[slot])])
    if any(isinstance(e, BlocksReused) for e in reused.results[0]):
        engine.check([(slot, tokens)])  # r3 runs on the slot now, before the load lands
    else:  # refused (not computed): r3 computes its own block
        [own] = await allocate(engine, second, 1) or []
        await compute(engine, second, [own], tokens)
        engine.check([(own, tokens)])
    await engine.execute(only=frozenset({decision.event.job_id}))


def state_pool(num_blocks: int = 64) -> PoolSpec:
    return PoolSpec(pool_id=0, kind="state", num_blocks=num_blocks, block_size=BLOCK, bytes_per_block=BLOCK_BYTES)


async def null_state_publication(sim: Simulation) -> None:
    """Seed 004: a recurrent-state group keeps only the last position's state; the others point
    at the null block. A connector that stores every position publishes the null block's zeros
    as the state at the earlier boundaries, and a request that shares only that prefix loads it."""
    ns = namespace()
    engine = await sim.engine("pod-a", ns, [state_pool()])
    tokens = prompt(8, 2)
    owner = await admit(engine, "r1")
    [last] = await allocate(engine, owner, 1) or []
    engine.compute([last], tokens, first_block=1)
    null = BlockRef(0, NULL_BLOCK_ID, 0)
    positions = [null, last]
    marked = await engine.step([MarkComputed(engine_id=engine.engine_id, owner_id=owner, blocks=positions, token_ids=tokens)])
    if any(isinstance(e, BlocksComputed) for e in marked.results[0]):
        await engine.step([StartStore(engine_id=engine.engine_id, tier=TIER, blocks=positions)])
    else:  # refused (null block): mark only the real state, chained on the prefix before it
        parent = chain_keys(namespace_id(ns), tokens[:BLOCK], BLOCK)[-1]
        await engine.step(
            [
                MarkComputed(
                    engine_id=engine.engine_id, owner_id=owner, blocks=[last], token_ids=tokens[BLOCK:], parent_key=parent
                ),
                StartStore(engine_id=engine.engine_id, tier=TIER, blocks=[last]),
            ]
        )
    await engine.execute()
    await engine.step([FinishOwner(engine_id=engine.engine_id, owner_id=owner)])
    # r2 shares the first block of tokens only.
    other = tokens[:BLOCK] + prompt(9, 1)
    second = await admit(engine, "r2")
    hit = await engine.client.lookup(TIER, other)
    boundary = getattr(hit.answer, "boundary", 0)
    if boundary:
        keys = [key for group in hit.answer.hits for key in group.keys]  # type: ignore[union-attr]
        await load_prefix(engine, second, keys, other[:boundary], first_block=boundary // BLOCK - 1)
    else:
        [own] = await allocate(engine, second, 1) or []
        engine.compute([own], other, first_block=0)
        engine.check([(own, other[:BLOCK])])


async def partial_hash_hit(sim: Simulation) -> None:
    """Seed 002: a hybrid model (attention blocks of 16 tokens, recurrent state every 32) shares
    48 tokens with a cached prompt. Only 32 is a whole reuse unit: at 48 there is no state. A
    lookup at the attention granularity resumes at 48 from the state at 32."""
    ns = msgspec.structs.replace(namespace(), block_sizes=(BLOCK, 2 * BLOCK))
    state = PoolSpec(pool_id=1, kind="state", num_blocks=64, block_size=2 * BLOCK, bytes_per_block=BLOCK_BYTES)
    engine = await sim.engine("pod-a", ns, [attention(), state])
    tokens = prompt(10, 4)
    owner = await admit(engine, "r1")
    attn_blocks, state_blocks = await allocate(engine, owner, 4, 0), await allocate(engine, owner, 2, 1)
    assert attn_blocks is not None and state_blocks is not None
    engine.compute(attn_blocks, tokens)
    engine.compute(state_blocks, tokens)
    await engine.step(
        [
            MarkComputed(engine_id=engine.engine_id, owner_id=owner, blocks=attn_blocks, token_ids=tokens),
            MarkComputed(engine_id=engine.engine_id, owner_id=owner, blocks=state_blocks, token_ids=tokens),
            StartStore(engine_id=engine.engine_id, tier=TIER, blocks=attn_blocks + state_blocks),
        ]
    )
    await engine.execute()
    await engine.step([FinishOwner(engine_id=engine.engine_id, owner_id=owner)])
    other = tokens[: 3 * BLOCK] + prompt(11, 1)  # diverges after 48 tokens
    second = await admit(engine, "r2")
    hit = await engine.client.lookup(TIER, other)
    assert isinstance(hit.answer, PrefixLookedUp)
    boundary = hit.answer.boundary
    items, holdings = [], []
    for group in hit.answer.hits:
        dests = await allocate(engine, second, len(group.keys), group.pool_id)
        assert dests is not None
        for index, (key, dest) in enumerate(zip(group.keys, dests, strict=True)):
            items.append(LoadRequest(key, dest))
            # An attention block holds its own tokens' KV; the state block is what the request
            # resumes from: the state at the boundary.
            holdings.append((dest, other[:boundary] if group.pool_id == 1 else other[: (index + 1) * BLOCK]))
    if items:
        await engine.step([StartLoad(engine_id=engine.engine_id, tier=TIER, items=items)])
        events = await engine.execute()
        if any(type(e).__name__ == "JobSucceeded" for e in events):
            engine.check(holdings)


async def req_id_reuse_after_preemption(sim: Simulation) -> None:
    """Seed 000: a request is preempted while its blocks are still being stored, and resumes
    under the same req_id. When the old attempt's store finishes, a connector that accounts by
    req_id reports "chat-7 finished": the resumed attempt's blocks are freed under it, another
    request takes and writes them, and the resumed request reads that request's KV."""
    engine = await sim.engine("pod-a", namespace(), [attention(num_blocks=5)])  # four usable blocks
    tokens, others = prompt(12, 2), prompt(13, 2)
    first = await admit(engine, "chat-7")
    blocks = await allocate(engine, first, 2)
    assert blocks is not None
    store = await compute_and_store(engine, first, blocks, tokens)
    await engine.step([FinishOwner(engine_id=engine.engine_id, owner_id=first, reason="preempted", req_id="chat-7")])
    resumed = await engine.step([StartOwner(engine_id=engine.engine_id, req_id="chat-7", resumed=True)])
    again = next(e for e in resumed.results[0] if isinstance(e, OwnerStarted)).owner_id
    mine = await allocate(engine, again, 2)
    assert mine is not None
    await compute(engine, again, mine, tokens)
    await engine.execute(only=frozenset({store.job_id}))  # the old attempt's store lands late...
    # ...and the connector says which request finished, by req_id.
    await engine.step([FinishOwner(engine_id=engine.engine_id, owner_id=first, reason="sent", req_id="chat-7")])
    intruder = await admit(engine, "chat-8")
    taken = await allocate(engine, intruder, 4) or await allocate(engine, intruder, 2)
    assert taken is not None
    engine.compute(taken, others + others)
    engine.check([(mine[0], tokens[:BLOCK]), (mine[1], tokens)])  # chat-7 decodes on its blocks


async def reset_with_late_completions(sim: Simulation) -> None:
    """I16 (seed 000): a cache reset while a store is in flight. After the reset the same slots
    go to a new request; the old store completes late and, unfenced, publishes the new request's
    KV under the old prompt's keys."""
    engine = await sim.engine("pod-a", namespace(), [attention(num_blocks=16)])
    tokens, others = prompt(14, 2), prompt(15, 2)
    owner = await admit(engine, "r1")
    blocks = await allocate(engine, owner, 2)
    assert blocks is not None
    store = await compute_and_store(engine, owner, blocks, tokens)
    reset = await engine.client.execute(ResetCache(engine_id=engine.engine_id, reason="reset_prefix_cache"))
    sim.tally.record(reset.events)
    fresh = await admit(engine, "r2")
    reused = await allocate(engine, fresh, 2)
    assert reused is not None
    await compute(engine, fresh, reused, others)
    await engine.execute(only=frozenset({store.job_id}))  # the old incarnation's store, late
    reader = await admit(engine, "r3")
    hit = await engine.client.lookup(TIER, tokens)
    keys = [key for group in getattr(hit.answer, "hits", []) for key in group.keys]
    if keys:
        await load_prefix(engine, reader, keys, tokens)
    else:
        mine = await allocate(engine, reader, 2)
        assert mine is not None
        await compute(engine, reader, mine, tokens)
        engine.check([(mine[0], tokens[:BLOCK]), (mine[1], tokens)])


SMALL_TIER = 2
"""Tier slots for the slow-load scenarios: one two-block prompt fills the tier."""


async def _slow_load_under_store_pressure(sim: Simulation, *, lease_seconds: float, pause: float, prompts: int = 1) -> None:
    """The shape the slow-load scenarios share. r1's prompt (or `prompts` prompts, the first
    one's stored first) fills the (slot-addressed) tier; r2 starts one load of them all with a
    lease of `lease_seconds`, but the worker is slow: the load is held. `pause` seconds of
    engine clock later r3 stores another prompt; under store pressure that evicts the first
    prompt's keys and their slots go to r3's store, which lands. Then r2's load runs: the slots
    it was told to read hold r3's bytes now."""
    engine = await sim.engine("pod-a", namespace(), [attention()])
    cached = [prompt(16 + 2 * index, 2) for index in range(prompts)]
    others = prompt(17, 2)
    stored = [await produce(engine, f"r1-{index}", tokens) for index, tokens in enumerate(cached)]
    reader = await admit(engine, "r2")
    dests = await allocate(engine, reader, 2 * prompts)
    assert dests is not None
    keys = [item.key for job in stored for item in job.items]
    items = [LoadRequest(key, dest) for key, dest in zip(keys, dests, strict=True)]
    load = await engine.step([StartLoad(engine_id=engine.engine_id, tier=TIER, items=items, lease_seconds=lease_seconds)])
    [decision] = load.decisions
    slow = frozenset({decision.event.job_id})
    writer = await admit(engine, "r3", advance=pause)
    blocks = await allocate(engine, writer, 2)
    assert blocks is not None
    engine.compute(blocks, others)
    # The tier is full: the first prompt's keys are evicted unless a live lease holds them (I12),
    # and then the store is refused (TIER_FULL) and the load lands first.
    await engine.step(
        [
            MarkComputed(engine_id=engine.engine_id, owner_id=writer, blocks=blocks, token_ids=others),
            StartStore(engine_id=engine.engine_id, tier=TIER, blocks=blocks),
        ]
    )
    await engine.execute(hold=slow)  # r3's store lands in the slots the first prompt's keys had
    landed = await engine.execute(only=slow)
    for index, tokens in enumerate(cached):
        use_or_recompute(engine, dests[2 * index : 2 * index + 2], tokens, landed)


async def lease_expiry_during_slow_load(sim: Simulation) -> None:
    """I12 (seed 002, Mooncake #4153). Mooncake's memory read path holds a read lease: eviction
    skips leased keys and a read that outlived its lease fails loudly (LEASE_EXPIRED) after the
    transfer. Its offload read path had no lease check, and the object CRC behind
    MOONCAKE_STORE_CHECKSUM is off by default; the thread names an offload read "that outlives its
    10s master lease, or that races an eviction plus backing-slot reuse" as the one silent
    channel left.
    (It then finds the offload files are per key, so that backend cannot alias a slot, and
    settles the incident on #3929; this scenario shows the channel on a slot-addressed tier,
    gpu.tiers.SlotTier, where it exists.) Baseline: CHECKSUMS off in both runs. The load's lease
    (1 s) is over when r3's store evicts r1's keys. On: the late load fails with LEASE_EXPIRED
    and the engine recomputes. Off: it counts as success, with r3's bytes."""
    await _slow_load_under_store_pressure(sim, lease_seconds=1.0, pause=5.0)


async def eviction_under_store_pressure(sim: Simulation) -> None:
    """I13 (seed 002, Mooncake #4153: a store 92% full under eviction churn; "eviction-race
    aliasing, a key mapping to a replica that was evicted and reallocated under pressure").
    Baseline: LEASES off in both runs, as on the offload read path, so a key being read is
    evicted under store pressure while its lease is still live and its slot is reused by r3's
    store before the read lands. Only the object checksum is left, and MOONCAKE_STORE_CHECKSUM is
    off by default. On: the worker finds the bytes differ from the published checksum and copies
    nothing; the load fails (CHECKSUM_MISMATCH; the key is gone, so there is nothing left to
    quarantine) and the engine recomputes. Off: the load copies r3's bytes and succeeds."""
    await _slow_load_under_store_pressure(sim, lease_seconds=30.0, pause=0.01)


class EncoderCache:
    """The model runner's encoder-output cache: slots of bytes, filled when the scheduler
    allocates an entry, released when a StepEnded notice says the entry was freed."""

    def __init__(self, engine: SimEngine, slots: int) -> None:
        self.engine = engine
        self.data = torch.zeros((slots, BLOCK_BYTES), dtype=torch.uint8)
        self.where: dict[str, int] = {}

    def output(self, entry_id: str) -> torch.Tensor:
        """What the encoder computes for this entry (a multimodal item's hash)."""
        return kv_bytes(self.engine.namespace, list(entry_id.encode()), ENCODER_GROUP, 0, BLOCK_BYTES)

    def fill(self, entry_id: str) -> int:
        slot = min(set(range(self.data.shape[0])) - set(self.where.values()))
        self.where[entry_id] = slot
        self.data[slot] = self.output(entry_id)
        return slot

    def apply(self, ended: Sequence[object]) -> None:
        for event in ended:
            if isinstance(event, StepEnded):
                for entry_id in event.freed_encoder_entries:
                    self.where.pop(entry_id, None)


async def stale_encoder_eviction(sim: Simulation) -> None:
    """Seed 000 (the encoder cache fix): an image's entry is freed and allocated again in one
    step; a freed notice sent anyway makes the runner evict it, the slot goes to the next image,
    and the request reads that image's encoder output as its own."""
    engine = await sim.engine("pod-a", namespace(), [attention()], encoder_cache_tokens=64)
    cache = EncoderCache(engine, slots=4)
    sim.tally.requests += 2
    a = AllocateEncoderEntry(engine_id=engine.engine_id, entry_id="img-a", num_tokens=16)
    first = await engine.step([a])
    cache.fill("img-a")
    cache.apply(first.ended)
    # The first request finishes with img-a; a second request brings the same image back.
    second = await engine.step([FreeEncoderEntry(engine_id=engine.engine_id, entry_id="img-a"), a])
    slot = cache.fill("img-a") if "img-a" not in cache.where else cache.where["img-a"]
    cache.apply(second.ended)
    third = await engine.step([AllocateEncoderEntry(engine_id=engine.engine_id, entry_id="img-b", num_tokens=16)])
    cache.fill("img-b")
    cache.apply(third.ended)
    # The second request's forward pass reads img-a's output where the scheduler put it.
    wrong = int(not torch.equal(cache.data[slot], cache.output("img-a")))
    sim.tally.loads_checked += 1
    sim.tally.wrong_reads += wrong


class Scenario(msgspec.Struct, frozen=True):
    name: str
    protection: Protection
    invariant: str
    run: Run
    evidence: str
    """What the on run records instead of the wrong read (a refusal reason, or a decision);
    empty when it records nothing of the kind: the protection leaves nothing wrong to refuse
    (a new object a generation: the right bytes are read)."""
    baseline: frozenset[Protection] = frozenset()
    """Protections off in both runs: the seed's deployment, where `protection` is the last
    safety net left (coordinator/core/protections.py). Never includes `protection` itself."""
    tier_slots: int = 4096
    """The size of the simulation's shared tier (small: stores evict)."""
    report: str = ""
    """The public report(s) the scenario reproduces (a seed, or an issue thread)."""
    disk_tier: bool = False
    """The shared tier is a file per key (gpu.tiers.DiskTier) instead of slots of memory."""

    def off(self, *, protection_on: bool) -> frozenset[Protection]:
        """What one run switches off: the baseline, and the scenario's protection in the off run."""
        return self.baseline if protection_on else self.baseline | {self.protection}


SCENARIOS = {
    scenario.name: scenario
    for scenario in (
        Scenario(
            "req-id-reuse-after-preemption",
            Protection.JOB_IDENTITY,
            "I4",
            req_id_reuse_after_preemption,
            "Refused:unknown_owner",
            report="seed 000",
        ),
        Scenario(
            "reset-with-late-completions",
            Protection.FENCING,
            "I16",
            reset_with_late_completions,
            "FencedRankDone:late_report",
            report="seed 000",
        ),
        Scenario(
            "stale-encoder-eviction",
            Protection.END_OF_STEP,
            "I14",
            stale_encoder_eviction,
            "NoticeDropped:reallocated_in_step",
            report="seed 000",
        ),
        Scenario(
            "preempt-during-async-store",
            Protection.PINS,
            "I3",
            preempt_during_async_store,
            "Refused:pool_exhausted",
            report="seed 000",
        ),
        Scenario(
            "overlapping-state-copy", Protection.ORDERED_COPIES, "I15", overlapping_state_copy, "ordered plan", report="seed 000"
        ),
        Scenario(
            "duplicate-keys-in-batch-load",
            Protection.LOAD_DEDUPE,
            "I11",
            duplicate_keys_in_batch_load,
            "every destination verified",
            report="seed 002 (Mooncake #3929)",
        ),
        Scenario(
            "weights-revision-change-under-same-model-name",
            Protection.NAMESPACE_WEIGHTS,
            "I9",
            weights_revision_change,
            "Refused:key_not_published",
            report="seed 003",
        ),
        Scenario(
            "cross-tenant-prefix",
            Protection.NAMESPACE_TENANT,
            "I9",
            cross_tenant_prefix,
            "Refused:key_not_published",
            report="seed 003",
        ),
        Scenario(
            "duplicate-offload-with-different-bytes",
            Protection.IDEMPOTENT_STORE,
            "I10",
            duplicate_offload_with_different_bytes,
            "KeyQuarantined:checksum_mismatch",
            report="seed 002 (Mooncake #3135, #2827)",
        ),
        Scenario(
            "partial-hash-hit", Protection.WHOLE_UNITS, "I7", partial_hash_hit, "boundary at a whole unit", report="seed 002"
        ),
        Scenario(
            "null-state-publication",
            Protection.NULL_STATES,
            "I2",
            null_state_publication,
            "Refused:null_block",
            report="seed 004",
        ),
        Scenario(
            "load-before-compute-complete",
            Protection.VISIBLE_WHEN_COMPLETE,
            "I17",
            load_before_compute_complete,
            "Refused:not_computed",
            report="I17 (seed 000)",
        ),
        Scenario(
            "lease-expiry-during-slow-load",
            Protection.LEASES,
            "I12",
            lease_expiry_during_slow_load,
            "JobFailed:lease_expired",
            baseline=frozenset({Protection.CHECKSUMS}),
            tier_slots=SMALL_TIER,
            report="seed 002 (Mooncake #4153)",
        ),
        Scenario(
            "eviction-under-store-pressure",
            Protection.CHECKSUMS,
            "I13",
            eviction_under_store_pressure,
            "JobFailed:checksum_mismatch",
            baseline=frozenset({Protection.LEASES}),
            tier_slots=SMALL_TIER,
            report="seed 002 (Mooncake #4153)",
        ),
    )
}


class Outcome(msgspec.Struct, frozen=True, kw_only=True):
    scenario: str
    invariant: str
    protection_on: bool
    requests: int
    wrong_reads: int
    loads_checked: int
    refusals: dict[str, int]
    events: int
    seconds: float
    log: str = ""
    report: str = ""
    """The public report(s) the scenario reproduces."""
    evidence: str = ""
    """What the on run should record instead of the wrong read (Scenario.evidence)."""
    baseline: list[str] = []
    """The scenario's baseline: protections off in both of its runs (sorted)."""
    protections_off: list[str] = []
    """What this run switched off (sorted): the baseline, and the scenario's protection when off."""


async def run_scenario(
    scenario: Scenario, *, protection_on: bool, directory: Path | None = None, tier: Callable[[int], Tier] | None = None
) -> Outcome:
    """One run; `tier` makes each rank's shared tier (a Mooncake Store's, for the scenarios that
    need one: coordinator/simulator/reported.py's MOONCAKE)."""
    off = scenario.off(protection_on=protection_on)
    started = time.perf_counter()
    async with Simulation(directory, off, tier_slots=scenario.tier_slots, disk_tier=scenario.disk_tier, tier=tier) as sim:
        await scenario.run(sim)
        tally: Tally = sim.tally
        where = str(sim.log_path) if directory is not None else ""
    return Outcome(
        scenario=scenario.name,
        invariant=scenario.invariant,
        protection_on=protection_on,
        requests=tally.requests,
        wrong_reads=tally.wrong_reads,
        loads_checked=tally.loads_checked,
        refusals=dict(sorted(tally.refusals.items())),
        events=tally.events,
        seconds=time.perf_counter() - started,
        log=where,
        report=scenario.report,
        evidence=scenario.evidence,
        baseline=sorted(p.value for p in scenario.baseline),
        protections_off=sorted(p.value for p in off),
    )
