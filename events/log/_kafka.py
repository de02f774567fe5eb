"""The Kafka log backend (aiokafka): `open_log("kafka://HOST:PORT[,HOST:PORT...]/TOPIC")`.

Layout. One topic per deployment, with ONE partition. Every record is keyed by its (first) stream
id, so a stream's records keep their order by Kafka's own rule too, but the single partition is
what gives the log its total, commit-ordered global sequence: the projector folds every stream
in one order (a report joins its job's engine stream, tiers and namespaces are streams of their
own, one append may span several streams), and readers in different processes must agree on
that order without asking each other. Several partitions would need a sequencer or a merge rule
of our own; one partition of one topic carries tens of MB/s, above the design's 250,000 events/s
of ~100 bytes. A topic with more than one partition is refused.

Records (events/log/_kafka_fold.py). One EventLog.append is one append in a record: its parts
(one per stream) hold the steps encoded as the SQL log stores them (pack_step), so a step, and
a multi-stream append, is atomic: the broker stores a record whole or not at all, and the fold
accepts or refuses an append whole. Global sequences
are not written anywhere: each reader assigns them deterministically while folding the topic in
offset order, counting the events of accepted records only (a fenced, conflicting or copied
record takes none). The same fold gives stream versions, command ids (find_commands) and claims.

Writing (events/log/_kafka_writer.py). A stream has one writer at a time, which claims it with
an epoch; a newer claim fences the older writer. Appends are checked against the fold plus the
writer's appends in flight, queued, and produced by one sender, several to a record (kind
`appends`); each learns its verdict from the fold once its record is read back.

Reading. No consumer group and no auto-commit: a reader assigns partition 0 and reads from offset 0, every
offset in order: a fetch that skipped a record (Tansu can serve N + 1 before N) is made again, and
an end offset behind what was read (Tansu's lags its acknowledgements for a few ms) asked again.

Failing closed. If the topic goes backwards (its end below what this process has read, a record
of ours acknowledged at an offset that now holds another, records deleted by retention), the log
raises LogDiverged, with the offsets, from every call from then on: it never continues a forked
history. `failure` says why, for a readiness check. A restarted process checks its state store:
a snapshot beyond the topic's head, or a topic whose first record is not the one the store was
built from, is refused too. Data lost and rewritten past what a process has read cannot be seen
from the outside: the broker settings in the production docs (replication, min.insync.replicas,
no unclean leader election, no retention) are what prevents that.

State store. Kafka cannot commit a projection's rows and its checkpoint in one transaction, so
checkpoints, projection transactions and snapshots live in a SQL database beside the topic:
`?state=PATH-or-SQL-URL`, by default a SQLite file under the data directory named after the
brokers and the topic. KafkaEventLog is a SqlEventLog whose engine is that store's (so the
audit index and any projection write there, with their checkpoints, as on the SQL backends);
every method that reads or writes events is overridden to go to the topic.

Memory: a reader keeps the accepted steps it folded (payloads included), their event ids and
command ids in memory, and answers reads, tails and replays from there.

The URL and its parameters: events/log/kafka_target.py.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from typing import Any

import anyio
import sqlalchemy as sa
import structlog
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition  # type: ignore[import-untyped]
from aiokafka.errors import KafkaError, OffsetOutOfRangeError  # type: ignore[import-untyped]

from events.log import schema as t
from events.log._contract import (
    AppendBatch,
    AppendResult,
    LogDiverged,
    LogError,
    LogUnavailable,
    StoredEvent,
    StoredStep,
)
from events.log._kafka_fold import KafkaFold
from events.log._kafka_writer import KafkaWriter, QueuedAppend
from events.log._sql import SqlEventLog, SqlProjectionTransaction, events_of
from events.log.kafka_target import KafkaTarget, ensure_topic, one_line

log = structlog.get_logger("kvledger.log")

TAIL_CHECK_S = 1.0
"""An idle tail asks for the topic's end this often, to notice a topic that went backwards."""
FETCH_RECORDS = 256
"""Records folded per fetch: the fold runs on the event loop, at about 200 us for a record of 256
events, so a batch holds the loop for at most ~50 ms before the fetcher awaits the broker again."""
HOLE_RETRY_S = 0.01
"""How soon the fetcher asks again for a record missing before the ones it was given."""
HOLE_TIMEOUT_S = 10.0
"""How long a record may stay missing before the log fails closed (_fold_fetched)."""
END_SETTLE_S = 2.0
"""How long the topic's end may stay below what was read before the log fails closed (_end)."""
ORIGIN_CHECKPOINT = "kvledger.kafka.origin"
"""The state store's checkpoint naming the topic history it was built from (KafkaFold.origin_code)."""


class KafkaEventLog(SqlEventLog):
    """EventLog on a Kafka topic, with a SQL state store for checkpoints, projections and
    snapshots. Open it with events.log.open_log("kafka://...")."""

    def __init__(self, target: KafkaTarget, state: SqlEventLog, producer: Any, consumer: Any) -> None:
        super().__init__(state.engine, target.url, state.blocking_engine)
        self.target = target
        self.state_url = state.url
        """Masked: safe to print."""
        self._fold = KafkaFold()
        self._producer = producer
        self._consumer = consumer
        self._partition = TopicPartition(target.topic, 0)
        self._kafka_writer = KafkaWriter(target, self.url, producer, self._fold, self)
        """This log's writer: its claims and appends (events/log/_kafka_writer.py)."""
        self.writer_id = self._kafka_writer.writer_id
        self._fetching = True
        """False while fetching is paused (see pause_fetching)."""
        self._reaching = 0
        """Calls waiting for the fold to reach an offset (_reach): fetching is not paused meanwhile."""
        self._acked: dict[int, tuple[list[tuple[str, bytes]], bytes]] = {}
        """offset -> (headers, value) of this writer's acknowledged records not yet read back."""
        self._advanced = anyio.Event()
        self._failure: tuple[type[LogError], str] | None = None
        self._fetcher: asyncio.Task[None] | None = None
        self._hole: tuple[int, float] | None = None
        """(the offset missing from a fetch, when it was first missed): see _fold_fetched."""
        self._origin_saved = False
        self._opened = False
        """True once open() checked the state store against the topic."""
        self._closed = False

    @classmethod
    async def open(cls, target: KafkaTarget, state: SqlEventLog) -> KafkaEventLog:
        """Create the topic if needed, read it whole, and check the state store against it."""
        await ensure_topic(target)
        producer = AIOKafkaProducer(
            bootstrap_servers=target.bootstrap,
            acks="all",
            enable_idempotence=False,
            linger_ms=0,
            # One record a batch: records in flight wait in the producer's queue, each sent as its
            # own batch. Tansu counts a batch of several records as one in its end offset (10
            # records acknowledged at offsets 0-9 in one batch: end offset 1), which a reader
            # would take for lost records (_end). A batch's first record always fits, whatever its size.
            max_batch_size=1,
            request_timeout_ms=target.request_timeout_ms,
            client_id=f"kvledger-{target.topic}",
        )
        consumer = AIOKafkaConsumer(
            bootstrap_servers=target.bootstrap,
            group_id=None,
            enable_auto_commit=False,
            auto_offset_reset="none",
            isolation_level="read_uncommitted",
            fetch_max_wait_ms=target.fetch_wait_ms,
            request_timeout_ms=target.request_timeout_ms,
            client_id=f"kvledger-{target.topic}",
        )
        event_log = cls(target, state, producer, consumer)
        try:
            try:
                with anyio.fail_after(target.call_timeout_s):
                    await producer.start()
                    await consumer.start()
                    consumer.assign([event_log._partition])
                    begins = await consumer.beginning_offsets([event_log._partition])
            except (KafkaError, OSError, TimeoutError) as error:
                raise LogUnavailable(f"cannot open log {target.url}: {one_line(error)}") from error
            begin = int(begins[event_log._partition])
            if begin > 0:
                raise LogDiverged(
                    f"topic {target.topic!r} on {target.url} now begins at offset {begin}: records before it were "
                    "deleted (retention?), and the log needs its whole history (set retention.ms=-1 on the topic)"
                )
            consumer.seek(event_log._partition, 0)
            event_log._fetcher = asyncio.create_task(event_log._fetch_forever())
            event_log._kafka_writer.start()
            await event_log._catch_up()
            await event_log._check_state_store()
            event_log._opened = True
        except BaseException:
            with anyio.CancelScope(shield=True):
                await event_log.close()
            raise
        log.info(
            "kafka_log_opened",
            url=target.url,
            records=event_log._fold.next_offset,
            global_seq=event_log._fold.head,
            streams=len(event_log._fold.versions),
            state=state.url,
        )
        return event_log

    @property
    def failure(self) -> str | None:
        """Why the log failed closed (None while it is healthy): for a readiness check."""
        return None if self._failure is None else self._failure[1]

    # --- writing ---------------------------------------------------------------------------

    async def append(self, batches: Sequence[AppendBatch], *, expected_head: int | None = None) -> list[AppendResult]:
        """Append every batch atomically; raises WrongExpectedVersion, HeadMoved, WriterFenced or
        AppendRejected and appends nothing. Appends are pipelined: see KafkaWriter.append."""
        return await self._kafka_writer.append(batches, expected_head=expected_head)

    async def queue_append(self, batches: Sequence[AppendBatch], *, expected_head: int | None = None) -> QueuedAppend:
        """PipelinedLog: check the append and queue it behind this writer's appends in flight;
        its results (or the fold's refusal) come from the returned handle's `results`."""
        return await self._kafka_writer.queue(batches, expected_head=expected_head)

    # --- reading ---------------------------------------------------------------------------

    async def read(self, after_seq: int = 0, limit: int = 10_000) -> list[StoredEvent]:
        return events_of(await self.read_steps(after_seq, limit), after_seq, limit)

    async def read_steps(self, after_seq: int = 0, limit: int = 10_000) -> list[StoredStep]:
        if limit <= 0:
            return []
        if self._fold.head < after_seq + limit:
            await self._catch_up()  # it may hold more by now
        self.check()
        return self._fold.steps_for(after_seq, limit)

    async def read_stream_steps(self, stream_id: str, after_seq: int = 0, limit: int = 1_000) -> list[StoredStep]:
        if limit <= 0:
            return []
        await self._catch_up()
        self.check()
        return self._fold.stream_steps_for(stream_id, after_seq, limit)

    async def tail(self, after_seq: int = 0, batch: int = 10_000) -> AsyncIterator[StoredEvent]:
        """Every committed event after `after_seq`, in order, forever: woken by every record
        folded (the fetch waits on the broker); an idle tail checks the topic's end."""
        last = after_seq
        while True:
            self.check()
            waiter = self._advanced
            events = events_of(self._fold.steps_for(last, batch), last, batch)
            for event in events:
                yield event
                last = event.global_seq
            if len(events) < batch:
                with anyio.move_on_after(TAIL_CHECK_S) as idle:
                    await waiter.wait()
                if idle.cancelled_caught:
                    await self._end()

    async def head(self) -> int:
        await self._catch_up()
        return self._fold.head

    async def find_commands(self, command_ids: Sequence[str]) -> dict[str, AppendResult]:
        """From the records folded so far, without asking the broker: a stream's commands come
        from its one writer, which has folded its own records (the fold also answers a command
        id that another writer committed meanwhile, at append time)."""
        self.check()
        commands = self._fold.commands
        return {command_id: commands[command_id] for command_id in command_ids if command_id in commands}

    async def stream_version(self, stream_id: str) -> int:
        await self._catch_up()
        return self._fold.versions.get(stream_id, 0)

    async def stream_versions(self) -> dict[str, int]:
        await self._catch_up()
        return {stream: version for stream, version in self._fold.versions.items() if version}

    async def close(self) -> None:
        if self._closed:
            return
        with anyio.CancelScope(shield=True):
            if self._opened and not self._origin_saved and self._fold.origin is not None:
                # The topic was empty at open: remember which history this store now follows (the
                # one this process read, even if the topic lost it since: the next open refuses then).
                try:
                    await self._save_origin()
                except Exception as error:  # noqa: BLE001 - only the next open's check is weaker for it
                    log.warning("kafka_origin_not_saved", url=self.url, error=one_line(error))
            self._closed = True
            try:
                tasks = [task for task in (*self._kafka_writer.tasks(), self._fetcher) if task is not None]
                for task in tasks:
                    task.cancel()
                if tasks:
                    await asyncio.wait(tasks)
                for client in (self._consumer, self._producer):
                    await self._stop(client)
            finally:
                await super().close()  # the state store's engine, whatever the clients did

    async def _stop(self, client: Any) -> None:
        """Stop one aiokafka client, bounded. With the broker down, a consumer's stop re-raises
        the CancelledError of its fetch task sleeping in backoff: that is not our cancellation,
        so it is logged, and the other client and the state store are still closed."""
        task = asyncio.current_task()
        try:
            with anyio.move_on_after(self.target.call_timeout_s):
                await client.stop()
        except asyncio.CancelledError as error:
            if task is not None and task.cancelling():
                raise
            log.warning("kafka_client_stop_failed", url=self.url, error=f"CancelledError: {error}")
        except (KafkaError, OSError) as error:
            log.warning("kafka_client_stop_failed", url=self.url, error=one_line(error))

    # --- following the topic -------------------------------------------------------------------

    async def _fetch_forever(self) -> None:
        """Fold every record as it arrives, in offset order; any error fails the log closed."""
        try:
            while True:
                fetched = await self._consumer.getmany(self._partition, timeout_ms=1000, max_records=FETCH_RECORDS)
                missing = self._fold_fetched(fetched.get(self._partition, []))
                if missing is None:
                    continue
                if missing < 0:
                    return
                self._consumer.seek(self._partition, missing)
                await asyncio.sleep(HOLE_RETRY_S)
        except asyncio.CancelledError:
            raise
        except OffsetOutOfRangeError as error:
            self.fail_closed(
                LogDiverged(
                    f"topic {self.target.topic!r} on {self.url} has no record at offset {self._fold.next_offset}, the next "
                    f"one this log reads ({one_line(error)}): the topic went backwards; refusing to continue a forked history"
                )
            )
        except Exception as error:  # noqa: BLE001 - the fetcher's end: recorded, and raised by every later call
            self.fail_closed(LogUnavailable(f"reading {self.url} failed: {one_line(error)}"))

    def _fold_fetched(self, records: Sequence[Any]) -> int | None:
        """Fold fetched records in offset order. Returns None, or the offset to fetch again from
        when a record is missing before them, or -1 when the log failed closed.

        A fetch may skip a committed record: Tansu (its memory storage) can answer a fetch at
        offset N with the record at N + 1 while the one at N, acknowledged to another producer,
        is not readable yet (5 producers at once, 3 tailing consumers: about 1 record in 500 was
        skipped by one consumer and read by the others). Folding past it loses that record for
        this reader for good: a tail never sees its events, or its writer's read-back finds
        another record at its offset (LogDiverged). So a hole is fetched again until it fills.
        Kafka leaves no hole below its high watermark in a topic only kvledger writes (no
        transactions, no compaction). One that stays HOLE_TIMEOUT_S fails the log closed, naming
        the offsets: folding past it could lose a committed record for this reader alone, and its
        state would then differ from every other reader's without a word."""
        folded = False
        try:
            for record in records:
                offset = int(record.offset)
                expected = self._fold.next_offset
                if offset < expected:
                    continue  # folded already by its writer
                if offset > expected:
                    return -1 if self._hole_timed_out(expected, offset) else expected
                if not self._fold_record(offset, record.headers, record.value):
                    return -1
                folded = True
            return None
        finally:
            if folded:
                self._wake()

    def _hole_timed_out(self, expected: int, offset: int) -> bool:
        """Whether the records expected..offset-1, missing from a fetch, stayed missing
        HOLE_TIMEOUT_S: the log has then failed closed."""
        now = time.monotonic()
        if self._hole is None or self._hole[0] != expected:
            self._hole = (expected, now)
            log.debug("kafka_fetch_hole", url=self.url, missing=expected, fetched=offset)
            return False
        waited = now - self._hole[1]
        if waited < HOLE_TIMEOUT_S:
            return False
        self.fail_closed(
            LogDiverged(
                f"topic {self.target.topic!r} on {self.url} holds no readable record at offsets {expected}..{offset - 1} "
                f"after {waited:.1f} s, below the record at {offset}: a topic kvledger reads must hold every offset "
                "(no transactional writer, no compaction); refusing to fold past records this reader may never see"
            )
        )
        return True

    def _fold_record(self, offset: int, headers: Sequence[tuple[str, bytes]], value: bytes | None) -> bool:
        # This writer's own record, acknowledged or fetched: folded from the appends it encoded
        # (KafkaFold.fold's `decoded`), not decoded back from its bytes.
        sent = self._kafka_writer.sent_appends(headers)
        try:
            skipped = self._fold.fold(offset, headers, value, sent)
        except LogError as error:
            self.fail_closed(error)
            return False
        if skipped is not None:
            log.warning("kafka_record_skipped", url=self.url, offset=offset, reason=skipped)
        return True

    def _wake(self) -> None:
        event, self._advanced = self._advanced, anyio.Event()
        event.set()

    def fail_closed(self, error: LogError) -> None:
        if self._failure is None:
            self._failure = (type(error), str(error))
            log.error("kafka_log_failed_closed", url=self.url, error=type(error).__name__, reason=str(error))
        self._wake()

    def check(self) -> None:
        if self._failure is not None:
            kind, reason = self._failure
            raise kind(reason)
        if self._closed:
            raise LogUnavailable(f"log {self.url} is closed")

    def failed(self) -> LogError | None:
        return None if self._failure is None else self._failure[0](self._failure[1])

    async def _end(self) -> int:
        """The topic's end offset now; fails the log closed if it stays below what was read.

        Tansu's end offset can lag the records it has acknowledged and serves, by a few offsets
        for a few ms while several producers write (measured: 1 to 26 ms, 5 producers), so an
        end below what was read is asked again for END_SETTLE_S before it counts as lost records."""
        self.check()
        behind_since: float | None = None
        while True:
            try:
                with anyio.fail_after(self.target.call_timeout_s):
                    ends = await self._consumer.end_offsets([self._partition])
            except (KafkaError, OSError, TimeoutError) as error:
                raise LogUnavailable(f"cannot reach log {self.url}: {one_line(error)}") from error
            end = int(ends[self._partition])
            if end >= self._fold.next_offset:
                return end
            now = time.monotonic()
            if behind_since is None:
                behind_since = now
                log.debug("kafka_end_behind", url=self.url, end=end, read_to=self._fold.next_offset - 1)
            elif now - behind_since >= END_SETTLE_S:
                self.fail_closed(
                    LogDiverged(
                        f"topic {self.target.topic!r} on {self.url} now ends at offset {end}, but this log has read up "
                        f"to offset {self._fold.next_offset - 1}: the broker lost committed records; refusing to "
                        "continue a forked history"
                    )
                )
                self.check()
            await anyio.sleep(HOLE_RETRY_S)

    async def _catch_up(self) -> None:
        """Fold everything committed before this call."""
        await self._reach(await self._end(), "catching up with the topic")

    def pause_fetching(self) -> None:
        """Stop fetching while this writer's records are in flight: it folds them from what it
        sent as they are acknowledged, and the broker need not send each back (the fetches cost
        the broker and this process about as much again as the produces)."""
        if self._fetching and not self._reaching:
            self._fetching = False
            self._consumer.pause(self._partition)

    def resume_fetching(self) -> None:
        """Fetch again from the next offset to fold: another writer's records are wanted (an
        acknowledged offset past the next one to fold, a read of the topic's end), or this
        writer has nothing in flight."""
        if not self._fetching:
            self._fetching = True
            self._consumer.seek(self._partition, self._fold.next_offset)
            self._consumer.resume(self._partition)

    async def _reach(self, offset: int, doing: str) -> None:
        if self._fold.next_offset < offset:
            self.resume_fetching()
        self._reaching += 1  # fetching is not paused while anything waits here (pause_fetching)
        try:
            with anyio.fail_after(self.target.call_timeout_s):
                while self._fold.next_offset < offset:
                    self.check()
                    await self._advanced.wait()
        except TimeoutError:
            raise LogUnavailable(
                f"log {self.url}: no records from the broker for {self.target.call_timeout_s:.0f} s while {doing}"
            ) from None
        finally:
            self._reaching -= 1
        self.check()

    # --- the writer's records (events/log/_kafka_writer.py: KafkaWriter's Follower) ----------------

    async def read_back(self, offset: int, headers: list[tuple[str, bytes]], value: bytes) -> None:
        """Fold up to this writer's record acknowledged at `offset`: from the bytes it sent when
        everything before it is folded, else once the fetcher brought what comes before."""
        self._acked[offset] = (headers, value)
        try:
            self._fold_acked()
            await self._reach(offset + 1, f"reading back the record acknowledged at offset {offset}")
        finally:
            self._acked.pop(offset, None)

    def _fold_acked(self) -> None:
        """Fold this writer's own acknowledged records from the fold's next offset on, from the
        bytes it sent, rather than wait for the fetcher to bring them back."""
        acked, folded = self._acked, False
        while (record := acked.get(self._fold.next_offset)) is not None:
            if not self._fold_record(self._fold.next_offset, *record):
                break
            folded = True
        if folded:
            self._wake()

    async def appended(self) -> None:
        if not self._origin_saved:
            # The topic was empty at open: from its first record on, the state store names the
            # history it follows, so a restart on a topic that lost it is refused even after a kill.
            try:
                await self._save_origin()
            except Exception as error:  # noqa: BLE001 - the record is committed; close() tries again
                log.warning("kafka_origin_not_saved", url=self.url, error=one_line(error))

    # --- the state store -------------------------------------------------------------------------

    async def _check_state_store(self) -> None:
        """Refuse a state store built from another history of the topic, or ahead of it."""
        origin, saved = self._fold.origin_code(), await self.checkpoint(ORIGIN_CHECKPOINT)
        if saved and saved != origin:
            found = "is empty" if not origin else "begins with another record"
            raise LogDiverged(
                f"topic {self.target.topic!r} on {self.url} {found}, but the state store {self.state_url} was built from "
                "a topic that began otherwise: the topic lost its history (or the store belongs to another topic); "
                "refusing to continue a forked history. Move the store away to rebuild it from the topic."
            )
        progress = await self._progress()
        if progress and not saved:
            raise LogDiverged(
                f"the state store {self.state_url} holds checkpoints up to global sequence {progress} but does not "
                f"name the history of topic {self.target.topic!r} it follows, so it cannot be checked against the "
                "topic; refusing to continue what may be a forked history. Move the store away to rebuild it."
            )
        if progress > self._fold.head:
            raise LogDiverged(
                f"the state store {self.state_url} holds a checkpoint at global sequence {progress}, but topic "
                f"{self.target.topic!r} on {self.url} holds {self._fold.head} events: the broker lost committed "
                "events; refusing to continue a forked history"
            )
        snapshots = await self.snapshots(1)
        if snapshots and snapshots[0].global_seq > self._fold.head:
            raise LogDiverged(
                f"the state store {self.state_url} holds a snapshot at global sequence {snapshots[0].global_seq}, "
                f"but topic {self.target.topic!r} on {self.url} holds {self._fold.head} events: the broker lost "
                "committed events; refusing to continue a forked history"
            )
        if origin:
            await self._save_origin()

    async def _progress(self) -> int:
        """The highest projection checkpoint in the state store (0: none)."""
        async with self.engine.connect() as conn:
            found = (
                await conn.execute(
                    sa.select(sa.func.max(t.checkpoints.c.global_seq)).where(t.checkpoints.c.name != ORIGIN_CHECKPOINT)
                )
            ).scalar()
        return int(found or 0)

    @asynccontextmanager
    async def projection_transaction(self, name: str) -> AsyncIterator[SqlProjectionTransaction]:
        """As on SQL, and the store names the topic's history in the same transaction as its
        first checkpoint: a reader killed before close() (the fleet service, the audit CLI) still
        leaves a store that a restart can check against the topic."""
        async with super().projection_transaction(name) as tx:
            yield tx
            origin = self._fold.origin_code()
            naming = not self._origin_saved and name != ORIGIN_CHECKPOINT and bool(origin)
            if naming:
                await SqlProjectionTransaction(tx.connection, ORIGIN_CHECKPOINT, self.dialect).advance(origin)
        if naming:
            self._origin_saved = True

    async def _save_origin(self) -> None:
        origin = self._fold.origin_code()
        if not origin:
            return
        async with self.projection_transaction(ORIGIN_CHECKPOINT) as tx:
            await tx.advance(origin)
        self._origin_saved = True
