"""The mixed workload's engines: one scheduler iteration over the requests (_requests.py).
coordinator/simulator/workload.py says what a run covers, runs it and reports."""

from __future__ import annotations

import random
import time
from collections import deque
from collections.abc import Sequence
from typing import Protocol

import torch

from coordinator.core.commands import (
    AllocateBlocks,
    AllocateEncoderEntry,
    FinishOwner,
    FreeEncoderEntry,
    LoadRequest,
    MarkComputed,
    ResetCache,
    StartLoad,
    StartOwner,
    StartStore,
)
from coordinator.core.keys import chain_keys, namespace_id
from coordinator.simulator._requests import (
    ATTENTION,
    ATTENTION_BLOCK,
    DECODE_TOKENS,
    ENCODER_TOKENS,
    LATE_LOAD,
    LOAD_DELAYS,
    MAX_CHUNK,
    MAX_RUNNING,
    STATE,
    STATE_BLOCK,
    STORE_DELAYS,
    TOKEN_BUDGET,
    VOCABULARY,
    Batch,
    EncoderRunner,
    Request,
    Stats,
)
from coordinator.simulator.harness import TIER, SimEngine, Simulation
from events import (
    BlocksAllocated,
    EncoderEntryAllocated,
    Event,
    JobFailed,
    JobFenced,
    JobSucceeded,
    KeyEvicted,
    LoadJobStarted,
    OwnerStarted,
    PrefixLookedUp,
    StepEnded,
    StoreJobStarted,
)


class Workload(Protocol):
    """What an engine's scheduler needs of the workload that drives it (coordinator/simulator/
    workload.py): its randomness and counters, where each key was stored, the simulation's
    tally, and the next turn of a finished request's conversation."""

    rng: random.Random
    stats: Stats
    stored_by: dict[bytes, str]
    sim: Simulation

    def follow_up(self, request: Request) -> None: ...


class WorkloadEngine:
    """One engine's scheduler, model runner and connector."""

    def __init__(self, workload: Workload, engine: SimEngine) -> None:
        self.workload = workload
        self.engine = engine
        self.rng = workload.rng
        self.stats = workload.stats
        self.ns_id = namespace_id(engine.namespace)
        self.waiting: deque[Request] = deque()
        self.active: list[Request] = []
        """Requests with an owner, in admission order."""
        self.free = {pool_id: set(range(1, spec.num_blocks)) for pool_id, spec in engine.pools.items()}
        """The slots the coordinator has free, as its allocations and freed notices say."""
        self.encoder_entries: dict[str, int] = {}
        """The entries the coordinator holds for this engine (least recently used first)."""
        self.encoder_refs: dict[str, int] = {}
        self.runner = EncoderRunner(engine.namespace)
        self.encode_now: list[str] = []
        self.pending: dict[int, int] = {}
        """Job id -> the iteration from which the workers run it."""
        self.loads: dict[int, tuple[Request, int]] = {}
        self.iteration = 0

    # --- one scheduler iteration -------------------------------------------------------------

    async def tick(self, iteration: int) -> None:
        self.iteration = iteration
        batch = Batch()
        for request in list(self.active):
            self._report(request, batch)
        for request in list(self.active):
            self._store_or_finish(request, batch)
        budget = TOKEN_BUDGET
        room = {pool_id: len(free) for pool_id, free in self.free.items()}
        for request in list(self.active):
            if request in self.active and request.phase in ("prefill", "decode") and budget > 0:
                budget = self._schedule(request, batch, room, budget, may_preempt=True)
        for request in list(self.active):
            if request.phase == "admitted" and budget > 0:
                budget = await self._schedule_new(request, batch, room, budget)
        while self.waiting and len(self.active) < MAX_RUNNING:
            self._admit(self.waiting.popleft(), batch)
        await self._step(batch)
        for request in list(self.active):
            if request.phase == "load_alloc":
                request.phase = "prefill" if request.blocked else "load_ready"
                if request.blocked:
                    request.plan = None
            elif request.work is not None and not request.blocked:
                self._forward(request)
            request.work, request.blocked = None, False
        await self.run_workers(iteration)

    def _report(self, request: Request, batch: Batch) -> None:
        """What the last forward pass computed, and the load of a hit whose blocks the last
        step allocated. Loads go before any store of the step, as a connector starts loads at
        scheduling and saves after the forward: a store's eviction never takes what a load of
        the same step relies on."""
        engine_id = self.engine.engine_id
        owner = request.owner
        assert owner is not None
        if request.mark_attn is not None:
            first, end = request.mark_attn
            batch.add(
                MarkComputed(
                    engine_id=engine_id,
                    owner_id=owner,
                    blocks=request.attention[first:end],
                    token_ids=request.tokens[first * ATTENTION_BLOCK : end * ATTENTION_BLOCK],
                    parent_key=self._parent(request, first * ATTENTION_BLOCK, ATTENTION_BLOCK),
                    extra_keys=request.extra,
                )
            )
            request.mark_attn = None
        for boundary in request.mark_states:
            batch.add(
                MarkComputed(
                    engine_id=engine_id,
                    owner_id=owner,
                    blocks=[request.states[boundary]],
                    token_ids=request.tokens[boundary - STATE_BLOCK : boundary],
                    parent_key=self._parent(request, boundary - STATE_BLOCK, STATE_BLOCK),
                    extra_keys=request.extra,
                )
            )
        request.mark_states = []
        if request.phase != "load_ready":
            return
        assert request.plan is not None
        boundary, attention_keys, state_key = request.plan
        items = [LoadRequest(key, dest) for key, dest in zip(attention_keys, request.attention, strict=False)]
        items.append(LoadRequest(state_key, request.spare[0]))
        attempt = request.attempt
        request.phase = "load_started"

        def loading(events: Sequence[Event]) -> None:
            started = [e for e in events if isinstance(e, LoadJobStarted)]
            if request.attempt != attempt:
                return
            if started:
                request.phase = "loading"
                self.loads[started[0].job_id] = (request, attempt)
                self.pending[started[0].job_id] = self.iteration + self.rng.choice(LOAD_DELAYS)
                self.stats.loads += 1
            else:  # refused (a key left the tier since the lookup): compute instead
                request.phase, request.plan = "prefill", None

        batch.add(StartLoad(engine_id=engine_id, tier=TIER, items=items), loading)

    def _store_or_finish(self, request: Request, batch: Batch) -> None:
        """Store a prompt whose prefill finished (its last blocks were marked just before); let
        a finished request go (after its store: the store pins its blocks, I3)."""
        engine_id = self.engine.engine_id
        owner = request.owner
        assert owner is not None
        if request.store_next:
            request.store_next = False
            blocks = request.attention[: request.prompt_len // ATTENTION_BLOCK]
            blocks += [request.states[boundary] for boundary in sorted(request.states)]
            batch.add(StartStore(engine_id=engine_id, tier=TIER, blocks=blocks), self._stored)
        if request.finish_next:
            self._verify(request)
            batch.add(FinishOwner(engine_id=engine_id, owner_id=owner, reason="finished", req_id=request.req_id))
            self._release_encoder(request)
            self.active.remove(request)
            request.phase = "finished"
            self.stats.finished += 1
            self.workload.follow_up(request)

    def _stored(self, events: Sequence[Event]) -> None:
        for event in events:
            if isinstance(event, StoreJobStarted) and event.items:
                # A store with nothing new succeeded in the step itself: nothing for workers.
                self.pending[event.job_id] = self.iteration + self.rng.choice(STORE_DELAYS)
                self.stats.stores += 1
                for item in event.items:
                    self.workload.stored_by[item.key] = self.engine.engine_id

    def _parent(self, request: Request, end: int, block_size: int) -> bytes | None:
        """The chained key of the block that ends at token `end` in a group (None at 0)."""
        if end == 0:
            return None
        return chain_keys(self.ns_id, request.tokens[:end], block_size, request.extra)[-1]

    def _admit(self, request: Request, batch: Batch) -> None:
        attempt = request.attempt

        def started(events: Sequence[Event]) -> None:
            owner = [e.owner_id for e in events if isinstance(e, OwnerStarted)]
            if owner and request.attempt == attempt:
                request.owner, request.phase = owner[0], "admitted"
            elif request.attempt == attempt:
                self.active.remove(request)
                request.phase = "waiting"
                self.waiting.appendleft(request)

        request.prompt_len = len(request.tokens)
        request.phase = "admitting"
        self.active.append(request)
        batch.add(StartOwner(engine_id=self.engine.engine_id, req_id=request.req_id, resumed=request.resumed), started)

    def _schedule(self, request: Request, batch: Batch, room: dict[int, int], budget: int, *, may_preempt: bool) -> int:
        """Plan this iteration's work for a running request: a prefill chunk or decode tokens,
        the blocks they need (preempting from the back when the pool is short), the image."""
        if request.phase == "decode":
            count = min(DECODE_TOKENS, request.max_tokens - len(request.tokens))
            if count <= 0:
                return budget
            end = len(request.tokens) + count
            work = ("decode", count)
            need_state = 0
        else:
            left = request.prompt_len - request.done
            chunk = min(left, MAX_CHUNK, budget)
            if chunk < left:
                chunk = chunk // STATE_BLOCK * STATE_BLOCK  # chunks end on a state block (align mode)
            if chunk <= 0:
                return budget
            end = request.done + chunk
            count = chunk
            work = ("prefill", end)
            need_state = max(0, (1 if end % STATE_BLOCK == 0 else 0) - len(request.spare))
        need_attention = max(0, -(-end // ATTENTION_BLOCK) - len(request.attention))
        short = room[ATTENTION] < need_attention or room[STATE] < need_state
        if short and not may_preempt:
            return budget  # a request not yet running waits for blocks; it does not preempt
        if work[0] == "prefill" and not self._encoder_for(request, request.done, end, batch):
            return budget
        while room[ATTENTION] < need_attention or room[STATE] < need_state:
            # vLLM: preempt from the back of the running requests until this one fits, or itself.
            position = self.active.index(request)
            victims = [r for r in self.active[position + 1 :] if r.holds_blocks() and r.phase in ("prefill", "decode")]
            victim = victims[-1] if victims else request
            self._preempt(victim, batch, room)
            if victim is request:
                return budget
        self._allocate(request, ATTENTION, need_attention, batch, room)
        self._allocate(request, STATE, need_state, batch, room)
        request.work = work
        return budget - count

    async def _schedule_new(self, request: Request, batch: Batch, room: dict[int, int], budget: int) -> int:
        """A request's first iteration: look its prompt up in the tier (read-only); on a hit,
        allocate the blocks to load it into; otherwise start its prefill."""
        answer = (await self.engine.client.lookup(TIER, request.tokens[: request.prompt_len - 1], request.extra)).answer
        if isinstance(answer, PrefixLookedUp) and answer.boundary:
            groups = {hit.pool_id: hit.keys for hit in answer.hits}
            attention_keys, [state_key] = groups[ATTENTION], groups[STATE]
            if room[ATTENTION] < len(attention_keys) or room[STATE] < 1:
                return budget  # wait for blocks; a new request does not preempt running ones
            request.plan = (answer.boundary, attention_keys, state_key)
            request.phase = "load_alloc"
            self._allocate(request, ATTENTION, len(attention_keys), batch, room)
            self._allocate(request, STATE, 1, batch, room)
            return budget
        request.phase = "prefill"
        left = self._schedule(request, batch, room, budget, may_preempt=False)
        if request.work is None:
            request.phase = "admitted"
        return left

    def _allocate(self, request: Request, pool_id: int, count: int, batch: Batch, room: dict[int, int]) -> None:
        if count <= 0:
            return
        assert request.owner is not None
        room[pool_id] -= count
        attempt = request.attempt

        def allocated(events: Sequence[Event]) -> None:
            if request.attempt != attempt:
                return
            got = [e for e in events if isinstance(e, BlocksAllocated)]
            if not got:  # refused: a slot still pinned by a job in flight, say; try again next time
                request.blocked = True
                return
            (request.attention if pool_id == ATTENTION else request.spare).extend(got[0].blocks)

        batch.add(
            AllocateBlocks(engine_id=self.engine.engine_id, owner_id=request.owner, pool_id=pool_id, count=count), allocated
        )

    def _encoder_for(self, request: Request, start: int, end: int, batch: Batch) -> bool:
        """The image's encoder output is cached before a chunk that covers its tokens; False
        when there is no room for it now (the request waits)."""
        if request.image is None or request.encoder_ref:
            return True
        entry_id, first, last = request.image
        if end <= first or start >= last:
            return True
        tokens = last - first
        engine_id = self.engine.engine_id
        if entry_id in self.encoder_entries:
            self.encoder_entries[entry_id] = self.encoder_entries.pop(entry_id)  # most recently used
        else:
            used = sum(self.encoder_entries.values())
            idle = [e for e in self.encoder_entries if not self.encoder_refs.get(e)]
            while used + tokens > ENCODER_TOKENS and idle:
                evicted = idle.pop(0)
                used -= self.encoder_entries.pop(evicted)
                batch.add(FreeEncoderEntry(engine_id=engine_id, entry_id=evicted))
            if used + tokens > ENCODER_TOKENS:
                return False
            self.encoder_entries[entry_id] = tokens
            attempt = request.attempt

            def allocated(events: Sequence[Event]) -> None:
                if any(isinstance(e, EncoderEntryAllocated) for e in events):
                    self.encode_now.append(entry_id)
                    return
                self.encoder_entries.pop(entry_id, None)  # refused: the request waits
                if request.attempt == attempt:
                    request.blocked = True
                    self._release_encoder(request)

            batch.add(AllocateEncoderEntry(engine_id=engine_id, entry_id=entry_id, num_tokens=tokens), allocated)
        self.encoder_refs[entry_id] = self.encoder_refs.get(entry_id, 0) + 1
        request.encoder_ref = True
        return True

    def _release_encoder(self, request: Request) -> None:
        if request.encoder_ref and request.image is not None:
            entry_id = request.image[0]
            self.encoder_refs[entry_id] -= 1
        request.encoder_ref = False

    def _preempt(self, request: Request, batch: Batch, room: dict[int, int]) -> None:
        """Preempted: its blocks go back (once no job pins them), it waits at the front and
        resumes as a new owner under the same req_id, recomputing what it had."""
        assert request.owner is not None
        self._verify(request)
        for ref in request.held():
            room[ref.pool_id] += 1  # optimistic: a slot a store still pins frees later
        batch.add(FinishOwner(engine_id=self.engine.engine_id, owner_id=request.owner, reason="preempted", req_id=request.req_id))
        self._release_encoder(request)
        self.active.remove(request)
        self._requeue(request)
        self.stats.preemptions += 1

    def _requeue(self, request: Request) -> None:
        request.attempt += 1
        request.owner, request.phase, request.resumed = None, "waiting", True
        request.attention, request.states, request.spare = [], {}, []
        request.computed = request.done = 0
        request.mark_attn, request.mark_states = None, []
        request.store_next = request.finish_next = False
        request.plan, request.work, request.blocked, request.hit_from_other = None, None, False, None
        self.waiting.appendleft(request)

    # --- the step and the forward pass ---------------------------------------------------------

    async def _step(self, batch: Batch) -> None:
        started = time.perf_counter()
        result = await self.engine.step(batch.commands)
        self.stats.step_seconds.append(time.perf_counter() - started)
        for handler, events in zip(batch.handlers, result.results, strict=True):
            handler(events)
        for events in result.results:
            for event in events:
                if isinstance(event, BlocksAllocated):
                    for ref in event.blocks:
                        self.free[ref.pool_id].discard(ref.block_id)
                elif isinstance(event, KeyEvicted):
                    self.stats.evictions += 1
        for event in result.ended:
            if isinstance(event, StepEnded):
                for ref in event.freed_blocks:
                    self.free[ref.pool_id].add(ref.block_id)
                self.runner.evict(event.freed_encoder_entries)
        for entry_id in self.encode_now:
            self.runner.encode(entry_id)
        self.encode_now = []

    def _forward(self, request: Request) -> None:
        """The forward pass for one request: write what compute gives into its blocks (all
        ranks), to be marked computed in the next step."""
        assert request.work is not None
        kind, amount = request.work
        engine = self.engine
        if request.hit_from_other is not None:  # the forward runs on the loaded prefix: a hit used
            self.stats.hits += 1
            self.stats.cross_engine_hits += request.hit_from_other
            request.hit_from_other = None
        if kind == "decode":
            request.tokens += [self.rng.randrange(VOCABULARY) for _ in range(amount)]
            end = len(request.tokens)
        else:
            end = amount
            if request.image is not None:
                entry_id, first, last = request.image
                if request.done < last and end > first:  # the chunk reads the image's encoder output
                    self.stats.encoder_reads += 1
                    self.workload.sim.tally.loads_checked += 1
                    self.workload.sim.tally.wrong_reads += not self.runner.read_ok(entry_id)
                if end >= last:
                    self._release_encoder(request)
        full = end // ATTENTION_BLOCK
        if full > request.computed:
            engine.compute(request.attention[request.computed : full], request.tokens, first_block=request.computed)
            request.mark_attn = (request.computed, full)
            request.computed = full
        if kind == "prefill" and end % STATE_BLOCK == 0:
            state = request.spare.pop(0)
            engine.compute([state], request.tokens, first_block=end // STATE_BLOCK - 1)
            request.states[end] = state
            request.mark_states.append(end)
        request.done = end
        if kind == "prefill" and end == request.prompt_len:
            request.phase = "decode"
            request.store_next = True
        if len(request.tokens) >= request.max_tokens and request.done == len(request.tokens):
            request.finish_next = True

    def _verify(self, request: Request) -> None:
        """Every block the request computed or loaded still holds what recompute gives."""
        computed = request.attention[: request.computed]
        holdings = [(ref, request.tokens[: (index + 1) * ATTENTION_BLOCK]) for index, ref in enumerate(computed)]
        holdings += [(ref, request.tokens[:boundary]) for boundary, ref in request.states.items()]
        tally = self.workload.sim.tally
        for ref, prefix in holdings:
            if any(
                not torch.equal(w.pools.block(ref), self.engine.expected_bytes(prefix, ref.pool_id, w.rank))
                for w in self.engine.workers
            ):
                tally.wrong_reads += 1
        self.stats.blocks_verified += len(holdings)

    # --- workers ---------------------------------------------------------------------------------

    async def run_workers(self, iteration: int | None) -> None:
        """Let the workers run the decisions that are due (all of them when `iteration` is None)."""
        due = frozenset(job for job, at in self.pending.items() if iteration is None or at <= iteration)
        if not due:
            return
        for job in due:
            del self.pending[job]
        for event in await self.engine.execute(only=due):
            if isinstance(event, JobSucceeded | JobFailed | JobFenced) and event.job_id in self.loads:
                request, attempt = self.loads.pop(event.job_id)
                if request.attempt == attempt:
                    self._landed(request, isinstance(event, JobSucceeded), event.kept if isinstance(event, JobFailed) else 0)

    def _landed(self, request: Request, ok: bool, kept: int = 0) -> None:
        """A prefix load finished: check what landed before the request uses it. A failed one
        keeps its first `kept` items (JobFailed.kept: attention blocks, loaded and verified)."""
        assert request.plan is not None
        boundary, attention_keys, state_key = request.plan
        request.plan = None
        request.phase = "prefill"
        if not ok:  # recompute from the start, in the blocks it holds, over none of the kept ones
            kept = min(kept, len(attention_keys), len(request.attention))
            if kept:
                kept_blocks = request.attention[:kept]
                self.engine.check(
                    [(ref, request.tokens[: (index + 1) * ATTENTION_BLOCK]) for index, ref in enumerate(kept_blocks)]
                )
                request.computed = kept
            return
        loaded = request.attention[: len(attention_keys)]
        state = request.spare.pop(0)
        holdings = [(ref, request.tokens[: (index + 1) * ATTENTION_BLOCK]) for index, ref in enumerate(loaded)]
        holdings.append((state, request.tokens[:boundary]))
        self.engine.check(holdings)
        request.computed = len(attention_keys)
        request.states[boundary] = state
        request.done = boundary
        request.hit_from_other = self.workload.stored_by.get(state_key) != self.engine.engine_id

    def in_flight(self, *, loads: bool) -> bool:
        """Whether a store (or, with `loads`, a load) of this engine waits for the workers."""
        return any((job in self.loads) == loads for job in self.pending)

    # --- reset -------------------------------------------------------------------------------------

    async def reset(self, *, late_loads: bool = False) -> None:
        """A cache reset outside any step. In-flight loads land first: the reset frees the
        slots they write into, which the next allocations hand out again (`late_loads` leaves
        them in flight, landing LATE_LOAD iterations later: that shows the wrong-KV reads).
        Stores may still be in flight: their reports come late and are dropped (I16). Every
        request starts over as a new owner under its req_id."""
        loads = frozenset(job for job in self.pending if job in self.loads)
        if late_loads:
            for job in loads:
                self.pending[job] = self.iteration + LATE_LOAD
        elif loads:
            for job in loads:
                self.pending[job] = self.iteration
            await self.run_workers(self.iteration)
        reset = ResetCache(engine_id=self.engine.engine_id, reason="reset_prefix_cache")
        committed = await self.engine.client.execute(reset)
        self.workload.sim.tally.record(committed.events)
        self.stats.resets += 1
        for request in reversed(self.active):
            self._release_encoder(request)
            self._requeue(request)
        self.active = []
        self.loads = {}
        self.free = {pool_id: set(range(1, spec.num_blocks)) for pool_id, spec in self.engine.pools.items()}
        self.encoder_entries, self.encoder_refs, self.encode_now = {}, {}, []
        self.runner.evict(list(self.runner.where))
