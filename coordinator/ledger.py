"""The pure core on the durable log: decide, commit, and only then is it true.

`Ledger` is the thin I/O shell around `CoordinatorCore`. A step is decided and folded in memory,
then appended as one atomic batch with the stream's expected version and the caller's command
id. If the append fails, the in-memory state has run ahead of the log, so it is rebuilt from
the log (the state is always what the log projects to, I18). A retried command id returns the
originally committed events and appends nothing.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import anyio
import msgspec
import structlog
import uuid_utils

from coordinator.commands import AnyCommand, DeclareTier, ReportRank
from coordinator.core import CoordinatorCore
from coordinator.recovery import decode, make_snapshot, recover
from coordinator.state import State
from events import Event, EventCodec
from events.log import AppendBatch, EventLog, PendingEvent

log = structlog.get_logger("kvledger.ledger")


class Commit(msgspec.Struct, frozen=True, kw_only=True):
    """What one committed command or step produced, and where it sits in the log."""

    events: list[Event]
    stream_id: str
    first_seq: int
    last_seq: int
    duplicate: bool = False
    """A retry of an already committed command id: `events` are the original ones."""


def stream_for(state: State, command: AnyCommand) -> str:
    """Each engine writes its own stream; tiers have theirs; a report joins its job's engine."""
    if isinstance(command, DeclareTier):
        return f"tier/{command.spec.name}"
    if isinstance(command, ReportRank):
        job = state.jobs.get(command.job_id)
        return f"engine/{job.decision.engine_id}" if job is not None else "reports"
    return f"engine/{command.engine_id}"


class Ledger:
    def __init__(
        self, event_log: EventLog, codec: EventCodec, state: State, last_seq: int,
        versions: dict[str, int], snapshot_every: int,
    ) -> None:
        self.log = event_log
        self.codec = codec
        self.core = CoordinatorCore(state, keep_events=False)
        self.last_seq = last_seq
        self._versions = versions
        self._snapshot_every = snapshot_every
        self._steps_since_snapshot = 0
        self._lock = anyio.Lock()

    @classmethod
    async def open(cls, event_log: EventLog, *, snapshot_every: int = 1000, codec: EventCodec | None = None) -> Ledger:
        """Recover the state (newest valid snapshot + tail) and get ready to append."""
        codec = codec or EventCodec()
        state, last_seq = await recover(event_log, codec)
        versions = await event_log.stream_versions()
        log.info("ledger_opened", url=event_log.url, global_seq=last_seq, streams=len(versions))
        return cls(event_log, codec, state, last_seq, versions, snapshot_every)

    @property
    def state(self) -> State:
        return self.core.state

    async def execute(self, command: AnyCommand, *, command_id: str | None = None) -> Commit:
        """Decide one command and commit its events."""
        async with self._lock:
            stream = stream_for(self.state, command)
            return await self._commit(stream, lambda: self.core.execute(command), step=-1, command_id=command_id)

    async def run_step(
        self, engine_id: str, step: int, clock: float, commands: Sequence[AnyCommand], *, command_id: str | None = None
    ) -> Commit:
        """One scheduler step as one atomic append: begin, the commands, end-of-step (I14)."""
        async with self._lock:
            commit = await self._commit(
                f"engine/{engine_id}",
                lambda: self.core.run_step(engine_id, step, clock, commands),
                step=step,
                command_id=command_id,
            )
            self._steps_since_snapshot += 1
            if self._steps_since_snapshot >= self._snapshot_every:
                await self._snapshot()
            return commit

    async def close(self) -> None:
        """Clean shutdown: leave a snapshot so the next start replays only what follows."""
        async with self._lock:
            if self._steps_since_snapshot:
                await self._snapshot()

    async def _commit(
        self, stream: str, decide: Callable[[], list[Event]], *, step: int, command_id: str | None
    ) -> Commit:
        events = decide()
        now = time.time()
        # Time-ordered ids (uuid7): random uuid4s scatter inserts across the unique index on
        # event_id (ops/bench/log.py measured several times the pages written per commit).
        pending = []
        for event in events:
            event_type, version, payload = self.codec.encode(event)
            pending.append(
                PendingEvent(event_id=uuid_utils.uuid7().hex, step=step, recorded_at=now, event_type=event_type,
                             schema_version=version, payload=payload)
            )
        expected = self._versions.get(stream, 0)
        try:
            (result,) = await self.log.append(
                [AppendBatch(stream_id=stream, expected_version=expected, events=pending, command_id=command_id)]
            )
        except BaseException:
            # The state ran ahead of a log that did not take the step: rebuild it from the log.
            with anyio.CancelScope(shield=True):
                await self._rebuild("append_failed")
            raise
        if result.duplicate:
            await self._rebuild("retried_command")
            stored = await self.log.read(result.first_seq - 1, result.last_seq - result.first_seq + 1) if result.last_seq else []
            log.info("command_retried", command_id=command_id, stream=stream, first_seq=result.first_seq)
            return Commit(events=[decode(self.codec, s) for s in stored], stream_id=stream,
                          first_seq=result.first_seq, last_seq=result.last_seq, duplicate=True)
        self._versions[stream] = result.stream_version
        self.last_seq = max(self.last_seq, result.last_seq)
        return Commit(events=events, stream_id=stream, first_seq=result.first_seq, last_seq=result.last_seq)

    async def _rebuild(self, reason: str) -> None:
        state, self.last_seq = await recover(self.log, self.codec)
        self.core = CoordinatorCore(state, keep_events=False)
        self._versions = await self.log.stream_versions()
        log.warning("ledger_rebuilt_from_log", reason=reason, global_seq=self.last_seq)

    async def _snapshot(self) -> None:
        snapshot = await anyio.to_thread.run_sync(make_snapshot, self.state, self.last_seq)
        await self.log.save_snapshot(snapshot)
        self._steps_since_snapshot = 0
        log.info("snapshot_saved", global_seq=snapshot.global_seq, bytes=len(snapshot.state))
