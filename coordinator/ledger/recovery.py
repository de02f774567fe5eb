"""Rebuilding state from the log: full replay, snapshot + tail, and writing snapshots (I18).

The authoritative path refuses an event it cannot decode, naming its type and global sequence;
forensic readers pass `skip_undecodable=True` to list and skip such events instead.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable

import blake3
import msgspec
import structlog

from coordinator.core.projector import project
from coordinator.core.state import SNAPSHOT_SCHEMA_VERSION, State, decode_state, encode_state, state_digest
from events import EventCodec, EventDecodeError
from events.log import EventLog, Snapshot
from events.log.reading import decode_step, stored_steps

log = structlog.get_logger("kvledger.recovery")


async def replay(
    event_log: EventLog,
    codec: EventCodec,
    state: State | None = None,
    after_seq: int = 0,
    *,
    skip_undecodable: bool = False,
    on_skip: Callable[[EventDecodeError], None] | None = None,
    on_progress: Callable[[int], None] | None = None,
    until_seq: int | None = None,
) -> tuple[State, int]:
    """Fold every committed event after `after_seq` (up to `until_seq`, default the head) into
    `state`; returns (state, last seq). A point inside a step leaves the state mid-step."""
    state = State() if state is None else state
    # Replay allocates millions of short-lived containers and makes no cycles; the cyclic
    # collector rescanning the growing state on every generation-0 pass cost about 3x in decode
    # (ops/bench/log.py). Pause it for the replay and restore it after.
    collecting = gc.isenabled()
    gc.disable()
    try:
        return await _replay_batches(event_log, codec, state, after_seq, skip_undecodable, on_skip, on_progress, until_seq)
    finally:
        if collecting:
            gc.enable()


async def _replay_batches(
    event_log: EventLog,
    codec: EventCodec,
    state: State,
    after_seq: int,
    skip_undecodable: bool,
    on_skip: Callable[[EventDecodeError], None] | None,
    on_progress: Callable[[int], None] | None,
    until_seq: int | None = None,
) -> tuple[State, int]:
    last = after_seq

    def skipped(error: EventDecodeError) -> None:
        log.warning("event_skipped", global_seq=error.position, event_type=error.event_type, error=str(error))
        if on_skip is not None:
            on_skip(error)

    async for batch in stored_steps(event_log, after_seq, until_seq):
        for step in batch:
            events = decode_step(codec, step, last, skipped if skip_undecodable else None)
            if until_seq is not None and step.last_seq > until_seq:
                events = events[: until_seq - max(step.first_seq, last + 1) + 1]
            project(events, state)
            last = step.last_seq if until_seq is None else min(step.last_seq, until_seq)
        if on_progress is not None:
            on_progress(last)
    return state, last


async def recover(event_log: EventLog, codec: EventCodec) -> tuple[State, int]:
    """The newest valid snapshot plus the tail; a full replay when no snapshot is usable.

    A snapshot is a cache: one whose digest does not match its bytes, or whose schema is not
    this code's, is ignored with a warning."""
    for snapshot in await event_log.snapshots():
        problem = _snapshot_problem(snapshot)
        if problem is None:
            state = decode_state(snapshot.state)  # decoded twice; recovery is rare
            log.info("recovery_from_snapshot", global_seq=snapshot.global_seq)
            return await replay(event_log, codec, state, snapshot.global_seq)
        log.warning("snapshot_ignored", global_seq=snapshot.global_seq, reason=problem)
    log.info("recovery_full_replay")
    return await replay(event_log, codec)


def _snapshot_problem(snapshot: Snapshot) -> str | None:
    if snapshot.schema_version != SNAPSHOT_SCHEMA_VERSION:
        return f"schema v{snapshot.schema_version}, this code reads v{SNAPSHOT_SCHEMA_VERSION}"
    if blake3.blake3(snapshot.state).hexdigest() != snapshot.digest:
        return "digest does not match the state bytes"
    try:
        decode_state(snapshot.state)
    except msgspec.DecodeError as error:
        return f"undecodable state ({error})"
    return None


def make_snapshot(state: State, global_seq: int) -> Snapshot:
    return Snapshot(
        global_seq=global_seq,
        schema_version=SNAPSHOT_SCHEMA_VERSION,
        digest=state_digest(state),
        state=encode_state(state),
        created_at=time.time(),
    )
