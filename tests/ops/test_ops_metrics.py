"""The metrics the alerting rules page on (ops/alerts/kvledger.rules.yml) move when the thing they
name happens: integrity violations by kind (I10, I13, I4), lease expiries (I12) and the age of
the oldest pin (I3).

Each test drives a real sidecar (in this process, on a real Unix socket and a SQLite log, as
tests/sidecar/test_sidecar.py does) through the commands and reports that make it happen; the counts are
read from the sidecar's own registry, what /metrics serves. The metrics are backend-independent
(they are fed from committed events and the committed state), so one backend is enough here.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from pathlib import Path

import anyio
import pytest

from coordinator.client import Address, EngineClient
from coordinator.core.commands import (
    AllocateBlocks,
    FinishOwner,
    LoadRequest,
    MarkComputed,
    ReportRank,
    StartLoad,
    StartOwner,
    StartStore,
)
from coordinator.sidecar import protocol as p
from coordinator.sidecar.metrics import INTEGRITY_KINDS
from coordinator.sidecar.server import Sidecar
from events import (
    BlockRef,
    BlocksAllocated,
    JobFailed,
    KeyQuarantined,
    LoadJobStarted,
    NoticeDropped,
    OwnerStarted,
    Reason,
    StoreJobStarted,
)
from events.log import EventLog, open_log
from tests.kit import builders as b
from tests.kit.sidecar import TIER_SPEC, declaration, sidecar_on

pytestmark = pytest.mark.anyio

ENGINE = "pod-a"


@pytest.fixture
async def sqlite_log(tmp_path: Path) -> AsyncIterator[EventLog]:
    event_log = await open_log(str(tmp_path / "log.sqlite"))
    try:
        yield event_log
    finally:
        await event_log.close()


def sample(sidecar: Sidecar, name: str, **labels: str) -> float | None:
    return sidecar.metrics.registry.get_sample_value(name, labels)


def integrity(sidecar: Sidecar) -> dict[str, float | None]:
    return {kind: sample(sidecar, "kvledger_integrity_violations_total", kind=kind) for kind in INTEGRITY_KINDS}


class Driver:
    """One engine's scheduler, by hand: each call is one committed step."""

    def __init__(self, client: EngineClient) -> None:
        self.client = client
        self.step_no = 0
        self.clock = 0.0

    async def step(self, *commands: object, clock: float | None = None) -> p.StepResult:
        self.step_no += 1
        self.clock = clock if clock is not None else self.clock + 0.01
        return await self.client.step(self.step_no, self.clock, list(commands))  # type: ignore[arg-type]

    async def owner(self, req_id: str) -> int:
        result = await self.step(StartOwner(engine_id=ENGINE, req_id=req_id))
        return next(e for e in result.results[0] if isinstance(e, OwnerStarted)).owner_id

    async def allocate(self, owner: int, count: int) -> list[BlockRef]:
        result = await self.step(AllocateBlocks(engine_id=ENGINE, owner_id=owner, pool_id=0, count=count))
        return next(e for e in result.results[0] if isinstance(e, BlocksAllocated)).blocks

    async def computed_and_stored(self, req_id: str, tokens: list[int]) -> StoreJobStarted:
        """A request computes `tokens` into blocks of its own and stores them: the store decision."""
        owner = await self.owner(req_id)
        blocks = await self.allocate(owner, len(tokens) // b.BLOCK)
        result = await self.step(
            MarkComputed(engine_id=ENGINE, owner_id=owner, blocks=blocks, token_ids=tokens),
            StartStore(engine_id=ENGINE, tier=b.TIER, blocks=blocks),
        )
        [decision] = result.decisions
        assert isinstance(decision.event, StoreJobStarted)
        return decision.event

    async def report(self, job: StoreJobStarted | LoadJobStarted, rank: int, checksums: list[bytes]) -> p.Committed:
        return await self.client.report(ReportRank(job_id=job.job_id, rank=rank, ok=True, checksums=checksums))

    async def honest_reports(self, job: StoreJobStarted) -> None:
        for rank in (0, 1):
            await self.report(job, rank, [b.checksum(item.key, rank) for item in job.items])


def engine_client(socket_path: Path) -> EngineClient:
    return EngineClient(Address(socket_path=str(socket_path)), declaration(ENGINE), tiers=[TIER_SPEC])


async def test_integrity_violations_count_a_store_conflict_a_load_checksum_mismatch_and_a_conflicting_report(
    sqlite_log: EventLog, tmp_path: Path
) -> None:
    """I10: two stores of the same key in flight at once, the second with other bytes: the key
    is quarantined and `store_conflict` counts it. I13: a load whose worker reads other bytes
    than published: the load fails, its key is quarantined, and `checksum_mismatch` counts the
    load (not also as a store conflict). I4: a rank reporting one job twice, differently:
    `conflicting_report`. Every kind is exported at 0 before anything happens."""
    sock = tmp_path / "s.sock"
    async with sidecar_on(sqlite_log, sock) as sidecar, engine_client(sock) as client:
        driver = Driver(client)
        assert integrity(sidecar) == dict.fromkeys(INTEGRITY_KINDS, 0.0)
        tokens = list(range(100, 100 + 2 * b.BLOCK))  # two blocks; both requests compute them: the same keys (I8)
        first = await driver.computed_and_stored("r1", tokens)
        second = await driver.computed_and_stored("r2", tokens)
        assert [i.key for i in first.items] == [i.key for i in second.items]
        await driver.honest_reports(first)
        assert integrity(sidecar) == dict.fromkeys(INTEGRITY_KINDS, 0.0)

        wrong = [b"other bytes", b.checksum(second.items[1].key, 0)]  # rank 0 computed block 0 wrong
        await driver.report(second, 0, wrong)
        committed = await driver.report(second, 1, [b.checksum(item.key, 1) for item in second.items])
        quarantined = [e for e in committed.events if isinstance(e, KeyQuarantined)]
        assert [(e.key, e.reason) for e in quarantined] == [(second.items[0].key, Reason.CHECKSUM_MISMATCH)]
        assert integrity(sidecar) == {"checksum_mismatch": 0.0, "store_conflict": 1.0, "conflicting_report": 0.0}

        reader = await driver.owner("r3")
        [dest] = await driver.allocate(reader, 1)
        key = first.items[1].key  # still published, never quarantined
        loaded = await driver.step(StartLoad(engine_id=ENGINE, tier=b.TIER, items=[LoadRequest(key, dest)]))
        [decision] = loaded.decisions
        load = decision.event
        assert isinstance(load, LoadJobStarted)
        await driver.report(load, 0, [b.checksum(key, 0)])
        committed = await driver.report(load, 1, [b"read other bytes"])
        assert any(isinstance(e, JobFailed) and e.reason == Reason.CHECKSUM_MISMATCH for e in committed.events)
        assert any(isinstance(e, KeyQuarantined) for e in committed.events)
        assert integrity(sidecar) == {"checksum_mismatch": 1.0, "store_conflict": 1.0, "conflicting_report": 0.0}

        third = await driver.computed_and_stored("r4", list(range(900, 900 + b.BLOCK)))
        await driver.report(third, 0, [b.checksum(third.items[0].key, 0)])
        answer = await driver.report(third, 0, [b"a different account of the same work"])
        assert [(type(e), e.reason) for e in answer.events if isinstance(e, NoticeDropped)] == [
            (NoticeDropped, Reason.CONFLICTING_REPORT)
        ], "a report is a notice: dropped and recorded"
        assert integrity(sidecar) == {"checksum_mismatch": 1.0, "store_conflict": 1.0, "conflicting_report": 1.0}
        assert sample(sidecar, "kvledger_refusals_total", kind="dropped", reason="conflicting_report") == 1.0


async def test_lease_expiries_count_a_load_that_completes_after_its_lease(sqlite_log: EventLog, tmp_path: Path) -> None:
    """I12: a load decided with a 1 s lease whose reports arrive after the engine's clock passed
    the expiry fails (`lease_expired`), and `kvledger_lease_expiries_total` counts it."""
    sock = tmp_path / "s.sock"
    async with sidecar_on(sqlite_log, sock) as sidecar, engine_client(sock) as client:
        driver = Driver(client)
        stored = await driver.computed_and_stored("r1", list(range(2 * b.BLOCK)))
        await driver.honest_reports(stored)
        reader = await driver.owner("r2")
        [dest] = await driver.allocate(reader, 1)
        key = stored.items[0].key
        loaded = await driver.step(StartLoad(engine_id=ENGINE, tier=b.TIER, items=[LoadRequest(key, dest)], lease_seconds=1.0))
        [decision] = loaded.decisions
        assert isinstance(decision.event, LoadJobStarted)
        assert sample(sidecar, "kvledger_lease_expiries_total") == 0.0
        await driver.step(clock=driver.clock + 5.0)  # the engine moves on; the load is slow
        for rank in (0, 1):
            committed = await driver.report(decision.event, rank, [b.checksum(key, rank)])
        assert any(isinstance(e, JobFailed) and e.reason == Reason.LEASE_EXPIRED for e in committed.events)
        assert sample(sidecar, "kvledger_lease_expiries_total") == 1.0


async def test_oldest_pin_seconds_grows_while_a_job_pins_and_drops_to_zero_when_it_ends(
    sqlite_log: EventLog, tmp_path: Path
) -> None:
    """I3: a store job pins its source blocks until both ranks report. While it is in flight the
    engine's `kvledger_oldest_pin_seconds` grows with wall time (the alert on stuck pins reads
    it); once it ends, 0. After a restart, a job recovered from the log still pins, and its age
    counts from the first scrape after the restart (never more than the truth)."""
    sock = tmp_path / "s.sock"
    async with sidecar_on(sqlite_log, sock) as sidecar, engine_client(sock) as client:
        driver = Driver(client)
        await driver.owner("warm-up")  # the engine is declared: its gauge exists, at 0
        assert sample(sidecar, "kvledger_oldest_pin_seconds", engine=ENGINE) == 0.0
        owner = await driver.owner("r1")
        blocks = await driver.allocate(owner, 2)
        tokens = list(range(2 * b.BLOCK))
        result = await driver.step(
            MarkComputed(engine_id=ENGINE, owner_id=owner, blocks=blocks, token_ids=tokens),
            StartStore(engine_id=ENGINE, tier=b.TIER, blocks=blocks),
            FinishOwner(engine_id=ENGINE, owner_id=owner),
        )
        [decision] = result.decisions
        store = decision.event
        assert isinstance(store, StoreJobStarted)
        await anyio.sleep(0.3)
        assert sample(sidecar, "kvledger_pins", engine=ENGINE) == 2.0
        age = sample(sidecar, "kvledger_oldest_pin_seconds", engine=ENGINE)
        assert age is not None and age >= 0.3
        await driver.report(store, 0, [b.checksum(item.key, 0) for item in store.items])
        age_after_one_rank = sample(sidecar, "kvledger_oldest_pin_seconds", engine=ENGINE)
        assert age_after_one_rank is not None and age_after_one_rank >= age, "one rank is not the whole job (I4)"

    restarted_at = time.monotonic()
    async with sidecar_on(sqlite_log, sock) as sidecar, engine_client(sock) as client:
        first_scrape = sample(sidecar, "kvledger_oldest_pin_seconds", engine=ENGINE)
        since_restart = time.monotonic() - restarted_at  # the job itself is older than this by >= 0.3 s
        assert first_scrape is not None and first_scrape <= since_restart, (
            "recovered: counted from this process's first look, not from before the restart"
        )
        await anyio.sleep(0.2)
        later = sample(sidecar, "kvledger_oldest_pin_seconds", engine=ENGINE)
        assert later is not None and later >= first_scrape + 0.2
        await client.report(
            ReportRank(job_id=store.job_id, rank=1, ok=True, checksums=[b.checksum(i.key, 1) for i in store.items])
        )
        assert sample(sidecar, "kvledger_pins", engine=ENGINE) == 0.0
        assert sample(sidecar, "kvledger_oldest_pin_seconds", engine=ENGINE) == 0.0
        assert sidecar.metrics.job_started == {}, "a finished job is forgotten"
