"""What a block's KV must be: a deterministic function of (namespace, token prefix, group, rank).

Recompute would produce exactly these bytes, so any load can be checked against them. The
namespace is always the whole one (weights revision and tenant included), whatever protection a
scenario switched off: a read of bytes computed under another namespace is a wrong-KV read.
"""

from __future__ import annotations

from collections.abc import Sequence

import blake3
import torch

from coordinator.core.keys import canonical_namespace
from events import NamespaceSpec

DOMAIN = b"kvledger-simulator-kv-content-v1"


def kv_bytes(namespace: NamespaceSpec, prefix: Sequence[int], pool_id: int, rank: int, nbytes: int) -> torch.Tensor:
    """The `nbytes` of KV that rank `rank` holds for the block of group `pool_id` ending the
    token prefix `prefix` (the state at the end of it, for a state group)."""
    hasher = blake3.blake3(DOMAIN)
    hasher.update(canonical_namespace(namespace))
    hasher.update(pool_id.to_bytes(4, "little") + rank.to_bytes(4, "little"))
    hasher.update(b"".join(token.to_bytes(4, "little", signed=True) for token in prefix))
    return torch.frombuffer(bytearray(hasher.digest(nbytes)), dtype=torch.uint8)
