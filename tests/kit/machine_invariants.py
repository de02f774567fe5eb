"""What holds after every rule of the state machine (the invariants it checks on `core.state`)."""

from __future__ import annotations

from hypothesis.stateful import invariant

from coordinator.core.projector import project
from coordinator.core.state import (
    decode_state,
    encode_state,
    jobs_in_flight,
)
from events import (
    KeyPublished,
    LoadJobStarted,
    StateCopyPlanned,
    StoreJobStarted,
)
from tests.kit.builders import (
    TIER,
)
from tests.kit.machine import WORLD_SIZE, MachineBase


class Invariants(MachineBase):
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
        # The projector's count of them (checks.room_for_a_job reads it) is a fresh count's.
        kept = jobs_in_flight(self.core.state, self.engine.engine_id)
        fresh = decode_state(encode_state(self.core.state))  # no count kept: counted afresh
        assert kept == jobs_in_flight(fresh, self.engine.engine_id), (kept, len(self.core.state.jobs))

    @invariant()
    def published_keys_come_from_successful_stores(self) -> None:
        """I5, I2: a key is loadable only after every rank stored it with a checksum."""
        for pool_id, key, entry in self.core.state.tiers[TIER].entries():
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
