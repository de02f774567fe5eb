"""Audit answers on small logs built with the real Ledger, for the cases a review found wrong:
an engine declared again under another tenant (audit reads follow the declaration in force, I9),
a cached-free block taken again by a reuse, keys live in several tiers, times of appends made
outside a step, and a slot with many generations. Each answer is compared with the replayed
state or with what the log recorded."""

from __future__ import annotations

import uuid
from typing import Literal

import anyio
import asyncpg
import pytest

from coordinator.audit import queries
from coordinator.audit.answers import OutOfScope
from coordinator.audit.queries import Audit
from coordinator.audit.store import sync_index
from coordinator.core.commands import (
    AllocateBlocks,
    DeclareEngine,
    DeclareTier,
    FinishOwner,
    FreeBlocks,
    MarkComputed,
    ObservedKvEvent,
    ObserveEngine,
    ObserveGap,
    ObserveKvEvents,
    ReportRank,
    ReuseBlocks,
    StartOwner,
    StartStore,
)
from coordinator.ledger.ledger import Ledger
from coordinator.ledger.recovery import replay
from events import BlockRef, BlocksAllocated, EventCodec, OwnerStarted, StoreJobStarted, TierSpec
from events.log import SqlEventLog, open_log, upgrade_log
from tests.conftest import PG_URL, _admin_dsn, _drop_pg_database, require_postgres
from tests.kit import builders as b

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


class Clock:
    """The ledger's wall clock (recorded_at), moved by the test."""

    def __init__(self, now: float) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


class Kit:
    def __init__(self, log: SqlEventLog, ledger: Ledger, clock: Clock) -> None:
        self.log, self.ledger, self.clock = log, ledger, clock

    async def step(self, engine: str, commands: list[object]) -> list[object]:
        state = self.ledger.state.engines[engine]
        self.clock.now += 1.0
        commit = await self.ledger.run_step(engine, state.step + 1, state.clock + 1.0, commands)  # type: ignore[arg-type]
        return list(commit.events)

    async def owner(self, engine: str, req_id: str) -> int:
        events = await self.step(engine, [StartOwner(engine_id=engine, req_id=req_id)])
        return next(e for e in events if isinstance(e, OwnerStarted)).owner_id

    async def allocate(self, engine: str, owner: int, count: int) -> list[BlockRef]:
        events = await self.step(engine, [AllocateBlocks(engine_id=engine, owner_id=owner, pool_id=0, count=count)])
        return next(e for e in events if isinstance(e, BlocksAllocated)).blocks

    async def store(self, engine: str, tier: str, blocks: list[BlockRef]) -> StoreJobStarted:
        """A store job, and its ranks' reports in an append of their own (outside a step)."""
        events = await self.step(engine, [StartStore(engine_id=engine, tier=tier, blocks=blocks)])
        job = next(e for e in events if isinstance(e, StoreJobStarted))
        for rank in (0, 1):
            self.clock.now += 1.0
            await self.ledger.execute(
                ReportRank(job_id=job.job_id, rank=rank, ok=True, checksums=[b.checksum(i.key, rank) for i in job.items])
            )
        return job


async def kit(log_url: str, tiers: tuple[str, ...] = (b.TIER,), tier_slots: int = 16) -> Kit:
    if log_url.startswith("postgresql"):
        await upgrade_log(log_url)
    log = await open_log(log_url)
    clock = Clock(1_800_000_000.0)
    ledger = await Ledger.open(log, clock=clock)
    for name in tiers:
        await ledger.execute(DeclareTier(spec=TierSpec(name=name, num_slots=tier_slots, bytes_per_slot=64)))
    return Kit(log, ledger, clock)


def declare(engine: str, tenant: str, tiers: tuple[str, ...] = (b.TIER,)) -> DeclareEngine:
    return DeclareEngine(
        engine_id=engine,
        namespace=b.namespace(tenant=tenant),
        pools=[b.attention_pool(num_blocks=16)],
        world_size=2,
        tiers=list(tiers),
    )


async def test_I9_audit_reads_follow_the_declaration_in_force_when_an_engine_changes_tenant(log_url: str) -> None:
    k = await kit(log_url)
    try:
        await k.ledger.execute(declare("pod-x", "tenant-a"))
        a_owner = await k.owner("pod-x", "secret-a")
        [a_block] = await k.allocate("pod-x", a_owner, 1)
        await k.step("pod-x", [FinishOwner(engine_id="pod-x", owner_id=a_owner)])
        await k.step("pod-x", [AllocateBlocks(engine_id="pod-x", owner_id=424242, pool_id=0, count=1)])  # refused
        a_end = await k.log.head()
        await k.ledger.execute(declare("pod-x", "tenant-b"))  # the pod restarts for another tenant
        b_owner = await k.owner("pod-x", "request-b")
        long_owner = await k.owner("pod-x", "x" * 300)  # longer than any VARCHAR(255) would take
        await k.allocate("pod-x", b_owner, 1)
        await sync_index(k.log)
        assert await k.log.checkpoint("audit") == await k.log.head()
        tenant_a, tenant_b = Audit(k.log, tenant="tenant-a"), Audit(k.log, tenant="tenant-b")
        assert (await tenant_b.request("x" * 300)).owners[0].owner_id == long_owner
        with pytest.raises(OutOfScope):
            await tenant_b.request("secret-a")
        with pytest.raises(OutOfScope):
            await tenant_b.block("pod-x", 0, a_block.block_id, a_end)
        assert (await tenant_a.request("secret-a")).owners[0].req_id == "secret-a"
        assert (await tenant_a.block("pod-x", 0, a_block.block_id, a_end)).owner is not None
        seen_by_b = {g.req_id for g in (await tenant_b.history("pod-x", 0, a_block.block_id)).generations}
        seen_by_a = {g.req_id for g in (await tenant_a.history("pod-x", 0, a_block.block_id)).generations}
        assert "secret-a" not in seen_by_b and "secret-a" in seen_by_a and "request-b" not in seen_by_a
        assert [r.reason for r in await tenant_a.refusals()] == ["unknown_owner"]
        assert await tenant_b.refusals() == []
        assert await tenant_a.engines() == await tenant_b.engines() == ["pod-x"]
    finally:
        await k.log.close()


async def test_a_request_id_holding_a_nul_is_indexed_and_the_index_keeps_up(log_url: str) -> None:
    """PostgreSQL's text holds no NUL. One StartOwner with req_id "a\\x00b" (the core takes any
    string there) failed every catch-up of the index on PostgreSQL, and every tenant's audit
    answered 503 (an adversarial review, session 31). The index writes U+FFFD for the NUL there;
    SQLite keeps the string as it is. The log keeps it as sent on both."""
    k = await kit(log_url)
    try:
        await k.ledger.execute(declare("pod-x", "tenant-a"))
        odd = await k.owner("pod-x", "a\x00b")
        plain = await k.owner("pod-x", "plain")
        await sync_index(k.log)
        assert await k.log.checkpoint("audit") == await k.log.head()
        indexed = "a\ufffdb" if log_url.startswith("postgresql") else "a\x00b"
        assert (await Audit(k.log).request(indexed)).owners[0].owner_id == odd
        assert (await Audit(k.log).request("plain")).owners[0].owner_id == plain
    finally:
        await k.log.close()


async def test_a_tenants_audit_answers_through_thousands_of_declarations_of_its_engines(log_url: str) -> None:
    """An engine restarted 1,100 times was 1,100 spans of its tenant, each a term of one OR, and
    SQLite refused the query as too deep: the tenant's refusals and requests answered 500 (an
    adversarial review, session 31). Declarations one after another under the tenant are one span
    now, and spans apart (an engine declared in turn under two tenants) are ORed as a balanced tree."""
    k = await kit(log_url)
    try:
        for _ in range(1_100):  # a crash loop: one span
            await k.ledger.execute(declare("pod-x", "tenant-a"))
        for index in range(2_100):  # in turn under two tenants: 1,050 spans of tenant-a
            await k.ledger.execute(declare("pod-y", "tenant-a" if index % 2 == 0 else "tenant-b"))
        await k.ledger.execute(declare("pod-y", "tenant-a"))
        for index in range(20):  # more engines than one OR holds, names in no particular order
            await k.ledger.execute(declare(f"{'Zz_-'[index % 4]}pod-{index}", "tenant-a"))
        mine = await k.owner("pod-y", "mine")
        theirs = await k.owner("_pod-18", "theirs")
        await k.step("pod-x", [AllocateBlocks(engine_id="pod-x", owner_id=424242, pool_id=0, count=1)])  # refused
        await sync_index(k.log)
        tenant_a = Audit(k.log, tenant="tenant-a")
        assert len(tenant_a._spans(await tenant_a._read(tenant_a._declarations))) == 1 + 1_051 + 20
        assert (await tenant_a.request("mine")).owners[0].owner_id == mine
        assert (await tenant_a.request("theirs")).owners[0].owner_id == theirs
        assert [r.reason for r in await tenant_a.refusals()] == ["unknown_owner"]
        assert await Audit(k.log, tenant="tenant-b").refusals() == []
    finally:
        await k.log.close()


def test_the_span_filter_finds_every_engine_whatever_order_the_database_sorts_names_in() -> None:
    """The filter splits engines on their names in Python's (code-point) order. PostgreSQL compares
    text in the database's collation: under ICU's English one "_pod" sorts before "-pod", "apod"
    and "Zpod", where Python puts it after all but "apod", and a split on that order sent rows down
    the wrong branch, so a tenant's own request was not found (a review, session 31). A database
    of that collation here; the filter compares names byte-wise ("C")."""
    require_postgres()
    name = f"kvl_test_icu_{uuid.uuid4().hex[:12]}"
    try:
        anyio.run(_engines_found_in_an_icu_database, name)
    finally:
        _drop_pg_database(name)


async def _engines_found_in_an_icu_database(name: str) -> None:
    admin = await asyncpg.connect(_admin_dsn())
    try:
        await admin.execute(f"CREATE DATABASE \"{name}\" LOCALE_PROVIDER icu ICU_LOCALE 'en' LOCALE 'C.UTF-8' TEMPLATE template0")
    except asyncpg.PostgresError as error:
        pytest.skip(f"PostgreSQL cannot make an ICU database here: {error}")
    finally:
        await admin.close()
    k = await kit(f"{PG_URL.rsplit('/', 1)[0]}/{name}")
    try:
        engines = [f"{prefix}pod-{index}" for index in range(6) for prefix in ("_", "-", "a", "Z")]
        owners = {}
        for engine in engines:
            await k.ledger.execute(declare(engine, "tenant-a"))
            owners[engine] = await k.owner(engine, f"req-{engine}")
        await sync_index(k.log)
        tenant_a = Audit(k.log, tenant="tenant-a")
        for engine in engines:
            assert (await tenant_a.request(f"req-{engine}")).owners[0].owner_id == owners[engine], engine
    finally:
        await k.log.close()


async def test_a_cached_free_block_taken_again_by_a_reuse_is_held_by_the_reuser(log_url: str) -> None:
    k = await kit(log_url)
    try:
        await k.ledger.execute(declare("e", "tenant-a"))
        first = await k.owner("e", "first")
        [ref] = await k.allocate("e", first, 1)
        await k.step("e", [MarkComputed(engine_id="e", owner_id=first, blocks=[ref], token_ids=list(range(b.BLOCK)))])
        await k.step("e", [FreeBlocks(engine_id="e", owner_id=first, blocks=[ref]), FinishOwner(engine_id="e", owner_id=first)])
        freed_at = await k.log.head()
        second = await k.owner("e", "second")
        await k.step("e", [ReuseBlocks(engine_id="e", owner_id=second, blocks=[ref])])
        await sync_index(k.log)
        audit, head = Audit(k.log), await k.log.head()
        state, _ = await replay(k.log, EventCodec(), until_seq=head)
        assert state.engines["e"].pools[0].refs[ref.block_id] == 1  # the truth: held again
        now = await audit.block("e", 0, ref.block_id, head)
        assert now.status == "held" and now.owner is not None and now.owner.req_id == "second"
        assert now.generation is not None and now.generation.ended_by == "open"
        between = await audit.block("e", 0, ref.block_id, freed_at)
        assert between.status == "free"
        [life] = (await audit.history("e", 0, ref.block_id)).generations
        assert life.ended_by == "open" and life.freed_seq is None
    finally:
        await k.log.close()


async def test_namespaces_count_a_key_live_in_another_tier_after_an_eviction_from_one(log_url: str) -> None:
    k = await kit(log_url, tiers=("host", "disk"), tier_slots=2)
    try:
        await k.ledger.execute(declare("e", "tenant-a", tiers=("host", "disk")))
        for req, tokens, tiers in (("r1", list(range(8)), ("host", "disk")), ("r2", list(range(50, 58)), ("host",))):
            owner = await k.owner("e", req)
            blocks = await k.allocate("e", owner, 2)
            await k.step("e", [MarkComputed(engine_id="e", owner_id=owner, blocks=blocks, token_ids=tokens)])
            for tier in tiers:  # r2 fills host: r1's keys leave host, and stay in disk
                await k.store("e", tier, blocks)
            await k.step("e", [FinishOwner(engine_id="e", owner_id=owner)])
        entries = [(name, key) for name, tier in k.ledger.state.tiers.items() for keys in tier.published.values() for key in keys]
        await sync_index(k.log)
        [space] = await Audit(k.log).namespaces(now=k.clock.now)
        assert space.keys == len(entries) == 4 and space.bytes == 4 * b.attention_pool().bytes_per_block
    finally:
        await k.log.close()


async def test_at_time_counts_appends_made_outside_a_step(log_url: str) -> None:
    k = await kit(log_url)
    try:
        await k.ledger.execute(declare("e", "tenant-a"))
        owner = await k.owner("e", "r")
        blocks = await k.allocate("e", owner, 1)
        await k.step("e", [MarkComputed(engine_id="e", owner_id=owner, blocks=blocks, token_ids=list(range(b.BLOCK)))])
        await k.store("e", b.TIER, blocks)  # its reports: appends with no step, recorded at their own times
        reported_at, reported_seq = k.clock.now, await k.log.head()
        k.clock.now += 100.0
        await k.step("e", [FinishOwner(engine_id="e", owner_id=owner)])
        await sync_index(k.log)
        audit = Audit(k.log)
        assert await audit.resolve("e", at_time=reported_at) == reported_seq
        answer = await audit.block("e", 0, blocks[0].block_id, reported_seq)
        assert answer.at.recorded_at == reported_at and answer.at.step >= 0
        assert all(not job.pinned_then for job in answer.jobs)  # the store ended with its last report
        assert [r.recorded_at for r in await audit.refusals()] == []
    finally:
        await k.log.close()


async def test_history_of_a_busy_slot_keeps_the_newest_generations_with_a_total(
    log_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    k = await kit(log_url)
    try:
        await k.ledger.execute(
            DeclareEngine(
                engine_id="e", namespace=b.namespace(), world_size=2, tiers=[b.TIER], pools=[b.attention_pool(num_blocks=2)]
            )
        )  # one usable slot
        for index in range(7):
            owner = await k.owner("e", f"r{index}")
            await k.allocate("e", owner, 1)
            await k.step("e", [FinishOwner(engine_id="e", owner_id=owner)])
        await sync_index(k.log)
        monkeypatch.setattr(queries, "LIST_LIMIT", 3)
        history = await Audit(k.log).history("e", 0, 1)
        assert history.generations_total == 7
        assert [g.generation for g in history.generations] == [5, 6, 7]
        assert [g.req_id for g in history.generations] == ["r4", "r5", "r6"]
        assert all(g.ended_by == "freed" for g in history.generations)
    finally:
        await k.log.close()


@pytest.mark.parametrize("list_limit", [queries.LIST_LIMIT, 2])
async def test_I9_an_observed_hash_answers_each_tenant_with_its_own_rows_only(
    log_url: str, list_limit: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An observed engine restarted under another tenant's namespace: the hash's rows, clears,
    gaps and total each belong to the tenant whose incarnation recorded them. The restart is
    both tenants': it ends the first one's residencies and begins the second's incarnation.
    With list_limit 2 the total is counted in SQL, past the rows listed, and the other tenant's
    newer rows must not crowd the caller's out of the list."""
    k = await kit(log_url, tiers=())
    block_hash = bytes([0xAB]) * 32
    engine = "vllm-x"

    def seen(tenant: str, reason: str) -> ObserveEngine:
        return ObserveEngine(engine_id=engine, namespace=b.namespace(tenant=tenant, tp=1), source="test", reason=reason)

    async def batch(seq: int, *events: ObservedKvEvent) -> None:
        await k.ledger.execute(ObserveKvEvents(engine_id=engine, seq=seq, ts=float(seq), dp_rank=0, events=list(events)))

    def kv(kind: Literal["stored", "removed", "cleared"]) -> ObservedKvEvent:
        if kind == "cleared":
            return ObservedKvEvent(kind="cleared", type_name="AllBlocksCleared")
        return ObservedKvEvent(
            kind=kind,
            type_name=f"Block{kind.title()}",
            block_hashes=[block_hash],
            token_ids=list(range(b.BLOCK)) if kind == "stored" else [],
            block_size=b.BLOCK if kind == "stored" else 0,
        )

    try:
        await k.ledger.execute(seen("tenant-a", "first_seen"))
        await batch(0, kv("stored"))
        await batch(1, kv("removed"))
        await batch(2, kv("stored"))
        await k.ledger.execute(seen("tenant-b", "restart"))
        await batch(0, kv("stored"))
        await batch(1, kv("removed"))
        await batch(2, kv("stored"))
        await batch(3, kv("cleared"))
        await k.ledger.execute(ObserveGap(engine_id=engine, first_seq=4, last_seq=5, reason="lost on the way"))
        await sync_index(k.log)
        monkeypatch.setattr(queries, "LIST_LIMIT", list_limit)
        everyone = await Audit(k.log).observed(block_hash.hex())
        tenant_a = await Audit(k.log, tenant="tenant-a").observed(block_hash.hex())
        tenant_b = await Audit(k.log, tenant="tenant-b").observed(block_hash.hex())
        assert (everyone.total, tenant_a.total, tenant_b.total) == (6, 3, 3)
        # tenant-b's rows are the newest: with list_limit 2 they fill the list unless it is scoped in SQL.
        assert {r.incarnation for r in tenant_a.residencies} == {1} and tenant_a.residencies
        if list_limit > 3:
            assert [(r.incarnation, r.ended_by) for r in tenant_b.residencies] == [(2, "removed"), (2, "cleared")]
        assert len(tenant_b.gaps) == 1 and "incarnation 2" in tenant_b.gaps[0]
        assert (tenant_a.tenant, tenant_b.tenant) == ("tenant-a", "tenant-b")
        assert tenant_a.gaps == [] and "cleared" not in [e.kind for e in tenant_a.events]
        assert {e.incarnation for e in tenant_a.events if e.kind != "restarted"} == {1}
        if list_limit > 3:
            assert [(r.incarnation, r.ended_by) for r in tenant_a.residencies] == [(1, "removed"), (1, "restarted")]
    finally:
        await k.log.close()
