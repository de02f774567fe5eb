"""Checksums of KV bytes: xxh3-128 (the `xxhash` package) over the raw bytes of a block shard,
in memory order. 16 bytes, fast enough to be always on (I13; seed 002: the checksum was off by
default). A tensor on a GPU is copied to the host first; a host tensor is hashed in place."""

from __future__ import annotations

import ctypes

import torch
import xxhash

ALGORITHM = "xxh3-128"


def checksum(data: torch.Tensor | bytes | bytearray | memoryview) -> bytes:
    """The 16-byte xxh3-128 digest of `data`'s bytes."""
    if isinstance(data, torch.Tensor):
        return xxhash.xxh3_128(tensor_bytes(data)).digest()
    return xxhash.xxh3_128(data).digest()


def tensor_bytes(data: torch.Tensor) -> bytes:
    """A tensor's bytes in memory order, as one host copy (no numpy needed)."""
    host = data.detach().contiguous().cpu()
    size = host.numel() * host.element_size()
    return ctypes.string_at(host.data_ptr(), size) if size else b""
