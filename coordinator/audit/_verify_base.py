"""The verifier's base: where a violation is reported, and the evidence indexes the checks share.

Pure (coordinator/audit/verify.py). The checks live in _verify_blocks.py (declarations, steps,
owners and blocks, lookups, copy plans) and _verify_jobs.py (jobs and tiers).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import msgspec

from coordinator.core.describe import describe
from coordinator.core.state import EngineState, JobState, State
from events import NULL_BLOCK_ID, BlockRef, Event

Slot = tuple[str, int, int]
"""(engine, pool, block)."""
TierKey = tuple[str, int, bytes]
"""(tier, pool, key)."""


class Violation(msgspec.Struct, frozen=True, kw_only=True):
    """One event that broke an invariant."""

    invariant: str
    """"I1" .. "I18" (DESIGN.md)."""
    seq: int
    """The global sequence of the offending event."""
    step: int
    """The engine step it belongs to: its append's step, or for an append outside a step (a
    worker's report, a reset) the engine's last step begun; -1 when there is none."""
    engine: str
    """The stream's engine ("" for a stream of no engine)."""
    message: str
    evidence: list[str] = []
    """The events involved, each as "seq N: what happened", the offending one first."""


class At(msgspec.Struct, frozen=True):
    """Where a check looks: the event (None for the end of the log) and its place."""

    seq: int
    step: int
    engine: str
    event: Event | None


class Checks:
    """The replayed state, the violations found, and the indexes evidence is drawn from."""

    def __init__(self, max_violations: int) -> None:
        self.state = State()
        self.violations: list[Violation] = []
        """The first `max_violations` violations, in log order."""
        self.violation_count = 0
        """Every violation found, kept or not."""
        self._max = max_violations
        # Evidence: where things happened, and which slots each job in flight touches (I3).
        self._job_seq: dict[int, int] = {}
        self._report_seq: dict[int, dict[int, int]] = {}
        self._job_slots: dict[int, list[Slot]] = {}
        self._busy: dict[Slot, dict[int, None]] = {}
        self._alloc_seq: dict[Slot, int] = {}
        self._published_seq: dict[TierKey, int] = {}
        self._evicted_seq: dict[TierKey, int] = {}
        self._evicted_in_append: dict[TierKey, tuple[int, list[bytes]]] = {}
        self._encoder_seq: dict[tuple[str, str], int] = {}
        self._reset_seq: dict[str, int] = {}

    def _flag(self, invariant: str, at: At, message: str, evidence: Sequence[str] | None = None) -> None:
        self.violation_count += 1
        if len(self.violations) >= self._max:
            return
        shown = [] if at.event is None else [f"seq {at.seq}: {describe(at.event)}"]
        self.violations.append(
            Violation(
                invariant=invariant,
                seq=at.seq,
                step=at.step,
                engine=at.engine,
                message=message,
                evidence=[*shown, *(evidence or [])],
            )
        )

    def _job_evidence(self, job_ids: Sequence[int]) -> list[str]:
        shown = []
        for job_id in job_ids:
            job = self.state.jobs.get(job_id) or (self.state.fenced[job_id].job if job_id in self.state.fenced else None)
            seq = self._job_seq.get(job_id)
            if job is not None and seq is not None:
                shown.append(f"seq {seq}: {describe(job.decision)}")
        return shown

    @staticmethod
    def _seen(seq: int | None, what: str) -> list[str]:
        return [] if seq is None else [f"seq {seq}: {what}"]

    def _current(self, at: At, engine: EngineState | None, ref: BlockRef, what: str, *, null_ok: bool = False) -> bool:
        """I1/I2 for a reference to an existing block: True when it names a real slot."""
        if engine is None or ref.pool_id not in engine.pools:
            return False
        pool = engine.pools[ref.pool_id]
        if ref.block_id == NULL_BLOCK_ID:
            if not null_ok:
                self._flag("I2", at, f"{what} the null block {ref_text(ref)}")
            return False
        if not 0 < ref.block_id < pool.spec.num_blocks:
            return False
        if ref.generation != pool.generations[ref.block_id]:
            slot = (engine.engine_id, ref.pool_id, ref.block_id)
            self._flag(
                "I1",
                at,
                f"{what} {ref_text(ref)}, a stale generation: the slot is at generation {pool.generations[ref.block_id]}",
                self._seen(self._alloc_seq.get(slot), f"{ref_text(pool.ref(ref.block_id))} allocated"),
            )
        return True

    def _started(self, job_id: int, slots: list[Slot], at: At) -> None:
        self._job_seq[job_id] = at.seq
        self._job_slots[job_id] = slots
        for slot in slots:
            self._busy.setdefault(slot, {})[job_id] = None

    def _not_in_flight(self, job_id: int, what: str, at: At) -> None:
        if job_id in self.state.fenced:
            self._flag(
                "I16",
                at,
                f"{what} for job {job_id}, which was fenced: a fenced job's late report is dropped",
                self._job_evidence([job_id]),
            )
        else:
            state = "never started" if job_id >= self.state.next_job_id else "finished"
            self._flag("I4", at, f"{what} for job {job_id}, which is not in flight ({state})")

    def _old_incarnation(self, job: JobState, what: str, at: At) -> None:
        decision = job.decision
        engine = self.state.engines.get(decision.engine_id)
        if engine is not None and decision.incarnation != engine.incarnation:
            self._flag(
                "I16",
                at,
                f"{what}: job {job.job_id} belongs to incarnation {decision.incarnation} of "
                f"{decision.engine_id}, which is at {engine.incarnation} (the job was never fenced)",
                [
                    *self._seen(self._reset_seq.get(decision.engine_id), f"engine {decision.engine_id} reset"),
                    *self._job_evidence([job.job_id]),
                ],
            )

    def _job_and_reports(self, job_id: int) -> Callable[[], list[str]]:
        """The job's decision and reports as evidence, built only if a violation needs it."""
        return lambda: [*self._job_evidence([job_id]), *self._reports_evidence(job_id)]

    def _reports_evidence(self, job_id: int) -> list[str]:
        return [f"seq {seq}: job {job_id} rank {rank} reported" for rank, seq in sorted(self._report_seq.get(job_id, {}).items())]


def ref_text(ref: BlockRef) -> str:
    return f"{ref.pool_id}/{ref.block_id}@g{ref.generation}"


def hexes(keys: Sequence[bytes]) -> str:
    return ", ".join(key.hex() for key in dict.fromkeys(keys))
