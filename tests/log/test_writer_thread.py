"""A SQLite log's appends run on one thread of the log's own, in the order they were made
(events/log/_writer_thread.py): what that thread promises its callers, and that a refused append
leaves it serving the next one."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import anyio
import pytest

from events.log import AppendRejected, open_log
from events.log._writer_thread import WriterThread
from tests.log.test_log_contract import all_events, batch, pending, pendings

pytestmark = pytest.mark.anyio

WRITER = "kvledger-log-writer"


def _writers() -> list[threading.Thread]:
    return [thread for thread in threading.enumerate() if thread.name.startswith(WRITER)]


async def test_appends_from_many_tasks_run_on_one_thread_in_the_order_they_were_made(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    event_log = await open_log(f"sqlite:///{tmp_path / 'log.sqlite'}")
    threads: set[str] = set()
    original: Any = getattr(event_log, "_append_blocking")  # noqa: B009

    def recording(*args: Any) -> Any:
        threads.add(threading.current_thread().name)
        return original(*args)

    monkeypatch.setattr(event_log, "_append_blocking", recording)
    try:
        assert _writers() == []  # opened, nothing appended: nothing started
        finished: list[int] = []

        async def one(stream: int) -> None:
            [result] = await event_log.append([batch(f"engine/{stream}", 0, pendings(f"s{stream}", 3))])
            finished.append(result.first_seq)

        async with anyio.create_task_group() as group:
            for stream in range(20):
                group.start_soon(one, stream)
        assert len(threads) == 1 and threads.pop().startswith(WRITER)
        events = await all_events(event_log)
        assert [e.global_seq for e in events] == list(range(1, 61))
        # Each task's three events are together: one append each, none interleaved.
        assert sorted(finished) == list(range(1, 61, 3))
        assert all(len({e.stream_id for e in events[i : i + 3]}) == 1 for i in range(0, 60, 3))
    finally:
        await event_log.close()
    assert _writers() == []  # closed with its log


@pytest.mark.parametrize(
    ("ids", "named"),
    [
        (["a-1", "b-0"], r"event id 'a-1' is taken \(global sequence 2\)"),  # engine/a's
        (["b-0", "b-0"], r"event id 'b-0' is given twice in the step"),
    ],
)
async def test_a_refused_append_names_the_event_id_leaves_the_log_unchanged_and_the_writer_serving(
    tmp_path: Path, ids: list[str], named: str
) -> None:
    event_log = await open_log(f"sqlite:///{tmp_path / 'log.sqlite'}")
    try:
        await event_log.append([batch("engine/a", 0, pendings("a", 2))])
        with pytest.raises(AppendRejected, match=named):
            # Event ids are unique across the whole log (DESIGN.md, "The log").
            await event_log.append([batch("engine/b", 0, [pending(event_id) for event_id in ids])])
        assert [e.event_id for e in await all_events(event_log)] == ["a-0", "a-1"]
        assert await event_log.stream_version("engine/b") == 0
        [result] = await event_log.append([batch("engine/b", 0, pendings("b", 2))])
        assert (result.first_seq, result.last_seq) == (3, 4)
    finally:
        await event_log.close()


async def test_a_call_cancelled_while_it_runs_still_runs_to_its_end() -> None:
    """As anyio.to_thread.run_sync by default: the caller learns of the cancellation only once
    the call ended, so an append is never left committing while its caller moved on."""
    writer = WriterThread(f"{WRITER} test")
    started, release = threading.Event(), threading.Event()
    ended: list[str] = []

    def slow() -> str:
        started.set()
        release.wait(10)
        ended.append("ended")
        return "done"

    try:
        with anyio.CancelScope() as scope:
            async with anyio.create_task_group() as group:
                group.start_soon(writer.run, slow)
                await anyio.to_thread.run_sync(started.wait, 10)
                scope.cancel()
                await anyio.sleep(0.05)
                assert ended == []  # cancelled, and still waiting for the call
                release.set()
        assert scope.cancelled_caught and ended == ["ended"]
        assert await writer.run(lambda: 41 + 1) == 42  # the thread goes on serving
    finally:
        release.set()
        await writer.close()


async def test_what_a_call_raises_reaches_its_caller_as_raised() -> None:
    writer = WriterThread(f"{WRITER} test")

    def refuses() -> None:
        raise LookupError("no such stream: engine/x")

    try:
        with pytest.raises(LookupError, match="engine/x"):
            await writer.run(refuses)
        assert await writer.run(str.upper, "next") == "NEXT"
    finally:
        await writer.close()
    assert _writers() == []
