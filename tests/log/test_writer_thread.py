"""A SQLite log's appends run on a thread of the log's own (events/log/_writer_thread.py): one
at a time, in order, never on the event loop (STYLE 10), and a cancelled caller still waits for
the call it gave, as with anyio's worker threads."""

from __future__ import annotations

import contextvars
import threading
import time
from pathlib import Path

import anyio
import pytest

from events.log import SqlEventLog, open_log
from events.log._writer_thread import WriterThread
from tests.kit.log_writer import append_steps

pytestmark = pytest.mark.anyio

NAME = "kvledger-append test"


async def test_calls_run_in_order_on_one_thread_that_is_not_the_loops() -> None:
    writer = WriterThread(NAME)
    seen: list[tuple[int, str]] = []

    def record(index: int) -> int:
        seen.append((index, threading.current_thread().name))
        return index * 10

    async with anyio.create_task_group() as group:
        results: dict[int, int] = {}

        async def call(index: int) -> None:
            results[index] = await writer.run(record, index)

        for index in range(50):
            group.start_soon(call, index)
    await writer.close()
    assert results == {index: index * 10 for index in range(50)}
    assert sorted(seen) == [(index, NAME) for index in range(50)]  # each once, all on the writer
    assert NAME != threading.current_thread().name


async def test_an_error_reaches_its_caller_and_the_thread_goes_on() -> None:
    writer = WriterThread(NAME)

    def fail() -> None:
        raise LookupError("no such row")

    with pytest.raises(LookupError, match="no such row"):
        await writer.run(fail)
    assert await writer.run(lambda: "still serving") == "still serving"
    await writer.close()


async def test_a_cancelled_caller_waits_for_its_call_to_finish() -> None:
    """anyio's default for worker threads: a call is never abandoned, so an append that
    committed is never taken for one that did not run."""
    writer = WriterThread(NAME)
    finished = threading.Event()

    def slow() -> str:
        time.sleep(0.3)
        finished.set()
        return "committed"

    with anyio.CancelScope() as scope:
        scope.deadline = anyio.current_time() + 0.05
        result = await writer.run(slow)
    assert finished.is_set()  # the scope's cancellation waited for the call
    assert result == "committed"  # and the caller got its result (anyio delivers the cancel later)
    await writer.close()


async def test_a_call_sees_its_callers_context() -> None:
    """structlog's bound context (contextvars) goes with the call, as with anyio's to_thread."""
    bound: contextvars.ContextVar[str] = contextvars.ContextVar("bound", default="unbound")
    writer = WriterThread(NAME)
    bound.set("engine-a")
    assert await writer.run(bound.get) == "engine-a"
    await writer.close()


async def test_close_ends_the_thread_after_the_calls_before_it_and_refuses_more() -> None:
    name = "kvledger-append closing"  # its own: a thread another test left running would not count
    writer = WriterThread(name)
    done: list[int] = []
    async with anyio.create_task_group() as group:
        for index in range(5):
            group.start_soon(writer.run, done.append, index)
        await anyio.sleep(0)
    await writer.close()
    assert done == [0, 1, 2, 3, 4]
    assert [thread for thread in threading.enumerate() if thread.name == name] == []
    with pytest.raises(RuntimeError, match=f"{name} is closed"):
        await writer.run(done.append, 5)
    assert done == [0, 1, 2, 3, 4]


async def test_a_sqlite_logs_appends_run_on_its_own_thread_and_it_ends_with_the_log(tmp_path: Path) -> None:
    event_log = await open_log(f"sqlite:///{tmp_path / 'log.sqlite'}")
    assert isinstance(event_log, SqlEventLog) and event_log.blocking_engine is not None
    appended_on: list[str] = []
    original = event_log._append_blocking

    def traced(*args: object) -> object:
        appended_on.append(threading.current_thread().name)
        return original(*args)  # type: ignore[arg-type]

    event_log._append_blocking = traced  # type: ignore[method-assign,assignment]
    try:
        await append_steps(event_log, "engine/a", 20, 4)
        assert await event_log.head() == 80
    finally:
        await event_log.close()
    name = appended_on[0]
    assert name.startswith("kvledger-append") and str(tmp_path) in name
    assert appended_on == [name] * 20
    assert [thread for thread in threading.enumerate() if thread.name == name] == []
