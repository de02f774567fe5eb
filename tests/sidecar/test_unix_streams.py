"""A read cancelled just as its Unix socket turns readable leaves no error behind
(coordinator/unix_streams.py mends anyio's streams for it)."""

from __future__ import annotations

import asyncio
import socket
from pathlib import Path
from typing import Any

import anyio
import anyio.lowlevel
import pytest

from coordinator import unix_streams

pytestmark = pytest.mark.anyio


async def _cancel_a_read_as_data_arrives(stream: Any, peer: socket.socket) -> list[BaseException | None]:
    """The race: the peer's byte arrives, and in the very loop iteration whose selector saw it,
    another task cancels the pending read."""
    loop = asyncio.get_running_loop()
    errors: list[BaseException | None] = []
    previous = loop.get_exception_handler()
    loop.set_exception_handler(lambda _loop, context: errors.append(context.get("exception")))
    try:
        async with anyio.create_task_group() as tasks:
            tasks.start_soon(stream.receive)
            await anyio.wait_all_tasks_blocked()
            peer.send(b"x")
            await anyio.lowlevel.checkpoint()  # wakes in the iteration that also queues the read's readiness
            tasks.cancel_scope.cancel()
        for _ in range(3):
            await anyio.lowlevel.checkpoint()
    finally:
        loop.set_exception_handler(previous)
    return errors


async def test_a_read_cancelled_as_its_socket_turns_readable_raises_nothing(tmp_path: Path) -> None:
    path = tmp_path / "s.sock"
    listener = await unix_streams.create_unix_listener(path)
    server_side = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    async with listener:
        async with anyio.create_task_group() as tasks:
            accepted: list[Any] = []

            async def accept() -> None:
                accepted.append(await listener.accept())

            tasks.start_soon(accept)
            await anyio.wait_all_tasks_blocked()
            server_side.connect(str(path))
        async with accepted[0] as stream:
            assert await _cancel_a_read_as_data_arrives(stream, server_side) == []
            # The stream still reads: the byte that raced the cancel is there for the next read.
            assert await stream.receive() == b"x"
        server_side.close()


async def test_the_race_is_real_in_anyio_streams_unmended() -> None:
    """Without the mend the same sequence raises InvalidStateError into the loop: the test above
    proves the mend, not a sequence that cannot race."""
    from anyio._backends import _asyncio as backend

    a, b = socket.socketpair(socket.AF_UNIX)
    a.setblocking(False)

    class Unmended(backend.UNIXSocketStream):
        def _wait_until_readable(self, loop: asyncio.AbstractEventLoop) -> asyncio.Future[Any]:
            def forget(_: object) -> None:
                del self._receive_future
                loop.remove_reader(self._raw_socket)

            future: asyncio.Future[Any] = asyncio.Future()
            self._receive_future = future
            loop.add_reader(self._raw_socket, future.set_result, None)  # anyio 4.16's registration
            future.add_done_callback(forget)
            return future

    errors = await _cancel_a_read_as_data_arrives(Unmended(a), b)
    assert [type(e) for e in errors] == [asyncio.InvalidStateError]
    a.close()
    b.close()


async def test_an_accept_cancelled_as_a_client_connects_raises_nothing(tmp_path: Path) -> None:
    """The listener's side of the race (the sidecar stopping while a client connects): the
    accept is cancelled in the loop iteration whose selector saw the connection."""
    path = tmp_path / "l.sock"
    listener = await unix_streams.create_unix_listener(path)
    client = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    loop = asyncio.get_running_loop()
    errors: list[BaseException | None] = []
    previous = loop.get_exception_handler()
    loop.set_exception_handler(lambda _loop, context: errors.append(context.get("exception")))
    try:
        async with listener:
            async with anyio.create_task_group() as tasks:
                tasks.start_soon(listener.accept)
                await anyio.wait_all_tasks_blocked()
                client.connect(str(path))
                await anyio.lowlevel.checkpoint()
                tasks.cancel_scope.cancel()
            for _ in range(3):
                await anyio.lowlevel.checkpoint()
            # The connection that raced the cancel is still there to accept.
            async with await listener.accept():
                pass
    finally:
        loop.set_exception_handler(previous)
        client.close()
    assert errors == []
