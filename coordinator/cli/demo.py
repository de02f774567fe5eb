"""The scripted demo: the seeds' failures played against the pure core, step by step.

Each action is one command; the demo records what the coordinator decided and which invariant
that shows. The workers are played by honest functions (checksums from the key and the rank)
except where a scene needs a liar.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import blake3
import msgspec

from coordinator.core import CoordinatorCore
from coordinator.core.commands import (
    AllocateBlocks,
    AllocateEncoderEntry,
    AnyCommand,
    DeclareEngine,
    DeclareTier,
    EndStep,
    FinishOwner,
    FreeBlocks,
    FreeEncoderEntry,
    LoadRequest,
    LookupPrefix,
    MarkComputed,
    Move,
    PlanStateCopy,
    ReportRank,
    ResetCache,
    StartLoad,
    StartOwner,
    StartStore,
    command_tag,
)
from coordinator.core.describe import describe
from coordinator.core.projector import project
from coordinator.core.state import state_digest
from coordinator.core.step import stepping
from events import (
    BlockRef,
    BlocksAllocated,
    Event,
    JobFailed,
    KeyQuarantined,
    LoadJobStarted,
    NamespaceSpec,
    NoticeDropped,
    OwnerStarted,
    PoolSpec,
    PrefixLookedUp,
    Refused,
    StoreJobStarted,
    TierSpec,
)

ATTENTION, STATE = 0, 1


class Row(msgspec.Struct, frozen=True):
    """One line of the demo table."""

    engine: str
    step: int
    command: str
    verdict: str
    """ok, refused, dropped or violation."""
    outcome: str
    shows: str
    """The invariant (and seed) the line demonstrates, if any."""


class DemoResult(msgspec.Struct, frozen=True):
    rows: list[Row]
    events: int
    digest: str
    replay_digest: str


def _verdict(events: list[Event]) -> str:
    if any(isinstance(e, Refused) for e in events):
        return "refused"
    if any(isinstance(e, NoticeDropped) for e in events):
        return "dropped"
    if any(isinstance(e, (KeyQuarantined, JobFailed)) for e in events):
        return "violation"
    return "ok"


def honest_checksum(key: bytes, rank: int) -> bytes:
    return blake3.blake3(key + bytes([rank])).digest(8)


def _namespace(tenant: str) -> NamespaceSpec:
    return NamespaceSpec(
        model_id="Qwen/Qwen3.5-9B",
        weights_revision="sha256:5f1c0d2e",
        tokenizer_digest="sha256:a41b77e0",
        kv_dtype="bfloat16",
        kv_layout_version=1,
        block_sizes=(4, 8),
        tensor_parallel_size=2,
        tenant=tenant,
    )


def run_demo() -> DemoResult:
    core = CoordinatorCore()
    rows: list[Row] = []
    steps: dict[str, int] = {}

    def do(command: AnyCommand, shows: str = "") -> list[Event]:
        return record(command, core.execute(command), shows)

    def record(command: AnyCommand, events: list[Event], shows: str) -> list[Event]:
        label = command_tag(command)
        engine_id = getattr(command, "engine_id", "")
        engine = core.state.engines.get(engine_id)
        rows.append(
            Row(
                engine_id or "-",
                max(engine.step, 0) if engine else 0,
                label,
                _verdict(events),
                "; ".join(describe(e) for e in events),
                shows,
            )
        )
        return events

    @contextmanager
    def demo_step(clock: float, shows: str = "", engine_id: str = "pod-a") -> Iterator[None]:
        """One step of `engine_id` (core/step.py's sequence); its end shows in the table."""
        step = steps[engine_id] = steps.get(engine_id, 0) + 1
        with stepping(core.execute, engine_id, step, clock) as events:
            yield
        record(EndStep(engine_id=engine_id), events.ended, shows)

    def first(events: list[Event], kind: type[Event]) -> Event:
        return next(e for e in events if isinstance(e, kind))

    def report(
        job_id: int, keys: list[bytes], shows: str = "", checksum: Callable[[bytes, int], bytes] = honest_checksum
    ) -> None:
        for rank in (1, 0):  # ranks report in any order
            do(ReportRank(job_id=job_id, rank=rank, ok=True, checksums=[checksum(k, rank) for k in keys]), shows)

    pools = [
        PoolSpec(pool_id=ATTENTION, kind="attention", num_blocks=8, block_size=4, bytes_per_block=64),
        PoolSpec(pool_id=STATE, kind="state", num_blocks=6, block_size=8, bytes_per_block=64),
    ]
    do(DeclareTier(spec=TierSpec(name="host", num_slots=16, bytes_per_slot=64)))
    do(
        DeclareEngine(
            engine_id="pod-a",
            namespace=_namespace("tenant-a"),
            pools=pools,
            world_size=2,
            tiers=["host"],
            encoder_cache_tokens=32,
        )
    )
    prompt = list(range(100, 116))  # 16 tokens: 4 attention blocks, 2 state blocks

    # Step 1: request A computes its prompt and starts an async store (seed 000).
    with demo_step(1.0):
        owner_a = first(do(StartOwner(engine_id="pod-a", req_id="req-A")), OwnerStarted).owner_id  # type: ignore[attr-defined]
        attn = first(do(AllocateBlocks(engine_id="pod-a", owner_id=owner_a, pool_id=ATTENTION, count=4)), BlocksAllocated).blocks  # type: ignore[attr-defined]
        state = first(do(AllocateBlocks(engine_id="pod-a", owner_id=owner_a, pool_id=STATE, count=1)), BlocksAllocated).blocks  # type: ignore[attr-defined]
        do(MarkComputed(engine_id="pod-a", owner_id=owner_a, blocks=attn, token_ids=prompt), "I8 chained keys")
        # The state pool keeps the state at token 8 only: token 16's state was never captured.
        do(MarkComputed(engine_id="pod-a", owner_id=owner_a, blocks=state, token_ids=prompt[:8]))
        store = first(
            do(StartStore(engine_id="pod-a", tier="host", blocks=[*attn, *state]), "I3 pins the blocks"), StoreJobStarted
        )
        assert isinstance(store, StoreJobStarted)
        do(StartStore(engine_id="pod-a", tier="host", blocks=[BlockRef(STATE, 0, 0)]), "I2 null block (seed 004)")

    # Step 2: A is preempted while its store is in flight; B allocates under pressure.
    with demo_step(2.0, "I14 no freed notice while draining"):
        do(FinishOwner(engine_id="pod-a", owner_id=owner_a, reason="preempted"), "I3 pinned blocks drain")
        owner_b = first(do(StartOwner(engine_id="pod-a", req_id="req-A", resumed=True)), OwnerStarted).owner_id  # type: ignore[attr-defined]
        do(AllocateBlocks(engine_id="pod-a", owner_id=owner_b, pool_id=ATTENTION, count=3), "I3 never a pinned slot")
        do(AllocateBlocks(engine_id="pod-a", owner_id=owner_b, pool_id=ATTENTION, count=1), "I3 draining slots stay out")

    # Step 3: the ranks report; the keys publish; a duplicate report changes nothing.
    with demo_step(3.0, "I14 drained blocks freed now"):
        keys = [item.key for item in store.items]
        report(store.job_id, keys, "I5 publish after every rank")
        do(ReportRank(job_id=store.job_id, rank=0, ok=True, checksums=[honest_checksum(k, 0) for k in keys]), "I4 stale report")

    # Step 4: a consumer sharing 12 tokens, then the full 16 (seeds 002 and 004).
    with demo_step(4.0, "I14 freed then reallocated: dropped"):
        do(LookupPrefix(engine_id="pod-a", tier="host", token_ids=prompt[:12] + [7, 7, 7, 7]), "I7 whole units: 8, not 12")
        do(LookupPrefix(engine_id="pod-a", tier="host", token_ids=prompt), "I6 state missing at 16: hit 8")
        do(FinishOwner(engine_id="pod-a", owner_id=owner_b))
        owner_c = first(do(StartOwner(engine_id="pod-a", req_id="req-C")), OwnerStarted).owner_id  # type: ignore[attr-defined]
        dest = first(do(AllocateBlocks(engine_id="pod-a", owner_id=owner_c, pool_id=ATTENTION, count=2)), BlocksAllocated).blocks  # type: ignore[attr-defined]
        old = BlockRef(dest[0].pool_id, dest[0].block_id, dest[0].generation - 1)
        do(FreeBlocks(engine_id="pod-a", owner_id=owner_c, blocks=[old]), "I1 stale generation")
        load = first(
            do(
                StartLoad(
                    engine_id="pod-a",
                    tier="host",
                    items=[LoadRequest(keys[0], dest[0]), LoadRequest(keys[0], dest[1])],
                    lease_seconds=5.0,
                ),
                "I11 duplicate key, two destinations",
            ),
            LoadJobStarted,
        )
        assert isinstance(load, LoadJobStarted)
        lie = lambda key, rank: honest_checksum(key, rank) if rank == 0 else b"\x00" * 8  # noqa: E731
        report(load.job_id, [keys[0], keys[0]], "I13 checksum mismatch", checksum=lie)
        do(StartLoad(engine_id="pod-a", tier="host", items=[LoadRequest(keys[0], dest[0])]), "I13 quarantined")

    # Step 5: an encoder entry evicted and re-allocated in one step (seed 000's third fix).
    with demo_step(5.0, "I14 stale freed notice dropped"):
        do(AllocateEncoderEntry(engine_id="pod-a", entry_id="img-1", num_tokens=16))
        do(FreeEncoderEntry(engine_id="pod-a", entry_id="img-1"))
        do(AllocateEncoderEntry(engine_id="pod-a", entry_id="img-1", num_tokens=16))

    # Step 6: overlapping state copies (seed 000's Mamba fix), then a copy from the null block.
    with demo_step(6.0):
        states = first(do(AllocateBlocks(engine_id="pod-a", owner_id=owner_c, pool_id=STATE, count=2)), BlocksAllocated).blocks  # type: ignore[attr-defined]
        s1, s2 = states
        do(
            PlanStateCopy(
                engine_id="pod-a", pool_id=STATE, moves=[Move(s1, 8, s1, 0, 48), Move(s2, 0, s1, 56, 8), Move(s1, 0, s2, 0, 8)]
            ),
            "I15 memmove + dependency order",
        )
        do(
            PlanStateCopy(engine_id="pod-a", pool_id=STATE, moves=[Move(BlockRef(STATE, 0, 0), 0, s2, 8, 8)]),
            "I2 no copy from null",
        )

    # Step 7: tenant B shares the store but never sees tenant A's keys (seed 003).
    do(DeclareEngine(engine_id="pod-b", namespace=_namespace("tenant-b"), pools=pools, world_size=2, tiers=["host"]))
    with demo_step(7.0, engine_id="pod-b"):
        hit = first(do(LookupPrefix(engine_id="pod-b", tier="host", token_ids=prompt), "I9 other tenant: no hit"), PrefixLookedUp)
        assert isinstance(hit, PrefixLookedUp) and hit.boundary == 0
        owner_d = first(do(StartOwner(engine_id="pod-b", req_id="req-D")), OwnerStarted).owner_id  # type: ignore[attr-defined]
        dest_b = first(
            do(AllocateBlocks(engine_id="pod-b", owner_id=owner_d, pool_id=ATTENTION, count=1)), BlocksAllocated
        ).blocks  # type: ignore[attr-defined]
        do(StartLoad(engine_id="pod-b", tier="host", items=[LoadRequest(keys[1], dest_b[0])]), "I9 reads as absent")

    # Step 8: a store in flight, then a cache reset: the late report is dropped (I16).
    with demo_step(8.0):
        fresh = first(do(AllocateBlocks(engine_id="pod-a", owner_id=owner_c, pool_id=ATTENTION, count=1)), BlocksAllocated).blocks  # type: ignore[attr-defined]
        do(MarkComputed(engine_id="pod-a", owner_id=owner_c, blocks=fresh, token_ids=[1, 2, 3, 4]))
        late = first(do(StartStore(engine_id="pod-a", tier="host", blocks=fresh)), StoreJobStarted)
        assert isinstance(late, StoreJobStarted)
    do(ResetCache(engine_id="pod-a"), "I16 new incarnation fences jobs")
    do(ReportRank(job_id=late.job_id, rank=0, ok=True, checksums=[b"late"]), "I16 late report dropped")

    replayed = project(core.events)
    return DemoResult(rows=rows, events=len(core.events), digest=state_digest(core.state), replay_digest=state_digest(replayed))
