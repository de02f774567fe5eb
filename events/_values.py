"""Value types shared by events and commands: block references, pool, tier and namespace specs."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import msgspec

PoolKind = Literal["attention", "sliding_window", "state", "encoder"]
"""A cache group's kind. `state` covers recurrent (Mamba, GDN, ShortConv) state pools."""

NamespaceOutcome = Literal["new", "compatible", "clear"]
"""A release decision between two namespaces (seed 003): B is a new namespace and shares nothing
with A; B may treat A's keys as equivalent (verified by a run comparing cached and uncached
outputs); or A's keys are cleared (quarantined) so no one loads them."""

NULL_BLOCK_ID = 0
"""Block 0 of every pool is the null block: never allocated, stored, loaded, copied or published
(I2; seed 004, vLLM's NULL_BLOCK_ID)."""


class BlockRef(msgspec.Struct, frozen=True, array_like=True, gc=False):
    """One lifetime of one slot: (pool, block_id, generation). Every message that touches a block
    names the generation it means (I1).

    gc=False, as every frozen value nested in events (the specs, Region, CopyOp, ComputedBlock,
    GroupHit, StoreItem, LoadItem, ExternalItem) and in commands (ExternalKey, LoadRequest, Move):
    they hold only numbers, bytes, strings and lists of them, so they are never part of a
    reference cycle, and the cyclic collector need not track the hundreds of thousands a replay
    decodes (ops/bench/log.py decoded 1.26-1.28M events/s against 1.09-1.16M tracked;
    tests/log/test_codec.py holds every value within an event to it)."""

    pool_id: int
    block_id: int
    generation: int


class PoolSpec(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    """The physical blocks of one cache group on a device."""

    pool_id: int
    kind: PoolKind
    num_blocks: int
    block_size: int
    """Tokens per block."""
    bytes_per_block: int
    managed: bool = True
    """Managed: kvledger chooses slots. Reported: the engine owns its allocator (vLLM's GPU
    blocks) and reports each allocation; kvledger checks it and assigns the generation."""
    sliding_window: int = 0
    """Tokens of context a sliding-window group needs to resume; 0 for other kinds."""


class TierSpec(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    """Where stored KV lives outside the device (host memory, local disk, a shared store)."""

    name: str
    num_slots: int
    bytes_per_slot: int


class NamespaceSpec(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    """What makes computed state comparable (seed 003). `namespace_id` is a digest of the
    canonical encoding of every field; see coordinator.core.keys."""

    model_id: str
    weights_revision: str
    """A digest of the exact checkpoint, not a display name (seed 003)."""
    tokenizer_digest: str
    """Tokenizer files, chat template and special-token rules."""
    kv_dtype: str
    kv_layout_version: int
    block_sizes: tuple[int, ...]
    """Block size in tokens of every cache group, in pool order."""
    tensor_parallel_size: int
    tenant: str
    """The sharing boundary: two tenants never share keys (I9)."""
    hash_algorithm: str = "blake3-128/kvledger-v1"
    pipeline_parallel_size: int = 1
    adapter_id: str = ""
    adapter_revision: str = ""
    kv_rank_layout: str = ""
    """How a block's KV is split across the ranks (vLLM's connector says "heads": each tensor-parallel
    rank stores its share of the KV heads). With the parallel sizes it is the parallel layout: two
    engines that lay a block out differently never share its key (vLLM #56772: TP1 and TP2 engines
    shared keys of different layouts, and completions differed)."""
    parallelism_agnostic: bool = False
    """The engine stores every block whole, laid out the same at any parallel layout: the parallel
    sizes and kv_rank_layout are left out of the namespace id, so engines of any TP/PP size share
    keys (and never those of an engine that did not say so). Only an engine whose stored bytes do
    not depend on its ranks may say it."""


class Region(msgspec.Struct, frozen=True, array_like=True, gc=False):
    """Bytes [offset, offset + length) of one block, or of the copy's scratch area when
    `block` is None."""

    block: BlockRef | None
    offset: int
    length: int


class CopyOp(msgspec.Struct, frozen=True, array_like=True, gc=False):
    """One copy inside an ordered state-copy plan (I15)."""

    src: Region
    dst: Region
    ordered: bool
    """True when src and dst overlap: the worker must copy with memmove semantics."""


SCRATCH_BLOCK = -1
"""The block id that names a copy plan's scratch area in a CopyBatch column (a Region whose
block is None); its generation column holds 0."""


class CopyBatch(msgspec.Struct, frozen=True, array_like=True, gc=False):
    """One batch of an ordered state-copy plan (I15), in columns: op k is entry k of every
    column, all of one pool. `ops()` reads it back as CopyOps.

    Columns, not a list of CopyOps (issue 22): a worker checks a 1,024-op batch in 0.15-0.17 ms
    reading columns, 0.45 ms reading CopyOps with their nested Regions and BlockRefs, a third of
    the copy itself (ops/bench/copies.py, half-block segments). The columns are int lists, not
    packed int64 bytes: bytes would read into numpy for nothing (np.frombuffer: 5 us for the
    five columns a worker reads, lists 90 us), but are opaque in the JSON export and to any
    reader's code, and cost 8 bytes an entry in the log where msgpack spends 1-3 on a plan's
    small ids and offsets (a 1,024-op batch: 15 KB as int lists, 57 KB as int64 bytes, 25 KB as
    CopyOps). Decoding one from the log costs 90 us as lists, 330 us as CopyOps.

    A scratch region has block SCRATCH_BLOCK (-1) and generation 0. One `length` serves both
    sides: a copy's source and destination have the same size. Columns of unequal length are
    refused when the batch is made or decoded (ValueError; msgspec.ValidationError on decode)."""

    pool_id: int
    src_block: list[int]
    src_generation: list[int]
    src_offset: list[int]
    dst_block: list[int]
    dst_generation: list[int]
    dst_offset: list[int]
    length: list[int]
    ordered: list[bool]
    """True when src and dst overlap: the worker must copy with memmove semantics."""

    def __post_init__(self) -> None:
        count = len(self.length)
        columns = (self.src_block, self.src_generation, self.src_offset, self.dst_block, self.dst_generation, self.dst_offset)
        if any(len(column) != count for column in columns) or len(self.ordered) != count:
            sizes = ", ".join(f"{name} {len(getattr(self, name))}" for name in self.__struct_fields__[1:])
            raise ValueError(f"a copy batch's columns differ in length: {sizes}")

    def __len__(self) -> int:
        return len(self.length)

    @classmethod
    def from_ops(cls, pool_id: int, ops: Sequence[CopyOp]) -> CopyBatch:
        """Pack CopyOps of pool `pool_id`. ValueError for an op whose source and destination
        differ in size, a block of another pool, or a block numbered SCRATCH_BLOCK: the columns
        cannot say them."""
        src_block: list[int] = []
        src_generation: list[int] = []
        src_offset: list[int] = []
        dst_block: list[int] = []
        dst_generation: list[int] = []
        dst_offset: list[int] = []
        for index, op in enumerate(ops):
            if op.src.length != op.dst.length:
                raise ValueError(f"op {index}: src has {op.src.length} bytes, dst {op.dst.length}")
            for region, (block, generation, offset) in (
                (op.src, (src_block, src_generation, src_offset)),
                (op.dst, (dst_block, dst_generation, dst_offset)),
            ):
                ref = region.block
                if ref is None:
                    block.append(SCRATCH_BLOCK)
                    generation.append(0)
                else:
                    if ref.pool_id != pool_id or ref.block_id == SCRATCH_BLOCK:
                        raise ValueError(
                            f"op {index} names block {ref.block_id} of pool {ref.pool_id}, in a batch of pool {pool_id}"
                        )
                    block.append(ref.block_id)
                    generation.append(ref.generation)
                offset.append(region.offset)
        lengths = [op.src.length for op in ops]
        ordered = [op.ordered for op in ops]
        return cls(pool_id, src_block, src_generation, src_offset, dst_block, dst_generation, dst_offset, lengths, ordered)

    def op(self, index: int) -> CopyOp:
        """Op `index` as a CopyOp."""
        return CopyOp(
            self._region(self.src_block[index], self.src_generation[index], self.src_offset[index], self.length[index]),
            self._region(self.dst_block[index], self.dst_generation[index], self.dst_offset[index], self.length[index]),
            self.ordered[index],
        )

    def ops(self) -> list[CopyOp]:
        """Every op as a CopyOp, in order (for the audit, descriptions and tests)."""
        return [self.op(index) for index in range(len(self))]

    def _region(self, block_id: int, generation: int, offset: int, length: int) -> Region:
        return Region(None if block_id == SCRATCH_BLOCK else BlockRef(self.pool_id, block_id, generation), offset, length)
