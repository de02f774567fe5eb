"""Benchmark: a production request trace replayed through kvledger, as vLLM's offloading manager drives it.

    .venv/bin/python ops/bench/trace.py --trace ../shared/traces/mooncake_conversation_trace.jsonl \\
        --slots 20000 [--engines 2] [--limit N] [--core-only] [--log PATH]

The trace is Mooncake's format (../shared/traces/README.md: one JSON request a line, `hash_ids`
the prompt's chained prefix blocks of 512 tokens); any trace of this format works. Each request,
in timestamp order, looks its key chain up to the first miss, loads the hit prefix and stores the
chain on a tier of `--slots` slots (coordinator/simulator/trace.py says exactly how), dealt
round-robin to `--engines` engines of one namespace sharing the tier.

1. Through the pure core (CoordinatorCore, in this process): the hit blocks and hit rate, and
   requests, decisions (lookups, loads, stores, reports) and blocks a second.
2. Unless `--core-only`, through a real `kvledger serve` (a temporary directory, SQLite, its log
   at `--log` if given): each engine an EngineClient and its rank a WorkerClient over the Unix
   socket; per request a LookupKeys, one Step (load and store), the rank's Reports. Requests go
   one after another, in the trace's order, so the sidecar must hit exactly the core's blocks
   (printed: equal or DIFFERENT). Also the step latency (send to reply) p50 and p99, and the
   same rates; the peer in the same run is the pure core's rate (`sidecar/core ratio`).

Beside the core, the same requests go through a reference LRU with no kvledger in it
(coordinator.simulator.trace.LruTier: the hit blocks must be equal; its blocks/s is printed
beside the core's). Ends with plain lines: `hit blocks N` (the pure core's), `hit rate X`,
`reference hit blocks N`, `core N blocks/s`, and for the sidecar run
`sidecar hit blocks N` and `sidecar/core ratio X` (decisions a second).
"""

from __future__ import annotations

import argparse
import gc
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import anyio  # noqa: E402
import structlog  # noqa: E402
from figures import console, core_build, load, out, percentile  # noqa: E402
from sidecar import server_output, stop, wait_ready  # noqa: E402

from coordinator.client import Address, EngineClient, WorkerClient  # noqa: E402
from coordinator.simulator.trace import (  # noqa: E402
    TIER,
    CoreReplay,
    LruTier,
    Tally,
    TraceError,
    TraceRequest,
    block_keys,
    declaration,
    outcome,
    plan,
    read_trace,
    tier_spec,
)

DEFAULT_TRACE = ROOT.parent / "shared" / "traces" / "mooncake_conversation_trace.jsonl"
PROGRESS_EVERY = 1000


def rates(name: str, tally: Tally, seconds: float) -> None:
    rate = tally.hit_blocks / tally.blocks if tally.blocks else 0.0
    out(
        f"{name}: {tally.requests:,} requests, hit blocks {tally.hit_blocks:,} of {tally.blocks:,} (hit rate {rate:.4f}), "
        f"{tally.stored_blocks:,} blocks stored, {tally.refused_stores:,} stores refused (tier full) in {seconds:.2f} s: "
        f"{tally.requests / seconds:,.0f} requests/s, {tally.decisions / seconds:,.0f} decisions/s, "
        f"{tally.blocks / seconds:,.0f} blocks/s"
    )


def core_run(requests: list[TraceRequest], slots: int, engines: int) -> tuple[CoreReplay, float]:
    replay = CoreReplay(slots, engines)
    # The declaration's columns (a 1M-block pool, the tier's) are new objects the cyclic GC would
    # otherwise walk at its first collections, inside the timed loop: ~7% of the instructions of
    # 3,000 requests (callgrind). Walked here, once, as a long-running sidecar walked them long ago.
    gc.collect()
    started = time.perf_counter()
    for index, request in enumerate(requests, 1):
        replay.replay(request)
        if index % PROGRESS_EVERY == 0:
            console.print(f"core: {index:,} of {len(requests):,} requests")
    seconds = time.perf_counter() - started
    rates("core", replay, seconds)
    return replay, seconds


async def sidecar_replay(socket: str, requests: list[TraceRequest], slots: int, engines: int) -> tuple[Tally, float, list[float]]:
    address = Address(socket_path=socket)
    names = [f"trace-{n}" for n in range(engines)]
    tally = Tally()
    latencies: list[float] = []
    clients = [EngineClient(address, declaration(name), tiers=[tier_spec(slots)]) for name in names]
    workers = [WorkerClient(address, name, 0) for name in names]
    steps = dict.fromkeys(names, 0)
    try:
        for client in clients:
            await client.connect()
        started = time.perf_counter()
        for index, request in enumerate(requests):
            engine = index % engines
            client, worker, name = clients[engine], workers[engine], names[engine]
            keys = block_keys(request.hash_ids)
            answer = (await client.lookup_keys(TIER, keys)).answer
            if not hasattr(answer, "loadable"):
                raise RuntimeError(f"request {index}: the lookup was refused: {answer}")
            hit, commands = plan(name, keys, answer.loadable)  # type: ignore[union-attr]
            steps[name] += 1
            sent = time.perf_counter()
            result = await client.step(steps[name], request.timestamp / 1000, commands)
            latencies.append(time.perf_counter() - sent)
            decided = outcome([event for events in result.results for event in events])
            for report in decided.reports:
                await worker.report(report)
            tally.count(len(keys), hit, len(commands), decided)
            if (index + 1) % PROGRESS_EVERY == 0:
                console.print(f"sidecar: {index + 1:,} of {len(requests):,} requests")
        return tally, time.perf_counter() - started, latencies
    finally:
        for worker in workers:
            await worker.aclose()
        for client in clients:
            await client.aclose()


def sidecar_run(args: argparse.Namespace, requests: list[TraceRequest], directory: Path) -> tuple[Tally, float] | None:
    socket = str(directory / "kvledger.sock")
    log_path = args.log or directory / "log.sqlite"
    output = directory / "serve.log"
    command = [
        str(Path(sys.executable).parent / "kvledger"),
        "serve",
        "--socket",
        socket,
        "--log",
        str(log_path),
        "--http",
        "off",
    ]
    with output.open("wb") as sink:
        server = subprocess.Popen(
            command, env={**os.environ, "KVLEDGER_DATA_DIR": str(directory)}, stdout=sink, stderr=subprocess.STDOUT, cwd=ROOT
        )
    try:

        async def run() -> tuple[Tally, float, list[float]]:
            await wait_ready(server, socket)
            return await sidecar_replay(socket, requests, args.slots, args.engines)

        tally, seconds, latencies = anyio.run(run)
    except BaseException:
        console.print(f"the sidecar run failed; kvledger serve's last output:\n{server_output(output)}")
        raise
    finally:
        code = stop(server)
        out(f"sidecar exit code after SIGTERM: {code} ({'clean' if code == 0 else 'NOT clean'})")
    rates("sidecar", tally, seconds)
    ordered = sorted(latencies)
    out(
        f"sidecar step latency (load and store, send to reply): p50 {percentile(ordered, 0.50) * 1e3:.2f} ms, "
        f"p99 {percentile(ordered, 0.99) * 1e3:.2f} ms over {len(ordered):,} steps; log {log_path}"
    )
    return tally, seconds


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trace", type=Path, default=DEFAULT_TRACE, help=f"a trace file (default {DEFAULT_TRACE})")
    parser.add_argument("--slots", type=int, required=True, help="tier slots (one 512-token block each)")
    parser.add_argument("--engines", type=int, default=1, help="engines sharing the tier, requests dealt round-robin")
    parser.add_argument("--limit", type=int, default=0, help="replay only the first N requests (default: all)")
    parser.add_argument("--core-only", action="store_true", help="the pure core only, no sidecar")
    parser.add_argument("--log", type=Path, default=None, help="where the sidecar run's SQLite log goes (kept)")
    args = parser.parse_args()
    if args.slots < 1 or args.engines < 1 or args.limit < 0:
        parser.error("--slots and --engines must be positive, --limit not negative")
    structlog.configure(logger_factory=structlog.PrintLoggerFactory(sys.stderr))
    try:
        requests = read_trace(args.trace)
    except (OSError, TraceError) as error:
        print(f"trace: {error}", file=sys.stderr)
        return 2
    if args.limit:
        requests = requests[: args.limit]
    out(f"host at start: {load()}")
    out(core_build())
    out(
        f"trace {args.trace.name}: {len(requests):,} requests, {sum(len(r.hash_ids) for r in requests):,} blocks; "
        f"tier {args.slots:,} slots; {args.engines} engine(s)"
    )
    core, core_seconds = core_run(requests, args.slots, args.engines)
    reference, started = LruTier(args.slots), time.perf_counter()
    for request in requests:
        reference.replay(request)
    reference_seconds = time.perf_counter() - started
    agrees = (reference.hit_blocks, reference.refused_stores) == (core.hit_blocks, core.refused_stores)
    out(
        f"reference LRU (coordinator.simulator.trace.LruTier, no kvledger in it): hit blocks {reference.hit_blocks:,}, "
        f"{reference.refused_stores:,} stores refused, in {reference_seconds:.2f} s "
        f"({core.blocks / reference_seconds:,.0f} blocks/s; the core: {core.blocks / core_seconds:,.0f})"
    )
    sidecar = None
    if not args.core_only:
        with tempfile.TemporaryDirectory(prefix="kvl-trace-bench-") as name:
            sidecar = sidecar_run(args, requests, Path(name))
    out(f"host at end: {load()}")
    out(f"hit blocks {core.hit_blocks}")
    out(f"hit rate {core.hit_blocks / core.blocks if core.blocks else 0.0:.4f}")
    out(f"reference hit blocks {reference.hit_blocks} ({'equal to' if agrees else 'DIFFERENT from'} the core's)")
    out(f"core {core.blocks / core_seconds:.0f} blocks/s")
    if sidecar is None:
        return 0 if agrees else 1
    tally, seconds = sidecar
    same = tally.hit_blocks == core.hit_blocks and tally.refused_stores == core.refused_stores
    out(f"sidecar hit blocks {tally.hit_blocks} ({'equal to' if same else 'DIFFERENT from'} the core's)")
    out(f"sidecar/core ratio {(tally.decisions / seconds) / (core.decisions / core_seconds):.3f}")
    return 0 if same and agrees else 1


if __name__ == "__main__":
    sys.exit(main())
