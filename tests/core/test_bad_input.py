"""Bad input: every malformed or unsafe command is answered with one event, never an exception.

Each test sends one bad command to the real core and checks that:

* the answer is a single `Refused` (or `NoticeDropped` for the notices FreeBlocks,
  FreeEncoderEntry and ReportRank, coordinator.core.commands.NOTICES) with the specific reason;
* its detail names the thing that failed (the pool, block, job, rank, engine, field...);
* the state is unchanged (compared without `last_event`, which every event bumps) and the
  refusal is recorded in the log (I1: refused and dropped commands are visible to forensics);
* the core keeps serving: a valid command right after succeeds.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import msgspec
import pytest

from coordinator.core import CoordinatorCore
from coordinator.core.checks import (
    MAX_CLOCK_JUMP,
    MAX_ENCODER_CACHE_TOKENS,
    MAX_ENCODER_ENTRIES,
    MAX_ENCODER_ENTRY_ID,
    MAX_STEP_JUMP,
    MAX_STREAM_NAME,
)
from coordinator.core.commands import (
    NOTICES,
    AllocateBlocks,
    AllocateEncoderEntry,
    AnyCommand,
    BeginStep,
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
    ReuseBlocks,
    StartLoad,
    StartOwner,
    StartStore,
    command_tag,
)
from coordinator.core.keys import MAX_WORLD_SIZE
from events import (
    BlockRef,
    BlocksAllocated,
    EngineDeclared,
    Event,
    NoticeDropped,
    PoolSpec,
    Reason,
    Refused,
    TierSpec,
)
from tests.kit.builders import (
    ENGINE,
    TIER,
    allocate,
    attention_pool,
    begin,
    compute,
    end,
    namespace,
    new_core,
    ok,
    owner,
    publish,
    start_store,
    state_bytes,
    state_pool,
)

ATTENTION, STATE, REPORTED = 0, 1, 2
ATTENTION_BLOCKS = 8
ENCODER_TOKENS = 8
CLOCK = 10.0
UNKNOWN_ENGINE = "engine-x"
UNKNOWN_POOL = 7


def pools() -> list[PoolSpec]:
    """Attention and state pools (managed) and a reported attention pool (the engine picks)."""
    return [
        attention_pool(ATTENTION, ATTENTION_BLOCKS),
        state_pool(STATE, 4),
        attention_pool(REPORTED, ATTENTION_BLOCKS, managed=False),
    ]


@dataclass
class World:
    """An engine in an open step, with one of everything a bad command can point at."""

    core: CoordinatorCore
    owner_id: int
    held: list[BlockRef]
    """Two attention blocks the owner holds, not computed, not pinned."""
    published_key: bytes
    published_block: BlockRef
    """The computed attention block the key was stored from (held by its publisher)."""
    job_id: int
    """A store job in flight: no rank has reported yet."""
    recycled_old: BlockRef
    """A reported-pool slot's previous lifetime: the slot was freed and allocated again."""
    recycled_now: BlockRef

    def valid_block_in(self, pool_id: int) -> BlockRef:
        return self.recycled_now if pool_id == REPORTED else self.published_block


def assert_rejected(core: CoordinatorCore, command: AnyCommand, reason: Reason, *names: str) -> Refused | NoticeDropped:
    """One Refused (NoticeDropped for a notice) with `reason`, naming `names`; nothing changed."""
    before = state_bytes(core)
    logged = len(core.events)
    events = core.execute(command)
    assert len(events) == 1, events
    [event] = events
    if isinstance(command, NOTICES):
        assert isinstance(event, NoticeDropped), event
        assert event.notice == command_tag(command)
    else:
        assert isinstance(event, Refused), event
        assert event.command == command_tag(command)
    assert event.reason == reason, event
    for name in names:
        assert name in event.detail, (name, event.detail)
    assert state_bytes(core) == before, f"refusing {command!r} changed the state"
    assert core.events[logged:] == [event], "the refusal must be recorded in the log"
    return event


def keeps_serving(core: CoordinatorCore, command: AnyCommand) -> list[Event]:
    return ok(core.execute(command))


@pytest.fixture
def world() -> World:
    core = new_core(pools(), encoder_cache_tokens=ENCODER_TOKENS)
    begin(core, clock=CLOCK)
    [key] = publish(core, [1, 2, 3, 4], pool_id=ATTENTION)
    publisher = next(o for o in core.state.owners.values() if o.req_id == "publisher")
    [(block_id, generation)] = publisher.blocks[ATTENTION].items()
    own = owner(core, "req-1")
    held = allocate(core, own, 2, ATTENTION)
    [stored] = allocate(core, own, 1, ATTENTION)
    compute(core, own, [stored], [9, 9, 9, 9])
    job = start_store(core, [stored])
    [recycled_old] = reported_allocate(core, own, 3)
    ok(core.execute(FreeBlocks(engine_id=ENGINE, owner_id=own, blocks=[recycled_old])))
    [recycled_now] = reported_allocate(core, own, 3)
    assert recycled_now.generation == recycled_old.generation + 1
    # I14: the slot was freed and re-allocated in this step, so its freed notice is dropped.
    [dropped, _] = core.execute(EndStep(engine_id=ENGINE))
    assert isinstance(dropped, NoticeDropped) and dropped.reason == Reason.REALLOCATED_IN_STEP
    begin(core, clock=CLOCK)
    ok(core.execute(AllocateEncoderEntry(engine_id=ENGINE, entry_id="img-1", num_tokens=4)))
    return World(
        core=core,
        owner_id=own,
        held=held,
        published_key=key,
        published_block=BlockRef(ATTENTION, block_id, generation),
        job_id=job.job_id,
        recycled_old=recycled_old,
        recycled_now=recycled_now,
    )


def reported_allocate(core: CoordinatorCore, owner_id: int, block_id: int) -> list[BlockRef]:
    [event] = ok(
        core.execute(AllocateBlocks(engine_id=ENGINE, owner_id=owner_id, pool_id=REPORTED, count=1, block_ids=[block_id]))
    )
    assert isinstance(event, BlocksAllocated)
    return event.blocks


def declare(engine_id: str = "engine-b", pool_specs: list[PoolSpec] | None = None, **namespace_fields: object) -> DeclareEngine:
    """DeclareEngine whose namespace agrees with its pools unless told otherwise."""
    pool_specs = pools() if pool_specs is None else pool_specs
    fields: dict[str, object] = {"block_sizes": tuple(p.block_size for p in pool_specs)}
    fields.update(namespace_fields)
    return DeclareEngine(
        engine_id=engine_id,
        namespace=namespace(**fields),  # type: ignore[arg-type]
        pools=pool_specs,
        world_size=2,
        tiers=[TIER],
        encoder_cache_tokens=ENCODER_TOKENS,
    )


# --- commands that name one block ------------------------------------------------------------------

BlockCommand = Callable[[World, BlockRef], AnyCommand]

BLOCK_COMMANDS: dict[str, BlockCommand] = {
    "free_blocks": lambda w, ref: FreeBlocks(engine_id=ENGINE, owner_id=w.owner_id, blocks=[ref]),
    "reuse_blocks": lambda w, ref: ReuseBlocks(engine_id=ENGINE, owner_id=w.owner_id, blocks=[ref]),
    "mark_computed": lambda w, ref: MarkComputed(engine_id=ENGINE, owner_id=w.owner_id, blocks=[ref], token_ids=[5, 6, 7, 8]),
    "start_store": lambda w, ref: StartStore(engine_id=ENGINE, tier=TIER, blocks=[ref]),
    "start_load": lambda w, ref: StartLoad(engine_id=ENGINE, tier=TIER, items=[LoadRequest(w.published_key, ref)]),
    "copy_source": lambda w, ref: PlanStateCopy(
        engine_id=ENGINE, pool_id=ref.pool_id, moves=[Move(ref, 0, w.held[1] if ref.pool_id == ATTENTION else ref, 0, 8)]
    ),
    "copy_destination": lambda w, ref: PlanStateCopy(
        engine_id=ENGINE, pool_id=ref.pool_id, moves=[Move(w.valid_block_in(ref.pool_id), 0, ref, 0, 8)]
    ),
}

VALID_BLOCK: dict[str, Callable[[World], BlockRef]] = {
    "free_blocks": lambda w: w.held[0],
    "reuse_blocks": lambda w: w.published_block,
    "mark_computed": lambda w: w.held[0],
    "start_store": lambda w: w.published_block,
    "start_load": lambda w: w.held[1],
    "copy_source": lambda w: w.published_block,
    "copy_destination": lambda w: w.held[1],
}


def then_the_valid_one(w: World, name: str) -> None:
    """The same kind of command, naming a block that is fine, succeeds."""
    keeps_serving(w.core, BLOCK_COMMANDS[name](w, VALID_BLOCK[name](w)))


# --- unknown engine -------------------------------------------------------------------------------

ENGINE_COMMANDS: dict[str, Callable[[World, str], AnyCommand]] = {
    "begin_step": lambda w, e: BeginStep(engine_id=e, step=99, clock=CLOCK),
    "end_step": lambda w, e: EndStep(engine_id=e),
    "reset_cache": lambda w, e: ResetCache(engine_id=e),
    "start_owner": lambda w, e: StartOwner(engine_id=e, req_id="req-9"),
    "finish_owner": lambda w, e: FinishOwner(engine_id=e, owner_id=w.owner_id),
    "allocate_blocks": lambda w, e: AllocateBlocks(engine_id=e, owner_id=w.owner_id, pool_id=ATTENTION, count=1),
    "reuse_blocks": lambda w, e: ReuseBlocks(engine_id=e, owner_id=w.owner_id, blocks=[w.published_block]),
    "free_blocks": lambda w, e: FreeBlocks(engine_id=e, owner_id=w.owner_id, blocks=[w.held[0]]),
    "mark_computed": lambda w, e: MarkComputed(engine_id=e, owner_id=w.owner_id, blocks=[w.held[0]], token_ids=[5, 6, 7, 8]),
    "lookup_prefix": lambda w, e: LookupPrefix(engine_id=e, tier=TIER, token_ids=[1, 2, 3, 4]),
    "start_store": lambda w, e: StartStore(engine_id=e, tier=TIER, blocks=[w.published_block]),
    "start_load": lambda w, e: StartLoad(engine_id=e, tier=TIER, items=[LoadRequest(w.published_key, w.held[1])]),
    "plan_state_copy": lambda w, e: PlanStateCopy(
        engine_id=e, pool_id=ATTENTION, moves=[Move(w.published_block, 0, w.held[1], 0, 8)]
    ),
    "allocate_encoder_entry": lambda w, e: AllocateEncoderEntry(engine_id=e, entry_id="img-2", num_tokens=2),
    "free_encoder_entry": lambda w, e: FreeEncoderEntry(engine_id=e, entry_id="img-1"),
}


@pytest.mark.parametrize("name", sorted(ENGINE_COMMANDS))
def test_every_engine_command_naming_an_unknown_engine_is_refused_and_the_core_serves_on(world: World, name: str) -> None:
    event = assert_rejected(world.core, ENGINE_COMMANDS[name](world, UNKNOWN_ENGINE), Reason.UNKNOWN_ENGINE, repr(UNKNOWN_ENGINE))
    assert event.engine_id == UNKNOWN_ENGINE
    if name == "begin_step":  # the real engine's step is open: end it, then begin anew
        keeps_serving(world.core, EndStep(engine_id=ENGINE))
        keeps_serving(world.core, BeginStep(engine_id=ENGINE, step=99, clock=CLOCK))
    else:
        keeps_serving(world.core, ENGINE_COMMANDS[name](world, ENGINE))


# --- unknown pool, unknown slot, stale generation, null block -------------------------------------


@pytest.mark.parametrize("name", sorted(BLOCK_COMMANDS))
def test_unknown_pool_in_a_block_reference(world: World, name: str) -> None:
    ref = BlockRef(UNKNOWN_POOL, 1, 1)
    assert_rejected(world.core, BLOCK_COMMANDS[name](world, ref), Reason.UNKNOWN_POOL, f"pool {UNKNOWN_POOL}")
    then_the_valid_one(world, name)


@pytest.mark.parametrize("managed", [True, False], ids=["managed", "reported"])
def test_allocate_from_an_unknown_pool(world: World, managed: bool) -> None:
    command = AllocateBlocks(
        engine_id=ENGINE, owner_id=world.owner_id, pool_id=UNKNOWN_POOL, count=1, block_ids=None if managed else [1]
    )
    assert_rejected(world.core, command, Reason.UNKNOWN_POOL, f"pool {UNKNOWN_POOL}")
    keeps_serving(world.core, AllocateBlocks(engine_id=ENGINE, owner_id=world.owner_id, pool_id=ATTENTION, count=1))


@pytest.mark.parametrize("block_id", [ATTENTION_BLOCKS, ATTENTION_BLOCKS + 100, -1], ids=["num_blocks", "far", "negative"])
@pytest.mark.parametrize("name", sorted(BLOCK_COMMANDS))
def test_unknown_slot(world: World, name: str, block_id: int) -> None:
    ref = BlockRef(ATTENTION, block_id, 1)
    assert_rejected(world.core, BLOCK_COMMANDS[name](world, ref), Reason.UNKNOWN_SLOT, f"block {block_id}", f"pool {ATTENTION}")
    then_the_valid_one(world, name)


@pytest.mark.parametrize("block_id", [ATTENTION_BLOCKS, ATTENTION_BLOCKS + 100, -1], ids=["num_blocks", "far", "negative"])
def test_reported_allocation_of_an_unknown_slot(world: World, block_id: int) -> None:
    command = AllocateBlocks(engine_id=ENGINE, owner_id=world.owner_id, pool_id=REPORTED, count=1, block_ids=[block_id])
    assert_rejected(world.core, command, Reason.UNKNOWN_SLOT, f"block {block_id}", f"pool {REPORTED}")
    keeps_serving(world.core, msgspec.structs.replace(command, block_ids=[5]))


@pytest.mark.parametrize("name", sorted(BLOCK_COMMANDS))
def test_stale_generation_of_a_recycled_slot(world: World, name: str) -> None:
    """I1: the slot was freed and allocated again; its old reference is refused (or dropped)."""
    old = world.recycled_old
    assert_rejected(
        world.core,
        BLOCK_COMMANDS[name](world, old),
        Reason.STALE_GENERATION,
        f"{old.pool_id}/{old.block_id}",
        f"generation {world.recycled_now.generation}",
    )
    then_the_valid_one(world, name)


@pytest.mark.parametrize("name", sorted(BLOCK_COMMANDS))
def test_generation_from_the_future(world: World, name: str) -> None:
    current = world.held[0] if name != "reuse_blocks" else world.published_block
    ahead = msgspec.structs.replace(current, generation=current.generation + 1)
    assert_rejected(
        world.core,
        BLOCK_COMMANDS[name](world, ahead),
        Reason.STALE_GENERATION,
        f"{ahead.pool_id}/{ahead.block_id}",
        f"not {ahead.generation}",
    )
    then_the_valid_one(world, name)


@pytest.mark.parametrize("pool_id", [ATTENTION, REPORTED])
@pytest.mark.parametrize("name", sorted(BLOCK_COMMANDS))
def test_I2_every_block_command_on_the_null_block_is_refused(world: World, name: str, pool_id: int) -> None:
    """I2: block 0 is never freed, reused, computed, stored, loaded or copied."""
    null = BlockRef(pool_id, 0, 0)
    assert_rejected(world.core, BLOCK_COMMANDS[name](world, null), Reason.NULL_BLOCK, "block 0", f"pool {pool_id}")
    then_the_valid_one(world, name)


def test_reported_allocation_of_the_null_block(world: World) -> None:
    command = AllocateBlocks(engine_id=ENGINE, owner_id=world.owner_id, pool_id=REPORTED, count=1, block_ids=[0])
    assert_rejected(world.core, command, Reason.NULL_BLOCK, "block 0", f"pool {REPORTED}")
    keeps_serving(world.core, msgspec.structs.replace(command, block_ids=[4]))


# --- jobs and ranks -----------------------------------------------------------------------------------


def valid_report(w: World, rank: int = 0) -> ReportRank:
    return ReportRank(job_id=w.job_id, rank=rank, ok=True, checksums=[b"sum:%d" % rank])


@pytest.mark.parametrize("job_id", [999, 0, -1])
def test_report_for_an_unknown_job(world: World, job_id: int) -> None:
    command = msgspec.structs.replace(valid_report(world), job_id=job_id)
    assert_rejected(world.core, command, Reason.UNKNOWN_JOB, f"job {job_id}")
    keeps_serving(world.core, valid_report(world))


def test_report_for_a_finished_job_is_stale(world: World) -> None:
    """I4: ids are never reused, so a late report for a finished job is stale, not unknown."""
    for rank in (0, 1):
        keeps_serving(world.core, valid_report(world, rank))
    assert_rejected(world.core, valid_report(world, 1), Reason.STALE_JOB, f"job {world.job_id}")
    keeps_serving(world.core, StartOwner(engine_id=ENGINE, req_id="req-2"))


@pytest.mark.parametrize("rank", [2, 7, -1])
def test_rank_outside_the_world_size(world: World, rank: int) -> None:
    assert_rejected(world.core, valid_report(world, rank), Reason.RANK_OUT_OF_RANGE, f"rank {rank}", "world size 2")
    keeps_serving(world.core, valid_report(world, 0))


@pytest.mark.parametrize(
    ("ok", "lost"),
    [(False, [0]), (True, [0])],
    ids=["a failed store's report", "a report that says ok"],
)
def test_lost_items_are_named_only_by_a_failed_load(world: World, ok: bool, lost: list[int]) -> None:
    """ReportRank.lost (the tier lost those items' bytes) belongs to a failed load's report: on
    a store's (world.job_id is one), or on a report that says ok, it is refused."""
    command = msgspec.structs.replace(valid_report(world), ok=ok, lost=lost)
    assert_rejected(world.core, command, Reason.INVALID_ARGUMENT, "lost")
    keeps_serving(world.core, valid_report(world))


# --- counts and numbers ----------------------------------------------------------------------------


@pytest.mark.parametrize("count", [0, -1, ATTENTION_BLOCKS, ATTENTION_BLOCKS + 1, 10**9])
def test_allocate_count_out_of_range(world: World, count: int) -> None:
    """1..num_blocks-1 (block 0 is the null block); more than that is a bad count, not a full pool."""
    command = AllocateBlocks(engine_id=ENGINE, owner_id=world.owner_id, pool_id=ATTENTION, count=count)
    assert_rejected(world.core, command, Reason.INVALID_COUNT, f"pool {ATTENTION}", f"got {count}")
    keeps_serving(world.core, msgspec.structs.replace(command, count=1))


def test_load_with_no_items(world: World) -> None:
    command = StartLoad(engine_id=ENGINE, tier=TIER, items=[])
    assert_rejected(world.core, command, Reason.INVALID_COUNT, "load items", "got 0")
    keeps_serving(world.core, msgspec.structs.replace(command, items=[LoadRequest(world.published_key, world.held[1])]))


@pytest.mark.parametrize("lease_seconds", [-1.0, 0.0, math.nan, math.inf, -math.inf, 1e9])
def test_lease_seconds_out_of_range(world: World, lease_seconds: float) -> None:
    command = StartLoad(
        engine_id=ENGINE, tier=TIER, items=[LoadRequest(world.published_key, world.held[1])], lease_seconds=lease_seconds
    )
    assert_rejected(world.core, command, Reason.INVALID_ARGUMENT, "lease_seconds")
    keeps_serving(world.core, msgspec.structs.replace(command, lease_seconds=30.0))


@pytest.mark.parametrize("num_blocks", [1, 0, -5, (1 << 24) + 2])
def test_declare_engine_with_a_pool_of_bad_size(world: World, num_blocks: int) -> None:
    """A usable pool has the null block and at least one more, and a bounded size."""
    bad = [msgspec.structs.replace(attention_pool(ATTENTION), num_blocks=num_blocks)]
    assert_rejected(world.core, declare(pool_specs=bad), Reason.INVALID_COUNT, f"pool {ATTENTION}")
    [declared] = [
        e for e in keeps_serving(world.core, declare(pool_specs=[attention_pool(ATTENTION)])) if isinstance(e, EngineDeclared)
    ]
    assert (declared.engine_id, declared.incarnation) == ("engine-b", 1)


@pytest.mark.parametrize("num_tokens", [0, -3, ENCODER_TOKENS + 1])
def test_encoder_entry_with_a_bad_number_of_tokens(world: World, num_tokens: int) -> None:
    command = AllocateEncoderEntry(engine_id=ENGINE, entry_id="img-2", num_tokens=num_tokens)
    assert_rejected(world.core, command, Reason.INVALID_COUNT, "encoder entry", f"got {num_tokens}")
    keeps_serving(world.core, msgspec.structs.replace(command, num_tokens=4))


# --- steps and clocks --------------------------------------------------------------------------------

OUTSIDE_A_STEP: dict[str, Callable[[World], AnyCommand]] = {
    "end_step": lambda w: EndStep(engine_id=ENGINE),
    "start_owner": lambda w: StartOwner(engine_id=ENGINE, req_id="req-9"),
    "finish_owner": lambda w: FinishOwner(engine_id=ENGINE, owner_id=w.owner_id),
    "allocate_blocks": lambda w: AllocateBlocks(engine_id=ENGINE, owner_id=w.owner_id, pool_id=ATTENTION, count=1),
    "allocate_encoder_entry": lambda w: AllocateEncoderEntry(engine_id=ENGINE, entry_id="img-2", num_tokens=2),
    "free_encoder_entry": lambda w: FreeEncoderEntry(engine_id=ENGINE, entry_id="img-1"),
    "lookup_prefix": lambda w: LookupPrefix(engine_id=ENGINE, tier=TIER, token_ids=[1, 2, 3, 4]),
    **{name: (lambda name: lambda w: BLOCK_COMMANDS[name](w, VALID_BLOCK[name](w)))(name) for name in BLOCK_COMMANDS},
}


@pytest.mark.parametrize("name", sorted(OUTSIDE_A_STEP))
def test_command_before_a_step_is_open(world: World, name: str) -> None:
    end(world.core)
    assert_rejected(world.core, OUTSIDE_A_STEP[name](world), Reason.NO_OPEN_STEP, repr(ENGINE))
    begin(world.core)
    keeps_serving(world.core, OUTSIDE_A_STEP[name](world))


def test_command_before_the_first_step() -> None:
    core = new_core(pools())  # declared, never stepped
    assert_rejected(core, StartOwner(engine_id=ENGINE, req_id="req-1"), Reason.NO_OPEN_STEP, repr(ENGINE))
    keeps_serving(core, BeginStep(engine_id=ENGINE, step=0, clock=0.0))


@pytest.mark.parametrize("behind", [0, 1, 5])
def test_step_number_that_does_not_advance(world: World, behind: int) -> None:
    end(world.core)
    current = world.core.state.engines[ENGINE].step
    step = current - behind
    assert_rejected(
        world.core,
        BeginStep(engine_id=ENGINE, step=step, clock=CLOCK),
        Reason.STEP_NOT_ADVANCING,
        f"step {step}",
        f"step {current}",
    )
    keeps_serving(world.core, BeginStep(engine_id=ENGINE, step=current + 1, clock=CLOCK))


@pytest.mark.parametrize("leap", ["step", "clock"])
def test_step_or_clock_that_leaps_past_its_bound(world: World, leap: str) -> None:
    """Unbounded, one step numbered 2**63-1 (or at clock 1e18) refused every later step of the
    engine for good (issue 17): a step leaps at most MAX_STEP_JUMP, a clock MAX_CLOCK_JUMP."""
    end(world.core)
    eng = world.core.state.engines[ENGINE]
    if leap == "step":
        poison = BeginStep(engine_id=ENGINE, step=2**63 - 1, clock=eng.clock)
        assert_rejected(world.core, poison, Reason.STEP_JUMP, f"step {2**63 - 1}", f"step {eng.step}")
        edge = BeginStep(engine_id=ENGINE, step=eng.step + MAX_STEP_JUMP + 1, clock=eng.clock)
        assert_rejected(world.core, edge, Reason.STEP_JUMP, f"{MAX_STEP_JUMP:,}")
    else:
        poison = BeginStep(engine_id=ENGINE, step=eng.step + 1, clock=1e18)
        assert_rejected(world.core, poison, Reason.STEP_JUMP, "clock 1e+18", f"{eng.clock}")
    keeps_serving(world.core, BeginStep(engine_id=ENGINE, step=eng.step + MAX_STEP_JUMP, clock=eng.clock + MAX_CLOCK_JUMP))


def test_begin_step_while_one_is_open(world: World) -> None:
    current = world.core.state.engines[ENGINE].step
    assert_rejected(
        world.core, BeginStep(engine_id=ENGINE, step=current + 1, clock=CLOCK), Reason.STEP_ALREADY_OPEN, f"step {current}"
    )
    keeps_serving(world.core, EndStep(engine_id=ENGINE))


@pytest.mark.parametrize("clock", [CLOCK - 0.001, 0.0, -1.0])
def test_clock_that_goes_backwards(world: World, clock: float) -> None:
    end(world.core)
    step = world.core.state.engines[ENGINE].step + 1
    assert_rejected(
        world.core, BeginStep(engine_id=ENGINE, step=step, clock=clock), Reason.CLOCK_REGRESSED, f"clock {clock}", str(CLOCK)
    )
    keeps_serving(world.core, BeginStep(engine_id=ENGINE, step=step, clock=CLOCK))  # standing still is fine


@pytest.mark.parametrize("clock", [math.nan, math.inf, -math.inf])
def test_clock_that_is_not_a_number(world: World, clock: float) -> None:
    end(world.core)
    step = world.core.state.engines[ENGINE].step + 1
    assert_rejected(world.core, BeginStep(engine_id=ENGINE, step=step, clock=clock), Reason.INVALID_ARGUMENT, "clock")
    keeps_serving(world.core, BeginStep(engine_id=ENGINE, step=step, clock=CLOCK + 1))


# --- declarations ------------------------------------------------------------------------------------


@pytest.mark.parametrize("engine_id", ["engine-b", ENGINE], ids=["new", "restart"])
def test_namespace_with_an_empty_weights_revision(world: World, engine_id: str) -> None:
    """Seed 003: a namespace must pin the exact weights, or two checkpoints share keys."""
    assert_rejected(world.core, declare(engine_id, weights_revision=""), Reason.INVALID_ARGUMENT, "weights_revision")
    keeps_serving(world.core, declare(engine_id))


@pytest.mark.parametrize("block_sizes", [(4,), (8, 4, 4), (4, 8, 16), (4, 8, 4, 4)])
def test_block_sizes_that_disagree_with_the_namespace(world: World, block_sizes: tuple[int, ...]) -> None:
    assert_rejected(world.core, declare(block_sizes=block_sizes), Reason.NAMESPACE_MISMATCH, "block sizes", str(block_sizes))
    keeps_serving(world.core, declare())


LAYOUT_CHANGES: dict[str, Callable[[], list[PoolSpec]]] = {
    "fewer_pools": lambda: pools()[:2],
    "more_blocks": lambda: [attention_pool(ATTENTION, ATTENTION_BLOCKS + 1), *pools()[1:]],
    "other_kind": lambda: [
        msgspec.structs.replace(attention_pool(ATTENTION, ATTENTION_BLOCKS), kind="sliding_window"),
        *pools()[1:],
    ],
    "reported_becomes_managed": lambda: [*pools()[:2], attention_pool(REPORTED, ATTENTION_BLOCKS, managed=True)],
    "other_bytes_per_block": lambda: [msgspec.structs.replace(pools()[0], bytes_per_block=128), *pools()[1:]],
    "reordered": lambda: [pools()[1], pools()[0], pools()[2]],
}


@pytest.mark.parametrize("change", sorted(LAYOUT_CHANGES))
def test_redeclare_with_another_pool_layout(world: World, change: str) -> None:
    """A restart keeps its pools: generations only make sense for the same slots (I1)."""
    assert_rejected(world.core, declare(ENGINE, LAYOUT_CHANGES[change]()), Reason.POOL_LAYOUT_CHANGED, repr(ENGINE))
    [declared] = [e for e in keeps_serving(world.core, declare(ENGINE)) if isinstance(e, EngineDeclared)]
    assert declared.incarnation == 2  # the same layout restarts as a new incarnation


def test_a_pool_id_the_log_cannot_hold_is_refused_by_the_core_itself() -> None:
    """Not only at the sidecar's door (coordinator/sidecar/admission.py): an in-process Ledger or
    the simulator goes straight to the decider, and the audit index holds 32-bit pool ids."""
    from coordinator.core import CoordinatorCore
    from coordinator.core.checks import MAX_POOL_ID
    from coordinator.core.commands import DeclareEngine
    from events import Reason, Refused
    from tests.kit import builders as b

    for pool_id in (MAX_POOL_ID + 1, -1):
        core = CoordinatorCore()
        pool = b.attention_pool(pool_id=pool_id)
        [refused] = core.execute(DeclareEngine(engine_id="e", namespace=b.namespace(), pools=[pool], world_size=2))
        assert isinstance(refused, Refused) and refused.reason == Reason.INVALID_ARGUMENT and str(pool_id) in refused.detail
        assert "e" not in core.state.engines
    core = CoordinatorCore()
    [declared, *_] = core.execute(
        DeclareEngine(engine_id="e", namespace=b.namespace(), pools=[b.attention_pool(pool_id=MAX_POOL_ID)], world_size=2)
    )
    assert not isinstance(declared, Refused)


# --- sizes an adversarial review found unbounded (session 31) --------------------------------------


@pytest.mark.parametrize("tp, pp", [(1 << 40, 1), (1 << 13, 1), (64, 128), (2**64 - 1, 1)])
def test_declare_engine_with_more_ranks_than_any_engine_has(world: World, tp: int, pp: int) -> None:
    """2**40 ranks made fencing a job list every rank on the event loop (the sidecar stopped
    answering), and a rank past 2**63 stopped the audit index: at most MAX_WORLD_SIZE ranks."""
    command = declare(tp=tp, pipeline_parallel_size=pp)
    command = msgspec.structs.replace(command, world_size=tp * pp)
    assert_rejected(world.core, command, Reason.INVALID_ARGUMENT, f"{tp * pp:,}", f"{MAX_WORLD_SIZE:,} ranks")
    keeps_serving(world.core, declare(tp=2))


def test_a_world_of_max_world_size_ranks_is_declared(world: World) -> None:
    command = msgspec.structs.replace(declare(tp=MAX_WORLD_SIZE // 2, pipeline_parallel_size=2), world_size=MAX_WORLD_SIZE)
    assert any(isinstance(e, EngineDeclared) for e in keeps_serving(world.core, command))


def test_declare_engine_with_an_id_longer_than_a_stream_name(world: World) -> None:
    """The engine's stream, "engine/<id>", is a 255-character column: PostgreSQL refused a longer
    one at the append, failing the group and rebuilding the ledger from the log each time."""
    assert_rejected(world.core, declare("e" * (MAX_STREAM_NAME + 1)), Reason.INVALID_ARGUMENT, "engine_id", "249")
    keeps_serving(world.core, declare("e" * MAX_STREAM_NAME))


def test_declare_tier_with_a_name_longer_than_a_stream_name(world: World) -> None:
    long = TierSpec(name="t" * (MAX_STREAM_NAME + 1), num_slots=4, bytes_per_slot=64)
    assert_rejected(world.core, DeclareTier(spec=long), Reason.INVALID_ARGUMENT, "tier name", "249")
    keeps_serving(world.core, DeclareTier(spec=TierSpec(name="t" * MAX_STREAM_NAME, num_slots=4, bytes_per_slot=64)))


@pytest.mark.parametrize("bad", ["a\x00b", "tab\there", "\x7f"], ids=["nul", "tab", "del"])
def test_an_engine_id_or_tier_name_holding_a_control_character_is_refused(world: World, bad: str) -> None:
    """Each names a stream of the log, and PostgreSQL's text holds no NUL: an engine id "N\\x00"
    failed every append of its group (an adversarial review, session 31)."""
    assert_rejected(world.core, declare(bad), Reason.INVALID_ARGUMENT, "engine_id", "control character")
    tier = DeclareTier(spec=TierSpec(name=bad, num_slots=4, bytes_per_slot=64))
    assert_rejected(world.core, tier, Reason.INVALID_ARGUMENT, "tier name", "control character")
    keeps_serving(world.core, declare("engine-b"))


@pytest.mark.parametrize("tokens", [MAX_ENCODER_CACHE_TOKENS + 1, 2**62])
def test_declare_engine_with_an_encoder_cache_beyond_any_engines(world: World, tokens: int) -> None:
    bad = msgspec.structs.replace(declare(), encoder_cache_tokens=tokens)
    assert_rejected(world.core, bad, Reason.INVALID_COUNT, "encoder_cache_tokens", f"{tokens:,}")
    keeps_serving(world.core, msgspec.structs.replace(declare(), encoder_cache_tokens=MAX_ENCODER_CACHE_TOKENS))


def test_encoder_entries_are_bounded_in_number_and_id_length(world: World) -> None:
    """One-token entries never freed, in a cache of 2**62 tokens, grew the state without end and
    made every allocation sum every entry (an adversarial review, session 31)."""
    long_id = AllocateEncoderEntry(engine_id=ENGINE, entry_id="x" * (MAX_ENCODER_ENTRY_ID + 1), num_tokens=1)
    assert_rejected(world.core, long_id, Reason.INVALID_ARGUMENT, "entry_id", f"{MAX_ENCODER_ENTRY_ID + 1}")
    core = new_core(pools(), encoder_cache_tokens=MAX_ENCODER_ENTRIES + 8)  # room in tokens: the count fills
    begin(core, clock=CLOCK)
    for index in range(MAX_ENCODER_ENTRIES):
        ok(core.execute(AllocateEncoderEntry(engine_id=ENGINE, entry_id=f"e{index}", num_tokens=1)))
    one_more = AllocateEncoderEntry(engine_id=ENGINE, entry_id="one-more", num_tokens=1)
    assert_rejected(core, one_more, Reason.ENCODER_CACHE_FULL, f"{MAX_ENCODER_ENTRIES:,} entries")
    keeps_serving(core, FreeEncoderEntry(engine_id=ENGINE, entry_id="e0"))
