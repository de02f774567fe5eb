"""The state machine's deliberately bad commands, and commands sent between steps."""

from __future__ import annotations

import msgspec
from hypothesis import strategies as st
from hypothesis.stateful import precondition, rule

from coordinator.core.commands import (
    AllocateBlocks,
    AllocateEncoderEntry,
    AnyCommand,
    BeginStep,
    DeclareEngine,
    EndStep,
    FreeBlocks,
    FreeEncoderEntry,
    LoadRequest,
    LookupPrefix,
    MarkComputed,
    Move,
    PlanStateCopy,
    ReportRank,
    ReuseBlocks,
    StartLoad,
    StartOwner,
    StartStore,
    command_tag,
)
from events import (
    BlockRef,
    NoticeDropped,
    Reason,
)
from tests.kit.builders import (
    ENGINE,
    TIER,
    namespace,
)
from tests.kit.machine import ATTENTION, DOCS, ENCODER_TOKENS, STATE, WORLD_SIZE, MachineBase


class BadCommandRules(MachineBase):
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
        foreign = [
            key for group, key, entry in tier.entries() if group == pool_id and entry.namespace_id != self.engine.namespace_id
        ]
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
