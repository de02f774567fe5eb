"""Device KV pools: one tensor per cache group, shaped and typed from the engine's declaration:
[num_blocks, bytes_per_block / itemsize] of the namespace's KV dtype (events.PoolSpec,
NamespaceSpec.kv_dtype). `bytes_per_block` is what one rank holds of a block (its tensor-parallel
shard); every rank has its own pools. Transfers and copies work on the same memory as bytes
(`pool()` and `block()` are uint8 views). Block 0 is the null block (I2): no transfer names it."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch

from events import NULL_BLOCK_ID, BlockRef, PoolSpec


class TransferError(Exception):
    """A decision this worker cannot carry out; `reason` is a stable word for the report."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(f"{reason}: {message}")
        self.reason = reason


KV_DTYPES: dict[str, torch.dtype] = {
    "uint8": torch.uint8,
    "int8": torch.int8,
    "float8_e4m3fn": torch.float8_e4m3fn,
    "float8_e5m2": torch.float8_e5m2,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float32": torch.float32,
}


def kv_dtype(name: str) -> torch.dtype:
    found = KV_DTYPES.get(name)
    if found is None:
        raise ValueError(f"KV dtype {name!r} is not one of {sorted(KV_DTYPES)}")
    return found


class DevicePools:
    def __init__(
        self, specs: Sequence[PoolSpec], device: torch.device, dtype: str = "uint8", *, directory: Path | None = None
    ) -> None:
        """With `directory` (CPU only), each pool is the file `pool-ID.kv` there, mapped shared:
        every process that maps the same directory sees the same memory (an engine and its
        worker processes; `/dev/shm` keeps it in memory). Created zero-filled when missing."""
        if directory is not None and device.type != "cpu":
            raise ValueError(f"pools mapped from files live in host memory, not on {device}")
        self.device = device
        self.dtype = kv_dtype(dtype)
        itemsize = torch.empty((), dtype=self.dtype).element_size()
        self.specs = {spec.pool_id: spec for spec in specs}
        self.typed: dict[int, torch.Tensor] = {}
        """The pools as the engine's kernels see them, in the KV dtype."""
        for spec in specs:
            if spec.bytes_per_block % itemsize:
                raise ValueError(f"pool {spec.pool_id}: {spec.bytes_per_block} bytes per block is not a whole number of {dtype}")
            shape = (spec.num_blocks, spec.bytes_per_block // itemsize)
            if directory is None:
                self.typed[spec.pool_id] = torch.zeros(shape, dtype=self.dtype, device=device)
                continue
            directory.mkdir(parents=True, exist_ok=True)
            mapped = torch.from_file(
                str(directory / f"pool-{spec.pool_id}.kv"),
                shared=True,
                size=spec.num_blocks * spec.bytes_per_block,
                dtype=torch.uint8,
            )
            self.typed[spec.pool_id] = mapped.view(self.dtype).view(shape)
        self.tensors = {pool_id: typed.view(torch.uint8) for pool_id, typed in self.typed.items()}
        """The same memory as bytes, [num_blocks, bytes_per_block]: what transfers move."""

    def pool(self, pool_id: int) -> torch.Tensor:
        tensor = self.tensors.get(pool_id)
        if tensor is None:
            raise TransferError("unknown_pool", f"no pool {pool_id} (pools: {sorted(self.tensors)})")
        return tensor

    def block(self, ref: BlockRef, *, allow_null: bool = False) -> torch.Tensor:
        """The view of one block shard; refuses the null block (unless the simulator's
        null-state scenario runs unprotected) and ids outside the pool."""
        tensor = self.pool(ref.pool_id)
        if ref.block_id == NULL_BLOCK_ID and allow_null:
            return tensor[NULL_BLOCK_ID]
        if ref.block_id == NULL_BLOCK_ID:
            raise TransferError("null_block", f"block {ref.pool_id}/0 is the null block")
        if not 0 < ref.block_id < tensor.shape[0]:
            raise TransferError("unknown_block", f"pool {ref.pool_id} has blocks 1..{tensor.shape[0] - 1}, not {ref.block_id}")
        return tensor[ref.block_id]
