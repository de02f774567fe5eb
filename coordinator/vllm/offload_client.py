"""The sidecar side of kvledger's vLLM offloading spec, without vLLM: settings, the engine's Hello,
the manager's session and the worker's reporter. coordinator/vllm/offload.py wraps these in
vLLM's classes; tests use them directly, against a real sidecar, where vLLM is not installed.

How the two vLLM processes talk to `kvledger serve` (both over its Unix socket):

* the **manager** (vLLM's scheduler process, synchronous) is the engine: one `SyncEngineClient`
  whose Hello declares the engine, its namespace (from kv_connector_extra_config), its reported
  pools (vLLM's KV-cache groups: vLLM allocates those blocks, kvledger never names one) and the
  tier. Lookups are answered at once from the committed state (LookupKeys, one per request per
  scheduler pass) and recorded in the log afterwards; the loads and stores of one scheduler pass
  are one kvledger step (LoadExternal, StoreExternal, coordinator/core/external.py), committed to the
  log before vLLM ships the pass to its workers: kvledger picks the tier slots, evicts, leases,
  names the jobs;
* the **worker** (each of vLLM's worker processes) learns its jobs from the LoadStoreSpec vLLM
  ships it (the committed decision: job id, tier keys, slots, published checksums), moves the
  bytes, and reports its (job, rank) result itself on a worker connection (`Reporter`): a key
  is published only once every rank's report with its checksum is committed (I5).

The tier keys are made by kvledger from vLLM's offload keys in the engine's namespace
(coordinator.core.external.external_key): vLLM's block hash ignores the weights revision, the tier
key does not.

A load the worker refuses (bytes that differ from the published checksum, a job the sidecar
failed) reaches vLLM as engine block ids in `LoadErrors`, which the connector
(coordinator/vllm/connector.py) hands to vLLM's get_block_ids_with_load_errors; vLLM then
recomputes those blocks, which it does only under kv_load_failure_policy "recompute" and for a
model with one KV-cache group (`check_connector_config`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, NamedTuple

import msgspec

from coordinator.client import Address, SidecarError, SidecarUnavailable, SyncEngineClient, SyncWorkerClient
from coordinator.core.commands import (
    AnyCommand,
    DeclareEngine,
    ExternalKey,
    LoadExternal,
    ReportRank,
    ResetCache,
    StoreExternal,
)
from coordinator.sidecar import protocol as p
from events import (
    Event,
    ExternalLoadStarted,
    ExternalStoreStarted,
    JobSucceeded,
    KeyEvicted,
    NamespaceSpec,
    PoolSpec,
    Refused,
    StepBegan,
    StepEnded,
    TierSpec,
)

HASH_PREFIX = "vllm:"
"""A vLLM engine's key hash algorithm as kvledger names it: "vllm:" + prefix_caching_hash_algo (as `kvledger ingest vllm` names it)."""
PREFETCH_KEYS = 4096
"""The most keys one lookup asks for a request and the requests waiting behind it (LedgerSession.ask)."""
HIT_SECONDS = 0.5
"""How long a hit is reused across scheduler passes by default (OffloadSettings.hit_seconds)."""
MAX_HIT_SECONDS = 60.0
"""The longest kvledger_hit_seconds taken: a hit older than that is not worth a load decision."""
NOMINAL_BLOCKS = 2
"""vLLM's GPU blocks are its own (a reported pool that kvledger never names a block of); the pool
is declared with the fewest blocks a pool may have (block 0 is the null block)."""


class SettingsError(ValueError):
    """kv_connector_extra_config cannot be used; the message names the key to fix."""


class MooncakeSettings(msgspec.Struct, frozen=True, kw_only=True):
    """kvledger_mooncake: {"master": "host:port", "metadata_url": "http://host:port/metadata",
    "segment_bytes": 67108864, "buffer_bytes": 16777216}: the master every worker's client names
    and what each client contributes to the store (gpu.mooncake.connect)."""

    master: str
    metadata_url: str
    segment_bytes: int = 64 << 20
    buffer_bytes: int = 16 << 20

    @classmethod
    def parse(cls, given: Any) -> MooncakeSettings:
        if not isinstance(given, Mapping) or not given.get("master") or not given.get("metadata_url"):
            raise SettingsError(
                'kvledger_mooncake needs {"master": "host:port", "metadata_url": "http://host:port/metadata"}: '
                f"the Mooncake master the workers connect to (given {given!r})"
            )
        try:
            return cls(
                master=str(given["master"]),
                metadata_url=str(given["metadata_url"]),
                segment_bytes=int(given.get("segment_bytes", 64 << 20)),
                buffer_bytes=int(given.get("buffer_bytes", 16 << 20)),
            )
        except (TypeError, ValueError) as error:
            raise SettingsError(f"kvledger_mooncake: {error}") from error


class OffloadSettings(msgspec.Struct, frozen=True, kw_only=True):
    """What the operator writes in kv_connector_extra_config (besides spec_name and spec_module_path)."""

    socket: str
    """kvledger_socket: the sidecar's Unix socket path."""
    namespace: dict[str, Any]
    """kvledger_namespace: the NamespaceSpec fields the engine is declared to run. weights_revision,
    tokenizer_digest, tenant, block_sizes and hash_algorithm ("vllm:sha256") are required: kvledger
    checks the last two against the engine at Hello. model_id, kv_dtype and kv_layout_version (1)
    default to the engine's; the parallel layout (tensor_parallel_size, pipeline_parallel_size,
    kv_rank_layout "heads") is always the engine's: a namespace that says otherwise is refused at
    start-up, and so is parallelism_agnostic (this tier's blocks are per-rank shards)."""
    engine_id: str = ""
    """kvledger_engine_id: a stable id makes a restart a new incarnation of the same engine (I16);
    default "vllm-<vLLM's engine_id>", new at every start."""
    tier_slots: int = 256
    """kvledger_tier_slots: blocks the tier holds (per rank)."""
    tier_dir: str = ""
    """kvledger_tier_dir: keep blocks in files there (gpu.tiers.DiskTier), reachable by later engine
    processes; default: in the worker process's memory (gpu.tiers.SlotTier), for this engine only."""
    mooncake: MooncakeSettings | None = None
    """kvledger_mooncake: keep blocks in a Mooncake Store (gpu.mooncake.MooncakeTier), shared by
    every engine whose workers name the same master; not with kvledger_tier_dir."""
    lease_seconds: float = 60.0
    """kvledger_lease_seconds: how long a load holds its keys against eviction (I12)."""
    hit_seconds: float = HIT_SECONDS
    """kvledger_hit_seconds: how long a key the sidecar answered loadable is taken as loadable in
    later scheduler passes without asking again (LedgerSession); 0 asks in every pass."""

    @classmethod
    def parse(cls, extra: Mapping[str, Any]) -> OffloadSettings:
        if not extra.get("kvledger_socket"):
            raise SettingsError("kv_connector_extra_config needs kvledger_socket: the path of `kvledger serve --socket`")
        namespace = extra.get("kvledger_namespace")
        if not isinstance(namespace, Mapping):
            raise SettingsError("kv_connector_extra_config needs kvledger_namespace: an object of NamespaceSpec fields")
        missing = [
            name
            for name in ("weights_revision", "tokenizer_digest", "tenant", "block_sizes", "hash_algorithm")
            if not namespace.get(name)
        ]
        if missing:
            raise SettingsError(f"kvledger_namespace lacks {missing}: declare what the engine must run")
        mooncake = extra.get("kvledger_mooncake")
        if mooncake is not None and extra.get("kvledger_tier_dir"):
            raise SettingsError("kv_connector_extra_config names kvledger_tier_dir and kvledger_mooncake: one tier, not both")
        try:
            return cls(
                socket=str(extra["kvledger_socket"]),
                mooncake=None if mooncake is None else MooncakeSettings.parse(mooncake),
                namespace=dict(namespace),
                engine_id=str(extra.get("kvledger_engine_id", "")),
                tier_slots=int(extra.get("kvledger_tier_slots", 256)),
                tier_dir=str(extra.get("kvledger_tier_dir", "")),
                lease_seconds=float(extra.get("kvledger_lease_seconds", 60.0)),
                hit_seconds=_hit_seconds(extra.get("kvledger_hit_seconds", HIT_SECONDS)),
            )
        except (TypeError, ValueError) as error:
            raise SettingsError(f"kv_connector_extra_config: {error}") from error


def _hit_seconds(value: Any) -> float:
    try:
        seconds = float(value)
    except (TypeError, ValueError):
        seconds = float("nan")
    if not 0 <= seconds <= MAX_HIT_SECONDS:
        raise ValueError(f"kvledger_hit_seconds is {value!r}: seconds from 0 (ask in every pass) to {MAX_HIT_SECONDS:g}")
    return seconds


class SpecItem(NamedTuple):
    """One block of a committed job as the worker needs it (KvledgerSpec.items)."""

    group: int
    """vLLM's KV-cache group (kvledger's pool)."""
    engine_key: bytes
    key: bytes
    """The tier key (in the engine's namespace)."""
    slot: int
    generation: int
    """The tier slot's generation: a tier whose objects outlive a slot's reuse names them by it."""
    checksums: list[bytes]
    """Published, one a rank (loads); empty for stores."""


SPEC_NAME = "KvledgerOffloadingSpec"
"""The spec's class in coordinator.vllm.offload, as kv_connector_extra_config names it."""
CONNECTOR_NAME = "KvledgerOffloadingConnector"
CONNECTOR_MODULE = "coordinator.vllm.connector"


def check_connector_config(load_failure_policy: str, extra: Mapping[str, Any]) -> None:
    """Refuse at start-up what would crash vLLM at the first refused load.

    A refused load is reported to vLLM as block ids (get_block_ids_with_load_errors) for a model
    with one KV-cache group, as failed requests (failed_recving) for one with several (vLLM 0.32
    raises on block ids then: they are unique only within a group; vllm/v1/core/sched/scheduler.py,
    _handle_invalid_blocks). vLLM's scheduler fails the request under kv_load_failure_policy
    "fail" (its default)."""
    if load_failure_policy != "recompute":
        raise SettingsError(
            f'{CONNECTOR_NAME} needs kv_transfer_config kv_load_failure_policy "recompute" '
            f"(it is {load_failure_policy!r}): a load kvledger refuses is recomputed by vLLM, "
            f"never served"
        )
    if extra.get("spec_name") != SPEC_NAME:
        raise SettingsError(
            f"{CONNECTOR_NAME} needs kv_connector_extra_config spec_name {SPEC_NAME!r} "
            f'(spec_module_path "coordinator.vllm.offload"), not {extra.get("spec_name")!r}'
        )


class LoadErrors:
    """The loads a worker refused, until vLLM's connector takes them: their engine block ids
    (reported for a model with one KV-cache group, whose block ids name blocks) and their vLLM
    transfer job ids (reported as failed requests for a model with several).

    vLLM asks once per forward pass, after the pass's transfers were submitted and their
    results taken (kv_connector_model_runner_mixin._get_kv_connector_output): a refused load
    must be in the answer of the pass that reports it finished, which a synchronous worker's is."""

    def __init__(self) -> None:
        self._block_ids: set[int] = set()
        self._jobs: set[int] = set()

    def refuse(self, block_ids: Iterable[int], job_id: int | None = None) -> None:
        self._block_ids.update(block_ids)
        if job_id is not None:
            self._jobs.add(job_id)

    def take(self) -> set[int]:
        """The refused block ids since the last call (each reported once)."""
        taken, self._block_ids = self._block_ids, set()
        return taken

    def take_jobs(self) -> set[int]:
        """The vLLM transfer jobs of the loads refused since the last call (each reported once)."""
        taken, self._jobs = self._jobs, set()
        return taken


def in_prefix_order(keys: Sequence[ExternalKey], positions: Sequence[int | None]) -> list[ExternalKey]:
    """`keys` by the token position each ends at (vLLM's ReqContext records it; None: unknown, kept
    where it came, after the known ones before it), stable. A sliding-window group's backfilled
    blocks reach a store after later ones (vLLM #50359, #53324); decided in prefix order, a store
    job publishes a request's shallow blocks first, and a tier that must evict among them keeps
    those every longer hit needs."""
    last = -1
    ranked = []
    for index, (key, position) in enumerate(zip(keys, positions, strict=True)):
        last = position if position is not None else last
        ranked.append((last, index, key))
    return [key for _, _, key in sorted(ranked, key=lambda rank: (rank[0], rank[1]))]


def check_groups(settings: OffloadSettings, facts: EngineFacts) -> None:
    """Refuse at start-up, in one line naming the group and the value, a model whose KV-cache
    groups the declared namespace does not describe (its block_sizes list one size a group, in
    group order), rather than at the engine's first request (the decider's refusal at Hello)."""
    declared = list(settings.namespace.get("block_sizes") or [])
    runs = [size for _, size in facts.groups]
    if len(declared) != len(runs):
        raise SettingsError(
            f"kvledger_namespace block_sizes lists {len(declared)} size(s) {declared}, and the model has "
            f"{len(runs)} KV-cache group(s) of {runs} tokens a block: list one a group, in group order"
        )
    for (group_id, size), said in zip(facts.groups, declared, strict=True):
        if size != said:
            raise SettingsError(
                f"KV-cache group {group_id} has {size} tokens a block; kvledger_namespace block_sizes says {said}"
            )
    if len({group_id for group_id, _ in facts.groups}) != len(facts.groups) or any(g < 0 for g, _ in facts.groups):
        raise SettingsError(f"KV-cache group ids {[g for g, _ in facts.groups]} must be distinct and not negative")


def unverified(published: Sequence[Sequence[bytes]], read: Sequence[bytes], rank: int) -> list[int]:
    """Indexes of the items whose bytes this rank read differ from (or lack) the published checksum (I13)."""
    return [
        index
        for index, (checksums, found) in enumerate(zip(published, read, strict=True))
        if rank >= len(checksums) or not found or found != checksums[rank]
    ]


class EngineFacts(msgspec.Struct, frozen=True, kw_only=True):
    """What the engine actually runs, as vLLM's OffloadingConfig (and its hash) tell."""

    vllm_engine_id: str
    model: str
    dtype: str
    groups: list[tuple[int, int]]
    """(group id, tokens per block) of each KV-cache group."""
    bytes_per_block: int
    """worker_kv_bytes_per_block: one block's bytes on one rank (every layer of its group)."""
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    hash_algorithm: str | None = None
    """vLLM's prefix_caching_hash_algo ("sha256"...), None while unknown."""

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size


def engine_id(settings: OffloadSettings, facts: EngineFacts) -> str:
    return settings.engine_id or f"vllm-{facts.vllm_engine_id}"


def tier_spec(settings: OffloadSettings, facts: EngineFacts) -> TierSpec:
    # A memory tier dies with its worker process: it is this engine start's alone, so a later
    # start never finds keys published whose bytes are gone. A directory or a Mooncake Store
    # outlives processes, and every engine naming the same one shares its tier.
    if settings.mooncake is not None:
        name = f"vllm-mooncake:{settings.mooncake.master}"
    elif settings.tier_dir:
        name = f"vllm-disk:{settings.tier_dir}"
    else:
        name = f"vllm-host/{facts.vllm_engine_id}"
    return TierSpec(name=name, num_slots=settings.tier_slots, bytes_per_slot=facts.bytes_per_block)


RANK_LAYOUT = "heads"
"""How vLLM splits a block across tensor-parallel ranks: each rank holds its share of the KV
heads (its worker stores that shard, gpu.tiers under rank-N)."""


def parallel_layout(facts: EngineFacts) -> dict[str, Any]:
    """The namespace fields of the engine's parallel layout: always the engine's own."""
    return {
        "tensor_parallel_size": facts.tensor_parallel_size,
        "pipeline_parallel_size": facts.pipeline_parallel_size,
        "kv_rank_layout": RANK_LAYOUT,
    }


def declaration(settings: OffloadSettings, facts: EngineFacts) -> tuple[DeclareEngine, TierSpec]:
    """The engine's Hello: the declared namespace, the engine's real pools and key hash algorithm
    (the decider refuses a block size or an algorithm that differs, naming both)."""
    layout = parallel_layout(facts)
    for name, runs in layout.items():
        said = settings.namespace.get(name, runs)
        if said != runs:
            raise SettingsError(
                f"kvledger_namespace says {name}={said!r}, the engine runs {runs!r}: the parallel layout is the "
                "engine's (engines of different layouts never share keys); leave it out"
            )
    if settings.namespace.get("parallelism_agnostic"):
        raise SettingsError(
            "kvledger_namespace says parallelism_agnostic: kvledger's vLLM tier stores each rank's shard of a "
            "block (its heads), which depends on the tensor-parallel size; leave it out"
        )
    fields: dict[str, Any] = {
        "model_id": facts.model,
        "kv_dtype": facts.dtype,
        "kv_layout_version": 1,
        **settings.namespace,
        **layout,
    }
    fields["block_sizes"] = tuple(fields["block_sizes"])
    try:
        namespace = msgspec.convert(fields, NamespaceSpec)
    except msgspec.ValidationError as error:
        raise SettingsError(f"kvledger_namespace: {error}") from error
    tier = tier_spec(settings, facts)
    pools = [
        PoolSpec(
            pool_id=group_id,
            kind="attention",
            num_blocks=NOMINAL_BLOCKS,
            block_size=block_size,
            bytes_per_block=facts.bytes_per_block,
            managed=False,
        )
        for group_id, block_size in facts.groups
    ]
    declare = DeclareEngine(
        engine_id=engine_id(settings, facts),
        namespace=namespace,
        pools=pools,
        world_size=facts.world_size,
        tiers=[tier.name],
        key_hash_algorithm=HASH_PREFIX + facts.hash_algorithm if facts.hash_algorithm else "",
    )
    return declare, tier


class Refusal(Exception):
    """The sidecar refused a decision; `event` says why."""

    def __init__(self, event: Refused) -> None:
        super().__init__(f"{event.command} refused: {event.reason}: {event.detail}")
        self.event = event


class PendingLoad:
    """A load vLLM asked for in this scheduler pass, decided when the pass is flushed
    (`LedgerSession.flush`): then `job` is the committed ExternalLoadStarted, or `refused` says
    why there is none (the worker refuses it and vLLM recomputes). vLLM pickles it to the
    workers only after the pass's metadata is built, which is after the flush."""

    def __init__(self, keys: Sequence[ExternalKey]) -> None:
        self.keys = list(keys)
        self.job: ExternalLoadStarted | None = None
        self.refused = ""


class PendingStore:
    """A store vLLM asked for in this pass, decided at the flush: `job` names the keys kvledger
    admitted (new ones only) with their slots, `evicted` what it evicted for them; no job when
    the tier had no slot to give (I12) or the sidecar could not be reached (nothing is stored)."""

    def __init__(self, keys: Sequence[ExternalKey]) -> None:
        self.keys = list(keys)
        self.job: ExternalStoreStarted | None = None
        self.evicted: list[KeyEvicted] = []
        self.refused = ""


class LedgerSession:
    """The manager's connection (vLLM's scheduler process, one thread).

    * Lookups never wait for a commit: `ask` puts a request's whole key chain to the sidecar in
      one LookupKeys, answered at once from the committed state; vLLM's following per-key
      `lookup` calls of the same pass are answered from that answer (`answer`).
    * The loads and stores of one scheduler pass are one committed kvledger step (`flush`, at
      the end of the pass), not one step each: until then they are PendingLoad / PendingStore.
    * A store of keys this pass's lookups found published is known to be an idempotent skip
      (I10): it is not sent at all.
    * A hit is reused in later passes for `settings.hit_seconds` without asking again; a miss is
      asked again in every pass (a request's own stores publish keys the next requests hit).
      A hit is never trusted for more than choosing to load: the load is decided at the flush,
      committed and leased (I12), and a key evicted meanwhile is refused there, which vLLM
      recomputes, as it would a miss. Every hit is forgotten once a flush saw a store evict or
      a load refused (the tier changed under them), once a decided load failed on a worker
      (`forget_hits`: vLLM names its blocks as load errors), and at a reset."""

    def __init__(self, settings: OffloadSettings, facts: EngineFacts, *, retry_for: float = 30.0) -> None:
        self.settings = settings
        self.declare, self.tier = declaration(settings, facts)
        self.engine_id = self.declare.engine_id
        # Raises SidecarError (code REFUSED, "namespace_mismatch: ... both values") on a bad Hello.
        self.client = SyncEngineClient(Address(socket_path=settings.socket), self.declare, tiers=[self.tier], retry_for=retry_for)
        self._step = 0
        self._clock = 0.0
        self._answers: dict[ExternalKey, bool] = {}
        """This pass's lookup answers."""
        self._ended_pass: dict[ExternalKey, bool] = {}
        """The answers of the pass that ended last: vLLM prepares its stores after it ends the pass
        (on_schedule_end, then the store jobs, in build_connector_meta)."""
        self._hits: dict[ExternalKey, float] = {}
        """Keys answered loadable, and when (time.monotonic): reused across passes while younger
        than settings.hit_seconds."""
        self._loads: list[PendingLoad] = []
        self._stores: list[PendingStore] = []
        self.steps = 0
        """Committed steps this session sent."""

    # --- lookups: answered at once, one question per request per pass -----------------------------

    def lookup(self, keys: Sequence[ExternalKey]) -> list[bool]:
        """Which keys are loadable now (committed state; never waits for a commit)."""
        reply = self.client.lookup_keys(self.tier.name, keys)
        if isinstance(reply.answer, Refused):
            raise Refusal(reply.answer)
        loadable = reply.answer.loadable
        self._answers.update(zip(keys, loadable, strict=True))
        if self.settings.hit_seconds:
            now, hits = time.monotonic(), self._hits
            for key, hit in zip(keys, loadable, strict=True):
                hits.pop(key, None)  # a miss now is no hit; a hit goes to the end (the first is the oldest)
                if hit:
                    hits[key] = now
        return list(loadable)

    def _known_hits(self) -> Callable[[ExternalKey], bool]:
        """Whether a key is a hit young enough to reuse (older hits are dropped here, all at once)."""
        hits = self._hits
        if hits:
            oldest = time.monotonic() - self.settings.hit_seconds
            if next(iter(hits.values())) < oldest:  # oldest first (lookup keeps them so)
                self._hits = hits = {key: at for key, at in hits.items() if at >= oldest}
        return hits.__contains__

    def ask(self, keys: Sequence[ExternalKey], waiting: Callable[[], Iterable[Sequence[ExternalKey]]] | None = None) -> None:
        """A request's key chain, asked once for this pass (the keys already answered are not asked
        again). `waiting`: the chains of the requests waiting behind it, called only when this
        chain needs a round trip; as many as fit in PREFETCH_KEYS ride along in the same lookup,
        so the requests one scheduler pass admits cost one round trip, not one each."""
        answers, hit = self._answers, self._known_hits()
        missing = list(dict.fromkeys(key for key in keys if key not in answers and not hit(key)))
        if not missing:
            return
        if waiting is not None:
            asked = set(missing)
            for chain in waiting():
                more = [key for key in dict.fromkeys(chain) if key not in answers and not hit(key) and key not in asked]
                if len(asked) + len(more) > PREFETCH_KEYS:
                    break
                asked.update(more)
                missing += more
        self.lookup(missing)

    def answer(self, key: ExternalKey) -> bool:
        """The key's answer in this pass: from `ask`, or asked alone when it was not part of a chain."""
        known = self._answers.get(key)
        if known is None:
            if self._known_hits()(key):
                return True
            (known,) = self.lookup([key])
        return known

    def forget_hits(self) -> None:
        """A load failed after it was decided (a rank's bytes failed verification, I13, or the
        sidecar failed the job): the keys' state changed where this session cannot see it, so
        no earlier hit is reused; the next passes ask again (and miss a quarantined key)."""
        self._hits = {}

    def end_pass(self) -> None:
        """vLLM ended a scheduler pass (on_schedule_end): the next question begins a new one."""
        self._ended_pass, self._answers = self._answers, {}

    # --- loads and stores: one committed step per pass ----------------------------------------

    def load(self, keys: Sequence[ExternalKey]) -> PendingLoad:
        pending = PendingLoad(keys)
        self._loads.append(pending)
        return pending

    def store(self, keys: Sequence[ExternalKey]) -> PendingStore | None:
        """None: nothing to store (every key was found published in this pass: an idempotent skip)."""
        hit = self._known_hits()
        fresh = [key for key in keys if not self._ended_pass.get(key) and not self._answers.get(key) and not hit(key)]
        if not fresh:
            return None
        pending = PendingStore(fresh)
        self._stores.append(pending)
        return pending

    def flush(self) -> None:
        """Decide every load and store of this pass in one committed step. Never raises: a load
        that could not be decided is refused (vLLM recomputes), a store not stored."""
        loads, stores, self._loads, self._stores = self._loads, self._stores, [], []
        if not loads and not stores:
            return
        commands: list[AnyCommand] = [
            LoadExternal(engine_id=self.engine_id, tier=self.tier.name, keys=load.keys, lease_seconds=self.settings.lease_seconds)
            for load in loads
        ]
        commands += [StoreExternal(engine_id=self.engine_id, tier=self.tier.name, keys=store.keys) for store in stores]
        try:
            results = self._decide(commands)
        except (SidecarError, SidecarUnavailable) as error:
            for load in loads:
                load.refused = f"no decision: {error}"
            for store in stores:
                store.refused = f"no decision: {error}"
            return
        for load, events in zip(loads, results, strict=False):
            refused = [e for e in events if isinstance(e, Refused)]
            if refused:
                load.refused = f"LoadExternal refused: {refused[0].reason}: {refused[0].detail}"
            else:
                (load.job,) = [e for e in events if isinstance(e, ExternalLoadStarted)]
        for store, events in zip(stores, results[len(loads) :], strict=True):
            refused = [e for e in events if isinstance(e, Refused)]
            if refused:  # TIER_FULL: every slot leased or being written (I12); nothing is stored
                store.refused = f"StoreExternal refused: {refused[0].reason}: {refused[0].detail}"
                continue
            (store.job,) = [e for e in events if isinstance(e, ExternalStoreStarted)]
            store.evicted = [e for e in events if isinstance(e, KeyEvicted)]
        if any(load.refused for load in loads) or any(store.evicted for store in stores):
            self._hits = {}  # the tier changed under them (evicted here, or refused a load)

    def _decide(self, commands: list[AnyCommand]) -> list[list[Event]]:
        """Each command's events: in one step, or in several for a pass that holds more than
        the sidecar takes in one (p.MAX_COMMANDS commands, p.MAX_DENSE_FRAME bytes)."""
        results: list[list[Event]] = []
        for chunk in p.frame_chunks(commands):
            results += self._decide_step(chunk)
        return results

    def _decide_step(self, commands: list[AnyCommand]) -> list[list[Event]]:
        # Steps must advance and the clock must not go back, across restarts of a stable engine
        # id too: wall-clock microseconds as the step, wall-clock seconds as the clock (leases).
        now = time.time()
        self._step = max(self._step + 1, int(now * 1_000_000))
        self._clock = max(self._clock, now)
        result = self.client.step(self._step, self._clock, commands)
        self.steps += 1
        if not result.duplicate:
            return [list(events) for events in result.results]
        return per_command([e for events in result.results for e in events], len(commands))

    def reset(self) -> list[Event]:
        """vLLM's `reset_prefix_cache(reset_connector=True)`: this engine's keys end in the tier
        (ResetCache.drop_tier_keys: evicted, or quarantined where a load holds one) and its jobs
        in flight are fenced (I16), committed before this returns; nothing this session knew of
        the tier survives it. Raises SidecarError or SidecarUnavailable when it could not be told."""
        self._answers, self._ended_pass, self._hits, self._loads, self._stores = {}, {}, {}, [], []
        reset = ResetCache(engine_id=self.engine_id, reason="reset_prefix_cache(reset_connector=True)", drop_tier_keys=True)
        return list(self.client.execute(reset).events)

    def close(self) -> None:
        self.client.close()


def per_command(events: Sequence[Event], commands: int) -> list[list[Event]]:
    """A retried step's events (its reply holds them all as one group), regrouped per command of
    a flush: each LoadExternal or StoreExternal ends with its job's start or its refusal (a
    store's KeyEvicted come before its start, the JobSucceeded of a store with nothing new after)."""
    groups: list[list[Event]] = [[]]
    for event in events:
        if isinstance(event, JobSucceeded) and len(groups) > 1 and not groups[-1]:
            groups[-2].append(event)
            continue
        if isinstance(event, StepBegan | StepEnded):
            continue
        groups[-1].append(event)
        if isinstance(event, Refused | ExternalLoadStarted | ExternalStoreStarted):
            groups.append([])
    groups = [group for group in groups if group]
    if len(groups) != commands:
        raise SidecarError(
            p.Error(
                code=p.ErrorCode.INVALID_MESSAGE,
                message=f"a retried step answered {len(groups)} decisions for {commands} commands",
            )
        )
    return groups


class Reporter:
    """A worker rank's reports, synchronous (vLLM's worker calls are), on one connection kept
    open (SyncWorkerClient), retried through a lost connection with the same command id (I4);
    a pass's reports go in one round trip (`report_all`)."""

    def __init__(self, socket_path: str, engine: str, rank: int, *, retry_for: float = 30.0) -> None:
        self._client = SyncWorkerClient(Address(socket_path=socket_path), engine, rank, retry_for=retry_for)
        self.rank = rank

    def report(self, report: ReportRank) -> list[Event]:
        """What the report committed (RankReported; with the last rank, the job's end)."""
        return self._client.report(report, command_id=self._command_id(report))

    def report_all(self, reports: Sequence[ReportRank]) -> list[list[Event]]:
        """Several reports in one round trip (one group); what each committed."""
        return self._client.report_all([(report, self._command_id(report)) for report in reports])

    def _command_id(self, report: ReportRank) -> str:
        return f"report/{self._client.engine_id}/{report.job_id}/{report.rank}"

    def close(self) -> None:
        self._client.close()


__all__ = [
    "CONNECTOR_MODULE",
    "CONNECTOR_NAME",
    "SPEC_NAME",
    "EngineFacts",
    "LedgerSession",
    "LoadErrors",
    "check_groups",
    "in_prefix_order",
    "OffloadSettings",
    "PendingLoad",
    "PendingStore",
    "Refusal",
    "Reporter",
    "SettingsError",
    "SidecarError",
    "SidecarUnavailable",
    "check_connector_config",
    "declaration",
    "engine_id",
    "tier_spec",
    "unverified",
]
