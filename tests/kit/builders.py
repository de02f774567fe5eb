"""Builders for tests: a small engine on the real pure core (no fakes, no mocks)."""

from __future__ import annotations

from collections.abc import Sequence

from coordinator.core import CoordinatorCore
from coordinator.core.commands import (
    AllocateBlocks,
    BeginStep,
    DeclareEngine,
    DeclareTier,
    EndStep,
    MarkComputed,
    ReportRank,
    StartOwner,
    StartStore,
)
from coordinator.core.projector import project
from coordinator.core.state import State, encode_state
from events import (
    BlockRef,
    BlocksAllocated,
    Event,
    NamespaceSpec,
    NoticeDropped,
    OwnerStarted,
    PoolSpec,
    Refused,
    StoreJobStarted,
    TierSpec,
)

ENGINE = "engine-a"
TIER = "host"
BLOCK = 4  # tokens per attention block
STATE_BLOCK = 8  # tokens per state block: reuse unit = lcm(4, 8) = 8


def namespace(tenant: str = "tenant-a", block_sizes: tuple[int, ...] = (BLOCK,), tp: int = 2, **extra: object) -> NamespaceSpec:
    fields: dict[str, object] = dict(
        model_id="org/model",
        weights_revision="sha256:1111",
        tokenizer_digest="sha256:2222",
        kv_dtype="bfloat16",
        kv_layout_version=1,
        block_sizes=block_sizes,
        tensor_parallel_size=tp,
        tenant=tenant,
    )
    fields.update(extra)
    return NamespaceSpec(**fields)  # type: ignore[arg-type]


def attention_pool(pool_id: int = 0, num_blocks: int = 16, managed: bool = True) -> PoolSpec:
    return PoolSpec(
        pool_id=pool_id, kind="attention", num_blocks=num_blocks, block_size=BLOCK, bytes_per_block=64, managed=managed
    )


def state_pool(pool_id: int = 1, num_blocks: int = 8) -> PoolSpec:
    return PoolSpec(pool_id=pool_id, kind="state", num_blocks=num_blocks, block_size=STATE_BLOCK, bytes_per_block=64)


def new_core(
    pools: Sequence[PoolSpec] | None = None,
    *,
    world_size: int = 2,
    tier_slots: int = 16,
    tenant: str = "tenant-a",
    engine_id: str = ENGINE,
    encoder_cache_tokens: int = 0,
    core: CoordinatorCore | None = None,
) -> CoordinatorCore:
    """A core with one declared tier and one declared engine (no step open)."""
    pools = list(pools) if pools is not None else [attention_pool()]
    core = core if core is not None else CoordinatorCore()
    core.execute(DeclareTier(spec=TierSpec(name=TIER, num_slots=tier_slots, bytes_per_slot=64)))
    events = core.execute(
        DeclareEngine(
            engine_id=engine_id,
            namespace=namespace(tenant, tuple(p.block_size for p in pools), tp=world_size),
            pools=pools,
            world_size=world_size,
            tiers=[TIER],
            encoder_cache_tokens=encoder_cache_tokens,
        )
    )
    assert not any(isinstance(e, Refused) for e in events), events
    return core


def begin(core: CoordinatorCore, clock: float = 0.0, engine_id: str = ENGINE) -> None:
    engine = core.state.engines[engine_id]
    ok(core.execute(BeginStep(engine_id=engine_id, step=engine.step + 1, clock=max(clock, engine.clock))))


def end(core: CoordinatorCore, engine_id: str = ENGINE) -> list[Event]:
    return ok(core.execute(EndStep(engine_id=engine_id)))


def ok(events: list[Event]) -> list[Event]:
    """Assert the command was neither refused nor dropped."""
    bad = [e for e in events if isinstance(e, (Refused, NoticeDropped))]
    assert not bad, bad
    return events


def owner(core: CoordinatorCore, req_id: str = "req-1", engine_id: str = ENGINE) -> int:
    event = ok(core.execute(StartOwner(engine_id=engine_id, req_id=req_id)))[0]
    assert isinstance(event, OwnerStarted)
    return event.owner_id


def allocate(core: CoordinatorCore, owner_id: int, count: int, pool_id: int = 0, engine_id: str = ENGINE) -> list[BlockRef]:
    event = ok(core.execute(AllocateBlocks(engine_id=engine_id, owner_id=owner_id, pool_id=pool_id, count=count)))[0]
    assert isinstance(event, BlocksAllocated)
    return event.blocks


def compute(
    core: CoordinatorCore,
    owner_id: int,
    blocks: list[BlockRef],
    tokens: Sequence[int],
    parent_key: bytes | None = None,
    engine_id: str = ENGINE,
) -> list[bytes]:
    from events import BlocksComputed

    event = ok(
        core.execute(
            MarkComputed(engine_id=engine_id, owner_id=owner_id, blocks=blocks, token_ids=list(tokens), parent_key=parent_key)
        )
    )[0]
    assert isinstance(event, BlocksComputed)
    return [c.key for c in event.blocks]


def start_store(core: CoordinatorCore, blocks: list[BlockRef], engine_id: str = ENGINE) -> StoreJobStarted:
    events = ok(core.execute(StartStore(engine_id=engine_id, tier=TIER, blocks=blocks)))
    started = [e for e in events if isinstance(e, StoreJobStarted)]
    assert len(started) == 1
    return started[0]


def checksum(key: bytes, rank: int) -> bytes:
    """What an honest worker would report for `key` on `rank`."""
    return b"sum:" + key[:6] + bytes([rank])


def report_all(
    core: CoordinatorCore, job_id: int, items_keys: Sequence[bytes], world_size: int = 2, ok_: bool = True
) -> list[Event]:
    events: list[Event] = []
    for rank in range(world_size):
        events += core.execute(ReportRank(job_id=job_id, rank=rank, ok=ok_, checksums=[checksum(k, rank) for k in items_keys]))
    return events


def publish(core: CoordinatorCore, tokens: Sequence[int], pool_id: int = 0, engine_id: str = ENGINE) -> list[bytes]:
    """Compute full blocks for `tokens` in `pool_id` under a fresh owner, store, and publish them.
    Needs an open step. Returns the keys."""
    size = core.state.engines[engine_id].pools[pool_id].spec.block_size
    own = owner(core, "publisher", engine_id)
    blocks = allocate(core, own, len(tokens) // size, pool_id, engine_id)
    keys = compute(core, own, blocks, tokens[: len(blocks) * size], engine_id=engine_id)
    job = start_store(core, blocks, engine_id)
    report_all(core, job.job_id, [item.key for item in job.items], core.state.engines[engine_id].world_size)
    return keys


def replay_matches(core: CoordinatorCore) -> bool:
    """I18: folding every emitted event from empty gives the live state, byte for byte."""
    return encode_state(project(core.events)) == encode_state(core.state)


def quiet_bytes(state: State) -> bytes:
    """The state's canonical bytes with `last_event` left out: every event, a refusal included,
    bumps that counter, so "the state is unchanged" means equal bytes apart from it."""
    import msgspec

    return encode_state(msgspec.structs.replace(state, last_event=0))


def state_bytes(core: CoordinatorCore) -> bytes:
    return quiet_bytes(core.state)


def rejected(core: CoordinatorCore, command: object, kind: type[Event], reason: object) -> Event:
    """Execute `command`, assert it came back as exactly one `kind` (Refused or NoticeDropped)
    event with `reason`, and that the state did not change. Returns that event."""
    before = state_bytes(core)
    events = core.execute(command)  # type: ignore[arg-type]
    assert [(type(e), getattr(e, "reason", None)) for e in events] == [(kind, reason)], events
    assert state_bytes(core) == before, f"{kind.__name__}({reason}) changed the state"
    return events[0]
