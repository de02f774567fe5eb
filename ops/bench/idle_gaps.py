"""Benchmark: what an idle gap before each request costs, the sidecar's step round trip beside the
pure core's work on the same host.

    .venv/bin/python ops/bench/idle_gaps.py [--gap-ms 20] [--requests 100] [--rounds 4] [--commands 4]
        [--trace PATH]

A serving engine talks to kvledger between forward passes: its scheduler's steps and its workers'
reports come some milliseconds apart, and kvledger's processes sleep in between (vLLM on the CPU:
a pass of the vllm_overhead.py workload takes ~10-20 ms). A benchmark that sends steps back to
back (sidecar.py) measures the round trip with every cache warm; this one measures it at a
serving pace too, and the same pacing on the pure core in this process, which does no I/O, as
the peer: where both slow down alike, the host's caches went cold while the process slept, and
no queue or timer of kvledger is in it.

1. core: a CoordinatorCore replays the Mooncake conversation trace as vLLM's offloading manager
   drives it (coordinator.simulator.trace.CoreReplay, tier of 20,000 slots; the first 1,000
   requests shipped with the code unless --trace names the whole trace), `--requests` requests
   back to back, then as many each after a sleep of `--gap-ms`, `--rounds` times in turns; each
   request timed on its own.
2. sidecar: a real `kvledger serve` on a fresh SQLite log and one engine (ops/bench/sidecar.py's
   EngineLoad: steps of `--commands` commands), the same turns of `--requests` steps back to back
   and paced; each step timed from send to reply.

Prints the p50 of each kind in each mode, and ends with plain lines:

    core back-to-back request p50 US us
    core paced request p50 US us
    core paced/back-to-back ratio R
    sidecar back-to-back step p50 MS ms
    sidecar paced step p50 MS ms
    sidecar paced/back-to-back ratio R
"""

from __future__ import annotations

import argparse
import gc
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import anyio  # noqa: E402
import structlog  # noqa: E402
from figures import core_build, load, out, percentile  # noqa: E402
from sidecar import TIER, EngineLoad, declaration, server_output, stop, wait_ready  # noqa: E402

from coordinator.client import Address, EngineClient  # noqa: E402
from coordinator.simulator.trace import SHIPPED_TRACE, CoreReplay, read_trace  # noqa: E402

TRACE_SLOTS = 20_000
WARMUP = 50
"""Requests (and steps) before the first timed turn."""

Turns = dict[str, list[float]]


async def turns(args: argparse.Namespace, one: Callable[[], Awaitable[float]]) -> Turns:
    """WARMUP calls of `one`, then `--rounds` turns of `--requests` calls back to back and as many
    each after a sleep of `--gap-ms`; each call's own seconds (what `one` returns), by mode."""
    for _ in range(WARMUP):
        await one()
    gc.collect()
    timed: Turns = {"back-to-back": [], "paced": []}
    for _ in range(args.rounds):
        for mode, calls in timed.items():
            for _ in range(args.requests):
                if mode == "paced":
                    # The whole process sleeps, as kvledger's do between an engine's passes (a
                    # blocking sleep: no task of this event loop runs meanwhile either).
                    time.sleep(args.gap_ms / 1000)  # noqa: ASYNC251
                calls.append(await one())
    return timed


async def core_turns(args: argparse.Namespace) -> Turns:
    requests = iter(read_trace(args.trace))
    replay = CoreReplay(TRACE_SLOTS)

    async def one() -> float:
        request = next(requests)
        started = time.perf_counter()
        replay.replay(request)
        return time.perf_counter() - started

    return await turns(args, one)


async def sidecar_turns(args: argparse.Namespace, socket_path: str, server: subprocess.Popen[bytes]) -> Turns:
    await wait_ready(server, socket_path)
    engine = EngineLoad("gaps-0", args.commands, 7)
    client = EngineClient(Address(socket_path=socket_path), declaration(engine.engine_id), tiers=[TIER], retry_for=30.0)
    async with client:

        async def one() -> float:
            commands, concern = engine.plan()
            engine.step += 1
            started = time.perf_counter()
            result = await client.step(engine.step, engine.step * 0.01, commands, command_id=engine.next_command_id())
            seconds = time.perf_counter() - started
            engine.follow(result, concern)
            return seconds

        return await turns(args, one)


def run_sidecar(args: argparse.Namespace) -> Turns:
    kvledger = ROOT / ".venv" / "bin" / "kvledger"
    with tempfile.TemporaryDirectory(prefix="kvl-gaps-") as name:
        directory = Path(name)
        socket_path = str(directory / "kvledger.sock")
        output = directory / "serve.log"
        command = [str(kvledger), "serve", "--socket", socket_path, "--log", str(directory / "log.sqlite"), "--http", "off"]
        env = {**os.environ, "KVLEDGER_DATA_DIR": str(directory)}
        with output.open("wb") as sink:
            server = subprocess.Popen(command, env=env, stdout=sink, stderr=subprocess.STDOUT, cwd=ROOT)
        try:
            return anyio.run(sidecar_turns, args, socket_path, server)
        except BaseException:
            print(
                f"idle_gaps.py: the sidecar run failed; kvledger serve's last output:\n{server_output(output)}", file=sys.stderr
            )
            raise
        finally:
            if stop(server) is None:
                server.kill()
                server.wait()


def p50(values: list[float]) -> float:
    return percentile(sorted(values), 0.50)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gap-ms", type=float, default=20.0, help="sleep before each paced request (default 20)")
    parser.add_argument("--requests", type=int, default=100, help="requests (steps) per mode per round (default 100)")
    parser.add_argument("--rounds", type=int, default=4, help="turns of both modes (default 4)")
    parser.add_argument("--commands", type=int, default=4, help="commands per sidecar step (default 4: a vLLM pass's size)")
    parser.add_argument("--trace", type=Path, default=SHIPPED_TRACE, help="a Mooncake trace (default: its first 1,000 requests)")
    args = parser.parse_args()
    if args.gap_ms <= 0 or args.requests < 1 or args.rounds < 1 or args.commands < 1:
        parser.error("--gap-ms, --requests, --rounds and --commands must be positive")
    needed = WARMUP + 2 * args.rounds * args.requests
    available = len(read_trace(args.trace))
    if available < needed:
        parser.error(f"{args.trace} holds {available:,} requests; --rounds and --requests need {needed:,} (pass --trace)")
    # The client's structlog lines (connected, retrying) go to stderr, keeping stdout to the figures.
    structlog.configure(logger_factory=structlog.PrintLoggerFactory(sys.stderr))
    out(f"host: {load()}; gap {args.gap_ms:g} ms, {args.rounds} rounds of {args.requests} requests a mode")
    out(core_build())
    core = anyio.run(core_turns, args)
    sidecar = run_sidecar(args)
    core_fast, core_paced = p50(core["back-to-back"]) * 1e6, p50(core["paced"]) * 1e6
    side_fast, side_paced = p50(sidecar["back-to-back"]) * 1e3, p50(sidecar["paced"]) * 1e3
    out(f"host at end: {load()}")
    out(f"core back-to-back request p50 {core_fast:.0f} us")
    out(f"core paced request p50 {core_paced:.0f} us")
    out(f"core paced/back-to-back ratio {core_paced / core_fast:.2f}")
    out(f"sidecar back-to-back step p50 {side_fast:.2f} ms")
    out(f"sidecar paced step p50 {side_paced:.2f} ms")
    out(f"sidecar paced/back-to-back ratio {side_paced / side_fast:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
