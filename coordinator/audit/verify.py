"""Verifying a log: replay it and check every invariant (DESIGN.md I1-I18) the log can show. Pure.

`Verifier` folds the log with the real projector (coordinator.core.projector) and inspects each event
against the state *before* it is applied: a log the coordinator wrote with every protection on
shows no violation; one written with a protection off (the simulator's fault scenarios,
coordinator/core/protections.py) or by a buggy coordinator shows each event that broke an invariant,
with its global sequence, its engine step and the earlier events that make it a violation.

What a log cannot show, and so is not checked here: whatever happened only on a worker or in an
engine and was reported as success (a batch load that filled one destination of a repeated key
and reported the read's checksum for all, I11; an engine's connector that resolved a req_id to
the wrong owner before its command reached the decider, I4), and prefix lookups answered on the
read-only fast path (the sidecar's Lookup), which are recorded nowhere (I6, I7). A content key
does not record how many tokens it covers, so a load that mixes groups at different boundaries
is visible only through the lookup that chose it.

Checks, each against the state before the event (coordinator/audit/_verify_blocks.py and
_verify_jobs.py; _verify_base.py holds the evidence they share):

* I1  an allocation's generation is the slot's previous generation + 1 (device and tier slots);
      an event naming a block (reuse, release, compute, store, load, copy) names its current one.
* I2  the null block is never allocated, computed, stored, loaded, copied or published.
* I3  a slot a job in flight reads or writes (whether or not it pinned it: a store decided with
      the pins protection off records `pinned=False`) is never allocated again, nor is a slot an
      owner still holds.
* I4  a report counts only for a job in flight, once per rank, in range; a job succeeds only
      after every rank reported ok.
* I5  a key is published by a store in flight whose every rank reported success with a
      checksum, with exactly the reported checksums; a load names a published key.
* I6, I7 a recorded lookup (PrefixLookedUp) stops at a whole reuse unit of the engine's groups
      and names, for every group, exactly the published keys needed to resume there.
* I9  a namespace id is the digest of its whole spec (the weights revision and the tenant
      included); a load or lookup names keys of its engine's namespace only.
* I10 a live key is never published again with other checksums (that re-store quarantines it),
      nor evicted and published again with other checksums in one append (the last writer won).
      A key evicted in an earlier append and stored again later is a new publication: a
      recompute's bytes may differ, and nothing then is served from the old entry.
* I11 a load that counts as success has a checksum from every rank for every destination.
* I12 an eviction never takes a key a live lease holds; a load never counts as success at or
      after its lease's expiry, nor when a key it read left the tier or moved.
* I13 a load never counts as success when a rank's checksums differ from the published ones;
      a load decision carries the published checksums; a quarantined key is not loaded.
* I14 a step's notices describe its end: no freed block allocated again or not free, no freed
      encoder entry allocated again, no removed key published again.
* I15 a copy plan never reads a region an earlier (or the same) batch writes, except its
      scratch; a copy overlapping itself is ordered (memmove); destinations never overlap.
* I16 a reset or restart leaves no job of the old incarnation in flight (they are fenced); no
      report, publication or success of an old incarnation's job counts.
* I17 no owner takes a ref on a block whose compute or load is not complete, and no store reads
      a block without the computed content it stores.
* I18 `finish()`: the state encoded at a midpoint (`snapshot_at`), decoded, and folded on with
      the tail equals the full replay, byte for byte; each stored snapshot given as
      `stored_digests` equals the replay at its sequence. An event the projector cannot fold is
      an I18 violation too: the log does not replay.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import msgspec

from coordinator.audit._verify_base import At, Violation
from coordinator.audit._verify_blocks import BlockChecks, copy_plan_problems
from coordinator.audit._verify_jobs import JobChecks
from coordinator.core.projector import ProjectionError, apply
from coordinator.core.state import State, decode_state, encode_state, state_digest
from events import (
    BlocksAllocated,
    BlocksComputed,
    BlocksReleased,
    BlocksReused,
    EncoderEntryAllocated,
    EncoderEntryFreed,
    EngineReset,
    Event,
    ExternalLoadStarted,
    ExternalStoreStarted,
    FencedRankDone,
    JobFailed,
    JobFenced,
    JobSucceeded,
    KeyEvicted,
    KeyPublished,
    LoadJobStarted,
    NamespaceRegistered,
    PrefixLookedUp,
    RankReported,
    StateCopyPlanned,
    StepEnded,
    StoreJobStarted,
)

__all__ = ["ReplayCheck", "Verifier", "Violation", "copy_plan_problems"]


class ReplayCheck(msgspec.Struct, frozen=True, kw_only=True):
    """I18: a replay resumed from a snapshot of the state at `snapshot_seq` against the full one."""

    snapshot_seq: int
    full_digest: str
    resumed_digest: str
    stored_snapshots_checked: int = 0
    """Stored snapshots compared with the replay at their sequence."""
    ok: bool


class Verifier(BlockChecks, JobChecks):
    """Feed it a log's appends in order (`feed`), then call `finish`; `violations` lists what
    broke. Holds the replayed state (`state`) and a few indexes for evidence, nothing else."""

    def __init__(
        self, *, snapshot_at: int = 0, stored_digests: Mapping[int, str] | None = None, max_violations: int = 10_000
    ) -> None:
        super().__init__(max_violations)
        self.events_checked = 0
        self.last_seq = 0
        self._snapshot_at = snapshot_at
        self._snapshot_seq = 0
        self._resumed: State | None = None
        self._replay: ReplayCheck | None = None
        self._stored = dict(stored_digests or {})
        self._stored_checked = 0
        self._checks: dict[type[Event], Callable[[Any, At], bool]] = {
            NamespaceRegistered: self._namespace_registered,
            EngineReset: self._engine_reset,
            StepEnded: self._step_ended,
            BlocksAllocated: self._blocks_allocated,
            BlocksReused: self._blocks_reused,
            BlocksReleased: self._blocks_released,
            BlocksComputed: self._blocks_computed,
            PrefixLookedUp: self._prefix_looked_up,
            StoreJobStarted: self._store_job_started,
            LoadJobStarted: self._load_job_started,
            ExternalStoreStarted: self._external_store_started,
            ExternalLoadStarted: self._external_load_started,
            StateCopyPlanned: self._state_copy_planned,
            RankReported: self._rank_reported,
            JobSucceeded: self._job_succeeded,
            JobFailed: self._job_failed,
            KeyPublished: self._key_published,
            KeyEvicted: self._key_evicted,
            EncoderEntryAllocated: self._encoder_entry_allocated,
        }
        if snapshot_at <= 0:
            self._take_snapshot(0)

    # --- feeding -------------------------------------------------------------------------------

    def feed(
        self, events: Sequence[Event], first_seq: int, stream_id: str, step: int, *, seqs: Sequence[int] | None = None
    ) -> None:
        """One append of one stream (a stored step): its events from global sequence
        `first_seq` on, or at `seqs` when some were left out (undecodable)."""
        engine = stream_id.removeprefix("engine/") if stream_id.startswith("engine/") else ""
        self._evicted_in_append = {}  # I10: an eviction and a re-publication in one append
        positions = seqs if seqs is not None else range(first_seq, first_seq + len(events))
        for seq, event in zip(positions, events, strict=True):
            self.event(event, seq, engine, step)

    def event(self, event: Event, seq: int, engine: str, step: int = -1) -> None:
        """Check one event against the state before it, then fold it in."""
        if step < 0:
            known = self.state.engines.get(engine)
            step = known.step if known is not None else -1
        at = At(seq, step, engine, event)
        check = self._checks.get(type(event))
        skip = check(event, at) if check is not None else False
        if not skip:
            self._fold(at)
        self.events_checked += 1
        self.last_seq = seq
        if self._resumed is None and seq >= self._snapshot_at:
            self._take_snapshot(seq)
        expected = self._stored.get(seq)
        if expected is not None:
            self._stored_checked += 1
            if state_digest(self.state) != expected:
                self._flag(
                    "I18",
                    at,
                    f"the stored snapshot at sequence {seq} differs from the replay at {seq}: "
                    "recovery from it gives another state than a full replay",
                )

    def finish(self) -> ReplayCheck:
        """I18: compare the replay resumed from the midpoint snapshot with the full replay
        (once: call it after the last event)."""
        if self._replay is not None:
            return self._replay
        if self._resumed is None:
            self._take_snapshot(self.last_seq)
        assert self._resumed is not None
        full, resumed = state_digest(self.state), state_digest(self._resumed)
        if full != resumed:
            self._flag(
                "I18",
                At(self.last_seq, -1, "", None),
                f"snapshot at sequence {self._snapshot_seq} + tail gives state {resumed[:16]}, the full replay {full[:16]}",
            )
        self._replay = ReplayCheck(
            snapshot_seq=self._snapshot_seq,
            full_digest=full,
            resumed_digest=resumed,
            stored_snapshots_checked=self._stored_checked,
            ok=full == resumed,
        )
        return self._replay

    def _fold(self, at: At) -> None:
        assert at.event is not None
        for state in (self.state, self._resumed):
            if state is None:
                continue
            try:
                apply(state, at.event)
            except (ProjectionError, LookupError, ValueError) as error:
                # A partial fold: both states (when there are two) take the same part of it.
                if state is self.state:
                    self._flag(
                        "I18",
                        at,
                        f"the projector cannot fold this event ({type(error).__name__}: {error}): the log does not replay",
                    )
        self._after_fold(at)

    def _take_snapshot(self, seq: int) -> None:
        data = encode_state(self.state)
        self._resumed = decode_state(data)
        self._snapshot_seq = seq
        if encode_state(self._resumed) != data:
            self._flag("I18", At(seq, -1, "", None), f"the state at sequence {seq} does not survive encode/decode byte for byte")

    def _after_fold(self, at: At) -> None:
        """Keep the evidence indexes: a job lets go of its slots once it is over (I3)."""
        event = at.event
        if isinstance(event, JobSucceeded | JobFailed | JobFenced | FencedRankDone):
            job_id = event.job_id
            if job_id not in self.state.jobs and job_id not in self.state.fenced:
                for slot in self._job_slots.pop(job_id, []):
                    holders = self._busy.get(slot)
                    if holders is not None:
                        holders.pop(job_id, None)
                        if not holders:
                            del self._busy[slot]
                self._job_seq.pop(job_id, None)
                self._report_seq.pop(job_id, None)
        elif isinstance(event, KeyPublished):
            where = (event.tier, event.pool_id, event.key)
            self._published_seq[where] = at.seq
            self._evicted_seq.pop(where, None)
        elif isinstance(event, KeyEvicted):
            where = (event.tier, event.pool_id, event.key)
            self._published_seq.pop(where, None)
            self._evicted_seq[where] = at.seq
        elif isinstance(event, EncoderEntryFreed):
            self._encoder_seq.pop((event.engine_id, event.entry_id), None)
