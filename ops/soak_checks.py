"""The soak's checks (ops/soak.py), pure: values in, findings out. No socket, process or file here.

* `regroup`: a retried step's events, split per command again (the sidecar answers a retry of a
  committed step with every command's events in one group: coordinator.ledger.split_step).
* `LogFacts`: a fold over the log read back, event by event.
* `check_commits`: (1) every acknowledged command is in the log exactly once, where the client
  was told, and the log is contiguous with unique event ids.
* `check_memory`, `rss_segments`: (4) the serve process's resident memory per restart segment.
* `check_refusals`: (5) every refusal kind in the log is one the workload or a fault explains.
"""

from __future__ import annotations

import statistics
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence

import msgspec

from coordinator.core.commands import (
    AllocateBlocks,
    AllocateEncoderEntry,
    AnyCommand,
    Command,
    FinishOwner,
    FreeBlocks,
    FreeEncoderEntry,
    MarkComputed,
    ReuseBlocks,
    StartLoad,
    StartOwner,
    StartStore,
    command_tag,
)
from events import (
    BlocksAllocated,
    BlocksComputed,
    BlocksReleased,
    BlocksReused,
    EncoderEntryAllocated,
    EncoderEntryFreed,
    Event,
    FencedRankDone,
    JobFailed,
    JobSucceeded,
    KeyEvicted,
    KeyQuarantined,
    LoadJobStarted,
    NoticeDropped,
    OwnerFinished,
    OwnerStarted,
    Refused,
    StepBegan,
    StepEnded,
    StoreJobStarted,
)
from events.log import AppendResult, StoredEvent

# --- (1) what the clients were told ----------------------------------------------------------------


class Ack(msgspec.Struct, frozen=True, kw_only=True):
    """One reply that said "committed", as the client got it."""

    command_id: str
    """As the log keys it: "<engine>/<the client's id>" (the sidecar scopes ids per engine)."""
    kind: str
    """"step", "execute" or "report"."""
    engine_id: str
    step: int = -1
    first_seq: int
    last_seq: int
    segment: int
    """The serve process that was running when the reply came (0: the first start)."""


class Check(msgspec.Struct, frozen=True):
    name: str
    passed: bool
    detail: str


# --- regrouping a retried step ------------------------------------------------------------------------


class RegroupError(ValueError):
    """The events do not read as the given commands' outcomes, in order."""


_OUTCOME: dict[type[Command], type[Event]] = {
    StartOwner: OwnerStarted,
    FinishOwner: OwnerFinished,
    AllocateBlocks: BlocksAllocated,
    ReuseBlocks: BlocksReused,
    FreeBlocks: BlocksReleased,
    MarkComputed: BlocksComputed,
    AllocateEncoderEntry: EncoderEntryAllocated,
    FreeEncoderEntry: EncoderEntryFreed,
    StartStore: StoreJobStarted,
    StartLoad: LoadJobStarted,
}
"""The event that closes each command's accepted outcome (coordinator/core/decider.py, jobs.py)."""
_BEFORE_OUTCOME: dict[type[Command], tuple[type[Event], ...]] = {
    FinishOwner: (BlocksReleased,),
    StartStore: (KeyEvicted,),
}
"""Events a command may emit before that one: a finish releases what the owner held; a store
evicts to make room."""


def regroup(commands: Sequence[AnyCommand], events: Sequence[Event]) -> list[list[Event]]:
    """Split one step's command events (StepBegan and StepEnded excluded) per command.

    The decider answers each command, in order, with its events or with one refusal (Refused,
    or NoticeDropped for a notice) naming the command's tag; each accepted outcome ends with one
    event of a known type (`_OUTCOME`), after the few kinds that may precede it, and a store with
    nothing new to write is followed by its JobSucceeded. Raises RegroupError otherwise."""
    groups: list[list[Event]] = []
    position = 0
    for command in commands:
        outcome = _OUTCOME.get(type(command))
        if outcome is None:
            raise RegroupError(f"no rule for a {type(command).__name__}")
        tag = command_tag(command)
        group: list[Event] = []
        while True:
            if position >= len(events):
                raise RegroupError(f"the events ran out inside {tag} (command {len(groups)})")
            event = events[position]
            position += 1
            group.append(event)
            refused = (isinstance(event, Refused) and event.command == tag) or (
                isinstance(event, NoticeDropped) and event.notice == tag
            )
            if refused:
                if len(group) != 1:
                    raise RegroupError(f"{tag} (command {len(groups)}) has events before its refusal")
                break
            if isinstance(event, outcome):
                break
            if not isinstance(event, _BEFORE_OUTCOME.get(type(command), ())):
                raise RegroupError(f"{type(event).__name__} cannot come from {tag} (command {len(groups)})")
        last = group[-1]
        if isinstance(last, StoreJobStarted) and not last.items and position < len(events):
            following = events[position]
            if isinstance(following, JobSucceeded) and following.job_id == last.job_id:
                group.append(following)
                position += 1
        groups.append(group)
    if position != len(events):
        raise RegroupError(f"{len(events) - position} events left after the last command")
    return groups


# --- the log read back --------------------------------------------------------------------------------


def refusal_kind(event: Event) -> str | None:
    """ "Type:reason" of a refusal, a dropped notice, a failed job, a quarantined key or a fenced
    job's late report (as coordinator.simulator.harness.Tally counts them); None otherwise."""
    if isinstance(event, Refused | NoticeDropped | JobFailed | KeyQuarantined):
        return f"{type(event).__name__}:{event.reason}"
    if isinstance(event, FencedRankDone):
        return "FencedRankDone:late_report"
    return None


class LogFacts:
    """What the whole log shows, folded one event at a time in global order."""

    def __init__(self) -> None:
        self.events = 0
        self.last_seq = 0
        self.gaps: list[tuple[int, int]] = []
        """(the sequence expected, the one found) wherever the global sequence jumps."""
        self.event_ids: set[str] = set()
        self.duplicate_event_ids = 0
        self.stream_versions: dict[str, int] = {}
        self.version_breaks: list[tuple[str, int, int]] = []
        """(stream, version expected, version found)."""
        self.step_began: dict[int, tuple[str, int]] = {}
        """Sequence of each StepBegan -> (engine, step)."""
        self.step_ended: dict[int, tuple[str, int]] = {}
        self.steps: Counter[tuple[str, int]] = Counter()
        """(engine, step) -> how many StepBegan the log holds for it."""
        self.refusals: Counter[str] = Counter()

    def feed(self, stored: StoredEvent, event: Event) -> None:
        self.events += 1
        if stored.global_seq != self.last_seq + 1:
            self.gaps.append((self.last_seq + 1, stored.global_seq))
        self.last_seq = stored.global_seq
        if stored.event_id in self.event_ids:
            self.duplicate_event_ids += 1
        self.event_ids.add(stored.event_id)
        expected = self.stream_versions.get(stored.stream_id, 0) + 1
        if stored.stream_version != expected:
            self.version_breaks.append((stored.stream_id, expected, stored.stream_version))
        self.stream_versions[stored.stream_id] = stored.stream_version
        if isinstance(event, StepBegan):
            self.step_began[stored.global_seq] = (event.engine_id, event.step)
            self.steps[(event.engine_id, event.step)] += 1
        elif isinstance(event, StepEnded):
            self.step_ended[stored.global_seq] = (event.engine_id, event.step)
        kind = refusal_kind(event)
        if kind is not None:
            self.refusals[kind] += 1


def check_commits(acks: Sequence[Ack], found: Mapping[str, AppendResult], facts: LogFacts, head: int) -> Check:
    """(1) Nothing the clients were told was committed is lost, moved or there twice."""
    problems: list[str] = []
    if facts.gaps:
        problems.append(f"the global sequence jumps at {facts.gaps[:3]}")
    if facts.last_seq != head or facts.events != head:
        problems.append(f"read {facts.events} events up to {facts.last_seq}, the head is {head}")
    if facts.duplicate_event_ids:
        problems.append(f"{facts.duplicate_event_ids} event ids appear twice")
    if facts.version_breaks:
        problems.append(f"stream versions break at {facts.version_breaks[:3]}")
    told: dict[str, tuple[int, int]] = {}
    for ack in acks:
        where = (ack.first_seq, ack.last_seq)
        if told.setdefault(ack.command_id, where) != where:
            problems.append(f"{ack.command_id} was acknowledged at {told[ack.command_id]} and at {where}")
        stored = found.get(ack.command_id)
        if stored is None:
            problems.append(f"{ack.kind} {ack.command_id} acknowledged at {where} is not in the log (lost)")
            continue
        if (stored.first_seq, stored.last_seq) != where:
            problems.append(f"{ack.command_id} acknowledged at {where} is at {(stored.first_seq, stored.last_seq)}")
        if ack.kind == "step":
            step = (ack.engine_id, ack.step)
            if facts.step_began.get(ack.first_seq) != step or facts.step_ended.get(ack.last_seq) != step:
                problems.append(f"step {step} acknowledged at {where} does not begin and end there")
    acked_steps = {(ack.engine_id, ack.step) for ack in acks if ack.kind == "step"}
    twice = sorted(step for step, count in facts.steps.items() if count > 1)
    if twice:
        problems.append(f"steps committed more than once: {twice[:5]}")
    unacknowledged = sorted(set(facts.steps) - acked_steps)
    if unacknowledged:
        problems.append(f"steps in the log that no engine was told of: {unacknowledged[:5]}")
    ranges = sorted({where for where in told.values() if where[1] >= where[0] > 0})
    overlapping = [(a, b) for a, b in zip(ranges, ranges[1:], strict=False) if b[0] <= a[1]]
    if overlapping:
        problems.append(f"acknowledged ranges overlap: {overlapping[:3]}")
    kinds = Counter(ack.kind for ack in acks)
    if not problems:
        detail = (
            f"{len(told):,} acknowledged commands ({kinds['step']:,} steps, {kinds['report']:,} reports, "
            f"{kinds['execute']:,} executes) each once at its position; sequence 1..{head:,} contiguous, "
            f"{len(facts.event_ids):,} event ids unique"
        )
        return Check("no committed event lost or duplicated", True, detail)
    more = f" (+{len(problems) - 5} more)" if len(problems) > 5 else ""
    return Check("no committed event lost or duplicated", False, "; ".join(problems[:5]) + more)


# --- (4) resident memory ------------------------------------------------------------------------------


class RssSample(msgspec.Struct, frozen=True, array_like=True):
    segment: int
    """Which start of the serve process (0: the first)."""
    since_start: float
    """Seconds since that start."""
    mb: float
    events: int = 0
    """The log's head when the sample was taken (what a log that keeps its events in memory holds)."""


class Segment(msgspec.Struct, frozen=True, kw_only=True):
    segment: int
    seconds: float
    """From the start to the last sample."""
    samples: int
    judged: bool
    """Long enough after warm-up to say whether memory stayed flat."""
    start_mb: float
    """Median of the first quarter of the samples after warm-up."""
    end_mb: float
    """Median of the last quarter."""
    peak_mb: float
    growth_mb: float
    growth_pct: float
    flat: bool
    allowed_mb: float = 0.0
    """Growth allowed beyond the limit: bytes_per_event times the events appended over the window."""


def rss_segments(
    samples: Sequence[RssSample],
    *,
    warmup: float,
    limit_mb: float,
    limit_pct: float,
    min_samples: int = 8,
    bytes_per_event: float = 0.0,
) -> list[Segment]:
    """Per restart segment: growth after warm-up, start and end each a median of a quarter of the
    samples (one sample's allocator noise moves neither). Flat: growth within the larger limit,
    plus `bytes_per_event` for each event appended over the same window (what a log that keeps
    its events in memory, the Kafka log, holds by design)."""
    segments = []
    for number in sorted({s.segment for s in samples}):
        mine = [s for s in samples if s.segment == number]
        window = [s for s in mine if s.since_start >= warmup]
        after = [s.mb for s in window]
        judged = len(after) >= min_samples
        quarter = max(1, len(after) // 4)
        start = statistics.median(after[:quarter]) if after else 0.0
        end = statistics.median(after[-quarter:]) if after else 0.0
        growth = end - start
        appended = (window[-1].events - window[0].events) if window else 0
        allowed = bytes_per_event * appended / 1e6
        flat = not judged or growth <= max(limit_mb, start * limit_pct / 100) + allowed
        segments.append(
            Segment(
                segment=number,
                seconds=round(mine[-1].since_start, 1),
                samples=len(mine),
                judged=judged,
                start_mb=round(start, 1),
                end_mb=round(end, 1),
                peak_mb=round(max(s.mb for s in mine), 1),
                growth_mb=round(growth, 1),
                growth_pct=round(100 * growth / start, 1) if start else 0.0,
                flat=flat,
                allowed_mb=round(allowed, 1),
            )
        )
    return segments


def check_memory(segments: Sequence[Segment], *, warmup: float, limit_mb: float, limit_pct: float, allowance: str = "") -> Check:
    """(4) Flat after warm-up in every segment long enough to tell, and at least one was
    (`allowance` names what rss_segments' allowance_mb was for)."""
    judged = [s for s in segments if s.judged]
    grown = [s for s in judged if not s.flat]
    name = "serve resident memory flat after warm-up"
    limit = f"limit max({limit_mb:g} MB, {limit_pct:g}%){' + ' + allowance if allowance else ''} after {warmup:g} s of warm-up"
    if not judged:
        return Check(name, False, f"no segment ran long enough after warm-up to judge ({limit})")
    worst = max(judged, key=lambda s: s.growth_mb)
    allowed = f" (allowed beyond the limit there: {worst.allowed_mb:.1f} MB)" if allowance else ""
    detail = (
        f"{len(judged)} of {len(segments)} segments judged; largest growth {worst.growth_mb:+.1f} MB "
        f"({worst.growth_pct:+.1f}%) in segment {worst.segment}{allowed}; {limit}"
    )
    if grown:
        detail = f"segments {[s.segment for s in grown]} grew past the limit; " + detail
    return Check(name, not grown, detail)


# --- (5) refusals -------------------------------------------------------------------------------------


class Explanation(msgspec.Struct, frozen=True):
    cause: str
    """"workload", "reset", "serve kill" or "worker kill": what must have happened."""
    why: str


EXPLAINED: dict[str, Explanation] = {
    # The workload's own pressure (seen in `kvledger simulate --engines 3` with no fault at all).
    "NoticeDropped:reallocated_in_step": Explanation(
        "workload", "a block freed and allocated again in one step: the end of step drops its freed notice (I14)"
    ),
    "Refused:pool_exhausted": Explanation(
        "workload", "the scheduler counts a block a store still pins as free and asks for one too many"
    ),
    "Refused:key_not_published": Explanation("workload", "a key left the tier between the engine's lookup and its load"),
    "Refused:tier_full": Explanation("workload", "every tier slot was pinned by a store or leased by a load at that moment"),
    "Refused:encoder_cache_full": Explanation("workload", "the encoder cache held other images' entries"),
    "FencedRankDone:late_report": Explanation(
        "reset", "the cache reset fenced a store in flight; its late report is dropped (I16)"
    ),
    # What a fault explains: only when that fault happened.
    "NoticeDropped:stale_job": Explanation(
        "worker kill", "a restarted worker re-sent a report for a job that had ended meanwhile"
    ),
    "NoticeDropped:duplicate_report": Explanation(
        "worker kill", "a restarted worker reported a (job, rank) again under another command id"
    ),
    "JobFailed:lease_expired": Explanation(
        "serve kill", "a load finished after its lease: the restart held the worker's report back"
    ),
}
"""Every refusal kind the soak accepts, with the cause that must have happened for it. Anything
else (a checksum mismatch, a quarantined key, a conflicting report, a stale generation...) is a
failure: no fault the soak injects explains it."""


def check_refusals(refusals: Mapping[str, int], causes: Iterable[str]) -> Check:
    """(5) Every kind of refusal in the log is explained by the workload or by a fault that happened."""
    happened = {"workload", *causes}
    unexplained = {
        kind: count for kind, count in sorted(refusals.items()) if kind not in EXPLAINED or EXPLAINED[kind].cause not in happened
    }
    name = "refusals only of kinds the workload or the faults explain"
    total = sum(refusals.values())
    if unexplained:
        return Check(name, False, f"unexplained: {', '.join(f'{k} x{v}' for k, v in unexplained.items())}")
    return Check(name, True, f"{total:,} refusals of {len(refusals)} kinds, each explained (table below)")
