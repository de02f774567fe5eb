"""Value types shared by events and commands: block references, pool, tier and namespace specs."""

from __future__ import annotations

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


class BlockRef(msgspec.Struct, frozen=True, array_like=True):
    """One lifetime of one slot: (pool, block_id, generation). Every message that touches a block
    names the generation it means (I1)."""

    pool_id: int
    block_id: int
    generation: int


class PoolSpec(msgspec.Struct, frozen=True, kw_only=True):
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


class TierSpec(msgspec.Struct, frozen=True, kw_only=True):
    """Where stored KV lives outside the device (host memory, local disk, a shared store)."""

    name: str
    num_slots: int
    bytes_per_slot: int


class NamespaceSpec(msgspec.Struct, frozen=True, kw_only=True):
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


class Region(msgspec.Struct, frozen=True, array_like=True):
    """Bytes [offset, offset + length) of one block, or of the copy's scratch area when
    `block` is None."""

    block: BlockRef | None
    offset: int
    length: int


class CopyOp(msgspec.Struct, frozen=True, array_like=True):
    """One copy inside an ordered state-copy plan (I15)."""

    src: Region
    dst: Region
    ordered: bool
    """True when src and dst overlap: the worker must copy with memmove semantics."""
