"""Ordered state copies on a device pool (I15): run a `plan_copies` plan on a real tensor.

A batch of moves means *parallel assignment*: every move reads the content as it was before the
batch. coordinator.core.copy_plan.plan_copies turns such a batch into ordered `batches` of CopyOps
(chains in dependency order, cycles broken by a first batch that saves sources to scratch);
this module executes that plan on a pool.

A pool is a contiguous 2-D torch.uint8 tensor [num_blocks, bytes_per_block]; block 0 is the
null block and is never read or written. A Region names bytes [offset, offset + length) of one
block, or of the scratch buffer when its block is None. Scratch is a separate uint8 tensor of
`scratch_bytes` on the pool's device, alive for one `execute_plan` call.

Execution:

* The whole plan is validated before any byte is written (block ids, null block, bounds, equal
  src/dst lengths, one pool id, no two destinations of one batch overlapping), so a bad plan
  raises CopyError and leaves the pool untouched.
* Batches run in order. Each batch is one gather and then one scatter: the byte ranges of
  all its sources and destinations are expanded into flat index tensors with one
  repeat_interleave + arange (no per-byte Python loop), every source is gathered into fresh
  buffers (`index_select` returns a copy), and only then are the buffers scattered to the
  destinations (`index_copy_`).
* Gather-then-scatter is memmove-safe: nothing is written until every source byte of the batch
  has been read, so an op whose own src and dst overlap inside one block (a shift; CopyOp.ordered)
  gets memmove semantics, and the batch as a whole has parallel-assignment semantics even if
  its copies were not independent. The order between batches is what the planner relies on
  (a batch may read what an earlier batch wrote, e.g. scratch).
* Indices address rows, not necessarily bytes: an op's row size ("unit") is the gcd of
  bytes_per_block and its offsets and length, so whole-block moves take one index per block
  and a one-byte shift one per byte; rows are read as int64/int32/int16 when the unit and the
  pool's alignment allow. Ops of one batch with different units form up to _MAX_GROUPS groups
  (usually one), each gathered with its own index_select; all groups are gathered before any
  is scattered, so the batch is still read whole before it is written. That is the same copy,
  with fewer and wider indices, and a few odd shifts do not shrink every index of the batch.

Indices are built on the host (the plan is host data); only per-op starts and counts go to
the pool's device, where they are expanded. On CUDA this module picks no stream: everything is enqueued on the caller's current
stream (the worker runs these on its transfer stream) and nothing here synchronises beyond the
host-to-device copy of the index metadata.
"""

from __future__ import annotations

import array
import math
from collections.abc import Sequence
from typing import cast

import torch

from coordinator.core.copy_plan import PlannedMove, overlapping_destinations, plan_copies
from events import BlockRef, CopyOp, Region

__all__ = ["CopyError", "apply_moves", "execute_plan", "validate_plan"]

_MAX_GROUPS = 4
_WIDE = ((8, torch.int64), (4, torch.int32), (2, torch.int16))


class CopyError(ValueError):
    """A plan this pool cannot run. `reason` is a stable string: bad_pool, bad_scratch,
    null_block, unknown_block, out_of_bounds, size_mismatch, mixed_pools, wrong_pool,
    overlapping_destinations. `batch` and `op` locate the offending op when there is one."""

    def __init__(self, reason: str, message: str, *, batch: int | None = None, op: int | None = None) -> None:
        super().__init__(message)
        self.reason = reason
        self.batch = batch
        self.op = op


class _Batch:
    """One batch's host-side metadata as int64 CPU tensors (one entry an op), in a unified
    address space: pool bytes are [0, num_blocks * bytes_per_block), scratch byte k is
    `pool_bytes + k`. The scratch masks are None when the batch does not touch scratch."""

    __slots__ = ("src", "dst", "length", "src_scratch", "dst_scratch")

    def __init__(
        self,
        src: torch.Tensor,
        dst: torch.Tensor,
        length: torch.Tensor,
        src_scratch: torch.Tensor | None,
        dst_scratch: torch.Tensor | None,
    ) -> None:
        self.src = src
        self.dst = dst
        self.length = length
        self.src_scratch = src_scratch
        self.dst_scratch = dst_scratch


def _ints(values: list[int]) -> torch.Tensor:
    """A Python int list as an int64 CPU tensor (through array: several times faster than
    torch.tensor on a list). OverflowError for a value outside int64."""
    return torch.frombuffer(array.array("q", values), dtype=torch.int64)


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


def _first_problem(
    batch_index: int, batch: Sequence[CopyOp], num_blocks: int, bytes_per_block: int, scratch_bytes: int
) -> CopyError:
    """The error for the first bad op of a batch the vectorised check rejected."""
    for index, op in enumerate(batch):
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
        if op.src.length != op.dst.length:
            return CopyError(
                "size_mismatch",
                f"batch {batch_index} op {index} ({_describe(op)}): src has {op.src.length} bytes, dst {op.dst.length}",
                batch=batch_index,
                op=index,
            )
    raise AssertionError("the vectorised check and the per-op check disagree")  # pragma: no cover


def _extract(
    batch_index: int,
    batch: Sequence[CopyOp],
    num_blocks: int,
    bytes_per_block: int,
    scratch_bytes: int,
    pool_ids: set[int],
    check_overlap: bool = True,
) -> _Batch:
    """Check one batch and turn it into unified byte addresses. A few list comprehensions
    read the ops' fields; every check after that is vectorised over the batch. The per-op walk
    (_first_problem) only runs to name the culprit once a check failed."""
    n = len(batch)
    regions = [op.src for op in batch] + [op.dst for op in batch]
    refs = [r.block for r in regions]
    try:
        offsets = _ints([r.offset for r in regions])
        lengths = _ints([r.length for r in regions])
        if None in refs:
            scratch: torch.Tensor | None = torch.tensor([b is None for b in refs], dtype=torch.bool)
            ids = _ints([-1 if b is None else b.block_id for b in refs])
        else:
            scratch = None
            ids = _ints([b.block_id for b in cast(list[BlockRef], refs)])
    except OverflowError:
        raise _first_problem(batch_index, batch, num_blocks, bytes_per_block, scratch_bytes) from None
    if scratch is None:
        limit: torch.Tensor | int = bytes_per_block
        in_range = (ids > 0) & (ids < num_blocks)
    else:
        limit = torch.where(scratch, scratch_bytes, bytes_per_block)
        in_range = scratch | ((ids > 0) & (ids < num_blocks))
    # offsets and lengths are each checked against the limit first, so their sum cannot wrap.
    bad = ~in_range | (lengths <= 0) | (offsets < 0) | (offsets > limit) | (lengths > limit)
    bad |= offsets + lengths > limit
    if bool(bad.any()) or not torch.equal(lengths[:n], lengths[n:]):
        raise _first_problem(batch_index, batch, num_blocks, bytes_per_block, scratch_bytes)
    pool_ids.update({b.pool_id for b in refs if b is not None})
    if len(pool_ids) > 1:
        raise CopyError(
            "mixed_pools",
            f"batch {batch_index}: the plan names pools {sorted(pool_ids)}; one tensor is one pool",
            batch=batch_index,
        )
    address = ids * bytes_per_block + offsets
    if scratch is not None:
        address = torch.where(scratch, num_blocks * bytes_per_block + offsets, address)
    # Destinations of one batch must not overlap: the scatter would race.
    if check_overlap and n > 1:
        starts, order = torch.sort(address[n:])
        stops = starts + lengths[n:][order]
        clash = torch.nonzero(starts[1:] < stops[:-1])
        if clash.numel():
            k = int(clash[0, 0])
            a, b = sorted((int(order[k]), int(order[k + 1])))
            raise CopyError(
                "overlapping_destinations",
                f"batch {batch_index} ops {a} ({_describe(batch[a])}) and {b} ({_describe(batch[b])}) write the same bytes",
                batch=batch_index,
                op=b,
            )
    return _Batch(
        address[:n],
        address[n:],
        lengths[:n],
        None if scratch is None else scratch[:n],
        None if scratch is None else scratch[n:],
    )


def _validate(
    pool: torch.Tensor,
    batches: Sequence[Sequence[CopyOp]],
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


def validate_plan(
    pool: torch.Tensor, batches: Sequence[Sequence[CopyOp]], scratch_bytes: int, *, pool_id: int | None = None
) -> None:
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


def _rows(flat: torch.Tensor, unit: int, width: int, dtype: torch.dtype) -> torch.Tensor:
    """`flat` (uint8) as rows of `unit` bytes, each row `unit // width` elements of `dtype`."""
    usable = flat[: flat.numel() // unit * unit]
    if width > 1:
        usable = usable.view(dtype)
    return usable.view(-1, unit // width)


def _expand(starts: torch.Tensor, counts: torch.Tensor, device: torch.device) -> torch.Tensor:
    """[starts[0], .., starts[0] + counts[0] - 1, starts[1], ..] on `device`: the row indices
    of a set of ranges, from per-range CPU tensors, with one repeat_interleave and one arange
    (or a broadcast add when every range has the same length)."""
    first = int(counts[0])
    if starts.numel() == 1:
        return torch.arange(int(starts[0]), int(starts[0]) + first, device=device)
    if bool((counts == first).all()):
        base = starts.to(device)
        return base if first == 1 else (base[:, None] + torch.arange(first, device=device)).reshape(-1)
    # Per range: its start minus the position where its rows begin in the output; + arange.
    total = int(counts.sum())
    shift = starts - (torch.cumsum(counts, 0) - counts)
    repeated = torch.repeat_interleave(shift.to(device), counts.to(device), output_size=total)
    return repeated + torch.arange(total, device=device)


def _groups(batch: _Batch, bytes_per_block: int) -> list[tuple[int, torch.Tensor | None]]:
    """The batch's ops by index unit: (row bytes, op indices, None for all). An op's unit is
    the gcd of bytes_per_block, its addresses and its length (a scratch address is pool_bytes
    + offset and bytes_per_block divides pool_bytes, so that is its offset's gcd too). Usually
    one group; a few odd shifts get their own small group instead of shrinking every index of
    the batch. At most _MAX_GROUPS: beyond that the groups moving the fewest bytes share a unit."""
    n = batch.length.numel()
    units = torch.gcd(torch.gcd(torch.gcd(batch.src, batch.dst), batch.length), torch.tensor(bytes_per_block))
    low, high = int(units.min()), int(units.max())
    if low == high or int(batch.length.sum()) // low <= 4 * n:
        return [(low, None)]  # one unit, or a few rows an op at the smallest: one group
    values, inverse = torch.unique(units, return_inverse=True)
    moved = torch.zeros(values.numel(), dtype=torch.int64).index_add_(0, inverse, batch.length)
    ranked = torch.argsort(moved, descending=True, stable=True).tolist()
    kept, rest = ranked[: _MAX_GROUPS - 1], ranked[_MAX_GROUPS - 1 :]
    if len(rest) == 1:
        kept, rest = ranked, []
    groups: list[tuple[int, torch.Tensor | None]] = [(int(values[g]), torch.nonzero(inverse == g).flatten()) for g in kept]
    if rest:
        unit = math.gcd(*(int(values[g]) for g in rest))
        groups.append((unit, torch.nonzero(torch.isin(inverse, torch.tensor(rest))).flatten()))
    return groups


class _Gathered:
    """One group's sources, read: `values` holds the rows of ops `order` (op indices, CPU),
    in that order, `counts` rows each."""

    __slots__ = ("unit", "pool_rows", "scratch_rows", "order", "counts", "values")

    def __init__(
        self,
        unit: int,
        pool_rows: torch.Tensor,
        scratch_rows: torch.Tensor | None,
        order: torch.Tensor,
        counts: torch.Tensor,
        values: torch.Tensor,
    ) -> None:
        self.unit = unit
        self.pool_rows = pool_rows
        self.scratch_rows = scratch_rows
        self.order = order
        self.counts = counts
        self.values = values

    def rows(self, scratch: bool) -> torch.Tensor:
        rows = self.scratch_rows if scratch else self.pool_rows
        assert rows is not None  # validated: a scratch region implies scratch_bytes > 0
        return rows


def _gather(
    flat: torch.Tensor, scratch: torch.Tensor | None, batch: _Batch, unit: int, members: torch.Tensor | None
) -> _Gathered:
    """Read the sources of ops `members` (None: all) at row size `unit`: one index_select per
    buffer (pool sources first, then scratch ones). index_select returns a copy."""
    pool_bytes = flat.numel()
    # Pool and scratch rows share one element type: a group may move bytes between them.
    width, dtype = _width(unit, flat)
    pool_rows = _rows(flat, unit, width, dtype)
    scratch_rows = None if scratch is None else _rows(scratch, unit, width, dtype)
    if members is None:
        members = torch.arange(batch.length.numel())
    parts: list[torch.Tensor] = []
    orders: list[torch.Tensor] = []
    kinds = (False,) if batch.src_scratch is None else (False, True)
    for kind in kinds:
        chosen = members if batch.src_scratch is None else members[batch.src_scratch[members] == kind]
        if not chosen.numel():
            continue
        rows = scratch_rows if kind else pool_rows
        assert rows is not None
        starts = (batch.src[chosen] - (pool_bytes if kind else 0)) // unit
        parts.append(rows.index_select(0, _expand(starts, batch.length[chosen] // unit, flat.device)))
        orders.append(chosen)
    order = orders[0] if len(orders) == 1 else torch.cat(orders)
    values = parts[0] if len(parts) == 1 else torch.cat(parts)
    return _Gathered(unit, pool_rows, scratch_rows, order, batch.length[order] // unit, values)


def _scatter(flat: torch.Tensor, batch: _Batch, gathered: _Gathered) -> None:
    """Write one group's gathered rows to its destinations: one index_copy_ per buffer."""
    pool_bytes = flat.numel()
    unit, order, counts = gathered.unit, gathered.order, gathered.counts
    kinds = (False,) if batch.dst_scratch is None else (False, True)
    for kind in kinds:
        if batch.dst_scratch is None:
            chosen = None
            ops = order
        else:
            chosen = torch.nonzero(batch.dst_scratch[order] == kind).flatten()  # positions in order
            if not chosen.numel():
                continue
            ops = order[chosen]
        starts = (batch.dst[ops] - (pool_bytes if kind else 0)) // unit
        part_counts = counts if chosen is None else counts[chosen]
        index = _expand(starts, part_counts, flat.device)
        values = gathered.values
        if chosen is not None and chosen.numel() != order.numel():
            where = torch.cumsum(counts, 0) - counts  # each op's first row in values
            values = values.index_select(0, _expand(where[chosen], part_counts, flat.device))
        gathered.rows(kind).index_copy_(0, index, values)


def _run_batch(flat: torch.Tensor, scratch: torch.Tensor | None, batch: _Batch, bytes_per_block: int) -> None:
    """Gather every source of the batch, then scatter: nothing is written before all is read."""
    groups = _groups(batch, bytes_per_block)
    if len(groups) == 1 and batch.src_scratch is None:
        # The common case, pool to pool at one unit: one index_select, one index_copy_.
        unit = groups[0][0]
        rows = _rows(flat, unit, *_width(unit, flat))
        counts = batch.length // unit
        values = rows.index_select(0, _expand(batch.src // unit, counts, flat.device))
        rows.index_copy_(0, _expand(batch.dst // unit, counts, flat.device), values)
        return
    gathered = [_gather(flat, scratch, batch, unit, members) for unit, members in groups]
    for group in gathered:
        _scatter(flat, batch, group)


def execute_plan(
    pool: torch.Tensor, batches: Sequence[Sequence[CopyOp]], scratch_bytes: int, *, pool_id: int | None = None
) -> None:
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
    # hide a bad block or bound.
    _validate(pool, [[CopyOp(m.src, m.dst, False) for m in planned]], 0, check_overlap=False)
    clash = overlapping_destinations(planned)
    if clash is not None:
        first, second = clash
        raise CopyError("overlapping_destinations", f"moves {first} and {second} write the same bytes", op=second)
    batches, scratch_bytes = plan_copies(planned)
    execute_plan(pool, batches, scratch_bytes)
    return len(batches), scratch_bytes
