"""The log contract (DESIGN.md, "The log"; events/log/_contract.py), one suite for every backend.

Every test takes the `event_log` or `log_url` fixture, so it runs on SQLite, on the real
PostgreSQL server and on a real Kafka-protocol broker (Tansu, tests/kit/kafka.py), each on fresh
storage. No mocks: writers are real tasks and real processes (tests/kit/log_writer.py), the crash is
a real SIGKILL, corruption and a newer schema are written into the real database. Every
subprocess has a timeout and is killed in a `finally`.

On Kafka, the tests about schemas (a newer schema, a log behind head) run against the Kafka
log's SQL state store, where its checkpoints, projections and snapshots live; the rest run
unchanged. Kafka's own cases (fencing, copies of a record, a topic that went backwards) are in
tests/log/test_kafka_log.py.

Cases:
* positions: global sequence, stream versions, head, read pagination, empty appends;
* expected version: a conflict appends nothing, concurrent appends at one version, one wins;
* command ids: a retry returns the original positions and appends nothing, even after reopening;
* atomicity: a failure in any batch or event of a step leaves nothing of the step; event ids
  are unique; a rejected append raises AppendRejected on every backend;
* concurrency: writers in tasks and processes while a reader tails; the reader sees 1..N once
  each, in order; tail wakes on an append in this process without waiting for its poll;
* crash: a writer killed with SIGKILL mid-append loses no committed step, leaves no partial one;
* checkpoints commit with projection rows, or neither does; an open projection transaction is
  invisible to (and does not block) readers; snapshots list newest first;
* bad input: a corrupt payload names its global sequence and forensic replay skips it; a newer
  schema is refused naming both revisions; PostgreSQL behind head is refused with the command
  to run, SQLite upgrades itself; an unreachable URL is one LogUnavailable line, password masked;
* nothing committed is ever rewritten or deleted.
"""

from __future__ import annotations

import os
import re
import signal
import sys
import time
from collections import defaultdict
from collections.abc import AsyncIterator, Iterator, Sequence
from contextlib import asynccontextmanager
from pathlib import Path

import anyio
import pytest
import sqlalchemy as sa
from anyio.abc import Process
from anyio.streams.buffered import BufferedByteReceiveStream
from sqlalchemy.ext.asyncio import AsyncConnection, create_async_engine

import migrations
from coordinator.ledger.recovery import replay
from events import EventCodec, EventDecodeError, TierDeclared, TierSpec
from events.log import (
    AppendBatch,
    AppendRejected,
    AppendResult,
    EventLog,
    LogError,
    LogUnavailable,
    PendingEvent,
    SchemaMismatch,
    Snapshot,
    StoredEvent,
    WrongExpectedVersion,
    _kafka,
    _sql,
    normalize,
    open_log,
    schema_revision,
    upgrade_log,
)
from events.log.kafka_target import parse_kafka_url
from tests.conftest import CONTRACT_BACKENDS, log_url_for
from tests.kit.log_writer import EVENT_TYPE, append_steps, event_id_for, payload_for

pytestmark = pytest.mark.anyio


@pytest.fixture(params=CONTRACT_BACKENDS)
def log_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """Every backend, Kafka included (the conftest's fixture has the SQL ones only)."""
    yield from log_url_for(request, tmp_path)


def sql_url(log_url: str) -> str:
    """The SQL database behind a log: itself, or a Kafka log's state store."""
    return parse_kafka_url(log_url).state_url if log_url.startswith("kafka://") else log_url


ROOT = Path(__file__).resolve().parents[2]
FALLBACK_S = 30.0
"""How long a tail's fallback waits in the wake-up test, against the 0.2 s and 1 s they wait in use."""
PROCESS_TIMEOUT = 30.0
"""Seconds any writer subprocess may work; it is killed after that (and in every `finally`)."""
START_TIMEOUT = 60.0
"""Seconds writer subprocesses started together may take to be ready (import kvledger, open the
log), apart from PROCESS_TIMEOUT: on 2 busy cores three Kafka writers took up to 23 s to start,
and their 300 appends then took 3 s."""


# --- helpers --------------------------------------------------------------------------------


def pending(event_id: str, payload: bytes = b"", *, step: int = 1, event_type: str = EVENT_TYPE) -> PendingEvent:
    return PendingEvent(
        event_id=event_id,
        step=step,
        recorded_at=1_700_000_000.5,
        event_type=event_type,
        schema_version=1,
        payload=payload or f"payload of {event_id}".encode() + b"\x00\xff",
    )


def pendings(prefix: str, count: int, step: int = 1) -> list[PendingEvent]:
    return [pending(f"{prefix}-{index}", step=step) for index in range(count)]


def batch(stream: str, expected: int, events: Sequence[PendingEvent], command_id: str | None = None) -> AppendBatch:
    return AppendBatch(stream_id=stream, expected_version=expected, events=list(events), command_id=command_id)


async def all_events(event_log: EventLog) -> list[StoredEvent]:
    """Every committed event, read in pages."""
    events: list[StoredEvent] = []
    while page := await event_log.read(events[-1].global_seq if events else 0, 1000):
        events.extend(page)
    return events


def assert_well_formed(events: Sequence[StoredEvent]) -> None:
    """Global sequences gapless from 1 in order, stream versions gapless from 1 per stream in
    global order, event ids unique."""
    assert [e.global_seq for e in events] == list(range(1, len(events) + 1))
    versions: dict[str, list[int]] = defaultdict(list)
    for event in events:
        versions[event.stream_id].append(event.stream_version)
    for stream, seen in versions.items():
        assert seen == list(range(1, len(seen) + 1)), f"stream {stream!r} versions {seen}"
    assert len({e.event_id for e in events}) == len(events)


async def assert_preserved(event_log: EventLog, before: Sequence[StoredEvent]) -> list[StoredEvent]:
    """Nothing committed is rewritten or deleted: the events read earlier are still there,
    byte for byte, at the same positions. Returns every event now."""
    now = await all_events(event_log)
    assert len(now) >= len(before), f"events were deleted: {len(before)} before, {len(now)} now"
    for old, new in zip(before, now):
        assert new == old, f"event at {old.global_seq} was rewritten: {old} -> {new}"
    return now


async def failed_append(event_log: EventLog, batches: Sequence[AppendBatch]) -> Exception:
    """The error an append raised (it must raise)."""
    try:
        await event_log.append(batches)
    except Exception as error:  # noqa: BLE001 - which type it is gets its own assertion
        return error
    raise AssertionError("the append succeeded")


def assert_rejected(error: Exception) -> None:
    """A rejected append raises the contract's AppendRejected on every backend, never one
    driver's or SQLAlchemy's own exception type."""
    assert isinstance(error, AppendRejected), (
        f"a rejected append raised {type(error).__module__}.{type(error).__qualname__}: {error}"
    )


def assert_stored_as_appended(
    stored: Sequence[StoredEvent], stream: str, first_version: int, appended: Sequence[PendingEvent]
) -> None:
    assert len(stored) == len(appended)
    for offset, (got, sent) in enumerate(zip(stored, appended)):
        assert (got.stream_id, got.stream_version) == (stream, first_version + offset)
        assert (got.event_id, got.step, got.recorded_at, got.event_type, got.schema_version, got.payload) == (
            sent.event_id,
            sent.step,
            sent.recorded_at,
            sent.event_type,
            sent.schema_version,
            sent.payload,
        )


async def log_state(event_log: EventLog) -> tuple[int, dict[str, int], list[StoredEvent]]:
    return await event_log.head(), await event_log.stream_versions(), await all_events(event_log)


@asynccontextmanager
async def writer_process(
    url: str, stream: str, steps: int, per_step: int, pause: float = 0.0, wait_for_go: bool = False
) -> AsyncIterator[Process]:
    """A real `python -m tests.kit.log_writer` process; killed on the way out if still running.
    With `wait_for_go` it starts appending only after a line is sent to its stdin."""
    process = await anyio.open_process(
        [sys.executable, "-m", "tests.kit.log_writer", url, stream, str(steps), str(per_step), str(pause)],
        cwd=ROOT,
        env={**os.environ, "PYTHONUNBUFFERED": "1", "KVLEDGER_TEST_WRITER_WAIT": "1" if wait_for_go else "0"},
    )
    try:
        yield process
    finally:
        with anyio.CancelScope(shield=True):
            if process.returncode is None:
                process.kill()
            with anyio.move_on_after(10):
                await process.wait()
            await process.aclose()


LOG_LINE = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d \[")
"""structlog's default console line: the log's own messages (a Kafka writer's claims, say), which
share the writer's stdout."""


async def read_line(stream: BufferedByteReceiveStream, process: Process | None = None) -> str:
    """The next line the writer printed, log lines skipped; if it ended instead, fail showing its stderr."""
    try:
        while LOG_LINE.match(line := (await stream.receive_until(b"\n", 65536)).decode()):
            pass
        return line
    except (anyio.EndOfStream, anyio.IncompleteRead):
        errors = b""
        if process is not None and process.stderr is not None:
            with anyio.move_on_after(5):
                async for chunk in process.stderr:
                    errors += chunk
        raise AssertionError(f"the writer process ended early; its stderr:\n{errors.decode(errors='replace')}") from None


# --- positions --------------------------------------------------------------------------------


async def test_append_assigns_global_sequences_stream_versions_and_head(event_log: EventLog) -> None:
    assert await event_log.head() == 0
    assert await event_log.stream_versions() == {}
    assert await event_log.stream_version("a") == 0

    first = pendings("a1", 3)
    [r1] = await event_log.append([batch("a", 0, first)])
    assert r1 == AppendResult(stream_id="a", first_seq=1, last_seq=3, stream_version=3, duplicate=False)
    second = pendings("b1", 2)
    [r2] = await event_log.append([batch("b", 0, second)])
    assert r2 == AppendResult(stream_id="b", first_seq=4, last_seq=5, stream_version=2)
    third = pendings("a2", 2, step=2)
    [r3] = await event_log.append([batch("a", 3, third)])
    assert r3 == AppendResult(stream_id="a", first_seq=6, last_seq=7, stream_version=5)

    assert await event_log.head() == 7
    assert await event_log.stream_version("a") == 5
    assert await event_log.stream_version("b") == 2
    assert await event_log.stream_version("never") == 0
    assert await event_log.stream_versions() == {"a": 5, "b": 2}

    stored = await all_events(event_log)
    assert_well_formed(stored)
    assert_stored_as_appended(stored[0:3], "a", 1, first)
    assert_stored_as_appended(stored[3:5], "b", 1, second)
    assert_stored_as_appended(stored[5:7], "a", 4, third)


async def test_a_multi_stream_append_takes_consecutive_sequences_in_batch_order(event_log: EventLog) -> None:
    await event_log.append([batch("x", 0, pendings("x0", 1))])
    results = await event_log.append(
        [batch("a", 0, pendings("a", 2)), batch("x", 1, pendings("x1", 3)), batch("b", 0, pendings("b", 1))]
    )
    assert [(r.stream_id, r.first_seq, r.last_seq, r.stream_version) for r in results] == [
        ("a", 2, 3, 2),
        ("x", 4, 6, 4),
        ("b", 7, 7, 1),
    ]
    assert_well_formed(await all_events(event_log))


async def test_empty_appends_append_nothing(event_log: EventLog) -> None:
    assert await event_log.append([]) == []
    [empty_new] = await event_log.append([batch("new", 0, [])])
    assert (empty_new.first_seq, empty_new.last_seq, empty_new.stream_version, empty_new.duplicate) == (0, 0, 0, False)
    assert await event_log.head() == 0
    assert await event_log.stream_version("new") == 0

    await event_log.append([batch("s", 0, pendings("s", 2))])
    [empty_existing] = await event_log.append([batch("s", 2, [], command_id="empty-cmd")])
    assert (empty_existing.first_seq, empty_existing.last_seq, empty_existing.stream_version) == (0, 0, 2)
    [retried] = await event_log.append([batch("s", 2, [], command_id="empty-cmd")])
    assert retried.duplicate and (retried.first_seq, retried.last_seq, retried.stream_version) == (0, 0, 2)
    # An empty batch still checks its expected version.
    with pytest.raises(WrongExpectedVersion):
        await event_log.append([batch("s", 1, [])])
    # ...and an empty batch beside a real one does not disturb the real one's positions.
    results = await event_log.append([batch("t", 0, []), batch("s", 2, pendings("s2", 1, step=2))])
    assert [(r.first_seq, r.last_seq, r.stream_version) for r in results] == [(0, 0, 0), (3, 3, 3)]
    assert await event_log.head() == 3
    assert await event_log.stream_versions() == {"s": 3}
    assert_well_formed(await all_events(event_log))


async def test_read_pages_by_after_seq_and_limit(event_log: EventLog) -> None:
    for index in range(5):
        stream = "even" if index % 2 == 0 else "odd"
        await event_log.append([batch(stream, await event_log.stream_version(stream), pendings(f"p{index}", 5))])
    assert [e.global_seq for e in await event_log.read(0, 10)] == list(range(1, 11))
    assert [e.global_seq for e in await event_log.read(10, 10)] == list(range(11, 21))
    assert [e.global_seq for e in await event_log.read(20, 10)] == list(range(21, 26))
    assert await event_log.read(25, 10) == []
    assert await event_log.read(1000) == []
    assert [e.global_seq for e in await event_log.read(3, 1)] == [4]
    assert [e.global_seq for e in await event_log.read()] == list(range(1, 26))
    paged: list[StoredEvent] = []
    for after in range(0, 25, 7):
        paged.extend(await event_log.read(after, 7))
    assert paged == await event_log.read()


async def test_read_stream_steps_reads_one_streams_steps_as_read_steps_holds_them(event_log: EventLog) -> None:
    """A worker's catch-up reads its engine's stream alone: the same steps read_steps returns of
    that stream, whole and in order, from the one ending after after_seq, at most `limit`."""
    for index in range(9):
        stream = "even" if index % 3 else "third"
        await event_log.append([batch(stream, await event_log.stream_version(stream), pendings(f"q{index}", 4))])
    every = await event_log.read_steps(0, 1000)
    for stream in ("even", "third"):
        own = [step for step in every if step.stream_id == stream]
        assert await event_log.read_stream_steps(stream, 0, 1000) == own
        for after in range(0, 37):
            expected = [step for step in own if step.last_seq > after]
            assert await event_log.read_stream_steps(stream, after, 2) == expected[:2], (stream, after)
    assert [step.first_seq for step in await event_log.read_stream_steps("third", 0, 1000)] == [1, 13, 25]
    assert [step.first_seq for step in await event_log.read_stream_steps("third", 14, 1)] == [13]  # holds 15 and 16
    assert [step.first_seq for step in await event_log.read_stream_steps("third", 16, 1)] == [25]
    assert await event_log.read_stream_steps("never-written", 0, 1000) == []
    assert await event_log.read_stream_steps("even", 0, 0) == []


# --- expected versions --------------------------------------------------------------------------


async def test_expected_version_conflict_appends_nothing(event_log: EventLog) -> None:
    await event_log.append([batch("s", 0, pendings("s", 2))])
    before = await log_state(event_log)

    with pytest.raises(WrongExpectedVersion) as stale:
        await event_log.append([batch("s", 1, pendings("stale", 1))])
    assert (stale.value.stream_id, stale.value.expected, stale.value.actual) == ("s", 1, 2)
    assert "'s'" in str(stale.value)
    with pytest.raises(WrongExpectedVersion) as as_new:
        await event_log.append([batch("s", 0, pendings("as-new", 1))])
    assert (as_new.value.expected, as_new.value.actual) == (0, 2)
    with pytest.raises(WrongExpectedVersion) as ahead:
        await event_log.append([batch("fresh", 3, pendings("ahead", 1))])
    assert (ahead.value.stream_id, ahead.value.expected, ahead.value.actual) == ("fresh", 3, 0)

    assert await log_state(event_log) == before
    # The stream goes on from where it was; nothing the failed appends did shows.
    [ok] = await event_log.append([batch("s", 2, pendings("next", 1))])
    assert (ok.first_seq, ok.stream_version) == (3, 3)
    assert_well_formed(await assert_preserved(event_log, before[2]))


async def test_concurrent_appends_at_one_expected_version_exactly_one_wins(event_log: EventLog) -> None:
    outcomes: dict[int, AppendResult | WrongExpectedVersion] = {}

    async def contend(writer: int) -> None:
        try:
            [result] = await event_log.append([batch("contended", 0, pendings(f"w{writer}", 3))])
            outcomes[writer] = result
        except WrongExpectedVersion as conflict:
            outcomes[writer] = conflict

    with anyio.fail_after(30):
        async with anyio.create_task_group() as tg:
            for writer in range(8):
                tg.start_soon(contend, writer)
    winners = [w for w, o in outcomes.items() if isinstance(o, AppendResult)]
    assert len(winners) == 1, outcomes
    for writer, outcome in outcomes.items():
        if writer != winners[0]:
            assert isinstance(outcome, WrongExpectedVersion) and outcome.actual == 3, outcome
    stored = await all_events(event_log)
    assert [e.event_id for e in stored] == [f"w{winners[0]}-{i}" for i in range(3)]
    assert await event_log.stream_version("contended") == 3


# --- command ids ----------------------------------------------------------------------------------


async def test_retried_command_id_returns_original_positions_and_appends_nothing(event_log: EventLog, log_url: str) -> None:
    step = batch("s", 0, pendings("s1", 3), command_id="cmd-1")
    [original] = await event_log.append([step])
    assert original == AppendResult(stream_id="s", first_seq=1, last_seq=3, stream_version=3, duplicate=False)
    await event_log.append([batch("other", 0, pendings("o", 2))])
    before = await log_state(event_log)

    # The exact retry (its expected version is now stale: the retry must win over the conflict).
    [retry] = await event_log.append([step])
    assert retry == AppendResult(stream_id="s", first_seq=1, last_seq=3, stream_version=3, duplicate=True)
    assert await log_state(event_log) == before

    # A retry beside a new batch: the retry appends nothing, the new batch appends.
    retry_again, fresh = await event_log.append([step, batch("t", 0, pendings("t", 1), command_id="cmd-2")])
    assert retry_again == retry
    assert (fresh.first_seq, fresh.last_seq, fresh.duplicate) == (6, 6, False)

    # Durable: a retry through a freshly opened log is still recognized.
    reopened = await open_log(log_url)
    try:
        [late] = await reopened.append([step])
        assert late == retry
        [late2] = await reopened.append([batch("t", 0, pendings("t", 1), command_id="cmd-2")])
        assert (late2.first_seq, late2.last_seq, late2.stream_version, late2.duplicate) == (6, 6, 1, True)
    finally:
        await reopened.close()
    assert await event_log.head() == 6
    assert_well_formed(await assert_preserved(event_log, before[2]))


# --- atomicity ------------------------------------------------------------------------------------


async def test_one_wrong_expected_version_in_a_multi_stream_append_appends_no_batch(event_log: EventLog) -> None:
    await event_log.append([batch("a", 0, pendings("a0", 2)), batch("b", 0, pendings("b0", 1))])
    before = await log_state(event_log)

    step = [
        batch("a", 2, pendings("a1", 2), command_id="multi"),
        batch("b", 0, pendings("b1", 2)),  # wrong: b is at 1
        batch("c", 0, pendings("c1", 2)),
    ]
    with pytest.raises(WrongExpectedVersion) as conflict:
        await event_log.append(step)
    assert (conflict.value.stream_id, conflict.value.expected, conflict.value.actual) == ("b", 0, 1)
    assert await log_state(event_log) == before
    assert "c" not in await event_log.stream_versions()

    # The command id of the failed append was not recorded: the corrected step appends for real.
    fixed = [step[0], batch("b", 1, pendings("b1", 2)), step[2]]
    results = await event_log.append(fixed)
    assert [(r.first_seq, r.last_seq, r.duplicate) for r in results] == [(4, 5, False), (6, 7, False), (8, 9, False)]
    assert_well_formed(await assert_preserved(event_log, before[2]))


async def test_a_failure_inside_a_step_leaves_nothing_of_it(event_log: EventLog) -> None:
    await event_log.append([batch("s", 0, pendings("s0", 2))])
    before = await log_state(event_log)

    # The fourth event of the second batch repeats an event id of the first batch: the insert
    # fails in the middle of the step, after rows of the step were written.
    first = batch("s", 2, pendings("s1", 3), command_id="failing-step")
    second = batch("t", 0, [*pendings("t1", 3), pending("s1-0")])
    across_batches = await failed_append(event_log, [first, second])
    assert await log_state(event_log) == before

    # An event id repeated inside one batch fails the same way.
    within_batch = await failed_append(event_log, [batch("u", 0, [pending("dup"), pending("u-1"), pending("dup")])])
    assert await log_state(event_log) == before

    # The log goes on gapless; the failed step's command id was not recorded.
    [result] = await event_log.append([first])
    assert (result.first_seq, result.last_seq, result.stream_version, result.duplicate) == (3, 5, 5, False)
    assert_well_formed(await assert_preserved(event_log, before[2]))
    assert_rejected(across_batches)
    assert_rejected(within_batch)


async def test_event_ids_are_unique_across_streams(event_log: EventLog) -> None:
    await event_log.append([batch("a", 0, [pending("the-id", b"original")])])
    before = await log_state(event_log)
    other_stream = await failed_append(event_log, [batch("b", 0, [pending("b-0"), pending("the-id", b"impostor")])])
    same_stream = await failed_append(event_log, [batch("a", 1, [pending("the-id", b"impostor")])])
    assert await log_state(event_log) == before
    [stored] = await event_log.read()
    assert (stored.event_id, stored.stream_id, stored.payload) == ("the-id", "a", b"original")
    assert_rejected(other_stream)
    assert_rejected(same_stream)


# --- concurrency ------------------------------------------------------------------------------------


async def test_tail_wakes_promptly_on_an_append_in_this_process(event_log: EventLog, monkeypatch: pytest.MonkeyPatch) -> None:
    """An append in this process wakes its tail itself. The fallbacks (the SQL poll, the Kafka
    idle check) are put off to 30 s here, so a tail that waited for one of them fails the bound
    by a wide margin, and a slow, loaded machine does not."""
    monkeypatch.setattr(_sql, "POLL_SECONDS", FALLBACK_S)
    monkeypatch.setattr(_kafka, "TAIL_CHECK_S", FALLBACK_S)
    await event_log.append([batch("s", 0, pendings("before", 2))])
    send, receive = anyio.create_memory_object_stream[tuple[StoredEvent, float]](100)

    async def reader() -> None:
        async with send:
            async for event in event_log.tail(after_seq=1):
                await send.send((event, time.monotonic()))

    latencies: list[float] = []
    with anyio.fail_after(20):
        async with anyio.create_task_group() as tg, receive:
            tg.start_soon(reader)
            first, _ = await receive.receive()
            assert first.global_seq == 2  # tail starts after after_seq
            for round_ in range(6):
                await anyio.sleep(0.05 + 0.013 * round_)  # the reader is idle, waiting
                [result] = await event_log.append([batch("s", 2 + round_, pendings(f"r{round_}", 1))])
                appended_at = time.monotonic()
                event, seen_at = await receive.receive()
                assert event.global_seq == result.last_seq
                latencies.append(seen_at - appended_at)
            tg.cancel_scope.cancel()
    assert max(latencies) < FALLBACK_S / 3, f"tail latencies after an append: {latencies}"


async def test_writers_in_tasks_and_processes_while_a_reader_tails(event_log: EventLog, log_url: str) -> None:
    """On Kafka this timed out when a fetch skipped a record (events/log/_kafka.py,
    _fold_fetched). The writers' start has a deadline of its own: under CPU load three writer
    processes took up to 23 s to start and their work then at most 3.3 s, and one 30 s deadline
    over both would fail with the log healthy. A failure says which part ran out and how far the
    reader and each writer got."""
    steps, per_step = 15, 4
    process_streams = [f"proc-{n}" for n in range(3)]
    task_streams = [f"task-{n}" for n in range(2)]
    total = (len(process_streams) + len(task_streams)) * steps * per_step
    seen: list[StoredEvent] = []
    outputs: dict[str, str] = {}
    printed: dict[str, list[bytes]] = {}
    """What each writer process printed so far, for a failure message."""
    finished: list[str] = []

    async def tail_reader(done: anyio.Event) -> None:
        async for event in event_log.tail():
            seen.append(event)
            if len(seen) >= total:
                break
        done.set()

    ready: list[str] = []
    all_ready, go = anyio.Event(), anyio.Event()

    async def run_process(stream: str) -> None:
        async with writer_process(log_url, stream, steps, per_step, pause=0.01, wait_for_go=True) as process:
            assert process.stdin is not None and process.stdout is not None and process.stderr is not None
            out, err = BufferedByteReceiveStream(process.stdout), process.stderr
            chunks = printed[stream] = []

            async def drain_err() -> None:
                async for chunk in err:
                    chunks.append(chunk)

            async with anyio.create_task_group() as inner:
                inner.start_soon(drain_err)
                assert await read_line(out, process) == "ready"
                ready.append(stream)
                if len(ready) == len(process_streams):
                    all_ready.set()
                await go.wait()
                await process.stdin.send(b"go\n")
                async for chunk in out:
                    chunks.append(chunk)
            code = await process.wait()
            outputs[stream] = b"".join(chunks).decode(errors="replace")
            assert code == 0, f"writer {stream} exited {code}: {outputs[stream]}"

    async def run_task(stream: str) -> None:
        await go.wait()
        await append_steps(event_log, stream, steps, per_step, pause=0.01)
        finished.append(stream)

    async def progress() -> str:
        """How far the reader and each writer got, for a failure message."""
        last_commits = {
            stream: (
                [line for line in b"".join(chunks).decode(errors="replace").splitlines() if line.startswith("committed ")]
                or ["nothing committed"]
            )[-1]
            for stream, chunks in printed.items()
        }
        head = "no answer within 10 s"
        with anyio.move_on_after(10):
            try:
                head = str(await event_log.head())
            except LogError as error:
                head = f"{type(error).__name__}: {error}"
        return (
            f"the reader saw {len(seen)} of {total} events; the log's head: {head}; writer processes ready: "
            f"{sorted(ready)}, their last commits: {last_commits}; writer tasks finished: {sorted(finished)}"
        )

    reader_done = anyio.Event()
    stalled: str | None = None
    with anyio.fail_after(START_TIMEOUT + PROCESS_TIMEOUT + 20):
        async with anyio.create_task_group() as tg:
            tg.start_soon(tail_reader, reader_done)
            for stream in process_streams:
                tg.start_soon(run_process, stream)
            for stream in task_streams:
                tg.start_soon(run_task, stream)
            with anyio.move_on_after(START_TIMEOUT) as starting:
                await all_ready.wait()
            if starting.cancelled_caught:
                stalled = f"the writer processes were not all ready after {START_TIMEOUT:.0f} s: " + await progress()
            else:
                go.set()  # every writer starts at once, and the deadline for their work with them
                with anyio.move_on_after(PROCESS_TIMEOUT) as working:
                    await reader_done.wait()
                if working.cancelled_caught:
                    stalled = f"{PROCESS_TIMEOUT:.0f} s after the writers started: " + await progress()
            if stalled is not None:
                tg.cancel_scope.cancel()
    if stalled is not None:
        pytest.fail(stalled)

    sequences = [e.global_seq for e in seen]
    assert sequences == list(range(1, total + 1)), "the tailing reader skipped or repeated a global sequence"
    assert_well_formed(seen)
    switches = sum(a.stream_id != b.stream_id for a, b in zip(seen, seen[1:]))
    assert switches >= 20, f"the writers hardly overlapped ({switches} stream switches): the test did not test concurrency"
    assert await event_log.head() == total
    assert await event_log.stream_versions() == {s: steps * per_step for s in process_streams + task_streams}
    for event in seen:
        step, index = divmod(event.stream_version - 1, per_step)
        assert (event.event_id, event.step, event.payload) == (
            event_id_for(event.stream_id, step + 1, index),
            step + 1,
            payload_for(event.stream_id, step + 1, index),
        )
    # What the reader saw is what is stored, and stays so.
    await assert_preserved(event_log, seen)


async def dead_writer_settled(log_url: str) -> None:
    """A killed client's PostgreSQL backend may still be finishing its transaction: a COMMIT the
    client sent before it died still lands. Wait until no other backend of this database is busy,
    so what the test reads next is final. (SQLite has no server: the dead process wrote nothing
    more.)"""
    if not log_url.startswith("postgresql"):
        return
    engine = create_async_engine(normalize(log_url))
    try:
        with anyio.fail_after(30):
            while True:
                async with engine.connect() as conn:
                    busy = (
                        await conn.execute(
                            sa.text(
                                "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
                                "AND backend_type = 'client backend' AND pid <> pg_backend_pid() AND state IS DISTINCT FROM 'idle'"
                            )
                        )
                    ).scalar()
                if not busy:
                    return
                await anyio.sleep(0.05)
    finally:
        await engine.dispose()


async def test_writer_killed_with_sigkill_mid_append_loses_no_commit_and_leaves_no_partial_step(
    event_log: EventLog, log_url: str
) -> None:
    per_step, stream = 256, "crashing"
    reported: list[tuple[int, int, int]] = []

    async def assert_whole_steps(checked: EventLog) -> None:
        """Every reported commit is there; only whole steps; sequences gapless."""
        stored = await all_events(checked)
        head = await checked.head()
        assert [e.global_seq for e in stored] == list(range(1, head + 1)), "global sequence has gaps"
        assert_well_formed(stored)
        assert len(stored) % per_step == 0, f"{len(stored)} events: a partial step of {len(stored) % per_step} events"
        assert await checked.stream_version(stream) == len(stored)
        by_step: dict[int, list[StoredEvent]] = defaultdict(list)
        for event in stored:
            by_step[event.step].append(event)
        assert sorted(by_step) == list(range(1, len(by_step) + 1))
        for step, events in by_step.items():
            assert [e.event_id for e in events] == [event_id_for(stream, step, i) for i in range(per_step)], f"step {step}"
            assert [e.payload for e in events] == [payload_for(stream, step, i) for i in range(per_step)], f"step {step}"
        for first_seq, last_seq, version in reported:
            assert last_seq - first_seq + 1 == per_step
            assert last_seq <= head, f"reported commit {first_seq}..{last_seq} lost (head {head})"
            committed = stored[first_seq - 1 : last_seq]
            assert [e.stream_version for e in committed] == list(range(version - per_step + 1, version + 1))

    # Each writer continues the stream the previous one left. It appends back to back, so the
    # time between two commit reports is about one append: the kill lands that fraction of an
    # append after a commit, somewhere inside the next append's transaction.
    for fraction in (0.2, 0.5, 0.8):
        async with writer_process(log_url, stream, 0, per_step) as process:
            assert process.stdout is not None
            lines = BufferedByteReceiveStream(process.stdout)
            with anyio.fail_after(PROCESS_TIMEOUT):
                assert await read_line(lines, process) == "ready"
                arrivals: list[float] = []
                while len(arrivals) < 4:
                    words = (await read_line(lines, process)).split()
                    arrivals.append(time.monotonic())
                    assert words[0] == "committed", words
                    reported.append((int(words[1]), int(words[2]), int(words[3])))
                append_seconds = sorted(b - a for a, b in zip(arrivals, arrivals[1:]))[1]
                await anyio.sleep(fraction * append_seconds)
                process.send_signal(signal.SIGKILL)
                assert await process.wait() == -signal.SIGKILL
        await dead_writer_settled(log_url)
        await assert_whole_steps(event_log)

    reopened = await open_log(log_url)  # as the restarted service would
    try:
        await assert_whole_steps(reopened)
        # The log stays writable after the crashes.
        version = await reopened.stream_version(stream)
        [after] = await reopened.append([batch(stream, version, pendings("after-crash", 1))])
        assert after.first_seq == version + 1
    finally:
        await reopened.close()


# --- checkpoints and snapshots -------------------------------------------------------------------------

projection_metadata = sa.MetaData()
projection_rows = sa.Table(
    "contract_projection_rows",
    projection_metadata,
    sa.Column("global_seq", sa.BigInteger, primary_key=True),
    sa.Column("event_id", sa.String(64), nullable=False),
)


async def create_projection_table(event_log: EventLog) -> None:
    async with event_log.projection_transaction("setup") as tx:
        connection: AsyncConnection = tx.connection
        await connection.run_sync(projection_metadata.create_all)


async def projected_rows(event_log: EventLog) -> list[tuple[int, str]]:
    async with event_log.projection_transaction("row-reader") as tx:
        connection: AsyncConnection = tx.connection
        result = await connection.execute(sa.select(projection_rows).order_by(projection_rows.c.global_seq))
        return [(row.global_seq, row.event_id) for row in result]


async def test_checkpoint_commits_with_projection_rows_or_not_at_all(event_log: EventLog) -> None:
    await event_log.append([batch("s", 0, pendings("s", 5))])
    await create_projection_table(event_log)
    assert await event_log.checkpoint("p") == 0

    # The events are read before the transaction: reading inside it is another test's subject.
    first, rest = await event_log.read(0, 3), await event_log.read(3, 2)
    async with event_log.projection_transaction("p") as tx:
        for event in first:
            await tx.connection.execute(projection_rows.insert().values(global_seq=event.global_seq, event_id=event.event_id))
        await tx.advance(3)
    assert await event_log.checkpoint("p") == 3
    assert await projected_rows(event_log) == [(1, "s-0"), (2, "s-1"), (3, "s-2")]

    class ProjectionFailed(Exception):
        pass

    with pytest.raises(ProjectionFailed):
        async with event_log.projection_transaction("p") as tx:
            for event in rest:
                await tx.connection.execute(projection_rows.insert().values(global_seq=event.global_seq, event_id=event.event_id))
            await tx.advance(5)
            raise ProjectionFailed
    assert await event_log.checkpoint("p") == 3
    assert await projected_rows(event_log) == [(1, "s-0"), (2, "s-1"), (3, "s-2")]

    # Failing before the checkpoint is written, with rows written, leaves nothing either.
    with pytest.raises(ProjectionFailed):
        async with event_log.projection_transaction("p") as tx:
            await tx.connection.execute(projection_rows.insert().values(global_seq=4, event_id="s-3"))
            raise ProjectionFailed
    assert await projected_rows(event_log) == [(1, "s-0"), (2, "s-1"), (3, "s-2")]

    # Advancing again updates the one checkpoint; checkpoints are per name.
    async with event_log.projection_transaction("p") as tx:
        for event in rest:
            await tx.connection.execute(projection_rows.insert().values(global_seq=event.global_seq, event_id=event.event_id))
        await tx.advance(5)
    assert await event_log.checkpoint("p") == 5
    assert await event_log.checkpoint("other") == 0
    assert await event_log.checkpoint("setup") == 0
    assert [seq for seq, _ in await projected_rows(event_log)] == [1, 2, 3, 4, 5]


async def test_an_open_projection_transaction_is_invisible_to_readers_and_does_not_block_them(event_log: EventLog) -> None:
    """Readers see the old checkpoint until the projection transaction commits, and get their
    answers at once: a projector that reads the log or a checkpoint while its own transaction is
    open must not wait for itself (on SQLite in WAL mode, readers never wait for a writer)."""
    await event_log.append([batch("s", 0, pendings("s", 3))])
    await create_projection_table(event_log)
    answers: dict[str, tuple[object, float]] = {}
    readers = {
        "checkpoint": lambda: event_log.checkpoint("p"),
        "read": lambda: event_log.read(0),
        "head": event_log.head,
        "stream_versions": event_log.stream_versions,
    }
    all_answered = anyio.Event()

    async def ask(name: str) -> None:
        answers[name] = (await readers[name](), time.monotonic())
        if len(answers) == len(readers):
            all_answered.set()

    with anyio.fail_after(60):
        async with anyio.create_task_group() as tg:
            async with event_log.projection_transaction("p") as tx:
                await tx.connection.execute(projection_rows.insert().values(global_seq=1, event_id="s-0"))
                await tx.advance(3)
                for name in readers:
                    tg.start_soon(ask, name)
                with anyio.move_on_after(2):
                    await all_answered.wait()
                committed_at = time.monotonic()
    waited = sorted(name for name, (_, at) in answers.items() if at >= committed_at)
    assert not waited, f"these reads waited for an open projection transaction to commit: {waited}"
    assert answers["checkpoint"][0] == 0, "a reader saw the checkpoint of a projection transaction that had not committed"
    assert answers["head"][0] == 3
    assert await event_log.checkpoint("p") == 3


async def test_snapshots_are_listed_newest_first(event_log: EventLog) -> None:
    assert await event_log.snapshots() == []

    def snapshot(seq: int, tag: bytes) -> Snapshot:
        return Snapshot(
            global_seq=seq,
            schema_version=3,
            digest=f"digest-{seq}-{tag.decode()}",
            state=b"\x00state\xff" + tag,
            created_at=1000.0 + seq,
        )

    saved = [snapshot(5, b"a"), snapshot(10, b"b"), snapshot(7, b"c"), snapshot(10, b"d"), snapshot(1, b"e")]
    for item in saved:
        await event_log.save_snapshot(item)
    listed = await event_log.snapshots()
    # Newest first: highest global sequence; of two at one sequence, the later saved.
    assert listed == [saved[3], saved[1], saved[2], saved[0], saved[4]]
    assert await event_log.snapshots(limit=2) == [saved[3], saved[1]]
    assert await event_log.snapshots(limit=10) == listed
    assert await event_log.head() == 0  # snapshots are not events


# --- bad input ------------------------------------------------------------------------------------------


async def test_a_corrupt_payload_names_its_global_sequence_and_forensic_replay_skips_it(event_log: EventLog) -> None:
    codec = EventCodec()

    def encoded(event: TierDeclared, event_id: str) -> PendingEvent:
        event_type, schema_version, payload = codec.encode(event)
        return PendingEvent(
            event_id=event_id, step=1, recorded_at=1.0, event_type=event_type, schema_version=schema_version, payload=payload
        )

    names = [f"tier-{n}" for n in range(12)]
    good_before = [
        encoded(TierDeclared(spec=TierSpec(name=name, num_slots=4, bytes_per_slot=64)), f"good-{name}") for name in names[:11]
    ]
    corrupt = PendingEvent(
        event_id="corrupt", step=1, recorded_at=1.0, event_type="job_succeeded", schema_version=1, payload=b"\xc1\xc1"
    )
    good_after = encoded(TierDeclared(spec=TierSpec(name="host", num_slots=4, bytes_per_slot=64)), "good-host")
    await event_log.append([batch("declarations", 0, good_before)])
    [bad] = await event_log.append([batch("engine", 0, [corrupt])])
    await event_log.append([batch("declarations", 11, [good_after])])
    assert bad.first_seq == 12

    with pytest.raises(EventDecodeError) as refused:
        await replay(event_log, codec)
    message = str(refused.value)
    assert re.search(r"\b12\b", message), f"the error does not name global sequence 12: {message}"
    assert "job_succeeded" in message
    assert refused.value.position == 12

    skipped: list[EventDecodeError] = []
    state, last = await replay(event_log, codec, skip_undecodable=True, on_skip=skipped.append)
    assert [error.position for error in skipped] == [12]
    assert last == 13
    assert sorted(state.tiers) == sorted([*names[:11], "host"])
    assert state.tiers["host"].spec == TierSpec(name="host", num_slots=4, bytes_per_slot=64)
    # The corrupt event is still in the log, as written: forensics see it, nothing repaired it.
    [stored] = await event_log.read(11, 1)
    assert (stored.event_id, stored.payload) == ("corrupt", b"\xc1\xc1")


async def test_a_log_written_by_a_newer_schema_is_refused_naming_both_revisions(event_log: EventLog, log_url: str) -> None:
    await event_log.append([batch("s", 0, pendings("s", 2))])
    before = await all_events(event_log)
    engine = create_async_engine(normalize(sql_url(log_url)))
    try:
        async with engine.begin() as conn:
            await conn.execute(sa.text("UPDATE alembic_version SET version_num = '9999_future'"))

        with pytest.raises(SchemaMismatch) as refused:
            await open_log(log_url)
        message = str(refused.value)
        assert "9999_future" in message and migrations.head() in message, message
        with pytest.raises(SchemaMismatch) as refused_upgrade:
            await upgrade_log(log_url)
        assert "9999_future" in str(refused_upgrade.value) and migrations.head() in str(refused_upgrade.value)
        assert await schema_revision(log_url) == ("9999_future", migrations.head())

        # Refusing changed nothing: neither the revision nor the events.
        async with engine.connect() as conn:
            assert (await conn.execute(sa.text("SELECT version_num FROM alembic_version"))).scalar_one() == "9999_future"
        await assert_preserved(event_log, before)
    finally:
        await engine.dispose()


async def test_a_log_behind_head_is_upgraded_on_sqlite_and_refused_on_postgresql(log_url: str) -> None:
    head = migrations.head()
    if log_url.startswith("postgresql"):
        assert await schema_revision(log_url) == (None, head)
        with pytest.raises(SchemaMismatch) as refused:
            await open_log(log_url)
        message = str(refused.value)
        assert "kvledger db upgrade" in message and head in message, message
        assert await schema_revision(log_url) == (None, head)  # refusing created nothing
        assert await upgrade_log(log_url) == head
        opened = [await open_log(log_url)]
    else:
        assert not Path(sql_url(log_url)).exists()
        # Several openers of one new file at once: one upgrades, all open. On Kafka the file is the
        # state store, and the topic is new too: one creates it, all open.
        opened = []

        async def open_one() -> None:
            opened.append(await open_log(log_url))

        with anyio.fail_after(60):
            async with anyio.create_task_group() as tg:
                for _ in range(3):
                    tg.start_soon(open_one)
    try:
        assert await schema_revision(log_url) == (head, head)
        for index, event_log in enumerate(opened):
            await event_log.append([batch(f"s{index}", 0, pendings(f"s{index}", 1))])
        assert await opened[0].head() == len(opened)
    finally:
        for event_log in opened:
            await event_log.close()


async def test_an_unreachable_log_is_one_line_naming_the_masked_url(log_url: str, tmp_path: Path) -> None:
    if log_url.startswith("postgresql"):
        url, shown, secret = "postgresql://user:s3cret@127.0.0.1:1/nope", ["127.0.0.1:1", "***", "nope"], "s3cret"
    elif log_url.startswith("kafka://"):
        # No broker listens on port 1. (A kafka:// URL takes no credentials yet.)
        url, shown, secret = f"kafka://127.0.0.1:1/nope?state={tmp_path / 'state.sqlite'}", ["127.0.0.1:1", "nope"], None
    else:
        blocker = tmp_path / "not-a-directory"
        blocker.write_text("a file where the log's directory would be")
        url, shown, secret = f"sqlite:///{blocker}/log.sqlite", [str(blocker)], None
    problems: list[str] = []
    for attempt in (open_log, upgrade_log, schema_revision):
        name = attempt.__name__
        try:
            with anyio.fail_after(30):
                await attempt(url)
        except LogUnavailable as unavailable:
            message = str(unavailable)
            if "\n" in message.strip():
                problems.append(f"{name}: not one line: {message!r}")
            problems.extend(f"{name}: {part!r} not in {message!r}" for part in shown if part not in message)
            if secret is not None and secret in message:
                problems.append(f"{name}: the password shows: {message!r}")
        except Exception as other:  # noqa: BLE001 - the wrong kind of error is the finding
            problems.append(f"{name} raised {type(other).__module__}.{type(other).__qualname__} ({other}), not LogUnavailable")
        else:
            problems.append(f"{name} did not fail")
    assert not problems, "\n".join(problems)


async def test_nothing_committed_is_rewritten_or_deleted(event_log: EventLog, log_url: str) -> None:
    every_byte = bytes(range(256))
    appended = [pending(f"bytes-{n}", every_byte[n:] + every_byte[:n] or b"\x00") for n in range(0, 256, 51)]
    await event_log.append([batch("raw", 0, appended, command_id="raw-1")])
    await event_log.append([batch("other", 0, pendings("other", 3))])
    before = await all_events(event_log)
    assert_stored_as_appended(before[: len(appended)], "raw", 1, appended)

    # Everything the service does after that: retries, conflicts, failed steps, projections,
    # snapshots, reopening and re-running the upgrade.
    await event_log.append([batch("raw", 0, [pending("bytes-0", b"rewritten?")], command_id="raw-1")])
    with pytest.raises(WrongExpectedVersion):
        await event_log.append([batch("raw", 0, [pending("new", b"x")])])
    assert_rejected(await failed_append(event_log, [batch("raw", len(appended), [pending("bytes-0", b"overwrite?")])]))
    with pytest.raises(RuntimeError):
        async with event_log.projection_transaction("p") as tx:
            await tx.advance(2)
            raise RuntimeError("projection failed")
    async with event_log.projection_transaction("p") as tx:
        await tx.advance(len(before))
    await event_log.save_snapshot(Snapshot(global_seq=len(before), schema_version=1, digest="d", state=b"s", created_at=1.0))
    await event_log.append([batch("raw", len(appended), pendings("later", 2, step=2))])
    assert await upgrade_log(log_url) == migrations.head()
    reopened = await open_log(log_url)
    try:
        await reopened.append([batch("other", 3, pendings("reopened", 1, step=2))])
        now = await assert_preserved(reopened, before)
    finally:
        await reopened.close()
    assert_stored_as_appended(now[: len(appended)], "raw", 1, appended)
    assert_well_formed(now)
    assert len(now) == len(before) + 3
    await assert_preserved(event_log, now)
