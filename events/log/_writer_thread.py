"""The one thread a SQLite log's appends run on, one call after another (events/log/_sql.py).

anyio.to_thread.run_sync with a one-slot limiter did the same job at a higher price: each call
acquired the limiter, handed the call to a pooled worker and reported back through anyio's
cancel-scope machinery: an empty call took ~110 us there against ~78 us on a thread of the log's
own, fed by a queue and answering with `call_soon_threadsafe` as aiosqlite's connection thread
does. Together with packing the rows on the loop's thread (`pack_batches`), 300k events appended
256 a step, one append after another, ran at 488-588k events/s against 427-519k (four pairs
alternated, issue 22). Only the writer moves here: reads stay in anyio's pool, so a long read
never queues behind an append or an append behind it.

Like to_thread.run_sync's default, a call is not cancellable once handed over: the caller waits
for it to end and then sees the cancellation, so an append is never left committing unseen.
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

_Call = tuple[contextvars.Context, Callable[..., Any], tuple[Any, ...], asyncio.Future[Any], asyncio.AbstractEventLoop]


class WriterThread:
    """Runs blocking calls on one thread of its own, in the order they were made; started by the
    first call, stopped by `close` (the calls queued before it still run)."""

    def __init__(self, name: str) -> None:
        self._name = name
        self._calls: queue.SimpleQueue[_Call | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._start = threading.Lock()

    async def run(self, func: Callable[..., T], *args: Any) -> T:
        """`func(*args)` on the writer thread; its result, or what it raised."""
        if self._thread is None:
            self._started()
        loop = asyncio.get_running_loop()
        future: asyncio.Future[T] = loop.create_future()
        self._calls.put((contextvars.copy_context(), func, args, future, loop))
        with anyio.CancelScope(shield=True):
            result = await future
        return result

    def _started(self) -> None:
        with self._start:
            if self._thread is None:
                self._thread = threading.Thread(target=self._serve, name=self._name, daemon=True)
                self._thread.start()

    def _serve(self) -> None:
        while (call := self._calls.get()) is not None:
            context, func, args, future, loop = call
            try:
                result = context.run(func, *args)
            except BaseException as error:  # the caller's to handle, whatever it is
                _answer(loop, future, None, error)
            else:
                _answer(loop, future, result, None)

    async def close(self) -> None:
        """Stop the thread once the calls queued before this one ran."""
        with self._start:
            thread, self._thread = self._thread, None
        if thread is not None:
            self._calls.put(None)
            await anyio.to_thread.run_sync(thread.join)


def _answer(loop: asyncio.AbstractEventLoop, future: asyncio.Future[Any], result: Any, error: BaseException | None) -> None:
    def settle() -> None:
        if future.done():
            # Cancelled by the loop itself (asyncio.run cancels what is left as it ends), which
            # anyio's shield does not hold off.
            return
        if error is None:
            future.set_result(result)
        else:
            future.set_exception(error)

    try:
        loop.call_soon_threadsafe(settle)
    except RuntimeError:
        # The loop closed while the call ran (a process going down): nobody is waiting any more.
        pass
