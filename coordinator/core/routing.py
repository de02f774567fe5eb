"""Which committed decisions a worker acts on: a decision is a store, a load or a state copy,
numbered by its global sequence (workers resume after the last one they did), for the ranks of
its engine. Pure: the sidecar routes decisions with it (its hub and its step replies), and the
workers (gpu/worker.py) read them, neither knowing the other's internals.
"""

from __future__ import annotations

from collections.abc import Sequence

import msgspec

from events import Event, LoadJobStarted, StateCopyPlanned, StoreJobStarted

DecisionEvent = StoreJobStarted | LoadJobStarted | StateCopyPlanned
DECISION_TYPES = (StoreJobStarted, LoadJobStarted, StateCopyPlanned)


class Decision(msgspec.Struct, frozen=True, array_like=True, gc=False):
    """A committed decision and its global sequence: workers resume after the last one they did."""

    seq: int
    event: DecisionEvent


def decisions_for(events: Sequence[Event], first_seq: int, engine_id: str, rank: int) -> list[Decision]:
    """The decisions among one commit's events that the worker (engine_id, rank) must act on."""
    return [
        Decision(first_seq + index, event)
        for index, event in enumerate(events)
        if isinstance(event, DECISION_TYPES) and event.engine_id == engine_id and rank < event.world_size and _has_work(event)
    ]


def _has_work(event: DecisionEvent) -> bool:
    """A store with every key already published, or a copy plan with nothing to move, succeeds
    in the step that decides it: no worker has anything to do or report."""
    if isinstance(event, StoreJobStarted):
        return bool(event.items)
    if isinstance(event, StateCopyPlanned):
        return bool(event.batches)
    return True
