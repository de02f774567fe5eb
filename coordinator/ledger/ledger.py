"""The I/O shell around the pure core: decide, commit, and only then is it true.

`Ledger` wraps `CoordinatorCore` with the durable log. A step is decided and folded in memory,
then appended as one atomic batch with the stream's expected version and the caller's command
id. If the append fails, the in-memory state has run ahead of the log, so it is rebuilt from
the log (the state is always what the log projects to, I18). A retried command id returns the
originally committed events and appends nothing.

Deciding and appending are two calls (`decide_group`, `append_decided`), so that the sidecar's
committer can decide the next group while the previous one's append is in flight (pipelined
group commit). A group decided on top of one whose append then fails is *superseded*: the
rebuild drops both, and `append_decided` refuses the second (`Superseded`) so that it is
decided again. Nothing of a group is shown before its append returned: readers either wait for
the groups in flight (`committed`) or read around what they touched (`uncommitted_keys`).

On a log that takes several appends in flight (events.log.PipelinedLog: Kafka), a group's
append may be handed to the log while the ones before it are still travelling (`append_decided`
with `queued`): each names the head it was decided on, counting the groups in flight before it,
so the log refuses it if one of those is refused. The rebuild after a failed append then waits
until every append handed to the log has its verdict: one accepted is committed (and answered),
one refused because a group before it was is superseded, as above.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from contextlib import asynccontextmanager, contextmanager
from typing import Any

import anyio
import blake3
import msgspec
import structlog
import uuid_utils

from coordinator.core import CoordinatorCore
from coordinator.core.commands import AnyCommand, ReportRank
from coordinator.core.decider import END_OF_STEP_NOTICES
from coordinator.core.projector import read_effects
from coordinator.core.protections import Protection
from coordinator.core.state import State
from coordinator.core.step import engine_stream, run_step, stream_for
from coordinator.ledger.recovery import make_snapshot, recover, replay
from events import Event, EventCodec, NoticeDropped, StepBegan, StepEnded
from events.log import (
    AppendBatch,
    AppendRejected,
    AppendResult,
    EventLog,
    HeadMoved,
    LogError,
    LogUnavailable,
    PendingEvent,
    PipelinedLog,
    Snapshot,
    WrongExpectedVersion,
    is_outage,
)
from events.log.reading import decode

log = structlog.get_logger("kvledger.ledger")


class Commit(msgspec.Struct, frozen=True, kw_only=True):
    """What one committed command or step produced, and where it sits in the log."""

    events: list[Event]
    stream_id: str
    first_seq: int
    last_seq: int
    duplicate: bool = False
    """A retry of an already committed command id: `events` are the original ones."""
    reused: bool = False
    """A duplicate whose command id was committed with other content (`content_digest`): the
    caller must not take `events` for what it sent (the sidecar refuses it `command_id_reused`)."""


class Step(msgspec.Struct, frozen=True, kw_only=True):
    """One scheduler step of one engine: begin, the commands, end-of-step (I14)."""

    engine_id: str
    step: int
    clock: float
    commands: Sequence[AnyCommand]
    command_id: str | None = None


class Single(msgspec.Struct, frozen=True, kw_only=True):
    """One command outside any step (a tier declaration, an engine's hello, a worker's report)."""

    command: AnyCommand
    command_id: str | None = None


class Recorded(msgspec.Struct, frozen=True, kw_only=True):
    """Events already decided outside any step, appended for the audit: the answers of reads
    (a lookup on the sidecar's read path). They are records, not state: folding them changes
    nothing (coordinator/core/projector.py), so they may land in any later group."""

    stream_id: str
    events: list[Event]


Submission = Step | Single
"""What a caller submits to be decided: a step or one command."""

_digest_encoder = msgspec.msgpack.Encoder()


def content_digest(tx: Submission) -> bytes:
    """What a command id stands for: its step (engine, number, clock, commands) or its command.
    Kept with the id in the log, so a retry with other content is told apart from a retry. A
    report's engine (stamped by the sidecar since 2026-12-05) is left out: the command id is
    scoped by the engine already, and a retry across that upgrade is the same report."""
    if isinstance(tx, Step):
        content: Any = (tx.engine_id, tx.step, tx.clock, [_unattributed(command) for command in tx.commands])
    else:
        content = _unattributed(tx.command)
    return blake3.blake3(_digest_encoder.encode(content)).digest(16)


def _unattributed(command: AnyCommand) -> AnyCommand:
    return msgspec.structs.replace(command, engine_id="") if isinstance(command, ReportRank) and command.engine_id else command


Transaction = Submission | Recorded


class StepCommit(msgspec.Struct, frozen=True, kw_only=True):
    """A committed step, command by command: what the sidecar answers an engine."""

    commit: Commit
    began: list[Event]
    results: list[list[Event]]
    """The events each command produced, in command order; a refusal is a `Refused` event."""
    ended: list[Event]


SubmitAll = Callable[[Sequence[Submission]], Awaitable[list[StepCommit | Commit]]]
"""A group commit (the sidecar's Committer.submit_all): transactions committed together, in
order; how a service the sidecar runs commits beside the engines' steps."""


HEAD_MOVED_ATTEMPTS = 50
"""How often `commit_group` decides a group again because another writer appended first."""


class Superseded(Exception):
    """A group decided on top of one whose append failed: the rebuild dropped it unappended.
    Its transactions are decided again (the sidecar's committer puts them back in its queue)."""


class DecidedGroup:
    """A group decided and folded in memory, not yet appended (`Ledger.decide_group`)."""

    __slots__ = ("transactions", "batches", "decided", "first_of", "done", "epoch", "keys", "engines", "head", "events", "sent")

    def __init__(
        self,
        transactions: Sequence[Transaction],
        batches: list[AppendBatch],
        decided: list[tuple[int, str, list[Event], StepCommit | None]],
        first_of: dict[str, int],
        done: dict[str, AppendResult],
        epoch: int,
        head: int,
    ) -> None:
        self.transactions = transactions
        self.batches = batches
        self.decided = decided
        self.first_of = first_of
        self.done = done
        self.epoch = epoch
        """The ledger's epoch when it was decided: a rebuild begins a new one and supersedes it."""
        self.keys, self.engines = read_effects(e for _, _, events, _ in decided for e in events)
        """What a read must not see of it before it is appended: the tier keys whose entries it
        changed, the engines it declared or reset."""
        self.head = head
        """The log's last global sequence it was decided on: the committed one plus the events of
        the groups decided before it and not yet appended (its append's expected head)."""
        self.events = sum(len(batch.events) for batch in batches)
        self.sent = False
        """Handed to the log: its append is under way, and only the log's verdict ends it."""

    @property
    def last_seq(self) -> int:
        """The last global sequence of its events once appended (its head when it has none)."""
        return self.head + self.events


class Ledger:
    def __init__(
        self,
        event_log: EventLog,
        codec: EventCodec,
        state: State,
        last_seq: int,
        versions: dict[str, int],
        snapshot_every: int,
        protections_off: frozenset[Protection] = frozenset(),
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.log = event_log
        self.pipelines = isinstance(event_log, PipelinedLog)
        """Whether its log takes several appends in flight (PipelinedLog): `append_decided` may
        then hand a group to the log before the ones before it returned."""
        self.codec = codec
        self.protections_off = protections_off
        """Empty except in the simulator's fault scenarios (coordinator.core.protections)."""
        self.core = CoordinatorCore(state, keep_events=False, protections_off=protections_off)
        self.last_seq = last_seq
        """The last global sequence the log took (committed): what readers may be shown."""
        self._versions = versions
        """Each stream's version in the log."""
        self._next_versions = dict(versions)
        """Each stream's version with the groups decided and not yet appended."""
        self._snapshot_every = snapshot_every
        self._steps_since_snapshot = 0
        self.stale = False
        """True from a failed append until a rebuild succeeds: the state may be ahead of the log."""
        self._epoch = 0
        self._pending: list[DecidedGroup] = []
        """Groups decided and folded in memory whose append has not returned, oldest first."""
        self._settled = anyio.Event()
        self._settled.set()
        self._unsure_keys: set[bytes] = set()
        self._unsure_engines: set[str] = set()
        """What the groups a failed append dropped had changed, until the rebuild succeeds."""
        self._snapshot_seq: int | None = None
        """The sequence of the last snapshot this ledger wrote (None: none yet)."""
        self._lock = anyio.Lock(fast_acquire=True)
        """Held while the state is changed (decide, rebuild) or read whole (`committed`). Taken
        without a loop iteration when free (coordinator/frames.py: what an iteration costs)."""
        self._serial = anyio.Lock(fast_acquire=True)
        """`commit_group`'s: a caller that pipelines (the sidecar's committer) orders its groups itself."""
        self.snapshot_due: Snapshot | None = None
        """An encoded snapshot waiting to be written (commit_group with save_snapshot=False)."""
        self.clock = clock
        """Wall-clock seconds, stamped on each appended step as `recorded_at` (what the audit's
        --at-time and namespace inventory read). Tests pass their own to place steps in time."""

    @classmethod
    async def open(
        cls,
        event_log: EventLog,
        *,
        snapshot_every: int = 1000,
        codec: EventCodec | None = None,
        protections_off: frozenset[Protection] = frozenset(),
        clock: Callable[[], float] = time.time,
    ) -> Ledger:
        """Recover the state (newest valid snapshot + tail) and get ready to append."""
        codec = codec or EventCodec()
        state, last_seq = await recover(event_log, codec)
        versions = await event_log.stream_versions()
        log.info("ledger_opened", url=event_log.url, global_seq=last_seq, streams=len(versions))
        return cls(event_log, codec, state, last_seq, versions, snapshot_every, protections_off, clock)

    @property
    def state(self) -> State:
        return self.core.state

    @asynccontextmanager
    async def committed(self) -> AsyncIterator[State]:
        """The state with nothing uncommitted in it: waits out the groups in flight. For read-only
        answers that must never show what the log has not taken (a worker's Welcome, /metrics)."""
        async with self._lock:
            await self._settle()
            await self._fresh()
            yield self.core.state

    def uncommitted_keys(self) -> tuple[set[bytes], set[str]]:
        """What the state in memory may hold that the log does not, for a reader that answers
        from it at once (the sidecar's lookups): the tier keys and the engines that the groups in
        flight changed, and those of a failed append until the rebuild from the log succeeded.
        A key in it must be answered as a miss, never as the state has it."""
        keys, engines = set(self._unsure_keys), set(self._unsure_engines)
        for group in self._pending:
            keys |= group.keys
            engines |= group.engines
        return keys, engines

    @property
    def in_flight(self) -> int:
        """Groups decided whose append has not returned."""
        return len(self._pending)

    async def execute(self, command: AnyCommand, *, command_id: str | None = None) -> Commit:
        """Decide one command and commit its events."""
        [commit] = await self.commit_group([Single(command=command, command_id=command_id)])
        assert isinstance(commit, Commit)
        return commit

    async def run_step(
        self, engine_id: str, step: int, clock: float, commands: Sequence[AnyCommand], *, command_id: str | None = None
    ) -> Commit:
        """One scheduler step as one atomic append: begin, the commands, end-of-step (I14)."""
        [result] = await self.commit_group(
            [Step(engine_id=engine_id, step=step, clock=clock, commands=commands, command_id=command_id)]
        )
        return result.commit if isinstance(result, StepCommit) else result

    async def commit_group(self, transactions: Sequence[Transaction], *, save_snapshot: bool = True) -> list[StepCommit | Commit]:
        """Decide every transaction in order, then commit them all in one atomic append (group
        commit): each keeps its own stream and command id, and a stream's transactions keep their
        order. A command id that is already committed is not decided again: its original events
        come back with `duplicate=True`. If the append fails, nothing of the group is committed,
        the state is rebuilt from the log, and the error propagates."""
        async with self._serial:  # concurrent callers: one group decided and appended at a time
            for attempt in range(1, HEAD_MOVED_ATTEMPTS + 1):
                group = await self.decide_group(transactions)
                try:
                    with _outages_retried(self.log.url):
                        results, snapshot = await self._append(group)
                except HeadMoved:  # another writer's steps came first: decided again on top of them
                    if attempt == HEAD_MOVED_ATTEMPTS:
                        raise
                    continue
                break
        await self._snapshot_due(snapshot, save_snapshot)
        return results

    async def catch_up(self) -> int:
        """Fold what other writers appended to the log (another sidecar on the same log) into
        the state, when nothing of this ledger's is in flight; returns how many events. A
        sidecar calls it now and then so its lookups see the fleet's publications; its own
        appends never need it to be safe (they name the head they were decided on)."""
        if self._pending or self.stale or await self.log.head() <= self.last_seq:
            return 0  # looked at without the lock: deciding never waits for a look that finds nothing
        async with self._lock:
            if self._pending or self.stale:
                return 0  # past last_seq are this ledger's own appends in flight too: not now
            before = self.last_seq
            try:
                state, last = await replay(self.log, self.codec, self.core.state, self.last_seq)
                versions = await self.log.stream_versions()
            except BaseException:
                self._fail_epoch()  # folded in part: rebuilt before the next decision (_fresh)
                raise
            self.core.state = state
            self.last_seq = last
            self._versions = versions
            self._next_versions = dict(versions)
            log.info("ledger_caught_up", global_seq=last, events=last - before)
            return last - before

    async def decide_group(self, transactions: Sequence[Transaction]) -> DecidedGroup:
        """Decide and fold the group in memory, on top of the groups still in flight; nothing is
        appended (`append_decided` does). Raises DecideFailed when the core fails on one."""
        with _outages_retried(self.log.url):
            async with self._lock:
                ids = [tx.command_id for tx in transactions if not isinstance(tx, Recorded) and tx.command_id is not None]
                while True:
                    await self._fresh()
                    epoch = self._epoch
                    done = await self.log.find_commands(ids) if ids else {}
                    # Unless the append in flight failed while the ids were read: then the state
                    # is no longer the log's. Decided on it, this group would be one that the
                    # failed append's rebuild waits for (it settles the groups in flight), while
                    # the committer appends it only once that append returned: neither would
                    # ever go on. So the state is rebuilt first (_fresh) and the ids read again.
                    if epoch == self._epoch:
                        break
                try:
                    batches, decided, first_of = self._decide_group(transactions, done)
                except BaseException:
                    # A bug in the core: what it folded of this group is in memory only. Rebuild,
                    # once the groups in flight landed (their folds are in memory too).
                    with anyio.CancelScope(shield=True):
                        await self._settle()
                        await self._rebuild("decide_failed")
                    raise
                head = self.last_seq + sum(pending.events for pending in self._pending)
                group = DecidedGroup(transactions, batches, decided, first_of, done, epoch, head)
                if batches:
                    self._pending.append(group)
                    self._settled = anyio.Event()
                return group

    async def append_decided(
        self, group: DecidedGroup, *, save_snapshot: bool = True, queued: anyio.Event | None = None
    ) -> list[StepCommit | Commit]:
        """Append a decided group and return its results. Raises Superseded (nothing appended)
        when a group before it failed; on its own failure the state is rebuilt from the log.

        `queued`: on a log that pipelines, set once the append is queued in the log (or failed
        before): the caller may then hand the log the next group's, which goes behind it. The
        caller appends groups in the order they were decided. Without it, or on another log,
        it is set when the append returned."""
        pipelined = queued if self.pipelines else None
        try:
            with _outages_retried(self.log.url):
                results, snapshot = await self._append(group, pipelined)
        finally:
            if queued is not None:
                queued.set()
        await self._snapshot_due(snapshot, save_snapshot)
        return results

    async def _snapshot_due(self, snapshot: Snapshot | None, save_snapshot: bool) -> None:
        if snapshot is not None:
            # Written outside the lock (a snapshot is a cache; the rows are insert-only, so an
            # older one landing later changes nothing). With save_snapshot=False the caller saves
            # it when it likes (`save_due_snapshot`): the sidecar's committer, in a task of its
            # own, so no step waits for the write.
            if save_snapshot:
                await self._save_snapshot(snapshot)
            else:
                self.snapshot_due = snapshot

    async def save_due_snapshot(self) -> None:
        """Write the newest snapshot a commit_group(save_snapshot=False) left due, if any."""
        snapshot, self.snapshot_due = self.snapshot_due, None
        if snapshot is not None:
            await self._save_snapshot(snapshot)

    async def close(self) -> None:
        """Clean shutdown: leave a snapshot so the next start replays only what follows."""
        async with self._lock:
            await self._settle()
            # A stale state (a failed append whose rebuild failed too) may hold what the log never took.
            if self.last_seq and self.last_seq != self._snapshot_seq and not self.stale:
                await self._snapshot()

    async def _settle(self) -> None:
        """Wait until no decided group is in flight (their appends never take the lock first)."""
        while self._pending:
            await self._settled.wait()

    def _landed(self, group: DecidedGroup) -> None:
        """The group's append returned, one way or the other."""
        if group in self._pending:
            self._pending.remove(group)
            if not self._pending:
                self._settled.set()

    async def _fresh(self) -> None:
        """After a rebuild that failed (the log was down), rebuild before anything else: the
        state in memory may still hold what the log did not take. Raises while the log is down."""
        if self.stale:
            await self._settle()
            try:
                await self._rebuild("stale_after_failed_rebuild")
            except Exception as error:
                if is_outage(error):
                    raise LogUnavailable(
                        f"{self.log.url} is unreachable while the state is rebuilt from it: "
                        f"{type(error).__name__}: {error}".splitlines()[0]
                    ) from error
                raise

    async def _append(
        self, group: DecidedGroup, queued: anyio.Event | None = None
    ) -> tuple[list[StepCommit | Commit], Snapshot | None]:
        if group.epoch != self._epoch:
            # Decided on top of a group whose append failed: the rebuild dropped its folds.
            self._landed(group)
            raise Superseded("decided on top of a group whose append failed; decide it again")
        results: dict[int, StepCommit | Commit] = {}
        if group.batches:
            try:
                # Decided on the log up to its head: appended only if no other writer (another
                # sidecar on the same log) appended since, else it is decided again (HeadMoved).
                group.sent = True
                if queued is not None:
                    assert isinstance(self.log, PipelinedLog)
                    appending = await self.log.queue_append(group.batches, expected_head=group.head)
                    queued.set()  # the next group's append may go behind it
                    appended = await appending.results()
                else:
                    appended = await self.log.append(group.batches, expected_head=group.head)
            except BaseException as error:
                # The state ran ahead of a log that did not take the group (and of whatever was
                # decided on top of it): rebuild it from the log, with what other writers appended.
                # A group whose epoch ended while it travelled was decided on one whose append
                # failed: refused for that (the head it names, a version it expects), it is
                # superseded and decided again, as if it had never been handed to the log.
                doomed = group.epoch != self._epoch
                self._fail_epoch()
                self._landed(group)
                with anyio.CancelScope(shield=True):
                    await self._rebuild_after("head_moved" if isinstance(error, HeadMoved) else "append_failed")
                if doomed and isinstance(error, HeadMoved | WrongExpectedVersion):
                    raise Superseded(f"decided on top of a group whose append failed; decide it again ({error})") from error
                raise
            self._landed(group)
            if any(r.duplicate for r in appended):
                # Another writer committed one of these ids between our check and our append.
                self._fail_epoch()
                await self._rebuild_after("retried_command")
                raise AppendRejected(
                    "another writer committed one of this group's command ids while it was being decided; "
                    "the rest were committed: retry each with its command id to get its result"
                )
            for (index, stream, events, detail), result in zip(group.decided, appended, strict=True):
                # Appends in flight together may return out of order: a stream's version only grows.
                self._versions[stream] = max(self._versions.get(stream, 0), result.stream_version)
                self.last_seq = max(self.last_seq, result.last_seq)
                commit = Commit(events=events, stream_id=stream, first_seq=result.first_seq, last_seq=result.last_seq)
                results[index] = commit if detail is None else msgspec.structs.replace(detail, commit=commit)
                if detail is not None:
                    self._steps_since_snapshot += 1
        for index, tx in enumerate(group.transactions):
            if index not in results:
                assert not isinstance(tx, Recorded) and tx.command_id is not None
                original = group.done.get(tx.command_id)
                earlier = results[group.first_of[tx.command_id]] if original is None else None
                retried = await self._retried(tx, original, earlier)
                first_digest = (
                    original.digest
                    if original is not None
                    else content_digest(_submission(group.transactions[group.first_of[tx.command_id]]))
                )
                if first_digest is not None and first_digest != content_digest(tx):
                    retried = _reused(retried)
                results[index] = retried
        snapshot = None
        if self._steps_since_snapshot >= self._snapshot_every:
            async with self._lock:
                # Only a state with nothing in flight is the log's (a group decided meanwhile
                # waits: the next append that finds none in flight encodes it).
                if not self._pending and not self.stale:
                    self._steps_since_snapshot = 0  # the next one after another snapshot_every steps, saved or not
                    snapshot = await anyio.to_thread.run_sync(make_snapshot, self.state, self.last_seq)
        return [results[index] for index in range(len(group.transactions))], snapshot

    def _fail_epoch(self) -> None:
        """What is in memory is no longer the log's: every group decided so far is superseded.
        Those already handed to the log stay pending until their verdicts (on a log that
        pipelines, several may be travelling): a rebuild waits for them (`_settle`), so that
        what the log took of them is in it."""
        self.stale = True
        self._epoch += 1
        for group in self._pending:
            self._unsure_keys |= group.keys
            self._unsure_engines |= group.engines
        self._pending = [group for group in self._pending if group.sent]
        if not self._pending:
            self._settled.set()

    async def _rebuild_after(self, reason: str) -> None:
        async with self._lock:
            if not self.stale:
                return  # a reader or a decision rebuilt it first
            await self._settle()
            try:
                await self._rebuild(reason)
            except Exception as rebuild_error:  # noqa: BLE001 - the log is down: the append's error is the one to raise
                # Still stale: the next commit rebuilds first (_fresh).
                log.warning("ledger_rebuild_failed", reason=reason, error=f"{type(rebuild_error).__name__}: {rebuild_error}")

    def _decide_group(
        self, transactions: Sequence[Transaction], done: dict[str, AppendResult]
    ) -> tuple[list[AppendBatch], list[tuple[int, str, list[Event], StepCommit | None]], dict[str, int]]:
        """Decide and fold each new transaction in memory, in order. Returns the batches to append,
        what each decided, and the index of each command id's first transaction (a command id
        repeated inside the group, or already committed, is not decided again)."""
        batches: list[AppendBatch] = []
        decided: list[tuple[int, str, list[Event], StepCommit | None]] = []
        first_of: dict[str, int] = {}
        expected = self._next_versions
        now = self.clock()
        for index, tx in enumerate(transactions):
            command_id = None
            detail: StepCommit | None = None
            try:
                if isinstance(tx, Recorded):
                    stream, step, events = tx.stream_id, -1, tx.events
                    self.core.record(events)
                else:
                    command_id = tx.command_id
                    if command_id is not None:
                        if command_id in done or command_id in first_of:
                            continue  # answered from the log, or from its first copy
                        first_of[command_id] = index
                    if isinstance(tx, Step):
                        stream, step = engine_stream(tx.engine_id), tx.step
                        decided_step = run_step(self.core.execute, tx.engine_id, tx.step, tx.clock, tx.commands)
                        events = decided_step.all()
                        detail = StepCommit(
                            commit=_PLACEHOLDER, began=decided_step.began, results=decided_step.results, ended=decided_step.ended
                        )
                    else:
                        stream, step = stream_for(self.state, tx.command), -1
                        events = self.core.execute(tx.command)
            except Exception as error:
                raise DecideFailed(index, error) from error
            version = expected.get(stream, 0)
            batches.append(
                AppendBatch(
                    stream_id=stream,
                    expected_version=version,
                    events=self._pending_events(events, step, now),
                    command_id=command_id,
                    digest=None if command_id is None or isinstance(tx, Recorded) else content_digest(tx),
                )
            )
            expected[stream] = version + len(events)
            decided.append((index, stream, events, detail))
        return batches, decided, first_of

    def _pending_events(self, events: list[Event], step: int, now: float) -> list[PendingEvent]:
        # Time-ordered ids (uuid7): random uuid4s scatter inserts across the unique index on
        # event_id (ops/bench/log.py measured several times the pages written per commit).
        encode = self.codec.encode
        pending = []
        for event in events:
            event_type, version, payload = encode(event)
            pending.append(
                PendingEvent(
                    event_id=uuid_utils.uuid7().hex,
                    step=step,
                    recorded_at=now,
                    event_type=event_type,
                    schema_version=version,
                    payload=payload,
                )
            )
        return pending

    async def _retried(
        self, tx: Step | Single, original: AppendResult | None, same_group: StepCommit | Commit | None
    ) -> StepCommit | Commit:
        """The answer to a command id that was committed before (or earlier in this group)."""
        if same_group is not None:
            commit = same_group.commit if isinstance(same_group, StepCommit) else same_group
            commit = msgspec.structs.replace(commit, duplicate=True)
            return msgspec.structs.replace(same_group, commit=commit) if isinstance(same_group, StepCommit) else commit
        assert original is not None
        stored = (
            await self.log.read(original.first_seq - 1, original.last_seq - original.first_seq + 1) if original.last_seq else []
        )
        events = [decode(self.codec, s) for s in stored]
        log.info("command_retried", command_id=tx.command_id, stream=original.stream_id, first_seq=original.first_seq)
        commit = Commit(
            events=events, stream_id=original.stream_id, first_seq=original.first_seq, last_seq=original.last_seq, duplicate=True
        )
        return split_step(commit) if isinstance(tx, Step) else commit

    async def _rebuild(self, reason: str) -> None:
        """Replace the state with the log's (nothing may be in flight: the caller settled)."""
        self._fail_epoch()  # until the state is the log's again
        state, last_seq = await recover(self.log, self.codec)
        versions = await self.log.stream_versions()
        self.core = CoordinatorCore(state, keep_events=False, protections_off=self.protections_off)
        self.last_seq = last_seq
        self._versions = versions
        self._next_versions = dict(versions)
        self.stale = False
        self._unsure_keys.clear()
        self._unsure_engines.clear()
        log.warning("ledger_rebuilt_from_log", reason=reason, global_seq=self.last_seq)

    async def _snapshot(self) -> None:
        snapshot = await anyio.to_thread.run_sync(make_snapshot, self.state, self.last_seq)
        self._steps_since_snapshot = 0
        await self.log.save_snapshot(snapshot)
        self._saved(snapshot)

    async def _save_snapshot(self, snapshot: Snapshot) -> None:
        try:
            await self.log.save_snapshot(snapshot)
        except Exception as error:  # noqa: BLE001 - a snapshot is a cache: the group is committed
            log.warning("snapshot_failed", global_seq=snapshot.global_seq, error=f"{type(error).__name__}: {error}")
            return
        self._saved(snapshot)

    def _saved(self, snapshot: Snapshot) -> None:
        self._snapshot_seq = max(self._snapshot_seq or 0, snapshot.global_seq)
        log.info("snapshot_saved", global_seq=snapshot.global_seq, bytes=len(snapshot.state))


@contextmanager
def _outages_retried(url: str) -> Iterator[None]:
    """A database that went away mid-commit (a command lookup, the append, a rebuild) is
    LogUnavailable, which callers retry; every other error passes as it is."""
    try:
        yield
    except (LogError, DecideFailed, Superseded):
        raise
    except Exception as error:
        if is_outage(error):
            raise LogUnavailable(
                f"{url} is unreachable: {type(error).__name__}: {error}".splitlines()[0]
                + ": it may or may not be committed; retry it with the same command ids"
            ) from error
        raise


class DecideFailed(RuntimeError):
    """The core raised while deciding transaction `index` of a group (a bug, never a refusal):
    nothing of the group was committed and the state was rebuilt from the log, so the others
    may be committed without it (coordinator/sidecar/committer.py does)."""

    def __init__(self, index: int, cause: Exception) -> None:
        super().__init__(f"the core failed on transaction {index} of the group: {type(cause).__name__}: {cause}")
        self.index = index
        self.cause = cause


def _submission(tx: Transaction) -> Submission:
    assert not isinstance(tx, Recorded)
    return tx


def _reused(result: StepCommit | Commit) -> StepCommit | Commit:
    if isinstance(result, StepCommit):
        return msgspec.structs.replace(result, commit=msgspec.structs.replace(result.commit, reused=True))
    return msgspec.structs.replace(result, reused=True)


_PLACEHOLDER = Commit(events=[], stream_id="", first_seq=0, last_seq=0)


def split_step(commit: Commit) -> StepCommit:
    """A retried step's committed events, regrouped: StepBegan first, the end-of-step events from
    StepEnded's reconciliation last. Per-command grouping is not stored in the log, so a retry
    gets every command's events as one group (the events themselves are the originals)."""
    events = commit.events
    began = events[:1] if events and isinstance(events[0], StepBegan) else []
    end = len(events)
    while end > len(began) and not isinstance(events[end - 1], StepEnded):
        end -= 1
    if end == len(began):  # no StepEnded
        return StepCommit(commit=commit, began=began, results=[events[len(began) :]], ended=[])
    start = end - 1  # StepEnded, and the notices its reconciliation dropped just before it
    while start > len(began) and _dropped_at_end_of_step(events[start - 1]):
        start -= 1
    return StepCommit(commit=commit, began=began, results=[events[len(began) : start]], ended=events[start:end])


def _dropped_at_end_of_step(event: Event) -> bool:
    return isinstance(event, NoticeDropped) and event.notice in END_OF_STEP_NOTICES
