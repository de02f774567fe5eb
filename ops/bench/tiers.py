"""Benchmark: a worker's stores and loads of the same blocks on the host, disk and Mooncake tiers,
against Mooncake's own put/get of the same bytes without kvledger (issue 21, item 6).

    .venv/bin/python ops/bench/tiers.py [--blocks 512] [--block-bytes 65536] [--repeats 3] [--threads 1]

One worker rank (gpu.worker.Worker, on the CPU) executes a store decision of --blocks blocks,
then a load decision of them into other blocks, on each tier:

* host: host memory, by content key (gpu.tiers.HostTier);
* disk: a file per key in a temporary directory, fsync never (gpu.tiers.DiskTier);
* mooncake: a real Mooncake Store master started here on free loopback ports, from the install
  `ops/tools/install-mooncake.sh` made (gpu.mooncake.MooncakeTier; skipped, saying why, without one).

A store is timed from the decision to the report (copy out, checksum of what was written); a load
likewise (read, checksum checked against the published one before anything is copied, copy in,
every destination verified). Best of --repeats, each on fresh slots and generations. The verify
cost is the checksums alone, timed on the same bytes. The peer is Mooncake's own client: `put`
then `get` of the same bytes under the same names, nothing checked; `mooncake/peer` is kvledger's
time over the peer's (1.0: no overhead). Ends with plain lines:

    host store blocks/s N, host load blocks/s N, disk ..., mooncake ...
    mooncake store ratio R      (peer put time / kvledger store time: >= 1.0 means no overhead)
    mooncake load ratio R
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

from events import BlockRef, LoadItem, LoadJobStarted, PoolSpec, StoreItem, StoreJobStarted  # noqa: E402
from gpu import mooncake  # noqa: E402
from gpu.checksum import checksum  # noqa: E402
from gpu.pools import DevicePools  # noqa: E402
from gpu.tiers import DiskTier, HostTier, Tier  # noqa: E402
from gpu.worker import Worker  # noqa: E402

CPU = torch.device("cpu")
TIER = "bench"


def best(repeats: int, run: Callable[[int], None]) -> float:
    times = []
    for attempt in range(repeats):
        started = time.perf_counter()
        run(attempt)
        times.append(time.perf_counter() - started)
    return min(times)


def worker_on(tier: Tier, blocks: int, block_bytes: int) -> Worker:
    pools = DevicePools(
        [PoolSpec(pool_id=0, kind="attention", num_blocks=2 * blocks + 1, block_size=16, bytes_per_block=block_bytes)], CPU
    )
    pool = pools.pool(0)
    pool.copy_(torch.randint(0, 256, pool.shape, dtype=torch.uint8))
    return Worker("bench", 0, pools, {TIER: tier})


def keys(blocks: int, attempt: int) -> list[bytes]:
    return [(attempt * 1_000_003 + index).to_bytes(16, "big") for index in range(blocks)]


def store_then_load(worker: Worker, blocks: int, repeats: int) -> tuple[float, float]:
    """Best store time and best load time (each a decision of `blocks` items)."""
    sums: dict[int, list[bytes]] = {}

    def store(attempt: int) -> None:
        generation = attempt + 1
        items = [StoreItem(BlockRef(0, 1 + index, 1), key, index, generation) for index, key in enumerate(keys(blocks, attempt))]
        report = worker.execute(StoreJobStarted(job_id=1, engine_id="bench", incarnation=1, tier=TIER, world_size=1, items=items))
        assert report.ok, report.error
        sums[attempt] = report.checksums

    def load(attempt: int) -> None:
        generation = attempt + 1
        items = [
            LoadItem(key, index, generation, BlockRef(0, 1 + blocks + index, 1), [sums[attempt][index]])
            for index, key in enumerate(keys(blocks, attempt))
        ]
        report = worker.execute(
            LoadJobStarted(job_id=2, engine_id="bench", incarnation=1, tier=TIER, world_size=1, items=items, lease_expires_at=1e9)
        )
        assert report.ok, report.error

    stored = best(repeats, store)
    loaded = best(repeats, load)
    return stored, loaded


def peer(store: Any, blocks: int, block_bytes: int, repeats: int) -> tuple[float, float]:
    """Mooncake's own put and get of as many blocks of the same size, nothing checked."""
    payloads = [os.urandom(block_bytes) for _ in range(blocks)]

    def put(attempt: int) -> None:
        for index, payload in enumerate(payloads):
            assert store.put(f"peer/{attempt}/{index}", payload) == 0

    def get(attempt: int) -> None:
        for index in range(blocks):
            assert len(store.get(f"peer/{attempt}/{index}")) == block_bytes

    return best(repeats, put), best(repeats, get)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--blocks", type=int, default=512)
    parser.add_argument("--block-bytes", type=int, default=65536)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch's CPU threads (default 1: with more, torch's copy threads and Mooncake's client threads "
        "contend for this machine's 2 cores, and a 64 KiB copy took 300 us instead of 20)",
    )
    args = parser.parse_args()
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    if args.blocks < 1 or args.block_bytes < 1 or args.repeats < 1:
        parser.error("--blocks, --block-bytes and --repeats must be positive")
    blocks, size = args.blocks, args.block_bytes
    megabytes = blocks * size / 1e6
    data = torch.randint(0, 256, (blocks, size), dtype=torch.uint8)
    verify = best(args.repeats, lambda _: [checksum(row) for row in data])
    print(
        f"{blocks} blocks of {size:,} bytes ({megabytes:.1f} MB) per decision; torch threads {torch.get_num_threads()}; "
        f"load average {os.getloadavg()[0]:.2f}"
    )
    print(f"verify cost (the checksums alone): {verify * 1e3:.1f} ms, {megabytes / verify:,.0f} MB/s")
    figures: dict[str, tuple[float, float]] = {}
    with tempfile.TemporaryDirectory(prefix="kvl-tiers-bench-") as name:
        directory = Path(name)
        figures["host"] = store_then_load(worker_on(HostTier(TIER, CPU), blocks, size), blocks, args.repeats)
        figures["disk"] = store_then_load(
            worker_on(DiskTier(TIER, directory / "disk", CPU, fsync="never"), blocks, size), blocks, args.repeats
        )
        from tests.kit.mooncake import MooncakeMaster, MooncakeUnavailable

        try:
            master = MooncakeMaster.start(directory)
        except MooncakeUnavailable as unavailable:
            print(f"mooncake: skipped ({unavailable})")
            master = None
        if master is not None:
            try:
                segment = max(256 << 20, 4 * (args.repeats + 1) * blocks * size)
                client = mooncake.connect(master.address, master.metadata_url, segment_bytes=segment)
                figures["mooncake"] = store_then_load(
                    worker_on(mooncake.MooncakeTier(TIER, client, rank=0, device=CPU), blocks, size), blocks, args.repeats
                )
                peer_put, peer_get = peer(client, blocks, size, args.repeats)
                client.close()
            finally:
                master.stop()
    for tier, (stored, loaded) in figures.items():
        print(
            f"{tier:9} store {blocks / stored:10,.0f} blocks/s {megabytes / stored:8,.0f} MB/s   "
            f"load {blocks / loaded:10,.0f} blocks/s {megabytes / loaded:8,.0f} MB/s"
        )
    if "mooncake" in figures:
        stored, loaded = figures["mooncake"]
        print(
            f"peer      put   {blocks / peer_put:10,.0f} blocks/s {megabytes / peer_put:8,.0f} MB/s   get  {blocks / peer_get:10,.0f} blocks/s {megabytes / peer_get:8,.0f} MB/s  (Mooncake's client alone)"
        )
    for tier, (stored, loaded) in figures.items():
        print(f"{tier} store blocks/s {blocks / stored:.0f}")
        print(f"{tier} load blocks/s {blocks / loaded:.0f}")
    if "mooncake" in figures:
        stored, loaded = figures["mooncake"]
        print(f"mooncake store ratio {peer_put / stored:.3f}")
        print(f"mooncake load ratio {peer_get / loaded:.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
