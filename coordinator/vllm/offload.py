# mypy: ignore-errors
# Why: this module subclasses vLLM's classes, and vLLM lives only in the separate .venv-vllm
# (ops/vllm/setup.sh), never in the project's .venv where mypy runs; everything here that is not
# glue to vLLM is in coordinator/vllm/offload_client.py, which mypy checks strictly.
"""kvledger as vLLM's offloading spec (vLLM 0.32, the OffloadingConnector's out-of-tree spec API).

    --kv-transfer-config '{"kv_connector": "KvledgerOffloadingConnector",
      "kv_connector_module_path": "coordinator.vllm.connector", "kv_role": "kv_both",
      "kv_load_failure_policy": "recompute",
      "kv_connector_extra_config": {"spec_name": "KvledgerOffloadingSpec",
        "spec_module_path": "coordinator.vllm.offload",
        "kvledger_socket": "/run/kvledger.sock",
        "kvledger_namespace": {"weights_revision": "sha256:...", "tokenizer_digest": "sha256:...",
                               "tenant": "team-a", "block_sizes": [32], "hash_algorithm": "vllm:sha256"}}}'

The manager (scheduler process) asks the sidecar for every decision: lookup, store admission and
tier slots (kvledger's LRU eviction, never of a leased key), loads and their leases, job ids
(coordinator/vllm/offload_client.py, LedgerSession). The worker (each worker process) moves the
bytes between vLLM's KV-cache tensors and the tier with gpu/ (gpu.tiers, gpu.checksum), checksums
what it stores, verifies what it loads against the published checksum before a byte reaches vLLM's
cache, and reports per job and rank to the sidecar itself (Reporter).

A load that does not count is refused, never served and never a crash: bytes read with another
checksum than published (reported: the key is quarantined, I13), an unreadable tier file, a job
the sidecar failed (lease expired, key evicted or quarantined meanwhile, I12) or a load it refused
to start. The worker copies none of a refused load's bytes into vLLM's cache (or, when the job
failed after the copy, has them recomputed over), tells vLLM the transfer is done (vLLM 0.32's
connector asserts success, ops/vllm/API_NOTES.md section 6) and names its engine blocks in
LoadErrors, which KvledgerOffloadingConnector (coordinator/vllm/connector.py) reports as load
errors: under kv_load_failure_policy "recompute" vLLM recomputes them. The spec works only under
that connector (get_worker refuses otherwise).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection, Iterable
from pathlib import Path

import msgspec
import numpy as np
import structlog
import torch
from vllm.v1.kv_offload.base import (
    CanonicalKVCaches,
    GPULoadStoreSpec,
    LoadStoreSpec,
    LookupResult,
    Medium,
    OffloadingEvent,
    OffloadingManager,
    OffloadingSpec,
    OffloadingWorker,
    OffloadKey,
    PrepareStoreOutput,
    ReqContext,
    RequestOffloadingContext,
    TransferResult,
    get_offload_group_idx,
)

from coordinator.core.commands import ExternalKey, ReportRank
from coordinator.vllm.offload_client import (
    CONNECTOR_MODULE,
    CONNECTOR_NAME,
    EngineFacts,
    LedgerSession,
    LoadErrors,
    OffloadSettings,
    PendingLoad,
    PendingStore,
    Refusal,
    Reporter,
    SettingsError,
    SidecarError,
    SidecarUnavailable,
    SpecItem,
    check_groups,
    engine_id,
    in_prefix_order,
    tier_spec,
    unverified,
)
from events import ExternalLoadStarted, ExternalStoreStarted, JobFailed, KeyEvicted, KeyQuarantined
from gpu.checksum import checksum
from gpu.mooncake import MooncakeTier
from gpu.tiers import DiskTier, SlotTier, Tier, TierError

log = structlog.get_logger("kvledger.vllm.offload")

HASH_ALGORITHMS = ("sha256", "sha256_cbor", "xxhash", "xxhash_cbor")


def engine_hash_algorithm() -> str | None:
    """vLLM's prefix_caching_hash_algo in this process, or None while it cannot be known.

    The worker process has the current vLLM config; the scheduler process does not (API_NOTES
    section 2), but once the engine core ran init_none_hash(hash_fn), NONE_HASH is hash_fn(seed):
    the algorithm is the one that gives it back. The scheduler's connector (and so the manager)
    is built before that: the manager says Hello at its first call."""
    from vllm.config import get_current_vllm_config_or_none

    config = get_current_vllm_config_or_none()
    if config is not None and config.cache_config is not None:
        return config.cache_config.prefix_caching_hash_algo
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core import kv_cache_utils

    none_hash = getattr(kv_cache_utils, "NONE_HASH", None)
    if none_hash is None:
        return None
    seed = kv_cache_utils.get_none_hash_seed()
    for name in HASH_ALGORITHMS:
        if get_hash_fn_by_name(name)(seed) == none_hash:
            return name
    return None


class KvledgerSpec(LoadStoreSpec):
    """A kvledger decision as the worker needs it (pickled to the worker by vLLM): the job id, the
    tier, and per block (group, engine key, tier key, tier slot, published checksums); or, for a
    load kvledger would not start, why (`refused`: the worker refuses it, vLLM recomputes).

    Made empty by prepare_load / prepare_store and filled when the pass's decisions are committed
    (`KvledgerOffloadingManager.flush`, at the end of build_connector_meta): vLLM pickles it to the
    workers only after that. `offered` are the engine keys vLLM's blocks come in (a store's job may
    admit fewer: kvledger skips what is already there or on its way, I10)."""

    def __init__(self, offered: list[bytes]) -> None:
        self.offered = offered
        self.job_id: int | None = None
        self.tier = ""
        self.items: list[SpecItem] = []
        self.refused = "not decided"

    def fill(self, job: ExternalStoreStarted | ExternalLoadStarted | None, refused: str = "") -> None:
        if job is None:
            self.refused = refused or "nothing to do"
            return
        self.job_id = job.job_id
        self.tier = job.tier
        self.items = [
            SpecItem(item.pool_id, item.engine_key, item.key, item.tier_slot, item.tier_generation, list(item.checksums))
            for item in job.items
        ]
        self.refused = ""

    def __repr__(self) -> str:
        if self.job_id is None:
            return f"KvledgerSpec(refused={self.refused!r}, {len(self.offered)} keys)"
        return f"KvledgerSpec(job={self.job_id}, tier={self.tier!r}, slots={[item.slot for item in self.items]})"


class KvledgerOffloadingManager(OffloadingManager):
    """Scheduler side: every decision is the sidecar's (LedgerSession), none is made here.

    Lookups are answered at once (one LookupKeys per request per pass: `ask`, called by
    KvledgerOffloadingConnector with the request's whole key chain); the loads and stores of a
    pass are decided together in one committed step when the pass ends (`flush`)."""

    def __init__(self, settings: OffloadSettings, facts: EngineFacts, events_enabled: bool) -> None:
        self.settings = settings
        self.facts = facts
        self.events_enabled = events_enabled
        self._session: LedgerSession | None = None
        self._events: list[OffloadingEvent] = []
        self._engine_keys: dict[bytes, OffloadKey] = {}
        """Tier key -> vLLM's key, for the keys this engine stored (to name evictions to vLLM)."""
        self._loads: list[tuple[KvledgerSpec, PendingLoad, ReqContext]] = []
        self._stores: list[tuple[KvledgerSpec, PendingStore]] = []
        self.reset_failed: str | None = None
        """Why the last reset_cache could not end this engine's keys in the tier (None: it did)."""

    def session(self) -> LedgerSession:
        if self._session is None:
            facts = self.facts
            if facts.hash_algorithm is None:
                facts = msgspec.structs.replace(facts, hash_algorithm=engine_hash_algorithm())
            self._session = LedgerSession(self.settings, facts)
            log.info(
                "kvledger_engine_declared",
                engine=self._session.engine_id,
                tier=self._session.tier.name,
                hash_algorithm=facts.hash_algorithm,
            )
        return self._session

    @staticmethod
    def _refs(keys: Iterable[OffloadKey]) -> list[ExternalKey]:
        return [ExternalKey(get_offload_group_idx(key), bytes(key)) for key in keys]

    def ask(self, keys: Collection[OffloadKey], waiting: Callable[[], Iterable[Collection[OffloadKey]]] | None = None) -> None:
        """A request's whole key chain, asked in one question before vLLM looks its keys up one by
        one; `waiting`, the chains of the requests behind it, asked in the same question when it
        needs a round trip (LedgerSession.ask)."""
        if not keys:
            return
        try:
            more = None if waiting is None else (lambda: (self._refs(chain) for chain in waiting()))
            self.session().ask(self._refs(keys), more)
        except (Refusal, SidecarError, SidecarUnavailable) as error:  # each lookup then asks alone (or misses)
            log.warning("kvledger_unavailable", call="ask", error=str(error))

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        try:
            loadable = self.session().answer(self._refs([key])[0])
        except (Refusal, SidecarError, SidecarUnavailable) as error:  # no decision, no load: recompute
            log.warning("kvledger_unavailable", call="lookup", error=str(error))
            return LookupResult.MISS
        return LookupResult.HIT if loadable else LookupResult.MISS

    def prepare_load(self, keys: Collection[OffloadKey], req_context: ReqContext) -> LoadStoreSpec:
        refs = self._refs(keys)
        spec = KvledgerSpec([ref.engine_key for ref in refs])
        try:
            pending = self.session().load(refs)
        except (SidecarError, SidecarUnavailable) as error:  # the worker refuses it: vLLM recomputes the blocks
            spec.fill(None, f"no sidecar: {error}")
            return spec
        self._loads.append((spec, pending, req_context))
        return spec

    def touch(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        """Recency is kvledger's: a successful load touches its keys (coordinator/core/projector.py)."""

    def complete_load(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        """The workers reported the job to the sidecar, which ended it and its leases."""

    def prepare_store(self, keys: Collection[OffloadKey], req_context: ReqContext) -> PrepareStoreOutput | None:
        refs = self._refs(keys)
        # Decided in prefix order (the token position each key ends at), however they came.
        ordered = in_prefix_order(refs, [req_context.get_offload_key_position(key) for key in keys])
        try:
            pending = self.session().store(ordered)
        except (SidecarError, SidecarUnavailable) as error:  # no decision, no store
            log.warning("kvledger_unavailable", call="prepare_store", error=str(error))
            return None
        if pending is None:  # every key is published already (this pass's lookups said so): nothing new
            return PrepareStoreOutput(keys_to_store=[], store_spec=KvledgerSpec([]), evicted_keys=[])
        # vLLM's order, not the decision's: its source blocks come in it (KvledgerOffloadingWorker._blocks).
        chosen = {ref.engine_key for ref in pending.keys}
        offered = [ref.engine_key for ref in refs if ref.engine_key in chosen]
        spec = KvledgerSpec(offered)
        self._stores.append((spec, pending))
        # Evictions are kvledger's, decided at the flush: vLLM hears of them as removal events.
        return PrepareStoreOutput(keys_to_store=[OffloadKey(key) for key in offered], store_spec=spec, evicted_keys=[])

    def flush(self) -> None:
        """Commit this pass's loads and stores in one kvledger step and fill their specs, before
        vLLM ships the pass's metadata to the workers (KvledgerOffloadingConnector calls it)."""
        loads, stores, self._loads, self._stores = self._loads, self._stores, [], []
        if not loads and not stores:
            return
        self.session().flush()
        for spec, pending, req_context in loads:
            spec.fill(pending.job, pending.refused)
            if pending.job is None:
                log.warning(
                    "kvledger_load_not_started",
                    request=req_context.req_id,
                    error=pending.refused,
                    keys=[ref.engine_key.hex() for ref in pending.keys],
                )
        evicted_keys: list[OffloadKey] = []
        for spec, pending in stores:
            spec.fill(pending.job, pending.refused)
            if pending.job is None:
                continue
            evicted_keys += [self._engine_keys.pop(e.key) for e in pending.evicted if e.key in self._engine_keys]
            for item in pending.job.items:
                self._engine_keys[item.key] = OffloadKey(item.engine_key)
        if evicted_keys and self.events_enabled:
            self._events.append(OffloadingEvent(keys=evicted_keys, medium=Medium.CPU, removed=True))

    def load_failed(self) -> None:
        """vLLM heard of loads refused on a worker (their blocks named as load errors): the tier
        changed under this session's hits (a key quarantined, a job failed), so none is reused."""
        if self._session is not None:
            self._session.forget_hits()

    def on_schedule_end(self, context) -> None:
        if self._session is not None:
            self._session.end_pass()

    def complete_store(self, keys: Collection[OffloadKey], req_context: ReqContext, success: bool = True) -> None:
        # Publication is the sidecar's, once every rank reported (I5); this only feeds vLLM's events.
        if success and keys and self.events_enabled:
            self._events.append(OffloadingEvent(keys=list(keys), medium=Medium.CPU, removed=False))

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        return RequestOffloadingContext()

    def take_events(self) -> Iterable[OffloadingEvent]:
        events, self._events = self._events, []
        return events

    def reset_cache(self) -> None:
        """`reset_prefix_cache(reset_connector=True)` (vLLM #57727: the CPU tier kept serving the
        old blocks after it returned success): this engine's keys end in kvledger's tier before
        it returns, its jobs in flight are fenced, and no lookup finds those keys afterwards.
        When kvledger could not be told, `reset_failed` says why (vLLM's own reset goes on: this
        is called in its middle) and the connector answers the reset with False
        (KvledgerOffloadingConnector.reset_cache)."""
        self._loads, self._stores = [], []
        self.reset_failed = None
        try:
            events = self.session().reset()
        except (SidecarError, SidecarUnavailable) as error:
            self.reset_failed = str(error)
            log.error("kvledger_reset_failed", error=self.reset_failed)
            return
        ended = [e.key for e in events if isinstance(e, KeyEvicted | KeyQuarantined)]
        if ended and self.events_enabled:
            removed = [self._engine_keys[key] for key in ended if key in self._engine_keys]
            if removed:
                self._events.append(OffloadingEvent(keys=removed, medium=Medium.CPU, removed=True))
        for key in ended:
            self._engine_keys.pop(key, None)
        log.info("kvledger_reset", engine=self.session().engine_id, keys_ended=len(ended))

    def shutdown(self) -> None:
        if self._session is not None:
            self._session.close()
            self._session = None


class KvledgerOffloadingWorker(OffloadingWorker):
    """Worker side: copies between vLLM's KV-cache rows and the tier, synchronously, verified."""

    def __init__(
        self,
        settings: OffloadSettings,
        facts: EngineFacts,
        rank: int,
        kv_caches: CanonicalKVCaches,
        blocks_per_chunk: int,
        load_errors: LoadErrors,
    ) -> None:
        if blocks_per_chunk != 1:
            raise ValueError(f"kvledger's spec stores one vLLM block per tier slot; blocks_per_chunk is {blocks_per_chunk}")
        self.rank = rank
        self.tensors = [t.tensor for t in kv_caches.tensors]
        self.group_tensors = {group: [ref.tensor_idx for ref in refs] for group, refs in enumerate(kv_caches.group_data_refs)}
        self.tier = _tier(settings, tier_spec(settings, facts), rank)
        self.reporter = Reporter(settings.socket, engine_id(settings, facts), rank)
        self.load_errors = load_errors
        self.finished: list[TransferResult] = []
        self._unreported: list = []
        """(report, what to do with what it committed) of the transfers submitted since the last get_finished."""

    def _rows(self, group: int, block_id: int) -> list[torch.Tensor]:
        return [self.tensors[index][block_id] for index in self.group_tensors[group]]

    def _blocks(self, spec: KvledgerSpec, engine_spec: GPULoadStoreSpec) -> list[int]:
        """The engine block of each of the job's items (vLLM's blocks come in the offered keys' order)."""
        block_ids = [int(b) for b in np.asarray(engine_spec.block_ids)]
        if len(block_ids) != len(spec.offered):
            raise RuntimeError(f"kvledger job {spec.job_id}: {len(spec.offered)} keys for {len(block_ids)} vLLM blocks")
        if [item.engine_key for item in spec.items] == spec.offered:  # a load, or a store that admitted every key
            return block_ids
        position = {engine_key: index for index, engine_key in enumerate(spec.offered)}
        return [block_ids[position[item.engine_key]] for item in spec.items]

    def submit_store(self, job_id: int, src_spec: GPULoadStoreSpec, dst_spec: LoadStoreSpec) -> bool:
        assert isinstance(dst_spec, KvledgerSpec), dst_spec
        if dst_spec.job_id is None:  # nothing admitted (already there, the tier full, no sidecar): nothing stored
            self.finished.append(TransferResult(job_id, True))
            return True
        started = time.perf_counter()
        checksums = []
        size = 0
        # A store is best effort: one that fails publishes nothing, so later lookups miss (the
        # sidecar decides every lookup). vLLM asserts success: the transfer is "done" either way.
        report = None
        try:
            if isinstance(self.tier, MooncakeTier) and self.rank == 0:  # what the slots held before: evicted, removed
                self.tier.retire((item.slot, item.generation - 1) for item in dst_spec.items)
            for block_id, item in zip(self._blocks(dst_spec, src_spec), dst_spec.items, strict=True):
                data = torch.cat([row.reshape(-1) for row in self._rows(item.group, block_id)]).view(torch.uint8)
                checksums.append(self.tier.write(item.key, data, slot=item.slot, generation=item.generation))
                size += data.numel()
        except (TierError, OSError) as error:
            log.warning("kvledger_store_write_failed", job_id=dst_spec.job_id, rank=self.rank, error=str(error))
            report = ReportRank(
                job_id=dst_spec.job_id, rank=self.rank, ok=False, checksums=[], error=f"tier_write_failed: {error}"[:500]
            )
        kvledger_job = dst_spec.job_id

        def reported(events: list | None) -> None:
            if events is None:
                log.warning("kvledger_unavailable", call="report_store", job_id=kvledger_job, rank=self.rank)
            if report is not None:
                self.finished.append(TransferResult(job_id, True))
                return
            failed = [e for e in events or [] if isinstance(e, JobFailed)]
            if failed:  # nothing published: later lookups miss, vLLM recomputes
                log.warning("kvledger_store_failed", job_id=kvledger_job, reason=failed[0].reason, detail=failed[0].detail)
            self.finished.append(TransferResult(job_id, True, size, time.perf_counter() - started))

        self._report(report or ReportRank(job_id=kvledger_job, rank=self.rank, ok=True, checksums=checksums), reported)
        return True

    def _refuse(
        self,
        job_id: int,
        block_ids: list[int],
        reason: str,
        *,
        kvledger_job: int | None,
        keys: list[str],
        events: list | None = None,
    ) -> bool:
        """vLLM recomputes the blocks (the connector names them as load errors); the transfer is
        "done" without a size, so vLLM neither crashes (it asserts success) nor counts it as loaded bytes."""
        self.load_errors.refuse(block_ids, job_id)
        self.finished.append(TransferResult(job_id, True))
        events = events or []
        log.warning(
            "kvledger_load_refused",
            job_id=kvledger_job,
            vllm_job_id=job_id,
            rank=self.rank,
            reason=reason,
            keys=keys,
            blocks=block_ids,
            quarantined=[e.key.hex() for e in events if isinstance(e, KeyQuarantined)],
            job_failed=[f"{e.reason}: {e.detail}" for e in events if isinstance(e, JobFailed)],
        )
        return True

    def _report(self, report: ReportRank, reported) -> None:
        """Queue a report: the pass's reports go to the sidecar together, in one round trip,
        when vLLM asks for the pass's finished transfers (`get_finished`); `reported` then gets
        what the report committed, or None when the sidecar could not be told (a load then
        cannot count: kvledger would not know its key was read)."""
        self._unreported.append((report, reported))

    def _send_reports(self) -> None:
        unreported, self._unreported = self._unreported, []
        if not unreported:
            return
        try:
            committed: list = self.reporter.report_all([report for report, _ in unreported])
        except (SidecarError, SidecarUnavailable) as error:
            log.warning("kvledger_unavailable", call="report", jobs=[report.job_id for report, _ in unreported], error=str(error))
            committed = [None] * len(unreported)
        for (_, reported), events in zip(unreported, committed, strict=True):
            reported(events)

    def submit_load(self, job_id: int, src_spec: LoadStoreSpec, dst_spec: GPULoadStoreSpec) -> bool:
        assert isinstance(src_spec, KvledgerSpec), src_spec
        if src_spec.job_id is None:  # a load kvledger would not start: refused, vLLM recomputes
            return self._refuse(
                job_id,
                [int(b) for b in np.asarray(dst_spec.block_ids)],
                src_spec.refused,
                kvledger_job=None,
                keys=[key.hex() for key in src_spec.offered],
            )
        started = time.perf_counter()
        block_ids = self._blocks(src_spec, dst_spec)
        keys = [item.key.hex() for item in src_spec.items]
        read: list[torch.Tensor] = []
        sums: list[bytes] = []
        unreadable: list[str] = []
        for block_id, item in zip(block_ids, src_spec.items, strict=True):
            nbytes = sum(row.numel() * row.element_size() for row in self._rows(item.group, block_id))
            try:
                data = self.tier.read(item.key, nbytes, slot=item.slot, generation=item.generation)
            except TierError as error:  # no checksum: the key is not quarantined, the job fails RANK_FAILED
                unreadable.append(str(error))
                data = torch.empty(0, dtype=torch.uint8)
            read.append(data)
            sums.append(checksum(data) if data.numel() else b"")
        bad = unverified([item.checksums for item in src_spec.items], sums, self.rank)
        if bad:
            # I13: not one byte of a bad block reaches vLLM's cache. The blocks before the first
            # are copied (the sidecar keeps them: JobFailed.kept) and vLLM recomputes from there
            # on, as its own per-block recovery does. Reported, so the key is quarantined.
            first = bad[0]
            mismatched = [keys[index] for index in bad]
            landed, _ = self._copy(block_ids[:first], src_spec.items[:first], read[:first])
            error = f"checksum_mismatch: {mismatched}" + (f"; unreadable: {unreadable}" if unreadable else "")
            self._report(
                ReportRank(job_id=src_spec.job_id, rank=self.rank, ok=False, checksums=landed + sums[first:], error=error),
                lambda events: self._refuse(
                    job_id, block_ids[first:], error, kvledger_job=src_spec.job_id, keys=mismatched, events=events
                ),
            )
            return True
        landed, size = self._copy(block_ids, src_spec.items, read)

        def reported(events: list | None) -> None:
            failed = [e for e in events or [] if isinstance(e, JobFailed)]
            if landed != sums or failed or events is None:
                # A load that does not count (lease expired, key evicted or quarantined meanwhile,
                # I12; bytes that changed on their way in; a report the sidecar never got): the
                # blocks it wrote are recomputed over, before vLLM hears the pass's transfers ended;
                # all but those a failed verification kept (JobFailed.kept: verified on every rank).
                reason = "verify_failed" if landed != sums else f"job_failed: {failed[0].reason}" if failed else "not_reported"
                kept = failed[0].kept if failed and landed == sums else 0
                self._refuse(job_id, block_ids[kept:], reason, kvledger_job=src_spec.job_id, keys=keys[kept:], events=events)
                return
            self.finished.append(TransferResult(job_id, True, size, time.perf_counter() - started))

        self._report(
            ReportRank(
                job_id=src_spec.job_id,
                rank=self.rank,
                ok=landed == sums,
                checksums=landed,
                error="" if landed == sums else "verify_failed",
            ),
            reported,
        )
        return True

    def _copy(self, block_ids: list[int], items: list[SpecItem], read: list[torch.Tensor]) -> tuple[list[bytes], int]:
        """Copy what was read into vLLM's blocks; the checksum of what landed in each, and the bytes moved."""
        landed = []
        size = 0
        for block_id, item, data in zip(block_ids, items, read, strict=True):
            offset = 0
            rows = self._rows(item.group, block_id)
            for row in rows:
                length = row.numel() * row.element_size()
                row.view(-1).view(torch.uint8).copy_(data[offset : offset + length])
                offset += length
            landed.append(checksum(torch.cat([row.reshape(-1) for row in rows]).view(torch.uint8)))
            size += offset
        return landed, size

    def get_finished(self) -> list[TransferResult]:
        """The pass's transfers: their reports sent first, together, so that a load the sidecar
        failed is refused (LoadErrors) in the same pass that reports it finished."""
        self._send_reports()
        finished, self.finished = self.finished, []
        return finished

    def wait(self, job_ids: set[int]) -> None:
        """Every transfer's bytes are moved before submit_* returns; its report goes now."""
        self._send_reports()

    def shutdown(self) -> None:
        self._send_reports()
        self.reporter.close()
        if isinstance(self.tier, MooncakeTier):
            self.tier.close()


def _tier(settings: OffloadSettings, spec, rank: int) -> Tier:
    """This rank's view of the tier: files under rank-N of kvledger_tier_dir; objects in the
    Mooncake Store kvledger_mooncake names (this rank's own client, its objects named by slot,
    generation, key and rank); else the worker process's memory."""
    device = torch.device("cpu")
    if settings.mooncake is not None:
        from gpu.mooncake import connect

        mooncake = settings.mooncake
        client = connect(
            mooncake.master, mooncake.metadata_url, segment_bytes=mooncake.segment_bytes, buffer_bytes=mooncake.buffer_bytes
        )
        log.info("kvledger_mooncake_connected", tier=spec.name, rank=rank, master=mooncake.master)
        return MooncakeTier(spec.name, client, rank=rank, device=device)
    if settings.tier_dir:
        return DiskTier(spec.name, Path(settings.tier_dir) / f"rank-{rank}", device)
    return SlotTier(spec.name, device, spec.num_slots, spec.bytes_per_slot)


class KvledgerOffloadingSpec(OffloadingSpec):
    """Instantiated once in the scheduler process (get_manager) and once per worker (get_worker)."""

    def __init__(self, config) -> None:
        super().__init__(config)
        self.settings = OffloadSettings.parse(self.extra_config)
        parallel = config.parallel
        self.facts = EngineFacts(
            vllm_engine_id=str(config.engine_id),
            model=str(config.model.name),
            dtype=str(config.model.dtype),
            groups=[(int(g.group_id), int(g.tokens_per_block)) for g in config.groups],
            bytes_per_block=int(config.worker_kv_bytes_per_block),
            tensor_parallel_size=int(parallel.tp_size),
            pipeline_parallel_size=int(parallel.pp_size),
        )
        self.rank = int(parallel.rank)
        check_groups(self.settings, self.facts)  # at start-up, in both roles, one line naming the group
        self.load_errors: LoadErrors | None = None
        """Set by KvledgerOffloadingConnector (coordinator/vllm/connector.py), which reports them to vLLM."""
        self._manager: KvledgerOffloadingManager | None = None
        self._worker: KvledgerOffloadingWorker | None = None

    def get_manager(self) -> OffloadingManager:
        if self._manager is None:
            self._manager = KvledgerOffloadingManager(self.settings, self.facts, self.kv_events_config.enable_kv_cache_events)
        return self._manager

    def get_worker(self, kv_caches: CanonicalKVCaches) -> OffloadingWorker:
        if self.load_errors is None:
            # Under vLLM's own OffloadingConnector a refused load could only crash the worker.
            raise SettingsError(
                f"{type(self).__name__} needs kv_connector {CONNECTOR_NAME!r} with "
                f"kv_connector_module_path {CONNECTOR_MODULE!r} (and kv_load_failure_policy "
                f'"recompute"), not vLLM\'s OffloadingConnector'
            )
        if self._worker is None:
            self._worker = KvledgerOffloadingWorker(
                self.settings, self.facts, self.rank, kv_caches, self.blocks_per_chunk, self.load_errors
            )
        return self._worker
