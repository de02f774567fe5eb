"""The verifier's checks of jobs and tiers: stores, loads, reports, publications, evictions
(I1, I2, I4, I5, I9, I10, I11, I12, I13, I16, I17; coordinator/audit/verify.py). Pure.

An external engine's jobs (vLLM's offloading: ExternalStoreStarted, ExternalLoadStarted) are
stores and loads like kvledger's own, checked by the same rules; only their device blocks are
the engine's, so there is no block of ours to check them against."""

from __future__ import annotations

from collections.abc import Sequence

from coordinator.audit._verify_base import At, Checks, hexes, ref_text
from coordinator.core.state import JobState
from coordinator.core.tier_slots import lease_live
from events import (
    NULL_BLOCK_ID,
    ExternalItem,
    ExternalLoadStarted,
    ExternalStoreStarted,
    JobFailed,
    JobSucceeded,
    KeyEvicted,
    KeyPublished,
    LoadItem,
    LoadJobStarted,
    RankReported,
    StateCopyPlanned,
    StoreItem,
    StoreJobStarted,
)


class JobChecks(Checks):
    """Each check takes an event and where it is, and says whether to skip folding it (True
    only where the projector could not fold it and the violation is reported already)."""

    # --- jobs ----------------------------------------------------------------------------------------------

    def _store_job_started(self, event: StoreJobStarted, at: At) -> bool:
        engine = self.state.engines.get(event.engine_id)
        for item in event.items:
            source = item.source
            if self._current(at, engine, source, "stores from"):
                assert engine is not None
                held = engine.pools[source.pool_id].keys[source.block_id]
                if held != item.key:
                    what = "no computed content" if held is None else f"key {held.hex()}"
                    self._flag("I17", at, f"stores {ref_text(source)} as key {item.key.hex()}, but the block holds {what}")
        self._reserved_slots(event.tier, event.items, at)
        self._started(
            event.job_id,
            [(event.engine_id, i.source.pool_id, i.source.block_id) for i in event.items if i.source.block_id != NULL_BLOCK_ID],
            at,
        )
        return False

    def _external_store_started(self, event: ExternalStoreStarted, at: At) -> bool:
        self._reserved_slots(event.tier, event.items, at)
        return False

    def _reserved_slots(self, tier_name: str, items: list[StoreItem] | list[ExternalItem], at: At) -> None:
        """I1: a store reserves each tier slot at its next generation."""
        tier = self.state.tiers.get(tier_name)
        if tier is None:
            return
        for item in items:
            if 0 <= item.tier_slot < tier.spec.num_slots:
                previous = tier.generations[item.tier_slot]
                if item.tier_generation != previous + 1:
                    self._flag(
                        "I1",
                        at,
                        f"reserves tier slot {item.tier_slot} at generation {item.tier_generation}; it "
                        f"was at {previous}, a reservation makes it {previous + 1}",
                    )

    def _load_job_started(self, event: LoadJobStarted, at: At) -> bool:
        engine = self.state.engines.get(event.engine_id)
        for item in event.items:
            self._current(at, engine, item.dest, "loads into")
        if not self._loaded_keys_published(event, at):
            return True  # the projector cannot lease a key that is not there; said above
        self._started(
            event.job_id,
            [(event.engine_id, i.dest.pool_id, i.dest.block_id) for i in event.items if i.dest.block_id != NULL_BLOCK_ID],
            at,
        )
        return False

    def _external_load_started(self, event: ExternalLoadStarted, at: At) -> bool:
        return not self._loaded_keys_published(event, at)

    def _loaded_keys_published(self, event: LoadJobStarted | ExternalLoadStarted, at: At) -> bool:
        """I5, I9, I13, I1: each key a load reads is published in the tier, in the engine's
        namespace, not quarantined, at the slot and generation the load reads, with the checksums
        it verifies against. False when one is not published at all (the fold cannot lease it)."""
        engine = self.state.engines.get(event.engine_id)
        tier = self.state.tiers.get(event.tier)
        foldable = True
        for item in event.items:
            pool_id = _pool(item)
            entry = tier.entry(pool_id, item.key) if tier is not None else None
            if entry is None:
                self._flag(
                    "I5",
                    at,
                    f"loads key {item.key.hex()} of group {pool_id}, which is not published in tier {event.tier!r}",
                    self._seen(self._evicted_seq.get((event.tier, pool_id, item.key)), f"{item.key.hex()[:8]} evicted"),
                )
                foldable = False
                continue
            published = self._seen(
                self._published_seq.get((event.tier, pool_id, item.key)),
                f"{item.key.hex()[:8]} published (job {entry.source_job})",
            )
            if engine is not None and entry.namespace_id != engine.namespace_id:
                self._flag(
                    "I9",
                    at,
                    f"loads key {item.key.hex()} of namespace {entry.namespace_id.hex()} into an engine "
                    f"of namespace {engine.namespace_id.hex()}",
                    published,
                )
            if entry.quarantined:
                self._flag("I13", at, f"loads quarantined key {item.key.hex()}", published)
            if (item.tier_slot, item.tier_generation) != (entry.tier_slot, entry.tier_generation):
                self._flag(
                    "I1",
                    at,
                    f"reads key {item.key.hex()} from tier slot {item.tier_slot} generation "
                    f"{item.tier_generation}; it is published at slot {entry.tier_slot} generation "
                    f"{entry.tier_generation}",
                    published,
                )
            if item.checksums and item.checksums != entry.checksums:
                self._flag("I13", at, f"verifies key {item.key.hex()} against other checksums than the published ones", published)
        return foldable

    def _rank_reported(self, event: RankReported, at: At) -> bool:
        job = self.state.jobs.get(event.job_id)
        if job is None:
            self._not_in_flight(event.job_id, f"rank {event.rank}'s report counted", at)
            return True  # nothing to count it on
        world_size = job.decision.world_size
        if not 0 <= event.rank < world_size:
            self._flag("I4", at, f"report of rank {event.rank} counted for job {event.job_id} of world size {world_size}")
        elif event.rank in job.reports:
            self._flag(
                "I4",
                at,
                f"a second report of job {event.job_id} rank {event.rank} counted",
                self._seen(self._report_seq.get(event.job_id, {}).get(event.rank), "the first report"),
            )
        self._old_incarnation(job, f"rank {event.rank}'s report counted", at)
        self._report_seq.setdefault(event.job_id, {})[event.rank] = at.seq
        return False

    def _job_succeeded(self, event: JobSucceeded, at: At) -> bool:
        job = self.state.jobs.get(event.job_id)
        if job is None:
            self._not_in_flight(event.job_id, "success", at)
            return True
        decision = job.decision
        nothing_to_do = not decision.batches if isinstance(decision, StateCopyPlanned) else not decision.items
        if not nothing_to_do:
            missing = [rank for rank in range(decision.world_size) if rank not in job.reports]
            failed = sorted(rank for rank, report in job.reports.items() if not report.ok)
            if missing or failed:
                self._flag(
                    "I4",
                    at,
                    f"job {event.job_id} succeeded with rank(s) {missing} not reported and {failed} failed",
                    [*self._job_evidence([event.job_id]), *self._reports_evidence(event.job_id)],
                )
        self._old_incarnation(job, "success counted", at)
        if isinstance(decision, (LoadJobStarted, ExternalLoadStarted)) and not nothing_to_do:
            self._load_succeeded(decision, job, at)
        return False

    def _job_failed(self, event: JobFailed, at: At) -> bool:
        """I13: the items a failed load keeps (JobFailed.kept) verified on every rank."""
        job = self.state.jobs.get(event.job_id)
        if not event.kept or job is None:
            return False
        decision = job.decision
        if not isinstance(decision, (LoadJobStarted, ExternalLoadStarted)) or event.kept > len(decision.items):
            self._flag("I13", at, f"job {event.job_id} failed keeping {event.kept} items, but it is no load of that many")
            return False
        tier = self.state.tiers.get(decision.tier)
        loaded: Sequence[LoadItem | ExternalItem] = decision.items
        for index, item in enumerate(loaded[: event.kept]):
            entry = tier.entry(_pool(item), item.key) if tier is not None else None
            published = entry.checksums if entry is not None else item.checksums
            unverified = [
                rank
                for rank in range(decision.world_size)
                if (report := job.reports.get(rank)) is None
                or len(report.checksums) <= index
                or rank >= len(published)
                or report.checksums[index] != published[rank]
            ]
            if unverified:
                self._flag(
                    "I13",
                    at,
                    f"load {event.job_id} keeps item {index} (key {item.key.hex()}), which rank(s) {unverified} did not verify",
                    self._job_and_reports(event.job_id)(),
                )
        return False

    def _load_succeeded(self, decision: LoadJobStarted | ExternalLoadStarted, job: JobState, at: At) -> None:
        """I11, I12, I13: what a load that counts as success must have."""
        evidence = self._job_and_reports(decision.job_id)
        engine = self.state.engines.get(decision.engine_id)
        if engine is not None and engine.clock >= decision.lease_expires_at:
            self._flag(
                "I12",
                at,
                f"load {decision.job_id} counts as success at engine clock {engine.clock:g}; its lease "
                f"expired at {decision.lease_expires_at:g}",
                evidence(),
            )
        tier = self.state.tiers.get(decision.tier)
        sums = {rank: report.checksums for rank, report in job.reports.items()}
        unverified = [rank for rank, found in sorted(sums.items()) if len(found) != len(decision.items) or not all(found)]
        if unverified:
            self._flag(
                "I11",
                at,
                f"load {decision.job_id} counts as success with rank(s) {unverified} reporting no checksum for some destination",
                evidence(),
            )
        gone, mismatched, quarantined = [], [], []
        loaded: Sequence[LoadItem | ExternalItem] = decision.items
        for index, item in enumerate(loaded):
            entry = tier.entry(_pool(item), item.key) if tier is not None else None
            if entry is not None and (entry.tier_slot, entry.tier_generation) != (item.tier_slot, item.tier_generation):
                entry = None
            if entry is None:
                gone.append(item.key)
            elif entry.quarantined:
                quarantined.append(item.key)
            published = entry.checksums if entry is not None else item.checksums
            if published and any(
                rank < len(published) and index < len(found) and found[index] and found[index] != published[rank]
                for rank, found in sums.items()
            ):
                mismatched.append(item.key)
        if gone:
            evicted = [
                f"seq {seq}: {key.hex()[:8]} evicted"
                for key in dict.fromkeys(gone)
                if (seq := self._evicted_seq.get((decision.tier, _pool_of(decision, key), key))) is not None
            ]
            self._flag(
                "I12",
                at,
                f"load {decision.job_id} counts as success though key(s) {hexes(gone)} left the tier or moved while it ran",
                [*evidence(), *evicted],
            )
        if quarantined:
            self._flag(
                "I13", at, f"load {decision.job_id} of quarantined key(s) {hexes(quarantined)} counts as success", evidence()
            )
        if mismatched:
            self._flag(
                "I13",
                at,
                f"load {decision.job_id} counts as success though ranks read other bytes than published "
                f"for key(s) {hexes(mismatched)}",
                evidence(),
            )

    # --- tiers ----------------------------------------------------------------------------------------------

    def _key_published(self, event: KeyPublished, at: At) -> bool:
        job = self.state.jobs.get(event.source_job)
        where = (event.tier, event.pool_id, event.key)
        if job is None or not isinstance(job.decision, (StoreJobStarted, ExternalStoreStarted)):
            if event.source_job in self.state.fenced:
                self._not_in_flight(event.source_job, f"key {event.key.hex()} published", at)
            else:
                self._flag("I5", at, f"key {event.key.hex()} published by job {event.source_job}, which is not a store in flight")
        else:
            self._published_by(event, job, at)
        tier = self.state.tiers.get(event.tier)
        if tier is not None and not 0 <= event.tier_slot < tier.spec.num_slots:
            self._flag(
                "I1", at, f"key {event.key.hex()} published into tier slot {event.tier_slot}, which the tier does not have"
            )
            return True  # the slot's row is not there to write
        if tier is not None and event.tier_generation != tier.generations[event.tier_slot]:
            # The state keeps one generation a slot: a key published at another is read back at the slot's.
            self._flag(
                "I1",
                at,
                f"key {event.key.hex()} published into tier slot {event.tier_slot} at generation {event.tier_generation}; "
                f"the slot is at {tier.generations[event.tier_slot]}",
            )
        existing = tier.entry(event.pool_id, event.key) if tier is not None else None
        if existing is not None and existing.checksums != event.checksums and not existing.quarantined:
            self._flag(
                "I10",
                at,
                f"key {event.key.hex()} published again with other checksums over the live entry "
                f"(job {existing.source_job}), and not quarantined",
                self._seen(self._published_seq.get(where), f"{event.key.hex()[:8]} published"),
            )
        replaced = self._evicted_in_append.get(where)
        if existing is None and replaced is not None and replaced[1] != event.checksums:
            self._flag(
                "I10",
                at,
                f"key {event.key.hex()} evicted and published again with other checksums in one "
                "append: the last writer won, no KeyQuarantined",
                [f"seq {replaced[0]}: {event.key.hex()[:8]} evicted"],
            )
        return False

    def _published_by(self, event: KeyPublished, job: JobState, at: At) -> None:
        """I2, I5, I16 for a publication by a store in flight."""
        decision = job.decision
        assert isinstance(decision, (StoreJobStarted, ExternalStoreStarted))
        items: Sequence[StoreItem | ExternalItem] = decision.items
        index = next(
            (
                i
                for i, item in enumerate(items)
                if (item.key, item.tier_slot, _pool(item)) == (event.key, event.tier_slot, event.pool_id)
            ),
            None,
        )
        evidence = self._job_and_reports(decision.job_id)
        if index is None:
            self._flag(
                "I5",
                at,
                f"key {event.key.hex()} published into tier slot {event.tier_slot} by job "
                f"{decision.job_id}, which did not store it there",
                evidence(),
            )
            return
        stored = items[index]
        if isinstance(stored, StoreItem) and stored.source.block_id == NULL_BLOCK_ID:
            self._flag(
                "I2",
                at,
                f"key {event.key.hex()} published from the null block {ref_text(stored.source)}",
                evidence(),
            )
        not_ok = [
            rank
            for rank in range(decision.world_size)
            if rank not in job.reports
            or not job.reports[rank].ok
            or len(job.reports[rank].checksums) <= index
            or not job.reports[rank].checksums[index]
        ]
        if not_ok:
            self._flag(
                "I5", at, f"key {event.key.hex()} published before rank(s) {not_ok} reported success with a checksum", evidence()
            )
        elif event.checksums != [job.reports[rank].checksums[index] for rank in range(decision.world_size)]:
            self._flag("I5", at, f"key {event.key.hex()} published with other checksums than its ranks reported", evidence())
        self._old_incarnation(job, f"key {event.key.hex()} published", at)

    def _key_evicted(self, event: KeyEvicted, at: At) -> bool:
        tier = self.state.tiers.get(event.tier)
        entry = tier.entry(event.pool_id, event.key) if tier is not None else None
        if entry is None:
            return False  # the projector says it cannot fold this
        live = sorted(job_id for job_id, expiry in (entry.leases or {}).items() if lease_live(self.state, job_id, expiry))
        if live:  # each lease read on the clock of the engine whose load holds it (lease_live)
            self._flag(
                "I12",
                at,
                f"evicts key {event.key.hex()} while load(s) {live} hold a lease live on their engine's clock",
                self._job_evidence(live),
            )
        self._evicted_in_append[(event.tier, event.pool_id, event.key)] = (at.seq, entry.checksums)
        return False


def _pool(item: StoreItem | LoadItem | ExternalItem) -> int:
    """The cache group (pool) an item of a store or a load is in."""
    if isinstance(item, ExternalItem):
        return item.pool_id
    return item.source.pool_id if isinstance(item, StoreItem) else item.dest.pool_id


def _pool_of(decision: LoadJobStarted | ExternalLoadStarted, key: bytes) -> int:
    return next(_pool(item) for item in decision.items if item.key == key)
