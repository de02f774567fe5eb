"""What the audit answers (coordinator/audit/queries.py asks the index): the answer structs the
CLI prints and the HTTP API serves, and the errors a question can meet."""

from __future__ import annotations

from typing import Any

import msgspec


class AuditError(Exception):
    """A question the index cannot answer as asked (unknown engine, step, key...)."""


class NotFound(AuditError):
    pass


class OutOfScope(AuditError):
    """The data belongs to a tenant the caller may not see."""


# --- answers ------------------------------------------------------------------------------------


class Point(msgspec.Struct, frozen=True):
    seq: int
    step: int
    """The engine's step at that sequence (-1 before its first step)."""
    recorded_at: float


class SlotEvent(msgspec.Struct, frozen=True):
    seq: int
    kind: str
    owner_id: int | None
    job_id: int | None
    key: str | None


class JobTouch(msgspec.Struct, frozen=True):
    job_id: int
    kind: str
    """store, load or copy."""
    started_seq: int
    ended_seq: int | None
    outcome: str
    """succeeded, failed: <reason>, fenced, or in flight."""
    pinned_then: bool
    """Whether the job held its pin on the slot at the asked point (I3): in flight then, and
    decided with its pin (a store decided without one, in a simulator run with the PINS
    protection off, never pinned)."""


class OwnerLife(msgspec.Struct, frozen=True):
    engine: str
    owner_id: int
    req_id: str
    started_seq: int
    finished_seq: int | None
    finished_reason: str
    resumed: bool
    blocks: list[str] = []
    """pool/block@generation of each allocation and reuse it made."""


class GenerationLife(msgspec.Struct, frozen=True):
    generation: int
    owner_id: int | None
    req_id: str
    allocated_seq: int
    allocated_step: int
    freed_seq: int | None
    freed_step: int | None
    ended_by: str
    """freed, reallocated (its freed notice was dropped: allocated again in that step), reset (the
    engine's incarnation ended), or open."""


class BlockAnswer(msgspec.Struct, frozen=True, kw_only=True):
    engine: str
    pool: int
    block: int
    tenant: str
    at: Point
    status: str
    """held, free (its last generation was freed by then) or never_allocated."""
    generation: GenerationLife | None
    owner: OwnerLife | None
    jobs: list[JobTouch]
    events: list[SlotEvent]
    """Everything recorded about that generation, before and after the point."""


class HistoryAnswer(msgspec.Struct, frozen=True, kw_only=True):
    engine: str
    pool: int
    block: int
    tenant: str
    generations: list[GenerationLife]
    """The newest LIST_LIMIT generations, oldest first (a tenant sees only those allocated under
    its own declarations of the engine)."""
    generations_total: int = 0


class Publication(msgspec.Struct, frozen=True):
    seq: int
    tier: str
    tier_slot: int | None
    size_bytes: int | None
    source_job: int | None
    source: str
    """engine pool/block@generation the job stored it from."""
    checksums: list[str]
    """Each rank's checksum (hex), in rank order."""


class KeyLoad(msgspec.Struct, frozen=True):
    seq: int
    engine: str
    job_id: int | None
    dest: str
    outcome: str


class KeyAnswer(msgspec.Struct, frozen=True, kw_only=True):
    key: str
    namespace_id: str
    tenant: str
    model_id: str
    computed: list[str]
    """engine pool/block@generation where it was computed, with the sequence."""
    publications: list[Publication]
    loads: list[KeyLoad]
    evictions: list[int]
    quarantines: list[str]
    counts: dict[str, int] = {}
    """How many rows of each kind the key has (computed, stored, published, loaded, evicted,
    quarantined): each list above holds the newest LIST_LIMIT of its kind, oldest first."""


class RequestAnswer(msgspec.Struct, frozen=True, kw_only=True):
    req_id: str
    owners: list[OwnerLife]
    """The newest LIST_LIMIT owner lifetimes, oldest first; `owners_total` counts them all."""
    owners_total: int = 0


class RefusalEntry(msgspec.Struct, frozen=True):
    seq: int
    step: int
    recorded_at: float
    engine: str
    kind: str
    subject: str
    reason: str
    detail: str


class DecisionEntry(msgspec.Struct, frozen=True):
    """A namespace release decision (seed 003) or a release of an abandoned namespace."""

    seq: int
    recorded_at: float | None
    outcome: str
    """new, compatible, clear, or released (`kvledger namespace gc`)."""
    from_namespace: str
    to_namespace: str | None
    """None for a release."""
    tenant: str
    affected_keys: int
    """Keys a clear quarantined or a release evicted."""
    evidence: str
    """A compatible decision's verification run."""
    reason: str


class NamespaceEntry(msgspec.Struct, frozen=True):
    namespace_id: str
    tenant: str
    model_id: str
    spec: dict[str, Any]
    keys: int
    """Keys published and not evicted since."""
    bytes: int
    first_published_at: float | None
    last_used_at: float | None
    """The last publication or load of one of its keys."""
    age_seconds: float | None
    decisions: list[DecisionEntry] = []
    """Release decisions from or to this namespace, and its releases, oldest first."""


class ObservedEvent(msgspec.Struct, frozen=True):
    """One thing an observed engine said of a block hash (stored, removed), or did to all of a
    medium's (cleared), or a restart that ended its incarnation's cache."""

    seq: int
    """kvledger's global sequence."""
    kind: str
    """stored, removed, cleared or restarted."""
    engine: str
    incarnation: int
    medium: str
    group: int | None
    """The engine's KV-cache group; None for a clear or a restart (all groups)."""
    dp_rank: int | None
    source_seq: int | None
    """The engine's own batch number (vLLM's sequence number); None for a restart."""


class ObservedResidency(msgspec.Struct, frozen=True):
    """One stay of a block hash in one engine incarnation's medium and group."""

    engine: str
    incarnation: int
    medium: str
    group: int
    dp_rank: int | None
    stored_seq: int
    stored_source_seq: int
    ended_seq: int | None
    ended_source_seq: int | None
    ended_by: str
    """removed, cleared, restarted (a new incarnation began), or stored (still there)."""


class ObservedHashAnswer(msgspec.Struct, frozen=True, kw_only=True):
    hash: str
    tenant: str
    residencies: list[ObservedResidency]
    events: list[ObservedEvent]
    """The hash's newest LIST_LIMIT rows (oldest first), with the clears and restarts among them."""
    total: int
    """Every stored and removed row of the hash."""
    gaps: list[str] = []
    """Batches the engines' incarnations in `residencies` missed (a removal may lie in one)."""
