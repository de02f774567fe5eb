"""Ordering a batch of state copies (I15; seed 000, the Mamba state-copy fix).

A batch of moves means *parallel assignment*: every move reads the content as it was before the
batch. Executed naively in parallel, a chain (A->B, B->C) or a shift inside one block can read a
region an earlier copy already overwrote. The plan:

* a move whose own source and destination overlap is flagged `ordered` (memmove semantics);
* move i must run before move j when i reads what j writes: chains run in dependency order;
* a cycle (a swap, a rotation) is broken by saving one move's source to scratch first;
* moves without such a dependency share a batch, so disjoint copies stay parallel;
* an exact self-copy changes nothing and is left out.

Overlapping destinations have no parallel-assignment meaning and are refused upstream.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence

import msgspec

from events import BlockRef, CopyOp, Region


class PlannedMove(msgspec.Struct, frozen=True):
    """A validated move: src and dst regions of one pool."""

    src: Region
    dst: Region


def _overlap(a: Region, b: Region) -> bool:
    if a.block is None or b.block is None or a.block.block_id != b.block.block_id:
        return False
    return a.offset < b.offset + b.length and b.offset < a.offset + a.length


def overlapping_destinations(moves: Sequence[PlannedMove]) -> tuple[int, int] | None:
    """A pair of moves (lower index first) whose destinations overlap, if any. Sorting each
    block's destinations by offset finds one in O(n log n): with positive lengths, a set of
    intervals overlaps somewhere exactly when two neighbours in that order do."""
    by_block: dict[int, list[tuple[int, int, int]]] = {}
    for index, move in enumerate(moves):
        dst = move.dst
        if dst.block is not None:
            by_block.setdefault(dst.block.block_id, []).append((dst.offset, dst.offset + dst.length, index))
    clashes = []
    for intervals in by_block.values():
        intervals.sort()
        for (_, end, first), (start, _, second) in zip(intervals, intervals[1:]):
            if start < end:
                clashes.append((min(first, second), max(first, second)))
    return min(clashes) if clashes else None


def _reader_edges(moves: Sequence[PlannedMove], active: list[int]) -> dict[int, set[int]]:
    """successors[i] = the moves j whose destination overlaps move i's source (i must run
    first). Destinations do not overlap one another (refused upstream), so each block's are
    disjoint and sorted by offset: a binary search finds the ones a source touches."""
    by_block: dict[int, list[tuple[int, int, int]]] = {}
    for j in active:
        dst = moves[j].dst
        if dst.block is not None:
            by_block.setdefault(dst.block.block_id, []).append((dst.offset, dst.offset + dst.length, j))
    ends: dict[int, list[int]] = {}
    for block_id, intervals in by_block.items():
        intervals.sort()
        ends[block_id] = [end for _, end, _ in intervals]
    successors: dict[int, set[int]] = {i: set() for i in active}
    for i in active:
        src = moves[i].src
        if src.block is None or src.block.block_id not in by_block:
            continue
        intervals = by_block[src.block.block_id]
        position = bisect.bisect_right(ends[src.block.block_id], src.offset)
        while position < len(intervals) and intervals[position][0] < src.offset + src.length:
            j = intervals[position][2]
            if j != i:
                successors[i].add(j)
            position += 1
    return successors


def plan_copies(moves: Sequence[PlannedMove]) -> tuple[list[list[CopyOp]], int]:
    """Order `moves` into batches; returns (batches, scratch bytes needed).

    Batch k holds every move whose readers-first constraints are met by batches before it
    (Kahn's algorithm by levels), so the plan is as parallel as the dependencies allow."""
    active = [i for i, move in enumerate(moves) if move.src != move.dst]
    # An edge i -> j: move i reads what move j writes, so i must run first.
    successors = _reader_edges(moves, active)
    predecessors: dict[int, set[int]] = {i: set() for i in active}
    for i, targets in successors.items():
        for j in targets:
            predecessors[j].add(i)

    source: dict[int, Region] = {i: moves[i].src for i in active}
    saves: list[CopyOp] = []
    scratch = 0
    batches: list[list[CopyOp]] = []
    remaining = dict.fromkeys(active)
    ready = [i for i in active if not predecessors[i]]

    def drop_out_edges(i: int) -> list[int]:
        """Remove i's out-edges; the moves this frees."""
        freed = []
        for j in successors[i]:
            predecessors[j].discard(i)
            if not predecessors[j]:
                freed.append(j)
        successors[i] = set()
        return freed

    while remaining:
        if not ready:
            # Every remaining move waits on another, so walking back along edges must close a
            # cycle. Save the source of the cycle's lowest-numbered move to scratch before
            # anything runs; it then reads the copy and its edges go. Each pass removes edges,
            # so this ends.
            seen: dict[int, int] = {}
            node = next(iter(remaining))
            while node not in seen:
                seen[node] = len(seen)
                node = min(predecessors[node])
            cycle = [n for n, order in seen.items() if order >= seen[node]]
            victim = min(cycle)
            saved = Region(None, scratch, moves[victim].src.length)
            saves.append(CopyOp(moves[victim].src, saved, False))
            source[victim] = saved
            scratch += saved.length
            ready = sorted(drop_out_edges(victim))
            continue
        ready.sort()
        batches.append([CopyOp(source[i], moves[i].dst, _overlap(source[i], moves[i].dst)) for i in ready])
        freed: list[int] = []
        for i in ready:
            del remaining[i]
            freed += drop_out_edges(i)
        ready = freed
    if saves:
        batches.insert(0, saves)
    return batches, scratch


def run_plan_on_bytes(
    blocks: dict[int, bytearray], batches: list[list[CopyOp]], scratch_bytes: int, *, reverse: bool = False
) -> None:
    """Reference executor over bytearrays, for tests and the demo: runs each batch's copies
    in list order (or reversed, to show order inside a batch does not matter)."""
    scratch = bytearray(scratch_bytes)

    def buffer(region: Region) -> bytearray:
        return scratch if region.block is None else blocks[region.block.block_id]

    for batch in batches:
        for op in reversed(batch) if reverse else batch:
            data = bytes(buffer(op.src)[op.src.offset : op.src.offset + op.src.length])
            buffer(op.dst)[op.dst.offset : op.dst.offset + op.dst.length] = data


def parallel_assignment_on_bytes(blocks: dict[int, bytearray], moves: Sequence[tuple[BlockRef, int, BlockRef, int, int]]) -> None:
    """What the batch means: every move reads the untouched original (the test oracle)."""
    original = {block_id: bytes(data) for block_id, data in blocks.items()}
    for src, src_offset, dst, dst_offset, length in moves:
        data = original[src.block_id][src_offset : src_offset + length]
        blocks[dst.block_id][dst_offset : dst_offset + length] = data
