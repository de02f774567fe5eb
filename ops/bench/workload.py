"""A seeded serving workload driven through the real decider, for benchmarks.

Requests share a few system prompts, so lookups hit and loads happen; requests finish (and
store their blocks) or get preempted and resume; ranks report in random order, sometimes
twice; encoder entries churn; state copies run. Every event comes from the decider, so the
mix is what a real engine would produce.
"""

from __future__ import annotations

import random
from collections.abc import Iterator

from coordinator.core import CoordinatorCore
from coordinator.core.commands import (
    AllocateBlocks,
    AllocateEncoderEntry,
    BeginStep,
    DeclareEngine,
    DeclareTier,
    EndStep,
    FinishOwner,
    FreeEncoderEntry,
    LoadRequest,
    LookupPrefix,
    MarkComputed,
    Move,
    PlanStateCopy,
    ReportRank,
    StartLoad,
    StartOwner,
    StartStore,
)
from events import (
    BlockRef,
    BlocksAllocated,
    Event,
    LoadJobStarted,
    NamespaceSpec,
    OwnerStarted,
    PoolSpec,
    PrefixLookedUp,
    StateCopyPlanned,
    StoreJobStarted,
    TierSpec,
)

ENGINE = "bench-engine"
ATTN, STATE = 0, 1
BLOCK, STATE_BLOCK = 16, 64
WORLD = 2


class Workload:
    def __init__(self, seed: int = 7, num_blocks: int = 4096, tier_slots: int = 8192) -> None:
        self.rng = random.Random(seed)
        self.core = CoordinatorCore()
        self.step = 0
        self.running: dict[int, dict[int, list[BlockRef]]] = {}
        self.decoding: dict[int, list[int]] = {}
        """owner -> [tokens written into its last block]: decode growth."""
        self.jobs: dict[int, tuple[int, list[bytes]]] = {}
        self.encoder: list[str] = []
        self.prompts = [[self.rng.randrange(50_000) for _ in range(512)] for _ in range(8)]
        ns = NamespaceSpec(
            model_id="bench/model",
            weights_revision="sha256:bench",
            tokenizer_digest="sha256:tok",
            kv_dtype="bfloat16",
            kv_layout_version=1,
            block_sizes=(BLOCK, STATE_BLOCK),
            tensor_parallel_size=WORLD,
            tenant="bench",
        )
        self.core.execute(DeclareTier(spec=TierSpec(name="host", num_slots=tier_slots, bytes_per_slot=1 << 16)))
        self.core.execute(
            DeclareEngine(
                engine_id=ENGINE,
                namespace=ns,
                world_size=WORLD,
                tiers=["host"],
                encoder_cache_tokens=4096,
                pools=[
                    PoolSpec(pool_id=ATTN, kind="attention", num_blocks=num_blocks, block_size=BLOCK, bytes_per_block=1 << 16),
                    PoolSpec(
                        pool_id=STATE, kind="state", num_blocks=num_blocks // 4, block_size=STATE_BLOCK, bytes_per_block=1 << 16
                    ),
                ],
            )
        )

    def _x(self, command: object) -> list[Event]:
        return self.core.execute(command)  # type: ignore[arg-type]

    def _report(self, job_id: int, keys: list[bytes]) -> None:
        ranks = list(range(WORLD))
        self.rng.shuffle(ranks)
        for rank in ranks:
            sums = [key[:4] + bytes([rank]) for key in keys]
            self._x(ReportRank(job_id=job_id, rank=rank, ok=True, checksums=sums))
            if self.rng.random() < 0.05:  # a duplicate report: dropped
                self._x(ReportRank(job_id=job_id, rank=rank, ok=True, checksums=sums))

    def _track(self, events: list[Event]) -> None:
        for event in events:
            if isinstance(event, StoreJobStarted) and event.items:
                self.jobs[event.job_id] = (event.job_id, [item.key for item in event.items])
            elif isinstance(event, LoadJobStarted):
                self.jobs[event.job_id] = (event.job_id, [item.key for item in event.items])
            elif isinstance(event, StateCopyPlanned) and event.batches:
                self.jobs[event.job_id] = (event.job_id, [])

    def _admit(self) -> None:
        prompt = self.rng.choice(self.prompts)[: self.rng.choice((128, 256, 384, 512))]
        tail = [self.rng.randrange(50_000) for _ in range(self.rng.randrange(0, 64))]
        tokens = prompt + tail
        owner = self._x(StartOwner(engine_id=ENGINE, req_id=f"r{self.rng.randrange(1000)}"))[0]
        assert isinstance(owner, OwnerStarted)
        hit = self._x(LookupPrefix(engine_id=ENGINE, tier="host", token_ids=tokens))[0]
        assert isinstance(hit, PrefixLookedUp)
        n_attn, n_state = len(tokens) // BLOCK, 1
        attn = self._x(AllocateBlocks(engine_id=ENGINE, owner_id=owner.owner_id, pool_id=ATTN, count=max(n_attn, 1)))[0]
        state = self._x(AllocateBlocks(engine_id=ENGINE, owner_id=owner.owner_id, pool_id=STATE, count=n_state))[0]
        if not isinstance(attn, BlocksAllocated) or not isinstance(state, BlocksAllocated):
            self._x(FinishOwner(engine_id=ENGINE, owner_id=owner.owner_id, reason="rejected"))
            return
        blocks = attn.blocks
        loaded = 0
        if hit.boundary:
            keys = hit.hits[0].keys
            loaded = len(keys)
            self._track(
                self._x(StartLoad(engine_id=ENGINE, tier="host", items=[LoadRequest(k, b) for k, b in zip(keys, blocks)]))
            )
        if n_attn > loaded:
            parent = hit.hits[0].keys[-1] if hit.boundary else None
            self._x(
                MarkComputed(
                    engine_id=ENGINE,
                    owner_id=owner.owner_id,
                    blocks=blocks[loaded:n_attn],
                    token_ids=tokens[loaded * BLOCK : n_attn * BLOCK],
                    parent_key=parent,
                )
            )
        if len(tokens) >= STATE_BLOCK:
            self._x(MarkComputed(engine_id=ENGINE, owner_id=owner.owner_id, blocks=state.blocks, token_ids=tokens[:STATE_BLOCK]))
        self.running[owner.owner_id] = {ATTN: list(blocks), STATE: state.blocks}
        self.decoding[owner.owner_id] = [len(tokens) - n_attn * BLOCK]
        if len(tokens) % BLOCK == 0 or n_attn == 0:
            self._grow(owner.owner_id)

    def _grow(self, owner_id: int) -> bool:
        """Allocate the next block of a decoding request; False under pool pressure."""
        event = self._x(AllocateBlocks(engine_id=ENGINE, owner_id=owner_id, pool_id=ATTN, count=1))[0]
        if not isinstance(event, BlocksAllocated):
            return False
        self.running[owner_id][ATTN].append(event.blocks[0])
        self.decoding[owner_id][0] = 0
        return True

    def _decode(self) -> None:
        """Every running request produces one token; a full block is marked computed."""
        for owner_id, blocks in list(self.running.items()):
            progress = self.decoding[owner_id]
            progress[0] += 1
            if progress[0] == BLOCK:
                self._x(
                    MarkComputed(
                        engine_id=ENGINE,
                        owner_id=owner_id,
                        blocks=[blocks[ATTN][-1]],
                        token_ids=[self.rng.randrange(50_000) for _ in range(BLOCK)],
                        parent_key=self.core.state.engines[ENGINE].pools[ATTN].keys[blocks[ATTN][-2].block_id]
                        if len(blocks[ATTN]) > 1
                        else None,
                    )
                )
                if not self._grow(owner_id):
                    self._finish(owner_id, "preempted")

    def _finish(self, owner_id: int, reason: str) -> None:
        blocks = self.running.pop(owner_id)
        del self.decoding[owner_id]
        computed = [
            b
            for b in blocks[ATTN] + blocks[STATE]
            if self.core.state.engines[ENGINE].pools[b.pool_id].keys[b.block_id] is not None
        ]
        if computed and self.rng.random() < 0.7:
            self._track(self._x(StartStore(engine_id=ENGINE, tier="host", blocks=computed)))
        if self.rng.random() < 0.1 and len(blocks[STATE]) == 1:
            s = blocks[STATE][0]
            self._track(self._x(PlanStateCopy(engine_id=ENGINE, pool_id=STATE, moves=[Move(s, 64, s, 0, 1024)])))
        self._x(FinishOwner(engine_id=ENGINE, owner_id=owner_id, reason=reason))

    def step_once(self) -> None:
        self.step += 1
        self._x(BeginStep(engine_id=ENGINE, step=self.step, clock=self.step * 0.05))
        if len(self.running) < 96:
            for _ in range(self.rng.randrange(0, 3)):
                self._admit()
        for job_id in [j for j in list(self.jobs) if self.rng.random() < 0.6]:
            self._report(*self.jobs.pop(job_id))
        self._decode()
        for owner_id in [o for o in list(self.running) if self.rng.random() < 0.01]:
            self._finish(owner_id, "preempted" if self.rng.random() < 0.1 else "finished")
        if self.rng.random() < 0.3:
            entry = f"img-{self.rng.randrange(64)}"
            if entry in self.core.state.engines[ENGINE].encoder_entries:
                self._x(FreeEncoderEntry(engine_id=ENGINE, entry_id=entry))
            self._x(AllocateEncoderEntry(engine_id=ENGINE, entry_id=entry, num_tokens=self.rng.randrange(16, 256)))
        self._x(EndStep(engine_id=ENGINE))

    def run(self, min_events: int) -> Iterator[int]:
        """Step until `min_events` events exist; yields the event count now and then."""
        while len(self.core.events) < min_events:
            self.step_once()
            if self.step % 2000 == 0:
                yield len(self.core.events)
