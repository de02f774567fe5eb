"""events.CopyBatch: one batch of a state-copy plan (I15) in columns, and its way back to CopyOps."""

from __future__ import annotations

import msgspec
import pytest

from events import SCRATCH_BLOCK, BlockRef, CopyBatch, CopyOp, Region

POOL_ID = 3


def _ref(block_id: int, generation: int = 1) -> BlockRef:
    return BlockRef(POOL_ID, block_id, generation)


def _good_op() -> CopyOp:
    return CopyOp(Region(_ref(1), 0, 8), Region(_ref(2), 0, 8), False)


def test_a_copy_batch_reads_back_the_ops_it_was_made_of() -> None:
    ops = [
        CopyOp(Region(_ref(1, 7), 8, 16), Region(None, 32, 16), False),
        CopyOp(Region(None, 0, 4), Region(_ref(2, 9), 60, 4), False),
        CopyOp(Region(_ref(3, 2), 0, 48), Region(_ref(3, 2), 8, 48), True),
    ]
    batch = CopyBatch.from_ops(POOL_ID, ops)
    assert len(batch) == 3 and batch.ops() == ops and batch.op(1) == ops[1]
    assert batch.src_block == [1, SCRATCH_BLOCK, 3] and batch.dst_generation == [0, 9, 2] and batch.length == [16, 4, 48]
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(batch), type=CopyBatch) == batch
    assert not CopyBatch.from_ops(POOL_ID, [])


def test_a_copy_batch_refuses_ops_its_columns_cannot_say() -> None:
    """One length column, one pool, and block -1 means scratch: ops that say otherwise are
    refused when packed (gpu.copies' old size_mismatch and mixed pools inside one batch)."""
    for bad, needle in (
        (CopyOp(Region(_ref(1), 0, 8), Region(_ref(3), 0, 9), False), "src has 8 bytes, dst 9"),
        (CopyOp(Region(BlockRef(POOL_ID + 1, 4, 1), 0, 8), Region(_ref(3), 0, 8), False), f"pool {POOL_ID + 1}"),
        (CopyOp(Region(_ref(1), 0, 8), Region(_ref(SCRATCH_BLOCK), 0, 8), False), "block -1"),
    ):
        with pytest.raises(ValueError, match="op 1") as caught:
            CopyBatch.from_ops(POOL_ID, [_good_op(), bad])
        assert needle in str(caught.value)


def test_columns_of_unequal_length_are_refused_when_made_or_decoded() -> None:
    columns = ([1], [1], [0], [2], [1], [0], [8], [False])
    with pytest.raises(ValueError, match="differ in length") as caught:
        CopyBatch(POOL_ID, *columns[:6], [8, 8], [False])
    assert "length 2" in str(caught.value) and "src_block 1" in str(caught.value)
    encoded = msgspec.msgpack.encode([POOL_ID, *columns[:5], [0, 8], [8], [False]])
    with pytest.raises(msgspec.ValidationError, match="differ in length"):
        msgspec.msgpack.decode(encoded, type=CopyBatch)
