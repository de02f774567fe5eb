"""Protection switches, for the simulator's fault scenarios only.

Every protection is on in production: `kvledger serve` refuses to start with any of them off.
The simulator (coordinator/simulator) switches exactly one off to reproduce the naive behaviour
of the systems in ../shared/seeds/ in the same code path, so a scenario's "off" run shows the
wrong-KV reads that the "on" run prevents.

Some protections are layered: leases (I12) keep a tier slot from being reused under a load, and
checksums (I13) catch a load that read a reused slot anyway. With either one on, a slot reused
under a slow load is a loud failure, never a wrong read. Seed 002 finds the silent channel only
where both are down: Mooncake's offload read path has no master read-lease check, and the object
CRC behind MOONCAKE_STORE_CHECKSUM is off by default. A scenario may therefore name a *baseline*
(`Scenario.baseline`): protections switched off in both of its runs to reproduce the seed's
deployment, so that the on/off comparison still toggles exactly one protection.

The switch travels as a context variable that `CoordinatorCore` sets around each decision and
the worker reads: the decider's signature stays `decide(state, command)`. Pure: no I/O.
"""

from __future__ import annotations

import enum
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar


class Protection(enum.StrEnum):
    """One protection each; the value is the first scenario that switches it off (the seeds',
    coordinator/simulator/scenarios.py, or a failure users reported, reported.py). A reported
    failure may switch off a protection an earlier scenario already shows: the same guard, met
    another way."""

    PINS = "preempt-during-async-store"
    """I3: a slot with a store in flight is pinned. Off: it can be reallocated under the store."""
    NAMESPACE_WEIGHTS = "weights-revision-change-under-same-model-name"
    """Namespaces include the weights revision. Off: two checkpoints of one model share keys."""
    NAMESPACE_TENANT = "cross-tenant-prefix"
    """I9: namespaces include the tenant. Off: one tenant's prefix is another's hit."""
    LOAD_DEDUPE = "duplicate-keys-in-batch-load"
    """I11: every destination of a repeated key is filled and verified. Off (worker): only the
    first is, and the read's checksum is reported for all."""
    JOB_IDENTITY = "req-id-reuse-after-preemption"
    """I4: owners and jobs are accounted by id, never by req_id. Off: a late notice for a
    preempted attempt lands on the resumed request that reuses its req_id."""
    FENCING = "reset-with-late-completions"
    """I16: a reset fences the old incarnation's jobs; their late reports are dropped. Off: a
    store that completes after the reset publishes what the recycled slots hold by then."""
    END_OF_STEP = "stale-encoder-eviction"
    """I14: notices describe the end of the step; a freed notice for an encoder entry allocated
    again in the same step is dropped. Off: the consumer evicts the new entry."""
    IDEMPOTENT_STORE = "duplicate-offload-with-different-bytes"
    """I10: a re-store of a published key with other bytes quarantines it. Off: the last store
    wins, and its bytes are served."""
    VISIBLE_WHEN_COMPLETE = "load-before-compute-complete"
    """I17: a block whose load or compute is not complete is no one's hit. Off: another request
    may take a ref on it and read it early."""
    WHOLE_UNITS = "partial-hash-hit"
    """I7: a hit is a whole reuse unit (the LCM of the groups' block sizes). Off: the finest
    group's blocks define the boundary, and a coarser group resumes from a state that does not
    end there (seed 002: 64-token hash hits on 1152-token blocks)."""
    NULL_STATES = "null-state-publication"
    """I2: the null block is never computed, stored or published. Off: a state group's skipped
    positions (the null block, seed 004) get keys and their zeros are published."""
    ORDERED_COPIES = "overlapping-state-copy"
    """I15: state copies keep parallel-assignment meaning. Off: moves run one by one, in the
    order given, each reading what earlier ones wrote."""
    LEASES = "lease-expiry-during-slow-load"
    """I12: eviction skips keys with a live lease; a load that completes after its lease expired
    fails (LEASE_EXPIRED), and so does one whose key left the tier or moved (KEY_EVICTED). Off
    (seed 002's offload read path, no lease check): eviction ignores leases, and a late load of
    a key that is gone counts as success. Its scenario runs with CHECKSUMS off in both runs."""
    CHECKSUMS = "eviction-under-store-pressure"
    """I13: a worker checks what it read against the published checksum before copying it, and
    the coordinator compares the checksums reported with the published ones; a mismatch fails
    the load (and quarantines the key while it is still published). Off (MOONCAKE_STORE_CHECKSUM
    unset, seed 002): neither. Its scenario runs with LEASES off in both runs."""
    STORE_FENCE = "store-reported-before-copy-fence"
    """I5: a rank reports a store only once its copy landed (the transfer stream synchronized),
    with the checksum of the bytes written. Off (vLLM #45704, #46278, #47282): the report goes out
    when the copy is queued, with the source block's checksum; the copy runs when the worker
    next acts, reading whatever the source block holds by then."""
    TIER_RESET = "reset-keeps-offloaded-blocks"
    """A reset that reaches the tier (ResetCache.drop_tier_keys) ends every key of the engine's
    namespace there. Off (vLLM #57727): the reset succeeds and the tier keeps serving the old
    blocks."""
    NAMESPACE_PARALLEL = "parallel-layouts-share-keys"
    """I9: namespaces include the parallel layout (TP/PP sizes, kv_rank_layout) unless the engine
    says its blocks do not depend on it. Off (vLLM #56772): TP1 and TP2 engines share keys whose
    bytes are laid out differently."""
    NAMESPACE_LAYOUT = "packed-layout-missing-from-identity"
    """I9: namespaces include the KV layout version and dtype. Off (LMCache #4463, #4247; Dynamo
    #14416): a new packed layout is missing from the cache identity, and old bytes are read as
    the new layout."""
    FULL_WIDTH_EXTRAS = "truncated-multimodal-hash"
    """I8: a content key covers its extra keys (multimodal hashes, salts) whole. Off (LMCache
    #4086): each extra key counts by its first 16 bits, so two images that share them share keys."""
    LOST_OBJECTS = "mooncake-silent-eviction"
    """I13: a tier read that finds a key's bytes gone (missing, empty or short) fails the load, and
    the key leaves the tier (ReportRank.lost). Off (a connector that copies what a Mooncake get
    returned, nothing once the store evicted the object): the destination keeps what it held and
    the load counts as success. Its scenario needs a Mooncake Store (tests/gpu/test_mooncake_tier.py)
    and runs with CHECKSUMS off (with them, the empty read differs from the published checksum)."""
    OBJECT_GENERATIONS = "mooncake-duplicate-put-keeps-first-value"
    """I1 on a shared store: a Mooncake object's name holds the tier slot's generation and the
    key (gpu.mooncake.MooncakeTier), so a slot given to another key is a new object. Off (a
    connector that names objects by where they live, tier slot and rank, like a segment offset):
    the new key's put of the old name returns 0 and Mooncake keeps the old key's bytes, served
    under the new key's published checksum. Needs a Mooncake Store; runs with CHECKSUMS off."""
    PUBLISH_WHEN_COMPLETE = "exists-without-value"
    """I5: a key is published when every rank's store reported success, with their checksums.
    Off (Mooncake #1374, #2827): it exists from the store's start (put_start), without checksums;
    a duplicate put of it is skipped, and a store that then fails leaves it existing with no
    value."""


ALL = frozenset(Protection)

_off: ContextVar[frozenset[Protection]] = ContextVar("kvledger_protections_off", default=frozenset())


def is_off(protection: Protection) -> bool:
    return protection in _off.get()


@contextmanager
def switched_off(off: frozenset[Protection]) -> Iterator[None]:
    """Run the block with these protections off (nothing, the production case, when empty)."""
    token = _off.set(off)
    try:
        yield
    finally:
        _off.reset(token)
