"""A mixed workload shaped like a vLLM scheduler's, with every protection on (the normal mode),
on the real embedded sidecar and real workers (coordinator/simulator/harness.py).

Each engine runs scheduler iterations; one iteration is one step transaction. Like vLLM with a
KV connector, an iteration's step carries what the previous forward pass computed (MarkComputed),
the stores of prompts whose prefill finished, the loads of prefix hits into the blocks the last
step allocated, the finished and preempted requests, then this iteration's allocations and
admissions. The engine
waits for the step's reply (the coordinator's share of the time), runs its forward pass on the
blocks it got (`SimEngine.compute`: what recompute would write), and lets the workers carry out
the decisions that are due (stores a few iterations late, so they run asynchronously).

What one run covers:

* requests that share long prefixes: a few system prompts whose lengths end inside a block, then
  a user turn (and, for some, an image); multi-turn follow-ups that extend a finished
  conversation and arrive at either engine;
* chunked prefill (at most MAX_CHUNK tokens of a prompt per iteration, within a token budget)
  and decode (DECODE_TOKENS a step, so a new block every few steps);
* preemption under block pressure (small pools), and resumption under the same req_id as a new
  owner (StartOwner(resumed=True)), recomputing prompt and output so far (vLLM's recompute mode),
  often from its own stored prefix;
* hybrid groups: attention blocks of 16 tokens and a "state" group of 32 (vLLM's Mamba prefix
  caching in align mode: the state is kept at every chunk end, chunks are whole state blocks), so
  the reuse unit is 32 and a hit loads the attention blocks before the boundary and the one state
  block at it;
* a multimodal encoder cache (AllocateEncoderEntry / FreeEncoderEntry) with a model runner that
  evicts what StepEnded says was freed and reads each image's output before the tokens after it;
* tensor parallelism (world_size workers per engine, each with its shard);
* `engines` instances on one namespace and one tier: one engine's stores are the other's hits;
* a small tier (TIER_SLOTS: pass it to Simulation), so stores evict;
* one cache reset (ResetCache outside a step) halfway, with stores still in flight.

Every prefix hit is checked against recompute once its load lands and before it is used; every
image output is checked before it is read; every block a request computed or loaded is checked
again when the request finishes or is preempted. Wrong-KV reads are counted from the bytes. The
coordinator's refusals under pressure (a pool or the encoder cache full, a key evicted between
lookup and load) are data: they are counted and the engine reacts (preempts, waits, recomputes).
The same seed gives the same run.
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Sequence

import msgspec

from coordinator.simulator._requests import (
    ARRIVAL,
    ATTENTION_BLOCK,
    ENCODER_TOKENS,
    FOLLOW_UP,
    IMAGE_SHARE,
    IMAGE_TOKENS,
    IMAGES,
    MAX_CONTEXT,
    MAX_WAITING,
    SYSTEM_PROMPTS,
    TIER_SLOTS,
    VOCABULARY,
    Request,
    Stats,
    namespace,
    pools,
)
from coordinator.simulator._scheduler import WorkloadEngine
from coordinator.simulator.harness import Simulation

__all__ = ["TIER_SLOTS", "WorkloadReport", "run_workload"]


class WorkloadReport(msgspec.Struct, kw_only=True):
    steps: int
    """Step transactions committed, all engines together."""
    requests: int
    """Requests that arrived (a resumption is not a new request)."""
    events: int
    """Events committed during the run (sim.tally.events)."""
    wrong_reads: int
    loads_checked: int
    """Loaded blocks and encoder outputs checked against recompute before use."""
    hits: int
    """Prefix hits used: loads that landed, were checked, and that a forward pass then ran on."""
    preemptions: int
    resets: int
    evictions: int
    refusals: dict[str, int]
    """Refused commands, dropped notices, failed jobs, quarantined keys, by kind:reason."""
    wall_seconds: float
    coordinator_seconds: float
    """Time spent awaiting the sidecar's step replies."""
    events_per_second: float
    """events / wall_seconds."""
    step_latency_p50_ms: float
    step_latency_p99_ms: float
    engine_steps: dict[str, int] = msgspec.field(default_factory=dict)
    stores: int = 0
    """Store jobs with something to write."""
    loads: int = 0
    blocks_verified: int = 0
    """Blocks a request computed or loaded, checked again when it finished or was preempted."""
    cross_engine_hits: int = 0
    """Hits on a prefix another engine stored."""
    encoder_reads: int = 0
    """Image outputs read from the encoder cache (checked; part of loads_checked)."""
    finished: int = 0


class Workload:
    def __init__(self, sim: Simulation, rng: random.Random) -> None:
        self.sim = sim
        self.rng = rng
        self.stats = Stats()
        self.engines: list[WorkloadEngine] = []
        self.system_prompts = [
            [rng.randrange(VOCABULARY) for _ in range(length)]
            for length in (
                rng.randrange(5, 10) * ATTENTION_BLOCK + rng.randrange(1, ATTENTION_BLOCK) for _ in range(SYSTEM_PROMPTS)
            )
        ]
        """A few long system prompts, each ending inside a block."""
        self.conversations = 0
        self.stored_by: dict[bytes, str] = {}
        """The engine whose store last took each key (which engine's stores a hit used)."""

    def arrive(self, engine: WorkloadEngine) -> None:
        if len(engine.waiting) >= MAX_WAITING or self.rng.random() >= ARRIVAL:
            return
        self.conversations += 1
        tokens = list(self.rng.choice(self.system_prompts))
        image = None
        extra: list[str] = []
        if self.rng.random() < IMAGE_SHARE:
            number = self.rng.randrange(IMAGES)
            entry_id = f"mm:image-{number}"
            length = IMAGE_TOKENS[number % len(IMAGE_TOKENS)]
            image = (entry_id, len(tokens), len(tokens) + length)
            tokens += [VOCABULARY + number * 100 + index for index in range(length)]  # its placeholder tokens
            extra = [entry_id]
        tokens += [self.rng.randrange(VOCABULARY) for _ in range(self.rng.randrange(8, 64))]
        output = self.rng.randrange(8, 40)
        self._new(engine, Request(f"req-{self.conversations}", tokens, len(tokens) + output, extra, image))

    def follow_up(self, request: Request) -> None:
        """The conversation goes on: the next turn extends this one's prompt and output."""
        turn = [self.rng.randrange(VOCABULARY) for _ in range(self.rng.randrange(8, 40))]
        output = self.rng.randrange(8, 32)
        if self.rng.random() >= FOLLOW_UP or len(request.tokens) + len(turn) + output > MAX_CONTEXT:
            return
        engine = self.rng.choice(self.engines)
        tokens = request.tokens + turn
        self._new(engine, Request(f"{request.req_id}.{len(tokens)}", tokens, len(tokens) + output, request.extra, request.image))

    def _new(self, engine: WorkloadEngine, request: Request) -> None:
        self.stats.requests += 1
        self.sim.tally.requests += 1
        engine.waiting.append(request)


async def run_workload(
    sim: Simulation,
    *,
    engines: int = 2,
    steps: int = 200,
    seed: int = 7,
    world_size: int = 2,
    late_loads_at_reset: bool = False,
) -> WorkloadReport:
    """Run `steps` scheduler iterations on each of `engines` engines (one namespace, one tier)
    with `world_size` tensor-parallel workers each; one cache reset halfway. The simulation
    should have world_size tiers (Simulation(world_size=...)) and a small tier
    (tier_slots=TIER_SLOTS) for stores to evict.

    `late_loads_at_reset`: reset while a load is in flight and let it land late, after the reset
    (the engine normally lets its loads land first). EngineReset frees the slots those loads
    still write into, so the late load overwrites blocks another request holds by then: wrong
    KV with every protection on (the known bug this switch reproduces)."""
    if world_size != len(sim.tiers):
        raise ValueError(f"world_size {world_size} != the simulation's {len(sim.tiers)} ranks")
    if engines < 1 or steps < 1:
        raise ValueError("engines and steps must be positive")
    started = time.perf_counter()
    events_before = sim.tally.events
    refusals_before = dict(sim.tally.refusals)
    wrong_before, checked_before = sim.tally.wrong_reads, sim.tally.loads_checked
    workload = Workload(sim, random.Random(seed))
    ns = namespace(world_size)
    for index in range(engines):
        engine = await sim.engine(f"wl-{index}", ns, pools(), encoder_cache_tokens=ENCODER_TOKENS)
        workload.engines.append(WorkloadEngine(workload, engine))
    steps_before = {e.engine.engine_id: e.engine.step_no for e in workload.engines}
    # The reset comes halfway, once the first engine has a store in flight (a quarter later at
    # the latest), so the store completes after it: its report is fenced (I16).
    reset_from, reset_by = steps // 2, steps // 2 + steps // 4
    for iteration in range(steps):
        for index, engine_load in enumerate(workload.engines):
            if (
                index == 0
                and not workload.stats.resets
                and iteration >= reset_from
                and (engine_load.in_flight(loads=late_loads_at_reset) or iteration >= reset_by)
            ):
                await engine_load.reset(late_loads=late_loads_at_reset)
            workload.arrive(engine_load)
            await engine_load.tick(iteration)
    for engine_load in workload.engines:
        await engine_load.run_workers(None)  # the stores and loads still in flight land
    stats = workload.stats
    wall = time.perf_counter() - started
    latencies = sorted(stats.step_seconds)
    events = sim.tally.events - events_before
    refusals = {
        kind: count - refusals_before.get(kind, 0)
        for kind, count in sorted(sim.tally.refusals.items())
        if count > refusals_before.get(kind, 0)
    }
    engine_steps = {e.engine.engine_id: e.engine.step_no - steps_before[e.engine.engine_id] for e in workload.engines}
    return WorkloadReport(
        steps=sum(engine_steps.values()),
        requests=stats.requests,
        events=events,
        wrong_reads=sim.tally.wrong_reads - wrong_before,
        loads_checked=sim.tally.loads_checked - checked_before,
        hits=stats.hits,
        preemptions=stats.preemptions,
        resets=stats.resets,
        evictions=stats.evictions,
        refusals=refusals,
        wall_seconds=round(wall, 3),
        coordinator_seconds=round(sum(latencies), 3),
        events_per_second=round(events / wall, 1) if wall > 0 else 0.0,
        step_latency_p50_ms=round(percentile(latencies, 0.50) * 1000, 3),
        step_latency_p99_ms=round(percentile(latencies, 0.99) * 1000, 3),
        engine_steps=engine_steps,
        stores=stats.stores,
        loads=stats.loads,
        blocks_verified=stats.blocks_verified,
        cross_engine_hits=stats.cross_engine_hits,
        encoder_reads=stats.encoder_reads,
        finished=stats.finished,
    )


def percentile(sorted_values: Sequence[float], fraction: float) -> float:
    """Nearest-rank percentile of an ascending sequence (0.0 when empty): the value at rank
    ceil(fraction x n). The benchmarks (ops/bench/figures.py) use this same one, so a simulator
    p99 and a benchmark p99 mean the same thing."""
    if not sorted_values:
        return 0.0
    index = max(0, min(len(sorted_values) - 1, math.ceil(fraction * len(sorted_values)) - 1))
    return sorted_values[index]
