"""The audit index projection: committed events -> insert-only rows for forensics. Pure.

Every row names the global sequence of the event it came from, so "what held this slot at
sequence N" is a range scan over an index ("the last allocation of the slot at or before N"),
never a replay. Rows are only ever inserted: a lifetime's end is a row of its own (`freed`,
`finished`, `evicted`), which is what makes indexing resumable from a checkpoint and its writes
cheap. The tables are declared in events/log/schema.py (kvl_audit_*); coordinator/audit/store.py
writes these rows and answers the queries.

The only memory the projection keeps is each engine's namespace (from its declarations), so that
computed, stored and loaded keys carry their namespace; `Indexer(namespaces=...)` restores it
from the index when indexing resumes.
"""

from __future__ import annotations

from collections.abc import Sequence

import msgspec

from events import (
    BlocksAllocated,
    BlocksComputed,
    BlocksReleased,
    BlocksReused,
    EngineDeclared,
    EngineObserved,
    EngineReset,
    Event,
    ExternalLoadStarted,
    ExternalStoreStarted,
    FencedRankDone,
    FencedRankReleased,
    JobFailed,
    JobFenced,
    JobSucceeded,
    KeyEvicted,
    KeyPublished,
    KeyQuarantined,
    LoadJobStarted,
    NamespaceDecided,
    NamespaceRegistered,
    NamespaceReleased,
    NoticeDropped,
    ObservedBlocksRemoved,
    ObservedBlocksStored,
    ObservedCacheCleared,
    ObservedEventsMissed,
    OwnerFinished,
    OwnerStarted,
    RankReported,
    Refused,
    StateCopyPlanned,
    StepEnded,
    StoreJobStarted,
)

# Row tuples, in the column order of their tables (events/log/schema.py).
SlotRow = tuple[str, int, int, int, int, str, int | None, int | None, bytes | None]
"""engine, pool, block, generation, seq, kind, owner_id, job_id, key"""
OwnerRow = tuple[str, int, str, int, str, str]
"""engine, owner_id, req_id, seq, kind, detail"""
JobRow = tuple[int, str, int, str, int | None, str]
"""job_id, engine, seq, kind, rank, detail"""
KeyRow = tuple[bytes, int, str, str, str, int, bytes | None, int | None, int | None, int | None, int | None, int | None, str, str]
"""key, seq, kind, engine, tier, pool, namespace_id, job_id, block, generation, tier_slot, size_bytes, checksums, detail"""
RefusalRow = tuple[int, str, str, str, str, str]
"""seq, engine, kind, subject, reason, detail"""
EngineRow = tuple[str, int, bytes | None, int, str, str]
"""engine, incarnation, namespace_id, seq, kind, detail"""
NamespaceRow = tuple[bytes, str, str, str, int]
"""namespace_id, tenant, model_id, spec (JSON), seq"""
StepRow = tuple[str, int, int, int, float]
"""engine, step (-1 for an append outside a step: a worker's report, a reset), first_seq, last_seq,
recorded_at"""
DecisionRow = tuple[int, str, bytes, bytes | None, int, str, str]
"""seq, outcome (new, compatible, clear or released), from_namespace, to_namespace, affected_keys,
evidence, reason"""
ObservedRow = tuple[bytes, int, str, str, int, str, int, int | None, int]
"""hash (empty for cleared), seq, kind (stored, removed, cleared), engine, incarnation, medium, group
(-1 for cleared), dp_rank, source_seq"""


class AuditRows(msgspec.Struct, kw_only=True):
    slots: list[SlotRow] = msgspec.field(default_factory=list)
    owners: list[OwnerRow] = msgspec.field(default_factory=list)
    jobs: list[JobRow] = msgspec.field(default_factory=list)
    keys: list[KeyRow] = msgspec.field(default_factory=list)
    refusals: list[RefusalRow] = msgspec.field(default_factory=list)
    engines: list[EngineRow] = msgspec.field(default_factory=list)
    namespaces: list[NamespaceRow] = msgspec.field(default_factory=list)
    steps: list[StepRow] = msgspec.field(default_factory=list)
    decisions: list[DecisionRow] = msgspec.field(default_factory=list)
    observed: list[ObservedRow] = msgspec.field(default_factory=list)

    def count(self) -> int:
        return sum(len(rows) for rows in msgspec.structs.astuple(self))


def engine_of_stream(stream_id: str) -> str:
    """Engine streams are "engine/<id>"; other streams (tiers) keep their whole id."""
    return stream_id.removeprefix("engine/")


def checksums_text(checksums: Sequence[bytes]) -> str:
    """Each rank's checksum in hex, comma-separated in rank order."""
    return ",".join(c.hex() for c in checksums)


class Indexer:
    """Folds committed steps into AuditRows. Feed steps in log order, each once."""

    def __init__(self, namespaces: dict[str, bytes] | None = None) -> None:
        self.namespaces: dict[str, bytes] = dict(namespaces or {})
        """engine id -> its current namespace id."""

    def step(
        self,
        rows: AuditRows,
        events: Sequence[Event],
        *,
        first_seq: int,
        last_seq: int,
        stream_id: str,
        step: int,
        recorded_at: float,
    ) -> None:
        """Add the rows of one stored step's events; `first_seq` is the first event's sequence
        (the events may be a tail of the step: then pass the tail's first sequence)."""
        engine = engine_of_stream(stream_id)
        rows.steps.append((engine, step, first_seq, last_seq, recorded_at))  # every append: its time
        for offset, event in enumerate(events):
            self.event(rows, event, first_seq + offset, engine)

    def event(self, rows: AuditRows, event: Event, seq: int, engine: str) -> None:  # noqa: C901 - one case per event type
        """Add the rows of one event at global sequence `seq`, from `engine`'s stream."""
        match event:
            case BlocksAllocated(owner_id=owner, blocks=blocks):
                rows.slots += [(engine, b.pool_id, b.block_id, b.generation, seq, "allocated", owner, None, None) for b in blocks]
            case BlocksReused(owner_id=owner, blocks=blocks):
                rows.slots += [(engine, b.pool_id, b.block_id, b.generation, seq, "reused", owner, None, None) for b in blocks]
            case BlocksReleased(owner_id=owner, blocks=blocks):
                rows.slots += [(engine, b.pool_id, b.block_id, b.generation, seq, "released", owner, None, None) for b in blocks]
            case StepEnded(freed_blocks=freed):
                rows.slots += [(engine, b.pool_id, b.block_id, b.generation, seq, "freed", None, None, None) for b in freed]
            case BlocksComputed(blocks=computed):
                namespace = self.namespaces.get(engine)
                for c in computed:
                    b = c.block
                    rows.slots.append((engine, b.pool_id, b.block_id, b.generation, seq, "computed", None, None, c.key))
                    rows.keys.append(
                        (
                            c.key,
                            seq,
                            "computed",
                            engine,
                            "",
                            b.pool_id,
                            namespace,
                            None,
                            b.block_id,
                            b.generation,
                            None,
                            None,
                            "",
                            "",
                        )
                    )
            case StoreJobStarted(job_id=job, tier=tier, items=items, already_published=skipped, pinned=pinned):
                namespace = self.namespaces.get(engine)
                rows.jobs.append(
                    (
                        job,
                        engine,
                        seq,
                        "store",
                        None,
                        f"tier {tier}: {len(items)} keys, {len(skipped)} already published{'' if pinned else ', NOT pinned'}",
                    )
                )
                for item in items:
                    s = item.source
                    rows.slots.append((engine, s.pool_id, s.block_id, s.generation, seq, "stored_from", None, job, item.key))
                    rows.keys.append(
                        (
                            item.key,
                            seq,
                            "stored",
                            engine,
                            tier,
                            s.pool_id,
                            namespace,
                            job,
                            s.block_id,
                            s.generation,
                            item.tier_slot,
                            None,
                            "",
                            "",
                        )
                    )
            case LoadJobStarted(job_id=job, tier=tier, items=items, lease_expires_at=expiry):
                namespace = self.namespaces.get(engine)
                rows.jobs.append((job, engine, seq, "load", None, f"tier {tier}: {len(items)} items, lease to t={expiry:g}"))
                for load in items:
                    d = load.dest
                    rows.slots.append((engine, d.pool_id, d.block_id, d.generation, seq, "loaded_into", None, job, load.key))
                    rows.keys.append(
                        (
                            load.key,
                            seq,
                            "loaded",
                            engine,
                            tier,
                            d.pool_id,
                            namespace,
                            job,
                            d.block_id,
                            d.generation,
                            load.tier_slot,
                            None,
                            checksums_text(load.checksums),
                            "",
                        )
                    )
            case ExternalStoreStarted(job_id=job, tier=tier, items=ext_items, already_published=skipped):
                # An engine that owns its device blocks (vLLM's offloading): no slot of kvledger's.
                namespace = self.namespaces.get(engine)
                rows.jobs.append(
                    (
                        job,
                        engine,
                        seq,
                        "store",
                        None,
                        f"tier {tier}: {len(ext_items)} external keys, {len(skipped)} already published",
                    )
                )
                for ext in ext_items:
                    rows.keys.append(
                        (
                            ext.key,
                            seq,
                            "stored",
                            engine,
                            tier,
                            ext.pool_id,
                            namespace,
                            job,
                            None,
                            None,
                            ext.tier_slot,
                            None,
                            "",
                            f"engine key {ext.engine_key.hex()}",
                        )
                    )
            case ExternalLoadStarted(job_id=job, tier=tier, items=ext_items, lease_expires_at=expiry):
                namespace = self.namespaces.get(engine)
                rows.jobs.append(
                    (job, engine, seq, "load", None, f"tier {tier}: {len(ext_items)} external keys, lease to t={expiry:g}")
                )
                for ext in ext_items:
                    rows.keys.append(
                        (
                            ext.key,
                            seq,
                            "loaded",
                            engine,
                            tier,
                            ext.pool_id,
                            namespace,
                            job,
                            None,
                            None,
                            ext.tier_slot,
                            None,
                            checksums_text(ext.checksums),
                            f"engine key {ext.engine_key.hex()}",
                        )
                    )
            case StateCopyPlanned(job_id=job, pool_id=pool, blocks=blocks, batches=batches):
                rows.jobs.append(
                    (job, engine, seq, "copy", None, f"pool {pool}: {sum(map(len, batches))} moves in {len(batches)} batches")
                )
                rows.slots += [(engine, b.pool_id, b.block_id, b.generation, seq, "copied", None, job, None) for b in blocks]
            case RankReported(job_id=job, rank=rank, ok=ok, error=error):
                rows.jobs.append((job, engine, seq, "reported", rank, "ok" if ok else f"failed: {error}"))
            case JobSucceeded(job_id=job):
                rows.jobs.append((job, engine, seq, "succeeded", None, ""))
            case JobFailed(job_id=job, reason=reason, detail=detail):
                rows.jobs.append((job, engine, seq, "failed", None, f"{reason}: {detail}"))
                rows.refusals.append((seq, engine, "job_failed", f"job {job}", str(reason), detail))
            case JobFenced(job_id=job, pending=pending):
                rows.jobs.append((job, engine, seq, "fenced", None, f"ranks pending: {pending}" if pending else ""))
            case FencedRankReleased(rank=rank, job_ids=released, reason=reason):
                rows.jobs += [
                    (job, engine, seq, "released", rank, f"the rank's worker is gone (an operator): {reason}") for job in released
                ]
            case FencedRankDone(job_id=job, rank=rank):
                rows.jobs.append((job, engine, seq, "fenced_rank_done", rank, "late report dropped"))
            case KeyPublished(
                tier=tier,
                namespace_id=namespace,
                pool_id=pool,
                key=key,
                tier_slot=slot,
                checksums=checksums,
                size_bytes=size,
                source_job=job,
            ):
                rows.keys.append(
                    (
                        key,
                        seq,
                        "published",
                        engine,
                        tier,
                        pool,
                        namespace,
                        job,
                        None,
                        None,
                        slot,
                        size,
                        checksums_text(checksums),
                        "",
                    )
                )
            case KeyEvicted(tier=tier, pool_id=pool, key=key, tier_slot=slot, engine_id=by):
                rows.keys.append((key, seq, "evicted", by, tier, pool, None, None, None, None, slot, None, "", ""))
            case KeyQuarantined(tier=tier, pool_id=pool, key=key, reason=reason, job_id=job, detail=detail):
                rows.keys.append(
                    (key, seq, "quarantined", engine, tier, pool, None, job, None, None, None, None, "", f"{reason}: {detail}")
                )
                rows.refusals.append((seq, engine, "quarantined", f"key {key.hex()}", str(reason), detail))
            case Refused(engine_id=by, command=command, reason=reason, detail=detail):
                rows.refusals.append((seq, by or engine, "refused", command, str(reason), detail))
            case NoticeDropped(engine_id=by, notice=notice, reason=reason, detail=detail):
                rows.refusals.append((seq, by or engine, "dropped", notice, str(reason), detail))
            case OwnerStarted(engine_id=by, owner_id=owner, req_id=req_id, resumed=resumed):
                rows.owners.append((by, owner, req_id, seq, "started", "resumed" if resumed else ""))
            case OwnerFinished(engine_id=by, owner_id=owner, reason=reason):
                rows.owners.append((by, owner, "", seq, "finished", reason))
            case EngineDeclared(engine_id=by, incarnation=incarnation, namespace_id=namespace, takeover=takeover):
                self.namespaces[by] = namespace
                rows.engines.append((by, incarnation, namespace, seq, "declared", "takeover" if takeover else ""))
            case EngineReset(engine_id=by, incarnation=incarnation, reason=reason):
                rows.engines.append((by, incarnation, self.namespaces.get(by), seq, "reset", reason))
            case NamespaceRegistered(namespace_id=namespace, spec=spec):
                rows.namespaces.append((namespace, spec.tenant, spec.model_id, msgspec.json.encode(spec).decode(), seq))
            case NamespaceDecided(
                from_namespace=source,
                to_namespace=target,
                outcome=outcome,
                rationale=rationale,
                evidence=evidence,
                affected_keys=affected,
            ):
                rows.decisions.append((seq, outcome, source, target, affected, evidence, rationale))
            case NamespaceReleased(namespace_id=namespace, rationale=rationale, evicted_keys=evicted):
                rows.decisions.append((seq, "released", namespace, None, evicted, "", rationale))
            case ObservedBlocksStored(
                engine_id=by,
                incarnation=incarnation,
                medium=medium,
                group=group,
                dp_rank=rank,
                source_seq=source,
                block_hashes=hashes,
            ):
                rows.observed += [(h, seq, "stored", by, incarnation, medium, group, rank, source) for h in dict.fromkeys(hashes)]
            case ObservedBlocksRemoved(
                engine_id=by,
                incarnation=incarnation,
                medium=medium,
                group=group,
                dp_rank=rank,
                source_seq=source,
                block_hashes=hashes,
            ):
                rows.observed += [
                    (h, seq, "removed", by, incarnation, medium, group, rank, source) for h in dict.fromkeys(hashes)
                ]
            case ObservedCacheCleared(engine_id=by, incarnation=incarnation, medium=medium, dp_rank=rank, source_seq=source):
                rows.observed.append((b"", seq, "cleared", by, incarnation, medium, -1, rank, source))
            case EngineObserved(engine_id=by, incarnation=incarnation, namespace_id=namespace, source=source, reason=reason):
                rows.engines.append((by, incarnation, namespace, seq, "observed", f"{reason} ({source})" if source else reason))
            case ObservedEventsMissed(engine_id=by, incarnation=incarnation, first_seq=first, last_seq=last, reason=reason):
                rows.engines.append(
                    (
                        by,
                        incarnation,
                        None,
                        seq,
                        "events_missed",
                        f"engine batches {first}..{last}" + (f": {reason}" if reason else ""),
                    )
                )
            case _:
                pass  # steps began, lookups, encoder entries, tiers: nothing a forensic query asks for
