"""A fenced job whose worker never reports (I16): an operator's release of that rank
(`kvledger jobs release`, the ReleaseFencedRank command) lets go of what the job holds, as the
rank's late report would have. On the pure core, through a real sidecar's operator door, and
with every bad input refused and the state unchanged."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner, Result

from coordinator.cli.main import app
from coordinator.core import CoordinatorCore
from coordinator.core.commands import ReleaseFencedRank, ReportRank, ResetCache
from coordinator.core.state import SlotStatus
from events import (
    BlockRef,
    EngineReset,
    FencedRankDone,
    FencedRankReleased,
    JobFenced,
    NoticeDropped,
    Reason,
    Refused,
    StoreJobStarted,
)
from events.log import EventLog
from tests.kit.builders import (
    ENGINE,
    TIER,
    allocate,
    begin,
    checksum,
    compute,
    new_core,
    ok,
    owner,
    quiet_bytes,
    rejected,
    replay_matches,
    start_store,
)
from tests.kit.sidecar import sidecar_on

TOKENS = list(range(100, 116))


def fenced_store(core: CoordinatorCore) -> tuple[StoreJobStarted, list[BlockRef], bytes]:
    """A store whose rank 0 reported and rank 1 never will: then the engine resets (its worker
    died with it), fencing the job with rank 1 pending, its block draining."""
    begin(core)
    own = owner(core)
    blocks = allocate(core, own, 1)
    [key] = compute(core, own, blocks, TOKENS[:4])
    job = start_store(core, blocks)
    ok(core.execute(ReportRank(job_id=job.job_id, rank=0, ok=True, checksums=[checksum(key, 0)])))
    assert [type(e) for e in ok(core.execute(ResetCache(engine_id=ENGINE)))] == [JobFenced, EngineReset]
    assert core.state.engines[ENGINE].pools[0].status(blocks[0].block_id) is SlotStatus.DRAINING
    return job, blocks, key


def test_I16_a_fenced_jobs_rank_released_by_an_operator_lets_go_of_its_slots() -> None:
    core = new_core()
    job, blocks, key = fenced_store(core)
    tier, pool = core.state.tiers[TIER], core.state.engines[ENGINE].pools[0]
    free_slots = len(tier.free)
    events = ok(core.execute(ReleaseFencedRank(engine_id=ENGINE, rank=1, reason="pod-a worker 1 OOM-killed")))
    assert events == [
        FencedRankReleased(engine_id=ENGINE, rank=1, job_ids=[job.job_id], reason="pod-a worker 1 OOM-killed"),
        FencedRankDone(job_id=job.job_id, rank=1),
    ]
    assert job.job_id not in core.state.fenced
    assert pool.status(blocks[0].block_id) is SlotStatus.FREE and pool.pins[blocks[0].block_id] == 0
    assert len(tier.free) == free_slots + 1 and tier.entry(0, key) is None  # the reserved tier slot is back, nothing published
    # The rank's report, if it ever came after all, is a plain stale one: nothing is let go twice.
    rejected(core, ReportRank(job_id=job.job_id, rank=1, ok=True, checksums=[checksum(key, 1)]), NoticeDropped, Reason.STALE_JOB)
    assert replay_matches(core)


@pytest.mark.parametrize(
    ("command", "reason"),
    [
        (ReleaseFencedRank(engine_id="no-such-engine", rank=1, reason="gone"), Reason.UNKNOWN_ENGINE),
        (ReleaseFencedRank(engine_id=ENGINE, rank=2, reason="gone"), Reason.STALE_JOB),  # beyond the jobs' world: nothing waits
        (ReleaseFencedRank(engine_id=ENGINE, rank=-1, reason="gone"), Reason.RANK_OUT_OF_RANGE),
        (ReleaseFencedRank(engine_id=ENGINE, rank=1, reason="  "), Reason.INVALID_ARGUMENT),
        (ReleaseFencedRank(engine_id=ENGINE, rank=0, reason="gone"), Reason.STALE_JOB),  # rank 0 reported: nothing waits on it
    ],
)
def test_a_release_that_names_nothing_waiting_is_refused_and_changes_nothing(command: ReleaseFencedRank, reason: Reason) -> None:
    core = new_core()
    fenced_store(core)
    before = quiet_bytes(core.state)
    rejected(core, command, Refused, reason)
    assert quiet_bytes(core.state) == before


@pytest.mark.anyio
async def test_kvledger_jobs_release_through_the_sidecar(event_log: EventLog, tmp_path: Path) -> None:
    from coordinator.core.commands import AllocateBlocks, MarkComputed, StartOwner, StartStore
    from events import BlocksAllocated, OwnerStarted
    from tests.kit.sidecar import declaration, engine_client

    sock = tmp_path / "s.sock"
    async with sidecar_on(event_log, sock) as sidecar:
        async with engine_client(sock, "pod-a") as client:
            result = await client.step(1, 1.0, [StartOwner(engine_id="pod-a", req_id="r")])
            own = next(e for e in result.results[0] if isinstance(e, OwnerStarted)).owner_id
            result = await client.step(2, 2.0, [AllocateBlocks(engine_id="pod-a", owner_id=own, pool_id=0, count=1)])
            blocks = next(e for e in result.results[0] if isinstance(e, BlocksAllocated)).blocks
            result = await client.step(
                3,
                3.0,
                [
                    MarkComputed(engine_id="pod-a", owner_id=own, blocks=blocks, token_ids=TOKENS[:4]),
                    StartStore(engine_id="pod-a", tier=TIER, blocks=blocks),
                ],
            )
        async with engine_client(sock, "pod-a"):  # a fresh engine process: a new incarnation fences the store
            pass
        assert len(sidecar.ledger.state.fenced) == 1
        assert declaration("pod-a").world_size == 2
        runner = CliRunner()
        released = await _invoke(
            runner, ["jobs", "release", "--engine", "pod-a", "--rank", "0", "--reason", "node drained", "--socket", str(sock)]
        )
        assert released.exit_code == 0, released.output
        assert "released rank 0 of pod-a" in released.output
        again = await _invoke(
            runner, ["jobs", "release", "--engine", "pod-a", "--rank", "0", "--reason", "node drained", "--socket", str(sock)]
        )
        assert again.exit_code == 1 and "stale_job" in again.output, again.output
        assert len(sidecar.ledger.state.fenced) == 1  # rank 1 still pending: nothing released for it
        done = await _invoke(
            runner, ["jobs", "release", "--engine", "pod-a", "--rank", "1", "--reason", "node drained", "--socket", str(sock)]
        )
        assert done.exit_code == 0, done.output
        assert not sidecar.ledger.state.fenced
        pool = sidecar.ledger.state.engines["pod-a"].pools[0]
        assert pool.pins[blocks[0].block_id] == 0


async def _invoke(runner: CliRunner, args: list[str]) -> Result:
    """The CLI runs anyio.run itself: from a thread, beside this test's event loop."""
    import anyio

    return await anyio.to_thread.run_sync(lambda: runner.invoke(app, args))


def test_I16_a_rank_beyond_a_shrunk_world_size_is_still_released() -> None:
    """The engine restarted with fewer ranks: its old fenced jobs still wait on their own ranks,
    and those are exactly the workers that are gone (found in review)."""
    from coordinator.core.commands import DeclareEngine
    from tests.kit.builders import attention_pool, namespace

    core = new_core(world_size=4)
    job, blocks, _ = fenced_store(core)
    ok(
        core.execute(
            DeclareEngine(engine_id=ENGINE, namespace=namespace(tp=2), pools=[attention_pool()], world_size=2, tiers=[TIER])
        )
    )
    assert core.state.engines[ENGINE].world_size == 2 and core.state.fenced[job.job_id].pending == [1, 2, 3]
    for rank in (3, 2, 1):
        ok(core.execute(ReleaseFencedRank(engine_id=ENGINE, rank=rank, reason="old pod deleted")))
    assert job.job_id not in core.state.fenced
    assert replay_matches(core)
