"""Ordered state copies on real torch pools (I15): gpu.copies against parallel assignment.

Every expected result comes from an untouched snapshot (`original = pool.clone()`) by plain
slicing: for each move, expected[dst] = original[src]. Never from the planner or another copy
routine.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from coordinator.core.copy_plan import PlannedMove, overlapping_destinations, plan_copies
from events import SCRATCH_BLOCK, BlockRef, CopyBatch, CopyOp, Region
from gpu import copies
from gpu.copies import CopyError, apply_moves, execute_plan, validate_plan

NUM_BLOCKS = 6
BLOCK = 64
POOL_ID = 3

Move = tuple[BlockRef, int, BlockRef, int, int]


def _ref(block_id: int) -> BlockRef:
    return BlockRef(POOL_ID, block_id, 1)


def _move(src: int, src_off: int, dst: int, dst_off: int, length: int) -> Move:
    return (_ref(src), src_off, _ref(dst), dst_off, length)


def _plan(*batches: list[CopyOp], pool_id: int = POOL_ID) -> list[CopyBatch]:
    """A plan of hand-written batches, packed as the decider packs the planner's."""
    return [CopyBatch.from_ops(pool_id, ops) for ops in batches]


def _pool(num_blocks: int = NUM_BLOCKS, block: int = BLOCK, seed: int = 0, device: str = "cpu") -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (num_blocks, block), dtype=torch.uint8, generator=generator).to(device)


def _expected(original: torch.Tensor, moves: Sequence[Move]) -> torch.Tensor:
    """Parallel assignment by plain slicing of the snapshot."""
    expected = original.clone()
    for src, src_off, dst, dst_off, length in moves:
        expected[dst.block_id, dst_off : dst_off + length] = original[src.block_id, src_off : src_off + length]
    return expected


def _apply(moves: Sequence[Move], pool: torch.Tensor | None = None) -> tuple[int, int]:
    pool = _pool() if pool is None else pool
    original = pool.clone()
    expected = _expected(original, moves)
    result = apply_moves(pool, moves)
    assert torch.equal(pool, expected)
    return result


# --- aliasing built on purpose ------------------------------------------------------------------


def test_I15_left_shift_inside_one_block_is_a_memmove() -> None:
    assert _apply([_move(1, 8, 1, 0, 48)]) == (1, 0)


def test_I15_right_shift_inside_one_block_is_a_memmove() -> None:
    assert _apply([_move(1, 0, 1, 8, 48)]) == (1, 0)


def test_I15_odd_byte_shifts_both_ways() -> None:
    """Shifts by one byte at odd offsets: the row unit is one byte."""
    _apply([_move(2, 1, 2, 0, 63)])
    _apply([_move(2, 0, 2, 1, 63)])
    _apply([_move(2, 3, 2, 6, 37), _move(4, 9, 4, 2, 41)])


def test_I15_exact_self_copy_changes_nothing() -> None:
    pool = _pool()
    original = pool.clone()
    assert apply_moves(pool, [_move(2, 5, 2, 5, 20)]) == (0, 0)
    assert torch.equal(pool, original)


def test_I15_chain_reads_the_original_of_every_link() -> None:
    moves = [_move(1, 0, 2, 0, BLOCK), _move(2, 0, 3, 0, BLOCK), _move(3, 0, 4, 0, BLOCK)]  # A->B, B->C, C->D
    batches, scratch = _apply(moves)
    assert batches == 3 and scratch == 0


def test_I15_chain_of_segments_in_one_block() -> None:
    moves = [_move(1, 0, 1, 16, 16), _move(1, 16, 1, 32, 16), _move(1, 32, 1, 48, 16)]
    _apply(moves)


def test_I15_swap_of_two_blocks_goes_through_scratch() -> None:
    batches, scratch = _apply([_move(1, 0, 2, 0, BLOCK), _move(2, 0, 1, 0, BLOCK)])
    assert scratch == BLOCK and batches >= 2


def test_I15_swap_of_two_segments_of_one_block() -> None:
    _apply([_move(3, 0, 3, 40, 20), _move(3, 40, 3, 0, 20)])


def test_I15_rotation_of_three() -> None:
    moves = [_move(1, 0, 2, 0, BLOCK), _move(2, 0, 3, 0, BLOCK), _move(3, 0, 1, 0, BLOCK)]
    _, scratch = _apply(moves)
    assert scratch > 0


def test_I15_rotation_of_three_partial_overlapping_segments() -> None:
    moves = [_move(1, 4, 2, 10, 30), _move(2, 0, 3, 7, 30), _move(3, 3, 1, 20, 30)]
    _apply(moves)


def test_I15_one_source_copied_to_several_destinations() -> None:
    moves = [_move(1, 0, 2, 0, 32), _move(1, 0, 3, 16, 32), _move(1, 0, 1, 32, 32), _move(1, 0, 4, 0, 32)]
    _apply(moves)


def test_I15_disjoint_moves_run_as_one_batch() -> None:
    moves = [_move(1 + (i % 5), 8 * (i // 5), 1 + ((i + 2) % 5), 8 * (i // 5) + 4, 4) for i in range(35)]
    assert overlapping_destinations([PlannedMove(Region(s, so, n), Region(d, do, n)) for s, so, d, do, n in moves]) is None
    pool = _pool()
    original = pool.clone()
    batches, scratch = apply_moves(pool, moves)
    assert (batches, scratch) == (1, 0)
    assert torch.equal(pool, _expected(original, moves))


def test_I15_whole_block_moves_across_blocks_in_one_batch() -> None:
    assert _apply([_move(1, 0, 4, 0, BLOCK), _move(2, 0, 5, 0, BLOCK)]) == (1, 0)


def test_I15_moves_across_blocks_of_mixed_sizes() -> None:
    moves = [_move(1, 0, 5, 0, 64), _move(2, 3, 4, 50, 13), _move(3, 17, 4, 0, 40), _move(4, 10, 3, 1, 2)]
    _apply(moves)


def test_I15_shift_mixed_with_a_disjoint_move_and_a_chain() -> None:
    moves = [_move(1, 2, 1, 0, 60), _move(2, 0, 3, 0, 32), _move(3, 0, 4, 0, 32), _move(5, 10, 5, 30, 20)]
    _apply(moves)


def test_I15_no_moves_is_a_no_op() -> None:
    pool = _pool()
    original = pool.clone()
    assert apply_moves(pool, []) == (0, 0)
    assert torch.equal(pool, original)


def test_I15_pool_slice_with_odd_storage_offset() -> None:
    """A contiguous pool that starts at an odd byte of its storage: no wide view is possible."""
    backing = torch.randint(0, 256, (1 + NUM_BLOCKS * BLOCK,), dtype=torch.uint8)
    pool = backing[1:].view(NUM_BLOCKS, BLOCK)
    _apply([_move(1, 0, 2, 0, BLOCK), _move(2, 0, 1, 0, BLOCK), _move(3, 8, 3, 0, 48)], pool)


def test_I15_one_batch_with_many_row_units() -> None:
    """Ops whose offsets and lengths have gcds 64, 32, 16, 8, 4, 2 and 1 with the block: more
    unit groups than the executor keeps apart, so some share a smaller unit."""
    moves = [
        _move(1, 0, 2, 0, 64),
        _move(3, 32, 4, 0, 32),
        _move(3, 16, 4, 48, 16),
        _move(5, 8, 5, 16, 24),  # a shift: src and dst overlap
        _move(1, 4, 4, 36, 4),
        _move(1, 2, 4, 32, 2),
        _move(3, 1, 4, 41, 7),
    ]
    assert _apply(moves) == (1, 0)


def test_I15_cycles_through_scratch_with_mixed_units() -> None:
    moves = [
        _move(1, 0, 2, 0, 64),
        _move(2, 0, 1, 0, 64),  # swap of whole blocks
        _move(3, 1, 4, 3, 5),
        _move(4, 3, 3, 1, 5),  # swap of odd byte ranges
        _move(5, 8, 5, 0, 56),  # shift
    ]
    _, scratch = _apply(moves)
    assert scratch > 0


# --- random batches ----------------------------------------------------------------------------


@st.composite
def _move_sets(draw: st.DrawFn) -> list[Move]:
    """Non-overlapping destinations, arbitrary (overlapping, repeated) sources; lengths often
    multiples of 8 so the wide paths get exercised too."""
    moves: list[Move] = []
    planned: list[PlannedMove] = []
    for _ in range(draw(st.integers(1, 12))):
        length = draw(st.sampled_from([1, 3, 8, 16, 24, 32, BLOCK]) | st.integers(1, BLOCK))
        aligned = draw(st.booleans())

        def offset() -> int:
            if aligned and length % 8 == 0:
                return 8 * draw(st.integers(0, (BLOCK - length) // 8))
            return draw(st.integers(0, BLOCK - length))

        move = _move(draw(st.integers(1, NUM_BLOCKS - 1)), offset(), draw(st.integers(1, NUM_BLOCKS - 1)), offset(), length)
        candidate = PlannedMove(Region(move[0], move[1], length), Region(move[2], move[3], length))
        if overlapping_destinations([*planned, candidate]) is None:
            moves.append(move)
            planned.append(candidate)
    return moves


@settings(max_examples=150, deadline=None)
@given(_move_sets(), st.integers(0, 2**16))
def test_I15_random_batches_equal_parallel_assignment(moves: list[Move], seed: int) -> None:
    _apply(moves, _pool(seed=seed))


@settings(max_examples=50, deadline=None)
@given(_move_sets())
def test_I15_execute_plan_of_the_planner_equals_parallel_assignment(moves: list[Move]) -> None:
    """The same through execute_plan directly, plan made by hand-off from plan_copies."""
    pool = _pool(seed=1)
    original = pool.clone()
    batches, scratch = plan_copies([PlannedMove(Region(s, so, n), Region(d, do, n)) for s, so, d, do, n in moves])
    execute_plan(pool, _plan(*batches), scratch)
    assert torch.equal(pool, _expected(original, moves))


# --- hand-written plans: scratch in and out, batch semantics ----------------------------------


def test_plan_reading_and_writing_scratch_in_one_batch() -> None:
    """A batch may read scratch and write scratch; the gather happens before the scatter."""
    pool = _pool()
    original = pool.clone()
    a, b = _ref(1), _ref(2)
    batches = _plan(
        [CopyOp(Region(a, 0, 16), Region(None, 0, 16), False), CopyOp(Region(b, 0, 16), Region(None, 16, 16), False)],
        # scratch[0:16] -> scratch[16:32] while scratch[16:32] -> block 3 and block 1 -> block 4
        [
            CopyOp(Region(None, 0, 16), Region(None, 16, 16), True),
            CopyOp(Region(None, 16, 16), Region(_ref(3), 0, 16), False),
            CopyOp(Region(a, 32, 16), Region(_ref(4), 8, 16), False),
        ],
        [CopyOp(Region(None, 16, 16), Region(_ref(5), 48, 16), False)],
    )
    execute_plan(pool, batches, 32)
    expected = original.clone()
    expected[3, 0:16] = original[2, 0:16]
    expected[4, 8:24] = original[1, 32:48]
    expected[5, 48:64] = original[1, 0:16]
    assert torch.equal(pool, expected)


def test_a_batch_is_itself_a_parallel_assignment() -> None:
    """Even a batch whose ops are not independent reads only the state before the batch."""
    pool = _pool()
    original = pool.clone()
    execute_plan(
        pool,
        _plan(
            [
                CopyOp(Region(_ref(1), 0, 8), Region(_ref(2), 0, 8), False),
                CopyOp(Region(_ref(2), 0, 8), Region(_ref(3), 0, 8), False),
            ]
        ),
        0,
    )
    expected = original.clone()
    expected[2, 0:8] = original[1, 0:8]
    expected[3, 0:8] = original[2, 0:8]
    assert torch.equal(pool, expected)


def test_a_batch_larger_than_a_chunk_with_a_chain_inside_is_still_a_parallel_assignment() -> None:
    """A hand-made batch copying each block to the next, over more rows than one CPU chunk
    (gpu.copies._CHUNK_BYTES): a chunk must not read what an earlier chunk wrote, so this batch
    must be gathered whole before it is written."""
    block = 2048
    count = 3 * (copies._CHUNK_BYTES // block)
    pool = _pool(num_blocks=count + 2, block=block, seed=5)
    original = pool.clone()
    batch = [CopyOp(Region(_ref(i), 0, block), Region(_ref(i + 1), 0, block), False) for i in range(1, count + 1)]
    execute_plan(pool, _plan(batch), 0)
    expected = original.clone()
    expected[2 : count + 2] = original[1 : count + 1]
    assert torch.equal(pool, expected)


def test_a_disjoint_batch_larger_than_a_chunk_equals_parallel_assignment() -> None:
    """Disjoint moves (shuffled whole blocks, then half blocks) over several CPU chunks."""
    block = 1024
    count = 3 * (copies._CHUNK_BYTES // block) + 7
    rng = random.Random(11)
    targets = list(range(count + 1, 2 * count + 1))
    rng.shuffle(targets)
    for length in (block, block // 2):
        pool = _pool(num_blocks=2 * count + 1, block=block, seed=length)
        original = pool.clone()
        moves = [
            _move(src, rng.choice((0, block - length)), dst, rng.choice((0, block - length)), length)
            for src, dst in zip(range(1, count + 1), targets, strict=True)
        ]
        batches, scratch = _apply(moves, pool)
        assert (batches, scratch) == (1, 0)
        assert torch.equal(pool, _expected(original, moves))


@pytest.mark.parametrize("threads", [2, 3])
def test_a_disjoint_batch_split_between_threads_equals_parallel_assignment(threads: int) -> None:
    """A disjoint batch of at least gpu.copies._PARALLEL_BYTES is split into one range of rows a
    torch CPU thread; with a row count that no thread count divides, every range but the last
    ends inside a chunk. Each byte must still land once, from the untouched source."""
    block = 4096
    count = copies._PARALLEL_BYTES // block + 13
    rng = random.Random(threads)
    targets = list(range(count + 1, 2 * count + 1))
    rng.shuffle(targets)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        pool = _pool(num_blocks=2 * count + 1, block=block, seed=threads)
        original = pool.clone()
        moves = [_move(src, 0, dst, 0, block) for src, dst in zip(range(1, count + 1), targets, strict=True)]
        assert _apply(moves, pool) == (1, 0)
        assert torch.equal(pool, _expected(original, moves))
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize(
    ("second_src", "disjoint"),
    [
        (Region(_ref(2), 8, 8), True),  # reads right after what the first op writes
        (Region(_ref(2), 0, 8), True),  # reads right before it
        (Region(_ref(2), 9, 8), False),  # one byte of it
        (Region(_ref(2), 23, 8), False),  # the last byte of it
        (Region(_ref(1), 0, 8), False),  # what the second op itself writes
    ],
)
def test_a_batch_is_disjoint_only_when_no_op_reads_what_any_op_writes(second_src: Region, disjoint: bool) -> None:
    """The check that lets a batch be copied chunk by chunk (a wrong True would copy bytes
    already overwritten): destinations block 2 [16, 24) and block 1 [0, 8)."""
    pool = _pool()
    batch = [
        CopyOp(Region(_ref(3), 0, 8), Region(_ref(2), 16, 8), False),
        CopyOp(second_src, Region(_ref(1), 0, 8), second_src.block == _ref(1)),
    ]
    (checked,) = copies._validate(pool, _plan(batch), 0)
    assert checked.disjoint is disjoint


# --- bad plans change nothing ------------------------------------------------------------------


def _good_op() -> CopyOp:
    return CopyOp(Region(_ref(1), 0, 8), Region(_ref(2), 0, 8), False)


@pytest.mark.parametrize(
    ("bad", "reason", "needle"),
    [
        (CopyOp(Region(_ref(0), 0, 8), Region(_ref(2), 8, 8), False), "null_block", "block 0"),
        (CopyOp(Region(_ref(1), 0, 8), Region(_ref(0), 0, 8), False), "null_block", "block 0"),
        (CopyOp(Region(_ref(NUM_BLOCKS), 0, 8), Region(_ref(2), 8, 8), False), "unknown_block", f"block {NUM_BLOCKS}"),
        (CopyOp(Region(_ref(1), 0, 8), Region(_ref(-2), 0, 8), False), "unknown_block", "block -2"),
        (CopyOp(Region(_ref(1), BLOCK - 4, 8), Region(_ref(2), 8, 8), False), "out_of_bounds", "block 1"),
        (CopyOp(Region(_ref(1), -1, 8), Region(_ref(2), 8, 8), False), "out_of_bounds", "block 1"),
        (CopyOp(Region(_ref(1), 0, 0), Region(_ref(2), 8, 0), False), "out_of_bounds", "block 1"),
        (CopyOp(Region(_ref(1), 0, 8), Region(None, 0, 8), False), "out_of_bounds", "scratch"),
        (CopyOp(Region(_ref(1), 0, 8), Region(_ref(5), 4, 8), False), "overlapping_destinations", "block 5"),
        (
            CopyOp(Region(BlockRef(POOL_ID + 1, 4, 1), 0, 8), Region(BlockRef(POOL_ID + 1, 3, 1), 0, 8), False),
            "mixed_pools",
            "pools",
        ),
    ],
)
def test_bad_plan_raises_and_changes_nothing(bad: CopyOp, reason: str, needle: str) -> None:
    pool = _pool()
    original = pool.clone()
    # The bad op sits in the LAST batch: earlier, valid batches must not have run either. A
    # batch is of one pool: the op of another pool makes a batch of its own pool.
    pool_id = POOL_ID if bad.src.block is None else bad.src.block.pool_id
    neighbour = CopyOp(Region(BlockRef(pool_id, 4, 1), 0, 8), Region(BlockRef(pool_id, 5, 1), 0, 8), False)
    batches = [*_plan([_good_op()]), CopyBatch.from_ops(pool_id, [neighbour, bad])]
    with pytest.raises(CopyError) as caught:
        validate_plan(pool, batches, 0)
    assert caught.value.reason == reason
    with pytest.raises(CopyError) as caught:
        execute_plan(pool, batches, 0)
    assert caught.value.reason == reason
    assert needle in str(caught.value)
    if reason not in ("mixed_pools", "overlapping_destinations"):
        assert "batch 1 op 1" in str(caught.value)
    assert torch.equal(pool, original)


@pytest.mark.parametrize(
    ("moves", "reason"),
    [
        ([_move(0, 0, 2, 0, 8)], "null_block"),
        ([_move(1, 0, 0, 0, 8)], "null_block"),
        ([_move(1, 0, NUM_BLOCKS, 0, 8)], "unknown_block"),
        ([_move(1, BLOCK - 7, 2, 0, 8)], "out_of_bounds"),
        ([_move(1, 0, 2, BLOCK, 1)], "out_of_bounds"),
        ([_move(1, 0, 2, 0, -1)], "out_of_bounds"),
        ([_move(0, 0, 0, 0, 8)], "null_block"),  # an exact self-copy does not hide a bad block
        ([_move(1, 0, 2, 0, 8), _move(3, 0, 2, 4, 8)], "overlapping_destinations"),
        ([_move(1, 0, 2, 0, 8), _move(2, 0, 1, 0, 8), _move(3, 0, 3, 2, 8), _move(4, 0, 3, 9, 4)], "overlapping_destinations"),
        ([_move(1, 0, SCRATCH_BLOCK, 0, 8)], "unknown_block"),  # -1 would read as scratch once packed
        ([_move(1, 0, 2, 0, 8), (BlockRef(POOL_ID + 1, 3, 1), 0, _ref(4), 0, 8)], "mixed_pools"),
    ],
)
def test_bad_moves_raise_and_change_nothing(moves: list[Move], reason: str) -> None:
    pool = _pool()
    original = pool.clone()
    with pytest.raises(CopyError) as caught:
        apply_moves(pool, moves)
    assert caught.value.reason == reason
    assert torch.equal(pool, original)


def test_bad_pools_and_scratch_are_refused() -> None:
    ok = _plan([_good_op()])
    for pool in (
        torch.zeros(NUM_BLOCKS, BLOCK, dtype=torch.int16),
        torch.zeros(NUM_BLOCKS * BLOCK, dtype=torch.uint8),
        torch.zeros(BLOCK, NUM_BLOCKS, dtype=torch.uint8).t(),
    ):
        with pytest.raises(CopyError) as caught:
            execute_plan(pool, ok, 0)
        assert caught.value.reason == "bad_pool"
    with pytest.raises(CopyError) as caught:
        execute_plan(_pool(), ok, -1)
    assert caught.value.reason == "bad_scratch"


def test_a_plan_for_another_pool_is_refused() -> None:
    pool = _pool()
    original = pool.clone()
    validate_plan(pool, _plan([_good_op()]), 0, pool_id=POOL_ID)
    with pytest.raises(CopyError) as caught:
        execute_plan(pool, _plan([_good_op()]), 0, pool_id=POOL_ID + 1)
    assert caught.value.reason == "wrong_pool"
    assert torch.equal(pool, original)


def test_a_batch_whose_columns_were_made_ragged_is_refused() -> None:
    """A CopyBatch refuses columns of unequal length when made or decoded
    (tests/events/test_copy_batch.py); a column changed afterwards (the lists are lists) is
    refused by the executor before anything is written."""
    columns = ([1], [1], [0], [2], [1], [0], [8], [False])
    pool = _pool()
    original = pool.clone()
    batch = CopyBatch(POOL_ID, *columns)
    batch.dst_offset.append(16)
    with pytest.raises(CopyError) as caught:
        execute_plan(pool, [*_plan([_good_op()]), batch], 0)
    assert caught.value.reason == "ragged_batch" and caught.value.batch == 1
    assert "dst_offset 2" in str(caught.value)
    assert torch.equal(pool, original)


@pytest.mark.parametrize(
    ("column", "value", "reason"),
    [
        (0, 1 << 70, "unknown_block"),
        (3, -(1 << 70), "unknown_block"),
        (2, 1 << 63, "out_of_bounds"),
        (5, -(1 << 64), "out_of_bounds"),
        (6, 1 << 80, "out_of_bounds"),
    ],
)
def test_a_column_value_outside_int64_is_refused_and_named(column: int, value: int, reason: str) -> None:
    """The columns are read into int64 arrays; an int that does not fit (a hand-made or hostile
    plan: a CopyBatch made in Python checks no range) is refused with the op it is in, as any
    other bad region, before anything is written."""
    columns: list[list[int | bool]] = [[1, 3], [1, 1], [0, 0], [2, 4], [1, 1], [0, 0], [8, 8], [False, False]]
    columns[column][1] = value
    pool = _pool()
    original = pool.clone()
    with pytest.raises(CopyError) as caught:
        execute_plan(pool, [CopyBatch(POOL_ID, *columns)], 0)  # type: ignore[arg-type]
    assert caught.value.reason == reason and caught.value.batch == 0 and caught.value.op == 1
    assert torch.equal(pool, original)


def test_copy_error_is_a_value_error() -> None:
    assert issubclass(CopyError, ValueError)


# --- CUDA --------------------------------------------------------------------------------------


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: runs a shift and a swap on a cuda pool")
def test_I15_shift_and_swap_on_a_cuda_pool() -> None:
    pool = _pool(device="cuda")
    original = pool.clone()
    moves = [_move(1, 8, 1, 0, 48), _move(2, 1, 2, 0, 63), _move(3, 0, 4, 0, BLOCK), _move(4, 0, 3, 0, BLOCK)]
    expected = _expected(original, moves)
    apply_moves(pool, moves)
    torch.cuda.synchronize()
    assert pool.device.type == "cuda"
    assert torch.equal(pool.cpu(), expected.cpu())
