"""The log contract every backend implements (DESIGN.md, "The log").

* Append-only. Unique (stream_id, stream_version), unique event_id, and a global sequence that
  is commit-ordered: a reader that has seen sequence N never later finds a new event below N.
* One append is atomic and names the version it expects each stream to be at. A command id
  makes it idempotent: a retry returns the original positions and appends nothing.
* Checkpoints commit in the same transaction as the projection rows they describe.
* Snapshots are caches: (global seq, state, schema version, digest), always rebuildable.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from contextlib import AbstractAsyncContextManager
from typing import Any, Protocol, runtime_checkable

import msgspec


class PendingEvent(msgspec.Struct, frozen=True, kw_only=True):
    """An encoded event about to be appended (see events.EventCodec.encode)."""

    event_id: str
    step: int
    recorded_at: float
    event_type: str
    schema_version: int
    payload: bytes


class StoredEvent(msgspec.Struct, frozen=True, gc=False):
    """An event as committed: its position in the global order and in its stream."""

    global_seq: int
    event_id: str
    stream_id: str
    stream_version: int
    """1 for a stream's first event."""
    step: int
    recorded_at: float
    event_type: str
    schema_version: int
    payload: bytes


class StepEntry(msgspec.Struct, frozen=True, array_like=True, gc=False):
    """One event's entry in its step's header: everything but the payload bytes."""

    event_id: str
    event_type: str
    schema_version: int
    length: int
    """Bytes of this event's payload in the step's concatenated payload."""
    step: int
    recorded_at: float


_header_encoder = msgspec.msgpack.Encoder()
_header_decoder = msgspec.msgpack.Decoder(list[StepEntry])


def schemas_of(events: Sequence[PendingEvent]) -> str:
    """The step's distinct "type@schema_version" values, sorted and comma-joined."""
    # The distinct pairs first, formatted once each: a step of 256 events holds a dozen kinds.
    kinds = {(e.event_type, e.schema_version) for e in events}
    return ",".join(sorted([f"{event_type}@{version}" for event_type, version in kinds]))


def pack_step(events: Sequence[PendingEvent]) -> tuple[str, bytes, bytes]:
    """(schemas, header, payload) of one step's row: payloads are kept byte for byte."""
    # Tuples encode as the same msgpack arrays as StepEntry (array_like), without building a
    # Struct per event: a quarter of pack_step's time (ops/bench/peer_eventsourcing.py, profiled).
    header = _header_encoder.encode(
        [(e.event_id, e.event_type, e.schema_version, len(e.payload), e.step, e.recorded_at) for e in events]
    )
    return schemas_of(events), header, b"".join([e.payload for e in events])


class StoredStep(msgspec.Struct, frozen=True, gc=False):
    """One stream's part of one committed append, as stored: its events' payloads concatenated.
    Replay decodes `payload` in one call when every schema in `schemas` is current
    (events.EventCodec.decode_concatenated); `events()` splits it into StoredEvents."""

    first_seq: int
    last_seq: int
    stream_id: str
    first_version: int
    schemas: str
    header: bytes
    payload: bytes
    step: int = -1
    """The engine step (-1 for an append outside a step, such as a worker's report)."""
    recorded_at: float = 0.0
    """Wall-clock time of the append (seconds since the epoch)."""

    @property
    def count(self) -> int:
        return self.last_seq - self.first_seq + 1

    def event_ids(self) -> list[str]:
        """The step's event ids in order, read from its header alone."""
        return [entry.event_id for entry in _header_decoder.decode(self.header)]

    def events(self) -> list[StoredEvent]:
        entries = _header_decoder.decode(self.header)
        if len(entries) != self.count:
            raise ValueError(
                f"step at global sequence {self.first_seq} of stream {self.stream_id!r}: the header lists "
                f"{len(entries)} events, the row spans {self.count}"
            )
        stored, offset, payload = [], 0, self.payload
        for index, entry in enumerate(entries):
            end = offset + entry.length
            stored.append(
                StoredEvent(
                    self.first_seq + index,
                    entry.event_id,
                    self.stream_id,
                    self.first_version + index,
                    entry.step,
                    entry.recorded_at,
                    entry.event_type,
                    entry.schema_version,
                    payload[offset:end],
                )
            )
            offset = end
        return stored


class AppendBatch(msgspec.Struct, frozen=True, kw_only=True):
    """One stream's part of an atomic append."""

    stream_id: str
    expected_version: int
    """The stream's version before this append; 0 for a new stream."""
    events: Sequence[PendingEvent]
    command_id: str | None = None
    digest: bytes | None = None
    """The content the command id stands for (the ledger's digest of it), kept with the id: a
    retry of the id with other content is told apart from a retry of the same."""


class AppendResult(msgspec.Struct, frozen=True, kw_only=True):
    stream_id: str
    first_seq: int
    """0 when the batch had no events."""
    last_seq: int
    stream_version: int
    """The stream's version after the append."""
    duplicate: bool = False
    """True when the command id had been appended before: nothing was appended now."""
    digest: bytes | None = None
    """The digest the command id was committed with (None: committed before digests were kept)."""


class Snapshot(msgspec.Struct, frozen=True, kw_only=True):
    global_seq: int
    """The state includes every event up to and including this sequence."""
    schema_version: int
    digest: str
    state: bytes
    created_at: float


class LogError(RuntimeError):
    """Base of the log's infrastructure errors."""


class WrongExpectedVersion(LogError):
    def __init__(self, stream_id: str, expected: int, actual: int) -> None:
        super().__init__(f"stream {stream_id!r} is at version {actual}, the append expected {expected}")
        self.stream_id, self.expected, self.actual = stream_id, expected, actual


class HeadMoved(LogError):
    """Another writer appended to the log since the appender last read it: the append named the
    head it was decided on (`expected_head`) and the log is past it. Nothing was appended; the
    appender reads what the other wrote and decides again (two sidecars on one log)."""

    def __init__(self, expected: int, actual: int, *, detail: str = "") -> None:
        because = f": {detail}" if detail else ""
        super().__init__(f"the log's head is at global sequence {actual}, the append was decided at {expected}{because}")
        self.expected, self.actual = expected, actual


class AppendRejected(LogError):
    """The database refused the append (a duplicate event id, say); nothing of it was kept."""


class LogUnavailable(LogError):
    """The log's database cannot be reached or opened. The message masks passwords."""


class SchemaMismatch(LogError):
    """The log's schema is newer than this code, or behind it where upgrading is manual."""


class NotALog(LogError):
    """What a read-only command was pointed at is not a kvledger log (not a SQLite database, or
    one without kvledger's schema); the message names the path."""


class LogDiverged(LogError):
    """The log went backwards: records this process read or was told were committed are gone
    (a broker lost them, or the topic was deleted). The log fails closed: every later call
    raises this again, so nothing continues a forked history."""


class WriterFenced(LogError):
    """Another writer has claimed this stream since this one did (Kafka log): this writer's
    appends to it are refused. Only a new writer (a restarted sidecar) may write it again."""


class ProjectionTransaction(Protocol):
    """A transaction for projection rows; `advance` writes the checkpoint in it."""

    @property
    def connection(self) -> Any: ...

    async def advance(self, global_seq: int) -> None: ...


class EventLog(Protocol):
    """The interface the coordinator, the sidecar and the forensic tools use."""

    url: str

    async def append(self, batches: Sequence[AppendBatch], *, expected_head: int | None = None) -> list[AppendResult]:
        """Append every batch atomically. With `expected_head`, only if the log's last global
        sequence is that one (else HeadMoved, nothing appended): the appender's state is the
        log's up to there, so what it decided on it holds (several writers on one log)."""
        ...

    async def read(self, after_seq: int = 0, limit: int = 10_000) -> list[StoredEvent]: ...

    async def read_steps(self, after_seq: int = 0, limit: int = 10_000) -> list[StoredStep]:
        """The steps holding events after_seq + 1 .. after_seq + limit, whole: the first may start
        at or before after_seq, the last may end after the limit. Replay's fast path."""
        ...

    async def read_stream_steps(self, stream_id: str, after_seq: int = 0, limit: int = 1_000) -> list[StoredStep]:
        """One stream's steps that hold events after after_seq, whole and in order, at most `limit`
        steps: what `read_steps` would return of that stream, without reading the others'. A
        worker's catch-up reads its engine's stream so."""
        ...

    def tail(self, after_seq: int = 0, batch: int = 10_000) -> AsyncIterator[StoredEvent]: ...

    async def head(self) -> int: ...

    async def find_commands(self, command_ids: Sequence[str]) -> dict[str, AppendResult]:
        """The committed appends among these command ids (`duplicate=True` on each). Those this
        log appended, or found when it opened, always; one another writer appended since (a
        second sidecar on the same log) may be missed until this log sees the head move (the SQL
        logs' CommandFilter) or the fold reads it (Kafka): an append then finds it committed,
        or names a head that moved (HeadMoved), and appends nothing of it."""
        ...

    async def stream_version(self, stream_id: str) -> int: ...

    async def stream_versions(self) -> dict[str, int]: ...

    async def checkpoint(self, name: str) -> int: ...

    def projection_transaction(self, name: str) -> AbstractAsyncContextManager[ProjectionTransaction]: ...

    async def save_snapshot(self, snapshot: Snapshot) -> None: ...

    async def snapshots(self, limit: int = 5) -> list[Snapshot]: ...

    async def close(self) -> None: ...


class AppendInFlight(Protocol):
    """An append a PipelinedLog checked and queued: its results once the log judged it."""

    async def results(self) -> list[AppendResult]:
        """What `append` would return; raises what `append` would raise."""
        ...


@runtime_checkable
class PipelinedLog(Protocol):
    """A log that takes several appends of one writer in flight (the Kafka log).

    `queue_append` checks an append against the log plus this writer's appends still in flight
    and queues it behind them, in call order, without waiting for their round trips; the log
    judges them in that order. One that names the head (`expected_head`, counting the events of
    the appends in flight before it) is refused if an append in flight before it that appends
    an event is refused (rule 0's `follows` on Kafka): nothing decided on a refused append is
    ever taken. `append` is `queue_append` and then its `results`."""

    async def queue_append(self, batches: Sequence[AppendBatch], *, expected_head: int | None = None) -> AppendInFlight:
        """Check and queue the append; returns once it is queued (raises what `append` raises
        for an append refused at its check, and then nothing is queued)."""
        ...
