"""Workers on real tensors through the real sidecar: verified stores and loads (I11, I13),
ordered state copies (I15), failures reported with a reason and never as success, and a
restart that executes nothing twice.

Pools are torch tensors on the CPU (the same API as CUDA); tiers are real host memory and real
files. Block contents are deterministic bytes per (block, rank), so every check compares bytes.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import anyio
import msgspec
import pytest
import torch

from coordinator.client import Address, EngineClient, WorkerClient
from coordinator.core.commands import (
    AllocateBlocks,
    LoadRequest,
    MarkComputed,
    Move,
    PlanStateCopy,
    StartLoad,
    StartOwner,
    StartStore,
)
from coordinator.core.protections import Protection
from coordinator.core.routing import Decision
from events import (
    BlockRef,
    BlocksAllocated,
    JobFailed,
    JobSucceeded,
    KeyQuarantined,
    LoadItem,
    LoadJobStarted,
    OwnerStarted,
    PoolSpec,
    StoreItem,
    StoreJobStarted,
)
from events.log import EventLog
from gpu.checksum import checksum
from gpu.pools import DevicePools
from gpu.tiers import DiskTier, HostTier, SlotTier, Tier, TierError
from gpu.worker import Pending, Worker, WorkerState
from tests.kit import builders as b
from tests.kit.sidecar import TIER_SPEC, Engine, declaration, sidecar_on

pytestmark = pytest.mark.anyio
CPU = torch.device("cpu")
BLOCK_BYTES = 256
WORLD = 2


def pattern(block_id: int, rank: int, salt: int = 0) -> torch.Tensor:
    """The bytes block `block_id` holds on `rank`: distinct per block, rank and salt."""
    return ((torch.arange(BLOCK_BYTES, dtype=torch.int64) * (7 + 2 * rank) + block_id * 31 + salt) % 251).to(torch.uint8)


def pools_spec() -> list[PoolSpec]:
    return [msgspec.structs.replace(b.attention_pool(num_blocks=32), bytes_per_block=BLOCK_BYTES)]


class Rig:
    """An engine and its two worker ranks, each with its own pools and a disk tier."""

    def __init__(self, socket: Path, root: Path) -> None:
        self.address = Address(socket_path=str(socket))
        self.specs = pools_spec()
        self.client = EngineClient(self.address, declaration("pod-a", pools=self.specs), tiers=[TIER_SPEC])
        self.engine = Engine(self.client)
        self.root = root
        self.workers = [self.make_worker(rank) for rank in range(WORLD)]

    def make_worker(self, rank: int) -> Worker:
        tiers: dict[str, Tier] = {b.TIER: DiskTier(b.TIER, self.root / f"tier-rank-{rank}", CPU)}
        return Worker("pod-a", rank, DevicePools(self.specs, CPU), tiers, self.root / f"worker-{rank}.json")

    async def run_workers(self, decisions: int, workers: list[Worker] | None = None) -> None:
        """Let each worker execute `decisions` more decisions, then stop."""

        async def one(worker: Worker) -> None:
            target = len(worker.executed) + decisions
            client = WorkerClient(self.address, "pod-a", worker.rank)
            stop: Callable[[Decision], bool] = lambda _: len(worker.executed) >= target  # noqa: E731
            await worker.run(client, stop_after=stop)

        with anyio.fail_after(30):
            async with anyio.create_task_group() as tg:
                for worker in workers or self.workers:
                    tg.start_soon(one, worker)

    async def owner(self, req_id: str) -> int:
        result = await self.engine.step([StartOwner(engine_id="pod-a", req_id=req_id)])
        return next(e for e in result.results[0] if isinstance(e, OwnerStarted)).owner_id

    async def allocate(self, owner: int, count: int) -> list[BlockRef]:
        result = await self.engine.step([AllocateBlocks(engine_id="pod-a", owner_id=owner, pool_id=0, count=count)])
        return next(e for e in result.results[0] if isinstance(e, BlocksAllocated)).blocks

    def fill(self, blocks: list[BlockRef], salt: int = 0) -> None:
        """The engine's compute wrote these blocks (on every rank)."""
        for worker in self.workers:
            for ref in blocks:
                worker.pools.block(ref).copy_(pattern(ref.block_id, worker.rank, salt))


async def stored_keys(rig: Rig, tokens: list[int]) -> tuple[StoreJobStarted, list[BlockRef]]:
    owner = await rig.owner("producer")
    blocks = await rig.allocate(owner, len(tokens) // b.BLOCK)
    rig.fill(blocks)
    result = await rig.engine.step(
        [
            MarkComputed(engine_id="pod-a", owner_id=owner, blocks=blocks, token_ids=tokens),
            StartStore(engine_id="pod-a", tier=b.TIER, blocks=blocks),
        ]
    )
    [decision] = result.decisions
    assert isinstance(decision.event, StoreJobStarted)
    await rig.run_workers(1)
    return decision.event, blocks


async def load(rig: Rig, keys: list[bytes]) -> tuple[LoadJobStarted, list[BlockRef]]:
    decision, dests, _ = await load_at(rig, keys)
    return decision, dests


async def load_at(rig: Rig, keys: list[bytes]) -> tuple[LoadJobStarted, list[BlockRef], int]:
    """A load decision, its destinations and its global sequence."""
    owner = await rig.owner(f"consumer-{len(rig.engine.results)}")
    dests = await rig.allocate(owner, len(keys))
    result = await rig.engine.step(
        [StartLoad(engine_id="pod-a", tier=b.TIER, items=[LoadRequest(key, dest) for key, dest in zip(keys, dests, strict=True)])]
    )
    [decision] = result.decisions
    assert isinstance(decision.event, LoadJobStarted)
    return decision.event, dests, decision.seq


async def job_outcome(event_log: EventLog, job_id: int) -> list[object]:
    from events import EventCodec
    from events.log.reading import decode

    codec = EventCodec()
    return [
        e
        for e in (decode(codec, s) for s in await event_log.read(0, 100_000))
        if isinstance(e, JobSucceeded | JobFailed | KeyQuarantined) and e.job_id == job_id
    ]


async def test_I11_I13_a_stored_block_loads_back_byte_for_byte_into_every_destination(
    event_log: EventLog, tmp_path: Path
) -> None:
    async with sidecar_on(event_log, tmp_path / "s.sock"):
        rig = Rig(tmp_path / "s.sock", tmp_path)
        async with rig.client:
            tokens = list(range(2 * b.BLOCK))
            store, sources = await stored_keys(rig, tokens)
            assert [type(e) for e in await job_outcome(event_log, store.job_id)] == [JobSucceeded]
            for worker in rig.workers:
                for item, ref in zip(store.items, sources, strict=True):
                    file = worker.tiers[b.TIER].path(item.key)  # type: ignore[attr-defined]
                    assert file.read_bytes() == bytes(pattern(ref.block_id, worker.rank).tolist())
            # The same key twice and another once: three destinations, two reads, all verified.
            keys = [store.items[0].key, store.items[0].key, store.items[1].key]
            decision, dests = await load(rig, keys)
            assert decision.items[0].checksums == [checksum(pattern(sources[0].block_id, r)) for r in range(WORLD)]
            await rig.run_workers(1)
            assert [type(e) for e in await job_outcome(event_log, decision.job_id)] == [JobSucceeded]
            expected_sources = [sources[0], sources[0], sources[1]]
            for worker in rig.workers:
                for dest, source in zip(dests, expected_sources, strict=True):
                    assert torch.equal(worker.pools.block(dest), pattern(source.block_id, worker.rank))


async def test_I13_a_flipped_byte_in_a_tier_file_fails_the_load_and_the_key_is_quarantined(
    event_log: EventLog, tmp_path: Path
) -> None:
    async with sidecar_on(event_log, tmp_path / "s.sock"):
        rig = Rig(tmp_path / "s.sock", tmp_path)
        async with rig.client:
            store, _ = await stored_keys(rig, list(range(2 * b.BLOCK)))
            key = store.items[0].key
            file = rig.workers[1].tiers[b.TIER].path(key)  # type: ignore[attr-defined]
            data = bytearray(file.read_bytes())
            data[17] ^= 0x01
            file.write_bytes(bytes(data))
            decision, dests = await load(rig, [key])
            before = [w.pools.block(dests[0]).clone() for w in rig.workers]
            await rig.run_workers(1)
            outcome = await job_outcome(event_log, decision.job_id)
            assert [type(e) for e in outcome] == [KeyQuarantined, JobFailed]
            assert outcome[0].key == key and outcome[1].reason == "checksum_mismatch"  # type: ignore[attr-defined]
            # Rank 1 copied nothing from the bad bytes; rank 0's good copy does not make the job succeed.
            assert torch.equal(rig.workers[1].pools.block(dests[0]), before[1])
            # The worker keeps running: the other key still loads.
            decision2, _ = await load(rig, [store.items[1].key])
            await rig.run_workers(1)
            assert [type(e) for e in await job_outcome(event_log, decision2.job_id)] == [JobSucceeded]


async def test_I13_a_load_that_fails_verification_keeps_the_blocks_before_the_first_bad_one(
    event_log: EventLog, tmp_path: Path
) -> None:
    """Issue 19, item 7: the second key's file is damaged on rank 1. Both ranks fill the first
    destination with the published bytes (it verified everywhere); rank 1 copies nothing from the
    second key on; the job fails keeping one block, which the engine's state counts as loaded."""
    async with sidecar_on(event_log, tmp_path / "s.sock") as sidecar:
        rig = Rig(tmp_path / "s.sock", tmp_path)
        async with rig.client:
            store, sources = await stored_keys(rig, list(range(2 * b.BLOCK)))
            keys = [item.key for item in store.items]
            file = rig.workers[1].tiers[b.TIER].path(keys[1])  # type: ignore[attr-defined]
            data = bytearray(file.read_bytes())
            data[5] ^= 0x01
            file.write_bytes(bytes(data))
            decision, dests = await load(rig, keys)
            before = rig.workers[1].pools.block(dests[1]).clone()
            await rig.run_workers(1)
            outcome = await job_outcome(event_log, decision.job_id)
            assert [type(e) for e in outcome] == [KeyQuarantined, JobFailed]
            assert outcome[1].kept == 1  # type: ignore[attr-defined]
            for worker in rig.workers:
                assert torch.equal(worker.pools.block(dests[0]), pattern(sources[0].block_id, worker.rank))
            assert torch.equal(rig.workers[1].pools.block(dests[1]), before)
            pool = sidecar.ledger.state.engines["pod-a"].pools[dests[0].pool_id]
            assert [pool.keys[d.block_id] for d in dests] == [keys[0], None]


@pytest.mark.parametrize("damage", ["missing", "truncated", "size_mismatch"])
async def test_a_missing_or_wrong_sized_tier_file_is_a_failed_report_with_its_reason(
    event_log: EventLog, tmp_path: Path, damage: str
) -> None:
    """The tier lost the key's bytes: the report says which items (lost), the load fails
    (OBJECT_LOST) and the key leaves the tier, so no lookup offers it again."""
    async with sidecar_on(event_log, tmp_path / "s.sock") as sidecar:
        rig = Rig(tmp_path / "s.sock", tmp_path)
        async with rig.client:
            store, _ = await stored_keys(rig, list(range(2 * b.BLOCK)))
            key = store.items[0].key
            file = rig.workers[0].tiers[b.TIER].path(key)  # type: ignore[attr-defined]
            if damage == "missing":
                file.unlink()
            elif damage == "truncated":
                file.write_bytes(file.read_bytes()[:100])
            else:
                file.write_bytes(file.read_bytes() + b"extra")
            decision, _ = await load(rig, [key])
            report = rig.workers[0].execute(decision)
            assert not report.ok and report.error.startswith(f"object_lost: {damage}: ") and report.lost == [0], report
            await rig.run_workers(1)
            outcome = await job_outcome(event_log, decision.job_id)
            assert [type(e) for e in outcome] == [JobFailed] and outcome[0].reason == "object_lost"  # type: ignore[attr-defined]
            tier = sidecar.ledger.state.tiers[b.TIER]
            assert tier.entry(decision.items[0].dest.pool_id, key) is None  # evicted: the tier lost it
            assert tier.entry(store.items[1].source.pool_id, store.items[1].key) is not None  # the other is kept


def test_pools_mapped_from_one_directory_are_one_memory_and_survive_their_mapper(tmp_path: Path) -> None:
    """`kvledger worker --pools-dir`: an engine and its worker processes map the same pool files,
    so a worker's copy lands in the engine's memory; a new mapping (a restarted worker) sees what
    was written before. Only host memory can be mapped from files."""
    specs = [b.attention_pool(num_blocks=4)]
    engine = DevicePools(specs, CPU, "bfloat16", directory=tmp_path)
    worker = DevicePools(specs, CPU, "uint8", directory=tmp_path)
    ref = BlockRef(0, 2, 1)
    worker.block(ref).copy_(torch.arange(worker.block(ref).numel(), dtype=torch.uint8))
    assert torch.equal(engine.block(ref), worker.block(ref))
    del worker
    restarted = DevicePools(specs, CPU, "uint8", directory=tmp_path)
    assert torch.equal(restarted.block(ref), engine.block(ref)) and int(restarted.block(ref).sum()) > 0
    assert not bool(restarted.block(BlockRef(0, 1, 1)).any())  # created zero-filled
    with pytest.raises(ValueError, match="host memory"):
        DevicePools(specs, torch.device("meta"), directory=tmp_path)


def test_decisions_naming_the_null_block_or_a_block_outside_the_pool_are_failed_reports(tmp_path: Path) -> None:
    specs = pools_spec()
    worker = Worker("pod-a", 0, DevicePools(specs, CPU), {b.TIER: HostTier(b.TIER, CPU)})
    before = worker.pools.pool(0).clone()
    for block_id, reason in ((0, "null_block"), (32, "unknown_block"), (10_000, "unknown_block")):
        event = StoreJobStarted(
            job_id=1,
            engine_id="pod-a",
            incarnation=1,
            tier=b.TIER,
            world_size=2,
            items=[StoreItem(BlockRef(0, 3, 1), b"k" * 16, 0, 1), StoreItem(BlockRef(0, block_id, 1), b"j" * 16, 1, 1)],
        )
        report = worker.execute(event)
        assert not report.ok and report.error.startswith(reason), report
        with pytest.raises(TierError, match="missing"):  # nothing stored: the bad item was found before any write
            worker.tiers[b.TIER].read(b"k" * 16, BLOCK_BYTES, slot=0)
        load = LoadJobStarted(
            job_id=2,
            engine_id="pod-a",
            incarnation=1,
            tier=b.TIER,
            world_size=2,
            items=[LoadItem(b"k" * 16, 0, 1, BlockRef(0, block_id, 1))],
            lease_expires_at=10.0,
        )
        report = worker.execute(load)
        assert not report.ok and report.error.startswith(reason)
    unknown_tier = StoreJobStarted(
        job_id=3,
        engine_id="pod-a",
        incarnation=1,
        tier="nvme",
        world_size=2,
        items=[StoreItem(BlockRef(0, 3, 1), b"k" * 16, 0, 1)],
    )
    assert worker.execute(unknown_tier).error.startswith("unknown_tier")
    assert torch.equal(worker.pools.pool(0), before)


async def test_I15_a_state_copy_decision_runs_on_the_pool_tensors_with_parallel_assignment(
    event_log: EventLog, tmp_path: Path
) -> None:
    async with sidecar_on(event_log, tmp_path / "s.sock"):
        rig = Rig(tmp_path / "s.sock", tmp_path)
        async with rig.client:
            owner = await rig.owner("copier")
            a, c = await rig.allocate(owner, 2)
            rig.fill([a, c])
            originals = [w.pools.pool(0).clone() for w in rig.workers]
            # A shift right inside block a, a swap of two regions between a and c, a copy a -> c.
            moves = [Move(a, 0, a, 8, 64), Move(c, 100, a, 100, 20), Move(a, 100, c, 100, 20), Move(a, 200, c, 0, 16)]
            result = await rig.engine.step([PlanStateCopy(engine_id="pod-a", pool_id=0, moves=moves)])
            [decision] = result.decisions
            await rig.run_workers(1)
            assert [type(e) for e in await job_outcome(event_log, decision.event.job_id)] == [JobSucceeded]
            for worker, original in zip(rig.workers, originals, strict=True):
                expected = original.clone()
                for move in moves:  # parallel assignment, from the untouched snapshot
                    expected[move.dst.block_id, move.dst_offset : move.dst_offset + move.length] = original[
                        move.src.block_id, move.src_offset : move.src_offset + move.length
                    ]
                assert torch.equal(worker.pools.pool(0), expected)


async def test_a_restarted_worker_resumes_after_its_acknowledged_decision_and_executes_nothing_twice(
    event_log: EventLog, tmp_path: Path
) -> None:
    async with sidecar_on(event_log, tmp_path / "s.sock"):
        rig = Rig(tmp_path / "s.sock", tmp_path)
        async with rig.client:
            first, _ = await stored_keys(rig, list(range(2 * b.BLOCK)))
            executed_before = list(rig.workers[0].executed)
            assert len(executed_before) == 1
            # Two more decisions while rank 0 is down; rank 1 keeps up.
            second, _, second_seq = await load_at(rig, [first.items[0].key])
            third, _ = await load(rig, [first.items[1].key])
            await rig.run_workers(2, [rig.workers[1]])
            restarted = rig.make_worker(0)  # a new process: only the state file carries over
            assert restarted.state == WorkerState(acked=executed_before[0])
            # Say it had executed `second` and saved its report, then crashed before sending it:
            pending_report = restarted.execute(second)
            restarted._save(WorkerState(acked=executed_before[0], pending=Pending(second_seq, pending_report)))
            again = rig.make_worker(0)
            await rig.run_workers(1, [again])
            assert len(again.executed) == 1, "only the decision after the saved report ran"
            assert [type(e) for e in await job_outcome(event_log, second.job_id)] == [JobSucceeded]
            assert [type(e) for e in await job_outcome(event_log, third.job_id)] == [JobSucceeded]
            assert again.state.pending is None and again.state.acked == again.executed[-1]


@pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs CUDA: stores and loads on the transfer stream after the compute stream"
)
def test_on_cuda_a_store_reads_what_the_compute_stream_wrote(tmp_path: Path) -> None:
    device = torch.device("cuda")
    specs = pools_spec()
    worker = Worker("pod-a", 0, DevicePools(specs, device), {b.TIER: HostTier(b.TIER, device)})
    ref = BlockRef(0, 5, 1)
    big = torch.randn(4096, 4096, device=device)
    (big @ big).sum()  # keep the compute stream busy
    worker.pools.block(ref).copy_(pattern(5, 0).to(device), non_blocking=True)
    report = worker.execute(
        StoreJobStarted(
            job_id=1, engine_id="pod-a", incarnation=1, tier=b.TIER, world_size=1, items=[StoreItem(ref, b"k" * 16, 0, 1)]
        )
    )
    assert report.ok and report.checksums == [checksum(pattern(5, 0))]


def test_kvledger_worker_processes_store_for_a_served_engine(tmp_path: Path) -> None:
    """`kvledger serve` and two `kvledger worker` processes: a store decided for the engine is
    written by both ranks to their disk tiers and published."""
    import subprocess
    import sys

    from tests.kit.sidecar import ROOT, serve_process

    with serve_process(tmp_path) as server:
        workers: list[subprocess.Popen[bytes]] = []
        try:

            async def scenario() -> None:
                rig = Rig(server.socket, tmp_path)
                async with rig.client:
                    for rank in range(WORLD):
                        workers.append(
                            subprocess.Popen(
                                [
                                    sys.executable,
                                    "-m",
                                    "coordinator.cli",
                                    "worker",
                                    "--engine",
                                    "pod-a",
                                    "--rank",
                                    str(rank),
                                    "--socket",
                                    str(server.socket),
                                    "--tier",
                                    f"{b.TIER}=disk:{tmp_path / 'tier'}",
                                    "--state-dir",
                                    str(tmp_path / "state"),
                                ],
                                cwd=ROOT,
                                env=server.env,
                                stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE,
                            )
                        )
                    owner = await rig.owner("producer")
                    blocks = await rig.allocate(owner, 2)
                    result = await rig.engine.step(
                        [
                            MarkComputed(engine_id="pod-a", owner_id=owner, blocks=blocks, token_ids=list(range(2 * b.BLOCK))),
                            StartStore(engine_id="pod-a", tier=b.TIER, blocks=blocks),
                        ]
                    )
                    [decision] = result.decisions
                    with anyio.fail_after(60):
                        while True:  # the published keys appear once both ranks reported
                            answer = await rig.client.lookup(b.TIER, list(range(2 * b.BLOCK)))
                            if answer.answer.boundary == 2 * b.BLOCK:  # type: ignore[union-attr]
                                break
                            await anyio.sleep(0.1)
                    assert isinstance(decision.event, StoreJobStarted)
                    for rank in range(WORLD):
                        for item in decision.event.items:
                            file = tmp_path / "tier" / f"rank-{rank}" / f"{item.key.hex()}.kv"
                            assert file.stat().st_size == BLOCK_BYTES  # zeros: nothing computed them here
                    assert (tmp_path / "state" / "worker-pod-a-0.json").exists()

            anyio.run(scenario)
        finally:
            for process in workers:
                process.kill()
                process.wait(10)
        first_line = workers[0].stdout.read().decode().splitlines()[0] if workers and workers[0].stdout else ""
        where = "cuda" if torch.cuda.is_available() else "cpu"  # the worker takes the GPU when it sees one
        assert first_line.startswith(f"kvledger worker: engine pod-a rank 0 on {where}"), first_line


def test_pools_are_typed_from_the_declaration_and_transfers_move_their_bytes() -> None:
    spec = pools_spec()
    pools = DevicePools(spec, CPU, "bfloat16")
    typed = pools.typed[0]
    assert typed.dtype == torch.bfloat16 and typed.shape == (32, BLOCK_BYTES // 2)
    assert pools.pool(0).shape == (32, BLOCK_BYTES) and pools.pool(0).dtype == torch.uint8
    typed[3] = torch.linspace(-1, 1, BLOCK_BYTES // 2, dtype=torch.bfloat16)  # the engine's kernel writes KV
    worker = Worker("pod-a", 0, pools, {b.TIER: HostTier(b.TIER, CPU)})
    report = worker.execute(
        StoreJobStarted(
            job_id=1,
            engine_id="pod-a",
            incarnation=1,
            tier=b.TIER,
            world_size=1,
            items=[StoreItem(BlockRef(0, 3, 1), b"k" * 16, 0, 1)],
        )
    )
    assert report.ok and report.checksums == [checksum(typed[3].view(torch.uint8))]
    with pytest.raises(ValueError, match="float64"):
        DevicePools(spec, CPU, "float64")
    odd = msgspec.structs.replace(spec[0], bytes_per_block=255)
    with pytest.raises(ValueError, match="255 bytes per block"):
        DevicePools([odd], CPU, "bfloat16")


def _store_then_reuse_the_slot(worker: Worker) -> LoadJobStarted:
    """Key a is stored at tier slot 0 from block 3; then the slot goes to key b, stored from
    block 4. Returns a load of key a at slot 0 (generation 1, a's checksum) into block 5."""
    tier = worker.tiers[b.TIER]
    worker.pools.block(BlockRef(0, 3, 1)).copy_(pattern(3, 0))
    worker.pools.block(BlockRef(0, 4, 1)).copy_(pattern(4, 0))
    stored = worker.execute(
        StoreJobStarted(
            job_id=1,
            engine_id="pod-a",
            incarnation=1,
            tier=b.TIER,
            world_size=1,
            items=[StoreItem(BlockRef(0, 3, 1), b"a" * 16, 0, 1)],
        )
    )
    assert stored.ok and torch.equal(tier.read(b"a" * 16, BLOCK_BYTES, slot=0), pattern(3, 0))
    reused = worker.execute(
        StoreJobStarted(
            job_id=2,
            engine_id="pod-a",
            incarnation=1,
            tier=b.TIER,
            world_size=1,
            items=[StoreItem(BlockRef(0, 4, 1), b"b" * 16, 0, 2)],
        )
    )
    assert reused.ok
    return LoadJobStarted(
        job_id=3,
        engine_id="pod-a",
        incarnation=1,
        tier=b.TIER,
        world_size=1,
        items=[LoadItem(b"a" * 16, 0, 1, BlockRef(0, 5, 1), stored.checksums)],
        lease_expires_at=10.0,
    )


def test_I13_a_slot_tier_read_of_a_reused_slot_returns_the_new_keys_bytes_and_the_checksum_catches_it() -> None:
    """SlotTier is addressed by slot: a stale read of key a at its old slot gets key b's bytes.
    The worker compares them with a's published checksum and copies nothing."""
    worker = Worker("pod-a", 0, DevicePools(pools_spec(), CPU), {b.TIER: SlotTier(b.TIER, CPU, 4, BLOCK_BYTES)})
    load = _store_then_reuse_the_slot(worker)
    assert torch.equal(worker.tiers[b.TIER].read(b"a" * 16, BLOCK_BYTES, slot=0), pattern(4, 0))
    before = worker.pools.block(BlockRef(0, 5, 1)).clone()
    report = worker.execute(load)
    assert not report.ok and report.error.startswith("checksum_mismatch"), report
    assert report.checksums == [checksum(pattern(4, 0))]  # what was read, for the coordinator
    assert torch.equal(worker.pools.block(BlockRef(0, 5, 1)), before)


def test_I13_off_the_worker_copies_whatever_the_slot_holds_and_reports_success() -> None:
    """Checksums off (MOONCAKE_STORE_CHECKSUM unset, seed 002): the same stale read lands."""
    worker = Worker(
        "pod-a",
        0,
        DevicePools(pools_spec(), CPU),
        {b.TIER: SlotTier(b.TIER, CPU, 4, BLOCK_BYTES)},
        protections_off=frozenset({Protection.CHECKSUMS}),
    )
    report = worker.execute(_store_then_reuse_the_slot(worker))
    assert report.ok and report.checksums == [checksum(pattern(4, 0))]
    assert torch.equal(worker.pools.block(BlockRef(0, 5, 1)), pattern(4, 0))


def test_a_slot_tier_checks_the_slot_and_the_size_and_a_key_tier_ignores_the_slot() -> None:
    tier = SlotTier(b.TIER, CPU, 2, BLOCK_BYTES)
    with pytest.raises(TierError, match="missing"):
        tier.read(b"a" * 16, BLOCK_BYTES, slot=1)
    with pytest.raises(TierError, match="unknown_slot"):
        tier.write(b"a" * 16, pattern(1, 0), slot=2)
    with pytest.raises(TierError, match="size_mismatch"):
        tier.write(b"a" * 16, torch.zeros(BLOCK_BYTES + 1, dtype=torch.uint8), slot=0)
    tier.write(b"a" * 16, pattern(1, 0), slot=1)
    with pytest.raises(TierError, match="size_mismatch"):
        tier.read(b"a" * 16, BLOCK_BYTES // 2, slot=1)
    tier.delete(b"a" * 16)
    with pytest.raises(TierError, match="missing"):
        tier.read(b"a" * 16, BLOCK_BYTES, slot=1)
    host = HostTier(b.TIER, CPU)
    host.write(b"a" * 16, pattern(1, 0), slot=0)
    host.write(b"b" * 16, pattern(2, 0), slot=0)  # the same slot: a key-addressed tier keeps both
    assert torch.equal(host.read(b"a" * 16, BLOCK_BYTES, slot=7), pattern(1, 0))
