"""The simulation harness: a real sidecar (embedded, on a real socket and a SQLite log), engines
that talk to it through EngineClient, and real workers (gpu.worker.Worker on real tensors) that
receive their decisions through a WorkerClient subscription and execute them when the scenario
says so: that is how a scenario makes a store slow, or a completion late.

Engines write what compute would produce (coordinator/simulator/content.py) into every rank's
pool before they mark blocks computed. After a load the engine relies on, `check` compares the
destination bytes with what recompute would give: a difference is a wrong-KV read, counted from
the bytes, never from bookkeeping.
"""

from __future__ import annotations

import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from types import TracebackType

import anyio
import msgspec
import structlog
import torch
from anyio.abc import TaskGroup

from coordinator.client import Address, EngineClient, WorkerClient
from coordinator.core.commands import AnyCommand, DeclareEngine, ReportRank
from coordinator.core.protections import Protection
from coordinator.core.routing import Decision
from coordinator.sidecar import protocol as p
from coordinator.sidecar.embedded import embedded_sidecar
from coordinator.sidecar.server import Sidecar
from coordinator.simulator.content import kv_bytes
from events import (
    BlockRef,
    Event,
    FencedRankDone,
    JobFailed,
    KeyQuarantined,
    NamespaceSpec,
    NoticeDropped,
    PoolSpec,
    Refused,
    TierSpec,
)
from events.log import EventLog, open_log
from gpu.pools import DevicePools
from gpu.tiers import DiskTier, SlotTier, Tier
from gpu.worker import Worker

log = structlog.get_logger("kvledger.simulator")

TIER = "shared"
CPU = torch.device("cpu")


class Tally(msgspec.Struct, kw_only=True):
    """What one run of a scenario produced."""

    requests: int = 0
    wrong_reads: int = 0
    loads_checked: int = 0
    refusals: dict[str, int] = msgspec.field(default_factory=dict)
    """Refused commands, dropped notices, failed jobs and quarantined keys, by reason."""
    events: int = 0

    def record(self, events: Sequence[Event]) -> None:
        self.events += len(events)
        for event in events:
            if isinstance(event, Refused | NoticeDropped | JobFailed | KeyQuarantined):
                key = f"{type(event).__name__}:{event.reason}"
            elif isinstance(event, FencedRankDone):
                key = "FencedRankDone:late_report"  # a fenced job's late report: its result dropped (I16)
            else:
                continue
            self.refusals[key] = self.refusals.get(key, 0) + 1


class SimEngine:
    """One engine instance: its client, its workers (one per rank) and its namespace."""

    def __init__(self, sim: Simulation, declare: DeclareEngine) -> None:
        self.sim = sim
        self.engine_id = declare.engine_id
        self.namespace = declare.namespace
        self.pools = {spec.pool_id: spec for spec in declare.pools}
        self.world_size = declare.world_size
        self.client = EngineClient(sim.address, declare, tiers=[sim.tier_spec])
        self.workers = [
            Worker(self.engine_id, rank, DevicePools(declare.pools, CPU), sim.tiers[rank], protections_off=sim.off)
            for rank in range(declare.world_size)
        ]
        self.received: list[list[Decision]] = [[] for _ in range(declare.world_size)]
        self.expected: dict[int, Decision] = {}
        """Decisions committed for this engine (from step results), by sequence."""
        self.executed: set[int] = set()
        self.step_no = 0
        self.clock = 0.0

    # --- steps ------------------------------------------------------------------------------

    async def step(self, commands: Sequence[AnyCommand], *, advance: float = 0.01) -> p.StepResult:
        self.step_no += 1
        self.clock += advance
        result = await self.client.step(self.step_no, self.clock, list(commands))
        self.sim.tally.record([*result.began, *(e for r in result.results for e in r), *result.ended])
        for decision in result.decisions:
            self.expected[decision.seq] = decision
        return result

    def compute(self, blocks: Sequence[BlockRef], tokens: Sequence[int], *, first_block: int = 0) -> None:
        """What the engine's forward pass writes: block i of the list holds the KV of the
        prefix ending at block (first_block + i) of `tokens`, on every rank."""
        for index, ref in enumerate(blocks):
            end = (first_block + index + 1) * self.pools[ref.pool_id].block_size
            for worker in self.workers:
                worker.pools.block(ref).copy_(self.expected_bytes(tokens[:end], ref.pool_id, worker.rank))

    def expected_bytes(self, prefix: Sequence[int], pool_id: int, rank: int) -> torch.Tensor:
        return kv_bytes(self.namespace, prefix, pool_id, rank, self.pools[pool_id].bytes_per_block)

    def check(self, holdings: Sequence[tuple[BlockRef, Sequence[int]]]) -> int:
        """Wrong-KV reads among blocks the engine is about to use: (block, the token prefix its
        KV must be of). Counted per block whose bytes differ from recompute on any rank."""
        wrong = 0
        for ref, prefix in holdings:
            if any(not torch.equal(w.pools.block(ref), self.expected_bytes(prefix, ref.pool_id, w.rank)) for w in self.workers):
                wrong += 1
        self.sim.tally.loads_checked += len(holdings)
        self.sim.tally.wrong_reads += wrong
        return wrong

    # --- workers -----------------------------------------------------------------------------

    async def execute(
        self,
        *,
        hold: frozenset[int] = frozenset(),
        only: frozenset[int] | None = None,
        failing: frozenset[tuple[int, int]] = frozenset(),
    ) -> list[Event]:
        """Let the workers carry out the committed decisions not yet done, in order, except the
        jobs in `hold` (or only those in `only`); returns what their reports committed. A (job,
        rank) in `failing` does nothing and reports a failure, as a rank whose transfer failed."""
        committed: list[Event] = []
        for seq in sorted(self.expected):
            decision = self.expected[seq]
            job_id = decision.event.job_id
            if seq in self.executed or job_id in hold or (only is not None and job_id not in only):
                continue
            for worker in self.workers:
                arrived = await self._arrival(worker.rank, seq)
                if (job_id, worker.rank) in failing:
                    report = ReportRank(job_id=job_id, rank=worker.rank, ok=False, error="transfer_failed: the rank's put failed")
                else:
                    report = await anyio.to_thread.run_sync(worker.execute, arrived.event)
                result = await self.sim.worker_clients[(self.engine_id, worker.rank)].report(report)
                committed += result.events
            self.executed.add(seq)
        self.sim.tally.record(committed)
        return committed

    async def _arrival(self, rank: int, seq: int) -> Decision:
        """The decision as the rank's subscription delivered it (never from the step result)."""
        with anyio.fail_after(30):
            while True:
                for decision in self.received[rank]:
                    if decision.seq == seq:
                        return decision
                await anyio.sleep(0.002)


class Simulation:
    """One run: a fresh log and sidecar, engines, workers; `off` protections switched off."""

    def __init__(
        self,
        directory: Path | None = None,
        off: frozenset[Protection] = frozenset(),
        *,
        world_size: int = 2,
        tier_slots: int = 4096,
        disk_tier: bool = False,
        tier: Callable[[int], Tier] | None = None,
        log_url: str | None = None,
    ) -> None:
        self._own_dir = tempfile.TemporaryDirectory(prefix="kvl-sim-") if directory is None else None
        self.directory: Path = Path(self._own_dir.name) if self._own_dir is not None else Path(str(directory))
        self.off = off
        self.tally = Tally()
        self.tier_spec = TierSpec(name=TIER, num_slots=tier_slots, bytes_per_slot=1 << 20)
        if tier is None:
            tier = (
                (lambda rank: DiskTier(TIER, self.directory / "tier" / f"rank{rank}", CPU, fsync="never"))
                if disk_tier
                else (lambda rank: SlotTier(TIER, CPU, self.tier_spec.num_slots, self.tier_spec.bytes_per_slot))
            )
        self.tiers: list[dict[str, Tier]] = [{TIER: tier(rank)} for rank in range(world_size)]
        """One shared tier per rank: every engine's worker of that rank sees the same one. It is
        addressed by tier slot, like a shared store's memory segment (gpu.tiers.SlotTier): a
        slot the coordinator gives to another key holds that key's bytes from its store on. With
        `disk_tier`, a file per key instead (gpu.tiers.DiskTier, vLLM's file tier); with `tier`,
        what it makes for each rank (a Mooncake Store's: gpu.mooncake.MooncakeTier)."""
        # A Unix socket path has a length limit (108 bytes on Linux): the socket gets a short
        # directory of its own, whatever the log's directory is.
        self._socket_dir = tempfile.TemporaryDirectory(prefix="kvl-")
        self.address = Address(socket_path=str(Path(self._socket_dir.name) / "s.sock"))
        self.engines: list[SimEngine] = []
        self.worker_clients: dict[tuple[str, int], WorkerClient] = {}
        self.started = time.perf_counter()
        self.log_url = log_url or str(self.log_path)
        """The sidecar's log: a SQLite file in `directory`, or any log URL (a Kafka topic that
        another Simulation's sidecar writes too: the fleet case)."""
        self.log: EventLog | None = None
        self.sidecar: Sidecar | None = None

    @property
    def log_path(self) -> Path:
        return self.directory / "log.sqlite"

    async def __aenter__(self) -> Simulation:
        self.log = await open_log(self.log_url)
        self._sidecar_cm = embedded_sidecar(self.log, Path(str(self.address)), http=None, protections_off=self.off)
        self.sidecar = await self._sidecar_cm.__aenter__()
        self._tasks_cm = anyio.create_task_group()
        self._tasks: TaskGroup = await self._tasks_cm.__aenter__()
        return self

    async def __aexit__(self, kind: type[BaseException] | None, error: BaseException | None, tb: TracebackType | None) -> None:
        self._tasks.cancel_scope.cancel()
        await self._tasks_cm.__aexit__(None, None, None)
        try:
            for engine in self.engines:
                await engine.client.aclose()
            await self._sidecar_cm.__aexit__(kind, error, tb)
        finally:  # even when the sidecar's exit raised (a scenario failed): no log left open
            assert self.log is not None
            await self.log.close()
            self._socket_dir.cleanup()
            if self._own_dir is not None:
                self._own_dir.cleanup()

    async def engine(
        self, engine_id: str, namespace: NamespaceSpec, pools: Sequence[PoolSpec], *, encoder_cache_tokens: int = 0
    ) -> SimEngine:
        """Declare an engine (its Hello) and start its workers' subscriptions."""
        declare = DeclareEngine(
            engine_id=engine_id,
            namespace=namespace,
            pools=list(pools),
            world_size=namespace.tensor_parallel_size,
            tiers=[TIER],
            encoder_cache_tokens=encoder_cache_tokens,
        )
        engine = SimEngine(self, declare)
        await engine.client.connect()
        assert engine.client.welcome is not None
        self.tally.record(engine.client.welcome.events)
        for rank in range(declare.world_size):
            client = WorkerClient(self.address, engine_id, rank)
            self.worker_clients[(engine_id, rank)] = client
            self._tasks.start_soon(self._subscribe, engine, rank, client)
        self.engines.append(engine)
        return engine

    async def _subscribe(self, engine: SimEngine, rank: int, client: WorkerClient) -> None:
        async for decision in client.decisions(0):
            engine.received[rank].append(decision)
