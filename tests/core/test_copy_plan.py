"""The state-copy planner (I15) against a parallel-assignment oracle on real bytes."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from coordinator.core.copy_plan import (
    PlannedMove,
    overlapping_destinations,
    parallel_assignment_on_bytes,
    plan_copies,
    run_plan_on_bytes,
)
from events import BlockRef, Region

SIZE = 32


def _blocks(n: int) -> dict[int, bytearray]:
    return {i: bytearray(((i * 37 + j * 11) % 251) + 1 for j in range(SIZE)) for i in range(1, n + 1)}


def _move(src: int, src_off: int, dst: int, dst_off: int, length: int) -> PlannedMove:
    return PlannedMove(Region(BlockRef(0, src, 1), src_off, length), Region(BlockRef(0, dst, 1), dst_off, length))


def _tuples(moves: list[PlannedMove]) -> list[tuple[BlockRef, int, BlockRef, int, int]]:
    return [(m.src.block, m.src.offset, m.dst.block, m.dst.offset, m.src.length) for m in moves]  # type: ignore[misc]


def _check(moves: list[PlannedMove], n: int = 4) -> list[list]:  # type: ignore[type-arg]
    expected = _blocks(n)
    parallel_assignment_on_bytes(expected, _tuples(moves))
    batches, scratch = plan_copies(moves)
    for reverse in (False, True):
        got = _blocks(n)
        run_plan_on_bytes(got, batches, scratch, reverse=reverse)
        assert got == expected
    return batches


def _naive(moves: list[PlannedMove], n: int = 4) -> dict[int, bytearray]:
    blocks = _blocks(n)
    for m in moves:
        data = bytes(blocks[m.src.block.block_id][m.src.offset : m.src.offset + m.src.length])  # type: ignore[union-attr]
        blocks[m.dst.block.block_id][m.dst.offset : m.dst.offset + m.dst.length] = data  # type: ignore[union-attr]
    return blocks


def test_I15_chain_runs_in_dependency_order() -> None:
    moves = [_move(1, 0, 2, 0, SIZE), _move(2, 0, 3, 0, SIZE)]  # A->B, B->C
    batches = _check(moves)
    assert [len(b) for b in batches] == [1, 1]
    assert batches[0][0].dst.block.block_id == 3  # B->C first # type: ignore[union-attr]
    expected = _blocks(4)
    parallel_assignment_on_bytes(expected, _tuples(moves))
    assert _naive(moves) != expected  # the unplanned order reads an overwritten block


def test_I15_cycle_goes_through_scratch() -> None:
    moves = [_move(1, 0, 2, 0, SIZE), _move(2, 0, 1, 0, SIZE)]  # swap
    batches = _check(moves)
    assert any(op.dst.block is None for op in batches[0])  # saved to scratch first


def test_I15_overlapping_shift_inside_a_block_is_ordered() -> None:
    for src_off, dst_off in ((4, 0), (0, 4)):  # left shift, right shift
        batches = _check([_move(1, src_off, 1, dst_off, 24)])
        assert batches[0][0].ordered is True


def test_I15_disjoint_copies_stay_in_one_batch_and_exact_self_copies_vanish() -> None:
    moves = [_move(1, 0, 2, 0, 8), _move(3, 0, 4, 0, 8), _move(1, 8, 2, 8, 8), _move(3, 0, 3, 0, 8)]
    batches = _check(moves)
    assert len(batches) == 1 and len(batches[0]) == 3
    assert not any(op.ordered for op in batches[0])


def test_overlapping_destinations_are_found() -> None:
    assert overlapping_destinations([_move(1, 0, 2, 0, 8), _move(3, 0, 2, 4, 8)]) == (0, 1)
    assert overlapping_destinations([_move(1, 0, 2, 0, 8), _move(3, 0, 2, 8, 8)]) is None


@st.composite
def _move_sets(draw: st.DrawFn) -> list[PlannedMove]:
    moves: list[PlannedMove] = []
    for _ in range(draw(st.integers(1, 8))):
        length = draw(st.integers(1, 16))
        move = _move(
            draw(st.integers(1, 4)),
            draw(st.integers(0, SIZE - length)),
            draw(st.integers(1, 4)),
            draw(st.integers(0, SIZE - length)),
            length,
        )
        if overlapping_destinations([*moves, move]) is None:
            moves.append(move)
    return moves


@settings(max_examples=300, deadline=None)
@given(_move_sets())
def test_I15_any_batch_equals_parallel_assignment(moves: list[PlannedMove]) -> None:
    batches = _check(moves)
    # Inside a batch no copy reads what another copy of the same batch writes.
    for batch in batches:
        for reader in batch:
            for writer in batch:
                if reader is not writer and reader.src.block is not None and writer.dst.block is not None:
                    same = reader.src.block.block_id == writer.dst.block.block_id
                    assert not (
                        same
                        and reader.src.offset < writer.dst.offset + writer.dst.length
                        and writer.dst.offset < reader.src.offset + reader.src.length
                    )


def test_I15_a_move_downstream_of_a_cycle_does_not_loop() -> None:
    """Regression: move 0 only waits on the cycle (1 <-> 2); breaking move 0 itself frees
    nothing. The planner must break a move on the cycle, and finish."""
    moves = [_move(4, 0, 2, 8, 8), _move(2, 0, 3, 0, 16), _move(3, 0, 2, 0, 8)]
    batches = _check(moves, n=4)
    saves = [op for op in batches[0] if op.dst.block is None]
    assert len(saves) == 1 and saves[0].src.block.block_id in (2, 3)
