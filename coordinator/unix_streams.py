"""anyio's Unix socket streams, with one race in them mended.

On the asyncio backend a Unix stream waits for its socket with
``loop.add_reader(sock, future.set_result, None)`` and unregisters the reader from the future's
done-callback, which runs one loop iteration later. When a task cancels the read (a timeout, a
connection's task group closing) in the same iteration as the socket turns readable, the
selector has already queued ``future.set_result`` behind the cancelling task: it runs on the
cancelled future and raises ``InvalidStateError`` into the loop's exception handler. Nothing is
lost (the read was cancelled anyway), but the error surfaces as a failure under the anyio test
runner and as a logged traceback in the sidecar. ``tests/sidecar/test_unix_streams.py`` reproduces it.

A Unix listener's accept waits the same way, and races the same way when it is cancelled as a
client connects. anyio 4.16 (the newest release) still has both; the readiness callbacks here set
the result only while the future is pending. Every Unix stream and listener kvledger opens goes
through this module.
"""

from __future__ import annotations

import asyncio
import os
import socket
from typing import Any

import anyio
from anyio._backends import _asyncio as _backend
from anyio.abc import SocketListener, SocketStream


def _set_unless_done(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


def _wait_until_readable(self: Any, loop: asyncio.AbstractEventLoop) -> asyncio.Future[None]:
    raw: socket.socket = self._raw_socket

    def forget(_: object) -> None:
        del self._receive_future
        loop.remove_reader(raw)

    future: asyncio.Future[None] = asyncio.Future()
    self._receive_future = future
    loop.add_reader(raw, _set_unless_done, future)
    future.add_done_callback(forget)
    return future


def _wait_until_writable(self: Any, loop: asyncio.AbstractEventLoop) -> asyncio.Future[None]:
    raw: socket.socket = self._raw_socket

    def forget(_: object) -> None:
        del self._send_future
        loop.remove_writer(raw)

    future: asyncio.Future[None] = asyncio.Future()
    self._send_future = future
    loop.add_writer(raw, _set_unless_done, future)
    future.add_done_callback(forget)
    return future


async def _accept(self: Any) -> SocketStream:
    """anyio 4.16's UNIXSocketListener.accept, its readiness callback guarded the same way (a
    listener closed as a client connects: the sidecar stopping)."""
    await _backend.AsyncIOBackend.checkpoint()
    raw: socket.socket = self._raw_socket
    with self._accept_guard:
        while True:
            try:
                client, _ = raw.accept()
                client.setblocking(False)
                return _backend.UNIXSocketStream(client)
            except BlockingIOError:
                future = self._accept_future = self._loop.create_future()
                self._loop.add_reader(raw, _set_unless_done, future)
                try:
                    await future
                finally:
                    if self._accept_future is future:
                        self._accept_future = None
                        self._loop.remove_reader(raw)
            except OSError as error:
                if self._closed:
                    raise anyio.ClosedResourceError from None
                raise anyio.BrokenResourceError from error


def _mend() -> None:
    mixin = getattr(_backend, "_RawSocketMixin", None)
    listener = getattr(_backend, "UNIXSocketListener", None)
    if mixin is None or not hasattr(mixin, "_wait_until_readable") or listener is None:
        return  # a later anyio laid its streams out anew: nothing of this shape to mend
    mixin._wait_until_readable = _wait_until_readable
    mixin._wait_until_writable = _wait_until_writable
    listener.accept = _accept


_mend()


async def connect_unix(path: str | os.PathLike[str]) -> SocketStream:
    """A connection to the Unix socket at ``path`` (anyio's, mended)."""
    return await anyio.connect_unix(path)


async def create_unix_listener(path: str | os.PathLike[str]) -> SocketListener:
    """A listener on the Unix socket at ``path`` (anyio's; its streams are mended)."""
    return await anyio.create_unix_listener(path)
