"""The state machine's pieces (tests/core/test_state_machine.py composes them): the world it drives
(constants), the record it keeps of each job (TrackedJob), and MachineBase: the core, the helpers
every rule uses, and the checks of what a report or a completion does."""

from __future__ import annotations

from dataclasses import dataclass, field

import msgspec
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine

from coordinator.core.commands import (
    NOTICES,
    AllocateBlocks,
    AnyCommand,
    BeginStep,
    EndStep,
    ReportRank,
    StartOwner,
)
from coordinator.core.state import (
    EngineState,
    JobDecision,
    KeyEntry,
    OwnerState,
    PoolState,
)
from events import (
    BlockRef,
    BlocksAllocated,
    Event,
    JobFailed,
    JobSucceeded,
    KeyPublished,
    LoadItem,
    LoadJobStarted,
    NoticeDropped,
    OwnerStarted,
    RankReported,
    Reason,
    Refused,
    StateCopyPlanned,
    StepBegan,
    StoreJobStarted,
)
from tests.kit.builders import (
    ENGINE,
    TIER,
    attention_pool,
    checksum,
    new_core,
    quiet_bytes,
    state_pool,
)

WORLD_SIZE = 2
ATTENTION, STATE = 0, 1
POOL_BLOCKS = {ATTENTION: 6, STATE: 4}  # small: allocation pressure, cached-free reuse
TIER_SLOTS = 4  # small: stores evict
ENCODER_TOKENS = 8
BYTES_PER_BLOCK = 64  # what tests.kit.builders gives both pools
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


class MachineBase(RuleBasedStateMachine):
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
            self.new_owner("req-auto")
        return data.draw(st.sampled_from(self.owners()))

    def honest_checksums(self, decision: JobDecision, rank: int) -> list[bytes]:
        if isinstance(decision, StateCopyPlanned):
            return []
        return [checksum(item.key, rank) for item in decision.items]

    def new_owner(self, req_id: str) -> None:
        """StartOwner, checked: the owner gets the next owner id."""
        self.ensure_step()
        owner_id = self.core.state.next_owner_id
        events = self.execute(StartOwner(engine_id=ENGINE, req_id=req_id))
        assert events == [OwnerStarted(engine_id=ENGINE, owner_id=owner_id, req_id=req_id)]

    def try_allocate(self, own: OwnerState, pool_id: int, count: int) -> list[BlockRef]:
        """Allocate up to `count` blocks if the pool has any; [] when it is exhausted."""
        pool = self.pool(pool_id)
        count = min(count, len(pool.free) + len(pool.cached))
        if count == 0:
            return []
        [allocated] = self.execute(AllocateBlocks(engine_id=ENGINE, owner_id=own.owner_id, pool_id=pool_id, count=count))
        assert isinstance(allocated, BlocksAllocated), allocated
        return allocated.blocks

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
        first_unverified: int | None = None
        for index, item in enumerate(decision.items):
            entry = before[(item.dest.pool_id, item.key)]
            if entry is None or (entry.tier_slot, entry.tier_generation) != (item.tier_slot, item.tier_generation):
                problems.add(Reason.KEY_EVICTED)
            elif entry.quarantined:
                problems.add(Reason.KEY_QUARANTINED)
            elif [rank_sums[index] for rank_sums in sums] != entry.checksums:
                problems.add(Reason.CHECKSUM_MISMATCH)
                mismatched.append((item.dest.pool_id, item.key))
                first_unverified = index if first_unverified is None else first_unverified
        if not problems:
            assert isinstance(outcome, JobSucceeded), events
            for item in decision.items:  # every destination, duplicates included, holds its key
                assert self.pool(item.dest.pool_id).keys[item.dest.block_id] == item.key, item
            return
        assert isinstance(outcome, JobFailed) and outcome.reason in problems, (problems, events)
        kept = 0
        if outcome.reason == Reason.CHECKSUM_MISMATCH:
            tier = self.core.state.tiers[TIER]
            for pool_id, key in mismatched:
                entry = tier.entry(pool_id, key)
                assert entry is not None and entry.quarantined, (pool_id, key)  # I13
            # Issue 19: the items before the first one some rank did not verify read the published
            # bytes on every rank and stay loaded (a duplicate of a key can verify where a later
            # copy of it did not); nothing from there on reads as computed.
            kept = first_unverified or 0
            assert outcome.kept == kept, (outcome, first_unverified)
        for index, item in enumerate(decision.items):
            expected = item.key if index < kept else None
            assert self.pool(item.dest.pool_id).keys[item.dest.block_id] == expected, (index, kept, item)

    def complete(self, data: st.DataObject, job_id: int, tamper: bool = False) -> None:
        job = self.jobs[job_id]
        silent = [r for r in range(WORLD_SIZE) if r not in job.reports]
        order = data.draw(st.permutations(silent))
        for rank in order:
            checksums = self.honest_checksums(job.decision, rank)
            if tamper and rank == order[0] and checksums:
                checksums[-1] = b"tampered:" + bytes([rank])
            self.report(ReportRank(job_id=job_id, rank=rank, ok=True, checksums=checksums))
