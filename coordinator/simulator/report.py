"""Running the scenarios on and off, and showing the outcome as a table (for `kvledger simulate`
and `kvledger demo`)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from rich.table import Table

from coordinator.core.protections import Protection
from coordinator.simulator.harness import Simulation
from coordinator.simulator.reported import REPORTED
from coordinator.simulator.scenarios import SCENARIOS, Outcome, Scenario, run_scenario
from coordinator.simulator.workload import TIER_SLOTS, WorkloadReport, run_workload

Pair = tuple[Outcome, Outcome]
"""(protection on, protection off)."""

ALL_SCENARIOS = {**SCENARIOS, **REPORTED}
"""The seeds' scenarios, then the failures users reported (coordinator/simulator/reported.py)."""


async def run_scenarios(chosen: Sequence[Scenario] | None = None, keep: Path | None = None) -> list[Pair]:
    """Each scenario on a fresh simulation with its protection on, then off (its baseline off in
    both runs); by default the seeds'. With `keep`, each run's log stays in keep/NAME-on and
    keep/NAME-off."""
    results = []
    for scenario in chosen or list(SCENARIOS.values()):
        runs = []
        for protection_on in (True, False):
            where = None
            if keep is not None:
                where = keep / f"{scenario.name}-{'on' if protection_on else 'off'}"
                where.mkdir(parents=True, exist_ok=True)
                for stale in where.glob("log.sqlite*"):
                    stale.unlink()
            runs.append(await run_scenario(scenario, protection_on=protection_on, directory=where))
        results.append((runs[0], runs[1]))
    return results


def scenario_table(results: Sequence[Pair], title: str) -> Table:
    table = Table(title=title)
    for column in (
        "scenario",
        "report",
        "invariant",
        "baseline off (both runs)",
        "requests",
        "wrong reads off",
        "wrong reads on",
        "what kvledger recorded instead (on)",
        "events/s (on)",
    ):
        table.add_column(column, overflow="fold")
    for on, off in results:
        recorded = ", ".join(f"{reason} x{count}" for reason, count in on.refusals.items()) or on.evidence or "-"
        table.add_row(
            on.scenario,
            on.report,
            on.invariant,
            ", ".join(Protection(value).name.lower() for value in on.baseline) or "-",
            str(on.requests),
            f"[bold red]{off.wrong_reads}[/]" if off.wrong_reads else "0",
            f"[bold red]{on.wrong_reads}[/]" if on.wrong_reads else "[green]0[/]",
            recorded,
            f"{on.events / on.seconds:,.0f}" if on.seconds else "-",
        )
    return table


def not_holding(results: Sequence[Pair]) -> list[str]:
    """Scenarios whose on run read wrong KV, or whose off run did not (the scenario must bite)."""
    return [on.scenario for on, off in results if on.wrong_reads or not off.wrong_reads]


async def mixed_workload(*, engines: int, steps: int, seed: int = 7, keep: Path | None = None) -> WorkloadReport:
    """The mixed workload, every protection on; with `keep`, its log stays in keep/."""
    if keep is not None:
        keep.mkdir(parents=True, exist_ok=True)
        for stale in keep.glob("log.sqlite*"):
            stale.unlink()
    async with Simulation(keep, frozenset(), tier_slots=TIER_SLOTS) as sim:
        return await run_workload(sim, engines=engines, steps=steps, seed=seed)


def workload_table(report: WorkloadReport, title: str) -> Table:
    table = Table(title=title)
    for column in (
        "steps",
        "requests",
        "events",
        "wrong reads",
        "loads checked",
        "hits",
        "preemptions",
        "evictions",
        "events/s",
        "step p50 / p99",
        "coordinator share",
        "what kvledger refused or dropped",
    ):
        table.add_column(column, overflow="fold")
    share = report.coordinator_seconds / report.wall_seconds if report.wall_seconds else 0.0
    table.add_row(
        str(report.steps),
        str(report.requests),
        f"{report.events:,}",
        f"[bold red]{report.wrong_reads}[/]" if report.wrong_reads else "[green]0[/]",
        str(report.loads_checked),
        str(report.hits),
        str(report.preemptions),
        str(report.evictions),
        f"{report.events_per_second:,.0f}",
        f"{report.step_latency_p50_ms:.2f} / {report.step_latency_p99_ms:.2f} ms",
        f"{share:.0%}",
        ", ".join(f"{k} x{v}" for k, v in sorted(report.refusals.items())) or "-",
    )
    return table
