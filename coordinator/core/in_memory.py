"""The pure core in one object: decide a command, fold what was decided, keep the events."""

from __future__ import annotations

from collections.abc import Sequence

from coordinator.core.commands import AnyCommand
from coordinator.core.decider import decide
from coordinator.core.projector import project
from coordinator.core.protections import Protection, switched_off
from coordinator.core.state import State
from coordinator.core.step import run_step
from events import Event


class CoordinatorCore:
    """Decider + projector over one in-memory state; `events` is everything ever emitted.

    The log (issue 3) and the sidecar wrap this: they persist each step's events before
    acting on them. Nothing here does I/O.
    """

    def __init__(
        self, state: State | None = None, *, keep_events: bool = True, protections_off: frozenset[Protection] = frozenset()
    ) -> None:
        self.state = State() if state is None else state
        self.protections_off = protections_off
        """Empty in production; the simulator's fault scenarios switch one off."""
        self.events: list[Event] = []
        """Everything emitted, for tests and the demo; a long-running service passes
        keep_events=False because its events live in the log."""
        self._keep_events = keep_events

    def execute(self, command: AnyCommand) -> list[Event]:
        """Decide one command against the current state, then fold its events in order."""
        if self.protections_off:
            with switched_off(self.protections_off):
                events = decide(self.state, command)
        else:
            events = decide(self.state, command)
        project(events, self.state)  # one fold loop for the command's events, not a call each
        if self._keep_events:
            self.events.extend(events)
        return events

    def record(self, events: Sequence[Event]) -> None:
        """Fold events decided elsewhere (records of reads answered outside a step: no state changes)."""
        project(events, self.state)
        if self._keep_events:
            self.events.extend(events)

    def run_step(self, engine_id: str, step: int, clock: float, commands: Sequence[AnyCommand]) -> list[Event]:
        """One scheduler iteration: begin, the commands in order, end-of-step reconciliation."""
        return run_step(self.execute, engine_id, step, clock, commands).all()
