"""The Kafka log's own cases (events/log/_kafka.py); the shared contract is tests/log/test_log_contract.py.

* the fold's rules, record by record, without a broker: claims and epochs, fencing, copies,
  foreign and garbled records, a format this code does not read;
* on a real broker (Tansu, tests/kit/kafka.py): a second writer fences the first, a zombie's late
  record is dropped by every reader, a record stored twice is applied once, records written at
  once by several producers reach every tailing reader (a fetch that skipped one is made again),
  a topic that went backwards fails the log closed with the reason (at run time and at the next
  open), a topic with several partitions is refused, and the Ledger recovers from a snapshot plus
  the topic's tail.

Records a broken or stale writer would leave are written with a plain producer, as that writer
would have written them: no mocks.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

import anyio
import pytest
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer  # type: ignore[import-untyped]
from aiokafka.admin import AIOKafkaAdminClient, NewTopic  # type: ignore[import-untyped]
from structlog.testing import capture_logs

from coordinator.core.state import encode_state
from coordinator.ledger.ledger import Ledger
from coordinator.ledger.recovery import replay
from events import EventCodec
from events.log import (
    AppendBatch,
    AppendRejected,
    AppendResult,
    EventLog,
    HeadMoved,
    KafkaEventLog,
    LogDiverged,
    LogError,
    PendingEvent,
    PipelinedLog,
    SchemaMismatch,
    SqlEventLog,
    StoredEvent,
    WriterFenced,
    WrongExpectedVersion,
    _kafka,
    open_log,
)
from events.log._contract import pack_step
from events.log._kafka_fold import (
    FORMAT_HEADER,
    KIND_HEADER,
    AppendRecord,
    ClaimRecord,
    KafkaFold,
    StepPart,
    encode_append,
    encode_appends,
    encode_claim,
)
from events.log.kafka_target import parse_kafka_url
from tests.conftest import KAFKA_FETCH_WAIT_MS
from tests.kit.kafka import KafkaBroker
from tests.log.test_ledger import _declare, _serve_request

pytestmark = pytest.mark.anyio

Record = tuple[bytes, list[tuple[str, bytes]]]


# --- records as a writer writes them -------------------------------------------------------------


def pending(event_id: str) -> PendingEvent:
    return PendingEvent(
        event_id=event_id,
        step=1,
        recorded_at=1.5,
        event_type="kafka_test_event",
        schema_version=1,
        payload=f"payload of {event_id}".encode() + b"\x00\xff",
    )


def part(stream: str, epoch: int, expected: int, ids: Sequence[str], command_id: str | None = None) -> StepPart:
    schemas, header, payload = pack_step([pending(event_id) for event_id in ids])
    return StepPart(stream, epoch, expected, command_id, 1, 1.5, schemas, header, payload)


def append_record(
    writer: str, *parts: StepPart, append_id: str | None = None, expected_head: int | None = None, follows: str | None = None
) -> Record:
    return encode_append(AppendRecord(append_id or uuid.uuid4().hex, writer, list(parts), expected_head, follows))


def claim_record(writer: str, **epochs: int) -> Record:
    return encode_claim(ClaimRecord(uuid.uuid4().hex, writer, epochs))


def fold_all(records: Sequence[Record]) -> KafkaFold:
    fold = KafkaFold()
    for offset, (value, headers) in enumerate(records):
        fold.fold(offset, headers, value)
    return fold


def event_ids(fold: KafkaFold) -> list[str]:
    return [event.event_id for step in fold.steps for event in step.events()]


# --- the fold, without a broker ----------------------------------------------------------------------


def test_a_claim_takes_a_stream_only_above_its_epoch() -> None:
    fold = fold_all([claim_record("w1", s=1), claim_record("w2", s=1), claim_record("w3", s=2, t=1)])
    assert fold.epochs == {"s": (2, "w3"), "t": (1, "w3")}  # w2's claim at an equal epoch lost the race


def test_a_fenced_writers_record_is_dropped_by_the_fold_and_takes_no_sequence() -> None:
    fold = fold_all(
        [
            claim_record("old", s=1),
            append_record("old", part("s", 1, 0, ["a", "b"])),
            claim_record("new", s=2),
            append_record("old", part("s", 1, 2, ["zombie"])),  # right version, fenced epoch
            append_record("new", part("s", 1, 2, ["wrong-epoch"])),  # the new writer must use its own epoch
            append_record("new", part("s", 2, 2, ["c"])),
            append_record("stranger", part("u", 0, 0, ["unclaimed"])),  # never claimed "u"
        ]
    )
    assert event_ids(fold) == ["a", "b", "c"]
    assert [event.global_seq for step in fold.steps for event in step.events()] == [1, 2, 3]
    assert fold.versions == {"s": 3} and fold.head == 3


def test_verdicts_name_what_refused_a_record() -> None:
    fold = KafkaFold()
    records = [
        claim_record("w", s=1),
        append_record("w", part("s", 1, 0, ["a"]), append_id="ok"),
        append_record("w", part("s", 1, 0, ["b"]), append_id="stale"),
        append_record("w", part("s", 1, 1, ["a"]), append_id="repeated-id"),
        append_record("x", part("s", 1, 1, ["c"]), append_id="fenced"),
    ]
    fold.awaited |= {"ok", "stale", "repeated-id", "fenced"}
    for offset, (value, headers) in enumerate(records):
        fold.fold(offset, headers, value)
    assert fold.verdicts["ok"] == [AppendResult(stream_id="s", first_seq=1, last_seq=1, stream_version=1)]
    stale = fold.verdicts["stale"]
    assert isinstance(stale, WrongExpectedVersion) and (stale.expected, stale.actual) == (0, 1)
    assert isinstance(fold.verdicts["repeated-id"], AppendRejected)
    fenced = fold.verdicts["fenced"]
    assert isinstance(fenced, WriterFenced) and "epoch 1" in str(fenced)
    assert fold.head == 1


def test_a_copy_of_an_accepted_record_is_applied_once() -> None:
    original = append_record("w", part("s", 1, 0, ["a", "b"], command_id="cmd"), append_id="first")
    resent = append_record("w", part("s", 1, 0, ["a", "b"]), append_id="second")  # same stream, version, ids
    fold = KafkaFold()
    fold.awaited |= {"first", "second"}
    for offset, (value, headers) in enumerate([claim_record("w", s=1), original, original, resent]):
        fold.fold(offset, headers, value)
    assert event_ids(fold) == ["a", "b"] and fold.versions == {"s": 2}
    committed = AppendResult(stream_id="s", first_seq=1, last_seq=2, stream_version=2)
    assert fold.verdicts["first"] == [committed]  # the first copy's verdict stands
    assert fold.verdicts["second"] == [AppendResult(stream_id="s", first_seq=1, last_seq=2, stream_version=2, duplicate=True)]
    # The same version with other events is no copy: it is a conflict, and appends nothing.
    value, headers = append_record("w", part("s", 1, 0, ["a", "other"]))
    fold.fold(4, headers, value)
    assert fold.head == 2


def test_a_pipelined_record_decided_after_a_refused_one_is_refused_even_where_the_head_matches() -> None:
    """A writer with records in flight decides the next one on the log as it will be if they are
    accepted. Its first is refused (another writer came first, with as many events); the second,
    decided after it, then names the right head by chance: `follows` refuses it all the same."""
    fold = KafkaFold()
    records = [
        claim_record("w", s=1, t=1),
        claim_record("o", u=1),
        append_record("o", part("u", 1, 0, ["x"])),  # lands between w's decision and its record
        append_record("w", part("s", 1, 0, ["a"]), append_id="r1", expected_head=0),
        append_record("w", part("t", 1, 0, ["b"]), append_id="r2", expected_head=1, follows="r1"),
        append_record("w", part("t", 1, 0, ["c"]), append_id="r3", expected_head=1),  # decided again
        append_record("w", part("t", 1, 1, ["d"]), append_id="r4", expected_head=2, follows="r3"),
    ]
    fold.awaited |= {"r1", "r2", "r3", "r4"}
    for offset, (value, headers) in enumerate(records):
        fold.fold(offset, headers, value)
    first, second = fold.verdicts["r1"], fold.verdicts["r2"]
    assert isinstance(first, HeadMoved) and (first.expected, first.actual) == (0, 1)
    assert isinstance(second, HeadMoved) and "r1" in str(second) and (second.expected, second.actual) == (1, 1)
    assert fold.verdicts["r4"] == [AppendResult(stream_id="t", first_seq=3, last_seq=3, stream_version=2)]
    assert event_ids(fold) == ["x", "c", "d"] and fold.versions == {"u": 1, "t": 2}


def test_appends_sharing_a_record_are_judged_one_by_one() -> None:
    """Appends a writer queued while its previous record travelled go out in one record; each is
    accepted or refused alone, in order, and takes its own verdict."""
    fold = KafkaFold()
    ok = AppendRecord("ok", "w", [part("s", 1, 0, ["a"])], 0)
    stale = AppendRecord("stale", "w", [part("t", 1, 5, ["b"])], 1, "ok")  # t is at version 0
    after = AppendRecord("after", "w", [part("s", 1, 1, ["c"])], 2, "stale")  # decided on the stale one
    alone = AppendRecord("alone", "w", [part("s", 1, 1, ["d"])])  # names no head: its version decides
    fold.awaited |= {"ok", "stale", "after", "alone"}
    for offset, (value, headers) in enumerate([claim_record("w", s=1, t=1), encode_appends([ok, stale, after, alone])]):
        assert fold.fold(offset, headers, value) is None
    assert fold.verdicts["ok"] == [AppendResult(stream_id="s", first_seq=1, last_seq=1, stream_version=1)]
    assert isinstance(fold.verdicts["stale"], WrongExpectedVersion)
    assert isinstance(fold.verdicts["after"], HeadMoved)
    assert fold.verdicts["alone"] == [AppendResult(stream_id="s", first_seq=2, last_seq=2, stream_version=2)]
    assert event_ids(fold) == ["a", "d"] and fold.next_offset == 2
    # A format-1 reader's kinds do not include it: a format-1 record of that kind is refused.
    with pytest.raises(SchemaMismatch, match="offset 2"):
        fold.fold(2, [(FORMAT_HEADER, b"1"), (KIND_HEADER, b"appends")], encode_appends([ok])[0])


def test_a_shared_stream_claimed_by_another_sidecar_since_is_decided_again_not_fenced() -> None:
    """Two sidecars of a fleet take turns on a tier's stream. One's append lands after the
    other claimed the stream: where it names the head, it is refused as HeadMoved (the writer
    claims again and decides again); an engine's stream, or an append naming no head, is fenced."""
    fold = KafkaFold()
    records = [
        claim_record("a", **{"tier/t": 1, "engine/a": 1}),
        claim_record("b", **{"tier/t": 2, "engine/a": 2}),  # b takes the tier in turn, and pod-a over
        append_record("a", part("tier/t", 1, 0, ["x"]), append_id="shared", expected_head=0),
        append_record("a", part("tier/t", 1, 0, ["y"]), append_id="no-head"),
        append_record("a", part("engine/a", 1, 0, ["z"]), append_id="engine", expected_head=0),
    ]
    fold.awaited |= {"shared", "no-head", "engine"}
    for offset, (value, headers) in enumerate(records):
        fold.fold(offset, headers, value)
    shared = fold.verdicts["shared"]
    assert isinstance(shared, HeadMoved) and "tier/t" in str(shared)
    assert isinstance(fold.verdicts["no-head"], WriterFenced)
    assert isinstance(fold.verdicts["engine"], WriterFenced)
    assert fold.head == 0


def test_a_garbled_append_in_an_appends_record_is_refused_alone() -> None:
    """Bad bytes from a broken writer: one append whose header and payload disagree is refused
    (AppendRejected) and skipped; the appends beside it in the record are judged on their own."""
    good = part("s", 1, 0, ["a"])
    short = StepPart(good.stream_id, good.epoch, good.expected_version, None, 1, 1.5, good.schemas, good.header, b"")
    fold = KafkaFold()
    fold.awaited |= {"garbled", "fine"}
    claim, claim_headers = claim_record("w", s=1)
    fold.fold(0, claim_headers, claim)
    value, headers = encode_appends([AppendRecord("garbled", "w", [short]), AppendRecord("fine", "w", [good])])
    assert "disagree" in (fold.fold(1, headers, value) or "")
    assert isinstance(fold.verdicts["garbled"], AppendRejected)
    assert fold.verdicts["fine"] == [AppendResult(stream_id="s", first_seq=1, last_seq=1, stream_version=1)]
    assert event_ids(fold) == ["a"]


def test_format_1_records_are_still_read() -> None:
    """Topics written before `follows` (format 1) fold as they always did."""
    value, _ = append_record("w", part("s", 1, 0, ["a"]))
    fold = fold_all([claim_record("w", s=1)])
    assert fold.fold(1, [(FORMAT_HEADER, b"1"), (KIND_HEADER, b"append")], value) is None
    assert event_ids(fold) == ["a"] and fold.head == 1


def test_foreign_and_garbled_records_are_skipped_and_another_format_fails_closed() -> None:
    fold = fold_all([claim_record("w", s=1)])
    assert fold.fold(1, [], b"written by another tool") is not None
    assert fold.fold(2, [(FORMAT_HEADER, b"1"), (KIND_HEADER, b"append")], b"\xc1 not msgpack") is not None
    good = part("s", 1, 0, ["a"])
    short = StepPart(
        good.stream_id, good.epoch, good.expected_version, None, 1, 1.5, good.schemas, good.header, good.payload[:-1]
    )
    value, headers = encode_append(AppendRecord("garbled", "w", [short]))
    assert "disagree" in (fold.fold(3, headers, value) or "")
    value, headers = append_record("w", good)
    assert fold.fold(4, headers, value) is None and fold.head == 1
    with pytest.raises(SchemaMismatch, match="offset 5"):
        fold.fold(5, [(FORMAT_HEADER, b"3"), (KIND_HEADER, b"append")], b"")


def test_the_kafka_log_reads_and_writes_every_event_through_the_topic() -> None:
    """KafkaEventLog inherits SqlEventLog's state store side only: an event method it did not
    override would read the state store's empty event tables."""
    for name in (
        "append",
        "read",
        "read_steps",
        "read_stream_steps",
        "tail",
        "head",
        "find_commands",
        "stream_version",
        "stream_versions",
        "close",
    ):
        assert getattr(KafkaEventLog, name) is not getattr(SqlEventLog, name), name
    for name in ("checkpoint", "save_snapshot", "snapshots"):
        assert getattr(KafkaEventLog, name) is getattr(SqlEventLog, name), name
    # projection_transaction is SqlEventLog's (the state store's), plus the topic's history named
    # with a store's first checkpoint (test_a_reader_killed_before_close_...).


def test_a_kafka_url_names_brokers_topic_and_state_store_and_a_bad_one_is_refused_without_its_password() -> None:
    target = parse_kafka_url("kafka://b1:9093,b2/events.prod?replication_factor=3&state=/var/kvl/state.sqlite")
    assert (target.bootstrap, target.topic, target.state_url, target.replication_factor) == (
        ["b1:9093", "b2:9092"],
        "events.prod",
        "/var/kvl/state.sqlite",
        3,
    )
    for bad in ("kafka://host:9092/", "kafka://host:9092/t?partitions=4", "kafka://u:pw@host/t", "kafka://h/t?state=kafka://h/u"):
        with pytest.raises(ValueError) as refused:
            parse_kafka_url(bad)
        assert "pw" not in str(refused.value)


# --- on a real broker -------------------------------------------------------------------------------


@pytest.fixture
def kafka_url(kafka_broker: KafkaBroker, tmp_path: Path) -> str:
    return kafka_broker.url(state=tmp_path / "state.sqlite", fetch_wait_ms=KAFKA_FETCH_WAIT_MS)


@pytest.fixture
async def kafka_log(kafka_url: str) -> AsyncIterator[KafkaEventLog]:
    event_log = await open_log(kafka_url)
    assert isinstance(event_log, KafkaEventLog)
    try:
        yield event_log
    finally:
        await event_log.close()


async def produce(url: str, records: Sequence[Record]) -> None:
    """Write records as another writer would: a plain producer, acks=all (into a topic of one
    partition: the broker would otherwise create it with its default count)."""
    target = parse_kafka_url(url)
    admin = AIOKafkaAdminClient(bootstrap_servers=target.bootstrap)
    await admin.start()
    try:
        if target.topic not in await admin.list_topics():
            await admin.create_topics([NewTopic(target.topic, num_partitions=1, replication_factor=1)])
    finally:
        await admin.close()
    producer = AIOKafkaProducer(bootstrap_servers=parse_kafka_url(url).bootstrap, acks="all", enable_idempotence=False)
    await producer.start()
    try:
        for value, headers in records:
            await producer.send_and_wait(parse_kafka_url(url).topic, value, partition=0, headers=headers)
    finally:
        await producer.stop()


async def recreate_topic(url: str, partitions: int = 1) -> None:
    """Delete the topic and create it again, empty: what a broker that lost its data serves."""
    target = parse_kafka_url(url)
    admin = AIOKafkaAdminClient(bootstrap_servers=target.bootstrap)
    await admin.start()
    try:
        if target.topic in await admin.list_topics():
            await admin.delete_topics([target.topic])
        await admin.create_topics([NewTopic(target.topic, num_partitions=partitions, replication_factor=1)])
    finally:
        await admin.close()


async def everything(event_log: EventLog) -> list[StoredEvent]:
    return await event_log.read(0, 1_000_000)


def step(stream: str, expected: int, ids: Sequence[str], command_id: str | None = None) -> AppendBatch:
    return AppendBatch(stream_id=stream, expected_version=expected, events=[pending(i) for i in ids], command_id=command_id)


async def test_a_second_writer_fences_the_first(kafka_log: KafkaEventLog, kafka_url: str) -> None:
    await kafka_log.append([step("engine/a", 0, ["a1", "a2"]), step("tier/host", 0, ["t1"])])
    second = await open_log(kafka_url)  # a restarted sidecar: it takes the engine's stream over
    try:
        [taken] = await second.append([step("engine/a", 2, ["b1"])])
        assert (taken.first_seq, taken.stream_version) == (4, 3)

        # Whether the first writer has read the claim yet (refused before it writes) or not (its
        # record goes out and the fold drops it: the next test shows that case alone), it is fenced.
        with pytest.raises(WriterFenced, match="engine/a"):
            await kafka_log.append([step("engine/a", 2, ["late"])])
        assert kafka_log.failure is None  # fenced is not broken: it may still read
        # From now on it is refused before anything is written; other streams it holds are still its own.
        with pytest.raises(WriterFenced):
            await kafka_log.append([step("engine/a", 3, ["later"])])
        [tier] = await kafka_log.append([step("tier/host", 1, ["t2"])])
        assert tier.first_seq == 5

        reader = await open_log(kafka_url)
        try:
            for view in (kafka_log, second, reader):
                assert [e.event_id for e in await everything(view)] == ["a1", "a2", "t1", "b1", "t2"]
                assert await view.stream_versions() == {"engine/a": 3, "tier/host": 2}
        finally:
            await reader.close()
    finally:
        await second.close()


async def test_writers_take_turns_on_a_shared_stream_while_an_engines_stream_keeps_one_writer(
    kafka_log: KafkaEventLog, kafka_url: str
) -> None:
    """Two sidecars of a fleet both write a tier's stream (and the namespaces'): each claims it
    again when the other has, instead of being fenced out of it for good; an engine's stream
    stays its one writer's."""
    await kafka_log.append([step("engine/a", 0, ["a1"]), step("tier/shared", 0, ["t1"])])
    second = await open_log(kafka_url)
    try:
        # Each turn reads what the other wrote first (head() folds the topic to its end), as a
        # sidecar's ledger does before it decides: its expected version is then the stream's.
        await second.append([step("engine/b", 0, ["b1"]), step("tier/shared", 1, ["t2"])])
        await kafka_log.head()
        await kafka_log.append([step("tier/shared", 2, ["t3"])])  # claimed again, not fenced
        await second.head()
        await second.append([step("tier/shared", 3, ["t4"])])
        await second.append([step("engine/a", 1, ["a2"])])  # a takeover of pod-a (a restarted sidecar)
        await kafka_log.head()
        with pytest.raises(WriterFenced, match="engine/a"):  # an engine's stream is not shared: fenced
            await kafka_log.append([step("engine/a", 2, ["late"])])
        await kafka_log.append([step("tier/shared", 4, ["t5"])])  # the shared one still takes turns
        assert [e.event_id for e in await everything(kafka_log)] == ["a1", "t1", "b1", "t2", "t3", "t4", "a2", "t5"]
    finally:
        await second.close()


async def test_appends_in_flight_travel_together_and_take_their_verdicts_in_order(
    kafka_log: KafkaEventLog, kafka_url: str
) -> None:
    """Appends called while others are in flight are checked against the log as it will be and
    queued behind them; those queued while a record travels go out together in the next. A retry
    of a command still in flight is answered by it; an event id already in flight is refused; the
    rest are unaffected."""
    calls, per = 24, 3
    results: dict[int, AppendResult] = {}
    in_flight: list[int] = []
    retried: list[tuple[int, AppendResult]] = []

    async def one(i: int) -> None:
        ids = [f"p{i}-{k}" for k in range(per)]
        batch = AppendBatch(
            stream_id="engine/a", expected_version=i * per, events=[pending(x) for x in ids], command_id=f"cmd-{i}"
        )
        [results[i]] = await kafka_log.append([batch], expected_head=i * per)

    async def retry_and_clash() -> None:
        with anyio.fail_after(10):  # without pipelining there is never more than one
            while len(kafka_log._kafka_writer._pending()) < 2:  # noqa: SLF001 - the writer's records in flight
                await anyio.sleep(0)
        in_flight.append(len(kafka_log._kafka_writer._pending()))  # noqa: SLF001
        flying = kafka_log._kafka_writer._pending()[-1]  # noqa: SLF001
        [command] = sorted(flying.commands)
        with pytest.raises(AppendRejected, match="already in the log"):
            await kafka_log.append([step("engine/b", 0, [flying.read[0][1][0]])])
        again = AppendBatch(stream_id="engine/a", expected_version=0, events=[pending("never")], command_id=command)
        [answer] = await kafka_log.append([again])
        retried.append((int(command.removeprefix("cmd-")), answer))

    async with anyio.create_task_group() as group:
        for i in range(calls):
            group.start_soon(one, i)
        group.start_soon(retry_and_clash)
    assert in_flight[0] >= 2, in_flight  # several records were in flight at once
    assert [results[i].first_seq for i in range(calls)] == [i * per + 1 for i in range(calls)]
    assert all(not result.duplicate for result in results.values())
    assert kafka_log._fold.next_offset < calls + 1  # noqa: SLF001 - a claim, then fewer records than appends
    [(call, answer)] = retried
    assert answer.duplicate and (answer.first_seq, answer.last_seq) == (results[call].first_seq, results[call].last_seq)
    reader = await open_log(kafka_url)
    try:
        expected = [f"p{i}-{k}" for i in range(calls) for k in range(per)]
        assert [e.event_id for e in await everything(reader)] == expected
        assert await reader.stream_versions() == {"engine/a": calls * per}
    finally:
        await reader.close()


async def test_two_writers_pipelining_at_once_each_read_the_others_records_between_their_own(
    kafka_log: KafkaEventLog, kafka_url: str
) -> None:
    """A writer with records in flight folds them from what it sent, and fetches only when the
    broker acknowledged one past what it folded (another writer's records came between): both
    writers, and a fresh reader, end with the same log in the same order."""
    second = await open_log(kafka_url)
    assert isinstance(second, KafkaEventLog)
    try:

        async def pipeline(writer: KafkaEventLog, name: str) -> None:
            async with anyio.create_task_group() as group:
                for i in range(30):
                    batch = AppendBatch(
                        stream_id=f"engine/{name}",
                        expected_version=i * 2,
                        events=[pending(f"{name}{i}-0"), pending(f"{name}{i}-1")],
                    )
                    group.start_soon(writer.append, [batch])
                    await anyio.sleep(0)

        async with anyio.create_task_group() as group:
            group.start_soon(pipeline, kafka_log, "a")
            group.start_soon(pipeline, second, "b")
        reader = await open_log(kafka_url)
        try:
            order = [e.event_id for e in await everything(reader)]
            assert sorted(order) == sorted(f"{n}{i}-{k}" for n in "ab" for i in range(30) for k in range(2))
            for view in (kafka_log, second):
                assert [e.event_id for e in await everything(view)] == order
                assert await view.stream_versions() == {"engine/a": 60, "engine/b": 60}
            # Each stream's events in its own order, whatever the interleaving.
            assert [x for x in order if x.startswith("a")] == [f"a{i}-{k}" for i in range(30) for k in range(2)]
        finally:
            await reader.close()
    finally:
        await second.close()


async def test_a_zombie_writers_late_record_is_dropped_by_every_reader(kafka_url: str) -> None:
    """A record the old writer sent before it was fenced lands after the new writer's claim."""
    await produce(
        kafka_url,
        [
            claim_record("old", s=1),
            append_record("old", part("s", 1, 0, ["a"])),
            claim_record("new", s=2),
            append_record("old", part("s", 1, 1, ["zombie"])),
            append_record("new", part("s", 2, 1, ["b"])),
        ],
    )
    event_log = await open_log(kafka_url)
    try:
        stored = await event_log.read()
        assert [(e.global_seq, e.event_id, e.stream_version) for e in stored] == [(1, "a", 1), (2, "b", 2)]
        # The writer in this process claims above both and goes on from the right version.
        [result] = await event_log.append([step("s", 2, ["c"])])
        assert (result.first_seq, result.stream_version) == (3, 3)
    finally:
        await event_log.close()


async def test_a_record_stored_twice_is_applied_once(kafka_log: KafkaEventLog, kafka_url: str) -> None:
    """A producer that retries without idempotence can store a record twice; a writer that lost an
    acknowledgement may send the same step again under a new record id. Either way, once."""
    once = append_record("other", part("s", 1, 0, ["a", "b"], command_id="cmd-1"))
    again = append_record("other", part("s", 1, 0, ["a", "b"]))
    await produce(kafka_url, [claim_record("other", s=1), once, once, again])
    assert [e.event_id for e in await everything(kafka_log)] == ["a", "b"]
    assert await kafka_log.stream_versions() == {"s": 2}
    assert (await kafka_log.find_commands(["cmd-1"]))["cmd-1"] == AppendResult(
        stream_id="s", first_seq=1, last_seq=2, stream_version=2, duplicate=True
    )
    # A retry of the command through the log is answered from the topic, and appends nothing.
    [retried] = await kafka_log.append([step("s", 0, ["a", "b"], command_id="cmd-1")])
    assert retried.duplicate and (retried.first_seq, retried.last_seq) == (1, 2)
    # The stream goes on gapless.
    [after] = await kafka_log.append([step("s", 2, ["c"])])
    assert (after.first_seq, after.stream_version) == (3, 3)
    assert [e.global_seq for e in await everything(kafka_log)] == [1, 2, 3]


async def test_records_written_at_once_by_several_producers_reach_every_tailing_reader(
    kafka_log: KafkaEventLog, kafka_url: str
) -> None:
    """Tansu can answer a fetch at offset N with the record at N + 1 while the record at N,
    acknowledged to another producer, is not yet readable (about 1 record in 500 for one of
    three tailing consumers, with 5 producers at once): a reader that folded past the hole lost
    that record for good (this failed 2 runs of 6); the fetcher now fetches a hole again until
    it fills. Its end offset can also lag, by a few ms, a record it acknowledged (which the
    writer folds at once): an end behind what was read is asked again rather than taken for
    lost records; the log appending and asking for the head here exercises that, though the
    lag itself is rarely hit in this test."""
    producers, steps = 5, 120
    readers = [kafka_log]
    for number in range(2):
        other = await open_log(kafka_url.replace("state.sqlite", f"state-{number}.sqlite"))
        assert isinstance(other, KafkaEventLog)
        readers.append(other)
    written = anyio.Event()
    own = 0

    async def append_and_ask_heads() -> None:
        """The log appends too: an append is read back at its acknowledged offset, before the
        broker's end offset may count it."""
        nonlocal own
        while not written.is_set():
            await kafka_log.append([step("own", own, [f"own-{own}"])])
            own += 1
            for reader in readers:
                await reader.head()

    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(append_and_ask_heads)
            async with anyio.create_task_group() as writers:
                for n in range(producers):
                    writers.start_soon(
                        produce,
                        kafka_url,
                        [
                            claim_record(f"w{n}", **{f"s{n}": 1}),
                            *(append_record(f"w{n}", part(f"s{n}", 1, index, [f"s{n}-{index}"])) for index in range(steps)),
                        ],
                    )
            written.set()
        for reader in readers:
            assert await reader.stream_versions() == {"own": own, **{f"s{n}": steps for n in range(producers)}}
            assert len(await everything(reader)) == own + producers * steps
    finally:
        for reader in readers[1:]:
            await reader.close()


async def test_a_topic_that_went_backwards_fails_the_log_closed(kafka_log: KafkaEventLog, kafka_url: str) -> None:
    await kafka_log.append([step("s", 0, ["a", "b"])])
    reader = await open_log(kafka_url)
    assert isinstance(reader, KafkaEventLog)
    try:
        assert await reader.head() == 2
        await recreate_topic(kafka_url)  # the broker lost everything

        # The writer's next record lands at an offset it has already read: another history.
        with capture_logs() as logs, pytest.raises(LogDiverged, match="went backwards") as diverged:
            await kafka_log.append([step("s", 2, ["c"])])
        assert "offset" in str(diverged.value) and "forked history" in str(diverged.value)
        [failed] = [entry for entry in logs if entry["event"] == "kafka_log_failed_closed"]
        assert (failed["log_level"], failed["error"], failed["reason"]) == ("error", "LogDiverged", str(diverged.value))
        # A reader notices the topic's end below what it read.
        with pytest.raises(LogDiverged, match="ends at offset"):
            await reader.head()
        # Failed closed: every later call says so, and nothing more is written.
        for event_log in (kafka_log, reader):
            assert event_log.failure is not None
            with pytest.raises(LogDiverged):
                await event_log.read()
            with pytest.raises(LogDiverged):
                await event_log.append([step("t", 0, ["d"])])
    finally:
        await reader.close()


async def test_a_restart_on_a_topic_that_lost_its_history_is_refused(kafka_url: str) -> None:
    event_log = await open_log(kafka_url)
    try:
        ledger = await Ledger.open(event_log)
        await _declare(ledger)
        await ledger.close()  # a clean shutdown leaves a snapshot at the head, in the state store
    finally:
        await event_log.close()

    await recreate_topic(kafka_url)  # empty now
    with pytest.raises(LogDiverged, match="state store") as empty:
        await open_log(kafka_url)
    assert "is empty" in str(empty.value)

    await produce(kafka_url, [claim_record("someone", s=1), append_record("someone", part("s", 1, 0, ["x"]))])
    with pytest.raises(LogDiverged, match="begins with another record"):
        await open_log(kafka_url)


async def test_a_topic_with_several_partitions_is_refused(kafka_url: str) -> None:
    await recreate_topic(kafka_url, partitions=3)
    with pytest.raises(LogError, match="3 partitions"):
        await open_log(kafka_url)


async def test_the_ledger_recovers_from_a_snapshot_plus_the_topics_tail(kafka_url: str) -> None:
    event_log = await open_log(kafka_url)
    try:
        ledger = await Ledger.open(event_log, snapshot_every=5)
        await _declare(ledger)
        for index in range(3):
            await _serve_request(ledger, index, clock=float(index))
        live = encode_state(ledger.state)
        [snapshot] = await event_log.snapshots(limit=1)
        assert 0 < snapshot.global_seq < await event_log.head()  # a tail to fold
    finally:
        await event_log.close()
    reopened = await open_log(kafka_url)
    try:
        recovered = await Ledger.open(reopened)
        assert encode_state(recovered.state) == live
        full, _ = await replay(reopened, EventCodec())
        assert encode_state(full) == live
        await _serve_request(recovered, 3, clock=3.0)  # and it writes on, as the engine's new writer
    finally:
        await reopened.close()


# --- a reader's state store, and closing with the broker gone (review findings) ------------------


async def writer_steps(broker: KafkaBroker, topic: str, state: Path, streams: Sequence[str]) -> None:
    """Another process writes one event on each stream (a writer, not the reader under test)."""
    writer = await open_log(broker.url(topic, state=state, fetch_wait_ms=KAFKA_FETCH_WAIT_MS))
    try:
        for stream in streams:
            await writer.append([step(stream, 0, [f"{stream}-{uuid.uuid4().hex[:8]}"])])
    finally:
        await writer.close()


async def test_a_reader_killed_before_close_still_refuses_a_topic_that_lost_its_history(
    kafka_broker: KafkaBroker, tmp_path: Path
) -> None:
    topic = f"kvl-{uuid.uuid4().hex[:8]}"
    url = kafka_broker.url(topic, state=tmp_path / "reader.sqlite", fetch_wait_ms=KAFKA_FETCH_WAIT_MS)
    reader = await open_log(url)  # opened on an empty topic: there is no history to name yet
    assert isinstance(reader, KafkaEventLog)
    await writer_steps(kafka_broker, topic, tmp_path / "w1.sqlite", ["tier/old-a", "tier/old-b"])
    async with reader.projection_transaction("audit") as tx:  # what the fleet service does: it never appends
        await tx.advance(await reader.head())
    # ...and is SIGKILLed: no close(). Only its state store's engine is let go, to leak nothing.
    reader._closed = True  # noqa: SLF001
    await SqlEventLog.close(reader)
    await recreate_topic(url)  # the broker lost everything; a writer starts a new history
    await writer_steps(kafka_broker, topic, tmp_path / "w2.sqlite", ["tier/new-a", "tier/new-b", "tier/new-c"])
    with pytest.raises(LogDiverged, match="forked history"):
        await open_log(url)


async def test_a_checkpoint_beyond_the_topics_head_is_refused(kafka_broker: KafkaBroker, tmp_path: Path) -> None:
    topic = f"kvl-{uuid.uuid4().hex[:8]}"
    url = kafka_broker.url(topic, state=tmp_path / "reader.sqlite", fetch_wait_ms=KAFKA_FETCH_WAIT_MS)
    await writer_steps(kafka_broker, topic, tmp_path / "w.sqlite", ["tier/a", "tier/b", "tier/c"])
    reader = await open_log(url)
    try:
        async with reader.projection_transaction("audit") as tx:
            await tx.advance(7)  # as if the topic had held 7 events and lost its tail since
    finally:
        await reader.close()
    with pytest.raises(LogDiverged, match="checkpoint at global sequence 7"):
        await open_log(url)


async def test_close_with_the_broker_gone_returns_and_stops_both_clients(tmp_path: Path) -> None:
    broker = KafkaBroker.start()
    url = broker.url(state=tmp_path / "state.sqlite", fetch_wait_ms=KAFKA_FETCH_WAIT_MS, request_timeout_ms=1000)
    try:
        event_log = await open_log(url)
        assert isinstance(event_log, KafkaEventLog)
        await event_log.append([step("tier/a", 0, ["x1"])])
    finally:
        broker.stop()  # the broker is gone while the log is open
    with pytest.raises(LogError):
        await event_log.append([step("tier/a", 1, ["x2"])])
    with anyio.fail_after(30):
        await event_log.close()  # returns: the consumer's fetch task's CancelledError is not ours
    assert event_log._producer._closed  # noqa: SLF001 - the producer was stopped after the consumer


@pytest.mark.parametrize("fills_after", [3, None])
async def test_a_hole_in_a_fetch_is_fetched_again_and_one_that_never_fills_fails_the_log_closed(
    kafka_log: KafkaEventLog, kafka_url: str, monkeypatch: pytest.MonkeyPatch, fills_after: int | None
) -> None:
    """The broker's fetch skips the record at one offset (what Tansu does for a few ms under
    concurrent producers), injected at the reader's consumer: the fetches that hold the records
    leave it out, `fills_after` times or for ever. A hole that fills is read in order
    and nothing is lost; one that stays HOLE_TIMEOUT_S fails the reader closed, naming the
    offset, rather than folding past a record only this reader would never see."""
    # Short only where the hole never fills: a hole that fills must not race the timeout on a busy machine.
    monkeypatch.setattr(_kafka, "HOLE_TIMEOUT_S", 0.5 if fills_after is None else 30.0)
    real_getmany = AIOKafkaConsumer.getmany
    hole: int | None = None
    skipped = 0

    async def getmany(consumer: AIOKafkaConsumer, *args: Any, **kwargs: Any) -> dict[Any, list[Any]]:
        """The reader's fetches (from its first, so none is in flight unaltered), not the writer's."""
        nonlocal skipped
        fetched: dict[Any, list[Any]] = await real_getmany(consumer, *args, **kwargs)
        if consumer is kafka_log._consumer or hole is None:
            return fetched
        for partition, records in fetched.items():
            if any(r.offset == hole for r in records) and (fills_after is None or skipped < fills_after):
                skipped += 1
                fetched[partition] = [r for r in records if r.offset != hole]
        return fetched

    monkeypatch.setattr(AIOKafkaConsumer, "getmany", getmany)
    await kafka_log.append([step("s", 0, ["a"])])
    reader = await open_log(kafka_url.replace("state.sqlite", "reader.sqlite"))
    assert isinstance(reader, KafkaEventLog)
    try:
        assert await reader.head() == 1
        hole = reader._fold.next_offset
        await kafka_log.append([step("s", 1, ["b"])])
        await kafka_log.append([step("s", 2, ["c"])])
        if fills_after is None:
            with capture_logs() as logs, pytest.raises(LogDiverged, match=rf"no readable record at offsets {hole}\.\.{hole} "):
                await reader.head()
            assert reader.failure is not None and skipped >= 2
            assert [entry["error"] for entry in logs if entry["event"] == "kafka_log_failed_closed"] == ["LogDiverged"]
            with pytest.raises(LogDiverged):
                await reader.read()
        else:
            assert await reader.head() == 3 and skipped == fills_after
            assert [e.event_id for e in await everything(reader)] == [e.event_id for e in await everything(kafka_log)]
    finally:
        await reader.close()


async def test_an_append_decided_after_one_in_flight_that_appends_no_event_is_accepted_with_it(
    kafka_log: KafkaEventLog, kafka_url: str
) -> None:
    """An append that names the head, queued behind one of this writer's in flight that carries
    only a command id (no event): the fold keeps, as the writer's last append (rule 0's
    `follows`), only one that appended something, so the second names the one before (here
    none) and both are accepted. Naming the empty one, the second was refused (HeadMoved) though
    nothing before it was."""
    await kafka_log.append([step("engine/a", 0, ["a1", "a2"])], expected_head=0)  # the stream is claimed
    outcomes: dict[str, list[AppendResult] | Exception] = {}

    async def append(name: str, batch: AppendBatch) -> None:
        try:
            outcomes[name] = await kafka_log.append([batch], expected_head=2)
        except HeadMoved as error:
            outcomes[name] = error

    async with anyio.create_task_group() as group:
        group.start_soon(append, "empty", step("engine/a", 2, [], command_id="cmd-no-event"))
        group.start_soon(append, "after", step("engine/a", 2, ["b1"], command_id="cmd-b"))
    assert not isinstance(outcomes["empty"], Exception), outcomes
    assert not isinstance(outcomes["after"], Exception), outcomes
    [after] = outcomes["after"]
    assert (after.first_seq, after.last_seq, after.stream_version) == (3, 3, 3)
    reader = await open_log(kafka_url)
    try:
        assert [e.event_id for e in await everything(reader)] == ["a1", "a2", "b1"]
        assert set(await reader.find_commands(["cmd-no-event", "cmd-b"])) == {"cmd-no-event", "cmd-b"}
    finally:
        await reader.close()


async def test_queue_append_queues_in_call_order_and_each_append_takes_its_own_verdict(
    kafka_log: KafkaEventLog, kafka_url: str
) -> None:
    """PipelinedLog: queue_append returns once the append is checked and queued, before its
    round trip; the next, queued behind it and naming the head after it, goes behind it in the
    topic. A refused one (its expected version is wrong, seen only against the first in flight)
    is refused at once, and queues nothing; the others take their own verdicts."""
    assert isinstance(kafka_log, PipelinedLog)
    await kafka_log.append([step("engine/a", 0, ["a0"])], expected_head=0)  # the stream is claimed
    first = await kafka_log.queue_append([step("engine/a", 1, ["a1", "a2"])], expected_head=1)
    with pytest.raises(WrongExpectedVersion):  # it expects the version before the first in flight
        await kafka_log.queue_append([step("engine/a", 1, ["x1"])], expected_head=3)
    second = await kafka_log.queue_append([step("engine/a", 3, ["a3"])], expected_head=3)
    [later] = await second.results()
    [earlier] = await first.results()
    assert (earlier.first_seq, earlier.last_seq, later.first_seq, later.stream_version) == (2, 3, 4, 4)
    reader = await open_log(kafka_url)
    try:
        assert [e.event_id for e in await everything(reader)] == ["a0", "a1", "a2", "a3"]
    finally:
        await reader.close()
