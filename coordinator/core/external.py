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
"""How many engine keys of one namespace and group `tier_keys` remembers the tier key of, at least
(at most twice as many, plus one command's: about 4-8 MiB with vLLM's 36-byte keys). One request's keys are hashed by
its lookup, then again by its load and its store (the sidecar's LookupKeys, then the step): a
blake3 hash costs ~0.5 us in Python, a remembered key ~0.05 us (ops/bench/trace.py spent a sixth
of its time hashing the same keys again)."""

MEMO_PLACES = 4
"""How many (namespace, group) pairs `tier_keys` keeps a memo for; one more clears them all, so
the memos hold at most 2 x MEMO_PLACES x RECENT_EXTERNAL_KEYS keys, and a command's (an engine has a few groups)."""


_KEYED = blake3.blake3(key=KEY_SEED_DIGEST)
"""A hasher keyed by the chain seed and fed nothing: a copy of it is a keyed hasher ~80 ns
sooner than a new one."""


def external_key(namespace_id: bytes, pool_id: int, engine_key: bytes) -> bytes:
    """The tier key of an engine's own block key: blake3 keyed by the chain seed (coordinator.core.keys)
    over ("external", namespace_id, pool_id, engine_key), 16 bytes. The namespace roots it, as it
    roots every content key (I8): the same vLLM hash under another weights revision, tokenizer or
    tenant is another key. The formula, written once; the decider asks `tier_keys`, which hashes
    the same bytes and remembers the recently asked."""
    payload = _encoder.encode(("external", namespace_id, pool_id, engine_key))
    return _KEYED.copy().update(payload).digest(KEY_BYTES)


class _Memo:
    """The tier keys of one namespace and group's recently asked engine keys, in two generations:
    `recent` fills up to RECENT_EXTERNAL_KEYS, then becomes `older` (the older one goes; a
    command's keys go to one generation, so it may hold that many more);
    a key found in `older` moves back to `recent`. A memo of a pure function: what it answers is
    exactly what `external_key` would, so nothing in it can go stale."""

    __slots__ = ("head", "older", "recent")

    def __init__(self, namespace_id: bytes, pool_id: int) -> None:
        # external_key's payload is a msgpack array of four items: its header and the first three
        # items are the same for every key of this namespace and group, so a copy of a hasher fed
        # them hashes a key as external_key does, from the fourth item on.
        head = b"\x94" + _encoder.encode("external") + _encoder.encode(namespace_id) + _encoder.encode(pool_id)
        self.head = _KEYED.copy().update(head)
        self.recent: dict[bytes, bytes] = {}
        self.older: dict[bytes, bytes] = {}

    def keys(self, engine_keys: list[bytes]) -> list[bytes]:
        found = list(map(self.recent.get, engine_keys))  # the common case, in one C loop
        if None in found:
            self._fill(engine_keys, found)
        return found  # type: ignore[return-value]  # no None left: _fill filled each

    def _fill(self, engine_keys: list[bytes], found: list[bytes | None]) -> None:
        missing = [index for index, key in enumerate(found) if key is None]
        if len(self.recent) + len(missing) > RECENT_EXTERNAL_KEYS:
            # A new generation before the batch, not in the middle of it: the memo's size is
            # checked once a command, not once a key.
            self.older, self.recent = self.recent, {}
        recent, older, head, encode = self.recent, self.older, self.head, _encoder.encode
        for index in missing:
            engine_key = engine_keys[index]
            key = older.get(engine_key)  # (a key twice in one command is hashed twice: same answer)
            if key is None:
                key = head.copy().update(encode(engine_key)).digest(KEY_BYTES)
            found[index] = recent[engine_key] = key


_MEMOS: dict[tuple[bytes, int], _Memo] = {}


def _memo(namespace_id: bytes, pool_id: int) -> _Memo:
    memo = _MEMOS.get((namespace_id, pool_id))
    if memo is None:
        if len(_MEMOS) >= MEMO_PLACES:
            _MEMOS.clear()
        memo = _MEMOS[namespace_id, pool_id] = _Memo(namespace_id, pool_id)
    return memo


def tier_keys(namespace_id: bytes, pool_ids: list[int], engine_keys: list[bytes]) -> list[bytes]:
    """`external_key` of each (pool_id, engine_key) pair of the columns, remembered (`_Memo`)."""
    group = _one_group(pool_ids)
    if group is not None:  # the common case: a command's keys are of one group
        return _memo(namespace_id, group).keys(engine_keys)
    return [_memo(namespace_id, pool_id).keys([key])[0] for pool_id, key in zip(pool_ids, engine_keys, strict=True)]


def _one_group(pool_ids: list[int]) -> int | None:
    """The one pool id every item names, or None (none, or several)."""
    if not pool_ids:
        return None
    first = pool_ids[0]
    return first if pool_ids.count(first) == len(pool_ids) else None


def _columns(eng: EngineState, keys: list[ExternalKey]) -> tuple[list[int], list[bytes]]:
    """The keys' pool ids and engine keys, once every key is checked to name a pool of the engine
    that the engine allocates itself (a reported pool) and to be 1..MAX_ENGINE_KEY_BYTES long."""
    check.count(len(keys), check.MAX_ITEMS_PER_COMMAND, "number of keys")
    pool_ids, engine_keys = [ref.pool_id for ref in keys], [ref.engine_key for ref in keys]
    # The common case checked in bulk: a command's keys name one or two pools, so each pool is
    # checked once, not once per key. Anything wrong: the key-by-key loop below names the first
    # bad key exactly as it always did.
    pools = eng.pools
    for pool_id in set(pool_ids):
        named = pools.get(pool_id)
        if named is None or named.spec.kind == "encoder" or named.spec.managed:
            break
    else:
        lengths = set(map(len, engine_keys))  # a command's keys have one length or a few: one C loop
        if 0 < min(lengths) and max(lengths) <= MAX_ENGINE_KEY_BYTES:
            return pool_ids, engine_keys
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
    raise AssertionError("the bulk check refused what the key-by-key check accepts")  # pragma: no cover


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
    pool_ids, engine_keys = _columns(eng, command.keys)
    namespace = eng.namespace_id
    keys = tier_keys(namespace, pool_ids, engine_keys)
    quarantined, namespace_ids = tier.quarantined, tier.namespace_ids
    # I9: another namespace's key reads exactly like an absent one.
    loadable = [
        slot is not None and slot not in quarantined and namespace_ids[slot] == namespace and key not in uncommitted
        for slot, key in zip(_slots(tier, pool_ids, keys), keys, strict=True)
    ]
    return ExternalKeysLookedUp(
        engine_id=eng.engine_id, tier=tier.spec.name, pool_ids=pool_ids, engine_keys=engine_keys, loadable=loadable
    )


_NOTHING: dict[bytes, int] = {}
"""A group with no published key (never written to)."""


def _slots(tier: TierState, pool_ids: list[int], keys: list[bytes]) -> list[int | None]:
    """The slot each tier key of the columns is published in, or None (TierState.slot_of of each)."""
    published = tier.published
    group = _one_group(pool_ids)
    if group is not None:  # one group, one C loop
        return list(map(published.get(group, _NOTHING).get, keys))
    return [tier.slot_of(pool_id, key) for pool_id, key in zip(pool_ids, keys, strict=True)]


# --- store -------------------------------------------------------------------------------------


def _in_flight(state: State, tier: TierState) -> set[tuple[int, bytes]]:
    """(pool, tier key) of every external store in flight to this tier: written, not yet published."""
    return {
        (item.pool_id, item.key)
        for job in state.jobs.values()
        if isinstance(job.decision, ExternalStoreStarted) and job.decision.tier == tier.spec.name
        for item in job.decision.items
    }


def _admitted(
    state: State, tier: TierState, pool_ids: list[int], engine_keys: list[bytes], keys: list[bytes]
) -> tuple[list[int], list[bytes], set[int]]:
    """Which of a store's keys get a slot (their indices), and which it skips (I10: published
    already, on their way in a store in flight, or twice in the command: an idempotent skip):
    their engine keys, and the slots of those published, which eviction must keep (a key in
    flight or twice in the command is not published, so never a candidate for eviction)."""
    slots = _slots(tier, pool_ids, keys)
    group = _one_group(pool_ids)
    writing = _in_flight(state, tier)
    if group is not None and not writing and len(set(keys)) == len(keys):
        # The common case, in C loops: one group, nothing in flight, no key twice.
        to_store = [index for index, slot in enumerate(slots) if slot is None]
        if len(to_store) == len(keys):
            return to_store, [], set()
        published = [index for index, slot in enumerate(slots) if slot is not None]
        published_slots = set(slots)
        published_slots.discard(None)
        return to_store, [engine_keys[index] for index in published], published_slots  # type: ignore[return-value]  # no None left
    to_store = []
    skipped: list[bytes] = []
    kept: set[int] = set()
    seen: set[tuple[int, bytes]] = set()
    for index, (pool_id, key, slot) in enumerate(zip(pool_ids, keys, slots, strict=True)):
        place = (pool_id, key)
        if slot is not None or place in seen or place in writing:
            skipped.append(engine_keys[index])
            if slot is not None:
                kept.add(slot)
            continue
        seen.add(place)
        to_store.append(index)
    return to_store, skipped, kept


def _store_external(state: State, command: StoreExternal) -> list[Event]:
    eng = check.engine_in_step(state, command.engine_id)
    check.room_for_a_job(state, eng, len(command.keys))
    tier = check.tier(state, eng, command.tier)
    pool_ids, engine_keys = _columns(eng, command.keys)
    keys = tier_keys(eng.namespace_id, pool_ids, engine_keys)
    to_store, skipped, kept = _admitted(state, tier, pool_ids, engine_keys, keys)
    slots, evictions = reserve_tier_slots(state, tier, eng, len(to_store), kept)
    job_id = state.next_job_id
    generations = tier.generations
    items = [
        ExternalItem(pool_ids[index], engine_keys[index], keys[index], slot, generations[slot] + 1)
        for index, slot in zip(to_store, slots, strict=True)
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
    check.room_for_a_job(state, eng, len(command.keys))
    tier = check.tier(state, eng, command.tier)
    pool_ids, engine_keys = _columns(eng, command.keys)
    check.finite(command.lease_seconds, "lease_seconds", high=check.MAX_LEASE_SECONDS)
    if command.lease_seconds <= 0:
        raise Refusal(Reason.INVALID_ARGUMENT, "lease_seconds must be positive")
    items = []
    namespace = eng.namespace_id
    keys = tier_keys(namespace, pool_ids, engine_keys)
    namespace_ids, quarantined, packed, generations = (
        tier.namespace_ids,
        tier.quarantined,
        tier.packed_checksums,
        tier.generations,
    )
    for pool_id, engine_key, key, slot in zip(pool_ids, engine_keys, keys, _slots(tier, pool_ids, keys), strict=True):
        if slot is None or namespace_ids[slot] != namespace:
            raise Refusal(
                Reason.KEY_NOT_PUBLISHED,
                f"engine key {engine_key.hex()} of group {pool_id} is not published in tier {tier.spec.name!r}",
            )
        if slot in quarantined:
            raise Refusal(Reason.KEY_QUARANTINED, f"engine key {engine_key.hex()} (tier key {key.hex()}) is quarantined")
        items.append(ExternalItem(pool_id, engine_key, key, slot, generations[slot], unpack_checksums(packed[slot])))
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
