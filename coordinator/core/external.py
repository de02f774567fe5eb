"""External keys: decisions for an engine that owns its device blocks and names its own keys.

vLLM's offloading connector is such an engine: vLLM allocates its GPU blocks and hashes them
itself, and its offloading manager only ever sees keys (block hash + group), never a block id.
kvledger cannot pin or generation-check those blocks (vLLM does, until the job completes), but it
still decides everything about the tier, under the same invariants as for its own blocks:

* the tier key is kvledger's, made from the engine's key *in the engine's namespace*
  (`external_key`): two engines whose hashes ignore the weights revision (vLLM's do) never meet
  in the tier unless their namespaces are the same (I8, I9; seed 003);
* a lookup answers from published, unquarantined keys of the namespace only (I9, I17);
* a store is admitted by kvledger, which gives each new key a tier slot, evicting least recently
  used keys that no lease holds and that no store in flight writes (I12), and names the job;
  keys are published only when every rank reported success with a checksum (I5); a re-store with
  other bytes quarantines the key (I10);
* a load leases its keys (I12) and carries the published checksums; a rank that read other bytes
  quarantines the key (I13); a load that completes after its lease expired fails (I12).

Jobs are counted per (job_id, rank) by the ordinary ReportRank (I4, coordinator/core/jobs.py) and
completed as kvledger's own are (coordinator/core/completion.py). Pure, like the rest of the decider.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Container
from typing import Any

import blake3
import msgspec

from coordinator.core import checks as check
from coordinator.core.checks import Refusal
from coordinator.core.commands import Command, ExternalKey, LoadExternal, LookupExternal, StoreExternal
from coordinator.core.keys import KEY_BYTES, KEY_SEED_DIGEST
from coordinator.core.state import EngineState, PoolState, State, TierState, unpack_checksums
from coordinator.core.tier_slots import reserve_tier_slots
from events import (
    Event,
    ExternalItem,
    ExternalKeysLookedUp,
    ExternalLoadStarted,
    ExternalStoreStarted,
    JobSucceeded,
    Reason,
)

Handler = Callable[[State, Any], list[Event]]

MAX_ENGINE_KEY_BYTES = 256
"""vLLM's keys are 36 bytes (a sha256 block hash + 4 bytes of group); a key this long is garbage."""

_encoder = msgspec.msgpack.Encoder()


RECENT_EXTERNAL_KEYS = 1 << 14
"""How many engine keys `external_key` remembers the tier key of (about 4 MiB with vLLM's
36-byte keys). One request's keys are hashed by its lookup, then again by its load and its store
(the sidecar's LookupKeys, then the step): a blake3 hash costs ~0.5 us in Python, a hit ~0.08 us
(ops/bench/trace.py spent a sixth of its time hashing the same keys again)."""


_KEYED = blake3.blake3(key=KEY_SEED_DIGEST)
"""A hasher keyed by the chain seed and fed nothing: a copy of it is a keyed hasher ~80 ns
sooner than a new one (external_key's cost on a miss)."""


@functools.lru_cache(maxsize=RECENT_EXTERNAL_KEYS)
def external_key(namespace_id: bytes, pool_id: int, engine_key: bytes) -> bytes:
    """The tier key of an engine's own block key: blake3 keyed by the chain seed (coordinator.core.keys)
    over ("external", namespace_id, pool_id, engine_key), 16 bytes. The namespace roots it, as it
    roots every content key (I8): the same vLLM hash under another weights revision, tokenizer or
    tenant is another key. A pure function, so the recently asked are remembered (a bounded
    cache: what it answers is exactly what the hash would)."""
    payload = _encoder.encode(("external", namespace_id, pool_id, engine_key))
    return _KEYED.copy().update(payload).digest(KEY_BYTES)


def _pools(eng: EngineState, keys: list[ExternalKey]) -> None:
    """Every key names a pool of the engine that the engine allocates itself (a reported pool)."""
    check.count(len(keys), check.MAX_ITEMS_PER_COMMAND, "number of keys")
    # The common case checked in bulk: a command's keys name one or two pools, so each pool is
    # checked once, not once per key. Anything wrong: the key-by-key loop below names the first
    # bad key exactly as it always did.
    pools = eng.pools
    for pool_id in {ref.pool_id for ref in keys}:
        named = pools.get(pool_id)
        if named is None or named.spec.kind == "encoder" or named.spec.managed:
            break
    else:
        if all(0 < len(ref.engine_key) <= MAX_ENGINE_KEY_BYTES for ref in keys):
            return
    for index, ref in enumerate(keys):
        pool: PoolState = check.pool(eng, ref.pool_id)
        if pool.spec.kind == "encoder":
            raise Refusal(Reason.INVALID_ARGUMENT, f"key {index}: pool {ref.pool_id} is an encoder pool")
        if pool.spec.managed:
            raise Refusal(
                Reason.INVALID_ARGUMENT,
                f"key {index}: pool {ref.pool_id} is managed by kvledger; store its blocks with StartStore",
            )
        if not 0 < len(ref.engine_key) <= MAX_ENGINE_KEY_BYTES:
            raise Refusal(
                Reason.INVALID_ARGUMENT, f"key {index} is {len(ref.engine_key)} bytes; an engine key is 1..{MAX_ENGINE_KEY_BYTES}"
            )


# --- lookup ------------------------------------------------------------------------------------


def _lookup_external(state: State, command: LookupExternal) -> list[Event]:
    check.engine_in_step(state, command.engine_id)
    return [answer_lookup(state, command)]


def answer_lookup(state: State, command: LookupExternal, uncommitted: Container[bytes] = frozenset()) -> ExternalKeysLookedUp:
    """Which of the engine's keys are loadable: the answer of a LookupExternal, inside a step or
    outside one (the sidecar's read path, `lookup_keys`). Raises Refusal. A tier key in
    `uncommitted` (changed by a group not yet in the log) is answered as a miss: never a hit the
    log may not keep, and a miss is always safe (the engine computes)."""
    eng = check.engine(state, command.engine_id)
    tier = check.tier(state, eng, command.tier)
    _pools(eng, command.keys)
    loadable = []
    namespace, published, quarantined, namespace_ids = eng.namespace_id, tier.published, tier.quarantined, tier.namespace_ids
    for ref in command.keys:  # TierState.slot_of inlined: once per key of every lookup
        pool_id = ref.pool_id
        key = external_key(namespace, pool_id, ref.engine_key)
        group = published.get(pool_id)
        slot = None if group is None else group.get(key)
        # I9: another namespace's key reads exactly like an absent one.
        loadable.append(
            slot is not None and slot not in quarantined and namespace_ids[slot] == namespace and key not in uncommitted
        )
    return ExternalKeysLookedUp(
        engine_id=eng.engine_id,
        tier=tier.spec.name,
        pool_ids=[k.pool_id for k in command.keys],
        engine_keys=[k.engine_key for k in command.keys],
        loadable=loadable,
    )


# --- store -------------------------------------------------------------------------------------


def _in_flight(state: State, tier: TierState) -> set[tuple[int, bytes]]:
    """(pool, tier key) of every external store in flight to this tier: written, not yet published."""
    return {
        (item.pool_id, item.key)
        for job in state.jobs.values()
        if isinstance(job.decision, ExternalStoreStarted) and job.decision.tier == tier.spec.name
        for item in job.decision.items
    }


def _store_external(state: State, command: StoreExternal) -> list[Event]:
    eng = check.engine_in_step(state, command.engine_id)
    tier = check.tier(state, eng, command.tier)
    _pools(eng, command.keys)
    writing = _in_flight(state, tier)
    to_store: list[tuple[ExternalKey, bytes]] = []
    skipped: list[bytes] = []
    kept: set[tuple[int, bytes]] = set()
    seen: set[tuple[int, bytes]] = set()
    namespace, published = eng.namespace_id, tier.published
    for ref in command.keys:
        pool_id = ref.pool_id
        key = external_key(namespace, pool_id, ref.engine_key)
        place = (pool_id, key)
        group = published.get(pool_id)
        if place in seen or place in writing or (group is not None and key in group):
            skipped.append(ref.engine_key)  # I10: there already, or on its way: an idempotent skip
            kept.add(place)
            continue
        seen.add(place)
        to_store.append((ref, key))
    slots, evictions = reserve_tier_slots(tier, eng, len(to_store), kept)
    job_id = state.next_job_id
    generations = tier.generations
    items = [
        ExternalItem(ref.pool_id, ref.engine_key, key, slot, generations[slot] + 1)
        for (ref, key), slot in zip(to_store, slots, strict=True)
    ]
    events: list[Event] = [*evictions]
    events.append(
        ExternalStoreStarted(
            job_id=job_id,
            engine_id=eng.engine_id,
            incarnation=eng.incarnation,
            tier=tier.spec.name,
            world_size=eng.world_size,
            items=items,
            already_published=skipped,
        )
    )
    if not items:
        events.append(JobSucceeded(job_id=job_id))
    return events


# --- load --------------------------------------------------------------------------------------


def _load_external(state: State, command: LoadExternal) -> list[Event]:
    eng = check.engine_in_step(state, command.engine_id)
    tier = check.tier(state, eng, command.tier)
    _pools(eng, command.keys)
    check.finite(command.lease_seconds, "lease_seconds", high=check.MAX_LEASE_SECONDS)
    if command.lease_seconds <= 0:
        raise Refusal(Reason.INVALID_ARGUMENT, "lease_seconds must be positive")
    items = []
    namespace = eng.namespace_id
    for ref in command.keys:
        key = external_key(namespace, ref.pool_id, ref.engine_key)
        slot = tier.slot_of(ref.pool_id, key)
        if slot is None or tier.namespace_ids[slot] != namespace:
            raise Refusal(
                Reason.KEY_NOT_PUBLISHED,
                f"engine key {ref.engine_key.hex()} of group {ref.pool_id} is not published in tier {tier.spec.name!r}",
            )
        if slot in tier.quarantined:
            raise Refusal(Reason.KEY_QUARANTINED, f"engine key {ref.engine_key.hex()} (tier key {key.hex()}) is quarantined")
        checksums = unpack_checksums(tier.packed_checksums[slot])
        items.append(ExternalItem(ref.pool_id, ref.engine_key, key, slot, tier.generations[slot], checksums))
    return [
        ExternalLoadStarted(
            job_id=state.next_job_id,
            engine_id=eng.engine_id,
            incarnation=eng.incarnation,
            tier=tier.spec.name,
            world_size=eng.world_size,
            items=items,
            lease_expires_at=eng.clock + command.lease_seconds,
        )
    ]


HANDLERS: dict[type[Command], Handler] = {
    LookupExternal: _lookup_external,
    StoreExternal: _store_external,
    LoadExternal: _load_external,
}
