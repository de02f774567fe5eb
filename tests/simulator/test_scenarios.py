"""Every fault scenario at a small size: with its protection off it must produce wrong-KV reads
(counted from the bytes the workers left in the pools), with it on none, and the on run must
show what kvledger did instead (the scenario's evidence)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import anyio
import msgspec
import pytest

from coordinator.core.protections import Protection
from coordinator.ledger.recovery import replay
from coordinator.simulator.scenarios import SCENARIOS, Outcome, Scenario, run_scenario
from events import Event, EventCodec, StateCopyPlanned, StoreJobStarted
from events.log import open_log
from tests.kit.sidecar import ROOT


def both(scenario: Scenario, tmp_path: Path) -> tuple[Outcome, Outcome]:
    async def run() -> tuple[Outcome, Outcome]:
        on = await run_scenario(scenario, protection_on=True, directory=tmp_path / "on")
        off = await run_scenario(scenario, protection_on=False, directory=tmp_path / "off")
        return on, off

    for sub in ("on", "off"):
        (tmp_path / sub).mkdir()
    return anyio.run(run)


async def decided(log: Path) -> list[Event]:
    event_log = await open_log(str(log))
    try:
        from events.log.reading import decode

        codec = EventCodec()
        events = [decode(codec, s) for s in await event_log.read(0, 1_000_000)]
        await replay(event_log, codec)  # the log replays cleanly (I18)
        return events
    finally:
        await event_log.close()


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_each_scenario_bites_with_its_protection_off_and_is_prevented_with_it_on(name: str, tmp_path: Path) -> None:
    scenario = SCENARIOS[name]
    assert scenario.protection == Protection(name), "a scenario switches off exactly its own protection"
    on, off = both(scenario, tmp_path)
    baseline = sorted(p.value for p in scenario.baseline)
    assert on.baseline == off.baseline == baseline
    assert on.protections_off == baseline, "the on run switches off the baseline only"
    assert off.protections_off == sorted([*baseline, scenario.protection.value]), "the off run adds exactly one"
    assert off.wrong_reads > 0, f"{name}: the scenario did not bite with the protection off: {off}"
    assert on.wrong_reads == 0, f"{name}: wrong-KV reads with the protection on: {on}"
    assert on.loads_checked or on.refusals, "the on run checked nothing"
    if scenario.evidence.startswith(("Refused:", "NoticeDropped:", "JobFailed:", "KeyQuarantined:", "FencedRankDone:")):
        assert scenario.evidence in on.refusals, f"{name}: expected {scenario.evidence} in {on.refusals}"
        assert scenario.evidence not in off.refusals
    events_on = anyio.run(decided, Path(on.log))
    events_off = anyio.run(decided, Path(off.log))
    if scenario.protection == Protection.ORDERED_COPIES:
        [plan_on] = [e for e in events_on if isinstance(e, StateCopyPlanned)]
        [plan_off] = [e for e in events_off if isinstance(e, StateCopyPlanned)]
        written_on = [op.dst.block for batch in plan_on.batches for op in batch]
        written_off = [op.dst.block for batch in plan_off.batches for op in batch]
        # Off runs the moves as given (b := a, then c := b); on orders the reader first (c := b).
        assert [len(batch) for batch in plan_on.batches] == [1, 1] and plan_on.scratch_bytes == 0
        assert written_on == list(reversed(written_off)) and written_off == plan_off.destinations
    if scenario.protection == Protection.WHOLE_UNITS:
        # On: the hit stops at 32 tokens (two attention blocks and the state at 32); off: at 48.
        assert (on.loads_checked, off.loads_checked) == (3, 4)
    if scenario.protection == Protection.PINS:
        stores_off = [e for e in events_off if isinstance(e, StoreJobStarted)]
        assert stores_off and not any(s.pinned for s in stores_off), "the unprotected store is recorded as unpinned"
        assert all(s.pinned for s in events_on if isinstance(s, StoreJobStarted))


def test_a_baseline_never_includes_the_protection_it_toggles_and_only_layered_scenarios_have_one() -> None:
    with_baseline = {name: scenario.baseline for name, scenario in SCENARIOS.items() if scenario.baseline}
    assert with_baseline == {
        "lease-expiry-during-slow-load": frozenset({Protection.CHECKSUMS}),
        "eviction-under-store-pressure": frozenset({Protection.LEASES}),
    }
    assert all(scenario.protection not in scenario.baseline for scenario in SCENARIOS.values())
    assert set(SCENARIOS) == {p.value for p in Protection}, "one scenario per protection"


@pytest.mark.parametrize(
    ("name", "caught"),
    [
        # The lease expired: r1's keys are evicted and their slots reused; the worker's checksum
        # check finds r3's bytes and copies nothing.
        ("lease-expiry-during-slow-load", "JobFailed:checksum_mismatch"),
        # The lease is live: r1's keys stay, r3's store is refused and the load lands intact.
        ("eviction-under-store-pressure", "Refused:tier_full"),
    ],
)
@pytest.mark.parametrize("only_own_off", [True, False])
def test_leases_and_checksums_are_layered_either_one_alone_prevents_the_wrong_read(
    name: str, caught: str, only_own_off: bool, tmp_path: Path
) -> None:
    """Why these scenarios have a baseline: without it, with only the scenario's own protection
    off (or every protection on), the other layer still stops the wrong read."""
    scenario = msgspec.structs.replace(SCENARIOS[name], baseline=frozenset())
    outcome = anyio.run(lambda: run_scenario(scenario, protection_on=not only_own_off, directory=tmp_path))
    assert outcome.protections_off == ([scenario.protection.value] if only_own_off else [])
    assert outcome.wrong_reads == 0, outcome
    assert caught in outcome.refusals, outcome.refusals
    if caught == "Refused:tier_full":
        assert outcome.loads_checked == 2  # the load succeeded and its bytes were checked


def test_serve_refuses_to_start_with_protections_off(tmp_path: Path) -> None:
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "coordinator.cli",
            "serve",
            "--socket",
            str(tmp_path / "s.sock"),
            "--log",
            str(tmp_path / "l.sqlite"),
            "--http",
            "off",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        env={"PATH": "/usr/bin:/bin", "KVLEDGER_DATA_DIR": str(tmp_path), "KVLEDGER_PROTECTIONS_OFF": "pins"},
    )
    assert run.returncode == 2 and "only inside `kvledger simulate`" in run.stderr
    assert not (tmp_path / "s.sock").exists()


def test_kvledger_simulate_prints_one_json_line_per_run_and_exits_0(tmp_path: Path) -> None:
    run = subprocess.run(
        [sys.executable, "-m", "coordinator.cli", "simulate", "--json", "--scenario", "overlapping-state-copy"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        env={"PATH": "/usr/bin:/bin", "KVLEDGER_DATA_DIR": str(tmp_path)},
    )
    assert run.returncode == 0, run.stderr
    on, off = (msgspec.json.decode(line, type=Outcome) for line in run.stdout.splitlines())
    assert (on.protection_on, off.protection_on) == (True, False)
    assert on.wrong_reads == 0 < off.wrong_reads
