"""Device KV pools: one uint8 tensor per cache group, [num_blocks, bytes_per_block], shaped from
the engine's declaration (events.PoolSpec). `bytes_per_block` is what one rank holds of a block
(its tensor-parallel shard); every rank has its own pools. Block 0 is the null block (I2): no
transfer ever names it."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from events import NULL_BLOCK_ID, BlockRef, PoolSpec


class TransferError(Exception):
    """A decision this worker cannot carry out; `reason` is a stable word for the report."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(f"{reason}: {message}")
        self.reason = reason


class DevicePools:
    def __init__(self, specs: Sequence[PoolSpec], device: torch.device) -> None:
        self.device = device
        self.specs = {spec.pool_id: spec for spec in specs}
        self.tensors = {
            spec.pool_id: torch.zeros((spec.num_blocks, spec.bytes_per_block), dtype=torch.uint8, device=device)
            for spec in specs
        }

    def pool(self, pool_id: int) -> torch.Tensor:
        tensor = self.tensors.get(pool_id)
        if tensor is None:
            raise TransferError("unknown_pool", f"no pool {pool_id} (pools: {sorted(self.tensors)})")
        return tensor

    def block(self, ref: BlockRef) -> torch.Tensor:
        """The view of one block shard; refuses the null block and ids outside the pool."""
        tensor = self.pool(ref.pool_id)
        if ref.block_id == NULL_BLOCK_ID:
            raise TransferError("null_block", f"block {ref.pool_id}/0 is the null block")
        if not 0 < ref.block_id < tensor.shape[0]:
            raise TransferError("unknown_block", f"pool {ref.pool_id} has blocks 1..{tensor.shape[0] - 1}, not {ref.block_id}")
        return tensor[ref.block_id]
