"""Prove on a live vLLM that kvledger as its offloading spec changes nothing in what it generates.

Run with the vLLM environment (ops/vllm/setup.sh), never the project's .venv:

    .venv-vllm/bin/python ops/vllm/prove.py --out /tmp/prove.json

It builds the tiny local model (tiny_model.py) in a temporary directory, then runs the same
prompts twice, each engine in a child process of its own:

* COLD: no connector and prefix caching off: every prompt computed from scratch;
* KVLEDGER: coordinator.vllm.connector.KvledgerOffloadingConnector (vLLM's OffloadingConnector
  with coordinator.vllm.offload.KvledgerOffloadingSpec, kv_load_failure_policy "recompute")
  against a `kvledger serve` started here from the project's venv (KVLEDGER, default
  .venv/bin/kvledger) on a temporary SQLite log, the tier in files (kvledger_tier_dir). The
  engine's own cache is small (num_gpu_blocks_override) and its prefix cache is reset between
  rounds, so later rounds get their prefix blocks back from kvledger's tier (stores in round 0,
  loads after). With --mooncake MASTER,METADATA_URL the tier is a Mooncake Store instead
  (kvledger_mooncake, gpu/mooncake.py: issue 21, item 3), every worker rank a client of it.

Before round --corrupt-round (default 2 of 4; 0: never) the engine's process flips the bytes of
one tier file (or Mooncake object): the middle key of the first load job (read from the log with `kvledger export`), a
key that round's first prompt loads again. The worker must refuse that load, vLLM recompute it,
and that round and the next (whose lookups must miss the quarantined key and still load the keys
before it) generate exactly what the cold run generates.

The JSON result holds, per run and prompt, the prompt's token ids, the generated token ids, the
per-token logprobs and vLLM's num_cached_tokens, plus the log's path, what was corrupted (the tier
key, the file, the log's last global sequence before) and the times: the test
(tests/vllm/test_vllm_live.py) compares the runs and reads the log.

VLLM_CPU_NUM_OF_RESERVED_CPU=1 is set for both runs: with a connector vLLM reserves one more CPU
core, which on a small machine changes the worker's thread count and so the float reductions
(logprobs differ by ~3e-6 with no KV loaded at all; ops/vllm/API_NOTES.md section 5).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent

sys.path.insert(0, str(HERE))
from serving import DEFAULT_KVLEDGER, kvledger_serve  # noqa: E402
from tiny_model import PROMPT_PREFIX as PREFIX  # noqa: E402 - the prompts both scripts send
from tiny_model import PROMPT_TAILS as TAILS  # noqa: E402


def digest(path: Path) -> str:
    return "sha256:" + hashlib.sha256(path.read_bytes()).hexdigest()


def namespace_of(model: Path, block_size: int, groups: int = 1) -> dict[str, Any]:
    """What the engine is declared to run: digests of the exact weights and tokenizer files."""
    return {
        "model_id": "kvledger-tiny-llama",
        "weights_revision": digest(model / "model.safetensors"),
        "tokenizer_digest": digest(model / "tokenizer.json"),
        "kv_dtype": "float32",
        "block_sizes": [block_size] * groups,
        "tenant": "prove",
        "hash_algorithm": "vllm:sha256",
    }


def corrupt_a_loaded_key(args: argparse.Namespace) -> dict[str, Any]:
    """Flip every byte of one published key's tier file (same size: a checksum mismatch, not a
    missing file): the middle key of the first load job, which the next round loads again."""
    export = subprocess.run([str(args.kvledger), "export", "--log", str(args.log)], capture_output=True, check=True)
    lines = [json.loads(line) for line in export.stdout.splitlines() if line.strip()]
    load = next(line for line in lines if line["type"] == "external_load_started")
    items = load["event"]["items"]  # ExternalItem, array-like: [pool_id, engine_key, key, slot, generation, checksums]
    _, _, key, slot, generation, _ = items[len(items) // 2]
    # With tensor parallelism, the last rank's shard only: one rank's failed verification must
    # refuse the load for every rank (vLLM unions the ranks' invalid blocks).
    rank = args.tensor_parallel_size - 1
    if args.mooncake:
        path, size = corrupt_an_object(args.mooncake, load["event"]["tier"], bytes.fromhex(key), slot, generation, rank)
    else:
        where = Path(args.tier_dir) / f"rank-{rank}" / f"{key}.kv"
        data = where.read_bytes()
        where.write_bytes(bytes(byte ^ 0xFF for byte in data))
        path, size = str(where), len(data)
    print(f"prove: corrupted tier key {key} ({path}, {size} bytes) of load job {load['event']['job_id']}", flush=True)
    return {
        "key": key,
        "path": str(path),
        "load_job": load["event"]["job_id"],
        "last_seq": max(line["seq"] for line in lines),
        "round": args.corrupt_round,
    }


CORRUPTING_CLIENTS: list[Any] = []
"""The Mooncake client that put a corrupted object holds it in its segment: kept for the run."""


def corrupt_an_object(mooncake: str, tier: str, key: bytes, slot: int, generation: int, rank: int) -> tuple[str, int]:
    """The Mooncake tier's object of (key, slot, generation, rank), replaced by its bytes flipped
    (same size): Mooncake keeps an existing name's first value, so it is removed first (forced:
    a get's lease may still hold it). Returns (the object's name, its size)."""
    from gpu.mooncake import MooncakeTier, connect

    master, metadata_url = mooncake.split(",", 1)
    client = connect(master, metadata_url)
    CORRUPTING_CLIENTS.append(client)
    name = MooncakeTier(tier, client, rank=rank, device=None).object_name(key, slot, generation)
    data = client.get(name)
    if not data:
        raise SystemExit(f"prove: Mooncake has no object {name} to corrupt")
    removed = client.remove(name, True)
    put = client.put(name, bytes(byte ^ 0xFF for byte in data))
    if removed != 0 or put != 0 or client.get(name) != bytes(byte ^ 0xFF for byte in data):
        raise SystemExit(f"prove: could not replace Mooncake object {name} (remove {removed}, put {put})")
    return name, len(data)


def thread_binding(ranks: int) -> str:
    """VLLM_CPU_OMP_THREADS_BIND for `ranks` ranks: this process's cores split evenly, "0|1"."""
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < ranks:
        raise SystemExit(f"prove: {ranks} tensor-parallel ranks need a core each; this process may use {len(cores)}")
    per = len(cores) // ranks
    return "|".join(",".join(str(c) for c in cores[r * per : (r + 1) * per]) for r in range(ranks))


def run_engine(args: argparse.Namespace) -> None:
    """One engine (the child process): generate every round, write the outputs as JSON."""
    os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "1")
    if args.tensor_parallel_size > 1:
        # vllm-cpu binds each rank's threads to a NUMA node of its own, and a small machine has
        # one ("Not enough allowed NUMA nodes to bind threads of 2 local CPUWorkers"): bind each
        # rank to its own cores instead.
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", thread_binding(args.tensor_parallel_size))
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    engine_args: dict[str, Any] = dict(
        model=str(args.model),
        tokenizer=str(args.model),
        dtype="float32",
        block_size=args.block_size,
        # One block is vLLM's null block; a hybrid model's two groups share the engine's blocks.
        max_model_len=(args.num_blocks // (2 if args.hybrid else 1) - 1) * args.block_size,
        max_num_seqs=4,
        num_gpu_blocks_override=args.num_blocks,
        kv_cache_memory_bytes=64 * 1024 * 1024,
        enforce_eager=True,
        seed=0,
        tensor_parallel_size=args.tensor_parallel_size,
    )
    if args.tensor_parallel_size > 1:
        engine_args["distributed_executor_backend"] = "mp"
    if args.phase == "cold":
        engine_args["enable_prefix_caching"] = False
    else:
        extra = {
            "spec_name": "KvledgerOffloadingSpec",
            "spec_module_path": "coordinator.vllm.offload",
            "kvledger_socket": args.socket,
            "kvledger_namespace": namespace_of(args.model, args.block_size, 2 if args.hybrid else 1),
            "kvledger_tier_slots": args.tier_slots,
        }
        if args.mooncake:
            master, metadata_url = args.mooncake.split(",", 1)
            extra["kvledger_mooncake"] = {"master": master, "metadata_url": metadata_url}
        else:
            extra["kvledger_tier_dir"] = str(args.tier_dir)
        engine_args["enable_prefix_caching"] = True
        engine_args["kv_transfer_config"] = KVTransferConfig(
            kv_connector="KvledgerOffloadingConnector",
            kv_connector_module_path="coordinator.vllm.connector",
            kv_role="kv_both",
            kv_load_failure_policy="recompute",
            kv_connector_extra_config=extra,
        )
    started = time.monotonic()
    llm = LLM(**engine_args)
    up = time.monotonic() - started
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, logprobs=0, seed=0)
    results = []
    corrupted = None
    for round_index in range(args.rounds):
        if round_index and args.phase == "kvledger":
            # Drops the engine's own prefix cache only (reset_connector=False): the blocks must
            # come back from kvledger's tier.
            llm.reset_prefix_cache()
            if round_index == args.corrupt_round:
                corrupted = corrupt_a_loaded_key(args)
        for prompt_index, tail in enumerate(TAILS):
            (output,) = llm.generate([PREFIX + tail], params, use_tqdm=False)
            completion = output.outputs[0]
            results.append(
                {
                    "round": round_index,
                    "prompt": prompt_index,
                    "prompt_token_ids": list(output.prompt_token_ids or []),
                    "num_cached_tokens": output.num_cached_tokens,
                    "token_ids": list(completion.token_ids),
                    "logprobs": [step[token].logprob for step, token in zip(completion.logprobs or [], completion.token_ids)],
                }
            )
    reset = None
    if args.phase == "kvledger":
        # vLLM #57727: the reset must reach the tier. After it, nothing comes back from kvledger:
        # the first prompt computes from scratch (the engine's own cache was reset too).
        reset_ok = llm.reset_prefix_cache(reset_connector=True)
        after = []
        for prompt_index, tail in enumerate(TAILS):
            (output,) = llm.generate([PREFIX + tail], params, use_tqdm=False)
            after.append({"prompt": prompt_index, "num_cached_tokens": output.num_cached_tokens})
        reset = {"ok": bool(reset_ok), "after": after}
    llm.llm_engine.engine_core.shutdown()
    Path(args.out).write_text(
        json.dumps(
            {"engine_up_s": up, "total_s": time.monotonic() - started, "results": results, "corrupted": corrupted, "reset": reset}
        )
        + "\n"
    )


def child(args: argparse.Namespace, phase: str, out: Path, socket: Path | None, timeout_s: float) -> dict[str, Any]:
    command = (
        [
            sys.executable,
            __file__,
            "--phase",
            phase,
            "--model",
            str(args.model),
            "--out",
            str(out),
            "--num-blocks",
            str(args.num_blocks),
            "--block-size",
            str(args.block_size),
            "--max-tokens",
            str(args.max_tokens),
            "--rounds",
            str(args.rounds),
            "--tier-slots",
            str(args.tier_slots),
            "--corrupt-round",
            str(args.corrupt_round),
            "--kvledger",
            str(args.kvledger),
            "--tensor-parallel-size",
            str(args.tensor_parallel_size),
        ]
        + (["--hybrid"] if args.hybrid else [])
        + (["--mooncake", args.mooncake] if args.mooncake else [])
    )
    if socket is not None:
        command += ["--socket", str(socket), "--log", str(args.log), "--tier-dir", str(args.tier_dir)]
    started = time.monotonic()
    done = subprocess.run(command, timeout=timeout_s, check=False)
    if done.returncode != 0:
        raise SystemExit(f"prove: the {phase} engine exited with {done.returncode}")
    result: dict[str, Any] = json.loads(out.read_text())
    result["wall_s"] = time.monotonic() - started
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="where the JSON result goes")
    parser.add_argument("--workdir", type=Path, default=None, help="keep the model, log and outputs here")
    parser.add_argument(
        "--kvledger", type=Path, default=DEFAULT_KVLEDGER, help="the project's kvledger command (its own venv, not this one)"
    )
    parser.add_argument("--model", type=Path, default=None, help="tiny model directory (built when missing)")
    parser.add_argument(
        "--num-blocks", type=int, default=None, help="num_gpu_blocks_override: small, so vLLM evicts (default 8; hybrid 16)"
    )
    parser.add_argument("--block-size", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=12)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument(
        "--corrupt-round", type=int, default=2, help="corrupt one loaded key's tier file before this round (0: never)"
    )
    parser.add_argument("--tier-slots", type=int, default=64)
    parser.add_argument("--engine-timeout", type=float, default=300.0, help="seconds per engine child")
    parser.add_argument(
        "--hybrid",
        action="store_true",
        help="a tiny model of a sliding-window and a full-attention layer: two KV-cache groups",
    )
    parser.add_argument(
        "--tensor-parallel-size", type=int, default=1, help="TP ranks (vllm-cpu: block sizes a multiple of 32; one core a rank)"
    )
    parser.add_argument(
        "--mooncake",
        default="",
        metavar="MASTER,METADATA_URL",
        help="the tier in a Mooncake Store (kvledger_mooncake) whose master is MASTER (host:port) and metadata "
        "server METADATA_URL, instead of files; the corrupted tier key is then an object replaced in the store",
    )
    parser.add_argument("--phase", choices=["cold", "kvledger"], default=None, help=argparse.SUPPRESS)
    parser.add_argument("--socket", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--log", type=Path, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--tier-dir", type=Path, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.num_blocks is None:
        args.num_blocks = 16 if args.hybrid else 8
    if args.phase is not None:
        run_engine(args)
        return

    started = time.monotonic()
    keep = args.workdir is not None
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="kvl-prove-"))
    workdir.mkdir(parents=True, exist_ok=True)
    if args.model is None:
        args.model = workdir / "model"
    if not (args.model / "config.json").exists():
        sys.path.insert(0, str(HERE))
        import tiny_model

        # One KV head a rank: each rank's shard of a block is its own (a single head is replicated).
        tiny_model.build(args.model, args.hybrid, kv_heads=max(1, args.tensor_parallel_size))
    log_path = args.log = workdir / "log.sqlite"
    log_path.unlink(missing_ok=True)
    args.tier_dir = workdir / "tier"
    shutil.rmtree(args.tier_dir, ignore_errors=True)

    cold = child(args, "cold", workdir / "cold.json", None, args.engine_timeout)
    print(f"prove: cold run done in {cold['wall_s']:.1f} s", flush=True)

    with kvledger_serve(args.kvledger, log_path, workdir / "sidecar.log", who="prove") as sidecar:
        cached = child(args, "kvledger", workdir / "kvledger.json", sidecar.socket, args.engine_timeout)
        print(f"prove: kvledger run done in {cached['wall_s']:.1f} s", flush=True)

    result = {
        "cold": cold["results"],
        "kvledger": cached["results"],
        "log": str(log_path),
        "corrupted": cached["corrupted"],
        "reset": cached["reset"],
        "tier_dir": "" if args.mooncake else str(args.tier_dir),
        "mooncake": args.mooncake,
        "sidecar_log": str(workdir / "sidecar.log"),
        "sidecar_exit": sidecar.exit_code,
        "workdir": str(workdir),
        "kept": keep,
        "namespace": namespace_of(args.model, args.block_size, 2 if args.hybrid else 1),
        "hybrid": args.hybrid,
        "tensor_parallel_size": args.tensor_parallel_size,
        "seconds": {
            "cold": cold["wall_s"],
            "kvledger": cached["wall_s"],
            "total": time.monotonic() - started,
            "engine_up_cold": cold["engine_up_s"],
            "engine_up_kvledger": cached["engine_up_s"],
        },
    }
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    same = [
        a["token_ids"] == b["token_ids"] and a["logprobs"] == b["logprobs"]
        for a, b in zip(result["cold"], result["kvledger"], strict=True)
    ]
    print(
        f"prove: {sum(same)}/{len(same)} generations equal to the cold run; cached tokens per request "
        f"{[r['num_cached_tokens'] for r in result['kvledger']]}; log {log_path}; wrote {args.out}",
        flush=True,
    )


if __name__ == "__main__":
    main()
