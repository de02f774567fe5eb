"""Why a command was refused, a notice dropped, a job failed or a key quarantined."""

from __future__ import annotations

import enum


class Reason(enum.StrEnum):
    """Stable reason codes. Values are part of the log format: add, never rename."""

    # bad input
    UNKNOWN_ENGINE = "unknown_engine"
    UNKNOWN_POOL = "unknown_pool"
    UNKNOWN_SLOT = "unknown_slot"
    UNKNOWN_OWNER = "unknown_owner"
    UNKNOWN_TIER = "unknown_tier"
    UNKNOWN_JOB = "unknown_job"
    INVALID_COUNT = "invalid_count"
    INVALID_ARGUMENT = "invalid_argument"
    RANK_OUT_OF_RANGE = "rank_out_of_range"
    NO_OPEN_STEP = "no_open_step"
    STEP_ALREADY_OPEN = "step_already_open"
    STEP_NOT_ADVANCING = "step_not_advancing"
    CLOCK_REGRESSED = "clock_regressed"
    STEP_JUMP = "step_jump"  # a step number or clock that leaps past its bound (coordinator/core/checks.py)
    NAMESPACE_MISMATCH = "namespace_mismatch"
    POOL_LAYOUT_CHANGED = "pool_layout_changed"
    TIER_SPEC_CHANGED = "tier_spec_changed"
    UNKNOWN_NAMESPACE = "unknown_namespace"
    MISSING_EVIDENCE = "missing_evidence"  # a `compatible` release decision names no verification run (seed 003)
    # safety (the invariants)
    STALE_GENERATION = "stale_generation"  # I1
    NULL_BLOCK = "null_block"  # I2
    SLOT_PINNED = "slot_pinned"  # I3
    SLOT_IN_USE = "slot_in_use"
    NOT_OWNER = "not_owner"
    ALREADY_HELD = "already_held"
    STALE_JOB = "stale_job"  # I4 / I16: finished or fenced
    DUPLICATE_REPORT = "duplicate_report"  # I4
    CONFLICTING_REPORT = "conflicting_report"  # I4
    FOREIGN_JOB = "foreign_job"  # I4 / I9: a rank's report on another engine's job
    RANK_FAILED = "rank_failed"  # I5
    MISSING_CHECKSUM = "missing_checksum"  # I5 / I11
    NOT_COMPUTED = "not_computed"  # I17
    ALREADY_COMPUTED = "already_computed"
    KEY_NOT_PUBLISHED = "key_not_published"  # I6 / I9: also said for another tenant's key
    KEY_QUARANTINED = "key_quarantined"  # I10 / I13
    CHECKSUM_MISMATCH = "checksum_mismatch"  # I10 / I13
    LEASE_EXPIRED = "lease_expired"  # I12
    KEY_EVICTED = "key_evicted"  # I12
    OBJECT_LOST = "object_lost"  # I13: a tier (Mooncake's) lost a published key's bytes on its own
    TIER_FULL = "tier_full"  # I12
    POOL_EXHAUSTED = "pool_exhausted"
    ENCODER_CACHE_FULL = "encoder_cache_full"
    TOO_MANY_JOBS = "too_many_jobs"  # an engine's jobs in flight, fenced ones too, are at their bound
    OUT_OF_BOUNDS = "out_of_bounds"  # I15
    OVERLAPPING_DESTINATIONS = "overlapping_destinations"  # I15
    REALLOCATED_IN_STEP = "reallocated_in_step"  # I14
    ENGINE_RESET = "engine_reset"  # I16
    CROSS_TENANT = "cross_tenant"  # I9: a release decision never relates two tenants' namespaces
    NAMESPACE_IN_USE = "namespace_in_use"  # I12: a release never evicts a key a load holds
    NAMESPACE_CLEARED = "namespace_cleared"  # seed 003: a deliberate cache clearing quarantines its keys
    # observed engines (vLLM's KV events, coordinator/core/observe.py)
    MALFORMED_EVENT = "malformed_event"  # a frame or an event that could not be decoded
    UNKNOWN_EVENT_TYPE = "unknown_event_type"  # an event type this kvledger does not know
    BROKEN_PARENT_CHAIN = "broken_parent_chain"  # a block stored under a parent that is not stored
    UNKNOWN_BLOCK_HASH = "unknown_block_hash"  # a removal of a hash that is not stored
    DUPLICATE_BATCH = "duplicate_batch"  # a batch at or below the last one recorded
