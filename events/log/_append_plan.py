"""What one append writes, decided before anything is written: the same rules on every SQL log.

A batch whose command id the log already holds (from an earlier append, or from a batch before
it in this append) is answered with that first result and writes nothing; any other batch must
find its stream at its expected version (the versions its earlier batches in this append left
counting), and takes the next global sequences. A wrong expected head or version refuses the
whole append. SQLite looks each stream and command id up with a statement when asked
(events/log/_sql.py); PostgreSQL looks them all up in one statement first
(events/log/_postgres_append.py).
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Sequence
from itertools import islice

import msgspec

from events.log._contract import AppendBatch, AppendResult, HeadMoved, WrongExpectedVersion

PackedStep = tuple[str, bytes, bytes, list[str], int]
"""A batch's events as its kvl_steps row holds them (schemas, header, payload), their ids, and the
row's codec."""

StepRow = tuple[int, int, str, int, int, float, str, bytes, bytes, int]
"""kvl_steps' columns in table order."""


class AppendPlan:
    """One append's answers and the rows that make them true."""

    __slots__ = ("results", "steps", "versions", "commands")

    def __init__(self) -> None:
        self.results: list[AppendResult] = []
        """Each batch's answer, in batch order."""
        self.steps: list[tuple[StepRow, list[str]]] = []
        """Each kvl_steps row to insert, with its events' ids."""
        self.versions: dict[str, tuple[int, bool]] = {}
        """stream -> (its version after the append, whether the log held the stream before)."""
        self.commands: list[tuple[str, AppendResult]] = []
        """Each command id to record, with its batch's result."""


def plan_append(
    batches: Sequence[AppendBatch],
    packed: Sequence[PackedStep | None],
    head: int,
    expected_head: int | None,
    version_of: Callable[[str], int | None],
    command_of: Callable[[str], AppendResult | None],
) -> AppendPlan:
    """The plan of an append on a log at `head`, whose streams' versions (None: no such stream)
    and recorded commands (duplicate=True) `version_of` and `command_of` read. Raises HeadMoved
    or WrongExpectedVersion, having written nothing."""
    if expected_head is not None and head != expected_head:
        raise HeadMoved(expected_head, head)
    plan = AppendPlan()
    held: dict[str, int | None] = {}  # stream -> its version in the log before the append
    versions: dict[str, int] = {}  # stream -> its version as this append leaves it so far
    done: dict[str, AppendResult] = {}  # command ids recorded by this append
    next_seq = head + 1
    for batch, contents in zip(batches, packed, strict=True):
        command_id = batch.command_id
        if command_id is not None:
            prior = done.get(command_id)
            if prior is None:
                prior = command_of(command_id)
            if prior is not None:
                plan.results.append(prior)
                continue
        stream = batch.stream_id
        if stream not in held:
            held[stream] = version_of(stream)
        stored = held[stream]
        actual = versions.get(stream, 0 if stored is None else stored)
        if actual != batch.expected_version:
            raise WrongExpectedVersion(stream, batch.expected_version, actual)
        count = len(batch.events)
        first, last = (next_seq, next_seq + count - 1) if count else (0, 0)
        if contents is not None:
            schemas, header, payload, event_ids, codec = contents
            step, recorded_at = batch.events[0].step, batch.events[0].recorded_at
            plan.steps.append(((first, last, stream, actual + 1, step, recorded_at, schemas, header, payload, codec), event_ids))
            versions[stream] = actual + count
            plan.versions[stream] = (actual + count, stored is not None)
        next_seq += count
        result = AppendResult(
            stream_id=stream, first_seq=first, last_seq=last, stream_version=actual + count, digest=batch.digest
        )
        if command_id is not None:
            plan.commands.append((command_id, result))
            done[command_id] = msgspec.structs.replace(result, duplicate=True)  # a later batch of it: a retry
        plan.results.append(result)
    return plan


def ascending(event_ids: Sequence[str]) -> bool:
    """Whether a step's ids strictly ascend (so none is given twice): the first test of whether
    it can be kept as one id run (kvl_id_runs), by `<` on str, the order both SQL logs' id
    columns compare in (events/log/schema.py)."""
    return bool(event_ids) and all(map(operator.lt, event_ids, islice(event_ids, 1, None)))
