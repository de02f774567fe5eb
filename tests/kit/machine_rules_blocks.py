"""The state machine's rules for steps, owners and blocks, and the encoder cache."""

from __future__ import annotations

from hypothesis import strategies as st
from hypothesis.stateful import precondition, rule

from coordinator.core.commands import (
    AllocateBlocks,
    AllocateEncoderEntry,
    BeginStep,
    EndStep,
    FinishOwner,
    FreeBlocks,
    FreeEncoderEntry,
    LoadRequest,
    LookupPrefix,
    MarkComputed,
    ReuseBlocks,
    StartLoad,
    StartOwner,
    StartStore,
)
from coordinator.core.keys import chain_keys
from coordinator.core.state import (
    OwnerState,
)
from events import (
    BlockRef,
    BlocksAllocated,
    BlocksComputed,
    BlocksReleased,
    BlocksReused,
    ComputedBlock,
    EncoderEntryAllocated,
    EncoderEntryFreed,
    Event,
    LoadJobStarted,
    NoticeDropped,
    OwnerFinished,
    OwnerStarted,
    PrefixLookedUp,
    Reason,
    Refused,
    StepBegan,
    StepEnded,
    StoreJobStarted,
)
from tests.kit.builders import (
    ENGINE,
    TIER,
)
from tests.kit.machine import ATTENTION, CLOCK_ADVANCES, DOCS, ENCODER_ENTRIES, ENCODER_TOKENS, LEASES, STATE, MachineBase


class BlockRules(MachineBase):
    # --- steps ---------------------------------------------------------------------------------

    @precondition(lambda self: not self.step_open)
    @rule(advance=st.sampled_from(CLOCK_ADVANCES), skip=st.integers(1, 2))
    def begin_step(self, advance: float, skip: int) -> None:
        step, clock = self.engine.step + skip, self.engine.clock + advance
        events = self.execute(BeginStep(engine_id=ENGINE, step=step, clock=clock))
        assert events == [StepBegan(engine_id=ENGINE, step=step, clock=clock)]
        self.step_open = True

    @precondition(lambda self: self.step_open)
    @rule()
    def end_step(self) -> None:
        events = self.execute(EndStep(engine_id=ENGINE))
        *dropped, ended = events
        assert isinstance(ended, StepEnded), events
        assert all(isinstance(d, NoticeDropped) and d.reason == Reason.REALLOCATED_IN_STEP for d in dropped), dropped
        # I14: the freed notices describe the state at the end of the step, once each.
        assert len(set(ended.freed_blocks)) == len(ended.freed_blocks), ended
        for ref in ended.freed_blocks:
            pool = self.pool(ref.pool_id)
            assert pool.generations[ref.block_id] == ref.generation, ref
            assert ref.block_id in pool.free or ref.block_id in pool.cached, ref
        entries = self.engine.encoder_entries
        assert ended.freed_encoder_entries == [e for e in self.freed_encoder_in_step if e not in entries]
        for entry_id in self.freed_encoder_in_step:
            if entry_id in entries:  # freed and re-allocated in this step: the notice is dropped
                assert any(
                    isinstance(d, NoticeDropped) and d.notice == "encoder_entry_freed" and repr(entry_id) in d.detail
                    for d in dropped
                ), dropped
        self.step_open = False
        self.freed_encoder_in_step = {}

    # --- owners and blocks ---------------------------------------------------------------------

    @rule(req_id=st.sampled_from(("req-1", "req-2", "req-3")))
    def start_owner(self, req_id: str) -> None:
        self.new_owner(req_id)

    def finish(self, own: OwnerState, reason: str) -> None:
        held = self.held(own)
        events = self.execute(FinishOwner(engine_id=ENGINE, owner_id=own.owner_id, reason=reason))
        expected: list[Event] = []
        if held:
            expected.append(BlocksReleased(engine_id=ENGINE, owner_id=own.owner_id, blocks=held))
        expected.append(OwnerFinished(engine_id=ENGINE, owner_id=own.owner_id, reason=reason))
        assert events == expected
        assert own.owner_id not in self.core.state.owners

    @rule(data=st.data(), reason=st.sampled_from(("finished", "aborted")))
    def finish_owner(self, data: st.DataObject, reason: str) -> None:
        self.finish(self.pick_owner(data), reason)

    @rule(data=st.data(), take_back_prefix=st.booleans())
    def preempt_and_resume(self, data: st.DataObject, take_back_prefix: bool) -> None:
        """A preempted request that resumes is a new owner with the same req_id."""
        own = self.pick_owner(data)
        computed = [ref for ref in self.held(own) if self.pool(ref.pool_id).keys[ref.block_id] is not None]
        self.finish(own, "preempted")
        resumed_id = self.core.state.next_owner_id
        events = self.execute(StartOwner(engine_id=ENGINE, req_id=own.req_id, resumed=True))
        assert events == [OwnerStarted(engine_id=ENGINE, owner_id=resumed_id, req_id=own.req_id, resumed=True)]
        assert resumed_id != own.owner_id  # req_id is metadata, never identity
        if take_back_prefix:
            # The resumed owner takes back what is still cached at the same generation.
            still = [
                ref
                for ref in computed
                if self.pool(ref.pool_id).generations[ref.block_id] == ref.generation
                and self.pool(ref.pool_id).keys[ref.block_id] is not None
            ]
            if still:
                events = self.execute(ReuseBlocks(engine_id=ENGINE, owner_id=resumed_id, blocks=still))
                assert events == [BlocksReused(engine_id=ENGINE, owner_id=resumed_id, blocks=still)]

    @rule(data=st.data(), pool_id=st.sampled_from((ATTENTION, STATE)), count=st.integers(1, 3))
    def allocate_blocks(self, data: st.DataObject, pool_id: int, count: int) -> None:
        own = self.pick_owner(data)
        pool = self.pool(pool_id)
        available = len(pool.free) + len(pool.cached)
        generations, refs, pins = list(pool.generations), list(pool.refs), list(pool.pins)
        events = self.execute(AllocateBlocks(engine_id=ENGINE, owner_id=own.owner_id, pool_id=pool_id, count=count))
        if count > available:
            self.rejected(events, Reason.POOL_EXHAUSTED)
            return
        [allocated] = events
        assert isinstance(allocated, BlocksAllocated), events
        assert len({ref.block_id for ref in allocated.blocks}) == count
        for ref in allocated.blocks:
            assert ref.pool_id == pool_id and ref.block_id != 0, ref  # I2
            assert ref.generation == generations[ref.block_id] + 1, ref  # I1
            assert refs[ref.block_id] == 0, f"{ref} was held by an owner"
            assert pins[ref.block_id] == 0, f"{ref} was reallocated while a job in flight pinned it (I3)"

    @precondition(lambda self: any(self.held(o) for o in self.owners()))
    @rule(data=st.data())
    def free_blocks(self, data: st.DataObject) -> None:
        self.ensure_step()
        own = data.draw(st.sampled_from([o for o in self.owners() if self.held(o)]))
        held = self.held(own)
        chosen = data.draw(st.lists(st.sampled_from(held), min_size=1, max_size=len(held), unique=True))
        events = self.execute(FreeBlocks(engine_id=ENGINE, owner_id=own.owner_id, blocks=chosen))
        assert events == [BlocksReleased(engine_id=ENGINE, owner_id=own.owner_id, blocks=chosen)]

    def writable(self, own: OwnerState, pool_id: int) -> list[BlockRef]:
        """The owner's blocks in `pool_id` that MarkComputed accepts: not computed, not pinned."""
        pool = self.pool(pool_id)
        return [
            BlockRef(pool_id, block_id, generation)
            for block_id, generation in own.blocks.get(pool_id, {}).items()
            if pool.keys[block_id] is None and pool.pins[block_id] == 0
        ]

    def compute(self, own: OwnerState, blocks: list[BlockRef], doc: list[int]) -> None:
        """MarkComputed `blocks` (one pool) with the start of `doc`; keys must chain (I8)."""
        size = self.pool(blocks[0].pool_id).spec.block_size
        tokens = doc[: size * len(blocks)]
        events = self.execute(MarkComputed(engine_id=ENGINE, owner_id=own.owner_id, blocks=blocks, token_ids=tokens))
        keys = chain_keys(self.engine.namespace_id, tokens, size)  # the same chain lookups use
        assert events == [
            BlocksComputed(engine_id=ENGINE, blocks=[ComputedBlock(ref, key) for ref, key in zip(blocks, keys, strict=True)])
        ]

    @rule(data=st.data(), doc=st.sampled_from(DOCS), pool_id=st.sampled_from((ATTENTION, STATE)))
    def mark_computed(self, data: st.DataObject, doc: list[int], pool_id: int) -> None:
        own = self.pick_owner(data)
        refs = self.writable(own, pool_id) or self.try_allocate(own, pool_id, 2)
        if not refs:
            return
        size = self.pool(pool_id).spec.block_size
        blocks = data.draw(st.lists(st.sampled_from(refs), min_size=1, max_size=min(len(refs), len(doc) // size), unique=True))
        self.compute(own, blocks, doc)

    @rule(
        data=st.data(),
        doc=st.sampled_from(DOCS),
        attention_blocks=st.integers(1, 4),
        state_blocks=st.integers(1, 2),
        then=st.sampled_from(("compute", "store", "publish", "load_prefix")),
        lease_seconds=st.sampled_from(LEASES),
    )
    def schedule_request(
        self,
        data: st.DataObject,
        doc: list[int],
        attention_blocks: int,
        state_blocks: int,
        then: str,
        lease_seconds: float,
    ) -> None:
        """A whole scheduler turn for a new request: look its prefix up and load the hit, or
        allocate in both groups and compute it, then maybe store it (and have every rank report
        success, in a random order, so the keys publish)."""
        self.ensure_step()
        self.new_owner("req-" + str(DOCS.index(doc)))
        own = self.owners()[-1]
        if then == "load_prefix":
            [looked] = self.execute(LookupPrefix(engine_id=ENGINE, tier=TIER, token_ids=doc))
            assert isinstance(looked, PrefixLookedUp)
            items = []
            for hit in looked.hits:
                dests = self.try_allocate(own, hit.pool_id, len(hit.keys))
                items += [LoadRequest(key, dest) for key, dest in zip(hit.keys, dests)]
            if items:
                events = self.execute(StartLoad(engine_id=ENGINE, tier=TIER, items=items, lease_seconds=lease_seconds))
                assert isinstance(events[0], LoadJobStarted), events
            return
        computed: list[BlockRef] = []
        for pool_id, count in ((ATTENTION, attention_blocks), (STATE, state_blocks)):
            blocks = self.try_allocate(own, pool_id, count)
            if blocks:
                self.compute(own, blocks, doc)
                computed += blocks
        if then in ("store", "publish") and computed:
            events = self.execute(StartStore(engine_id=ENGINE, tier=TIER, blocks=computed))
            if isinstance(events[0], Refused):
                self.rejected(events, Reason.TIER_FULL)
                return
            [started] = [e for e in events if isinstance(e, StoreJobStarted)]
            if then == "publish" and self.jobs[started.job_id].status == "open":
                self.complete(data, started.job_id)

    @rule(data=st.data())
    def reuse_blocks(self, data: st.DataObject) -> None:
        own = self.pick_owner(data)
        candidates = [
            pool.ref(block_id)
            for pool_id, pool in self.engine.pools.items()
            for block_id in range(1, pool.spec.num_blocks)
            if pool.keys[block_id] is not None and block_id not in own.blocks.get(pool_id, {})
        ]
        if not candidates:
            return
        chosen = data.draw(st.lists(st.sampled_from(candidates), min_size=1, max_size=2, unique=True))
        events = self.execute(ReuseBlocks(engine_id=ENGINE, owner_id=own.owner_id, blocks=chosen))
        assert events == [BlocksReused(engine_id=ENGINE, owner_id=own.owner_id, blocks=chosen)]

    # --- encoder cache -------------------------------------------------------------------------

    @rule(entry_id=st.sampled_from(ENCODER_ENTRIES), num_tokens=st.integers(1, 5))
    def allocate_encoder_entry(self, entry_id: str, num_tokens: int) -> None:
        self.ensure_step()
        eng = self.engine
        cached, used = entry_id in eng.encoder_entries, eng.encoder_used
        events = self.execute(AllocateEncoderEntry(engine_id=ENGINE, entry_id=entry_id, num_tokens=num_tokens))
        if cached:
            self.rejected(events, Reason.ALREADY_HELD)
        elif used + num_tokens > ENCODER_TOKENS:
            self.rejected(events, Reason.ENCODER_CACHE_FULL)
        else:
            assert events == [EncoderEntryAllocated(engine_id=ENGINE, entry_id=entry_id, num_tokens=num_tokens)]

    @rule(data=st.data(), cached_one=st.booleans())
    def free_encoder_entry(self, data: st.DataObject, cached_one: bool) -> None:
        """Free a cached entry, or (a stale notice) one that is not cached."""
        self.ensure_step()
        entries = sorted(self.engine.encoder_entries) if cached_one else []
        entry_id = data.draw(st.sampled_from(entries or ENCODER_ENTRIES))
        cached = entry_id in self.engine.encoder_entries
        events = self.execute(FreeEncoderEntry(engine_id=ENGINE, entry_id=entry_id))
        if not cached:
            event = self.rejected(events, Reason.UNKNOWN_SLOT)
            assert repr(entry_id) in event.detail
            return
        assert events == [EncoderEntryFreed(engine_id=ENGINE, entry_id=entry_id)]
        self.freed_encoder_in_step[entry_id] = None

    @precondition(lambda self: bool(self.engine.encoder_entries))
    @rule(data=st.data())
    def free_and_reallocate_encoder_entry(self, data: st.DataObject) -> None:
        """Freed and re-allocated in one step: the freed notice must not survive the step (I14)."""
        self.ensure_step()
        entry_id = data.draw(st.sampled_from(sorted(self.engine.encoder_entries)))
        num_tokens = self.engine.encoder_entries[entry_id]
        assert self.execute(FreeEncoderEntry(engine_id=ENGINE, entry_id=entry_id)) == [
            EncoderEntryFreed(engine_id=ENGINE, entry_id=entry_id)
        ]
        self.freed_encoder_in_step[entry_id] = None
        events = self.execute(AllocateEncoderEntry(engine_id=ENGINE, entry_id=entry_id, num_tokens=num_tokens))
        assert events == [EncoderEntryAllocated(engine_id=ENGINE, entry_id=entry_id, num_tokens=num_tokens)]
