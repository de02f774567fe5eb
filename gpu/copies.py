"""Ordered state copies on a device pool (I15): run a `plan_copies` plan on a real tensor.

A batch of moves means *parallel assignment*: every move reads the content as it was before the
batch. coordinator.core.copy_plan.plan_copies turns such a batch into ordered batches of CopyOps
(chains in dependency order, cycles broken by a first batch that saves sources to scratch); the
decider packs each batch into a CopyBatch, its ops in columns; this module executes such a plan
(a sequence of CopyBatches) on a pool.

A pool is a contiguous 2-D torch.uint8 tensor [num_blocks, bytes_per_block]; block 0 is the
null block and is never read or written. A Region names bytes [offset, offset + length) of one
block, or of the scratch buffer when its block is None (in a CopyBatch, block SCRATCH_BLOCK).
Scratch is a separate uint8 tensor of `scratch_bytes` on the pool's device, alive for one
`execute_plan` call.

Execution:

* The whole plan is validated before any byte is written (columns of equal length, block ids,
  null block, bounds, one pool id, no two destinations of one batch overlapping), so a bad plan
  raises CopyError and leaves the pool untouched.
* Batches run in order. Each batch is one gather and then one scatter: the byte ranges of
  all its sources and destinations are expanded into index arrays (no per-byte Python loop),
  every source is gathered into a fresh buffer, and only then is the buffer scattered to the
  destinations.
* Gather-then-scatter is memmove-safe: nothing is written until every source byte of the batch
  has been read, so an op whose own src and dst overlap inside one block (a shift; CopyOp.ordered)
  gets memmove semantics, and the batch as a whole has parallel-assignment semantics even if
  its copies were not independent. The order between batches is what the planner relies on
  (a batch may read what an earlier batch wrote, e.g. scratch).
* A batch that is *disjoint* (no op reads a byte that any op of the batch writes: what the
  planner makes of moves without a dependency) has nothing to protect, so on the CPU it is
  copied a cache-sized chunk at a time (_CHUNK_BYTES): each chunk's staged rows are still in
  cache when they are written out, and a large one (_PARALLEL_BYTES) is split between torch's
  CPU threads, one contiguous range of rows each. Validation tells the two kinds apart; a
  hand-made plan with a chain inside one batch still gets the whole gather first, on one thread.
* Indices address rows, not necessarily bytes: an op's row size ("unit") is the gcd of
  bytes_per_block and its offsets and length, so whole-block moves take one index per block
  and a one-byte shift one per byte; rows are read as int64/int32/int16 when the unit and the
  pool's alignment allow. Ops of one batch with different units form up to _MAX_GROUPS groups
  (usually one), each gathered on its own; all groups are gathered before any is scattered, so
  the batch is still read whole before it is written. That is the same copy, with fewer and
  wider indices, and a few odd shifts do not shrink every index of the batch.

The plan's metadata is read once into numpy arrays on the host (the plan is host data): the
columns packed with struct and read with np.frombuffer (2.6x faster than np.array on a list), and
validated there, vectorised, with reductions (min/max) for the bounds of pool regions. When every op
of a batch is one row of one size (whole blocks, half blocks: what the decider makes), the
overlap checks compare row numbers and the row is the index unit, with no gcd. Checking 1,024 ops
takes about 0.12 ms (0.15-0.2 before these fast paths, 0.45 ms when it walked CopyOps' nested
objects; ops/bench/copies.py, issue 22). On the CPU the copies themselves are numpy fancy indexing
on a view of the pool's memory: one memcpy a row, where torch's CPU index_select/index_copy_ go
element by element and ran 3-9x slower (ops/bench/copies.py). On CUDA they are torch
index_select and index_copy_, and only per-op starts and counts go to the device, where they are
expanded; this module picks no stream: everything is enqueued on the caller's current stream (the
worker runs these on its transfer stream) and nothing here synchronises beyond the host-to-device
copy of the index metadata.
"""

from __future__ import annotations

import math
import struct
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import cast

import numpy as np
import torch

from coordinator.core.copy_plan import PlannedMove, overlapping_destinations, plan_copies
from events import SCRATCH_BLOCK, BlockRef, CopyBatch, CopyOp, Region

__all__ = ["CopyError", "apply_moves", "execute_plan", "validate_plan"]

_MAX_GROUPS = 4
_WIDE = ((8, torch.int64), (4, torch.int32), (2, torch.int16))


class CopyError(ValueError):
    """A plan this pool cannot run. `reason` is a stable string: bad_pool, bad_scratch,
    null_block, unknown_block, out_of_bounds, mixed_pools, wrong_pool, overlapping_destinations,
    ragged_batch (a CopyBatch whose columns were changed to unequal lengths after it was made).
    `batch` and `op` locate the offending op when there is one. A copy's two sizes can no longer
    differ (size_mismatch): a CopyBatch has one length column, and CopyBatch.from_ops refuses
    CopyOps whose sizes differ."""

    def __init__(self, reason: str, message: str, *, batch: int | None = None, op: int | None = None) -> None:
        super().__init__(message)
        self.reason = reason
        self.batch = batch
        self.op = op


class _Batch:
    """One batch's host-side metadata as int64 numpy arrays (one entry an op), in a unified
    address space: pool bytes are [0, num_blocks * bytes_per_block), scratch byte k is
    `pool_bytes + k`. The scratch masks are None when the batch does not touch scratch.
    `disjoint`: no op reads a byte that any op of the batch writes (its own destination
    included), so the ops may run one after another, in any order, with no staging copy.
    `row`: when every op is one row of the same size (that size divides the block size and every
    address), that size, the batch's one index unit; else 0."""

    __slots__ = ("src", "dst", "length", "src_scratch", "dst_scratch", "disjoint", "row")

    def __init__(
        self,
        src: np.ndarray,
        dst: np.ndarray,
        length: np.ndarray,
        src_scratch: np.ndarray | None,
        dst_scratch: np.ndarray | None,
        disjoint: bool,
        row: int,
    ) -> None:
        self.src = src
        self.dst = dst
        self.length = length
        self.src_scratch = src_scratch
        self.dst_scratch = dst_scratch
        self.disjoint = disjoint
        self.row = row


def _ints(*columns: list[int]) -> np.ndarray:
    """Columns of Python ints, end to end, as one int64 array. OverflowError for a value outside
    int64. Packed with struct and read back with np.frombuffer: 2.6x faster than np.array on a
    list (6.4 against 16.8 us for 1,024 ints), which matters when a 1,024-op batch has five. Each
    column packed on its own, then joined: unpacking a chain of them into one call took twice as
    long (14.9 against 7.8 us for two columns of 1,024)."""
    try:
        packed = b"".join([struct.pack(f"{len(column)}q", *column) for column in columns])
    except struct.error as error:  # a value outside int64 (or not an int: the codec refuses those first)
        raise OverflowError(str(error)) from None
    return np.frombuffer(packed, dtype=np.int64)


def _check_pool(pool: torch.Tensor) -> None:
    if pool.dtype != torch.uint8 or pool.dim() != 2:
        raise CopyError("bad_pool", f"a pool is a 2-D torch.uint8 tensor, not {pool.dim()}-D {pool.dtype}")
    if not pool.is_contiguous():
        raise CopyError("bad_pool", "the pool must be contiguous (copies work on pool.view(-1))")
    if pool.shape[0] < 2 or pool.shape[1] < 1:
        raise CopyError("bad_pool", f"pool of shape {tuple(pool.shape)} has no usable block")


def _region_problem(region: Region, num_blocks: int, bytes_per_block: int, scratch_bytes: int) -> tuple[str, str] | None:
    """(reason, description) of what is wrong with one region, or None."""
    block = region.block
    if block is None:
        where, limit = "scratch", scratch_bytes
    else:
        where, limit = f"block {block.block_id}", bytes_per_block
        if block.block_id == 0:
            return "null_block", "block 0 (the null block)"
        if not 0 < block.block_id < num_blocks:
            return "unknown_block", f"block {block.block_id}, not in a pool of {num_blocks} blocks"
    if region.length <= 0 or region.offset < 0 or region.offset + region.length > limit:
        return (
            "out_of_bounds",
            f"{where} bytes [{region.offset}, {region.offset + region.length}) outside [0, {limit})",
        )
    return None


def _describe(op: CopyOp) -> str:
    def name(region: Region) -> str:
        return "scratch" if region.block is None else f"block {region.block.block_id}"

    return f"{name(op.src)}[{op.src.offset}:+{op.src.length}] -> {name(op.dst)}[{op.dst.offset}:+{op.dst.length}]"


def _first_problem(batch_index: int, batch: CopyBatch, num_blocks: int, bytes_per_block: int, scratch_bytes: int) -> CopyError:
    """The error for the first bad op of a batch the vectorised check rejected."""
    for index, op in enumerate(batch.ops()):
        for side, region in (("src", op.src), ("dst", op.dst)):
            problem = _region_problem(region, num_blocks, bytes_per_block, scratch_bytes)
            if problem is not None:
                reason, what = problem
                return CopyError(
                    reason,
                    f"batch {batch_index} op {index} ({_describe(op)}): {side} {what}",
                    batch=batch_index,
                    op=index,
                )
    raise AssertionError("the vectorised check and the per-op check disagree")  # pragma: no cover


def _extract(
    batch_index: int,
    batch: CopyBatch,
    num_blocks: int,
    bytes_per_block: int,
    scratch_bytes: int,
    pool_ids: set[int],
    check_overlap: bool = True,
) -> _Batch:
    """Check one batch and turn it into unified byte addresses. The batch's columns are read
    straight into numpy (src and dst side by side: entry k and n + k are op k's two regions);
    every check after that is vectorised over the batch. The per-op walk (_first_problem) only
    runs to name the culprit once a check failed."""
    n = len(batch.length)
    sizes = {len(batch.src_block), len(batch.dst_block), len(batch.src_offset), len(batch.dst_offset), n}
    if len(sizes) > 1:
        # A CopyBatch refuses ragged columns when it is made; this is one changed since.
        raise CopyError(
            "ragged_batch",
            f"batch {batch_index}: its columns differ in length (src_block {len(batch.src_block)}, dst_block "
            f"{len(batch.dst_block)}, src_offset {len(batch.src_offset)}, dst_offset {len(batch.dst_offset)}, length {n})",
            batch=batch_index,
        )
    try:
        ids = _ints(batch.src_block, batch.dst_block)
        offsets = _ints(batch.src_offset, batch.dst_offset)
        length = _ints(batch.length)
    except OverflowError:
        raise _first_problem(batch_index, batch, num_blocks, bytes_per_block, scratch_bytes) from None
    lengths = np.concatenate((length, length))
    is_scratch = ids == SCRATCH_BLOCK
    scratch = is_scratch if is_scratch.any() else None
    if scratch is None:
        # Pool regions only: every bound is one reduction. Offsets and lengths are each checked
        # against the block size first, so their sum cannot wrap.
        good = (
            int(ids.min()) > 0
            and int(ids.max()) < num_blocks
            and int(length.min()) > 0
            and int(offsets.min()) >= 0
            and int(length.max()) <= bytes_per_block
            and int(offsets.max()) <= bytes_per_block
            and int((offsets + lengths).max()) <= bytes_per_block
        )
        if not good:
            raise _first_problem(batch_index, batch, num_blocks, bytes_per_block, scratch_bytes)
        address = ids * bytes_per_block + offsets
    else:
        limit = np.where(scratch, scratch_bytes, bytes_per_block)
        in_range = scratch | ((ids > 0) & (ids < num_blocks))
        # offsets and lengths are each checked against the limit first, so their sum cannot wrap.
        bad = ~in_range | (lengths <= 0) | (offsets < 0) | (offsets > limit) | (lengths > limit)
        if bad.any() or (offsets + lengths > limit).any():
            raise _first_problem(batch_index, batch, num_blocks, bytes_per_block, scratch_bytes)
        address = np.where(scratch, num_blocks * bytes_per_block + offsets, ids * bytes_per_block + offsets)
    pool_ids.add(batch.pool_id)
    if len(pool_ids) > 1:
        raise CopyError(
            "mixed_pools",
            f"batch {batch_index}: the plan names pools {sorted(pool_ids)}; one tensor is one pool",
            batch=batch_index,
        )
    src, dst, length = address[:n], address[n:], lengths[:n]
    src_scratch = None if scratch is None else scratch[:n]
    dst_scratch = None if scratch is None else scratch[n:]
    # One row an op: every op moves the same number of bytes, which divides the block size and
    # every address (a scratch address is pool_bytes + offset: the same test). Then an op's row
    # unit is its length, and addresses compare as row numbers.
    size = int(length[0])
    row = size if bytes_per_block % size == 0 and int(length.max()) == int(length.min()) and not (address % size).any() else 0
    if not check_overlap:
        return _Batch(src, dst, length, src_scratch, dst_scratch, False, row)
    if row:
        disjoint = _check_rows(batch_index, batch, src // row, dst // row)
    else:
        disjoint = _check_ranges(batch_index, batch, src, dst, length)
    return _Batch(src, dst, length, src_scratch, dst_scratch, disjoint, row)


def _overlap_error(batch_index: int, batch: CopyBatch, a: int, b: int) -> CopyError:
    return CopyError(
        "overlapping_destinations",
        f"batch {batch_index} ops {a} ({_describe(batch.op(a))}) and {b} ({_describe(batch.op(b))}) write the same bytes",
        batch=batch_index,
        op=b,
    )


def _check_rows(batch_index: int, batch: CopyBatch, src: np.ndarray, dst: np.ndarray) -> bool:
    """The overlap checks of a batch of one-row ops, as row numbers: no destination row twice
    (CopyError), and whether the batch is disjoint (no source row is a destination row)."""
    ordered = np.sort(dst)
    same = np.flatnonzero(ordered[1:] == ordered[:-1])
    if same.size:
        a, b = np.flatnonzero(dst == ordered[same[0]])[:2].tolist()
        raise _overlap_error(batch_index, batch, a, b)
    at = np.minimum(np.searchsorted(ordered, src), ordered.size - 1)
    return not (ordered[at] == src).any()


def _check_ranges(batch_index: int, batch: CopyBatch, src: np.ndarray, dst: np.ndarray, length: np.ndarray) -> bool:
    """The overlap checks of any batch, as byte ranges: no two destinations overlapping
    (CopyError), and whether the batch is disjoint (no source touches any destination)."""
    n = length.size
    order = np.argsort(dst, kind="stable")
    starts = dst[order]
    stops = starts + length[order]
    clash = np.flatnonzero(starts[1:] < stops[:-1])
    if clash.size:
        k = int(clash[0])
        a, b = sorted((int(order[k]), int(order[k + 1])))
        raise _overlap_error(batch_index, batch, a, b)
    # The destinations are disjoint and sorted, so a source can only meet the last one starting
    # at or before it or the first one after it.
    after = np.searchsorted(starts, src, side="right")
    hits_before = (after > 0) & (stops[np.maximum(after - 1, 0)] > src)
    hits_after = (after < n) & (starts[np.minimum(after, n - 1)] < src + length)
    return not (hits_before | hits_after).any()


def _validate(
    pool: torch.Tensor,
    batches: Sequence[CopyBatch],
    scratch_bytes: int,
    *,
    pool_id: int | None = None,
    check_overlap: bool = True,
) -> list[_Batch]:
    _check_pool(pool)
    if scratch_bytes < 0:
        raise CopyError("bad_scratch", f"scratch_bytes is {scratch_bytes}")
    num_blocks, bytes_per_block = pool.shape
    pool_ids: set[int] = set()
    checked = [
        _extract(index, batch, num_blocks, bytes_per_block, scratch_bytes, pool_ids, check_overlap)
        for index, batch in enumerate(batches)
        if batch
    ]
    if pool_id is not None and pool_ids - {pool_id}:
        raise CopyError("wrong_pool", f"the plan names pool {min(pool_ids - {pool_id})}; this tensor is pool {pool_id}")
    return checked


def validate_plan(pool: torch.Tensor, batches: Sequence[CopyBatch], scratch_bytes: int, *, pool_id: int | None = None) -> None:
    """Raise CopyError if `pool` cannot run the plan; checks everything, writes nothing.
    With `pool_id`, every block the plan names must belong to that pool."""
    _validate(pool, batches, scratch_bytes, pool_id=pool_id)


def _width(unit: int, flat: torch.Tensor) -> tuple[int, torch.dtype]:
    """The widest element (bytes, dtype) that divides a row of `unit` bytes and that `flat`
    (uint8) is aligned to; scratch, freshly allocated, is aligned to all of them."""
    for width, dtype in _WIDE:
        if unit % width == 0 and flat.storage_offset() % width == 0 and flat.data_ptr() % width == 0:
            return width, dtype
    return 1, torch.uint8


_Array = np.ndarray | torch.Tensor
"""Row indices or gathered rows: a numpy array on the CPU, a torch tensor on other devices."""


class _Rows:
    """A buffer (pool or scratch, uint8) seen as rows of `unit` bytes, each row `unit // width`
    elements, with the two operations a batch needs. On the CPU the rows are a numpy view of the
    tensor's memory and indices are numpy arrays: numpy's fancy indexing copies a row with one
    memcpy, where torch's CPU index_select/index_copy_ go element by element (3-9x slower on
    16 KiB rows, ops/bench/copies.py). On other devices they are torch index_select/index_copy_
    with indices on the device."""

    __slots__ = ("tensor", "host")

    def __init__(self, flat: torch.Tensor, unit: int, width: int, dtype: torch.dtype) -> None:
        usable = flat[: flat.numel() // unit * unit]
        if width > 1:
            usable = usable.view(dtype)
        self.tensor = usable.view(-1, unit // width)
        self.host = self.tensor.numpy() if flat.device.type == "cpu" else None

    def index(self, starts: np.ndarray, counts: np.ndarray) -> _Array:
        """The row indices [starts[0], .., starts[0] + counts[0] - 1, starts[1], ..] of a set of
        ranges, from per-range host arrays: built on the host for the CPU; otherwise only the
        per-range starts and counts go to the device, where they are expanded."""
        if self.host is not None:
            return _expand_host(starts, counts)
        return _expand_device(starts, counts, self.tensor.device)

    def select(self, index: _Array) -> _Array:
        """The rows at `index`, as a new buffer (a copy: read before anything is written)."""
        if self.host is not None:
            return cast(np.ndarray, self.host[index])
        return self.tensor.index_select(0, cast(torch.Tensor, index))

    def put(self, index: _Array, values: _Array) -> None:
        """rows[index] = values (the indices are distinct: destinations never overlap)."""
        if self.host is not None:
            self.host[index] = values
        else:
            self.tensor.index_copy_(0, cast(torch.Tensor, index), cast(torch.Tensor, values))


def _expand_host(starts: np.ndarray, counts: np.ndarray) -> np.ndarray:
    first = int(counts[0])
    if starts.size == 1:
        return np.arange(int(starts[0]), int(starts[0]) + first)
    if (counts == first).all():
        return starts if first == 1 else (starts[:, None] + np.arange(first)).reshape(-1)
    # Per range: its start minus the position where its rows begin in the output; + arange.
    total = int(counts.sum())
    shift = starts - (np.cumsum(counts) - counts)
    return np.repeat(shift, counts) + np.arange(total)


def _expand_device(starts: np.ndarray, counts: np.ndarray, device: torch.device) -> torch.Tensor:
    first = int(counts[0])
    if starts.size == 1:
        return torch.arange(int(starts[0]), int(starts[0]) + first, device=device)
    base = torch.from_numpy(np.ascontiguousarray(starts)).to(device)
    if (counts == first).all():
        return base if first == 1 else (base[:, None] + torch.arange(first, device=device)).reshape(-1)
    total = int(counts.sum())
    shift = torch.from_numpy(starts - (np.cumsum(counts) - counts)).to(device)
    repeated = torch.repeat_interleave(shift, torch.from_numpy(np.ascontiguousarray(counts)).to(device), output_size=total)
    return repeated + torch.arange(total, device=device)


def _groups(batch: _Batch, bytes_per_block: int) -> list[tuple[int, np.ndarray | None]]:
    """The batch's ops by index unit: (row bytes, op indices, None for all). An op's unit is
    the gcd of bytes_per_block, its addresses and its length (a scratch address is pool_bytes
    + offset and bytes_per_block divides pool_bytes, so that is its offset's gcd too). Usually
    one group; a few odd shifts get their own small group instead of shrinking every index of
    the batch. At most _MAX_GROUPS: beyond that the groups moving the fewest bytes share a unit."""
    if batch.row:
        return [(batch.row, None)]  # one row an op: the row is the unit
    n = batch.length.size
    units = np.gcd(np.gcd(np.gcd(batch.src, batch.dst), batch.length), bytes_per_block)
    low, high = int(units.min()), int(units.max())
    if low == high or int(batch.length.sum()) // low <= 4 * n:
        return [(low, None)]  # one unit, or a few rows an op at the smallest: one group
    values, inverse = np.unique(units, return_inverse=True)
    moved = np.zeros(values.size, dtype=np.int64)
    np.add.at(moved, inverse, batch.length)
    ranked = np.argsort(-moved, kind="stable").tolist()
    kept, rest = ranked[: _MAX_GROUPS - 1], ranked[_MAX_GROUPS - 1 :]
    if len(rest) == 1:
        kept, rest = ranked, []
    groups: list[tuple[int, np.ndarray | None]] = [(int(values[g]), np.flatnonzero(inverse == g)) for g in kept]
    if rest:
        unit = math.gcd(*(int(values[g]) for g in rest))
        groups.append((unit, np.flatnonzero(np.isin(inverse, rest))))
    return groups


class _Gathered:
    """One group's sources, read: `values` holds the rows of ops `order` (op indices), in that
    order, `counts` rows each, read from `pool_rows` and `scratch_rows`."""

    __slots__ = ("unit", "pool_rows", "scratch_rows", "order", "counts", "values")

    def __init__(
        self,
        unit: int,
        pool_rows: _Rows,
        scratch_rows: _Rows | None,
        order: np.ndarray,
        counts: np.ndarray,
        values: _Array,
    ) -> None:
        self.unit = unit
        self.pool_rows = pool_rows
        self.scratch_rows = scratch_rows
        self.order = order
        self.counts = counts
        self.values = values

    def rows(self, scratch: bool) -> _Rows:
        rows = self.scratch_rows if scratch else self.pool_rows
        assert rows is not None  # validated: a scratch region implies scratch_bytes > 0
        return rows


def _concat(parts: list[_Array]) -> _Array:
    if len(parts) == 1:
        return parts[0]
    if isinstance(parts[0], np.ndarray):
        return np.concatenate(cast(list[np.ndarray], parts))
    return torch.cat(cast(list[torch.Tensor], parts))


def _gather(flat: torch.Tensor, scratch: torch.Tensor | None, batch: _Batch, unit: int, members: np.ndarray | None) -> _Gathered:
    """Read the sources of ops `members` (None: all) at row size `unit`: one select per
    buffer (pool sources first, then scratch ones), each a copy."""
    pool_bytes = flat.numel()
    # Pool and scratch rows share one element type: a group may move bytes between them.
    width, dtype = _width(unit, flat)
    pool_rows = _Rows(flat, unit, width, dtype)
    scratch_rows = None if scratch is None else _Rows(scratch, unit, width, dtype)
    if members is None:
        members = np.arange(batch.length.size)
    parts: list[_Array] = []
    orders: list[np.ndarray] = []
    kinds = (False,) if batch.src_scratch is None else (False, True)
    for kind in kinds:
        chosen = members if batch.src_scratch is None else members[batch.src_scratch[members] == kind]
        if not chosen.size:
            continue
        rows = scratch_rows if kind else pool_rows
        assert rows is not None
        starts = (batch.src[chosen] - (pool_bytes if kind else 0)) // unit
        parts.append(rows.select(rows.index(starts, batch.length[chosen] // unit)))
        orders.append(chosen)
    order = orders[0] if len(orders) == 1 else np.concatenate(orders)
    return _Gathered(unit, pool_rows, scratch_rows, order, batch.length[order] // unit, _concat(parts))


def _scatter(batch: _Batch, gathered: _Gathered, pool_bytes: int) -> None:
    """Write one group's gathered rows to its destinations: one put per buffer."""
    unit, order, counts = gathered.unit, gathered.order, gathered.counts
    kinds = (False,) if batch.dst_scratch is None else (False, True)
    for kind in kinds:
        if batch.dst_scratch is None:
            chosen = None
            ops = order
        else:
            chosen = np.flatnonzero(batch.dst_scratch[order] == kind)  # positions in order
            if not chosen.size:
                continue
            ops = order[chosen]
        rows = gathered.rows(kind)
        starts = (batch.dst[ops] - (pool_bytes if kind else 0)) // unit
        part_counts = counts if chosen is None else counts[chosen]
        values = gathered.values
        if chosen is not None and chosen.size != order.size:
            where = np.cumsum(counts) - counts  # each op's first row in values
            values = _take_rows(values, where[chosen], part_counts)
        rows.put(rows.index(starts, part_counts), values)


def _take_rows(values: _Array, starts: np.ndarray, counts: np.ndarray) -> _Array:
    """The rows [starts[k], starts[k] + counts[k]) of gathered `values`, in order."""
    if isinstance(values, np.ndarray):
        return cast(np.ndarray, values[_expand_host(starts, counts)])
    return values.index_select(0, _expand_device(starts, counts, values.device))


_CHUNK_BYTES = 1 << 20
"""A disjoint batch on the CPU is copied this many bytes at a time (rows of whole ops): each
chunk's staging copy is still in cache when it is written out, so the batch costs about one
pass over its bytes rather than two (ops/bench/copies.py: 1-2 MiB was best)."""


_PARALLEL_BYTES = 4 << 20
"""A disjoint CPU batch of at least this many bytes is split between torch's CPU threads (as
torch's own index_select/index_copy_ split theirs): numpy's fancy indexing lets go of the GIL
while it copies. Below it, a thread's hand-over costs more than it saves."""

_helpers: ThreadPoolExecutor | None = None
_helpers_size = 0
_helpers_lock = threading.Lock()


def _helper_pool(threads: int) -> ThreadPoolExecutor:
    """The process's copy helpers (threads - 1 of them; the caller's thread is the other)."""
    global _helpers, _helpers_size
    with _helpers_lock:
        if _helpers is None or _helpers_size != threads - 1:
            if _helpers is not None:
                _helpers.shutdown(wait=False)
            _helpers = ThreadPoolExecutor(threads - 1, thread_name_prefix="kvledger-copy")
            _helpers_size = threads - 1
        return _helpers


def _copy_range(host: np.ndarray, src: np.ndarray, dst: np.ndarray, step: int, start: int, stop: int) -> None:
    for at in range(start, stop, step):
        end = min(at + step, stop)
        host[dst[at:end]] = host[src[at:end]]


def _copy_chunks(host: np.ndarray, src: np.ndarray, dst: np.ndarray, step: int, nbytes: int) -> None:
    """rows[dst] = rows[src] for a disjoint batch, `step` rows at a time; with torch's CPU threads
    > 1 and at least _PARALLEL_BYTES, the rows are split into that many contiguous ranges, one a
    thread (the batch is disjoint: the ranges neither read nor write each other's bytes)."""
    threads = min(torch.get_num_threads(), len(src) // step) if nbytes >= _PARALLEL_BYTES else 1
    if threads <= 1:
        _copy_range(host, src, dst, step, 0, len(src))
        return
    share = -(-len(src) // threads)
    helpers = _helper_pool(threads)
    futures = [
        helpers.submit(_copy_range, host, src, dst, step, start, min(start + share, len(src)))
        for start in range(share, len(src), share)
    ]
    _copy_range(host, src, dst, step, 0, share)
    for future in futures:
        future.result()


def _run_batch(flat: torch.Tensor, scratch: torch.Tensor | None, batch: _Batch, bytes_per_block: int) -> None:
    """Gather every source of the batch, then scatter: nothing is written before all is read.
    A disjoint batch (no op reads what any op writes) needs no such care: on the CPU it is
    copied a cache-sized chunk at a time."""
    groups = _groups(batch, bytes_per_block)
    if len(groups) == 1 and batch.src_scratch is None and batch.dst_scratch is None:
        # The common case, pool to pool at one unit.
        unit = groups[0][0]
        rows = _Rows(flat, unit, *_width(unit, flat))
        counts = batch.length // unit
        src = rows.index(batch.src // unit, counts)
        dst = rows.index(batch.dst // unit, counts)
        step = max(1, _CHUNK_BYTES // unit)
        if rows.host is not None and batch.disjoint and len(src) > step:
            # On the CPU (rows.host) the indices are numpy arrays.
            _copy_chunks(rows.host, cast(np.ndarray, src), cast(np.ndarray, dst), step, int(batch.length.sum()))
            return
        rows.put(dst, rows.select(src))
        return
    gathered = [_gather(flat, scratch, batch, unit, members) for unit, members in groups]
    for group in gathered:
        _scatter(batch, group, flat.numel())


def execute_plan(pool: torch.Tensor, batches: Sequence[CopyBatch], scratch_bytes: int, *, pool_id: int | None = None) -> None:
    """Validate the whole plan (with `pool_id`: also that it names only that pool), then run
    its batches in order, each as one gather + one scatter on `pool.view(-1)` (see the module
    docstring). On CUDA, runs on the current stream."""
    checked = _validate(pool, batches, scratch_bytes, pool_id=pool_id)
    if not checked:
        return
    flat = pool.view(-1)
    scratch = torch.empty(scratch_bytes, dtype=torch.uint8, device=pool.device) if scratch_bytes else None
    for batch in checked:
        _run_batch(flat, scratch, batch, pool.shape[1])


def apply_moves(pool: torch.Tensor, moves: Sequence[tuple[BlockRef, int, BlockRef, int, int]]) -> tuple[int, int]:
    """Parallel assignment of `moves` = (src block, src offset, dst block, dst offset, length)
    on `pool`: plan with plan_copies and execute. Overlapping destinations have no meaning and
    are refused before anything is written. Returns (number of batches, scratch bytes)."""
    planned = [
        PlannedMove(Region(src, src_offset, length), Region(dst, dst_offset, length))
        for src, src_offset, dst, dst_offset, length in moves
    ]
    # Check the moves themselves first: the planner drops exact self-copies, which must not
    # hide a bad block or bound. Packed in one CopyBatch, they must be of one pool and name no
    # block SCRATCH_BLOCK (which a column reads as scratch).
    pool_ids = set()
    for index, (src, _, dst, _, _) in enumerate(moves):
        for side, ref in (("src", src), ("dst", dst)):
            pool_ids.add(ref.pool_id)
            if ref.block_id == SCRATCH_BLOCK:
                raise CopyError(
                    "unknown_block",
                    f"move {index}: {side} block {ref.block_id}, not in a pool of {pool.shape[0]} blocks",
                    op=index,
                )
    if len(pool_ids) > 1:
        raise CopyError("mixed_pools", f"the moves name pools {sorted(pool_ids)}; one tensor is one pool")
    pool_id = pool_ids.pop() if pool_ids else 0
    _validate(pool, [CopyBatch.from_ops(pool_id, [CopyOp(m.src, m.dst, False) for m in planned])], 0, check_overlap=False)
    clash = overlapping_destinations(planned)
    if clash is not None:
        first, second = clash
        raise CopyError("overlapping_destinations", f"moves {first} and {second} write the same bytes", op=second)
    plan, scratch_bytes = plan_copies(planned)
    execute_plan(pool, [CopyBatch.from_ops(pool_id, ops) for ops in plan], scratch_bytes)
    return len(plan), scratch_bytes
