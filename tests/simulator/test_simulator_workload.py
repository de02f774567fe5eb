"""The mixed workload (coordinator/simulator/workload.py), small: two engines on one namespace
and one tier, tensor-parallel workers, every protection on. No wrong-KV read, every feature
exercised, refusals only where pressure explains them, the log replays to the live state, and
the same seed runs the same way twice."""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest

from coordinator.core.state import state_digest
from coordinator.ledger.recovery import replay
from coordinator.simulator.harness import Simulation
from coordinator.simulator.workload import TIER_SLOTS, WorkloadReport, run_workload
from events import EventCodec

pytestmark = pytest.mark.anyio

STEPS = 70
SEED = 7

EXPLAINED = {
    "Refused:pool_exhausted": "an allocation counted on a preempted request's blocks that a store in flight still pins (I3)",
    "Refused:tier_full": "every tier slot is leased or being stored",
    "Refused:encoder_cache_full": "the encoder cache holds only referenced images",
    "Refused:key_not_published": "another engine's store evicted a key between the lookup and the load",
    "NoticeDropped:reallocated_in_step": "a freed block (or encoder entry) was allocated again in the same step (I14)",
    "FencedRankDone:late_report": "a store in flight at the reset reported after it: fenced, its slots kept until then (I16)",
    "NoticeDropped:stale_job": "a repeated late report of a fenced job (I16)",
}
"""What pressure (and the one reset) explains. Seen at SEED and STEPS: reallocated_in_step and
stale_job; at other seeds and sizes key_not_published and pool_exhausted too."""

TIMINGS = ("wall_seconds", "coordinator_seconds", "events_per_second", "step_latency_p50_ms", "step_latency_p99_ms")


async def run(directory: Path, *, seed: int = SEED, late_loads_at_reset: bool = False) -> WorkloadReport:
    """One small run; inside it, the log replays to exactly the sidecar's live state (I18)."""
    directory.mkdir()
    async with Simulation(directory, frozenset(), tier_slots=TIER_SLOTS) as sim:
        report = await run_workload(sim, engines=2, steps=STEPS, seed=seed, world_size=2, late_loads_at_reset=late_loads_at_reset)
        assert sim.log is not None and sim.sidecar is not None
        replayed, _ = await replay(sim.log, EventCodec())
        assert state_digest(replayed) == state_digest(sim.sidecar.ledger.state)
        assert replayed.last_event == report.events
    return report


def counts(report: WorkloadReport) -> dict[str, object]:
    return {name: value for name, value in msgspec.structs.asdict(report).items() if name not in TIMINGS}


async def test_mixed_workload_reads_no_wrong_kv_and_exercises_everything(tmp_path: Path) -> None:
    report = await run(tmp_path / "first")
    print(msgspec.json.encode(report).decode())
    assert report.wrong_reads == 0, report
    assert report.loads_checked > 0 and report.hits > 0 and report.encoder_reads > 0
    assert report.cross_engine_hits > 0, "one engine's stores are the other's hits"
    assert report.preemptions > 0
    assert report.evictions > 0 and report.stores > 0
    assert report.resets == 1
    assert report.blocks_verified > 0 and report.finished > 0
    assert report.engine_steps == {"wl-0": STEPS, "wl-1": STEPS}
    assert report.steps == 2 * STEPS
    unexplained = set(report.refusals) - set(EXPLAINED)
    assert not unexplained, f"refusals that pressure does not explain: {unexplained} in {report.refusals}"
    assert "NoticeDropped:reallocated_in_step" in report.refusals
    assert "FencedRankDone:late_report" in report.refusals, "the reset came with a store in flight"
    assert report.events > 0 and report.coordinator_seconds > 0 and report.step_latency_p99_ms >= report.step_latency_p50_ms

    again = await run(tmp_path / "again")
    assert counts(again) == counts(report), "the same seed must run the same way"


async def test_I16_a_load_in_flight_across_a_reset_does_not_land_in_a_recycled_block(tmp_path: Path) -> None:
    """Found by this workload: a reset used to free the slots of loads still in flight, so a late
    load overwrote a block another request held by then. Fenced jobs now keep their slots pinned
    until every rank reports."""
    report = await run(tmp_path / "late", late_loads_at_reset=True)
    assert report.refusals.get("FencedRankDone:late_report", 0) >= 2, "no job was in flight across the reset"
    assert report.wrong_reads == 0, report


def test_percentiles_are_nearest_rank_as_the_benchmarks_take_them() -> None:
    from coordinator.simulator.workload import percentile

    hundred = [float(v) for v in range(1, 101)]
    assert (percentile(hundred, 0.50), percentile(hundred, 0.99), percentile(hundred, 1.0)) == (50.0, 99.0, 100.0)
    assert percentile([7.0], 0.99) == 7.0 and percentile([], 0.5) == 0.0
    assert percentile([1.0, 2.0, 3.0], 0.5) == 2.0  # rank ceil(1.5) = 2, no interpolation
