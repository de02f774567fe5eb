"""Benchmark: ordered state copies (gpu/copies.py, I15) against plain torch on the same data.

    .venv/bin/python ops/bench/copies.py [--moves 1024] [--block-bytes 16384] [--repeats 10]
        [--device auto|cpu|cuda] [--overlap 0.1] [--shift-bytes 64] [--threads 0]

A pool of 2 * moves + 1 blocks (uint8 [num_blocks, block_bytes]); `moves` disjoint moves from
blocks 1..moves to a shuffled permutation of blocks moves+1..2*moves, in two shapes:

* whole blocks: each move copies one whole block;
* segments: each move copies half a block, at offset 0 or block_bytes/2 (chosen at random on
  both sides).

Per shape, each timed as its best run after a warm-up (CUDA: synchronised). The bytes baseline,
slow, gets `repeats` runs of its own; ours, validate_plan alone and the rows and loop baselines
are timed in turns (`repeats` rounds, each running every one 3 times, the order rotated), so
that a burst of load on a shared host falls on them alike and their ratios hold still:

1. baseline, bytes: `flat.index_copy_(0, dst_idx, flat.index_select(0, src_idx))` with the
   per-byte int64 indices precomputed (not timed) - the brief's `flat[dst] = flat[src]`;
2. baseline, rows: the same with one index per move, on `flat` viewed as rows of one move's
   length (a whole block or half-block row) of int64, indices precomputed - the best plain
   gather/scatter for this layout;
3. baseline, loop: one `pool[d, a:b].copy_(pool[s, c:e])` a move (correct only because the
   moves are disjoint);
4. ours: `execute_plan` on the planner's plan (one batch, a CopyBatch of columns), validation
   and index building included; the planning (`plan_copies` and packing its batches into
   CopyBatches, as the decider does) is timed on its own.

The ratio printed is baseline time / our time: >= 0.9 means ours is at least 0.9x as fast as
that baseline (the target is against the bytes baseline, the brief's baseline; the rows one is
shown too). Then the overlap cost: the same moves with a fraction (`--overlap`, default 10%)
replaced by shifts inside their destination block by `--shift-bytes` (src and dst overlap;
memmove semantics), still one batch; its time and planning time next to the all-disjoint
case. execute_plan indexes rows of the gcd of each op's offsets and length; the shifts form
their own group of smaller rows, so `--shift-bytes 1` (one index a byte for those ops) shows
the worst case.

Every result is checked once against the parallel-assignment result computed by slicing an
untouched snapshot. Also printed: GB/s (bytes copied / time) and, as the device's ceiling, one
plain contiguous `copy_` of the same byte count. The load average is printed too: figures taken
on a busy machine are low. --threads sets torch's CPU threads (0: torch's default).
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

from coordinator.core.copy_plan import PlannedMove, plan_copies  # noqa: E402
from events import BlockRef, CopyBatch, Region  # noqa: E402
from gpu.copies import execute_plan, validate_plan  # noqa: E402

Move = tuple[int, int, int, int, int]  # src block, src offset, dst block, dst offset, length


def out(line: str) -> None:
    print(line, flush=True)


def load() -> str:
    one, five, fifteen = os.getloadavg()
    return f"load average {one:.2f} {five:.2f} {fifteen:.2f} ({os.cpu_count()} cores, torch threads {torch.get_num_threads()})"


def best_of(repeats: int, device: torch.device, run: Callable[[], object]) -> float:
    """Best wall time of `repeats` runs after one warm-up, synchronising on CUDA."""

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    run()
    sync()
    times = []
    for _ in range(repeats):
        sync()
        start = time.perf_counter()
        run()
        sync()
        times.append(time.perf_counter() - start)
    return min(times)


PER_TURN = 3
"""Runs of one contender in a row in `in_turns` (the first after another contender's may pay for
its leftovers: torch's OpenMP threads still spinning, caches)."""


def in_turns(rounds: int, device: torch.device, contenders: dict[str, Callable[[], object]]) -> dict[str, float]:
    """Best wall time of each contender, timed in turns: each round runs every contender
    PER_TURN times, the order rotated from round to round. On a shared host a burst of load then
    falls on all of them alike, rather than on whichever was being timed when it came, so the
    ratios between them are steadier than those of best_of one after another."""

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    names = list(contenders)
    for name in names:
        contenders[name]()
    sync()
    best = dict.fromkeys(names, float("inf"))
    for round_ in range(rounds):
        turn = round_ % len(names)
        for name in names[turn:] + names[:turn]:
            run = contenders[name]
            for _ in range(PER_TURN):
                sync()
                start = time.perf_counter()
                run()
                sync()
                best[name] = min(best[name], time.perf_counter() - start)
    return best


def byte_index(moves: list[Move], bytes_per_block: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    src = torch.cat([torch.arange(s * bytes_per_block + so, s * bytes_per_block + so + n) for s, so, _, _, n in moves])
    dst = torch.cat([torch.arange(d * bytes_per_block + do, d * bytes_per_block + do + n) for _, _, d, do, n in moves])
    return src.to(device), dst.to(device)


def planned(moves: list[Move]) -> list[PlannedMove]:
    return [PlannedMove(Region(BlockRef(0, s, 1), so, n), Region(BlockRef(0, d, 1), do, n)) for s, so, d, do, n in moves]


def plan(moves: list[Move]) -> tuple[list[CopyBatch], int]:
    """What the decider does: plan_copies, then each batch packed into columns."""
    batches, scratch = plan_copies(planned(moves))
    return [CopyBatch.from_ops(0, ops) for ops in batches], scratch


def expected_of(original: torch.Tensor, moves: list[Move]) -> torch.Tensor:
    expected = original.clone()
    for s, so, d, do, n in moves:
        expected[d, do : do + n] = original[s, so : so + n]
    return expected


def gbps(nbytes: int, seconds: float) -> str:
    return f"{nbytes / seconds / 1e9:.2f} GB/s"


def scenario(
    name: str, moves: list[Move], length: int, pool: torch.Tensor, original: torch.Tensor, args: argparse.Namespace
) -> tuple[float, float, float]:
    """Time the baselines and ours on `moves`; returns (our time, planning time, the strongest baseline's time over ours)."""
    device = pool.device
    bytes_per_block = pool.shape[1]
    flat = pool.view(-1)
    nbytes = sum(m[4] for m in moves)

    def reset() -> None:
        pool.copy_(original)

    expected = expected_of(original, moves)

    start = time.perf_counter()
    batches, scratch = plan(moves)
    plan_s = time.perf_counter() - start
    assert len(batches) == 1 and scratch == 0, (len(batches), scratch)
    plan_s = min(plan_s, best_of(max(1, args.repeats // 2), device, lambda: plan(moves)))

    def ours() -> None:
        execute_plan(pool, batches, scratch)

    reset()
    ours()
    assert torch.equal(pool, expected), f"{name}: execute_plan disagrees with parallel assignment"

    src_idx, dst_idx = byte_index(moves, bytes_per_block, device)

    def bytes_baseline() -> None:
        flat.index_copy_(0, dst_idx, flat.index_select(0, src_idx))  # noqa: F821 - bound above (ruff sees the del below)

    reset()
    bytes_baseline()
    assert torch.equal(pool, expected), f"{name}: the bytes baseline is wrong"
    bytes_s = best_of(args.repeats, device, bytes_baseline)
    del src_idx, dst_idx

    # The widest element that divides the row: uint8 rows make index_copy_ several times slower.
    width = next(w for w in (8, 4, 2, 1) if length % w == 0)
    wide = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}[width]
    rows = (flat.view(wide) if width > 1 else flat).view(-1, length // width)
    src_rows = torch.tensor([(s * bytes_per_block + so) // length for s, so, _, _, _ in moves], device=device)
    dst_rows = torch.tensor([(d * bytes_per_block + do) // length for _, _, d, do, _ in moves], device=device)

    def rows_baseline() -> None:
        rows.index_copy_(0, dst_rows, rows.index_select(0, src_rows))

    reset()
    rows_baseline()
    assert torch.equal(pool, expected), f"{name}: the rows baseline is wrong"

    views = [(pool[d, do : do + n], pool[s, so : so + n]) for s, so, d, do, n in moves]

    def loop_baseline() -> None:
        for target, source in views:
            target.copy_(source)

    # The moves are disjoint, so running any of them again leaves the expected pool.
    timed = in_turns(
        args.repeats,
        device,
        {"ours": ours, "validate": lambda: validate_plan(pool, batches, scratch), "rows": rows_baseline, "loop": loop_baseline},
    )
    assert torch.equal(pool, expected), f"{name}: the pool changed while timed"
    ours_s, validate_s, rows_s, loop_s = timed["ours"], timed["validate"], timed["rows"], timed["loop"]

    out(f"{name}: {len(moves):,} moves of {length:,} bytes, {nbytes / 2**20:,.1f} MiB, one batch")
    out(f"  baseline bytes (index_select + index_copy_, per-byte indices): {bytes_s * 1e3:8.3f} ms  {gbps(nbytes, bytes_s)}")
    out(f"  baseline rows  (index_select + index_copy_, one index a move): {rows_s * 1e3:8.3f} ms  {gbps(nbytes, rows_s)}")
    out(f"  baseline loop  (one copy_ a move):                             {loop_s * 1e3:8.3f} ms  {gbps(nbytes, loop_s)}")
    out(f"  ours (execute_plan: validate + index + gather + scatter):     {ours_s * 1e3:8.3f} ms  {gbps(nbytes, ours_s)}")
    ratio = bytes_s / ours_s
    out(f"    of which validate_plan alone:                               {validate_s * 1e3:8.3f} ms")
    out(
        f"  ratio baseline/ours: bytes {ratio:.2f} (target >= 0.9: {'met' if ratio >= 0.9 else 'MISSED'}), "
        f"rows {rows_s / ours_s:.2f}, loop {loop_s / ours_s:.2f}"
    )
    out(f"  planning (plan_copies of {len(moves):,} moves + packing, not in the figures above): {plan_s * 1e3:.3f} ms")
    strongest = min(bytes_s, rows_s, loop_s) / ours_s
    out(f"  strongest baseline/ours: {strongest:.2f} (issue 22's bar: >= 0.9 of the strongest baseline)")
    return ours_s, plan_s, strongest


def overlap_case(
    name: str,
    moves: list[Move],
    pool: torch.Tensor,
    original: torch.Tensor,
    args: argparse.Namespace,
    disjoint: tuple[float, float],
) -> None:
    """The same moves, a fraction of them replaced by a shift inside the destination block."""
    device = pool.device
    rng = random.Random(args.seed + 1)
    shift = args.shift_bytes
    count = round(len(moves) * args.overlap)
    chosen = set(rng.sample(range(len(moves)), count))
    mixed: list[Move] = []
    for index, (s, so, d, do, n) in enumerate(moves):
        if index in chosen:
            mixed.append((d, do, d, do + shift, n - shift))  # src and dst overlap inside block d
        else:
            mixed.append((s, so, d, do, n))
    expected = expected_of(original, mixed)
    start = time.perf_counter()
    batches, scratch = plan(mixed)
    plan_s = time.perf_counter() - start
    assert len(batches) == 1 and scratch == 0
    ordered = sum(batches[0].ordered)
    plan_s = min(plan_s, best_of(max(1, args.repeats // 2), device, lambda: plan(mixed)))

    def ours() -> None:
        execute_plan(pool, batches, scratch)

    pool.copy_(original)
    ours()
    assert torch.equal(pool, expected), f"{name}: execute_plan disagrees with parallel assignment (overlap)"
    ours_s = best_of(args.repeats, device, ours)
    nbytes = sum(m[4] for m in mixed)
    disjoint_s, disjoint_plan_s = disjoint
    out(
        f"  with {args.overlap:.0%} shifts by {shift} bytes ({ordered} ordered ops, still one batch): "
        f"{ours_s * 1e3:.3f} ms {gbps(nbytes, ours_s)}, {ours_s / disjoint_s:.2f}x the all-disjoint time; "
        f"planning {plan_s * 1e3:.3f} ms ({plan_s / disjoint_plan_s:.2f}x)"
    )


def ceiling(nbytes: int, device: torch.device, repeats: int) -> None:
    a = torch.empty(nbytes, dtype=torch.uint8, device=device).fill_(1)
    b = torch.empty_like(a)
    seconds = best_of(repeats, device, lambda: b.copy_(a))
    out(
        f"ceiling: one contiguous copy_ of {nbytes / 2**20:,.1f} MiB on {device}: {seconds * 1e3:.3f} ms  {gbps(nbytes, seconds)}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--moves", type=int, default=1024, help="moves in the batch (default 1024)")
    parser.add_argument("--block-bytes", type=int, default=16384, help="bytes per block (default 16384)")
    parser.add_argument("--repeats", type=int, default=10, help="timed runs or rounds, best kept (default 10)")
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    parser.add_argument("--overlap", type=float, default=0.1, help="fraction of moves made shifts (default 0.1)")
    parser.add_argument("--shift-bytes", type=int, default=64, help="shift of the overlapping moves (default 64)")
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads (default: torch's choice)")
    parser.add_argument("--seed", type=int, default=7)
    args = parser.parse_args()
    if args.moves < 1 or args.repeats < 1 or args.block_bytes < 2 or args.block_bytes % 2:
        parser.error("--moves and --repeats must be positive, --block-bytes even and >= 2")
    if not 0 <= args.overlap <= 1 or not 0 < args.shift_bytes < args.block_bytes // 2:
        parser.error("--overlap is in [0, 1]; --shift-bytes in (0, block_bytes / 2)")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device here")
    device = torch.device(
        "cuda" if args.device == "auto" and torch.cuda.is_available() else "cpu" if args.device == "auto" else args.device
    )
    if args.threads:
        torch.set_num_threads(args.threads)

    out(f"host at start: {load()}")
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    out(f"device {device} ({name}), torch {torch.__version__}")
    rng = random.Random(args.seed)
    n, block = args.moves, args.block_bytes
    generator = torch.Generator().manual_seed(args.seed)
    original = torch.randint(0, 256, (2 * n + 1, block), dtype=torch.uint8, generator=generator).to(device)
    pool = original.clone()
    targets = list(range(n + 1, 2 * n + 1))
    rng.shuffle(targets)

    whole: list[Move] = [(1 + i, 0, targets[i], 0, block) for i in range(n)]
    half = block // 2
    segments: list[Move] = [(1 + i, rng.choice((0, half)), targets[i], rng.choice((0, half)), half) for i in range(n)]

    strongest = []
    for label, moves, length in (("whole blocks", whole, block), ("half-block segments", segments, half)):
        ours_s, plan_s, ratio = scenario(label, moves, length, pool, original, args)
        strongest.append(ratio)
        overlap_case(label, moves, pool, original, args, (ours_s, plan_s))
    ceiling(n * block, device, args.repeats)
    out(f"host at end: {load()}")
    out(f"strongest baseline ratio {min(strongest):.3f}")


if __name__ == "__main__":
    main()
