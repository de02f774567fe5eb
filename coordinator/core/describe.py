"""One-line human descriptions of events, for the demo table and forensics output."""

from __future__ import annotations

from events import (
    BlockRef,
    BlocksAllocated,
    BlocksComputed,
    BlocksReleased,
    BlocksReused,
    EncoderEntryAllocated,
    EncoderEntryFreed,
    EngineDeclared,
    EngineReset,
    Event,
    FencedRankDone,
    JobFailed,
    JobFenced,
    JobSucceeded,
    KeyEvicted,
    KeyPublished,
    KeyQuarantined,
    LoadJobStarted,
    NamespaceDecided,
    NamespaceReleased,
    NoticeDropped,
    OwnerFinished,
    OwnerStarted,
    PrefixLookedUp,
    RankReported,
    Refused,
    StateCopyPlanned,
    StepBegan,
    StepEnded,
    StoreJobStarted,
    event_tag,
)


def _blocks(refs: list[BlockRef]) -> str:
    return ", ".join(f"{r.pool_id}/{r.block_id}@g{r.generation}" for r in refs) or "-"


def describe(event: Event) -> str:
    """What happened, in the words of DESIGN.md."""
    match event:
        case Refused(command=command, reason=reason, detail=detail):
            return f"REFUSED {command}: {reason} ({detail})"
        case NoticeDropped(notice=notice, reason=reason, detail=detail):
            return f"DROPPED {notice}: {reason} ({detail})"
        case EngineDeclared(engine_id=engine_id, incarnation=incarnation, pools=pools):
            return f"engine {engine_id} incarnation {incarnation}, {len(pools)} pools"
        case EngineReset(engine_id=engine_id, incarnation=incarnation, reason=reason):
            return f"engine {engine_id} reset ({reason}): incarnation {incarnation}"
        case StepBegan(step=step, clock=clock):
            return f"step {step} began at t={clock:g}"
        case StepEnded(step=step, freed_blocks=freed, freed_encoder_entries=entries, removed_keys=removed):
            return f"step {step} ended: freed [{_blocks(freed)}], encoder freed {entries}, removed {len(removed)} keys"
        case OwnerStarted(owner_id=owner_id, req_id=req_id, resumed=resumed):
            return f"owner {owner_id} for {req_id}{' (resumed)' if resumed else ''}"
        case OwnerFinished(owner_id=owner_id, reason=reason):
            return f"owner {owner_id} {reason}"
        case BlocksAllocated(owner_id=owner_id, blocks=blocks):
            return f"owner {owner_id} allocated {_blocks(blocks)}"
        case BlocksReused(owner_id=owner_id, blocks=blocks):
            return f"owner {owner_id} reused {_blocks(blocks)}"
        case BlocksReleased(owner_id=owner_id, blocks=blocks):
            return f"owner {owner_id} released {_blocks(blocks)}"
        case BlocksComputed(blocks=blocks):
            return f"computed {_blocks([c.block for c in blocks])}"
        case PrefixLookedUp(num_tokens=n, boundary=boundary, reuse_unit=unit):
            return f"lookup of {n} tokens: hit {boundary} (unit {unit})"
        case StoreJobStarted(job_id=job_id, items=items, already_published=skipped):
            extra = f", {len(skipped)} already published or on their way in" if skipped else ""
            return f"store job {job_id}: {_blocks([i.source for i in items])}{extra}"
        case LoadJobStarted(job_id=job_id, items=items, lease_expires_at=expiry):
            return f"load job {job_id}: into {_blocks([i.dest for i in items])}, lease to t={expiry:g}"
        case StateCopyPlanned(job_id=job_id, batches=batches, scratch_bytes=scratch):
            ordered = sum(sum(batch.ordered) for batch in batches)
            return f"copy job {job_id}: {len(batches)} batches, {ordered} ordered, {scratch} B scratch"
        case RankReported(job_id=job_id, rank=rank, ok=ok):
            return f"job {job_id} rank {rank} {'ok' if ok else 'FAILED'}"
        case JobSucceeded(job_id=job_id):
            return f"job {job_id} succeeded"
        case JobFailed(job_id=job_id, reason=reason, detail=detail):
            return f"job {job_id} FAILED: {reason} ({detail})"
        case JobFenced(job_id=job_id):
            return f"job {job_id} fenced"
        case FencedRankDone(job_id=job_id, rank=rank):
            return f"fenced job {job_id}: rank {rank} done with its slots"
        case KeyPublished(pool_id=pool_id, key=key, tier=tier):
            return f"published {key.hex()[:8]} (group {pool_id}) in {tier}"
        case KeyEvicted(key=key, tier=tier):
            return f"evicted {key.hex()[:8]} from {tier}"
        case KeyQuarantined(key=key, reason=reason):
            return f"QUARANTINED {key.hex()[:8]}: {reason}"
        case NamespaceDecided(from_namespace=source, to_namespace=target, outcome=outcome, affected_keys=n):
            cleared = f": {n} keys quarantined" if outcome == "clear" else ""
            return f"namespace {source.hex()[:8]} -> {target.hex()[:8]} decided {outcome}{cleared}"
        case NamespaceReleased(namespace_id=namespace, evicted_keys=n):
            return f"namespace {namespace.hex()[:8]} released: {n} keys evicted"
        case EncoderEntryAllocated(entry_id=entry_id, num_tokens=n):
            return f"encoder entry {entry_id} ({n} tokens)"
        case EncoderEntryFreed(entry_id=entry_id):
            return f"encoder entry {entry_id} freed"
    return event_tag(type(event))
