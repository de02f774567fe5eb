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
from coordinator.simulator.report import ALL_SCENARIOS
from coordinator.simulator.reported import MOONCAKE, REPORTED, colliding_images
from coordinator.simulator.scenarios import SCENARIOS, Outcome, Scenario, _foreign_namespace, namespace, run_scenario
from events import Event, EventCodec, KeyPublished, LoadJobStarted, StateCopyPlanned, StoreJobStarted
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


@pytest.mark.parametrize("name", sorted(ALL_SCENARIOS))
def test_each_scenario_bites_with_its_protection_off_and_is_prevented_with_it_on(name: str, tmp_path: Path) -> None:
    scenario = ALL_SCENARIOS[name]
    if name in {p.value for p in Protection}:
        assert scenario.protection == Protection(name), "a scenario named after a protection switches off that one"
    assert scenario.report, "every scenario names the report it reproduces"
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
        written_on = [op.dst.block for batch in plan_on.batches for op in batch.ops()]
        written_off = [op.dst.block for batch in plan_off.batches for op in batch.ops()]
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
        loads_off = [e for e in events_off if isinstance(e, LoadJobStarted)]
        assert not any(load.pinned for load in loads_off), "the unprotected load is recorded as unpinned"
        assert all(load.pinned for load in events_on if isinstance(load, LoadJobStarted))
    if scenario.protection == Protection.PUBLISH_WHEN_COMPLETE:
        # Off: the keys exist from the store's start, without checksums; on: never without them.
        assert [e.checksums for e in events_off if isinstance(e, KeyPublished)][-2:] == [[], []]
        assert all(e.checksums for e in events_on if isinstance(e, KeyPublished))


def test_a_baseline_never_includes_the_protection_it_toggles_and_only_layered_scenarios_have_one() -> None:
    with_baseline = {name: scenario.baseline for name, scenario in ALL_SCENARIOS.items() if scenario.baseline}
    assert with_baseline == {
        "lease-expiry-during-slow-load": frozenset({Protection.CHECKSUMS}),
        "eviction-under-store-pressure": frozenset({Protection.LEASES}),
        "store-reported-before-copy-fence": frozenset({Protection.CHECKSUMS}),
        "batch-get-skips-lease-check": frozenset({Protection.CHECKSUMS}),
    }
    assert all(scenario.protection not in scenario.baseline for scenario in ALL_SCENARIOS.values())
    named = set(ALL_SCENARIOS) | set(MOONCAKE)
    assert {p.value for p in Protection} <= named, "every protection has a scenario named after it"
    assert all(scenario.protection not in scenario.baseline for scenario in MOONCAKE.values())
    assert set(SCENARIOS) <= {p.value for p in Protection}, "each seed's scenario has a protection of its own"
    assert not set(SCENARIOS) & set(REPORTED)
    assert len(REPORTED) >= 10


def test_the_colliding_images_differ_and_share_their_first_16_bits() -> None:
    first, second = colliding_images()
    assert first != second and first[:4] == second[:4] and len(first) == len(second) == 64


def test_engines_of_other_tensor_parallel_sizes_are_caught_by_the_checksums_too(tmp_path: Path) -> None:
    """What parallel-layouts-share-keys says of TP1 against TP2: with the namespace blind to the
    parallel layout, the keys are shared, but a TP1 load of a TP2 store has one checksum per
    rank where two were published, and fails; nothing wrong is read."""

    async def tp1_loads_tp2(sim: object) -> None:
        await _foreign_namespace(sim, namespace(tp=1))  # type: ignore[arg-type]

    scenario = msgspec.structs.replace(REPORTED["parallel-layouts-share-keys"], run=tp1_loads_tp2)
    outcome = anyio.run(lambda: run_scenario(scenario, protection_on=False, directory=tmp_path))
    assert outcome.protections_off == [Protection.NAMESPACE_PARALLEL.value]
    assert outcome.wrong_reads == 0 and outcome.refusals.get("JobFailed:checksum_mismatch") == 1, outcome


@pytest.mark.parametrize(
    ("name", "caught"),
    [
        # The lease expired: r1's keys are evicted and their slots reused; the worker's checksum
        # check finds r3's bytes and copies nothing.
        ("lease-expiry-during-slow-load", "JobFailed:checksum_mismatch"),
        # The lease is live: r1's keys stay, r3's store is refused and the load lands intact.
        ("eviction-under-store-pressure", "Refused:tier_full"),
        # A batch load, the same way as the single one above.
        ("batch-get-skips-lease-check", "JobFailed:checksum_mismatch"),
    ],
)
@pytest.mark.parametrize("only_own_off", [True, False])
def test_leases_and_checksums_are_layered_either_one_alone_prevents_the_wrong_read(
    name: str, caught: str, only_own_off: bool, tmp_path: Path
) -> None:
    """Why these scenarios have a baseline: without it, with only the scenario's own protection
    off (or every protection on), the other layer still stops the wrong read."""
    scenario = msgspec.structs.replace(ALL_SCENARIOS[name], baseline=frozenset())
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


def test_with_the_store_fence_off_the_checksums_alone_catch_the_garbled_block(tmp_path: Path) -> None:
    """store-reported-before-copy-fence's baseline: with only the fence off, the copy that ran
    after the report wrote the next request's bytes, and the load finds they differ from the
    checksum the store reported: it fails, the key is quarantined, nothing wrong is read."""
    scenario = msgspec.structs.replace(REPORTED["store-reported-before-copy-fence"], baseline=frozenset())
    outcome = anyio.run(lambda: run_scenario(scenario, protection_on=False, directory=tmp_path))
    assert outcome.protections_off == [Protection.STORE_FENCE.value]
    assert outcome.wrong_reads == 0, outcome
    assert outcome.refusals.get("JobFailed:checksum_mismatch") == 1, outcome.refusals
