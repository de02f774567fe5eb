"""Run a real vLLM on the tiny local model and record every KV-event frame it publishes.

Run with the vLLM environment (``make vllm-env``), never the project's .venv:

    .venv-vllm/bin/python ops/vllm/probe.py                       # record the fixture
    PYTHONPATH=/dir/of/spec .venv-vllm/bin/python ops/vllm/probe.py --out /tmp/run.frames \\
        --connector-spec DictOffloadingSpec --connector-module dict_offload_spec \\
        --reset-between-rounds                                     # same prompts, a connector

``--connector-module`` is a module *name*: vLLM passes ``spec_module_path`` to
``importlib.import_module`` in the engine-core and worker processes, which inherit PYTHONPATH.

vLLM's ZMQ publisher *connects* its PUB socket to a ``tcp://host:port`` endpoint (it binds only
``*``, ``::``, ipc and inproc endpoints; vllm/distributed/kv_events.py ``_is_bind_endpoint``), so
this script binds a SUB socket there before the engine starts.

Outputs, next to each other:

- ``OUT`` (``*.msgpack-frames``): the raw frames, in the container described in
  tests/fixtures/vllm/README.md: one msgpack array of ``[topic: bin, seq: bin(8), payload: bin]``,
  each exactly as received.
- ``OUT.json``: a decoded summary (each batch, each event, hashes in hex where they are bytes).
- ``OUT.outputs.json``: the prompts' token ids, generated token ids and per-token logprobs, so
  that two runs (say without and with a connector) can be compared.

Prompts share a long prefix (several 32-token blocks) so that BlockStored events chain through
``parent_block_hash`` and later prompts hit the prefix cache; a small KV cache
(``--num-blocks``) makes the engine evict, so BlockRemoved appears; ``reset_prefix_cache`` at the
end gives AllBlocksCleared.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
DEFAULT_OUT = REPO / "tests" / "fixtures" / "vllm" / "kv_events_0_32.msgpack-frames"

sys.path.insert(0, str(HERE))
from tiny_model import PROMPT_PREFIX as PREFIX  # noqa: E402 - the prompts both scripts send
from tiny_model import PROMPT_TAILS as TAILS  # noqa: E402


def _hexify(value: Any) -> Any:
    """JSON-friendly copy of a decoded msgpack value: bytes become ``{"hex": ...}``."""
    if isinstance(value, bytes):
        return {"hex": value.hex()}
    if isinstance(value, (list, tuple)):
        return [_hexify(item) for item in value]
    if isinstance(value, dict):
        return {str(_hexify(key)): _hexify(item) for key, item in value.items()}
    return value


class FrameRecorder:
    """Binds a SUB socket and collects multipart frames in a thread until stopped."""

    def __init__(self, endpoint: str, topic: str) -> None:
        import zmq

        self._zmq = zmq
        self._context = zmq.Context()
        self._socket = self._context.socket(zmq.SUB)
        self._socket.setsockopt(zmq.SUBSCRIBE, topic.encode())
        self._socket.bind(endpoint)
        self.frames: list[list[bytes]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kv-event-recorder", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        poller = self._zmq.Poller()
        poller.register(self._socket, self._zmq.POLLIN)
        while not self._stop.is_set():
            if poller.poll(100):
                self.frames.append(self._socket.recv_multipart())

    def wait_quiet(self, quiet_s: float = 1.5, limit_s: float = 15.0) -> None:
        """Return once no frame has arrived for ``quiet_s`` (the publisher thread is async)."""
        deadline = time.monotonic() + limit_s
        seen, since = len(self.frames), time.monotonic()
        while time.monotonic() < deadline:
            time.sleep(0.1)
            if len(self.frames) != seen:
                seen, since = len(self.frames), time.monotonic()
            elif time.monotonic() - since >= quiet_s:
                return

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        self._socket.close(linger=0)
        self._context.term()


def summarize(frames: list[list[bytes]]) -> dict[str, Any]:
    """Decode each frame with plain msgpack (not vLLM's classes): the wire shape, as a consumer
    that does not import vLLM sees it."""
    import msgpack

    batches = []
    event_types: dict[str, int] = {}
    hash_types: set[str] = set()
    field_names: dict[str, set[str]] = {}
    for frame in frames:
        if len(frame) != 3:
            batches.append({"malformed_frame_parts": len(frame)})
            continue
        topic, seq_bytes, payload = frame
        batch = msgpack.unpackb(payload, raw=False, strict_map_key=False)
        # EventBatch is array_like: [ts, events, data_parallel_rank]; omit_defaults may drop the
        # trailing rank when it is None.
        ts, events = batch[0], batch[1]
        rank = batch[2] if len(batch) > 2 else None
        for event in events:
            kind = event["type"] if isinstance(event, dict) else f"array:{event[0]}"
            event_types[kind] = event_types.get(kind, 0) + 1
            if isinstance(event, dict):
                field_names.setdefault(kind, set()).update(event)
                for block_hash in event.get("block_hashes", []) + [event.get("parent_block_hash")]:
                    if block_hash is not None:
                        hash_types.add(type(block_hash).__name__)
        batches.append(
            {
                "topic": topic.decode(),
                "seq": int.from_bytes(seq_bytes, "big", signed=True),
                "payload_len": len(payload),
                "batch_array_len": len(batch),
                "ts": ts,
                "data_parallel_rank": rank,
                "events": _hexify(events),
            }
        )
    return {
        "frames": len(frames),
        "event_types": event_types,
        "event_fields": {kind: sorted(names) for kind, names in field_names.items()},
        "hash_python_types": sorted(hash_types),
        "batches": batches,
    }


def request_replay(endpoint: str, start_seq: int, limit_s: float = 10.0) -> list[list[bytes]]:
    """Ask vLLM's ROUTER replay socket for every buffered batch from ``start_seq`` on.

    The request is ``[b"", start_seq as 8-byte big-endian]`` from a DEALER (vLLM expects the
    ROUTER's three parts: identity, empty delimiter, seq). Each reply arrives as
    ``[b"", topic, seq, payload]``; the end marker is ``[b"", b"", seq=-1, b""]``. The frames are
    returned as received, end marker included.
    """
    import zmq

    context = zmq.Context()
    socket = context.socket(zmq.DEALER)
    socket.connect(endpoint)
    socket.send_multipart([b"", start_seq.to_bytes(8, "big")])
    frames: list[list[bytes]] = []
    deadline = time.monotonic() + limit_s
    try:
        while time.monotonic() < deadline:
            if not socket.poll(200):
                continue
            frame = socket.recv_multipart()
            frames.append(frame)
            if len(frame) == 4 and int.from_bytes(frame[2], "big", signed=True) == -1:
                break
    finally:
        socket.close(linger=0)
        context.term()
    return frames


def write_frames(path: Path, frames: list[list[bytes]]) -> None:
    import msgpack

    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(msgpack.packb([list(frame) for frame in frames], use_bin_type=True))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--model",
        type=Path,
        default=Path("/tmp/kvledger-tiny-llama"),
        help="tiny model directory; built by tiny_model.py if missing",
    )
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--port", type=int, default=5599)
    parser.add_argument("--topic", default="kv")
    parser.add_argument(
        "--replay-port", type=int, default=None, help="vLLM binds its ROUTER replay socket here (default: --port + 1)"
    )
    parser.add_argument("--block-size", type=int, default=32)
    parser.add_argument("--num-blocks", type=int, default=8, help="num_gpu_blocks_override: small, so that the engine evicts")
    parser.add_argument("--max-tokens", type=int, default=12)
    parser.add_argument("--rounds", type=int, default=2, help="how many times the prompt list is sent, one prompt at a time")
    parser.add_argument(
        "--reset-between-rounds",
        action="store_true",
        help="reset_prefix_cache() between rounds: later rounds must come from the connector (or be recomputed, without one)",
    )
    parser.add_argument("--connector-spec", default=None, help="OffloadingConnector spec class name (with --connector-module)")
    parser.add_argument("--connector-module", default=None, help="importable module name holding the spec (spec_module_path)")
    parser.add_argument("--connector-extra", default="{}", help="JSON merged into kv_connector_extra_config")
    parser.add_argument("--no-events", action="store_true", help="run without KV events")
    parser.add_argument(
        "--no-prefix-caching", action="store_true", help="a truly cold engine: every prompt computed from scratch"
    )
    args = parser.parse_args()

    # vLLM's CPU backend reserves one core for the engine-core process, and one MORE when any
    # kv_transfer_config is set (vllm/v1/worker/cpu/ompmultiprocessing.py, "for nixl_connector").
    # On a 2-core machine the second reservation cannot be met, so a run with a connector gets 2
    # OpenMP threads and a run without gets 1: their float reductions differ (logprobs by ~3e-6)
    # although no KV was loaded. Pinning the reservation makes the two runs comparable bit for bit.
    os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "1")

    sys.path.insert(0, str(HERE))
    import tiny_model

    if not (args.model / "config.json").exists():
        tiny_model.build(args.model)

    from vllm import LLM, SamplingParams
    from vllm.config import KVEventsConfig, KVTransferConfig

    endpoint = f"tcp://127.0.0.1:{args.port}"
    replay_endpoint = f"tcp://127.0.0.1:{args.replay_port or args.port + 1}"
    recorder = None if args.no_events else FrameRecorder(endpoint, args.topic)
    engine_args: dict[str, Any] = dict(
        model=str(args.model),
        tokenizer=str(args.model),
        dtype="float32",
        block_size=args.block_size,
        # One block is vLLM's null block, never handed to a request.
        max_model_len=(args.num_blocks - 1) * args.block_size,
        max_num_seqs=4,
        num_gpu_blocks_override=args.num_blocks,
        kv_cache_memory_bytes=64 * 1024 * 1024,
        enable_prefix_caching=not args.no_prefix_caching,
        enforce_eager=True,
        seed=0,
    )
    if recorder is not None:
        engine_args["kv_events_config"] = KVEventsConfig(
            enable_kv_cache_events=True,
            publisher="zmq",
            endpoint=endpoint,
            replay_endpoint=replay_endpoint,
            topic=args.topic,
        )
    if args.connector_spec:
        extra: dict[str, Any] = {"spec_name": args.connector_spec}
        if args.connector_module:
            extra["spec_module_path"] = args.connector_module
        extra.update(json.loads(args.connector_extra))
        connector: dict[str, Any] = {"kv_connector": "OffloadingConnector"}
        if args.connector_spec == "KvledgerOffloadingSpec":  # runs only under kvledger's connector
            connector = {
                "kv_connector": "KvledgerOffloadingConnector",
                "kv_connector_module_path": "coordinator.vllm.connector",
                "kv_load_failure_policy": "recompute",
            }
        engine_args["kv_transfer_config"] = KVTransferConfig(**connector, kv_role="kv_both", kv_connector_extra_config=extra)

    started = time.monotonic()
    llm = LLM(**engine_args)
    print(f"probe: engine up in {time.monotonic() - started:.1f} s", flush=True)

    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, logprobs=0, seed=0)
    prompts = [PREFIX + tail for tail in TAILS]
    results = []
    for round_index in range(args.rounds):
        if round_index and args.reset_between_rounds:
            llm.reset_prefix_cache()
        # One prompt at a time: each step's events then belong to one request, and with a small
        # cache each prompt evicts some blocks of the one before.
        for prompt_index, prompt in enumerate(prompts):
            (output,) = llm.generate([prompt], params, use_tqdm=False)
            completion = output.outputs[0]
            results.append(
                {
                    "round": round_index,
                    "prompt": prompt_index,
                    "prompt_token_ids": output.prompt_token_ids,
                    "num_cached_tokens": output.num_cached_tokens,
                    "token_ids": list(completion.token_ids),
                    "logprobs": [step[token].logprob for step, token in zip(completion.logprobs or [], completion.token_ids)],
                }
            )
    llm.reset_prefix_cache()
    # One more request after the reset: its stores follow AllBlocksCleared in the log.
    llm.generate([prompts[0]], params, use_tqdm=False)

    frames: list[list[bytes]] = []
    replayed: list[list[bytes]] = []
    if recorder is not None:
        recorder.wait_quiet()
        frames = recorder.frames
        replayed = request_replay(replay_endpoint, start_seq=0)
    llm.llm_engine.engine_core.shutdown()
    if recorder is not None:
        recorder.close()

    if frames:
        write_frames(args.out, frames)
    if replayed:
        write_frames(Path(f"{args.out}.replay"), replayed)
    summary = summarize(frames)
    live = {frame[1]: frame[2] for frame in frames if len(frame) == 3}
    summary["replay"] = {
        "frames": len(replayed),
        "end_marker": [part.hex() for part in replayed[-1]] if replayed else None,
        "payloads_equal_live": all(live.get(frame[2]) == frame[3] for frame in replayed[:-1] if len(frame) == 4),
    }
    summary["engine"] = {key: str(value) for key, value in engine_args.items() if key not in ("model", "tokenizer")}
    summary["env"] = {
        "VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES": os.environ.get("VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES", "(unset: 1)"),
        "VLLM_CPU_NUM_OF_RESERVED_CPU": os.environ["VLLM_CPU_NUM_OF_RESERVED_CPU"],
    }
    Path(f"{args.out}.json").write_text(json.dumps(summary, indent=1) + "\n")
    Path(f"{args.out}.outputs.json").write_text(json.dumps(results, indent=1) + "\n")
    print(
        f"probe: {len(frames)} frames, event types {summary['event_types']}, "
        f"hash types {summary['hash_python_types']}; "
        f"cached tokens per request {[r['num_cached_tokens'] for r in results]}; "
        f"replay {summary['replay']}; wrote {args.out}(.json, .outputs.json, .replay)",
        flush=True,
    )


if __name__ == "__main__":
    main()
