"""The step sequence, written once: BeginStep, the step's commands in order, EndStep (I14: the
end of a step reconciles what it freed), and the stream each command's events are written to.
The in-memory core (in_memory.py), the ledger (coordinator/ledger/ledger.py) and the benchmarks run
steps through `run_step`. Pure."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple

from coordinator.core.commands import AnyCommand, BeginStep, DecideNamespace, DeclareTier, EndStep, ReleaseNamespace, ReportRank
from coordinator.core.state import State
from events import Event

NAMESPACE_STREAM = "namespaces"
"""The stream of namespace decisions (they name no engine)."""


class StepEvents(NamedTuple):
    """What one step decided: its beginning, each command's events in order, its end."""

    began: list[Event]
    results: list[list[Event]]
    ended: list[Event]

    def all(self) -> list[Event]:
        return self.began + [event for result in self.results for event in result] + self.ended


def run_step(
    execute: Callable[[AnyCommand], list[Event]], engine_id: str, step: int, clock: float, commands: Sequence[AnyCommand]
) -> StepEvents:
    """One scheduler iteration of `engine_id`, each command decided (and folded) by `execute`."""
    began = execute(BeginStep(engine_id=engine_id, step=step, clock=clock))
    results = [execute(command) for command in commands]
    ended = execute(EndStep(engine_id=engine_id))
    return StepEvents(began, results, ended)


def stream_for(state: State, command: AnyCommand) -> str:
    """Each engine writes its own stream; tiers have theirs; a report joins its job's engine;
    namespace decisions go to one stream of their own."""
    if isinstance(command, DeclareTier):
        return f"tier/{command.spec.name}"
    if isinstance(command, (DecideNamespace, ReleaseNamespace)):
        return NAMESPACE_STREAM
    if isinstance(command, ReportRank):
        job = state.jobs.get(command.job_id)
        if job is None and command.job_id in state.fenced:
            job = state.fenced[command.job_id].job
        return f"engine/{job.decision.engine_id}" if job is not None else "reports"
    return f"engine/{command.engine_id}"
