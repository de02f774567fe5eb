"""The Kafka log's writing side: claims, appends checked and queued, one sender, verdicts.

A KafkaEventLog (events/log/_kafka.py) follows the topic: it fetches every record and folds it
(events/log/_kafka_fold.py). This module is its writer, which produces to that topic and learns
what became of each of its records from that same fold; what it needs of the log that follows
the topic is `Follower`.

Claims. A stream has one writer at a time. A writer claims a stream before its first append to
it: it writes a claim record with epoch = the highest epoch seen on that stream + 1, and from
then on stamps its epoch and writer id on every part it appends there. Readers drop any part
whose epoch is not the stream's current claim, so a second writer (a restarted sidecar) fences
the first: the old one's later records, even ones still in flight when the new one claimed, are
dropped by every reader, and the old writer gets WriterFenced. Expected versions, command ids
and event-id uniqueness are checked by the writer before it produces (it folds the topic too),
and checked again by the fold, which is the arbiter: after the broker acknowledges a record at
offset N, the writer folds up to N and reports what the fold made of it (its verdict).

Pipelining. Appends do not wait for each other's round trip. An append is checked against the
fold plus this writer's appends still in flight (`_InFlight`: the log as it will be if they are
accepted) and queued (`_outbox`); `queue` returns then, so a caller may keep several in flight.
One sender task (`_send_forever`) produces the queue one record at a time: every append queued
while the previous record travelled goes out together in the next (kind `appends`, up to
MAX_RECORD_BYTES), produced once the previous one is acknowledged. A delivery task per record
(`_delivered`) waits for its acknowledgement, has the follower fold up to it
(`Follower.read_back`: from the bytes sent, when nothing before it is missing) and hands each of
its appends its verdict. The fold judges each append alone, in offset order, so an append decided
on one that is then refused is refused too: by its expected version, or, when it names the head,
by rule 0's `follows`. A retry of a command id still in flight waits for its verdict and is
answered by it. Claims are not pipelined: a claim waits until every append in flight has its
verdict. While its records are in flight the writer has the follower pause fetching (it folds
them from what it sent), and resume once none is.

No idempotent producer, no transactions (the test broker, Tansu, rejects InitProducerId, and the
design does not need them): the producer runs with acks="all" and enable_idempotence=False. A
producer retry may store a record twice; the copy has the same stream, version and event ids as
the accepted original and is applied once (rule 2 of the fold). A write whose acknowledgement is
lost raises LogUnavailable; retrying it with the same command id is answered from the log.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Sequence
from typing import Any, Protocol

import anyio
import msgspec
import structlog
from aiokafka.errors import KafkaError, MessageSizeTooLargeError  # type: ignore[import-untyped]

from events.log._contract import (
    AppendBatch,
    AppendRejected,
    AppendResult,
    HeadMoved,
    LogDiverged,
    LogError,
    LogUnavailable,
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
from events.log.kafka_target import KafkaTarget, one_line

log = structlog.get_logger("kvledger.log")

CLAIM_ATTEMPTS = 3
SENT_HEADER = "kvl-sent"
"""A Kafka header naming this writer's record (writer id:count), so that it folds its own record
from what it encoded. Readers ignore it; it is not part of the record's format."""
MAX_RECORD_BYTES = 512 * 1024
"""Appends queued while a record travels go out together in the next one, up to this many bytes
of steps (a larger append goes alone): well under the producer's and brokers' 1 MiB default."""


class Follower(Protocol):
    """What the writer needs of the log that follows the topic (KafkaEventLog)."""

    def check(self) -> None:
        """Raise the error the log failed closed with, or LogUnavailable once it is closed."""
        ...

    def failed(self) -> LogError | None:
        """The error the log failed closed with (a new instance), None while it is healthy."""
        ...

    def fail_closed(self, error: LogError) -> None:
        """Fail the log closed: every later call raises `error`."""
        ...

    def pause_fetching(self) -> None:
        """This writer is about to produce a record: fetching may pause while it travels."""
        ...

    def resume_fetching(self) -> None:
        """Nothing of this writer's is in flight: follow the other writers again."""
        ...

    async def read_back(self, offset: int, headers: list[tuple[str, bytes]], value: bytes) -> None:
        """Fold up to this writer's record acknowledged at `offset` (these headers and value)."""
        ...

    async def appended(self) -> None:
        """The fold accepted an append of this writer's (the state store may name the topic's history)."""
        ...


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


class QueuedAppend:
    """An append checked and queued (KafkaWriter.queue): its results once the fold judged it."""

    __slots__ = ("_writer", "_batches", "_results", "_sent", "_first_of", "_flight")

    def __init__(
        self,
        writer: KafkaWriter,
        batches: Sequence[AppendBatch],
        results: list[AppendResult | None],
        sent: list[tuple[int, AppendBatch]],
        first_of: dict[str, int],
        flight: _InFlight | None,
    ) -> None:
        self._writer = writer
        self._batches = batches
        self._results = results
        """What was known at the check (a command id committed before), None for the rest."""
        self._sent = sent
        self._first_of = first_of
        self._flight = flight
        """The append in flight (None: nothing to send, every result known at the check)."""

    async def results(self) -> list[AppendResult]:
        """One result per batch, as `append` returns them; raises the fold's verdict if it refused."""
        results = self._results
        if self._flight is not None:
            appended = await self._writer._verdict_of(self._flight)  # noqa: SLF001 - the writer's own handle
            for (index, _), result in zip(self._sent, appended, strict=True):
                results[index] = result
        for index, batch in enumerate(self._batches):
            if results[index] is None:
                assert batch.command_id is not None
                first = results[self._first_of[batch.command_id]]
                assert first is not None
                results[index] = msgspec.structs.replace(first, duplicate=True)
        return [result for result in results if result is not None]


class KafkaWriter:
    """The writer of one KafkaEventLog: its claims, its appends in flight and their record sender."""

    def __init__(self, target: KafkaTarget, url: str, producer: Any, fold: KafkaFold, follower: Follower) -> None:
        self._target = target
        self._url = url
        """Masked: safe to print."""
        self._producer = producer
        self._fold = fold
        """The follower's fold: what the topic holds so far, this writer's records as they are read back."""
        self._follower = follower
        self.writer_id = uuid.uuid4().hex
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
        self._records_sent = 0
        self._sending: dict[bytes, list[ReadAppend]] = {}
        """SENT_HEADER token -> the appends of this writer's record produced and not yet read back."""

    def start(self) -> None:
        """Start the sender task (KafkaEventLog.open, once the clients are started)."""
        self._sender = asyncio.create_task(self._send_forever())

    def tasks(self) -> list[asyncio.Task[None]]:
        """The sender and the deliveries running now, for close() to cancel."""
        return [task for task in (self._sender, *self._deliveries) if task is not None]

    def sent_appends(self, headers: Sequence[tuple[str, bytes]]) -> list[ReadAppend] | None:
        """The appends of this writer's record with these headers, produced and not yet read
        back (its SENT_HEADER names it), so that the fold reads them from what was encoded;
        None for any other record."""
        return next((self._sending.get(header) for name, header in headers if name == SENT_HEADER), None)

    async def append(self, batches: Sequence[AppendBatch], *, expected_head: int | None = None) -> list[AppendResult]:
        """Append every batch atomically (KafkaEventLog.append); raises WrongExpectedVersion,
        HeadMoved, WriterFenced or AppendRejected and appends nothing.

        Appends are pipelined. A call made while others are in flight is checked against the log
        as it will be once they are accepted, and queued behind them; appends queued while a
        record travels go out together in the next record (one round trip for all), each still
        judged alone by the fold, in order: one decided on an append that was then refused is
        refused too, with its own error (rule 0's `follows`, or its expected version)."""
        return await (await self.queue(batches, expected_head=expected_head)).results()

    async def queue(self, batches: Sequence[AppendBatch], *, expected_head: int | None = None) -> QueuedAppend:
        """The first half of `append`: check the batches and queue their append behind this
        writer's appends in flight, in call order (KafkaEventLog.queue_append). Raises what
        `append` raises for an append refused at its check."""
        while True:
            async with self._appending:
                self._follower.check()
                waiting = self._command_in_flight(batches)
                if waiting is None:
                    results, sent, first_of, flight = await self._enqueue(batches, expected_head)
                    return QueuedAppend(self, batches, results, sent, first_of, flight)
            await waiting.wait()  # a retry of a command still in flight: answered once it is judged

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
                raise AppendRejected(f"append refused by {self._url}: event id {repeated!r} is already in the log")
            ids |= batch_ids
            versions[stream] = actual + len(batch.events)
            if batch.events or command_id is not None:
                sent.append((index, batch))
            else:
                results[index] = AppendResult(stream_id=stream, first_seq=0, last_seq=0, stream_version=actual)
        if not sent:
            return results, sent, first_of, None
        # The append this one follows (rule 0): the last in flight that appends an event. The
        # fold keeps only those as a writer's last append; one of command ids alone changes no
        # state, so what was decided after it holds whatever becomes of it.
        follows = None
        if expected_head is not None:
            follows = next((flight.record.append_id for flight in reversed(pending) if flight.events), None)
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
                f"stream {stream!r} of {self._url} was claimed at epoch {epoch} by writer {writer}; this writer "
                f"({self.writer_id}, epoch {self._held[stream]}) is fenced and may not append to it"
            )

    async def _verdict_of(self, flight: _InFlight) -> list[AppendResult]:
        """Wait for the fold's verdict on an append in flight: its results, or its error."""
        await flight.done.wait()
        verdict = flight.verdict
        if isinstance(verdict, LogError):
            if isinstance(verdict, AppendRejected):
                raise AppendRejected(f"append refused by {self._url}: {verdict}")
            raise verdict
        assert isinstance(verdict, list)
        await self._follower.appended()
        return verdict

    async def _send_forever(self) -> None:
        """The sender: takes the queued appends (as many as fit MAX_RECORD_BYTES, at least one)
        and produces them as one record, once the record before it was acknowledged: the
        appends queued while it travelled go out together next.

        The producer sends one request at a time to a broker, in order (aiokafka mutes a
        partition while a batch of it travels), and takes a record while another travels: a
        record produced at once waits in it, holding only the appends queued so far, and the
        next appends wait behind it for a round trip more."""
        travelling: asyncio.Future[Any] | None = None
        try:
            while True:
                while not self._outbox:
                    await self._outbox_ready.wait()
                    self._outbox_ready = anyio.Event()
                if travelling is not None and not travelling.done():
                    await asyncio.wait([travelling])  # its outcome is _delivered's to take
                    continue  # more may have been queued meanwhile, and the log may have failed
                failure = self._follower.failed()
                if failure is not None:
                    self._settle_failed(self._take(len(self._outbox)), failure)
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
                self._follower.pause_fetching()
                try:
                    delivery = await self._producer.send(
                        self._target.topic, value, key=flights[0].record.parts[0].stream_id.encode(), partition=0, headers=headers
                    )
                except (KafkaError, OSError) as error:
                    self._sending.pop(token, None)
                    self._settle_failed(flights, self._send_error(value, error))
                    continue
                except BaseException:
                    self._sending.pop(token, None)
                    self._settle_failed(flights, LogUnavailable(f"log {self._url} is closed"))
                    raise
                travelling = delivery
                task = asyncio.create_task(self._delivered(flights, value, headers, delivery, token))
                self._deliveries.add(task)
                task.add_done_callback(self._deliveries.discard)
        except Exception as error:  # noqa: BLE001 - the sender's end: recorded, and raised by every later call
            self._follower.fail_closed(LogUnavailable(f"appending to {self._url} failed: {one_line(error)}"))
        finally:
            self._settle_failed(self._take(len(self._outbox)), LogUnavailable(f"log {self._url} is closed"))

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
            await self._follower.read_back(offset, headers, value)
        except (KafkaError, OSError) as error:
            self._settle_failed(flights, self._send_error(value, error))
            return
        except LogError as error:
            self._settle_failed(flights, error)
            return
        except BaseException:
            self._settle_failed(flights, LogUnavailable(f"log {self._url} is closed"))
            raise
        finally:
            self._sending.pop(token, None)
            if not self._sending:
                self._follower.resume_fetching()  # nothing of its own in flight: follow the other writers again
        for flight in flights:
            flight.settle(self._verdict_at(flight.record.append_id, offset))

    def _settle_failed(self, flights: list[_InFlight], error: LogError) -> None:
        for flight in flights:
            self._fold.awaited.discard(flight.record.append_id)
            flight.settle(error)

    def _verdict_at(self, record_id: str, offset: int) -> Verdict:
        """The fold's verdict on this writer's record (or append) read back at `offset`."""
        verdict = self._fold.verdicts.pop(record_id, None)
        if verdict is None:
            self._fold.awaited.discard(record_id)
            self._follower.fail_closed(
                LogDiverged(
                    f"topic {self._target.topic!r} on {self._url}: the broker acknowledged this writer's record at offset "
                    f"{offset}, but the record read at that offset is another: the topic went backwards (committed "
                    "records were lost) and was written again; refusing to continue a forked history"
                )
            )
            failure = self._follower.failed()
            assert failure is not None
            return failure
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
            log.info("kafka_streams_claimed", url=self._url, writer=self.writer_id, epochs=won)
            streams = [stream for stream in streams if stream not in won]
            if not streams:
                return
        raise WriterFenced(f"{self._url}: other writers kept claiming stream(s) {', '.join(streams)} first")

    async def _send(self, record_id: str, value: bytes, headers: list[tuple[str, bytes]], *, key: str) -> Verdict:
        """Produce one record (a claim) and fold up to it: its verdict."""
        self._fold.awaited.add(record_id)
        try:
            metadata = await self._producer.send_and_wait(
                self._target.topic, value, key=key.encode(), partition=0, headers=headers
            )
        except (KafkaError, OSError) as error:
            self._fold.awaited.discard(record_id)
            raise self._send_error(value, error) from error
        except BaseException:
            self._fold.awaited.discard(record_id)
            raise
        offset = int(metadata.offset)
        await self._follower.read_back(offset, headers, value)
        return self._verdict_at(record_id, offset)

    def _send_error(self, value: bytes, error: KafkaError | OSError) -> LogError:
        """What a failed produce raises, for what Kafka said."""
        if isinstance(error, MessageSizeTooLargeError):
            return AppendRejected(
                f"its record is {len(value):,} bytes, more than the broker or producer takes ({one_line(error)}); split the step"
            )
        return LogUnavailable(
            f"append to {self._url} failed ({one_line(error)}): it may or may not be committed; retry it with the same command id"
        )
