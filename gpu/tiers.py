"""Tiers as one worker rank sees them (each rank stores its shard). Every call names the item's
content key and the tier slot the coordinator gave it (StoreItem / LoadItem.tier_slot); a tier
is addressed by one of them:

* HostTier: host memory (pinned when the pools are on CUDA), by content key.
* DiskTier: one file per key under `root`, written to a temporary name, fsynced per the policy
  (`always`: the file and its directory before the rename is trusted; `never`: leave it to the
  OS), then renamed into place, so a reader never sees half a file under the key's name.
* SlotTier: host memory addressed by tier slot, like a memory segment of a shared store
  (Mooncake's): the bytes live at the slot, whatever key they were written for. A slot freed
  by an eviction and given to another key's store holds that key's bytes, so a read of the
  old key at that slot returns them. Only the coordinator's leases (I12) and the checksums
  (I13) stand between that and a wrong-KV read (the simulator's fault scenarios use it).

Every call also names the slot's generation (StoreItem / LoadItem.tier_generation): a tier whose
objects outlive a slot's reuse names them by it (gpu.mooncake.MooncakeTier); these do not need it.
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

    def write(self, key: bytes, data: torch.Tensor, *, slot: int, generation: int = 0) -> bytes: ...

    def read(self, key: bytes, nbytes: int, *, slot: int, generation: int = 0) -> torch.Tensor: ...

    def delete(self, key: bytes) -> None: ...


class HostTier:
    def __init__(self, name: str, device: torch.device) -> None:
        self.name = name
        self.device = device
        self._blocks: dict[bytes, torch.Tensor] = {}

    def write(self, key: bytes, data: torch.Tensor, *, slot: int, generation: int = 0) -> bytes:
        """`slot` is not used: this tier is addressed by key."""
        buffer = host_buffer(data.numel(), self.device)
        buffer.copy_(data.reshape(-1))
        self._blocks[key] = buffer
        return checksum(buffer)

    def read(self, key: bytes, nbytes: int, *, slot: int, generation: int = 0) -> torch.Tensor:
        found = self._blocks.get(key)
        if found is None:
            raise TierError("missing", f"key {key.hex()} is not in host tier {self.name!r}")
        if found.numel() != nbytes:
            raise TierError("size_mismatch", f"key {key.hex()} holds {found.numel()} bytes, expected {nbytes}")
        return found

    def delete(self, key: bytes) -> None:
        self._blocks.pop(key, None)


class SlotTier:
    """Host memory of `num_slots` slots of at most `bytes_per_slot` bytes, addressed by slot.
    A read returns what the slot holds now, checking only that it was written with that many
    bytes: the key it was written for is kept for messages and `delete`, never checked."""

    def __init__(self, name: str, device: torch.device, num_slots: int, bytes_per_slot: int) -> None:
        self.name = name
        self.device = device
        self.num_slots = num_slots
        self.bytes_per_slot = bytes_per_slot
        self._slots: dict[int, tuple[bytes, torch.Tensor]] = {}
        """slot -> (the key last written there, its bytes)."""

    def _check_slot(self, slot: int) -> None:
        if not 0 <= slot < self.num_slots:
            raise TierError("unknown_slot", f"slot {slot} is outside tier {self.name!r} of {self.num_slots} slots")

    def write(self, key: bytes, data: torch.Tensor, *, slot: int, generation: int = 0) -> bytes:
        self._check_slot(slot)
        if data.numel() * data.element_size() > self.bytes_per_slot:
            raise TierError(
                "size_mismatch",
                f"{data.numel() * data.element_size()} bytes do not fit a slot of {self.bytes_per_slot} in tier {self.name!r}",
            )
        buffer = host_buffer(data.numel() * data.element_size(), self.device)
        buffer.copy_(data.reshape(-1).view(torch.uint8))
        self._slots[slot] = (key, buffer)
        return checksum(buffer)

    def read(self, key: bytes, nbytes: int, *, slot: int, generation: int = 0) -> torch.Tensor:
        self._check_slot(slot)
        found = self._slots.get(slot)
        if found is None:
            raise TierError("missing", f"slot {slot} of tier {self.name!r} was never written (reading key {key.hex()})")
        written_for, data = found
        if data.numel() != nbytes:
            raise TierError(
                "size_mismatch",
                f"slot {slot} holds {data.numel()} bytes (written for key {written_for.hex()}), expected {nbytes}",
            )
        copy = host_buffer(nbytes, self.device)
        copy.copy_(data)
        return copy

    def delete(self, key: bytes) -> None:
        for slot in [slot for slot, (written_for, _) in self._slots.items() if written_for == key]:
            del self._slots[slot]


class DiskTier:
    def __init__(self, name: str, root: Path, device: torch.device, fsync: FsyncPolicy = "always") -> None:
        self.name = name
        self.root = root
        self.device = device
        self.fsync = fsync
        root.mkdir(parents=True, exist_ok=True)

    def path(self, key: bytes) -> Path:
        return self.root / f"{key.hex()}.kv"

    def write(self, key: bytes, data: torch.Tensor, *, slot: int, generation: int = 0) -> bytes:
        """`slot` is not used: this tier is addressed by key (a file per key)."""
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

    def read(self, key: bytes, nbytes: int, *, slot: int, generation: int = 0) -> torch.Tensor:
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
