"""The verifier's checks of declarations, steps, owners and blocks, lookups and copy plans
(I1, I2, I3, I6, I7, I9, I14, I15, I16, I17; coordinator/audit/verify.py). Pure."""

from __future__ import annotations

from collections.abc import Sequence

import msgspec

from coordinator.audit._verify_base import At, Checks, ref_text
from coordinator.core.keys import namespace_id, reuse_unit
from coordinator.core.state import SlotStatus
from events import (
    NULL_BLOCK_ID,
    BlocksAllocated,
    BlocksComputed,
    BlocksReleased,
    BlocksReused,
    CopyOp,
    EncoderEntryAllocated,
    EngineReset,
    NamespaceRegistered,
    PrefixLookedUp,
    Region,
    StateCopyPlanned,
    StepEnded,
)


class BlockChecks(Checks):
    """Each check takes an event and where it is, and says whether to skip folding it (True
    only where the projector could not fold it and the violation is reported already)."""

    # --- declarations and steps --------------------------------------------------------------------

    def _namespace_registered(self, event: NamespaceRegistered, at: At) -> bool:
        expected = namespace_id(event.spec)
        if event.namespace_id != expected:
            left_out = [
                name
                for name in ("weights_revision", "tenant", "adapter_revision")
                if namespace_id(msgspec.structs.replace(event.spec, **{name: ""})) == event.namespace_id
            ]
            why = f" (it is the digest of the spec without its {', '.join(left_out)})" if left_out else ""
            self._flag(
                "I9",
                at,
                f"namespace id {event.namespace_id.hex()} is not the digest of its spec "
                f"({expected.hex()}){why}: namespaces that differ there share keys",
            )
        return False

    def _engine_reset(self, event: EngineReset, at: At) -> bool:
        alive = [job.job_id for job in self.state.jobs.values() if job.decision.engine_id == event.engine_id]
        if alive:
            pins = "" if event.keep_pins else "; the reset drops their pins too"
            self._flag(
                "I16",
                at,
                f"engine {event.engine_id} moves to incarnation {event.incarnation} with job(s) "
                f"{alive} of the old one in flight and not fenced{pins}",
                self._job_evidence(alive),
            )
        self._reset_seq[event.engine_id] = at.seq
        return False

    def _step_ended(self, event: StepEnded, at: At) -> bool:
        engine = self.state.engines.get(event.engine_id)
        if engine is None:
            return False
        for ref in event.freed_blocks:
            pool = engine.pools.get(ref.pool_id)
            if pool is None or not 0 < ref.block_id < pool.spec.num_blocks:
                continue
            generation, status = pool.generations[ref.block_id], pool.status(ref.block_id)
            if generation != ref.generation or status not in (SlotStatus.FREE, SlotStatus.CACHED_FREE):
                slot = (event.engine_id, ref.pool_id, ref.block_id)
                self._flag(
                    "I14",
                    at,
                    f"freed notice for {ref_text(ref)}, which at step end is {status} at generation {generation}",
                    self._seen(self._alloc_seq.get(slot), f"{ref_text(pool.ref(ref.block_id))} allocated"),
                )
        for entry_id in event.freed_encoder_entries:
            if entry_id in engine.encoder_entries:
                self._flag(
                    "I14",
                    at,
                    f"freed notice for encoder entry {entry_id!r}, which was allocated again in the step",
                    self._seen(self._encoder_seq.get((event.engine_id, entry_id)), f"encoder entry {entry_id} allocated"),
                )
        removed = set(event.removed_keys)
        for tier_name, pool_id, key in engine.pending_removed_keys:
            tier = self.state.tiers.get(tier_name)
            if key in removed and tier is not None and tier.entry(pool_id, key) is not None:
                self._flag(
                    "I14",
                    at,
                    f"removed-key notice for {key.hex()}, which is published again at step end",
                    self._seen(self._published_seq.get((tier_name, pool_id, key)), f"{key.hex()[:8]} published"),
                )
        return False

    # --- owners and blocks -----------------------------------------------------------------------------

    def _blocks_allocated(self, event: BlocksAllocated, at: At) -> bool:
        engine = self.state.engines.get(event.engine_id)
        if engine is None:
            return False
        under_jobs: dict[int, None] = {}
        busy: list[str] = []
        for ref in event.blocks:
            pool = engine.pools.get(ref.pool_id)
            if pool is None:
                continue
            if ref.block_id == NULL_BLOCK_ID:
                self._flag("I2", at, f"allocates the null block {ref_text(ref)}")
                continue
            if not 0 < ref.block_id < pool.spec.num_blocks:
                continue
            slot = (event.engine_id, ref.pool_id, ref.block_id)
            previous = pool.generations[ref.block_id]
            if ref.generation != previous + 1:
                self._flag(
                    "I1",
                    at,
                    f"allocates {ref_text(ref)}: the slot was at generation {previous}, an allocation makes it {previous + 1}",
                )
            jobs = self._busy.get(slot)
            if jobs:
                under_jobs.update(jobs)
                busy.append(ref_text(pool.ref(ref.block_id)))
            elif pool.refs[ref.block_id]:
                self._flag(
                    "I3",
                    at,
                    f"allocates {ref.pool_id}/{ref.block_id} again while an owner holds it",
                    self._seen(self._alloc_seq.get(slot), f"{ref_text(pool.ref(ref.block_id))} allocated"),
                )
            self._alloc_seq[slot] = at.seq
        if busy:
            self._flag(
                "I3",
                at,
                f"allocates {', '.join(busy)} again while job(s) {list(under_jobs)} in flight still read or write them",
                self._job_evidence(list(under_jobs)),
            )
        return False

    def _blocks_reused(self, event: BlocksReused, at: At) -> bool:
        engine = self.state.engines.get(event.engine_id)
        for ref in event.blocks:
            if not self._current(at, engine, ref, "takes a ref on"):
                continue
            assert engine is not None
            if engine.pools[ref.pool_id].keys[ref.block_id] is None:
                writers = list(self._busy.get((event.engine_id, ref.pool_id, ref.block_id), {}))
                self._flag(
                    "I17",
                    at,
                    f"takes a ref on {ref_text(ref)}, which holds no complete content: its compute or load is not done",
                    self._job_evidence(writers),
                )
        return False

    def _blocks_released(self, event: BlocksReleased, at: At) -> bool:
        engine = self.state.engines.get(event.engine_id)
        for ref in event.blocks:
            self._current(at, engine, ref, "releases")
        return False

    def _blocks_computed(self, event: BlocksComputed, at: At) -> bool:
        engine = self.state.engines.get(event.engine_id)
        for computed in event.blocks:
            if computed.block.block_id == NULL_BLOCK_ID:
                self._flag(
                    "I2",
                    at,
                    f"gives the null block {ref_text(computed.block)} a content key "
                    f"({computed.key.hex()}): its zeros would be stored as a state",
                )
                continue
            self._current(at, engine, computed.block, "marks computed")
        return False

    def _encoder_entry_allocated(self, event: EncoderEntryAllocated, at: At) -> bool:
        self._encoder_seq[(event.engine_id, event.entry_id)] = at.seq
        return False

    # --- lookups -----------------------------------------------------------------------------------------

    def _prefix_looked_up(self, event: PrefixLookedUp, at: At) -> bool:
        engine = self.state.engines.get(event.engine_id)
        tier = self.state.tiers.get(event.tier)
        if engine is None or tier is None:
            return False
        groups = [pool for pool in engine.pools.values() if pool.spec.kind != "encoder"]
        unit = reuse_unit((pool.spec.kind, pool.spec.block_size) for pool in groups)
        if event.reuse_unit != unit or (unit and event.boundary % unit) or (not unit and event.boundary):
            self._flag(
                "I7",
                at,
                f"lookup stops at {event.boundary} tokens with reuse unit {event.reuse_unit}; "
                f"the engine's groups make the unit {unit}: a hit must be a whole unit",
            )
            return False
        hits = {hit.pool_id: hit.keys for hit in event.hits}
        if not event.boundary:
            if event.hits:
                self._flag("I6", at, "lookup with no hit names keys to load")
            return False
        for pool in groups:
            size, kind = pool.spec.block_size, pool.spec.kind
            end = event.boundary // size
            start = (
                end - 1
                if kind == "state"
                else (
                    max(0, (event.boundary - pool.spec.sliding_window) // size)
                    if kind == "sliding_window" and pool.spec.sliding_window
                    else 0
                )
            )
            keys = hits.get(pool.spec.pool_id)
            if keys is None or len(keys) != end - start:
                self._flag(
                    "I6",
                    at,
                    f"lookup hit at {event.boundary} names {0 if keys is None else len(keys)} keys of "
                    f"group {pool.spec.pool_id}, which needs {end - start} to resume there",
                )
                continue
            for key in keys:
                entry = tier.entry(pool.spec.pool_id, key)
                if entry is None or entry.quarantined:
                    self._flag(
                        "I6",
                        at,
                        f"lookup hit at {event.boundary} names key {key.hex()} of group "
                        f"{pool.spec.pool_id}, which is {'quarantined' if entry else 'not published'}",
                    )
                elif entry.namespace_id != engine.namespace_id:
                    self._flag(
                        "I9",
                        at,
                        f"lookup hit names key {key.hex()} of another namespace ({entry.namespace_id.hex()})",
                        self._seen(self._published_seq.get((event.tier, pool.spec.pool_id, key)), f"{key.hex()[:8]} published"),
                    )
        return False

    def _state_copy_planned(self, event: StateCopyPlanned, at: At) -> bool:
        engine = self.state.engines.get(event.engine_id)
        for ref in event.blocks:
            self._current(at, engine, ref, "copies")
        for problem in copy_plan_problems([batch.ops() for batch in event.batches]):
            self._flag("I15", at, problem)
        self._started(
            event.job_id,
            [(event.engine_id, ref.pool_id, ref.block_id) for ref in event.blocks if ref.block_id != NULL_BLOCK_ID],
            at,
        )
        return False


def copy_plan_problems(batches: Sequence[Sequence[CopyOp]]) -> list[str]:
    """I15: what is wrong with a copy plan run batch after batch, each batch's copies in any
    order: a copy reading a region that an earlier batch, or another copy of its batch, writes
    (scratch excepted: a cycle's saved source is written to be read), a copy overlapping itself
    that is not ordered (memmove), two destinations overlapping, scratch read before it was
    saved. Empty for a sound plan (coordinator/core/copy_plan.py)."""
    problems: list[str] = []
    written: dict[int, list[tuple[int, int, int, int]]] = {}
    """block_id -> (start, end, batch, copy) of every region written so far, this batch included."""
    saved: list[tuple[int, int]] = []
    for number, batch in enumerate(batches):
        for index, op in enumerate(batch):
            dst = op.dst
            if dst.block is None:
                continue
            regions = written.setdefault(dst.block.block_id, [])
            if any(dst.offset < end and start < dst.offset + dst.length for start, end, _, _ in regions):
                problems.append(f"batch {number} writes {region_text(dst)}, which the plan writes already")
            regions.append((dst.offset, dst.offset + dst.length, number, index))
            if overlaps(op.src, dst) and not op.ordered:
                problems.append(
                    f"batch {number} copies {region_text(op.src)} onto the overlapping {region_text(dst)} without "
                    "memmove semantics (ordered=False)"
                )
        for index, op in enumerate(batch):
            src = op.src
            if src.block is None:
                if not any(start <= src.offset and src.offset + src.length <= end for start, end in saved):
                    problems.append(
                        f"batch {number} reads scratch [{src.offset}, {src.offset + src.length}) before anything saved it there"
                    )
                continue
            for start, end, writer, copy in written.get(src.block.block_id, []):
                if (writer, copy) != (number, index) and src.offset < end and start < src.offset + src.length:
                    when = "another copy of the same batch" if writer == number else f"batch {writer}"
                    problems.append(
                        f"batch {number} reads {region_text(src)}, which {when} overwrites: the copy no "
                        "longer reads the content as it was before the plan"
                    )
                    break
        saved += [(op.dst.offset, op.dst.offset + op.dst.length) for op in batch if op.dst.block is None]
    return problems


def overlaps(a: Region, b: Region) -> bool:
    if a.block is None or b.block is None or a.block.block_id != b.block.block_id:
        return False
    return a.offset < b.offset + b.length and b.offset < a.offset + a.length


def region_text(region: Region) -> str:
    where = "scratch" if region.block is None else ref_text(region.block)
    return f"{where}[{region.offset}, {region.offset + region.length})"
