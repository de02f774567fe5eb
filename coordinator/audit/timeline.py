"""`kvledger audit timeline`: which generation and owner held each slot of one pool over a range
of engine steps, with pins, jobs and refusals marked. The picture for an incident report.

Three layers (STYLE.md 1): `read_rows` is the SQL shell over the audit index (kvl_audit_*,
built by coordinator/audit/store.py); `build_timeline` is pure and turns those rows into a plain
model (`Timeline`: bars, pins, job and refusal marks); coordinator/audit/timeline_draw.py renders
the model to PNG (matplotlib) or self-contained HTML (plotly). `draw_timeline` does all three.

A bar is one *hold* of one generation of a slot: from its allocation (or a reuse of its cached
content after it was freed) to the `freed` row that returned it to the free list, the next
allocation of the slot (a freed notice dropped because the slot was reallocated in the same step,
I14, leaves no `freed` row), or the engine's reset. So a slot's bars never overlap, and
generations increase along a slot (I1).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any, Literal

import msgspec
import sqlalchemy as sa
import structlog

from coordinator.audit import _packed as packed
from coordinator.audit.answers import AuditError, NotFound
from coordinator.audit.queries import Audit, job_touch
from events.log import SqlEventLog
from events.log import schema as t

log = structlog.get_logger("kvledger.audit")

MAX_STEPS = 2000
"""Steps one picture covers at most: past that a bar is narrower than a pixel."""
MAX_SLOTS = 200
"""Slot lanes one picture draws at most; past that the busiest are drawn and the rest counted."""

Format = Literal["png", "html"]
_FORMATS: dict[str, Format] = {".png": "png", ".html": "html", ".htm": "html"}


class TimelineError(AuditError):
    """A timeline that cannot be drawn as asked (bad --steps, --out or range)."""


# --- the model ----------------------------------------------------------------------------------


class StepSpan(msgspec.Struct, frozen=True, array_like=True):
    step: int
    first_seq: int
    last_seq: int


class Bar(msgspec.Struct, frozen=True, kw_only=True):
    """One hold of one generation of a slot."""

    block: int
    generation: int
    owner_id: int | None
    """The owner that allocated it (or took the cached content back after a free)."""
    req_id: str
    start_seq: int
    end_seq: int | None
    """The row that ended the hold; None: still held after the range."""
    start_step: int
    """The step of the start, or the range's first step for a hold that began before it."""
    end_step: int
    """The step of the end, or the range's last step for a hold that goes on after it."""
    ended_by: str
    """freed, reallocated, reset or open."""
    released_seq: int | None = None
    """When its last owner let go: the slot is freed at the end of that step (I14), or later if a
    job pins it (draining, I3)."""
    sharers: list[str] = []
    """Other owners that took a ref on it (prefix-cache reuse): 'owner N (req)'."""


class Pin(msgspec.Struct, frozen=True, kw_only=True):
    """A job in flight on a slot: the slot is pinned from the job's start to its end (I3)."""

    block: int
    generation: int
    job_id: int
    kind: str
    """store, load or copy."""
    start_seq: int
    end_seq: int | None
    """None: still in flight after the range."""
    start_step: int
    end_step: int
    outcome: str


class JobMark(msgspec.Struct, frozen=True, kw_only=True):
    job_id: int
    kind: str
    detail: str
    start_seq: int
    end_seq: int | None
    outcome: str
    """succeeded, failed: <reason>, fenced, or in flight."""
    blocks: list[int]
    """The slots of this pool it touched."""


class RefusalMark(msgspec.Struct, frozen=True, kw_only=True):
    seq: int
    step: int
    kind: str
    """refused, dropped, job_failed or quarantined."""
    subject: str
    reason: str
    detail: str
    block: int | None
    """The slot of this pool it names, if any (drawn on that slot's lane)."""


class Timeline(msgspec.Struct, frozen=True, kw_only=True):
    engine: str
    pool: int
    first_step: int
    last_step: int
    """The range asked for, clipped to the steps the engine has."""
    first_seq: int
    last_seq: int
    """The global sequences the range covers (events between two steps belong to the earlier)."""
    steps: list[StepSpan]
    slots: list[int]
    """The lanes drawn, by block id."""
    bars: list[Bar]
    pins: list[Pin]
    jobs: list[JobMark]
    refusals: list[RefusalMark]
    omitted_slots: int = 0
    """Slots with something to draw that the lane cap left out."""

    def step_of(self, seq: int) -> int:
        """The engine step a sequence belongs to: the last step that began at or before it."""
        return self.steps[_span_index(self.steps, seq)].step

    def x(self, seq: int) -> float:
        """Where a sequence lies on the step axis: step s covers [s, s+1), its events spread
        evenly in it; sequences between two steps sit at the end of the earlier."""
        seq = min(max(seq, self.first_seq), self.last_seq + 1)
        span = self.steps[_span_index(self.steps, seq)]
        if seq > span.last_seq:
            return float(span.step + 1)
        return span.step + (seq - span.first_seq) / (span.last_seq - span.first_seq + 1)

    def x_end(self, seq: int | None) -> float:
        """The end of a span that ends at `seq` (None: after the range)."""
        return float(self.last_step + 1) if seq is None or seq > self.last_seq else self.x(seq)

    @property
    def note(self) -> str:
        """What the picture leaves out, for its title and the command's output."""
        if not self.omitted_slots:
            return ""
        shown = len(self.slots)
        return f"{shown} of {shown + self.omitted_slots} slots drawn (the busiest); narrow --steps to see the others"


def _span_index(steps: Sequence[StepSpan], seq: int) -> int:
    lo, hi = 0, len(steps) - 1
    while lo < hi:  # the last span whose first_seq <= seq (steps are in log order)
        mid = (lo + hi + 1) // 2
        if steps[mid].first_seq <= seq:
            lo = mid
        else:
            hi = mid - 1
    return lo


# --- input --------------------------------------------------------------------------------------


_STEPS = re.compile(r"^\s*(\d+)\s*:\s*(\d+)\s*$")


def parse_steps(text: str) -> tuple[int, int]:
    """`A:B`, two engine steps with A <= B."""
    found = _STEPS.match(text)
    if found is None:
        raise TimelineError(f"--steps {text!r} is not A:B (two step numbers, e.g. 100:250)")
    first, last = int(found[1]), int(found[2])
    if first > last:
        raise TimelineError(f"--steps {text!r}: the first step is after the last")
    return first, last


def output_format(out: Path) -> Format:
    """The picture's format from the file's suffix: .png or .html."""
    found = _FORMATS.get(out.suffix.lower())
    if found is None:
        raise TimelineError(
            f"--out {str(out)!r}: cannot tell the format from {out.suffix or 'no suffix'!r}; name a .png or .html file"
        )
    return found


# --- rows -> model (pure) -----------------------------------------------------------------------


PoolSlotRow = tuple[int, int, int, str, int | None, int | None]
"""block, generation, seq, kind, owner_id, job_id (kvl_audit_slots of one engine and pool)."""
JobEventRow = tuple[int, int, str, str]
"""job_id, seq, kind, detail (kvl_audit_jobs)."""
EngineRefusalRow = tuple[int, str, str, str, str]
"""seq, kind, subject, reason, detail (kvl_audit_refusals of one engine)."""


class IndexRows(msgspec.Struct, kw_only=True):
    """What the index holds about one pool around a range, as plain tuples."""

    engine: str
    pool: int
    steps: list[StepSpan]
    first_seq: int
    last_seq: int
    slots: list[PoolSlotRow]
    """Every row in the range, and every row up to its end of a generation alive at its start."""
    resets: list[int]
    """The sequences of the engine's resets, up to the range's end."""
    req_ids: dict[int, str]
    jobs: list[JobEventRow]
    refusals: list[EngineRefusalRow]


class _Hold:
    """A hold being folded (mutable, private to build_timeline)."""

    def __init__(self, block: int, generation: int, owner: int | None, seq: int) -> None:
        self.block, self.generation, self.owner, self.start = block, generation, owner, seq
        self.holders: set[int] = {owner} if owner is not None else set()
        self.sharers: list[int] = []
        self.released: int | None = None


def build_timeline(rows: IndexRows, *, max_slots: int = MAX_SLOTS) -> Timeline:
    """The model of the range from the index's rows. Pure."""
    steps = rows.steps
    first_seq, last_seq = rows.first_seq, rows.last_seq
    first_step, last_step = steps[0].step, steps[-1].step

    def step_of(seq: int) -> int:
        return steps[_span_index(steps, min(max(seq, first_seq), last_seq))].step

    def owner_text(owner: int | None) -> str:
        return "" if owner is None else rows.req_ids.get(owner, "")

    bars: list[Bar] = []

    def close(hold: _Hold, end: int | None, ended_by: str) -> None:
        if end is not None and end < first_seq:
            return  # over before the range began
        bars.append(
            Bar(
                block=hold.block,
                generation=hold.generation,
                owner_id=hold.owner,
                req_id=owner_text(hold.owner),
                start_seq=hold.start,
                end_seq=end,
                start_step=step_of(hold.start),
                end_step=last_step if end is None else step_of(end),
                ended_by=ended_by,
                released_seq=hold.released,
                sharers=[f"owner {o}" + (f" ({owner_text(o)})" if owner_text(o) else "") for o in hold.sharers],
            )
        )

    # Fold each slot's rows, with the engine's resets, in log order.
    by_block: dict[int, list[PoolSlotRow]] = {}
    for row in sorted(rows.slots, key=lambda r: r[2]):
        by_block.setdefault(row[0], []).append(row)
    resets = sorted(rows.resets)
    pins_touched: list[PoolSlotRow] = []
    for block, slot_rows in by_block.items():
        hold: _Hold | None = None
        pending_resets = iter(resets)
        next_reset = next(pending_resets, None)
        for row in slot_rows:
            _, generation, seq, kind, owner, job = row
            while next_reset is not None and next_reset < seq:
                if hold is not None:
                    close(hold, next_reset, "reset")
                    hold = None
                next_reset = next(pending_resets, None)
            if job is not None:
                pins_touched.append(row)
            if kind == "allocated":
                if hold is not None:
                    close(hold, seq, "reallocated")
                hold = _Hold(block, generation, owner, seq)
            elif hold is not None and generation != hold.generation:
                continue  # a late row naming an older generation: that generation's hold is over
            elif kind == "reused" and owner is not None:
                if hold is None:  # cached content taken back after its free: a new hold
                    hold = _Hold(block, generation, owner, seq)
                else:
                    hold.holders.add(owner)
                    hold.sharers.append(owner)
                    hold.released = None
            elif kind == "released" and hold is not None and owner is not None:
                hold.holders.discard(owner)
                if not hold.holders:
                    hold.released = seq
            elif kind == "freed" and hold is not None:
                close(hold, seq, "freed")
                hold = None
        if hold is not None:
            if next_reset is not None:
                close(hold, next_reset, "reset")
            else:
                close(hold, None, "open")

    # Pins and jobs: each job's start and end from its rows (the same reading as `audit block`).
    job_rows: dict[int, list[Any]] = {}
    for job_id, seq, kind, detail in sorted(rows.jobs, key=lambda r: r[1]):
        job_rows.setdefault(job_id, []).append(_JobRowView(seq, kind, detail))
    touches = {job_id: job_touch(job_id, found, found[0].seq, last_seq) for job_id, found in job_rows.items()}
    pins: list[Pin] = []
    job_blocks: dict[int, set[int]] = {}
    for block, generation, seq, _kind, _owner, job in pins_touched:
        assert job is not None
        touch = touches.get(job)
        start, end = (touch.started_seq, touch.ended_seq) if touch is not None else (seq, None)
        end = None if end is not None and end > last_seq else end
        if (end is not None and end < first_seq) or start > last_seq:
            continue
        job_blocks.setdefault(job, set()).add(block)
        pins.append(
            Pin(
                block=block,
                generation=generation,
                job_id=job,
                kind=touch.kind if touch else "?",
                start_seq=start,
                end_seq=end,
                start_step=step_of(start),
                end_step=last_step if end is None else step_of(end),
                outcome=touch.outcome if touch else "in flight",
            )
        )
    jobs = []
    for job_id in sorted(job_blocks):
        touch = touches.get(job_id)
        started = next((r for r in job_rows.get(job_id, []) if r.kind in ("store", "load", "copy")), None)
        jobs.append(
            JobMark(
                job_id=job_id,
                kind=touch.kind if touch else "?",
                detail=started.detail if started else "",
                start_seq=touch.started_seq if touch else min(p.start_seq for p in pins if p.job_id == job_id),
                end_seq=touch.ended_seq if touch and touch.ended_seq is not None and touch.ended_seq <= last_seq else None,
                outcome=touch.outcome if touch else "in flight",
                blocks=sorted(job_blocks[job_id]),
            )
        )

    refusals = [
        mark
        for mark in (
            _refusal(row, rows.pool, set(job_blocks), step_of) for row in rows.refusals if first_seq <= row[0] <= last_seq
        )
        if mark is not None
    ]

    # Lanes: every slot with something to draw; past the cap, the busiest.
    activity: dict[int, int] = {}
    for block in [b.block for b in bars] + [p.block for p in pins] + [r.block for r in refusals if r.block is not None]:
        activity[block] = activity.get(block, 0) + 1
    kept = set(sorted(activity, key=lambda b: (-activity[b], b))[:max_slots])
    return Timeline(
        engine=rows.engine,
        pool=rows.pool,
        first_step=first_step,
        last_step=last_step,
        first_seq=first_seq,
        last_seq=last_seq,
        steps=steps,
        slots=sorted(kept),
        bars=sorted((b for b in bars if b.block in kept), key=lambda b: (b.block, b.start_seq)),
        pins=sorted((p for p in pins if p.block in kept), key=lambda p: (p.block, p.start_seq, p.job_id)),
        jobs=jobs,
        refusals=[r for r in refusals if r.block is None or r.block in kept],
        omitted_slots=len(activity) - len(kept),
    )


class _JobRowView(msgspec.Struct, frozen=True):
    """A kvl_audit_jobs row as `job_touch` reads it (attributes seq, kind, detail)."""

    seq: int
    kind: str
    detail: str


# Refusal texts name slots as "block P/B" (coordinator/core/decider.py, checks.py, jobs.py).
_NAMED_SLOT = re.compile(r"\b(?:block|destination|holds) (\d+)/(\d+)\b")
_NAMED_JOB = re.compile(r"^job (\d+)$")


def _refusal(row: EngineRefusalRow, pool: int, jobs: set[int], step_of: Callable[[int], int]) -> RefusalMark | None:
    """The mark of one refusal, on the slot it names; None when it concerns another pool only."""
    seq, kind, subject, reason, detail = row
    block: int | None = None
    named = _NAMED_SLOT.search(f"{subject} {detail}")
    if named is not None:
        if int(named[1]) != pool:
            return None
        block = int(named[2])
    job = _NAMED_JOB.match(subject)
    if job is not None and int(job[1]) not in jobs:
        return None  # a failed job that touched no slot of this pool
    return RefusalMark(seq=seq, step=step_of(seq), kind=kind, subject=subject, reason=reason, detail=detail, block=block)


# --- the index -> rows (the SQL shell) ----------------------------------------------------------


async def read_rows(
    event_log: SqlEventLog, *, pool: int, first_step: int, last_step: int, engine: str | None = None, max_steps: int = MAX_STEPS
) -> IndexRows:
    """The index's rows for one pool of one engine over steps first_step..last_step.

    Cost: the range's rows through the slot index, plus one scan of the pool's rows with
    allocations before the range (which generation each slot held when it began)."""
    audit = Audit(event_log)
    engine = await audit.engine(engine)
    s, st, j, r, o = (t.audit_slots.c, t.audit_steps.c, t.audit_jobs.c, t.audit_refusals.c, t.audit_owners.c)
    head = await audit.indexed()
    async with event_log.engine.connect() as conn:
        pools = [
            int(p)
            for p in (await conn.execute(sa.select(s.pool).where(s.engine == engine).distinct().order_by(s.pool))).scalars()
        ]
        if pool not in pools:
            raise NotFound(
                f"engine {engine!r} has no pool {pool} in the audit index "
                f"(pools with slots: {', '.join(map(str, pools)) or 'none'})"
            )
        # kvl_audit_steps has a row for every append; steps are those with a step number.
        in_range = sa.and_(st.engine == engine, st.step >= max(first_step, 0), st.step <= last_step)
        count = (await conn.execute(sa.select(sa.func.count()).where(in_range))).scalar() or 0
        if count == 0:
            known = (
                await conn.execute(sa.select(sa.func.min(st.step), sa.func.max(st.step)).where(st.engine == engine, st.step >= 0))
            ).one()
            have = "none" if known[0] is None else f"{known[0]}..{known[1]}"
            raise NotFound(f"engine {engine!r} has no steps in {first_step}..{last_step} (its steps: {have})")
        if count > max_steps:
            raise TimelineError(
                f"steps {first_step}..{last_step} are {count} steps; one picture draws at most {max_steps}: narrow --steps"
            )
        # Step numbers only grow within an engine (the decider refuses STEP_NOT_ADVANCING), so
        # sequence order is step order.
        steps = [
            StepSpan(int(x.step), int(x.first_seq), int(x.last_seq))
            for x in await conn.execute(sa.select(st.step, st.first_seq, st.last_seq).where(in_range).order_by(st.first_seq))
        ]
        following = (
            await conn.execute(
                sa.select(sa.func.min(st.first_seq)).where(st.engine == engine, st.step >= 0, st.first_seq > steps[-1].last_seq)
            )
        ).scalar()
        first_seq, last_seq = steps[0].first_seq, (int(following) - 1 if following is not None else max(head, steps[-1].last_seq))

        # Every touch in the range, and the touches before it of the generation each slot held
        # when it began (from its last allocation before the range).
        touches = await conn.run_sync(lambda sync: packed.pool_touches(sync, engine, pool, first_seq, last_seq))
        touches += await conn.run_sync(lambda sync: packed.held_before(sync, engine, pool, first_seq))
        slot_rows: list[PoolSlotRow] = [
            (block, generation, seq, kind, owner_id, job_id) for block, (seq, kind, generation, owner_id, job_id, _) in touches
        ]
        resets = [
            int(x)
            for x in (
                await conn.execute(
                    sa.select(t.audit_engines.c.seq).where(
                        t.audit_engines.c.engine == engine, t.audit_engines.c.kind == "reset", t.audit_engines.c.seq <= last_seq
                    )
                )
            ).scalars()
        ]
        owners = sorted({row[4] for row in slot_rows if row[4] is not None})
        req_ids: dict[int, str] = {}
        for chunk_owners in _chunks(owners, 500):
            for x in await conn.execute(
                sa.select(o.owner_id, o.req_id)
                .where(o.engine == engine, o.kind == "started", o.owner_id.in_(chunk_owners))
                .order_by(o.seq)
            ):
                req_ids[int(x.owner_id)] = str(x.req_id)
        job_ids = sorted({row[5] for row in slot_rows if row[5] is not None})
        jobs: list[JobEventRow] = []
        for chunk_jobs in _chunks(job_ids, 500):
            jobs += [
                (int(x.job_id), int(x.seq), str(x.kind), str(x.detail))
                for x in await conn.execute(sa.select(j.job_id, j.seq, j.kind, j.detail).where(j.job_id.in_(chunk_jobs)))
            ]
        refusals: list[EngineRefusalRow] = [
            (int(x.seq), str(x.kind), str(x.subject), str(x.reason), str(x.detail))
            for x in await conn.execute(
                sa.select(r.seq, r.kind, r.subject, r.reason, r.detail)
                .where(r.engine == engine, r.seq >= first_seq, r.seq <= last_seq)
                .order_by(r.seq)
            )
        ]
    return IndexRows(
        engine=engine,
        pool=pool,
        steps=steps,
        first_seq=first_seq,
        last_seq=last_seq,
        slots=slot_rows,
        resets=resets,
        req_ids=req_ids,
        jobs=jobs,
        refusals=refusals,
    )


def _chunks(items: Sequence[Any], size: int) -> Iterable[Sequence[Any]]:
    """Bounded IN lists (SQLite caps bound parameters)."""
    for start in range(0, len(items), size):
        yield items[start : start + size]


# --- all together -------------------------------------------------------------------------------


async def load_timeline(
    event_log: SqlEventLog,
    *,
    pool: int,
    first_step: int,
    last_step: int,
    engine: str | None = None,
    max_steps: int = MAX_STEPS,
    max_slots: int = MAX_SLOTS,
) -> Timeline:
    """The model of one pool's slots over steps first_step..last_step, from the audit index."""
    rows = await read_rows(event_log, pool=pool, first_step=first_step, last_step=last_step, engine=engine, max_steps=max_steps)
    return build_timeline(rows, max_slots=max_slots)
