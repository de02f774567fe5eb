"""Tiers addressed by content key, as one worker rank sees them (each rank stores its shard).

* HostTier: host memory (pinned when the pools are on CUDA).
* DiskTier: one file per key under `root`, written to a temporary name, fsynced per the policy
  (`always`: the file and its directory before the rename is trusted; `never`: leave it to the
  OS), then renamed into place, so a reader never sees half a file under the key's name.

`write` returns the checksum of the bytes actually written (gpu/checksum.py). `read` fills a
host buffer and fails with a TierError naming why: a missing, truncated or oversized file.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Literal, Protocol

import torch

from gpu.checksum import checksum, tensor_bytes
from gpu.device import host_buffer

FsyncPolicy = Literal["always", "never"]


class TierError(Exception):
    def __init__(self, reason: str, message: str) -> None:
        super().__init__(f"{reason}: {message}")
        self.reason = reason


class Tier(Protocol):
    name: str

    def write(self, key: bytes, data: torch.Tensor) -> bytes: ...

    def read(self, key: bytes, nbytes: int) -> torch.Tensor: ...

    def delete(self, key: bytes) -> None: ...


class HostTier:
    def __init__(self, name: str, device: torch.device) -> None:
        self.name = name
        self.device = device
        self._blocks: dict[bytes, torch.Tensor] = {}

    def write(self, key: bytes, data: torch.Tensor) -> bytes:
        buffer = host_buffer(data.numel(), self.device)
        buffer.copy_(data.reshape(-1))
        self._blocks[key] = buffer
        return checksum(buffer)

    def read(self, key: bytes, nbytes: int) -> torch.Tensor:
        found = self._blocks.get(key)
        if found is None:
            raise TierError("missing", f"key {key.hex()} is not in host tier {self.name!r}")
        if found.numel() != nbytes:
            raise TierError("size_mismatch", f"key {key.hex()} holds {found.numel()} bytes, expected {nbytes}")
        return found

    def delete(self, key: bytes) -> None:
        self._blocks.pop(key, None)


class DiskTier:
    def __init__(self, name: str, root: Path, device: torch.device, fsync: FsyncPolicy = "always") -> None:
        self.name = name
        self.root = root
        self.device = device
        self.fsync = fsync
        root.mkdir(parents=True, exist_ok=True)

    def path(self, key: bytes) -> Path:
        return self.root / f"{key.hex()}.kv"

    def write(self, key: bytes, data: torch.Tensor) -> bytes:
        payload = tensor_bytes(data)
        final = self.path(key)
        temporary = final.with_name(f".{final.name}.{os.getpid()}.tmp")
        with open(temporary, "wb") as handle:
            handle.write(payload)
            handle.flush()
            if self.fsync == "always":
                os.fsync(handle.fileno())
        os.replace(temporary, final)
        if self.fsync == "always":
            directory = os.open(self.root, os.O_RDONLY)
            try:
                os.fsync(directory)
            finally:
                os.close(directory)
        return checksum(payload)

    def read(self, key: bytes, nbytes: int) -> torch.Tensor:
        path = self.path(key)
        try:
            with open(path, "rb") as handle:
                payload = handle.read(nbytes + 1)
        except FileNotFoundError:
            raise TierError("missing", f"tier {self.name!r} has no file for key {key.hex()} ({path})") from None
        except OSError as error:
            raise TierError("io_error", f"reading {path}: {error}") from error
        if len(payload) < nbytes:
            raise TierError("truncated", f"{path} holds {len(payload)} bytes, expected {nbytes}")
        if len(payload) > nbytes:
            raise TierError("size_mismatch", f"{path} holds more than the {nbytes} bytes expected")
        buffer = host_buffer(nbytes, self.device)
        buffer.copy_(torch.frombuffer(bytearray(payload), dtype=torch.uint8))
        return buffer

    def delete(self, key: bytes) -> None:
        self.path(key).unlink(missing_ok=True)

