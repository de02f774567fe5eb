"""The step sequence, written once: BeginStep, the step's commands in order, EndStep (I14: the
end of a step reconciles what it freed), and the stream each command's events are written to.
The in-memory core (in_memory.py) and the ledger (coordinator/ledger/ledger.py) run steps
through `run_step`; the demo and ops/bench/memory.py, whose commands each need the events of the
last, through `stepping`. Pure."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import NamedTuple

from coordinator.core.commands import AnyCommand, BeginStep, DecideNamespace, DeclareTier, EndStep, ReleaseNamespace, ReportRank
from coordinator.core.state import State
from events import Event

NAMESPACE_STREAM = "namespaces"
"""The stream of namespace decisions (they name no engine)."""
MAX_STREAM_ID = 255
"""Characters of a stream id: the log's column (kvl_steps.stream_id) holds no more."""
REFUSED_NAMES_STREAM = "refused-names"
"""Where the events of an engine or a tier whose name cannot be in a stream id go: longer than
MAX_STREAM_ID, or holding a NUL (PostgreSQL's text holds none). Each such engine or tier is
refused (checks.stream_name), and its refusals are recorded here. Written to a stream named by
the name itself, PostgreSQL refused each of them at the append, failing its whole group (an
adversarial review, session 31)."""


class StepEvents(NamedTuple):
    """What one step decided: its beginning, each command's events in order, its end."""

    began: list[Event]
    results: list[list[Event]]
    ended: list[Event]

    def all(self) -> list[Event]:
        return self.began + [event for result in self.results for event in result] + self.ended


@contextmanager
def stepping(execute: Callable[[AnyCommand], list[Event]], engine_id: str, step: int, clock: float) -> Iterator[StepEvents]:
    """One scheduler iteration of `engine_id` whose commands the caller decides one at a time
    (each may need the events of the last, as an engine's scheduler does): BeginStep on entry,
    EndStep on a clean exit. The caller appends each command's events to `results`; `ended` holds
    the end of the step's after the block. A block that raises ends no step."""
    events = StepEvents(execute(BeginStep(engine_id=engine_id, step=step, clock=clock)), [], [])
    yield events
    events.ended.extend(execute(EndStep(engine_id=engine_id)))


def run_step(
    execute: Callable[[AnyCommand], list[Event]], engine_id: str, step: int, clock: float, commands: Sequence[AnyCommand]
) -> StepEvents:
    """One scheduler iteration of `engine_id`, each command decided (and folded) by `execute`.
    `stepping` written out: no generator context manager around every step (a command that
    raises ends no step, as there)."""
    began = execute(BeginStep(engine_id=engine_id, step=step, clock=clock))
    results = [execute(command) for command in commands]
    return StepEvents(began, results, execute(EndStep(engine_id=engine_id)))


def engine_stream(engine_id: str) -> str:
    """The stream an engine's steps, and every decision for its workers, are committed to."""
    return _bounded(f"engine/{engine_id}")


def _bounded(stream: str) -> str:
    return stream if len(stream) <= MAX_STREAM_ID and "\x00" not in stream else REFUSED_NAMES_STREAM


def stream_for(state: State, command: AnyCommand) -> str:
    """Each engine writes its own stream; tiers have theirs; a report joins its job's engine;
    namespace decisions go to one stream of their own."""
    if isinstance(command, DeclareTier):
        return _bounded(f"tier/{command.spec.name}")
    if isinstance(command, (DecideNamespace, ReleaseNamespace)):
        return NAMESPACE_STREAM
    if isinstance(command, ReportRank):
        job = state.jobs.get(command.job_id)
        if job is None and command.job_id in state.fenced:
            job = state.fenced[command.job_id].job
        return engine_stream(job.decision.engine_id) if job is not None else "reports"
    return engine_stream(command.engine_id)
