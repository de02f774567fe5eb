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

Writers. A stream has one writer at a time. A KafkaEventLog claims a stream before its first
append to it: it writes a claim record with epoch = the highest epoch seen on that stream + 1,
and from then on stamps its epoch and writer id on every part it appends there. Readers drop
any part whose epoch is not the stream's current claim, so a second writer (a restarted sidecar)
fences the first: the old one's later records, even ones still in flight when the new one
claimed, are dropped by every reader, and the old writer gets WriterFenced. Expected versions,
command ids and event-id uniqueness are checked by the writer before it produces (it folds the
topic too), and checked again by the fold, which is the arbiter: after the broker acknowledges
a record at offset N, the writer folds up to N and reports what the fold made of it.

Pipelining. Appends do not wait for each other's round trip. An append is checked against the
fold plus this writer's appends still in flight (the log as it will be if they are accepted)
and queued; one sender task produces the queue, and every append queued while the previous
record travelled goes out together in the next record (kind `appends`, up to MAX_RECORD_BYTES).
The fold judges each append alone, in offset order, so an append decided on one that is then
refused is refused too: by its expected version, or, when it names the head, by rule 0's
`follows`. A retry of a command id still in flight waits for its verdict and is answered by it.
Claims are not pipelined: a claim waits until every append in flight has its verdict.

No idempotent producer, no transactions (the test broker, Tansu, rejects InitProducerId, and the
design does not need them): the producer runs with acks="all" and enable_idempotence=False. A
producer retry may store a record twice; the copy has the same stream, version and event ids as
the accepted original and is applied once (rule 2 of the fold). A write whose acknowledgement is
lost raises LogUnavailable; retrying it with the same command id is answered from the log.
No consumer group and no auto-commit: a reader assigns partition 0 and reads from offset 0, every
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
import uuid
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from typing import Any

import anyio
import msgspec
import sqlalchemy as sa
import structlog
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition  # type: ignore[import-untyped]
from aiokafka.errors import KafkaError, MessageSizeTooLargeError, OffsetOutOfRangeError  # type: ignore[import-untyped]

from events.log import schema as t
from events.log._contract import (
    AppendBatch,
    AppendRejected,
    AppendResult,
    HeadMoved,
    LogDiverged,
    LogError,
    LogUnavailable,
    StoredEvent,
    StoredStep,
    WriterFenced,
    WrongExpectedVersion,
    pack_step,
)
from events.log._kafka_fold import (
    ENGINE_STREAM_PREFIX,
    AppendRecord,
    ClaimRecord,
    KafkaFold,
    ReadAppend,
    StepPart,
    Verdict,
    encode_appends,
    encode_claim,
    first_repeated,
)
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
CLAIM_ATTEMPTS = 3
SENT_HEADER = "kvl-sent"
"""A Kafka header naming this writer's record (writer id:count), so that it folds its own record
from what it encoded. Readers ignore it; it is not part of the record's format."""
MAX_RECORD_BYTES = 512 * 1024
"""Appends queued while a record travels go out together in the next one, up to this many bytes
of steps (a larger append goes alone): well under the producer's and brokers' 1 MiB default."""
ORIGIN_CHECKPOINT = "kvledger.kafka.origin"
"""The state store's checkpoint naming the topic history it was built from (KafkaFold.origin_code)."""


class _InFlight:
    """One append of this writer's, from its check until the fold's verdict on it: what it will
    change once accepted (for checking the appends behind it), and the verdict when it comes."""

    __slots__ = ("record", "read", "versions", "commands", "events", "size", "done", "verdict")

    def __init__(
        self,
        record: AppendRecord,
        read: list[tuple[StepPart, list[str]]],
        versions: dict[str, int],
        commands: set[str],
    ) -> None:
        self.record = record
        self.read = read
        """The record's parts with their event ids: what the fold reads from it (ReadAppend)."""
        self.versions = versions
        """stream -> its version after this append."""
        self.commands = commands
        self.events = sum(len(event_ids) for _, event_ids in read)
        self.size = sum(len(part.header) + len(part.payload) for part in record.parts)
        self.done = anyio.Event()
        self.verdict: Verdict | None = None

    def settle(self, verdict: Verdict) -> None:
        if not self.done.is_set():
            self.verdict = verdict
            self.done.set()


class KafkaEventLog(SqlEventLog):
    """EventLog on a Kafka topic, with a SQL state store for checkpoints, projections and
    snapshots. Open it with events.log.open_log("kafka://...")."""

    def __init__(self, target: KafkaTarget, state: SqlEventLog, producer: Any, consumer: Any) -> None:
        super().__init__(state.engine, target.url, state.blocking_engine)
        self.target = target
        self.state_url = state.url
        """Masked: safe to print."""
        self.writer_id = uuid.uuid4().hex
        self._fold = KafkaFold()
        self._producer = producer
        self._consumer = consumer
        self._partition = TopicPartition(target.topic, 0)
        self._held: dict[str, int] = {}
        """Streams this writer claimed: stream id -> its epoch there."""
        self._appending = anyio.Lock()
        """Held while an append is checked and queued, not while it travels: appends are queued,
        and produced, in the order they were checked (append)."""
        self._in_flight: list[_InFlight] = []
        """This writer's appends from their check until their verdict (see _pending)."""
        self._outbox: list[_InFlight] = []
        """Appends checked and not yet handed to the producer, in order (the sender takes them)."""
        self._outbox_ready = anyio.Event()
        self._sender: asyncio.Task[None] | None = None
        self._deliveries: set[asyncio.Task[None]] = set()
        self._fetching = True
        """False while fetching is paused (see _pause_fetching)."""
        self._reaching = 0
        """Calls waiting for the fold to reach an offset (_reach): fetching is not paused meanwhile."""
        self._records_sent = 0
        self._sending: dict[bytes, list[ReadAppend]] = {}
        """SENT_HEADER token -> the appends of this writer's record produced and not yet read back."""
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
            event_log._sender = asyncio.create_task(event_log._send_forever())
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
        AppendRejected and appends nothing.

        Appends are pipelined. A call made while others are in flight is checked against the log
        as it will be once they are accepted, and queued behind them; appends queued while a
        record travels go out together in the next record (one round trip for all), each still
        judged alone by the fold, in order: one decided on an append that was then refused is
        refused too, with its own error (rule 0's `follows`, or its expected version)."""
        while True:
            async with self._appending:
                self._check()
                waiting = self._command_in_flight(batches)
                if waiting is None:
                    results, sent, first_of, flight = await self._enqueue(batches, expected_head)
                    break
            await waiting.wait()  # a retry of a command still in flight: answered once it is judged
        if flight is not None:
            appended = await self._verdict_of(flight)
            for (index, _), result in zip(sent, appended, strict=True):
                results[index] = result
        for index, batch in enumerate(batches):
            if results[index] is None:
                assert batch.command_id is not None
                first = results[first_of[batch.command_id]]
                assert first is not None
                results[index] = msgspec.structs.replace(first, duplicate=True)
        return [result for result in results if result is not None]

    def _command_in_flight(self, batches: Sequence[AppendBatch]) -> anyio.Event | None:
        """The in-flight append carrying one of these command ids, to wait for, if any."""
        commands = {batch.command_id for batch in batches if batch.command_id is not None}
        for flight in self._pending() if commands else ():
            if not commands.isdisjoint(flight.commands):
                return flight.done
        return None

    def _pending(self) -> list[_InFlight]:
        """This writer's appends not folded yet, oldest first. One leaves this list the moment
        the fold judges it (KafkaFold.awaited), accepted or refused, so the fold's state plus
        these is the log as it will be if they are all accepted."""
        awaited = self._fold.awaited
        self._in_flight = [flight for flight in self._in_flight if flight.record.append_id in awaited]
        return self._in_flight

    async def _enqueue(
        self, batches: Sequence[AppendBatch], expected_head: int | None
    ) -> tuple[list[AppendResult | None], list[tuple[int, AppendBatch]], dict[str, int], _InFlight | None]:
        """Check `batches` against the fold and this writer's appends in flight, and queue their
        record for the sender: (results known already, the batches sent, each command id's first
        batch, the append in flight). Called with the append lock held."""
        await self._claim_streams_of(batches)
        pending = self._pending()
        fold = self._fold
        head = fold.head + sum(flight.events for flight in pending)
        if expected_head is not None and head != expected_head:
            raise HeadMoved(expected_head, head)  # the fold would refuse it too (its rule 0)
        results: list[AppendResult | None] = [None] * len(batches)
        sent: list[tuple[int, AppendBatch]] = []
        first_of: dict[str, int] = {}
        versions: dict[str, int] = {}
        ids: set[str] = set()
        for index, batch in enumerate(batches):
            stream, command_id = batch.stream_id, batch.command_id
            if command_id is not None:
                if command_id in fold.commands:
                    results[index] = fold.commands[command_id]
                    continue
                if command_id in first_of:
                    continue  # answered by its first batch below, as the SQL log does
                first_of[command_id] = index
            self._check_not_fenced(stream)
            actual = versions.get(stream)
            if actual is None:
                actual = next(
                    (flight.versions[stream] for flight in reversed(pending) if stream in flight.versions),
                    fold.versions.get(stream, 0),
                )
            if batch.expected_version != actual:
                raise WrongExpectedVersion(stream, batch.expected_version, actual)
            # Ids new to the committed log; one repeated from an append still in flight is refused
            # by the fold (rule 5), in order, like every other conflict with an append in flight.
            batch_ids = {event.event_id for event in batch.events}  # set operations: no loop an event
            if len(batch_ids) != len(batch.events) or not batch_ids.isdisjoint(ids) or not batch_ids.isdisjoint(fold.event_ids):
                repeated = first_repeated([event.event_id for event in batch.events], ids | fold.event_ids)
                raise AppendRejected(f"append refused by {self.url}: event id {repeated!r} is already in the log")
            ids |= batch_ids
            versions[stream] = actual + len(batch.events)
            if batch.events or command_id is not None:
                sent.append((index, batch))
            else:
                results[index] = AppendResult(stream_id=stream, first_seq=0, last_seq=0, stream_version=actual)
        if not sent:
            return results, sent, first_of, None
        follows = pending[-1].record.append_id if pending and expected_head is not None else None
        parts = [self._part(batch) for _, batch in sent]
        record = AppendRecord(uuid.uuid4().hex, self.writer_id, parts, expected_head, follows)
        read = [(part, [event.event_id for event in batch.events]) for part, (_, batch) in zip(parts, sent, strict=True)]
        flight = _InFlight(record, read, versions, set(first_of))
        self._fold.awaited.add(record.append_id)
        self._in_flight.append(flight)
        self._outbox.append(flight)
        self._outbox_ready.set()
        return results, sent, first_of, flight

    def _part(self, batch: AppendBatch) -> StepPart:
        schemas, header, payload = pack_step(batch.events)
        first = batch.events[0] if batch.events else None
        return StepPart(
            batch.stream_id,
            self._held[batch.stream_id],
            batch.expected_version,
            batch.command_id,
            first.step if first else -1,
            first.recorded_at if first else 0.0,
            schemas,
            header,
            payload,
            batch.digest,
        )

    async def _claim_streams_of(self, batches: Sequence[AppendBatch]) -> None:
        """Claim the streams these batches write that this writer does not hold, once its
        appends in flight are judged (a claim then comes after them in the topic, as it did
        when appends went one at a time)."""
        streams = {batch.stream_id for batch in batches if batch.events or batch.command_id is not None}
        for stream in streams:
            if not stream.startswith(ENGINE_STREAM_PREFIX) and stream in self._held and self._claimed_by_other(stream):
                # A shared stream (a tier's, the namespaces', reports') that another writer (a
                # sidecar on the same log) claimed since: claimed again. Its expected versions
                # and the head guard it; only an engine's stream has a single writer.
                del self._held[stream]
        unclaimed = sorted(streams - set(self._held))
        if unclaimed:
            for flight in list(self._in_flight):
                await flight.done.wait()
            await self._claim(unclaimed)

    def _claimed_by_other(self, stream: str) -> bool:
        return self._fold.epochs.get(stream) != (self._held[stream], self.writer_id)

    def _check_not_fenced(self, stream: str) -> None:
        if stream in self._held and self._claimed_by_other(stream):
            epoch, writer = self._fold.epochs[stream]
            raise WriterFenced(
                f"stream {stream!r} of {self.url} was claimed at epoch {epoch} by writer {writer}; this writer "
                f"({self.writer_id}, epoch {self._held[stream]}) is fenced and may not append to it"
            )

    async def _verdict_of(self, flight: _InFlight) -> list[AppendResult]:
        """Wait for the fold's verdict on an append in flight: its results, or its error."""
        await flight.done.wait()
        verdict = flight.verdict
        if isinstance(verdict, LogError):
            if isinstance(verdict, AppendRejected):
                raise AppendRejected(f"append refused by {self.url}: {verdict}")
            raise verdict
        assert isinstance(verdict, list)
        if not self._origin_saved:
            # The topic was empty at open: from its first record on, the state store names the
            # history it follows, so a restart on a topic that lost it is refused even after a kill.
            try:
                await self._save_origin()
            except Exception as error:  # noqa: BLE001 - the record is committed; close() tries again
                log.warning("kafka_origin_not_saved", url=self.url, error=one_line(error))
        return verdict

    async def _send_forever(self) -> None:
        """The sender: takes the queued appends (as many as fit MAX_RECORD_BYTES, at least one)
        and produces them as one record. The producer holds one record while another travels
        (one request at a time to a broker, in order); while it is full this task waits, and the
        appends queued meanwhile go out together next."""
        try:
            while True:
                while not self._outbox:
                    await self._outbox_ready.wait()
                    self._outbox_ready = anyio.Event()
                if self._failure is not None:
                    self._settle_failed(self._take(len(self._outbox)), self._failure[0](self._failure[1]))
                    continue
                size, count = self._outbox[0].size, 1
                while count < len(self._outbox) and size + self._outbox[count].size <= MAX_RECORD_BYTES:
                    size += self._outbox[count].size
                    count += 1
                flights = self._take(count)
                value, headers = encode_appends([flight.record for flight in flights])
                self._records_sent += 1
                token = f"{self.writer_id}:{self._records_sent}".encode()
                headers.append((SENT_HEADER, token))
                self._sending[token] = [(flight.record, flight.read) for flight in flights]
                self._pause_fetching()
                try:
                    delivery = await self._producer.send(
                        self.target.topic, value, key=flights[0].record.parts[0].stream_id.encode(), partition=0, headers=headers
                    )
                except (KafkaError, OSError) as error:
                    self._sending.pop(token, None)
                    self._settle_failed(flights, self._send_error(value, error))
                    continue
                except BaseException:
                    self._sending.pop(token, None)
                    self._settle_failed(flights, LogUnavailable(f"log {self.url} is closed"))
                    raise
                task = asyncio.create_task(self._delivered(flights, value, headers, delivery, token))
                self._deliveries.add(task)
                task.add_done_callback(self._deliveries.discard)
        except Exception as error:  # noqa: BLE001 - the sender's end: recorded, and raised by every later call
            self._fail(LogUnavailable(f"appending to {self.url} failed: {one_line(error)}"))
        finally:
            self._settle_failed(self._take(len(self._outbox)), LogUnavailable(f"log {self.url} is closed"))

    def _take(self, count: int) -> list[_InFlight]:
        taken = self._outbox[:count]
        del self._outbox[:count]
        return taken

    async def _delivered(
        self,
        flights: list[_InFlight],
        value: bytes,
        headers: list[tuple[str, bytes]],
        delivery: asyncio.Future[Any],
        token: bytes,
    ) -> None:
        """Wait for a record's acknowledgement, fold up to it, and hand each of its appends its verdict."""
        try:
            metadata = await delivery
            offset = int(metadata.offset)
            await self._read_back(offset, headers, value)
        except (KafkaError, OSError) as error:
            self._settle_failed(flights, self._send_error(value, error))
            return
        except LogError as error:
            self._settle_failed(flights, error)
            return
        except BaseException:
            self._settle_failed(flights, LogUnavailable(f"log {self.url} is closed"))
            raise
        finally:
            self._sending.pop(token, None)
            if not self._sending:
                self._resume_fetching()  # nothing of its own in flight: follow the other writers again
        for flight in flights:
            flight.settle(self._verdict_at(flight.record.append_id, offset))

    def _settle_failed(self, flights: list[_InFlight], error: LogError) -> None:
        for flight in flights:
            self._fold.awaited.discard(flight.record.append_id)
            flight.settle(error)

    async def _read_back(self, offset: int, headers: list[tuple[str, bytes]], value: bytes) -> None:
        """Fold up to this writer's record acknowledged at `offset`: from the bytes it sent when
        everything before it is folded, else once the fetcher brought what comes before."""
        self._acked[offset] = (headers, value)
        try:
            self._fold_acked()
            await self._reach(offset + 1, f"reading back the record acknowledged at offset {offset}")
        finally:
            self._acked.pop(offset, None)

    def _verdict_at(self, record_id: str, offset: int) -> Verdict:
        """The fold's verdict on this writer's record (or append) read back at `offset`."""
        verdict = self._fold.verdicts.pop(record_id, None)
        if verdict is None:
            self._fold.awaited.discard(record_id)
            self._fail(
                LogDiverged(
                    f"topic {self.target.topic!r} on {self.url}: the broker acknowledged this writer's record at offset "
                    f"{offset}, but the record read at that offset is another: the topic went backwards (committed "
                    "records were lost) and was written again; refusing to continue a forked history"
                )
            )
            assert self._failure is not None
            return self._failure[0](self._failure[1])
        return verdict

    async def _claim(self, streams: list[str]) -> None:
        """Claim `streams` at their highest epoch + 1; a claim that lost a race is made again."""
        for _ in range(CLAIM_ATTEMPTS):
            epochs = {stream: self._fold.epochs.get(stream, (0, ""))[0] + 1 for stream in streams}
            claim = ClaimRecord(uuid.uuid4().hex, self.writer_id, epochs)
            won = await self._send(claim.claim_id, *encode_claim(claim), key=streams[0])
            if isinstance(won, LogError):
                raise won
            assert isinstance(won, dict)
            self._held.update(won)
            log.info("kafka_streams_claimed", url=self.url, writer=self.writer_id, epochs=won)
            streams = [stream for stream in streams if stream not in won]
            if not streams:
                return
        raise WriterFenced(f"{self.url}: other writers kept claiming stream(s) {', '.join(streams)} first")

    async def _send(self, record_id: str, value: bytes, headers: list[tuple[str, bytes]], *, key: str) -> Verdict:
        """Produce one record (a claim) and fold up to it: its verdict."""
        self._fold.awaited.add(record_id)
        try:
            metadata = await self._producer.send_and_wait(
                self.target.topic, value, key=key.encode(), partition=0, headers=headers
            )
        except (KafkaError, OSError) as error:
            self._fold.awaited.discard(record_id)
            raise self._send_error(value, error) from error
        except BaseException:
            self._fold.awaited.discard(record_id)
            raise
        offset = int(metadata.offset)
        await self._read_back(offset, headers, value)
        return self._verdict_at(record_id, offset)

    def _send_error(self, value: bytes, error: KafkaError | OSError) -> LogError:
        """What a failed produce raises, for what Kafka said."""
        if isinstance(error, MessageSizeTooLargeError):
            return AppendRejected(
                f"its record is {len(value):,} bytes, more than the broker or producer takes ({one_line(error)}); split the step"
            )
        return LogUnavailable(
            f"append to {self.url} failed ({one_line(error)}): it may or may not be committed; retry it with the same command id"
        )

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

    # --- reading ---------------------------------------------------------------------------

    async def read(self, after_seq: int = 0, limit: int = 10_000) -> list[StoredEvent]:
        return events_of(await self.read_steps(after_seq, limit), after_seq, limit)

    async def read_steps(self, after_seq: int = 0, limit: int = 10_000) -> list[StoredStep]:
        if limit <= 0:
            return []
        if self._fold.head < after_seq + limit:
            await self._catch_up()  # it may hold more by now
        self._check()
        return self._fold.steps_for(after_seq, limit)

    async def read_stream_steps(self, stream_id: str, after_seq: int = 0, limit: int = 1_000) -> list[StoredStep]:
        if limit <= 0:
            return []
        await self._catch_up()
        self._check()
        return self._fold.stream_steps_for(stream_id, after_seq, limit)

    async def tail(self, after_seq: int = 0, batch: int = 10_000) -> AsyncIterator[StoredEvent]:
        """Every committed event after `after_seq`, in order, forever: woken by every record
        folded (the fetch waits on the broker); an idle tail checks the topic's end."""
        last = after_seq
        while True:
            self._check()
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
        self._check()
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
                tasks = [task for task in (self._sender, *self._deliveries, self._fetcher) if task is not None]
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
            self._fail(
                LogDiverged(
                    f"topic {self.target.topic!r} on {self.url} has no record at offset {self._fold.next_offset}, the next "
                    f"one this log reads ({one_line(error)}): the topic went backwards; refusing to continue a forked history"
                )
            )
        except Exception as error:  # noqa: BLE001 - the fetcher's end: recorded, and raised by every later call
            self._fail(LogUnavailable(f"reading {self.url} failed: {one_line(error)}"))

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
        self._fail(
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
        sent = next((self._sending.get(header) for name, header in headers if name == SENT_HEADER), None)
        try:
            skipped = self._fold.fold(offset, headers, value, sent)
        except LogError as error:
            self._fail(error)
            return False
        if skipped is not None:
            log.warning("kafka_record_skipped", url=self.url, offset=offset, reason=skipped)
        return True

    def _wake(self) -> None:
        event, self._advanced = self._advanced, anyio.Event()
        event.set()

    def _fail(self, error: LogError) -> None:
        if self._failure is None:
            self._failure = (type(error), str(error))
            log.error("kafka_log_failed_closed", url=self.url, error=type(error).__name__, reason=str(error))
        self._wake()

    def _check(self) -> None:
        if self._failure is not None:
            kind, reason = self._failure
            raise kind(reason)
        if self._closed:
            raise LogUnavailable(f"log {self.url} is closed")

    async def _end(self) -> int:
        """The topic's end offset now; fails the log closed if it stays below what was read.

        Tansu's end offset can lag the records it has acknowledged and serves, by a few offsets
        for a few ms while several producers write (measured: 1 to 26 ms, 5 producers), so an
        end below what was read is asked again for END_SETTLE_S before it counts as lost records."""
        self._check()
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
                self._fail(
                    LogDiverged(
                        f"topic {self.target.topic!r} on {self.url} now ends at offset {end}, but this log has read up "
                        f"to offset {self._fold.next_offset - 1}: the broker lost committed records; refusing to "
                        "continue a forked history"
                    )
                )
                self._check()
            await anyio.sleep(HOLE_RETRY_S)

    async def _catch_up(self) -> None:
        """Fold everything committed before this call."""
        await self._reach(await self._end(), "catching up with the topic")

    def _pause_fetching(self) -> None:
        """Stop fetching while this writer's records are in flight: it folds them from what it
        sent as they are acknowledged, and the broker need not send each back (the fetches cost
        the broker and this process about as much again as the produces)."""
        if self._fetching and not self._reaching:
            self._fetching = False
            self._consumer.pause(self._partition)

    def _resume_fetching(self) -> None:
        """Fetch again from the next offset to fold: another writer's records are wanted (an
        acknowledged offset past the next one to fold, a read of the topic's end), or this
        writer has nothing in flight."""
        if not self._fetching:
            self._fetching = True
            self._consumer.seek(self._partition, self._fold.next_offset)
            self._consumer.resume(self._partition)

    async def _reach(self, offset: int, doing: str) -> None:
        if self._fold.next_offset < offset:
            self._resume_fetching()
        self._reaching += 1  # fetching is not paused while anything waits here (_pause_fetching)
        try:
            with anyio.fail_after(self.target.call_timeout_s):
                while self._fold.next_offset < offset:
                    self._check()
                    await self._advanced.wait()
        except TimeoutError:
            raise LogUnavailable(
                f"log {self.url}: no records from the broker for {self.target.call_timeout_s:.0f} s while {doing}"
            ) from None
        finally:
            self._reaching -= 1
        self._check()

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
