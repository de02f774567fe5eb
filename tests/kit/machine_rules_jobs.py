"""The state machine's rules for jobs (store, load, state copy, lookup), reports and resets."""

from __future__ import annotations

import msgspec
from hypothesis import strategies as st
from hypothesis.stateful import precondition, rule

from coordinator.core.commands import (
    AnyCommand,
    DeclareEngine,
    LoadRequest,
    LookupPrefix,
    Move,
    PlanStateCopy,
    ReportRank,
    ResetCache,
    StartLoad,
    StartStore,
)
from coordinator.core.keys import chain_keys
from coordinator.core.state import (
    SlotStatus,
)
from events import (
    EngineDeclared,
    EngineReset,
    FencedRankDone,
    JobFenced,
    KeyEvicted,
    LoadJobStarted,
    PrefixLookedUp,
    Reason,
    Refused,
    StateCopyPlanned,
    StoreJobStarted,
)
from tests.kit.builders import (
    ENGINE,
    TIER,
    namespace,
)
from tests.kit.machine import (
    ATTENTION,
    BYTES_PER_BLOCK,
    DOCS,
    ENCODER_TOKENS,
    LEASES,
    REUSE_UNIT,
    STATE,
    WEIGHTS_REVISIONS,
    WORLD_SIZE,
    MachineBase,
)


class JobRules(MachineBase):
    # --- jobs ----------------------------------------------------------------------------------

    @rule(data=st.data())
    def start_store(self, data: st.DataObject) -> None:
        self.ensure_step()
        candidates = [
            pool.ref(block_id)
            for pool in self.engine.pools.values()
            for block_id in range(1, pool.spec.num_blocks)
            if pool.refs[block_id] > 0 and pool.keys[block_id] is not None
        ]
        if not candidates:
            return
        chosen = data.draw(st.lists(st.sampled_from(candidates), min_size=1, max_size=3, unique=True))
        tier = self.core.state.tiers[TIER]
        leased = [
            (pool_id, key)
            for pool_id, key, entry in tier.entries()
            if any(expiry > self.engine.clock for expiry in (entry.leases or {}).values())  # one engine: its clock
        ]
        events = self.execute(StartStore(engine_id=ENGINE, tier=TIER, blocks=chosen))
        if isinstance(events[0], Refused):
            self.rejected(events, Reason.TIER_FULL)
            return
        [started] = [e for e in events if isinstance(e, StoreJobStarted)]
        for evicted in (e for e in events if isinstance(e, KeyEvicted)):
            assert (evicted.pool_id, evicted.key) not in leased, f"evicted a leased key (I12): {evicted}"
            # I10: a key the store skips as already published must stay published.
            assert evicted.key not in started.already_published, f"evicted a key it relies on: {evicted}"
        for item in started.items:
            assert item.source in chosen and item.source.block_id != 0, item  # I2

    @rule(data=st.data(), lease_seconds=st.sampled_from(LEASES), duplicate=st.booleans())
    def start_load(self, data: st.DataObject, lease_seconds: float, duplicate: bool) -> None:
        self.ensure_step()
        tier = self.core.state.tiers[TIER]
        ns = self.engine.namespace_id
        keys: dict[int, list[bytes]] = {pool_id: [] for pool_id in tier.published}
        for pool_id, key, entry in tier.entries():
            if not entry.quarantined and entry.namespace_id == ns:
                keys[pool_id].append(key)
        dests = {
            pool_id: [
                pool.ref(block_id)
                for block_id in range(1, pool.spec.num_blocks)
                if pool.refs[block_id] > 0 and pool.keys[block_id] is None and pool.pins[block_id] == 0
            ]
            for pool_id, pool in self.engine.pools.items()
        }
        usable = sorted(pool_id for pool_id in keys if keys[pool_id])
        if not usable:
            return
        pool_id = data.draw(st.sampled_from(usable))
        if not dests[pool_id]:  # a request that will load its prefix instead of computing it
            dests[pool_id] = self.try_allocate(self.pick_owner(data), pool_id, 2)
            if not dests[pool_id]:
                return
        chosen = data.draw(st.lists(st.sampled_from(dests[pool_id]), min_size=1, max_size=3, unique=True))
        if duplicate:  # I11: the same published key into every destination
            key = data.draw(st.sampled_from(keys[pool_id]))
            items = [LoadRequest(key, dest) for dest in chosen]
        else:
            items = [LoadRequest(data.draw(st.sampled_from(keys[pool_id])), dest) for dest in chosen]
        events = self.execute(StartLoad(engine_id=ENGINE, tier=TIER, items=items, lease_seconds=lease_seconds))
        [started] = events
        assert isinstance(started, LoadJobStarted), events
        assert [(i.key, i.dest) for i in started.items] == [(i.key, i.dest) for i in items]
        assert started.lease_expires_at == self.engine.clock + lease_seconds

    @rule(data=st.data(), pool_id=st.sampled_from((STATE, STATE, ATTENTION)), num_moves=st.integers(1, 2))
    def plan_state_copy(self, data: st.DataObject, pool_id: int, num_moves: int) -> None:
        self.ensure_step()
        pool = self.pool(pool_id)
        dests = [pool.ref(b) for b in range(1, pool.spec.num_blocks) if pool.refs[b] > 0 and pool.pins[b] == 0]
        if not dests:
            dests = self.try_allocate(self.pick_owner(data), pool_id, 1)
        # Held, draining or cached-free slots may be read (listed after the allocation above,
        # which may have recycled a cached-free one).
        sources = [pool.ref(b) for b in range(1, pool.spec.num_blocks) if pool.status(b) is not SlotStatus.FREE]
        if not sources or not dests:
            return
        moves = []
        for _ in range(num_moves):
            length = data.draw(st.integers(1, BYTES_PER_BLOCK))
            moves.append(
                Move(
                    src=data.draw(st.sampled_from(sources)),
                    src_offset=data.draw(st.integers(0, BYTES_PER_BLOCK - length)),
                    dst=data.draw(st.sampled_from(dests)),
                    dst_offset=data.draw(st.integers(0, BYTES_PER_BLOCK - length)),
                    length=length,
                )
            )
        events = self.execute(PlanStateCopy(engine_id=ENGINE, pool_id=pool_id, moves=moves))
        if isinstance(events[0], Refused):
            self.rejected(events, Reason.OVERLAPPING_DESTINATIONS)
            return
        assert isinstance(events[0], StateCopyPlanned), events

    @rule(doc=st.sampled_from(DOCS), length=st.integers(0, 16))
    def lookup(self, doc: list[int], length: int) -> None:
        self.ensure_step()
        tokens = doc[:length]
        events = self.execute(LookupPrefix(engine_id=ENGINE, tier=TIER, token_ids=tokens))
        [looked] = events
        assert isinstance(looked, PrefixLookedUp), events
        assert looked.reuse_unit == REUSE_UNIT
        ns = self.engine.namespace_id
        tier = self.core.state.tiers[TIER]
        chains = {pool_id: chain_keys(ns, tokens, pool.spec.block_size) for pool_id, pool in self.engine.pools.items()}

        def loadable(pool_id: int, key: bytes) -> bool:  # I9: this namespace only
            entry = tier.entry(pool_id, key)
            return entry is not None and not entry.quarantined and entry.namespace_id == ns

        def hit_at(boundary: int) -> bool:  # I6: every group has its key at the boundary
            attention = chains[ATTENTION][: boundary // self.pool(ATTENTION).spec.block_size]
            state = chains[STATE][boundary // self.pool(STATE).spec.block_size - 1]
            return all(loadable(ATTENTION, k) for k in attention) and loadable(STATE, state)

        expected = max((b for b in range(REUSE_UNIT, length + 1, REUSE_UNIT) if hit_at(b)), default=0)
        assert looked.boundary == expected, (looked, expected)
        for hit in looked.hits:
            assert all(loadable(hit.pool_id, key) for key in hit.keys), hit

    # --- reports -------------------------------------------------------------------------------

    @precondition(lambda self: any(job.status == "open" for job in self.jobs.values()))
    @rule(
        data=st.data(),
        ok_=st.sampled_from((True,) * 5 + (False,)),
        mode=st.sampled_from(("honest",) * 4 + ("corrupt", "missing", "empty")),
    )
    def report_one_rank(self, data: st.DataObject, ok_: bool, mode: str) -> None:
        """One rank of a random in-flight job reports: ranks arrive in any order, across jobs."""
        job_id = data.draw(st.sampled_from(self.open_job_ids()))
        job = self.jobs[job_id]
        rank = data.draw(st.sampled_from([r for r in range(WORLD_SIZE) if r not in job.reports]))
        checksums = self.honest_checksums(job.decision, rank)
        if checksums and mode == "corrupt":
            checksums[0] = b"corrupt:" + bytes([rank])
        elif checksums and mode == "missing":
            checksums = checksums[:-1]
        elif checksums and mode == "empty":
            checksums[-1] = b""
        self.report(ReportRank(job_id=job_id, rank=rank, ok=ok_, checksums=checksums, error="" if ok_ else "io error"))

    @precondition(lambda self: any(job.status == "open" for job in self.jobs.values()))
    @rule(data=st.data(), tamper=st.sampled_from((False, False, False, True)))
    def complete_job(self, data: st.DataObject, tamper: bool) -> None:
        """Every silent rank of a random in-flight job reports success, in a random order; with
        `tamper`, one of them reports bytes that differ (wrong KV stored or loaded)."""
        self.complete(data, data.draw(st.sampled_from(self.open_job_ids())), tamper)

    @precondition(lambda self: bool(self.sent_reports))
    @rule(data=st.data(), conflicting=st.booleans())
    def resend_report(self, data: st.DataObject, conflicting: bool) -> None:
        """A duplicate (or conflicting) report is dropped; for a finished job it is stale (I4)."""
        sent = data.draw(st.sampled_from(self.sent_reports))
        command = msgspec.structs.replace(sent, ok=not sent.ok) if conflicting else sent
        events = self.execute(command)
        if self.jobs[sent.job_id].status != "open":
            event = self.rejected(events, Reason.STALE_JOB)
        else:
            event = self.rejected(events, Reason.CONFLICTING_REPORT if conflicting else Reason.DUPLICATE_REPORT)
        assert f"job {sent.job_id}" in event.detail

    @precondition(lambda self: any(job.status != "open" for job in self.jobs.values()))
    @rule(data=st.data(), rank=st.integers(0, WORLD_SIZE - 1))
    def late_report(self, data: st.DataObject, rank: int) -> None:
        """A report for a finished or fenced job is stale (I4, I16), even from a silent rank."""
        job_id = data.draw(st.sampled_from(sorted(i for i, job in self.jobs.items() if job.status != "open")))
        job = self.jobs[job_id]
        command = ReportRank(job_id=job_id, rank=rank, ok=True, checksums=self.honest_checksums(job.decision, rank))
        events = self.execute(command)
        if job.status == "fenced" and rank not in job.reports and rank not in job.drained:
            # I16: its result is dropped, but this rank's transfer is over: the job lets go of
            # its slots when every rank is.
            assert events == [FencedRankDone(job_id=job_id, rank=rank)], events
            job.drained.add(rank)
        else:
            event = self.rejected(events, Reason.STALE_JOB)
            assert f"job {job_id}" in event.detail

    # --- resets --------------------------------------------------------------------------------

    @rule(
        how=st.sampled_from(("reset_cache", "restart")),
        weights_revision=st.sampled_from(WEIGHTS_REVISIONS),
        now=st.integers(0, 2),
    )
    def reset(self, how: str, weights_revision: str, now: int) -> None:
        """A new incarnation fences every job in flight (I16); generations keep counting (I1)."""
        if now:  # two times out of three do nothing, so state builds up between resets
            return
        open_ids = self.open_job_ids()
        incarnation = self.engine.incarnation
        if how == "reset_cache":
            command: AnyCommand = ResetCache(engine_id=ENGINE)
        else:
            command = DeclareEngine(
                engine_id=ENGINE,
                namespace=namespace(block_sizes=(4, 8), tp=WORLD_SIZE, weights_revision=weights_revision),
                pools=[pool.spec for pool in self.engine.pools.values()],
                world_size=WORLD_SIZE,
                tiers=[TIER],
                encoder_cache_tokens=ENCODER_TOKENS,
            )
        events = self.execute(command)
        assert sorted(e.job_id for e in events if isinstance(e, JobFenced)) == open_ids
        [reset] = [e for e in events if isinstance(e, EngineReset)]
        assert reset.incarnation == incarnation + 1
        if how == "restart":
            assert isinstance(events[-1], EngineDeclared), events
        for job_id in open_ids:
            self.jobs[job_id].status = "fenced"
        assert not self.owners()
        self.step_open = False
        self.freed_encoder_in_step = {}
