"""A thread of a log's own for its appends: blocking calls run there one at a time, in the order
they were given, and the caller awaits each on the event loop (STYLE 10: no SQLite work on it).

anyio's `to_thread.run_sync` hands each call to a worker thread of a shared pool through a
capacity limiter and a cancel scope; that hand-over, there and back, cost an append ~130 us
with no work in it, and more at an engine's pace: after 20 ms of idle, 200 us of work came back
after ~590 us through anyio and ~480 us through one thread of its own (a probe of both, the same
hour). A log's appends are serial anyway (one writer connection, `BEGIN IMMEDIATE`), so one
thread that owns them loses nothing. On an event loop other than asyncio's (the project runs on
asyncio; anyio could run trio) calls go through anyio's pool as before.

Like anyio's default (`abandon_on_cancel=False`), a call cannot be abandoned: a caller cancelled
while its call runs waits for it to return, and the cancellation reaches it afterwards, so a
transaction that committed is never reported as not run.
"""

from __future__ import annotations

import asyncio
import contextvars
import queue
import threading
from collections.abc import Callable
from typing import Any, TypeVar

import anyio

T = TypeVar("T")

_STOP = object()
"""Put on the queue by close(): the thread ends after the calls before it."""


class WriterThread:
    """Runs blocking calls on one thread of its own, started by the first call."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._calls: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._start = threading.Lock()
        self._closed = False

    async def run(self, function: Callable[..., T], *args: Any) -> T:
        """`function(*args)` on this thread, after every call given before it."""
        if self._closed:
            raise RuntimeError(f"{self.name} is closed")
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # not asyncio's loop
            return await anyio.to_thread.run_sync(function, *args)
        self._started()
        future: asyncio.Future[T] = loop.create_future()
        self._calls.put((contextvars.copy_context(), function, args, future))
        with anyio.CancelScope(shield=True):  # as anyio's to_thread: the caller waits for the result
            result = await future
        return result

    def _started(self) -> None:
        if self._thread is None:
            with self._start:
                if self._thread is None:
                    self._thread = threading.Thread(target=self._serve, name=self.name, daemon=True)
                    self._thread.start()

    def _serve(self) -> None:
        while True:
            call = self._calls.get()
            if call is _STOP:
                return
            context, function, args, future = call
            try:
                result = context.run(function, *args)
            except BaseException as error:  # noqa: BLE001 - handed to the caller, whatever it is
                _settle_soon(future, None, error)
            else:
                _settle_soon(future, result, None)
            del call, context, function, args, future  # nothing of a call outlives it here

    async def close(self) -> None:
        """Ends the thread once the calls given before this have run (waits for it off the loop)."""
        self._closed = True
        thread = self._thread
        if thread is None:
            return
        self._calls.put(_STOP)
        await anyio.to_thread.run_sync(thread.join)


def _settle_soon(future: asyncio.Future[Any], result: Any, error: BaseException | None) -> None:
    try:
        future.get_loop().call_soon_threadsafe(_settle, future, result, error)
    except RuntimeError:
        pass  # the loop is closed: nobody waits for this call any more


def _settle(future: asyncio.Future[Any], result: Any, error: BaseException | None) -> None:
    if future.cancelled():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)
