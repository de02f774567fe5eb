"""Stateful property test: random command sequences against the real CoordinatorCore.

One engine (world size 2) with a hybrid layout: a small attention pool (0), a small state pool
(1), a 4-slot host tier (so stores evict) and an 8-token encoder cache. Rules allocate under
pressure, preempt and resume (same req_id, new owner), compute, store, load (duplicate keys
included, I11), copy state, look up prefixes, reset or restart (another weights revision too),
free and re-allocate encoder entries in one step, let the clock jump past leases, report job
ranks one at a time in random order (duplicate, conflicting, tampered and late reports
included) and send deliberately bad commands. Hypothesis switches rules off at random per run
(swarm testing), so the rules that need a step or an owner start one themselves.

The test keeps its own record of every job and the first report of each rank, and checks each
job's outcome against it: stores publish only when every rank succeeded with checksums (I5),
re-stores are no-ops or quarantines (I10), loads fail on an expired lease, an evicted or
quarantined key, or a checksum mismatch, which quarantines the key (I12, I13).

After every rule the invariants below are checked on `core.state`:

* I2 / I3: block 0 is in no list; no pinned or referenced slot is free or cached; idle slots are
  in exactly one list (nothing leaks); refs and pins equal what owners and in-flight jobs hold.
* I1: generations only grow (device pools and tier slots).
* I4 / I16: the jobs in flight are exactly the ones this test started and has not completed or
  fenced.
* I5 / I2: every published key comes from a store job whose every rank reported success with a
  checksum, from a real (non-null) block, with one checksum per rank (in the state and in every
  KeyPublished event).
* I18: replaying every emitted event from an empty state gives the live state, byte for byte.

No Python exception may escape `core.execute`: the decider answers bad input with events, and a
refusal or dropped notice is one event that leaves the state unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import msgspec
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from coordinator.core.commands import (
    NOTICES,
    AllocateBlocks,
    AllocateEncoderEntry,
    AnyCommand,
    BeginStep,
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
    command_tag,
)
from coordinator.core.keys import chain_keys
from coordinator.core.projector import project
from coordinator.core.state import (
    EngineState,
    JobDecision,
    KeyEntry,
    OwnerState,
    PoolState,
    SlotStatus,
    encode_state,
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
    EngineDeclared,
    EngineReset,
    Event,
    FencedRankDone,
    JobFailed,
    JobFenced,
    JobSucceeded,
    KeyEvicted,
    KeyPublished,
    LoadItem,
    LoadJobStarted,
    NoticeDropped,
    OwnerFinished,
    OwnerStarted,
    PrefixLookedUp,
    RankReported,
    Reason,
    Refused,
    StateCopyPlanned,
    StepBegan,
    StepEnded,
    StoreJobStarted,
)
from tests.builders import (
    ENGINE,
    TIER,
    allocate,
    attention_pool,
    begin,
    checksum,
    compute,
    namespace,
    new_core,
    ok,
    owner,
    quiet_bytes,
    state_pool,
)

WORLD_SIZE = 2
ATTENTION, STATE = 0, 1
POOL_BLOCKS = {ATTENTION: 6, STATE: 4}  # small: allocation pressure, cached-free reuse
TIER_SLOTS = 4  # small: stores evict
ENCODER_TOKENS = 8
BYTES_PER_BLOCK = 64  # what tests.builders gives both pools
REUSE_UNIT = 8  # lcm(attention block 4, state block 8)
DOCS: tuple[list[int], ...] = (
    [1] * 16,
    [1] * 8 + [2] * 8,
    list(range(16)),
    [7, 7, 7, 7, 8, 8, 8, 8, 9, 9, 9, 9, 1, 2, 3, 4],
)
"""Token sequences: shared prefixes give equal keys across owners, so stores skip and collide."""
CLOCK_ADVANCES = (0.0, 0.5, 3.0, 12.0, 45.0)
"""45 s jumps past every lease (the longest is 30 s): expired loads and evictable keys (I12)."""
LEASES = (1.0, 5.0, 30.0)
ENCODER_ENTRIES = ("img-a", "img-b", "img-c")
WEIGHTS_REVISIONS = ("sha256:1111", "sha256:3333")
"""A restart may load other weights: the old namespace's keys stay published but are never
hits nor loadable for the new one (I9; seed 003)."""


@dataclass
class TrackedJob:
    """The test's own record of a job: what it was told to do and the reports it accepted."""

    decision: JobDecision
    reports: dict[int, ReportRank] = field(default_factory=dict)
    status: str = "open"
    """"open", "complete" (every rank reported, or nothing to do) or "fenced" (I16)."""
    drained: set[int] = field(default_factory=set)
    """Fenced: the ranks that reported late (their transfer is over)."""

    def holds_slots(self) -> bool:
        """Open, or fenced with a rank not heard from yet: its transfers may still land (I16)."""
        if self.status == "open":
            return True
        return self.status == "fenced" and len(self.reports) + len(self.drained) < self.decision.world_size

    def fully_succeeded(self) -> bool:
        """Every rank reported ok with one non-empty checksum per item (I5)."""
        if len(self.reports) != self.decision.world_size:
            return False
        if not all(report.ok for report in self.reports.values()):
            return False
        if isinstance(self.decision, StateCopyPlanned):
            return True
        return all(
            len(report.checksums) == len(self.decision.items) and all(report.checksums) for report in self.reports.values()
        )


class CoordinatorMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.core = new_core(
            [attention_pool(ATTENTION, POOL_BLOCKS[ATTENTION]), state_pool(STATE, POOL_BLOCKS[STATE])],
            world_size=WORLD_SIZE,
            tier_slots=TIER_SLOTS,
            encoder_cache_tokens=ENCODER_TOKENS,
        )
        self.step_open = False
        self.jobs: dict[int, TrackedJob] = {}
        self.succeeded_stores: set[int] = set()
        """Store jobs whose every rank reported ok with checksums: the only ones that may publish."""
        self.sent_reports: list[ReportRank] = []
        self.freed_encoder_in_step: dict[str, None] = {}
        self.seen_generations = self.generations()
        self.events_checked = 0

    # --- helpers -------------------------------------------------------------------------------

    @property
    def engine(self) -> EngineState:
        return self.core.state.engines[ENGINE]

    def pool(self, pool_id: int) -> PoolState:
        return self.engine.pools[pool_id]

    def owners(self) -> list[OwnerState]:
        return [o for o in self.core.state.owners.values() if o.engine_id == ENGINE]

    @staticmethod
    def held(own: OwnerState) -> list[BlockRef]:
        return [
            BlockRef(pool_id, block_id, generation)
            for pool_id, blocks in own.blocks.items()
            for block_id, generation in blocks.items()
        ]

    def open_job_ids(self) -> list[int]:
        return sorted(job_id for job_id, job in self.jobs.items() if job.status == "open")

    def generations(self) -> dict[str, list[int]]:
        seen = {f"pool {pool_id}": list(pool.generations) for pool_id, pool in self.engine.pools.items()}
        seen |= {f"tier {name}": list(tier.generations) for name, tier in self.core.state.tiers.items()}
        return seen

    def execute(self, command: AnyCommand) -> list[Event]:
        """Run one command; no exception may escape, and a refusal changes nothing."""
        before = quiet_bytes(self.core.state)
        try:
            events = self.core.execute(command)
        except Exception as exc:  # the decider must answer bad input with events
            raise AssertionError(f"an exception escaped core.execute({command!r})") from exc
        rejected = [e for e in events if isinstance(e, (Refused, NoticeDropped))]
        # EndStep legitimately drops notices (I14) next to its StepEnded; anything else that
        # refuses says so with exactly one event and leaves the state as it was.
        if rejected and not isinstance(command, EndStep):
            assert len(events) == 1, events
            expected = NoticeDropped if isinstance(command, NOTICES) else Refused
            assert isinstance(events[0], expected), events
            assert quiet_bytes(self.core.state) == before, f"{command!r} was refused but changed the state"
        self.track_new_jobs(events)
        return events

    def rejected(self, events: list[Event], reason: Reason) -> Refused | NoticeDropped:
        assert len(events) == 1, events
        [event] = events
        assert isinstance(event, (Refused, NoticeDropped)), events
        assert event.reason == reason, event
        return event

    def track_new_jobs(self, events: list[Event]) -> None:
        finished_at_once = {e.job_id for e in events if isinstance(e, JobSucceeded)}
        for event in events:
            if isinstance(event, (StoreJobStarted, LoadJobStarted, StateCopyPlanned)):
                assert event.job_id not in self.jobs, f"job id {event.job_id} reused (I4)"
                job = TrackedJob(event)
                empty = not event.batches if isinstance(event, StateCopyPlanned) else not event.items
                if empty:  # nothing to do: it succeeds at once and never pins anything
                    assert event.job_id in finished_at_once, events
                    job.status = "complete"
                self.jobs[event.job_id] = job

    def ensure_step(self) -> None:
        """Open a step if none is: hypothesis switches rules off at random (swarm testing), so
        the rules that need a step cannot rely on `begin_step` being enabled."""
        if not self.step_open:
            step, clock = self.engine.step + 1, self.engine.clock + 0.5
            assert self.execute(BeginStep(engine_id=ENGINE, step=step, clock=clock)) == [
                StepBegan(engine_id=ENGINE, step=step, clock=clock)
            ]
            self.step_open = True

    def pick_owner(self, data: st.DataObject) -> OwnerState:
        """An owner of this engine, started first if there is none (see `ensure_step`)."""
        self.ensure_step()
        if not self.owners():
            self.start_owner("req-auto")
        return data.draw(st.sampled_from(self.owners()))

    def honest_checksums(self, decision: JobDecision, rank: int) -> list[bytes]:
        if isinstance(decision, StateCopyPlanned):
            return []
        return [checksum(item.key, rank) for item in decision.items]

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
        self.ensure_step()
        owner_id = self.core.state.next_owner_id
        events = self.execute(StartOwner(engine_id=ENGINE, req_id=req_id))
        assert events == [OwnerStarted(engine_id=ENGINE, owner_id=owner_id, req_id=req_id)]

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

    def try_allocate(self, own: OwnerState, pool_id: int, count: int) -> list[BlockRef]:
        """Allocate up to `count` blocks if the pool has any; [] when it is exhausted."""
        pool = self.pool(pool_id)
        count = min(count, len(pool.free) + len(pool.cached))
        if count == 0:
            return []
        [allocated] = self.execute(AllocateBlocks(engine_id=ENGINE, owner_id=own.owner_id, pool_id=pool_id, count=count))
        assert isinstance(allocated, BlocksAllocated), allocated
        return allocated.blocks

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
        self.start_owner("req-" + str(DOCS.index(doc)))
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

    # --- jobs ----------------------------------------------------------------------------------

    @rule(data=st.data())
    def start_store(self, data: st.DataObject) -> None:
        self.ensure_step()
        candidates = [
            pool.ref(block_id)
            for pool in self.engine.pools.values()
            for block_id in range(1, pool.spec.num_blocks)
            if pool.refs[block_id] > 0 and pool.keys[block_id] is not None
        ]
        if not candidates:
            return
        chosen = data.draw(st.lists(st.sampled_from(candidates), min_size=1, max_size=3, unique=True))
        tier = self.core.state.tiers[TIER]
        leased = [
            (ref.pool_id, ref.key) for ref in tier.lru.values() if tier.entries[ref.pool_id][ref.key].leased_at(self.engine.clock)
        ]
        events = self.execute(StartStore(engine_id=ENGINE, tier=TIER, blocks=chosen))
        if isinstance(events[0], Refused):
            self.rejected(events, Reason.TIER_FULL)
            return
        [started] = [e for e in events if isinstance(e, StoreJobStarted)]
        for evicted in (e for e in events if isinstance(e, KeyEvicted)):
            assert (evicted.pool_id, evicted.key) not in leased, f"evicted a leased key (I12): {evicted}"
            # I10: a key the store skips as already published must stay published.
            assert evicted.key not in started.already_published, f"evicted a key it relies on: {evicted}"
        for item in started.items:
            assert item.source in chosen and item.source.block_id != 0, item  # I2

    @rule(data=st.data(), lease_seconds=st.sampled_from(LEASES), duplicate=st.booleans())
    def start_load(self, data: st.DataObject, lease_seconds: float, duplicate: bool) -> None:
        self.ensure_step()
        tier = self.core.state.tiers[TIER]
        ns = self.engine.namespace_id
        keys = {
            pool_id: [key for key, entry in group.items() if not entry.quarantined and entry.namespace_id == ns]
            for pool_id, group in tier.entries.items()
        }
        dests = {
            pool_id: [
                pool.ref(block_id)
                for block_id in range(1, pool.spec.num_blocks)
                if pool.refs[block_id] > 0 and pool.keys[block_id] is None and pool.pins[block_id] == 0
            ]
            for pool_id, pool in self.engine.pools.items()
        }
        usable = sorted(pool_id for pool_id in keys if keys[pool_id])
        if not usable:
            return
        pool_id = data.draw(st.sampled_from(usable))
        if not dests[pool_id]:  # a request that will load its prefix instead of computing it
            dests[pool_id] = self.try_allocate(self.pick_owner(data), pool_id, 2)
            if not dests[pool_id]:
                return
        chosen = data.draw(st.lists(st.sampled_from(dests[pool_id]), min_size=1, max_size=3, unique=True))
        if duplicate:  # I11: the same published key into every destination
            key = data.draw(st.sampled_from(keys[pool_id]))
            items = [LoadRequest(key, dest) for dest in chosen]
        else:
            items = [LoadRequest(data.draw(st.sampled_from(keys[pool_id])), dest) for dest in chosen]
        events = self.execute(StartLoad(engine_id=ENGINE, tier=TIER, items=items, lease_seconds=lease_seconds))
        [started] = events
        assert isinstance(started, LoadJobStarted), events
        assert [(i.key, i.dest) for i in started.items] == [(i.key, i.dest) for i in items]
        assert started.lease_expires_at == self.engine.clock + lease_seconds

    @rule(data=st.data(), pool_id=st.sampled_from((STATE, STATE, ATTENTION)), num_moves=st.integers(1, 2))
    def plan_state_copy(self, data: st.DataObject, pool_id: int, num_moves: int) -> None:
        self.ensure_step()
        pool = self.pool(pool_id)
        dests = [pool.ref(b) for b in range(1, pool.spec.num_blocks) if pool.refs[b] > 0 and pool.pins[b] == 0]
        if not dests:
            dests = self.try_allocate(self.pick_owner(data), pool_id, 1)
        # Held, draining or cached-free slots may be read (listed after the allocation above,
        # which may have recycled a cached-free one).
        sources = [pool.ref(b) for b in range(1, pool.spec.num_blocks) if pool.status(b) is not SlotStatus.FREE]
        if not sources or not dests:
            return
        moves = []
        for _ in range(num_moves):
            length = data.draw(st.integers(1, BYTES_PER_BLOCK))
            moves.append(
                Move(
                    src=data.draw(st.sampled_from(sources)),
                    src_offset=data.draw(st.integers(0, BYTES_PER_BLOCK - length)),
                    dst=data.draw(st.sampled_from(dests)),
                    dst_offset=data.draw(st.integers(0, BYTES_PER_BLOCK - length)),
                    length=length,
                )
            )
        events = self.execute(PlanStateCopy(engine_id=ENGINE, pool_id=pool_id, moves=moves))
        if isinstance(events[0], Refused):
            self.rejected(events, Reason.OVERLAPPING_DESTINATIONS)
            return
        assert isinstance(events[0], StateCopyPlanned), events

    @rule(doc=st.sampled_from(DOCS), length=st.integers(0, 16))
    def lookup(self, doc: list[int], length: int) -> None:
        self.ensure_step()
        tokens = doc[:length]
        events = self.execute(LookupPrefix(engine_id=ENGINE, tier=TIER, token_ids=tokens))
        [looked] = events
        assert isinstance(looked, PrefixLookedUp), events
        assert looked.reuse_unit == REUSE_UNIT
        ns = self.engine.namespace_id
        tier = self.core.state.tiers[TIER]
        chains = {pool_id: chain_keys(ns, tokens, pool.spec.block_size) for pool_id, pool in self.engine.pools.items()}

        def loadable(pool_id: int, key: bytes) -> bool:  # I9: this namespace only
            entry = tier.entry(pool_id, key)
            return entry is not None and not entry.quarantined and entry.namespace_id == ns

        def hit_at(boundary: int) -> bool:  # I6: every group has its key at the boundary
            attention = chains[ATTENTION][: boundary // self.pool(ATTENTION).spec.block_size]
            state = chains[STATE][boundary // self.pool(STATE).spec.block_size - 1]
            return all(loadable(ATTENTION, k) for k in attention) and loadable(STATE, state)

        expected = max((b for b in range(REUSE_UNIT, length + 1, REUSE_UNIT) if hit_at(b)), default=0)
        assert looked.boundary == expected, (looked, expected)
        for hit in looked.hits:
            assert all(loadable(hit.pool_id, key) for key in hit.keys), hit

    # --- reports -------------------------------------------------------------------------------

    @precondition(lambda self: any(job.status == "open" for job in self.jobs.values()))
    @rule(
        data=st.data(),
        ok_=st.sampled_from((True,) * 5 + (False,)),
        mode=st.sampled_from(("honest",) * 4 + ("corrupt", "missing", "empty")),
    )
    def report_one_rank(self, data: st.DataObject, ok_: bool, mode: str) -> None:
        """One rank of a random in-flight job reports: ranks arrive in any order, across jobs."""
        job_id = data.draw(st.sampled_from(self.open_job_ids()))
        job = self.jobs[job_id]
        rank = data.draw(st.sampled_from([r for r in range(WORLD_SIZE) if r not in job.reports]))
        checksums = self.honest_checksums(job.decision, rank)
        if checksums and mode == "corrupt":
            checksums[0] = b"corrupt:" + bytes([rank])
        elif checksums and mode == "missing":
            checksums = checksums[:-1]
        elif checksums and mode == "empty":
            checksums[-1] = b""
        self.report(ReportRank(job_id=job_id, rank=rank, ok=ok_, checksums=checksums, error="" if ok_ else "io error"))

    def report(self, command: ReportRank) -> None:
        """Send a first report for (job, rank) and check what the job's completion does."""
        job_id, job = command.job_id, self.jobs[command.job_id]
        tier = self.core.state.tiers[TIER]
        # What the tier held for the job's keys before this report: the expected outcome.
        before: dict[tuple[int, bytes], KeyEntry | None] = {}
        if isinstance(job.decision, StoreJobStarted | LoadJobStarted):  # this machine starts no external job
            for item in job.decision.items:
                pool_id = item.dest.pool_id if isinstance(item, LoadItem) else item.source.pool_id
                entry = tier.entry(pool_id, item.key)
                before[(pool_id, item.key)] = None if entry is None else msgspec.structs.replace(entry)
        events = self.execute(command)
        assert events[0] == RankReported(
            job_id=job_id, rank=command.rank, ok=command.ok, checksums=command.checksums, error=command.error
        ), events
        job.reports[command.rank] = command
        self.sent_reports.append(command)
        if len(job.reports) < WORLD_SIZE:  # I4: counted per (job_id, rank)
            assert len(events) == 1 and job_id in self.core.state.jobs, events
            return
        job.status = "complete"
        assert job_id not in self.core.state.jobs
        [outcome] = [e for e in events if isinstance(e, (JobSucceeded, JobFailed))]
        assert outcome.job_id == job_id
        if not job.fully_succeeded():
            assert isinstance(outcome, JobFailed), events  # I5: failed or partial never succeeds
            assert not any(isinstance(e, KeyPublished) for e in events), events
            return
        sums = [job.reports[rank].checksums for rank in range(WORLD_SIZE)]
        if isinstance(job.decision, StoreJobStarted):
            assert isinstance(outcome, JobSucceeded), events
            self.succeeded_stores.add(job_id)
            for index, item in enumerate(job.decision.items):
                checksums = [rank_sums[index] for rank_sums in sums]
                earlier = before[(item.source.pool_id, item.key)]
                entry = tier.entry(item.source.pool_id, item.key)
                assert entry is not None, item
                if earlier is None:  # I5: published, one checksum per rank
                    assert (entry.source_job, entry.checksums) == (job_id, checksums), entry
                elif earlier.checksums != checksums:  # I10: same key, other bytes: quarantined
                    assert entry.quarantined and entry.source_job == earlier.source_job, entry
                else:  # I10: the same bytes again: a no-op
                    assert entry.quarantined == earlier.quarantined, entry
        elif isinstance(job.decision, LoadJobStarted):
            self.check_load_outcome(job.decision, sums, before, outcome, events)
        else:
            assert isinstance(outcome, JobSucceeded), events

    def check_load_outcome(
        self,
        decision: LoadJobStarted,
        sums: list[list[bytes]],
        before: dict[tuple[int, bytes], KeyEntry | None],
        outcome: JobSucceeded | JobFailed,
        events: list[Event],
    ) -> None:
        """I11, I12, I13: a load counts only if its lease held, its keys are still the ones it
        leased and every destination (duplicates included) verified against the checksums."""
        problems: set[Reason] = set()
        if self.engine.clock >= decision.lease_expires_at:  # a lease is live while clock < expiry
            problems.add(Reason.LEASE_EXPIRED)
        mismatched = []
        for index, item in enumerate(decision.items):
            entry = before[(item.dest.pool_id, item.key)]
            if entry is None or (entry.tier_slot, entry.tier_generation) != (item.tier_slot, item.tier_generation):
                problems.add(Reason.KEY_EVICTED)
            elif entry.quarantined:
                problems.add(Reason.KEY_QUARANTINED)
            elif [rank_sums[index] for rank_sums in sums] != entry.checksums:
                problems.add(Reason.CHECKSUM_MISMATCH)
                mismatched.append((item.dest.pool_id, item.key))
        if not problems:
            assert isinstance(outcome, JobSucceeded), events
            for item in decision.items:  # every destination, duplicates included, holds its key
                assert self.pool(item.dest.pool_id).keys[item.dest.block_id] == item.key, item
            return
        assert isinstance(outcome, JobFailed) and outcome.reason in problems, (problems, events)
        if outcome.reason == Reason.CHECKSUM_MISMATCH:
            tier = self.core.state.tiers[TIER]
            for pool_id, key in mismatched:
                entry = tier.entry(pool_id, key)
                assert entry is not None and entry.quarantined, (pool_id, key)  # I13
        for item in decision.items:  # a failed load leaves nothing that reads as computed
            assert self.pool(item.dest.pool_id).keys[item.dest.block_id] is None, item

    @precondition(lambda self: any(job.status == "open" for job in self.jobs.values()))
    @rule(data=st.data(), tamper=st.sampled_from((False, False, False, True)))
    def complete_job(self, data: st.DataObject, tamper: bool) -> None:
        """Every silent rank of a random in-flight job reports success, in a random order; with
        `tamper`, one of them reports bytes that differ (wrong KV stored or loaded)."""
        self.complete(data, data.draw(st.sampled_from(self.open_job_ids())), tamper)

    def complete(self, data: st.DataObject, job_id: int, tamper: bool = False) -> None:
        job = self.jobs[job_id]
        silent = [r for r in range(WORLD_SIZE) if r not in job.reports]
        order = data.draw(st.permutations(silent))
        for rank in order:
            checksums = self.honest_checksums(job.decision, rank)
            if tamper and rank == order[0] and checksums:
                checksums[-1] = b"tampered:" + bytes([rank])
            self.report(ReportRank(job_id=job_id, rank=rank, ok=True, checksums=checksums))

    @precondition(lambda self: bool(self.sent_reports))
    @rule(data=st.data(), conflicting=st.booleans())
    def resend_report(self, data: st.DataObject, conflicting: bool) -> None:
        """A duplicate (or conflicting) report is dropped; for a finished job it is stale (I4)."""
        sent = data.draw(st.sampled_from(self.sent_reports))
        command = msgspec.structs.replace(sent, ok=not sent.ok) if conflicting else sent
        events = self.execute(command)
        if self.jobs[sent.job_id].status != "open":
            event = self.rejected(events, Reason.STALE_JOB)
        else:
            event = self.rejected(events, Reason.CONFLICTING_REPORT if conflicting else Reason.DUPLICATE_REPORT)
        assert f"job {sent.job_id}" in event.detail

    @precondition(lambda self: any(job.status != "open" for job in self.jobs.values()))
    @rule(data=st.data(), rank=st.integers(0, WORLD_SIZE - 1))
    def late_report(self, data: st.DataObject, rank: int) -> None:
        """A report for a finished or fenced job is stale (I4, I16), even from a silent rank."""
        job_id = data.draw(st.sampled_from(sorted(i for i, job in self.jobs.items() if job.status != "open")))
        job = self.jobs[job_id]
        command = ReportRank(job_id=job_id, rank=rank, ok=True, checksums=self.honest_checksums(job.decision, rank))
        events = self.execute(command)
        if job.status == "fenced" and rank not in job.reports and rank not in job.drained:
            # I16: its result is dropped, but this rank's transfer is over: the job lets go of
            # its slots when every rank is.
            assert events == [FencedRankDone(job_id=job_id, rank=rank)], events
            job.drained.add(rank)
        else:
            event = self.rejected(events, Reason.STALE_JOB)
            assert f"job {job_id}" in event.detail

    # --- resets --------------------------------------------------------------------------------

    @rule(
        how=st.sampled_from(("reset_cache", "restart")),
        weights_revision=st.sampled_from(WEIGHTS_REVISIONS),
        now=st.integers(0, 2),
    )
    def reset(self, how: str, weights_revision: str, now: int) -> None:
        """A new incarnation fences every job in flight (I16); generations keep counting (I1)."""
        if now:  # two times out of three do nothing, so state builds up between resets
            return
        open_ids = self.open_job_ids()
        incarnation = self.engine.incarnation
        if how == "reset_cache":
            command: AnyCommand = ResetCache(engine_id=ENGINE)
        else:
            command = DeclareEngine(
                engine_id=ENGINE,
                namespace=namespace(block_sizes=(4, 8), tp=WORLD_SIZE, weights_revision=weights_revision),
                pools=[pool.spec for pool in self.engine.pools.values()],
                world_size=WORLD_SIZE,
                tiers=[TIER],
                encoder_cache_tokens=ENCODER_TOKENS,
            )
        events = self.execute(command)
        assert sorted(e.job_id for e in events if isinstance(e, JobFenced)) == open_ids
        [reset] = [e for e in events if isinstance(e, EngineReset)]
        assert reset.incarnation == incarnation + 1
        if how == "restart":
            assert isinstance(events[-1], EngineDeclared), events
        for job_id in open_ids:
            self.jobs[job_id].status = "fenced"
        assert not self.owners()
        self.step_open = False
        self.freed_encoder_in_step = {}

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

    # --- bad commands --------------------------------------------------------------------------

    def block_command(self, data: st.DataObject, ref: BlockRef) -> AnyCommand:
        """A command whose only fault is `ref` (checked before anything else about it)."""
        options: list[AnyCommand] = [
            StartStore(engine_id=ENGINE, tier=TIER, blocks=[ref]),
            StartLoad(engine_id=ENGINE, tier=TIER, items=[LoadRequest(b"\x00" * 16, ref)]),
            PlanStateCopy(engine_id=ENGINE, pool_id=ref.pool_id, moves=[Move(ref, 0, ref, 0, 8)]),
        ]
        if self.owners():
            owner_id = data.draw(st.sampled_from(self.owners())).owner_id
            options += [
                FreeBlocks(engine_id=ENGINE, owner_id=owner_id, blocks=[ref]),
                ReuseBlocks(engine_id=ENGINE, owner_id=owner_id, blocks=[ref]),
                MarkComputed(engine_id=ENGINE, owner_id=owner_id, blocks=[ref], token_ids=[1] * 8),
            ]
        return data.draw(st.sampled_from(options))

    @rule(
        data=st.data(),
        kind=st.sampled_from(
            (
                "stale_generation",
                "null_block",
                "unknown_slot",
                "unknown_pool",
                "unknown_job",
                "rank_out_of_range",
                "step_already_open",
                "pool_layout_changed",
                "not_computed",
                "foreign_namespace_key",
            )
        ),
        pool_id=st.sampled_from((ATTENTION, STATE)),
    )
    def bad_command(self, data: st.DataObject, kind: str, pool_id: int) -> None:
        self.ensure_step()
        pool = self.pool(pool_id)
        tier = self.core.state.tiers[TIER]
        # Blocks held but not computed: allocated, being loaded (I17) or written by a copy.
        uncomputed = [pool.ref(b) for b in range(1, pool.spec.num_blocks) if pool.refs[b] > 0 and pool.keys[b] is None]
        foreign = [key for key, entry in tier.entries.get(pool_id, {}).items() if entry.namespace_id != self.engine.namespace_id]
        loadable_into = [ref for ref in uncomputed if pool.pins[ref.block_id] == 0]
        if (
            (kind == "rank_out_of_range" and not self.open_job_ids())
            or (kind == "not_computed" and not uncomputed)
            or (kind == "foreign_namespace_key" and not (foreign and loadable_into))
        ):
            kind = "unknown_job"
        command: AnyCommand
        if kind == "not_computed":  # I17: not a hit, nor storable, until computed or loaded
            ref = data.draw(st.sampled_from(uncomputed))
            holders = [o for o in self.owners() if ref.block_id not in o.blocks.get(pool_id, {})]
            options: list[AnyCommand] = [StartStore(engine_id=ENGINE, tier=TIER, blocks=[ref])]
            options += [ReuseBlocks(engine_id=ENGINE, owner_id=o.owner_id, blocks=[ref]) for o in holders]
            command = data.draw(st.sampled_from(options))
            reason, name = Reason.NOT_COMPUTED, f"{pool_id}/{ref.block_id}"
        elif kind == "foreign_namespace_key":  # I9: another namespace's key reads as absent
            key = data.draw(st.sampled_from(foreign))
            ref = data.draw(st.sampled_from(loadable_into))
            command = StartLoad(engine_id=ENGINE, tier=TIER, items=[LoadRequest(key, ref)])
            reason, name = Reason.KEY_NOT_PUBLISHED, key.hex()
        elif kind == "stale_generation":
            block_id = data.draw(st.integers(1, pool.spec.num_blocks - 1))
            generation = pool.generations[block_id] + data.draw(st.sampled_from((1, -1)))
            command = self.block_command(data, BlockRef(pool_id, block_id, generation))
            reason, name = Reason.STALE_GENERATION, f"{pool_id}/{block_id}"
        elif kind == "null_block":
            command = self.block_command(data, BlockRef(pool_id, 0, 0))
            reason, name = Reason.NULL_BLOCK, "block 0"
        elif kind == "unknown_slot":
            block_id = data.draw(st.sampled_from((pool.spec.num_blocks, pool.spec.num_blocks + 3, -1)))
            command = self.block_command(data, BlockRef(pool_id, block_id, 1))
            reason, name = Reason.UNKNOWN_SLOT, f"block {block_id}"
        elif kind == "unknown_pool":
            command = self.block_command(data, BlockRef(9, 1, 1))
            reason, name = Reason.UNKNOWN_POOL, "pool 9"
        elif kind == "unknown_job":
            next_id = self.core.state.next_job_id
            job_id = data.draw(st.sampled_from((0, -1, next_id, next_id + 7)))
            command = ReportRank(job_id=job_id, rank=0, ok=True, checksums=[b"x"])
            reason, name = Reason.UNKNOWN_JOB, f"job {job_id}"
        elif kind == "rank_out_of_range":
            job_id = data.draw(st.sampled_from(self.open_job_ids()))
            rank = data.draw(st.sampled_from((WORLD_SIZE, WORLD_SIZE + 5, -1)))
            command = ReportRank(job_id=job_id, rank=rank, ok=True, checksums=[b"x"])
            reason, name = Reason.RANK_OUT_OF_RANGE, f"rank {rank}"
        elif kind == "step_already_open":
            command = BeginStep(engine_id=ENGINE, step=self.engine.step + 1, clock=self.engine.clock)
            reason, name = Reason.STEP_ALREADY_OPEN, f"step {self.engine.step}"
        else:
            specs = [pool.spec for pool in self.engine.pools.values()]
            specs[-1] = msgspec.structs.replace(specs[-1], num_blocks=specs[-1].num_blocks + 1)
            command = DeclareEngine(
                engine_id=ENGINE,
                namespace=namespace(block_sizes=(4, 8), tp=WORLD_SIZE),
                pools=specs,
                world_size=WORLD_SIZE,
                tiers=[TIER],
                encoder_cache_tokens=ENCODER_TOKENS,
            )
            reason, name = Reason.POOL_LAYOUT_CHANGED, repr(ENGINE)
        event = self.rejected(self.execute(command), reason)
        assert name in event.detail, (command, event)
        assert (event.notice if isinstance(event, NoticeDropped) else event.command) == command_tag(command)

    @precondition(lambda self: not self.step_open)
    @rule(
        data=st.data(),
        kind=st.sampled_from(("no_open_step", "step_not_advancing", "clock_regressed")),
    )
    def command_between_steps(self, data: st.DataObject, kind: str) -> None:
        eng = self.engine
        command: AnyCommand
        if kind == "no_open_step":
            outside: list[AnyCommand] = [
                StartOwner(engine_id=ENGINE, req_id="req-late"),
                EndStep(engine_id=ENGINE),
                AllocateBlocks(engine_id=ENGINE, owner_id=1, pool_id=ATTENTION, count=1),
                FreeBlocks(engine_id=ENGINE, owner_id=1, blocks=[BlockRef(ATTENTION, 1, 1)]),
                LookupPrefix(engine_id=ENGINE, tier=TIER, token_ids=DOCS[0]),
                StartStore(engine_id=ENGINE, tier=TIER, blocks=[BlockRef(ATTENTION, 1, 1)]),
                AllocateEncoderEntry(engine_id=ENGINE, entry_id="img-a", num_tokens=1),
                FreeEncoderEntry(engine_id=ENGINE, entry_id="img-a"),
            ]
            command = data.draw(st.sampled_from(outside))
            reason, name = Reason.NO_OPEN_STEP, repr(ENGINE)
        elif kind == "step_not_advancing":
            step = eng.step - data.draw(st.integers(0, 1))
            command = BeginStep(engine_id=ENGINE, step=step, clock=eng.clock)
            reason, name = Reason.STEP_NOT_ADVANCING, f"step {step}"
        elif eng.step >= 0:  # the first step of an incarnation may set any clock
            clock = eng.clock - data.draw(st.sampled_from((0.5, 100.0)))
            command = BeginStep(engine_id=ENGINE, step=eng.step + 1, clock=clock)
            reason, name = Reason.CLOCK_REGRESSED, f"clock {clock}"
        else:
            return
        event = self.rejected(self.execute(command), reason)
        assert name in event.detail, (command, event)

    # --- invariants ----------------------------------------------------------------------------

    @invariant()
    def slots_are_consistent(self) -> None:
        """I2, I3: the free and cached lists hold exactly the idle slots, never a pinned one."""
        for pool_id, pool in self.engine.pools.items():
            assert 0 not in pool.free and 0 not in pool.cached, f"pool {pool_id}: null block listed (I2)"
            assert (pool.generations[0], pool.refs[0], pool.pins[0], pool.keys[0]) == (0, 0, 0, None)
            assert not pool.free.keys() & pool.cached.keys(), f"pool {pool_id}: slot both free and cached"
            for block_id in range(1, pool.spec.num_blocks):
                listed = block_id in pool.free or block_id in pool.cached
                where = f"pool {pool_id} block {block_id} (refs {pool.refs[block_id]}, pins {pool.pins[block_id]})"
                assert pool.refs[block_id] >= 0 and pool.pins[block_id] >= 0, where
                if pool.pins[block_id] > 0:
                    assert not listed, f"{where} is pinned by a job in flight but listed as free/cached (I3)"
                if pool.refs[block_id] > 0:
                    assert not listed, f"{where} is held by an owner but listed as free/cached"
                if pool.refs[block_id] == 0 and pool.pins[block_id] == 0:
                    assert listed, f"{where} is idle but in no list: leaked"
                if block_id in pool.free:
                    assert pool.keys[block_id] is None, f"{where} is clean-free with a content key"
                if block_id in pool.cached:
                    assert pool.keys[block_id] is not None, f"{where} is cached-free without a content key"

    @invariant()
    def generations_only_grow(self) -> None:
        """I1: a generation never goes back, so an old reference never becomes current again."""
        now = self.generations()
        for where, previous in self.seen_generations.items():
            assert all(n >= p for n, p in zip(now[where], previous, strict=True)), (where, previous, now[where])
        self.seen_generations = now

    @invariant()
    def refs_and_pins_match_holders(self) -> None:
        """I3: pins are exactly what in-flight jobs hold; refs exactly what owners hold."""
        expected_pins = {pool_id: [0] * pool.spec.num_blocks for pool_id, pool in self.engine.pools.items()}
        for job in (job for job in self.jobs.values() if job.holds_slots()):
            decision = job.decision
            if isinstance(decision, StoreJobStarted):
                pinned = [item.source for item in decision.items]
            elif isinstance(decision, LoadJobStarted):
                pinned = [item.dest for item in decision.items]
            elif isinstance(decision, StateCopyPlanned):
                pinned = list(decision.blocks)
            else:
                pinned = []  # external jobs pin none of kvledger's slots
            for ref in pinned:
                expected_pins[ref.pool_id][ref.block_id] += 1
        expected_refs = {pool_id: [0] * pool.spec.num_blocks for pool_id, pool in self.engine.pools.items()}
        for own in self.owners():
            for ref in self.held(own):
                assert self.pool(ref.pool_id).generations[ref.block_id] == ref.generation, (own, ref)
                expected_refs[ref.pool_id][ref.block_id] += 1
        for pool_id, pool in self.engine.pools.items():
            assert pool.pins == expected_pins[pool_id], (pool_id, pool.pins, expected_pins[pool_id])
            assert pool.refs == expected_refs[pool_id], (pool_id, pool.refs, expected_refs[pool_id])

    @invariant()
    def jobs_in_flight_are_the_open_ones(self) -> None:
        """I4 / I16: the core's jobs in flight are exactly those not completed nor fenced, and
        its draining fenced jobs exactly those with a rank not heard from."""
        assert sorted(self.core.state.jobs) == self.open_job_ids()
        draining = sorted(i for i, job in self.jobs.items() if job.status == "fenced" and job.holds_slots())
        assert sorted(self.core.state.fenced) == draining

    @invariant()
    def published_keys_come_from_successful_stores(self) -> None:
        """I5, I2: a key is loadable only after every rank stored it with a checksum."""
        for pool_id, group in self.core.state.tiers[TIER].entries.items():
            for key, entry in group.items():
                assert entry.source_job in self.succeeded_stores, (
                    f"key {key.hex()} of pool {pool_id} was published by job {entry.source_job}, "
                    "which did not succeed on every rank (I5)"
                )
                job = self.jobs[entry.source_job]
                assert isinstance(job.decision, StoreJobStarted)
                [(index, item)] = [
                    (i, item) for i, item in enumerate(job.decision.items) if item.key == key and item.source.pool_id == pool_id
                ]
                assert item.source.block_id != 0, f"key {key.hex()} was stored from the null block (I2)"
                assert (entry.tier_slot, entry.tier_generation) == (item.tier_slot, item.tier_generation)
                assert len(entry.checksums) == WORLD_SIZE
                assert entry.checksums == [job.reports[r].checksums[index] for r in range(WORLD_SIZE)]

    @invariant()
    def published_events_carry_one_checksum_per_rank(self) -> None:
        for event in self.core.events[self.events_checked :]:
            if isinstance(event, KeyPublished):
                assert len(event.checksums) == WORLD_SIZE, event
                assert all(event.checksums), event
        self.events_checked = len(self.core.events)

    @invariant()
    def replay_gives_the_live_state(self) -> None:
        """I18: the same log always projects to the same state, byte for byte."""
        assert encode_state(project(self.core.events)) == encode_state(self.core.state)


# Shrinking a failing 60-step run can take Hypothesis minutes (its own cap is 300 s, equal to
# pyproject's default pytest timeout): give this module room so a failure reports its shrunk
# example instead of a timeout.
pytestmark = pytest.mark.timeout(900)

CoordinatorMachine.TestCase.settings = settings(
    max_examples=100,  # a passing run takes ~10 s; 60 examples sometimes miss a 7-step bug
    stateful_step_count=60,
    deadline=None,
    report_multiple_bugs=False,  # one bug, shrunk, is what a reader needs
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
TestCoordinatorStateMachine = CoordinatorMachine.TestCase


# --- regressions found by the machine, pinned down as plain tests ----------------------------


def test_state_copy_from_a_cached_free_slot_keeps_it_out_of_the_free_lists() -> None:
    """I3: a copy may read a cached-free slot (status is not FREE), which pins it; the pinned
    slot must then leave `pool.cached`, or the next allocation hands it to a new owner while
    the copy still reads it."""
    core = new_core(
        [attention_pool(ATTENTION, POOL_BLOCKS[ATTENTION]), state_pool(STATE, POOL_BLOCKS[STATE])],
        encoder_cache_tokens=ENCODER_TOKENS,
    )
    begin(core)
    first = owner(core, "req-1")
    [source] = allocate(core, first, 1, STATE)
    compute(core, first, [source], DOCS[0][:8])
    ok(core.execute(FinishOwner(engine_id=ENGINE, owner_id=first)))  # source is cached-free now
    second = owner(core, "req-2")
    [dest] = allocate(core, second, 1, STATE)
    ok(core.execute(PlanStateCopy(engine_id=ENGINE, pool_id=STATE, moves=[Move(source, 0, dest, 0, 64)])))
    pool = core.state.engines[ENGINE].pools[STATE]
    assert pool.pins[source.block_id] == 1
    assert source.block_id not in pool.cached and source.block_id not in pool.free, (
        "a slot pinned by a state copy is still listed as cached-free (I3)"
    )
    third = owner(core, "req-3")
    events = core.execute(AllocateBlocks(engine_id=ENGINE, owner_id=third, pool_id=STATE, count=2))
    allocated = [ref.block_id for e in events if isinstance(e, BlocksAllocated) for ref in e.blocks]
    assert source.block_id not in allocated, "a slot pinned by a state copy in flight was reallocated (I3)"
