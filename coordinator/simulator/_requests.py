"""The mixed workload's model of an engine's requests: the workload's sizes and rates, a
request's way through the scheduler (Request, Phase), the counters (Stats), one step's commands
(Batch), the encoder runner, and the engines' namespace and pools. coordinator/simulator/_scheduler.py
runs the scheduler iterations over them."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Literal

import torch

from coordinator.core.commands import AnyCommand
from coordinator.simulator.content import kv_bytes
from events import BlockRef, Event, NamespaceSpec, PoolSpec

ATTENTION = 0
STATE = 1
ATTENTION_BLOCK = 16
STATE_BLOCK = 32
"""The reuse unit is lcm(16, 32) = 32 tokens."""
BLOCK_BYTES = 64
"""Bytes one rank holds of one block (its tensor-parallel shard): small, so runs are fast."""
ATTENTION_BLOCKS = 65
"""Per engine, the null block included: 64 usable, about four requests' worth."""
STATE_BLOCKS = 25
ENCODER_TOKENS = 96
"""The encoder cache holds two or three images."""
IMAGE_TOKENS = (32, 48)
ENCODER_BYTES = 64
ENCODER_GROUP = 1 << 16
"""The group id encoder outputs are hashed under (no pool has it)."""
TIER_SLOTS = 96
"""The tier size the workload is meant for: `Simulation(..., tier_slots=TIER_SLOTS)` (stores evict)."""

TOKEN_BUDGET = 192
"""Tokens one forward pass may compute (vLLM's max_num_batched_tokens)."""
MAX_CHUNK = 64
"""Prompt tokens one request may prefill per iteration (long prompts take several)."""
DECODE_TOKENS = 4
MAX_RUNNING = 6
MAX_WAITING = 8
MAX_CONTEXT = 400
ARRIVAL = 0.3
"""Chance that a new conversation arrives at an engine in an iteration."""
FOLLOW_UP = 0.4
"""Chance that a finished request's conversation goes on (at either engine)."""
IMAGE_SHARE = 0.3
IMAGES = 5
SYSTEM_PROMPTS = 3
STORE_DELAYS = (0, 0, 1, 2, 3)
"""Iterations a store waits before the workers run it."""
LOAD_DELAYS = (0, 0, 1)
LATE_LOAD = 6
"""Iterations a load left in flight across the reset waits (run_workload(late_loads_at_reset=True))."""
VOCABULARY = 50_000


Phase = Literal[
    "waiting",
    "admitting",
    "admitted",
    "load_alloc",
    "load_ready",
    "load_started",
    "loading",
    "prefill",
    "decode",
    "finished",
]
"""A request's way: waiting -> admitting (StartOwner sent) -> admitted (an owner; next, its lookup)
-> on a hit: load_alloc -> load_ready -> load_started -> loading (the job in flight) -> prefill
(from the boundary, or from 0) -> decode -> finished. Preempted or reset: waiting again."""


@dataclass(eq=False)
class Request:
    req_id: str
    tokens: list[int]
    """Prompt and output so far."""
    max_tokens: int
    extra: list[str]
    """Extra keys of every block (the image's hash)."""
    image: tuple[str, int, int] | None
    """(entry id, first token, end) of the image placeholder, or None."""
    prompt_len: int = 0
    """Tokens this attempt prefills (prompt and output so far, for a resumption)."""
    resumed: bool = False
    attempt: int = 0
    owner: int | None = None
    phase: Phase = "waiting"
    attention: list[BlockRef] = field(default_factory=list)
    computed: int = 0
    """Attention blocks whose KV is written (computed, or loaded)."""
    states: dict[int, BlockRef] = field(default_factory=dict)
    """Token boundary -> the state block holding the state there (computed or loaded)."""
    spare: list[BlockRef] = field(default_factory=list)
    """State blocks allocated and not yet written."""
    done: int = 0
    """Tokens whose KV is computed."""
    mark_attn: tuple[int, int] | None = None
    mark_states: list[int] = field(default_factory=list)
    store_next: bool = False
    finish_next: bool = False
    encoder_ref: bool = False
    plan: tuple[int, list[bytes], bytes] | None = None
    """A prefix hit to load: (boundary, attention keys, the state key at the boundary)."""
    work: tuple[str, int] | None = None
    """What this iteration's forward does: ("prefill", chunk end) or ("decode", tokens)."""
    blocked: bool = False
    hit_from_other: bool | None = None
    """A loaded prefix not used yet: whether another engine stored it."""

    def holds_blocks(self) -> bool:
        return bool(self.attention or self.states or self.spare)

    def held(self) -> list[BlockRef]:
        return [*self.attention, *self.states.values(), *self.spare]


@dataclass
class Stats:
    requests: int = 0
    hits: int = 0
    preemptions: int = 0
    resets: int = 0
    evictions: int = 0
    stores: int = 0
    loads: int = 0
    blocks_verified: int = 0
    cross_engine_hits: int = 0
    encoder_reads: int = 0
    finished: int = 0
    step_seconds: list[float] = field(default_factory=list)


Handler = Callable[[Sequence[Event]], None]


def _ignore(events: Sequence[Event]) -> None:
    pass


class Batch:
    """The commands of one step, each with what to do with its events."""

    def __init__(self) -> None:
        self.commands: list[AnyCommand] = []
        self.handlers: list[Handler] = []

    def add(self, command: AnyCommand, handler: Handler = _ignore) -> None:
        self.commands.append(command)
        self.handlers.append(handler)


class EncoderRunner:
    """The model runner's encoder cache: a slot per image output, filled when the scheduler
    allocated an entry in the step, evicted when StepEnded says the entry was freed."""

    def __init__(self, namespace: NamespaceSpec) -> None:
        self.namespace = namespace
        self.data = torch.zeros((ENCODER_TOKENS // min(IMAGE_TOKENS) + 1, ENCODER_BYTES), dtype=torch.uint8)
        self.where: dict[str, int] = {}

    def output(self, entry_id: str) -> torch.Tensor:
        """What the encoder computes for this image."""
        return kv_bytes(self.namespace, list(entry_id.encode()), ENCODER_GROUP, 0, ENCODER_BYTES)

    def evict(self, entry_ids: Sequence[str]) -> None:
        for entry_id in entry_ids:
            self.where.pop(entry_id, None)

    def encode(self, entry_id: str) -> None:
        if entry_id not in self.where:
            used = set(self.where.values())
            self.where[entry_id] = next(slot for slot in range(self.data.shape[0]) if slot not in used)
        self.data[self.where[entry_id]] = self.output(entry_id)

    def read_ok(self, entry_id: str) -> bool:
        slot = self.where.get(entry_id)
        return slot is not None and torch.equal(self.data[slot], self.output(entry_id))


def namespace(world_size: int) -> NamespaceSpec:
    return NamespaceSpec(
        model_id="org/hybrid-8b",
        weights_revision="sha256:weights-1",
        tokenizer_digest="sha256:tokenizer-1",
        kv_dtype="bfloat16",
        kv_layout_version=1,
        block_sizes=(ATTENTION_BLOCK, STATE_BLOCK),
        tensor_parallel_size=world_size,
        tenant="tenant-a",
    )


def pools() -> list[PoolSpec]:
    return [
        PoolSpec(
            pool_id=ATTENTION,
            kind="attention",
            num_blocks=ATTENTION_BLOCKS,
            block_size=ATTENTION_BLOCK,
            bytes_per_block=BLOCK_BYTES,
        ),
        PoolSpec(pool_id=STATE, kind="state", num_blocks=STATE_BLOCKS, block_size=STATE_BLOCK, bytes_per_block=BLOCK_BYTES),
    ]
