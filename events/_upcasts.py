"""The upcasters every EventCodec starts with: each turns one event type's payload (decoded
untyped: structs as maps, array-like structs as lists) from one schema version to the next."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import msgspec

from events._values import SCRATCH_BLOCK

Upcaster = Callable[[dict[str, Any]], dict[str, Any]]
"""One step of one event type: its fields at version v -> its fields at v + 1."""


def _state_copy_planned_v1(fields: dict[str, Any]) -> dict[str, Any]:
    """v1 -> v2: each batch, a list of CopyOps ([src, dst, ordered], a region [block or None,
    offset, length], a block [pool, block_id, generation]), becomes a CopyBatch's columns. The
    decider only wrote copies of equal sizes within the event's pool; anything else cannot be
    said in columns and is refused as corrupt rather than guessed at."""
    pool_id = fields["pool_id"]
    batches = []
    for number, batch in enumerate(fields["batches"]):
        columns: list[list[Any]] = [[] for _ in range(8)]
        for index, (src, dst, ordered) in enumerate(batch):
            if src[2] != dst[2]:
                raise msgspec.ValidationError(f"v1 copy plan batch {number} op {index}: src has {src[2]} bytes, dst {dst[2]}")
            for side, (block, offset, _) in enumerate((src, dst)):
                if block is not None and block[0] != pool_id:
                    raise msgspec.ValidationError(f"v1 copy plan batch {number} op {index} leaves pool {pool_id}")
                columns[3 * side].append(SCRATCH_BLOCK if block is None else block[1])
                columns[3 * side + 1].append(0 if block is None else block[2])
                columns[3 * side + 2].append(offset)
            columns[6].append(src[2])
            columns[7].append(ordered)
        batches.append([pool_id, *columns])
    return {**fields, "batches": batches}


UPCASTERS: dict[tuple[str, int], Upcaster] = {
    ("state_copy_planned", 1): _state_copy_planned_v1,
}
"""(event type, from version) -> the step to from_version + 1."""
