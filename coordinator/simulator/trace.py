"""Replaying a production request trace through the pure core, as vLLM's offloading manager
drives kvledger (issue 20).

The trace format is Mooncake's (FAST'25 release; ../shared/traces/README.md): one JSON object a
line, `timestamp` (ms), `input_length`, `output_length`, and `hash_ids`, the prompt's prefix
blocks of 512 tokens as chained ids (an id stands for its whole prefix, so it alone names the
block). Each request, in timestamp order, is what vLLM's scheduler does with kvledger as its
offloading spec (coordinator/vllm/offload.py):

1. look the request's key chain up (read-only, as the sidecar answers LookupKeys) and take the
   hit up to the first miss;
2. in one step, load the hit prefix (LoadExternal: leased, I12) and store the chain
   (StoreExternal: the published keys are skipped and kept, the new ones get slots, the least
   recently used keys no lease holds are evicted, or the store is refused TIER_FULL whole);
3. the one worker rank reports both jobs (its checksums: the published ones for the load), so the
   load touches its keys and the store publishes the new ones (I5).

An engine's clock is the request's timestamp. Pure: no I/O but `read_trace`.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence
from itertools import islice
from pathlib import Path

import msgspec

from coordinator.core import CoordinatorCore
from coordinator.core.commands import (
    AnyCommand,
    DeclareEngine,
    DeclareTier,
    ExternalKey,
    LoadExternal,
    LookupExternal,
    ReportRank,
    StoreExternal,
)
from coordinator.core.external import answer_lookup
from events import (
    Event,
    ExternalLoadStarted,
    ExternalStoreStarted,
    KeyEvicted,
    NamespaceSpec,
    PoolSpec,
    Reason,
    Refused,
    TierSpec,
)

SHIPPED_TRACE = Path(__file__).resolve().parent / "traces" / "mooncake_conversation_trace_head1000.jsonl"
"""The first 1,000 requests of Mooncake's conversation trace (traces/README.md: source, licence)."""
TRACE_BLOCK = 512
"""Tokens of one trace block (Mooncake's hash_ids)."""
TIER = "trace-tier"
LEASE_SECONDS = 60.0


class TraceRequest(msgspec.Struct, frozen=True):
    timestamp: int
    input_length: int
    output_length: int
    hash_ids: list[int]


class TraceError(ValueError):
    """A trace line that is not a request of the format; names the file and the line."""


_decoder = msgspec.json.Decoder(TraceRequest)


def parse_trace(lines: Iterable[bytes | str], name: str = "trace") -> list[TraceRequest]:
    """The requests of `lines` (blank ones skipped) in timestamp order (stable: ties keep theirs)."""
    requests = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            request = _decoder.decode(line)
        except msgspec.DecodeError as error:
            raise TraceError(f"{name}:{number}: not a trace request ({error})") from None
        if request.timestamp < 0 or any(block < 0 for block in request.hash_ids):
            raise TraceError(f"{name}:{number}: a negative timestamp or hash id")
        requests.append(request)
    return sorted(requests, key=lambda request: request.timestamp)


def read_trace(path: Path) -> list[TraceRequest]:
    with path.open("rb") as lines:
        return parse_trace(lines, str(path))


def block_keys(hash_ids: list[int]) -> list[ExternalKey]:
    """The engine key of each trace block: its id, 8 bytes big-endian, in group 0 (one loop a
    request, no call a block)."""
    return [ExternalKey(0, hash_id.to_bytes(8, "big")) for hash_id in hash_ids]


def block_key(hash_id: int) -> ExternalKey:
    """The engine key of one trace block (`block_keys`)."""
    return block_keys([hash_id])[0]


def tier_spec(slots: int) -> TierSpec:
    return TierSpec(name=TIER, num_slots=slots, bytes_per_slot=TRACE_BLOCK)


def declaration(engine_id: str) -> DeclareEngine:
    """A trace engine: one namespace for all (they share the tier's keys), one reported pool (the
    engine owns its device blocks, as vLLM does), one rank."""
    namespace = NamespaceSpec(
        model_id="trace-model",
        weights_revision="sha256:trace",
        tokenizer_digest="sha256:trace",
        kv_dtype="bfloat16",
        kv_layout_version=1,
        block_sizes=(TRACE_BLOCK,),
        tensor_parallel_size=1,
        tenant="trace",
    )
    pool = PoolSpec(
        pool_id=0, kind="attention", num_blocks=1 << 20, block_size=TRACE_BLOCK, bytes_per_block=TRACE_BLOCK, managed=False
    )
    return DeclareEngine(engine_id=engine_id, namespace=namespace, pools=[pool], world_size=1, tiers=[TIER])


def plan(engine_id: str, keys: list[ExternalKey], loadable: Sequence[bool]) -> tuple[int, list[AnyCommand]]:
    """The hit (blocks up to the first miss) and the step's commands: load it, store the chain."""
    hit = next((index for index, found in enumerate(loadable) if not found), len(keys))
    commands: list[AnyCommand] = []
    if hit:
        commands.append(LoadExternal(engine_id=engine_id, tier=TIER, keys=keys[:hit], lease_seconds=LEASE_SECONDS))
    if keys:
        commands.append(StoreExternal(engine_id=engine_id, tier=TIER, keys=keys))
    return hit, commands


class Outcome(msgspec.Struct):
    reports: list[ReportRank]
    """The worker's: the load's with the published checksums, the store's with its bytes'."""
    stored: int = 0
    refused: int = 0
    """Stores refused TIER_FULL (every slot leased or being written, or too few for the chain)."""


def outcome(events: Iterable[Event]) -> Outcome:
    """What a request's step decided; RuntimeError on any refusal but a full tier."""
    result = Outcome(reports=[])
    for event in events:
        if isinstance(event, KeyEvicted):  # most of a step's events, and nothing to report
            continue
        if isinstance(event, ExternalLoadStarted):
            checksums = [item.checksums[0] for item in event.items]
            result.reports.append(ReportRank(job_id=event.job_id, rank=0, ok=True, checksums=checksums))
        elif isinstance(event, ExternalStoreStarted) and event.items:
            checksums = [item.key for item in event.items]  # the bytes' checksum: any, stable
            result.reports.append(ReportRank(job_id=event.job_id, rank=0, ok=True, checksums=checksums))
            result.stored += len(event.items)
        elif isinstance(event, Refused):
            if event.reason != Reason.TIER_FULL:
                raise RuntimeError(f"the trace replay was refused: {event.command}: {event.reason}: {event.detail}")
            result.refused += 1
    return result


class Tally:
    """What a replay counted."""

    def __init__(self) -> None:
        self.requests = 0
        self.blocks = 0
        self.hit_blocks = 0
        self.stored_blocks = 0
        self.refused_stores = 0
        self.decisions = 0
        """Commands decided: lookups, loads, stores and reports."""

    def count(self, blocks: int, hit: int, commands: int, result: Outcome) -> None:
        self.requests += 1
        self.blocks += blocks
        self.hit_blocks += hit
        self.stored_blocks += result.stored
        self.refused_stores += result.refused
        self.decisions += 1 + commands + len(result.reports)


class CoreReplay(Tally):
    """The trace through one CoordinatorCore: `engines` engines of one namespace sharing a tier of
    `slots` slots (requests dealt round-robin), one rank each."""

    def __init__(self, slots: int, engines: int = 1) -> None:
        super().__init__()
        if slots < 1 or engines < 1:
            raise ValueError(f"a replay needs at least one slot and one engine, not {slots} and {engines}")
        self.core = CoordinatorCore(keep_events=False)
        self.core.execute(DeclareTier(spec=tier_spec(slots)))
        self.engines = [f"trace-{n}" for n in range(engines)]
        for engine in self.engines:
            self.core.execute(declaration(engine))
        self.steps = dict.fromkeys(self.engines, 0)

    def replay(self, request: TraceRequest) -> int:
        """One request; the blocks it hit."""
        engine = self.engines[self.requests % len(self.engines)]
        keys = block_keys(request.hash_ids)
        answer = answer_lookup(self.core.state, LookupExternal(engine_id=engine, tier=TIER, keys=keys))
        hit, commands = plan(engine, keys, answer.loadable)
        self.steps[engine] += 1
        result = outcome(self.core.run_step(engine, self.steps[engine], request.timestamp / 1000, commands))
        for report in result.reports:
            self.core.execute(report)
        self.count(len(keys), hit, len(commands), result)
        return hit

    def replay_all(self, requests: Iterable[TraceRequest]) -> int:
        for request in requests:
            self.replay(request)
        return self.hit_blocks


class LruTier:
    """The reference a reader checks kvledger's replay against, with no kvledger in it: a tier of
    `slots` blocks kept in least-recently-used order that never evicts a block the current
    request relies on. Per request: the hit is the chain up to the first block it does not hold;
    the hit blocks are used, in order; the request's blocks it does not hold are stored, in
    order, evicting the least recently used blocks the request does not hold, or, when they
    cannot all fit, none of them (kvledger refuses such a store TIER_FULL, whole)."""

    def __init__(self, slots: int) -> None:
        if slots < 1:
            raise ValueError(f"a tier needs at least one slot, not {slots}")
        self.slots = slots
        self.blocks: OrderedDict[int, None] = OrderedDict()
        self.hit_blocks = 0
        self.refused_stores = 0

    def replay(self, request: TraceRequest) -> int:
        """One request; the blocks it hit."""
        chain = request.hash_ids
        hit = 0
        while hit < len(chain) and chain[hit] in self.blocks:
            hit += 1
        self.hit_blocks += hit
        missing = [block for block in dict.fromkeys(chain) if block not in self.blocks]
        relied_on = set(chain) & self.blocks.keys()
        evictable = len(self.blocks) - len(relied_on)
        fits = len(missing) <= self.slots - len(relied_on)
        for block in chain[:hit]:
            self.blocks.move_to_end(block)
        if not fits:
            self.refused_stores += 1
            return hit
        to_evict = max(0, len(self.blocks) + len(missing) - self.slots)
        assert to_evict <= evictable
        for block in list(islice((block for block in self.blocks if block not in relied_on), to_evict)):
            del self.blocks[block]
        for block in missing:
            self.blocks[block] = None
        return hit


class BesideReference(msgspec.Struct, frozen=True):
    """A trace replayed through the pure core and through the reference LRU, at one capacity."""

    trace: str
    requests: int
    blocks: int
    slots: int
    hit_blocks: int
    reference_hit_blocks: int
    refused_stores: int
    reference_refused_stores: int

    @property
    def hit_rate(self) -> float:
        return self.hit_blocks / self.blocks if self.blocks else 0.0

    @property
    def reference_hit_rate(self) -> float:
        return self.reference_hit_blocks / self.blocks if self.blocks else 0.0

    @property
    def equal(self) -> bool:
        return (self.hit_blocks, self.refused_stores) == (self.reference_hit_blocks, self.reference_refused_stores)


def beside_reference(requests: Sequence[TraceRequest], slots: int, trace: str) -> BesideReference:
    """`requests` through CoreReplay and through LruTier, each on a tier of `slots` slots."""
    core, reference = CoreReplay(slots), LruTier(slots)
    for request in requests:
        core.replay(request)
        reference.replay(request)
    return BesideReference(
        trace=trace,
        requests=core.requests,
        blocks=core.blocks,
        slots=slots,
        hit_blocks=core.hit_blocks,
        reference_hit_blocks=reference.hit_blocks,
        refused_stores=core.refused_stores,
        reference_refused_stores=reference.refused_stores,
    )
