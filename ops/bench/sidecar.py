"""Benchmark: the sidecar's step latency and sustained event rate, over its Unix socket, on SQLite, PostgreSQL or Kafka.

    .venv/bin/python ops/bench/sidecar.py [--engines 4] [--steps 400] [--commands 256] [--warmup 20] [--seed 7]
        [--log sqlite|postgresql|kafka] [--appends-in-flight N] [--broker-rtt-ms MS]

Starts a real `kvledger serve` subprocess (`--socket DIR/kvledger.sock --log DIR/log.sqlite
--http off`, KVLEDGER_DATA_DIR=DIR) in a temporary directory and waits until the socket exists
and a Health request answers ready. Then `--engines` engines, each its own EngineClient (engine
ids bench-0 .. bench-N-1, one connection each, all in one anyio task group in this process),
declare a namespace with one attention pool of 65,536 blocks and the tier tests/kit/builders.py uses,
and send steps of exactly `--commands` commands each:

    FinishOwner for owners that are done, MarkComputed of the blocks each owner was allocated in
    its previous step (chained on its last content key), AllocateBlocks(count=1..2) for owners
    admitted in earlier steps that still grow, and StartOwner to fill the step up.

Each owner lives for 1..8 allocations, so the pool never runs out and no command should be
refused; the refusals counted in the replies are printed either way. Every engine first runs
`--warmup` steps (not timed); then all engines start the timed phase together. Every timed step is
timed from send to reply (time.perf_counter, the client's encode and decode included); the timed
phase's wall time is from the common start until the last engine's last reply. The events of a
step are what its StepResult carries (began + every command's results + ended): the events
committed. Prints the p50/p99/max step latency, steps/s, events/s and commands/s, and each
against the targets (DESIGN.md, "Targets"): p50 <= 1 ms, p99 <= 5 ms, >= 250,000 events/s (in
one `targets:` line, and p50 and p99 each on a `step latency p50|p99 ..., target ...` line too).

The engines and the sidecar share the machine: the engines' own work (planning steps, decoding
replies, all on one event loop) takes CPU from the sidecar, and one engine's reply handling
delays the others'. The load average and the cores count are printed: figures taken on a busy or
small machine are low. After the run the sidecar is stopped with SIGTERM and its exit code is
printed (0 is a clean drain and snapshot); the log's head sequence is checked against the events
counted in the replies. Progress goes to stderr; the figures go to stdout as plain lines.

    .venv/bin/python ops/bench/sidecar.py --engines 4 --commands 32   # 4 engines of 32-command steps

The ceiling, in the same run: what the log alone takes of the same events. Once the sidecar has
stopped, its SQLite log is read back through the events.log API (open_log, read_steps: each
stored row is one stream's batch of one append, with its stream id, first version, step and
payloads) and exactly those events (same event ids, types, schema versions, payloads, steps and
recorded_at) are appended to a fresh SQLite log in the same temporary directory, through the same
EventLog.append the sidecar's ledger calls: one AppendBatch per engine step, with its stream id,
its expected version (the stored first version - 1) and the command id the sidecar logged for it
(the engine's command id as the sidecar scoped it, found with EventLog.find_commands; the Hello's
declarations carried none in the sidecar and carry none here). The batches are grouped into
append calls exactly as the sidecar's group commit grouped them: the ledger stamps one wall-clock
time (recorded_at) on every batch of a group, so consecutive rows with the same recorded_at were
one append. This mirrors the sidecar most honestly: ops/bench/log.py's one batch per append
would make more, smaller transactions than the sidecar made with concurrent engines, and so
understate the ceiling (and flatter the ratio); the appends and steps per append are printed.
The warmup's rows (and the Hellos' declarations) are appended first, not timed, so the timed
appends start on a log of the same size as the sidecar's timed phase did; then the timed phase's
rows are appended back to back, timed with time.perf_counter (the PendingEvents are built before,
not timed; packing each step's row is inside append, as in the sidecar). Prints `log-only append
N events/s`, its latency per append, `sidecar/log ratio target >= 0.5: met|MISSED` and, as the
last line, `sidecar/log ratio X` (the sidecar's timed events/s over the log-only events/s; 1.0
would be a sidecar that costs nothing over its log).

--log postgresql: the same, on PostgreSQL at $KVLEDGER_TEST_PG (default
postgresql://postgres@127.0.0.1:5432/test, as ops/bench/log.py): two databases of the script's
own, created and upgraded first (the sidecar's and the log-only ceiling's), dropped at the end.

--log kafka: the same, on the Kafka log. This script starts a Tansu broker (tests/kit/kafka.py,
memory storage, on a free loopback port; skipped, saying why, where it cannot run) and the sidecar
logs to a topic of its own there (`--log kafka://.../TOPIC?state=DIR/state.sqlite`, the URL's
defaults otherwise). The log-only ceiling reads the sidecar's topic back (with a state store of
its own) and appends the same events to a fresh topic on the same broker, one append at a time
as above. The broker shares the machine with the engines and the sidecar, and answers in a
fraction of a millisecond; --broker-rtt-ms MS puts tests/kit/tcp_proxy.py in front of it
(the broker advertises the proxy, so every client connection, the log-only ceiling's too, goes
through it) to add MS to each round trip, as a broker across a network does.
"""

from __future__ import annotations

import argparse
import gc
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import anyio  # noqa: E402
import structlog  # noqa: E402
import uuid_utils  # noqa: E402
from anyio.streams.buffered import BufferedByteReceiveStream  # noqa: E402
from figures import console, core_build, load, out, percentile, progress  # noqa: E402
from log import PG_URL, pg_admin, pg_unreachable  # noqa: E402  (ops/bench/log.py, beside this script)

from coordinator import unix_streams  # noqa: E402
from coordinator.client import Address, EngineClient  # noqa: E402
from coordinator.core.commands import (  # noqa: E402
    AllocateBlocks,
    AnyCommand,
    DeclareEngine,
    FinishOwner,
    MarkComputed,
    StartOwner,
)
from coordinator.sidecar import protocol as p  # noqa: E402
from coordinator.sidecar.admission import scoped  # noqa: E402
from events import (  # noqa: E402
    BlockRef,
    BlocksAllocated,
    BlocksComputed,
    NoticeDropped,
    OwnerStarted,
    Refused,
    TierSpec,
)
from events.log import AppendBatch, EventLog, PendingEvent, StoredStep, open_log, upgrade_log  # noqa: E402
from tests.kit import builders as b  # noqa: E402
from tests.kit.kafka import BrokerUnavailable, KafkaBroker, free_port  # noqa: E402

P50_TARGET_MS = 1.0
P99_TARGET_MS = 5.0
EVENTS_TARGET = 250_000
NUM_BLOCKS = 1 << 16
MAX_ALLOCATIONS = 8
"""An owner grows by 1..this many allocations (of 1..2 blocks each) before it finishes."""
TIER = TierSpec(name=b.TIER, num_slots=1 << 16, bytes_per_slot=64)
RATIO_TARGET = 0.5
"""The sidecar's events/s over the log alone's, on the same events (issue 16)."""
READ_LIMIT = 10_000
"""Events a read_steps call asks for when the sidecar's log is read back."""
START_TIMEOUT = 30.0
STOP_TIMEOUT = 30.0


def verdict(ok: bool) -> str:
    return "met" if ok else "MISSED"


# --- one engine's workload -----------------------------------------------------------------------


@dataclass
class Owner:
    owner_id: int
    allocations: int
    """Allocations this owner makes before it finishes."""
    allocated: int = 0
    """Allocations asked for so far."""
    uncomputed: list[BlockRef] = field(default_factory=list)
    """Blocks allocated (and answered) but not yet marked computed."""
    parent_key: bytes | None = None
    broken: bool = False
    """One of its commands was refused: its tracking may be off, so it is only finished."""


class EngineLoad:
    """Plans one engine's steps and follows their replies, so every command is one the decider
    accepts: owners are only named once their OwnerStarted came back, blocks once allocated."""

    def __init__(self, engine_id: str, commands: int, seed: int) -> None:
        self.engine_id = engine_id
        self.commands = commands
        self.rng = random.Random(seed)
        self.owners: dict[int, Owner] = {}
        self.requests = 0
        self.step = 0
        self.refused = 0
        self.dropped = 0
        self.reasons: dict[str, int] = {}
        self.command_ids: dict[int, str] = {}
        """The command id each step was sent with (what the client would draw: a uuid7), by step."""

    def next_command_id(self) -> str:
        """A command id for step `self.step`, kept so the log-only run can append it again."""
        command_id = self.command_ids[self.step] = uuid_utils.uuid7().hex
        return command_id

    def plan(self) -> tuple[list[AnyCommand], list[Owner | None]]:
        """The next step's commands, exactly `commands` of them, and the owner each one concerns
        (None for StartOwner)."""
        rng, engine, budget = self.rng, self.engine_id, self.commands
        commands: list[AnyCommand] = []
        concern: list[Owner | None] = []
        for owner in list(self.owners.values()):
            if len(commands) >= budget:
                break
            if owner.broken or (owner.allocated >= owner.allocations and not owner.uncomputed):
                commands.append(
                    FinishOwner(engine_id=engine, owner_id=owner.owner_id, reason="aborted" if owner.broken else "finished")
                )
                concern.append(owner)
                del self.owners[owner.owner_id]
                continue
            if owner.uncomputed:
                blocks, owner.uncomputed = owner.uncomputed, []
                tokens = [rng.randrange(50_000) for _ in range(b.BLOCK * len(blocks))]
                commands.append(
                    MarkComputed(
                        engine_id=engine, owner_id=owner.owner_id, blocks=blocks, token_ids=tokens, parent_key=owner.parent_key
                    )
                )
                concern.append(owner)
            if len(commands) < budget and owner.allocated < owner.allocations:
                owner.allocated += 1
                commands.append(AllocateBlocks(engine_id=engine, owner_id=owner.owner_id, pool_id=0, count=rng.randint(1, 2)))
                concern.append(owner)
        while len(commands) < budget:
            self.requests += 1
            commands.append(StartOwner(engine_id=engine, req_id=f"{engine}-r{self.requests}"))
            concern.append(None)
        return commands, concern

    def follow(self, result: p.StepResult, concern: list[Owner | None]) -> int:
        """Fold a step's reply into the tracking; returns the events it carries."""
        assert not result.duplicate and len(result.results) == len(concern), result
        events = len(result.began) + len(result.ended)
        for owner, produced in zip(concern, result.results, strict=True):
            events += len(produced)
            for event in produced:
                if isinstance(event, (Refused, NoticeDropped)):
                    if isinstance(event, Refused):
                        self.refused += 1
                    else:
                        self.dropped += 1
                    self.reasons[str(event.reason)] = self.reasons.get(str(event.reason), 0) + 1
                    if owner is not None:
                        owner.broken = True
                elif isinstance(event, OwnerStarted):
                    self.owners[event.owner_id] = Owner(event.owner_id, self.rng.randint(1, MAX_ALLOCATIONS))
                elif isinstance(event, BlocksAllocated) and owner is not None:
                    owner.uncomputed.extend(event.blocks)
                elif isinstance(event, BlocksComputed) and owner is not None:
                    owner.parent_key = event.blocks[-1].key
        for event in result.began + result.ended:
            if isinstance(event, (Refused, NoticeDropped)):
                self.refused += isinstance(event, Refused)
                self.dropped += isinstance(event, NoticeDropped)
                self.reasons[str(event.reason)] = self.reasons.get(str(event.reason), 0) + 1
        return events


def declaration(engine_id: str) -> DeclareEngine:
    return DeclareEngine(
        engine_id=engine_id,
        namespace=b.namespace(tenant="bench"),
        world_size=2,
        tiers=[b.TIER],
        pools=[b.attention_pool(num_blocks=NUM_BLOCKS)],
    )


# --- the sidecar process -------------------------------------------------------------------------


async def health(socket_path: str, token: str = "") -> p.HealthResult:
    """One Health request on an observer connection of its own."""
    stream = await unix_streams.connect_unix(socket_path)
    async with stream:
        reader = BufferedByteReceiveStream(stream)

        async def receive() -> p.ServerMessage:
            length = p.frame_length(await reader.receive_exactly(p.HEADER_BYTES), p.DEFAULT_MAX_FRAME)
            return p.decode_server(await reader.receive_exactly(length))

        await stream.send(p.frame(p.Hello(protocol=p.PROTOCOL_VERSION, role="observer", token=token)))
        welcome = await receive()
        if not isinstance(welcome, p.Welcome):
            raise RuntimeError(f"the sidecar answered Hello with {welcome!r}")
        await stream.send(p.frame(p.Health()))
        reply = await receive()
        if not isinstance(reply, p.HealthResult):
            raise RuntimeError(f"the sidecar answered Health with {reply!r}")
        return reply


async def wait_ready(server: subprocess.Popen[bytes], socket_path: str, token: str = "") -> p.HealthResult:
    deadline = time.monotonic() + START_TIMEOUT
    problem = "the socket does not exist yet"
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise RuntimeError(f"kvledger serve exited with {server.returncode} before it was ready")
        if Path(socket_path).exists():
            try:
                answer = await health(socket_path, token)
            except (OSError, anyio.EndOfStream, anyio.IncompleteRead, anyio.BrokenResourceError) as error:
                problem = f"{type(error).__name__}: {error}"
            else:
                if answer.ready:
                    return answer
                problem = f"not ready: {answer.reason}"
        await anyio.sleep(0.05)
    raise RuntimeError(f"kvledger serve was not ready after {START_TIMEOUT:.0f} s ({problem})")


def server_output(path: Path, lines: int = 20) -> str:
    try:
        text = path.read_text(errors="replace").splitlines()
    except OSError:
        return "(no output)"
    return "\n".join(text[-lines:]) or "(no output)"


# --- the run ---------------------------------------------------------------------------------------


@dataclass
class Totals:
    latencies: list[float] = field(default_factory=list)
    timed_events: int = 0
    all_events: int = 0
    """Every event the engines' Hellos and steps committed, warmup included."""
    started: float = 0.0
    finished: float = 0.0
    cpu_started: tuple[float, float | None] = (0.0, None)
    """(this process's CPU seconds, the sidecar's) at the start of the timed phase."""
    cpu_finished: tuple[float, float | None] = (0.0, None)


def cpu_seconds(pid: int) -> tuple[float, float | None]:
    """(this process's CPU seconds, process `pid`'s, from /proc where there is one)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        other: float | None = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        other = None
    return time.process_time(), other


async def bench(args: argparse.Namespace, socket_path: str, server_pid: int) -> tuple[Totals, list[EngineLoad]]:
    address = Address(socket_path=socket_path)
    totals = Totals()
    loads = [EngineLoad(f"bench-{i}", args.commands, args.seed * 1000 + i) for i in range(args.engines)]
    ready = anyio.Event()
    warmed = 0

    with progress() as bar:
        warm_task = bar.add_task(f"warmup: {args.engines} engines x {args.warmup} steps", total=args.engines * args.warmup)
        timed_task = bar.add_task(
            f"timed: {args.engines} engines x {args.steps} steps of {args.commands} commands", total=args.engines * args.steps
        )

        async def engine(load: EngineLoad) -> None:
            nonlocal warmed
            client = EngineClient(address, declaration(load.engine_id), tiers=[TIER], retry_for=120.0)
            async with client:
                assert client.welcome is not None
                totals.all_events += len(client.welcome.events)
                for _ in range(args.warmup):
                    commands, concern = load.plan()
                    load.step += 1
                    result = await client.step(load.step, load.step * 0.01, commands, command_id=load.next_command_id())
                    totals.all_events += load.follow(result, concern)
                    bar.advance(warm_task)
                warmed += 1
                if warmed == len(loads):
                    gc.collect()
                    totals.cpu_started = cpu_seconds(server_pid)
                    totals.started = time.perf_counter()
                    ready.set()
                await ready.wait()
                for _ in range(args.steps):
                    commands, concern = load.plan()
                    load.step += 1
                    command_id = load.next_command_id()
                    before = time.perf_counter()
                    result = await client.step(load.step, load.step * 0.01, commands, command_id=command_id)
                    totals.latencies.append(time.perf_counter() - before)
                    events = load.follow(result, concern)
                    totals.timed_events += events
                    totals.all_events += events
                    bar.advance(timed_task)
                totals.finished = max(totals.finished, time.perf_counter())
                totals.cpu_finished = cpu_seconds(server_pid)

        async with anyio.create_task_group() as tg:
            for load in loads:
                tg.start_soon(engine, load)
    return totals, loads


def report(args: argparse.Namespace, totals: Totals, loads: list[EngineLoad]) -> float:
    """Print the timed phase's figures; returns its events/s (the ratio's numerator)."""
    latencies = sorted(totals.latencies)
    elapsed = totals.finished - totals.started
    steps = len(latencies)
    p50, p99, worst = (percentile(latencies, 0.50) * 1e3, percentile(latencies, 0.99) * 1e3, latencies[-1] * 1e3)
    rate = totals.timed_events / elapsed
    out(
        f"timed: {args.engines} engine(s) x {args.steps} steps of {args.commands} commands "
        f"({args.warmup} warmup steps each not timed), {steps:,} steps, {totals.timed_events:,} events in {elapsed:.2f} s "
        f"({totals.timed_events / steps:,.1f} events/step)"
    )
    out(
        f"step latency (send to reply): p50 {p50:.2f} ms, p99 {p99:.2f} ms, max {worst:.2f} ms, mean {sum(latencies) / steps * 1e3:.2f} ms"
    )
    out(f"step latency p50 {p50:.2f} ms, target <= {P50_TARGET_MS:g} ms: {verdict(p50 <= P50_TARGET_MS)}")
    out(f"step latency p99 {p99:.2f} ms, target <= {P99_TARGET_MS:g} ms: {verdict(p99 <= P99_TARGET_MS)}")
    out(f"throughput: {steps / elapsed:,.1f} steps/s, {rate:,.0f} events/s, {steps * args.commands / elapsed:,.0f} commands/s")
    refused = sum(engine_load.refused for engine_load in loads)
    dropped = sum(engine_load.dropped for engine_load in loads)
    reasons: dict[str, int] = {}
    for engine_load in loads:
        for reason, n in engine_load.reasons.items():
            reasons[reason] = reasons.get(reason, 0) + n
    detail = f" ({', '.join(f'{r} {n}' for r, n in sorted(reasons.items()))})" if reasons else ""
    out(
        f"refused: {refused:,} commands, notices dropped: {dropped:,}, over all {sum(load.step for load in loads):,} steps "
        f"(warmup included){detail}"
    )
    out(
        f"owners running at the end: {sum(len(load.owners) for load in loads):,}, "
        f"owners started: {sum(load.requests for load in loads):,}"
    )
    (mine0, side0), (mine1, side1) = totals.cpu_started, totals.cpu_finished
    sidecar_cpu = f"the sidecar {side1 - side0:.2f} s" if side0 is not None and side1 is not None else "the sidecar unknown"
    out(
        f"CPU in the timed phase: the engines (this process) {mine1 - mine0:.2f} s, {sidecar_cpu}, "
        f"of {elapsed:.2f} s wall on {os.cpu_count()} cores"
    )
    out(
        f"targets: p50 <= {P50_TARGET_MS:g} ms: {verdict(p50 <= P50_TARGET_MS)}; "
        f"p99 <= {P99_TARGET_MS:g} ms: {verdict(p99 <= P99_TARGET_MS)}; "
        f">= {EVENTS_TARGET:,} events/s: {verdict(rate >= EVENTS_TARGET)}"
    )
    return rate


@dataclass
class Logs:
    """Where the sidecar logs, and where the log-only ceiling reads it back and appends it again."""

    sidecar: str
    reader: str
    """The sidecar's log, read back once it has stopped."""
    fresh: str
    """An empty log of the same backend for the log-only ceiling."""

    @classmethod
    def sqlite(cls, directory: Path) -> Logs:
        path = str(directory / "log.sqlite")
        return cls(path, path, str(directory / "log-only.sqlite"))

    @classmethod
    def postgresql(cls, databases: Sequence[str]) -> Logs:
        sidecar, fresh = (f"{PG_URL.rsplit('/', 1)[0]}/{database}" for database in databases)
        return cls(sidecar, sidecar, fresh)

    @classmethod
    def kafka(cls, directory: Path, broker: KafkaBroker) -> Logs:
        topic = f"kvl-bench-{uuid_utils.uuid7().hex[-12:]}"
        return cls(
            broker.url(topic, state=directory / "state.sqlite"),
            broker.url(topic, state=directory / "reader-state.sqlite"),
            broker.url(state=directory / "log-only-state.sqlite"),
        )


async def run(
    args: argparse.Namespace, directory: Path, server: subprocess.Popen[bytes], socket_path: str
) -> tuple[Totals, list[EngineLoad], float]:
    answer = await wait_ready(server, socket_path)
    console.print(f"sidecar ready ({answer.server}, head_seq {answer.head_seq})")
    totals, loads = await bench(args, socket_path, server.pid)
    rate = report(args, totals, loads)
    head = (await health(socket_path)).head_seq
    out(
        f"log head sequence {head:,}; events counted in the Welcome and StepResult replies {totals.all_events:,}: "
        f"{'equal' if head == totals.all_events else 'DIFFERENT'}"
    )
    if args.log == "sqlite":
        sizes = [
            (directory / name).stat().st_size if (directory / name).exists() else 0 for name in ("log.sqlite", "log.sqlite-wal")
        ]
        out(f"sqlite files before shutdown: main {sizes[0] / 2**20:,.1f} MiB, WAL {sizes[1] / 2**20:,.1f} MiB")
    return totals, loads, rate


# --- the ceiling: the same events appended to a fresh log, nothing else ------------------------------


async def read_back(log: EventLog) -> list[StoredStep]:
    """Every row of the log, in order: one stream's batch of one append each."""
    rows: list[StoredStep] = []
    end = await log.head()
    while (rows[-1].last_seq if rows else 0) < end:
        last = rows[-1].last_seq if rows else 0
        rows.extend(await log.read_steps(last, min(READ_LIMIT, end - last)))
    return rows


def appends_of(rows: list[StoredStep], command_ids: dict[int, str]) -> list[list[AppendBatch]]:
    """The rows as the sidecar appended them: one AppendBatch per row (its stream, its expected
    version, its logged command id, its events as PendingEvents), grouped into append calls as its
    group commit grouped them: the ledger stamps one recorded_at on every batch of a group."""
    appends: list[list[AppendBatch]] = []
    group_time: float | None = None
    for row in rows:
        if row.recorded_at != group_time:
            appends.append([])
            group_time = row.recorded_at
        events = [
            PendingEvent(
                event_id=e.event_id,
                step=e.step,
                recorded_at=e.recorded_at,
                event_type=e.event_type,
                schema_version=e.schema_version,
                payload=e.payload,
            )
            for e in row.events()
        ]
        appends[-1].append(
            AppendBatch(
                stream_id=row.stream_id,
                expected_version=row.first_version - 1,
                events=events,
                command_id=command_ids.get(row.first_seq),
            )
        )
    return appends


async def log_only(args: argparse.Namespace, logs: Logs, totals: Totals, loads: list[EngineLoad], sidecar_rate: float) -> float:
    """Append the sidecar's committed events again to a fresh log of its backend, the timed
    phase's timed; prints the figures and returns the ratio of the sidecar's events/s to the log's."""
    # Every step's command id as the sidecar logged it; the timed phase's are the boundary.
    logged = {
        scoped(load.engine_id, "step", command_id): step > args.warmup
        for load in loads
        for step, command_id in load.command_ids.items()
    }
    source = await open_log(logs.reader)
    try:
        rows = await read_back(source)
        found = await source.find_commands(list(logged))
    finally:
        await source.close()
    command_ids = {result.first_seq: command_id for command_id, result in found.items()}
    timed = [logged.get(command_ids.get(row.first_seq, ""), False) for row in rows]
    start = timed.index(True) if True in timed else len(rows)
    strays = sum(1 for is_timed in timed[start:] if not is_timed)
    if strays or len(found) != len(logged):
        console.print(
            f"[yellow]log-only: {len(found):,} of {len(logged):,} step command ids found in the sidecar's log; "
            f"{strays} rows after the first timed step are not timed steps (appended, and timed, anyway)"
        )
    warm, hot = appends_of(rows[:start], command_ids), appends_of(rows[start:], command_ids)
    if not hot:
        raise RuntimeError("the sidecar's log holds none of the timed steps' command ids")
    events = sum(row.count for row in rows[start:])
    steps = len(rows) - start
    out(
        f"log-only: read back {len(rows):,} rows, {sum(row.count for row in rows):,} events from the sidecar's log; "
        f"timed phase {steps:,} rows, {events:,} events (counted in the replies {totals.timed_events:,}: "
        f"{'equal' if events == totals.timed_events else 'DIFFERENT'})"
    )

    target = await open_log(logs.fresh)
    latencies: list[float] = []
    try:
        for batches in warm:
            await target.append(batches)
        # The PendingEvents are what a real writer would not hold all at once: out of the GC's way.
        gc.collect()
        gc.freeze()
        try:
            with progress() as bar:
                task = bar.add_task(f"log-only: appending {events:,} events in {len(hot):,} appends", total=events)
                started = time.perf_counter()
                for batches in hot:
                    before = time.perf_counter()
                    results = await target.append(batches)
                    latencies.append(time.perf_counter() - before)
                    bar.advance(task, sum(len(batch.events) for batch in batches))
                elapsed = time.perf_counter() - started
        finally:
            gc.unfreeze()
        head = await target.head()
    finally:
        await target.close()
    assert not any(result.duplicate for result in results), results
    assert head == rows[-1].last_seq, (head, rows[-1].last_seq)

    rate = events / elapsed
    latencies.sort()
    out(
        f"log-only append {rate:,.0f} events/s ({events:,} events of the timed phase in {elapsed:.2f} s; "
        f"{steps:,} steps in {len(hot):,} appends, {steps / len(hot):.2f} steps/append as the sidecar's group commit "
        f"grouped them; the {len(rows) - steps:,} rows before (warmup, declarations) appended first, not timed; fresh {args.log} log, EventLog.append)"
    )
    out(
        f"log-only append latency per append: p50 {percentile(latencies, 0.50) * 1e3:.2f} ms, "
        f"p99 {percentile(latencies, 0.99) * 1e3:.2f} ms, max {latencies[-1] * 1e3:.2f} ms"
    )
    ratio = sidecar_rate / rate
    out(
        f"sidecar/log ratio target >= {RATIO_TARGET:g}: {verdict(ratio >= RATIO_TARGET)} "
        f"(sidecar {sidecar_rate:,.0f} events/s over log-only {rate:,.0f} events/s = {ratio:.2f})"
    )
    return ratio


def stop(server: subprocess.Popen[bytes]) -> int | None:
    """SIGTERM, then wait up to STOP_TIMEOUT for a clean exit; None if it did not stop."""
    if server.poll() is not None:
        return server.returncode
    server.send_signal(signal.SIGTERM)
    try:
        return server.wait(timeout=STOP_TIMEOUT)
    except subprocess.TimeoutExpired:
        return None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engines", type=int, default=4, help="concurrent engines, one connection each (default 4)")
    parser.add_argument("--steps", type=int, default=400, help="timed steps per engine (default 400)")
    parser.add_argument("--commands", type=int, default=256, help="commands per step (default 256)")
    parser.add_argument("--warmup", type=int, default=20, help="steps per engine before timing (default 20)")
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument(
        "--log", choices=("sqlite", "postgresql", "kafka"), default="sqlite", help="the sidecar's log backend (default sqlite)"
    )
    parser.add_argument(
        "--appends-in-flight",
        type=int,
        default=None,
        help="passed to kvledger serve (groups whose appends travel at once on Kafka); default: serve's own",
    )
    parser.add_argument(
        "--broker-rtt-ms",
        type=float,
        default=0.0,
        help="--log kafka: milliseconds added to every round trip to the broker (tests/kit/tcp_proxy.py); default 0",
    )
    args = parser.parse_args()
    if args.engines < 1 or args.steps < 1 or args.commands < 1 or args.warmup < 0:
        parser.error("--engines, --steps and --commands must be positive, --warmup not negative")
    # The client's structlog lines (connected, retrying) go to stderr, keeping stdout to the figures.
    structlog.configure(logger_factory=structlog.PrintLoggerFactory(sys.stderr))

    kvledger = Path(sys.executable).parent / "kvledger"
    out(f"host at start: {load()}")
    out(core_build())
    broker: KafkaBroker | None = None
    proxy: subprocess.Popen[bytes] | None = None
    if args.log == "kafka":
        proxy_port = free_port() if args.broker_rtt_ms > 0 else None
        try:
            broker = KafkaBroker.start(advertised_port=proxy_port)
        except BrokerUnavailable as problem:
            out(f"kafka: skipped, no Tansu broker ({problem})")
            return 0
        out(f"kafka: Tansu broker on 127.0.0.1:{broker.port} (memory storage), started by this script")
        if proxy_port is not None:
            proxy = subprocess.Popen(
                [sys.executable, "-m", "tests.kit.tcp_proxy", str(proxy_port), str(broker.port), str(args.broker_rtt_ms / 2)],
                cwd=ROOT,
            )
            wait_listening(proxy_port)
            out(f"kafka: clients reach it through a proxy at {broker.bootstrap} adding {args.broker_rtt_ms:g} ms a round trip")
    databases: list[str] = []
    if args.log == "postgresql":
        unreachable = anyio.run(pg_unreachable)
        if unreachable is not None:
            out(f"postgresql: skipped, the server at {PG_URL} is unreachable ({unreachable})")
            return 0
        databases = [f"kvl_bench_{uuid_utils.uuid7().hex[-12:]}" for _ in range(2)]
    try:
        for database in databases:
            anyio.run(pg_admin, f'CREATE DATABASE "{database}"')
            anyio.run(upgrade_log, f"{PG_URL.rsplit('/', 1)[0]}/{database}")
        if databases:
            out(f"postgresql: databases {', '.join(databases)} on {PG_URL.rsplit('/', 1)[0]}, created by this script")
        return bench_on(args, kvledger, broker, databases)
    finally:
        for database in databases:
            anyio.run(pg_admin, f'DROP DATABASE IF EXISTS "{database}" WITH (FORCE)')
        if proxy is not None:
            proxy.kill()
            proxy.wait()
        if broker is not None:
            broker.stop()


def wait_listening(port: int) -> None:
    deadline = time.monotonic() + START_TIMEOUT
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1.0).close()
            return
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def bench_on(args: argparse.Namespace, kvledger: Path, broker: KafkaBroker | None, databases: Sequence[str]) -> int:
    status = 0
    with tempfile.TemporaryDirectory(prefix="kvl-sidecar-bench-") as name:
        directory = Path(name)
        if broker is not None:
            logs = Logs.kafka(directory, broker)
        elif databases:
            logs = Logs.postgresql(databases)
        else:
            logs = Logs.sqlite(directory)
        socket_path = str(directory / "kvledger.sock")
        output = directory / "serve.log"
        env = {**os.environ, "KVLEDGER_DATA_DIR": str(directory)}
        command = [str(kvledger), "serve", "--socket", socket_path, "--log", logs.sidecar, "--http", "off"]
        if args.appends_in_flight is not None:
            command += ["--appends-in-flight", str(args.appends_in_flight)]
        with output.open("wb") as sink:
            server = subprocess.Popen(command, env=env, stdout=sink, stderr=subprocess.STDOUT, cwd=ROOT)
        try:
            try:
                totals, loads, rate = anyio.run(run, args, directory, server, socket_path)
            except BaseException:
                console.print(f"the benchmark failed; kvledger serve's last output:\n{server_output(output)}")
                status = 1
                raise
            finally:
                code = stop(server)
                if code is None:
                    out(f"sidecar: did not stop within {STOP_TIMEOUT:.0f} s of SIGTERM; killed")
                    status = 1
                else:
                    out(f"sidecar exit code after SIGTERM: {code} ({'clean' if code == 0 else 'NOT clean'})")
                    if code != 0:
                        status = 1
                        console.print(f"kvledger serve's last output:\n{server_output(output)}")
        finally:
            if server.poll() is None:
                server.kill()
                server.wait()
        # The sidecar has stopped: the log alone, on the same events (what it committed).
        ratio = anyio.run(log_only, args, logs, totals, loads, rate)
    out(f"host at end: {load()}")
    out(f"sidecar/log ratio {ratio:.2f}")
    return status


if __name__ == "__main__":
    sys.exit(main())
