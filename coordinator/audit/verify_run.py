"""`kvledger verify`: stream a whole log through the pure Verifier (coordinator/audit/verify.py).

The log is read step by step (events.log.reading.stored_steps, decode_step), as a replay
reads it; the only I/O here. An event this code cannot decode (a newer kvledger wrote it) is
listed in `undecodable` and skipped, as forensic readers do (DESIGN.md, "The log"): the state
after it may then differ from the coordinator's, so the report lists it and is not `ok`.

I18 is checked twice: the replay resumed from an encoded snapshot of the state at the log's
midpoint must end byte-identical to the full replay, and each stored snapshot the log holds
(the newest few, those recovery would start from) must equal the replay at its sequence.
"""

from __future__ import annotations

import gc
from collections.abc import Callable

import blake3
import msgspec

from coordinator.audit.verify import ReplayCheck, Verifier, Violation
from coordinator.core.state import SNAPSHOT_SCHEMA_VERSION
from events import EventCodec, EventDecodeError
from events.log import EventLog, mask
from events.log.reading import decode_step, stored_steps


class VerifyProgress(msgspec.Struct, frozen=True):
    checked_seq: int
    head: int
    violations: int


class VerifyReport(msgspec.Struct, frozen=True, kw_only=True):
    """What `verify_log` found. `ok`: every event was decoded and checked, none broke an
    invariant, and the replays agree."""

    log: str
    """The log's URL, passwords masked."""
    head: int
    """The last global sequence verified (the log's head when verification began)."""
    events_checked: int
    violation_count: int
    violations: list[Violation]
    """The first `max_violations`, in log order."""
    replay: ReplayCheck
    undecodable: list[int] = []
    """Global sequences of events skipped because this code cannot decode them."""
    ok: bool

    def by_invariant(self) -> dict[str, int]:
        """How many of the listed violations each invariant has."""
        counts: dict[str, int] = {}
        for violation in self.violations:
            counts[violation.invariant] = counts.get(violation.invariant, 0) + 1
        return dict(sorted(counts.items(), key=lambda item: int(item[0].removeprefix("I"))))


async def verify_log(
    event_log: EventLog,
    *,
    on_progress: Callable[[VerifyProgress], None] | None = None,
    codec: EventCodec | None = None,
    snapshot_at: int | None = None,
    max_violations: int = 10_000,
) -> VerifyReport:
    """Replay every committed event up to the head (as of the call) and check each invariant the
    log can show. `snapshot_at` is where the I18 resumed replay starts (default: the midpoint).

    The cyclic garbage collector is paused meanwhile, as in coordinator.ledger.recovery.replay (the
    fold makes no cycles; rescanning the growing state cost most of replay's time)."""
    collecting = gc.isenabled()
    gc.disable()
    try:
        return await _verify(event_log, on_progress, codec or EventCodec(), snapshot_at, max_violations)
    finally:
        if collecting:
            gc.enable()


async def _verify(
    event_log: EventLog,
    on_progress: Callable[[VerifyProgress], None] | None,
    codec: EventCodec,
    snapshot_at: int | None,
    max_violations: int,
) -> VerifyReport:
    head = await event_log.head()
    stored = {
        snapshot.global_seq: snapshot.digest
        for snapshot in await event_log.snapshots()
        # Only snapshots recovery would use: others are ignored caches, not the log's state.
        if snapshot.schema_version == SNAPSHOT_SCHEMA_VERSION
        and 0 < snapshot.global_seq <= head
        and blake3.blake3(snapshot.state).hexdigest() == snapshot.digest
    }
    verifier = Verifier(
        snapshot_at=head // 2 if snapshot_at is None else snapshot_at, stored_digests=stored, max_violations=max_violations
    )
    undecodable: list[int] = []
    last = 0
    async for batch in stored_steps(event_log, 0, head):
        for step in batch:
            skipped: list[EventDecodeError] = []
            events = decode_step(codec, step, last, skipped.append)
            first = max(step.first_seq, last + 1)
            seqs = None
            if skipped:
                gone = {error.position for error in skipped}
                undecodable += sorted(seq for seq in gone if seq is not None)
                seqs = [seq for seq in range(first, step.last_seq + 1) if seq not in gone]
            verifier.feed(events, first, step.stream_id, step.step, seqs=seqs)
            last = step.last_seq
        if on_progress is not None:
            on_progress(VerifyProgress(last, head, verifier.violation_count))
    replay = verifier.finish()
    return VerifyReport(
        log=mask(event_log.url),
        head=head,
        events_checked=verifier.events_checked,
        violation_count=verifier.violation_count,
        violations=verifier.violations,
        replay=replay,
        undecodable=undecodable,
        ok=verifier.violation_count == 0 and replay.ok and not undecodable,
    )
