"""Benchmark: the coordinator state's memory, in bytes per tracked slot and per published key.

    .venv/bin/python ops/bench/memory.py [--slots 1000000] [--keys 1000000] [--world-size 2]

Everything is built through the real pure core (coordinator.core.CoordinatorCore: decider and
projector, events not kept), exactly as a sidecar folds them:

1. slots: one engine with one attention pool of `--slots` blocks. Measured twice: declared (every
   slot free), then tracked in use, every slot allocated to owners and marked computed (each holds
   a generation, a ref and its content key).
2. keys: a tier of `--keys` slots; requests compute blocks and store them, every rank reports its
   checksum (`--world-size` ranks, 16-byte xxh3-128 checksums as the workers send), and each key
   is published: its place in the tier's key -> slot dict and LRU, its packed checksums, and its
   slot's row in the tier's columns (coordinator/core/state.py, TierState).

Bytes are what tracemalloc sees allocated by the Python heap between the two points (the state
only: the decider's events are dropped as they are folded), divided by the count. A key's figure
leaves out what its tier costs as declared (the per-slot lists and the free set), printed beside
it. Targets (DESIGN.md, "Targets"): <= 300 B per slot, <= 200 B per key. Progress goes to
stderr; figures to stdout.
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import sys
import time
import tracemalloc
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from figures import console, core_build, load, out  # noqa: E402

from coordinator.core import CoordinatorCore  # noqa: E402
from coordinator.core.commands import (  # noqa: E402
    AllocateBlocks,
    AnyCommand,
    DeclareEngine,
    DeclareTier,
    FinishOwner,
    MarkComputed,
    ReportRank,
    StartOwner,
    StartStore,
)
from coordinator.core.step import stepping  # noqa: E402
from events import (  # noqa: E402
    BlockRef,
    BlocksAllocated,
    BlocksComputed,
    Event,
    NamespaceSpec,
    NoticeDropped,
    OwnerStarted,
    PoolSpec,
    Refused,
    StoreJobStarted,
    TierSpec,
)

ENGINE = "bench-engine"
TIER = "host"
BLOCK = 16
SLOT_TARGET = 300
KEY_TARGET = 200
CHUNK = 4096
"""Blocks per request: an owner computes (and stores) this many at a time."""


def namespace(world_size: int) -> NamespaceSpec:
    return NamespaceSpec(
        model_id="bench/model",
        weights_revision="sha256:bench",
        tokenizer_digest="sha256:tok",
        kv_dtype="bfloat16",
        kv_layout_version=1,
        block_sizes=(BLOCK,),
        tensor_parallel_size=world_size,
        tenant="bench",
    )


def ok(events: list[Event]) -> list[Event]:
    bad = [e for e in events if isinstance(e, (Refused, NoticeDropped))]
    if bad:
        raise SystemExit(f"the core refused a benchmark command: {bad[0]}")
    return events


def checked(core: CoordinatorCore) -> Callable[[AnyCommand], list[Event]]:
    """`core.execute`, stopping the benchmark at the first refusal."""
    return lambda command: ok(core.execute(command))


def heap() -> int:
    gc.collect()
    return tracemalloc.get_traced_memory()[0]


def declare(core: CoordinatorCore, slots: int, tier_slots: int, world_size: int) -> None:
    ok(core.execute(DeclareTier(spec=TierSpec(name=TIER, num_slots=tier_slots, bytes_per_slot=1 << 20))))
    pool = PoolSpec(pool_id=0, kind="attention", num_blocks=slots + 1, block_size=BLOCK, bytes_per_block=1 << 20)
    ok(
        core.execute(
            DeclareEngine(engine_id=ENGINE, namespace=namespace(world_size), pools=[pool], world_size=world_size, tiers=[TIER])
        )
    )


def compute_chunk(core: CoordinatorCore, index: int, count: int) -> tuple[int, list[BlockRef]]:
    """An owner allocates `count` blocks and computes them (distinct tokens: distinct keys)."""
    [started] = ok(core.execute(StartOwner(engine_id=ENGINE, req_id=f"req-{index}")))
    assert isinstance(started, OwnerStarted)
    [allocated] = ok(core.execute(AllocateBlocks(engine_id=ENGINE, owner_id=started.owner_id, pool_id=0, count=count)))
    assert isinstance(allocated, BlocksAllocated)
    tokens = [index * 1_000_003 + i for i in range(count * BLOCK)]
    [computed] = ok(
        core.execute(MarkComputed(engine_id=ENGINE, owner_id=started.owner_id, blocks=allocated.blocks, token_ids=tokens))
    )
    assert isinstance(computed, BlocksComputed)
    return started.owner_id, list(allocated.blocks)


def fill_slots(core: CoordinatorCore, slots: int) -> None:
    step, done = 0, 0
    while done < slots:
        count = min(CHUNK, slots - done)
        step += 1
        with stepping(checked(core), ENGINE, step, float(step)):
            compute_chunk(core, step, count)
        done += count
        if step % 64 == 0:
            console.print(f"slots: {done:,} of {slots:,} tracked")


def publish_keys(core: CoordinatorCore, keys: int, world_size: int) -> None:
    step, done = 0, 0
    while done < keys:
        count = min(CHUNK, keys - done)
        step += 1
        with stepping(checked(core), ENGINE, step, float(step)):
            owner_id, blocks = compute_chunk(core, step, count)
            events = ok(core.execute(StartStore(engine_id=ENGINE, tier=TIER, blocks=blocks)))
            [job] = [e for e in events if isinstance(e, StoreJobStarted)]
            for rank in range(world_size):
                sums = [hashlib.blake2b(item.key + bytes([rank]), digest_size=16).digest() for item in job.items]
                ok(core.execute(ReportRank(job_id=job.job_id, rank=rank, ok=True, checksums=sums)))
            ok(core.execute(FinishOwner(engine_id=ENGINE, owner_id=owner_id)))
        done += count
        if step % 64 == 0:
            console.print(f"keys: {done:,} of {keys:,} published")


def measure_slots(slots: int, world_size: int) -> None:
    tracemalloc.start()
    before = heap()
    core = CoordinatorCore(keep_events=False)
    declare(core, slots, 1, world_size)
    declared = heap()
    started = time.perf_counter()
    fill_slots(core, slots)
    tracked = heap()
    tracemalloc.stop()
    pool = core.state.engines[ENGINE].pools[0]
    assert sum(1 for r in pool.refs if r) == slots, "every slot is held"
    per_free, per_held = (declared - before) / slots, (tracked - before) / slots
    out(
        f"slots: {slots:,} declared (free): {per_free:,.1f} B/slot; all held and computed (a generation, a ref, a "
        f"content key each): {per_held:,.1f} B/slot [target <= {SLOT_TARGET}: {'met' if per_held <= SLOT_TARGET else 'MISSED'}] "
        f"(built in {time.perf_counter() - started:.1f} s)"
    )
    out(f"{per_held:.1f} B per tracked slot")


def measure_keys(keys: int, world_size: int) -> None:
    tracemalloc.start()
    start = heap()
    core = CoordinatorCore(keep_events=False)
    declare(core, CHUNK, keys, world_size)
    before = heap()
    started = time.perf_counter()
    publish_keys(core, keys, world_size)
    after = heap()
    tracemalloc.stop()
    tier = core.state.tiers[TIER]
    published = sum(len(group) for group in tier.published.values())
    assert published == keys, f"{published} keys published of {keys}"
    per_key = (after - before) / keys
    out(
        f"keys: {keys:,} published in a tier of {keys:,} slots, {world_size} ranks' 16-byte checksums each: "
        f"{per_key:,.1f} B/key [target <= {KEY_TARGET}: {'met' if per_key <= KEY_TARGET else 'MISSED'}] "
        f"(built in {time.perf_counter() - started:.1f} s); not in that figure, the tier as declared (every slot "
        f"free, the engine's pool of {CHUNK:,} blocks with it): {(before - start) / keys:,.1f} B/slot"
    )
    out(f"{per_key:.1f} B per published key")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--slots", type=int, default=1_000_000)
    parser.add_argument("--keys", type=int, default=1_000_000)
    parser.add_argument("--world-size", type=int, default=2)
    args = parser.parse_args()
    out(f"memory benchmark, {load()}")
    out(core_build())
    measure_slots(args.slots, args.world_size)
    measure_keys(args.keys, args.world_size)


if __name__ == "__main__":
    main()
