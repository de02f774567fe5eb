"""The frame reader (coordinator/frames.py) on a real Unix socket pair: a frame that arrived whole
costs one receive, however it is cut into header and body; frames in pieces, stalls, a stream
that ends mid-frame and frames larger than one receive all read as anyio's reader read them."""

from __future__ import annotations

import socket

import anyio
import pytest
from anyio.abc import ByteReceiveStream, UNIXSocketStream

from coordinator.frames import CHUNK, LARGEST_RECEIVE, FrameReader
from coordinator.sidecar import protocol as p

pytestmark = pytest.mark.anyio


class Counted(ByteReceiveStream):
    """The real stream, its receives counted and their asks kept."""

    def __init__(self, stream: UNIXSocketStream) -> None:
        self.stream = stream
        self.asks: list[int] = []

    async def receive(self, max_bytes: int = 65536) -> bytes:
        self.asks.append(max_bytes)
        return await self.stream.receive(max_bytes)

    async def aclose(self) -> None:
        await self.stream.aclose()


async def _pair() -> tuple[socket.socket, Counted]:
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    theirs.setblocking(False)
    return ours, Counted(await UNIXSocketStream.from_socket(theirs))


def _frame(body: bytes) -> bytes:
    return len(body).to_bytes(p.HEADER_BYTES, "big") + body


async def _read_frame(reader: FrameReader, seconds: float = 5.0) -> bytes:
    """As the sidecar reads one: its first byte (waiting for ever), its header's rest, its body."""
    first = await reader.receive_exactly(1)
    header = first + await reader.receive_within(p.HEADER_BYTES - 1, seconds)
    return await reader.receive_within(int.from_bytes(header, "big"), seconds)


async def test_frames_that_arrived_whole_are_read_with_one_receive() -> None:
    sender, stream = await _pair()
    reader = FrameReader(stream)
    sender.sendall(_frame(b"step one") + _frame(b"step two, longer"))
    assert await _read_frame(reader) == b"step one"
    assert await _read_frame(reader) == b"step two, longer"
    assert stream.asks == [CHUNK]  # anyio's reader asked three times a frame: 1 byte, the header's rest, the body
    assert reader.buffered == 0
    sender.close()
    await stream.aclose()


async def test_a_frame_in_pieces_is_put_together() -> None:
    sender, stream = await _pair()
    reader = FrameReader(stream)
    frame = _frame(bytes(range(256)) * 40)
    async with anyio.create_task_group() as group:

        async def trickle() -> None:
            for start in range(0, len(frame), 1000):
                sender.sendall(frame[start : start + 1000])
                await anyio.sleep(0.002)

        group.start_soon(trickle)
        assert await _read_frame(reader) == bytes(range(256)) * 40
    sender.close()
    await stream.aclose()


async def test_a_frame_that_stalls_times_out_and_one_that_ends_is_incomplete() -> None:
    sender, stream = await _pair()
    reader = FrameReader(stream)
    sender.sendall(_frame(b"0123456789")[:-4])  # the header and six bytes of ten
    first = await reader.receive_exactly(1)
    header = first + await reader.receive_within(p.HEADER_BYTES - 1, 1.0)
    with pytest.raises(TimeoutError):
        await reader.receive_within(int.from_bytes(header, "big"), 0.1)
    assert reader.buffered == 6  # nothing received is lost to the timeout
    sender.close()
    with pytest.raises(anyio.IncompleteRead):
        await reader.receive_exactly(10)
    await stream.aclose()


async def test_a_frame_larger_than_one_receive_is_read_a_bounded_ask_at_a_time() -> None:
    sender, stream = await _pair()
    reader = FrameReader(stream)
    body = bytes(range(251)) * 20_000  # ~5 MB
    async with anyio.create_task_group() as group:

        async def send() -> None:
            await anyio.to_thread.run_sync(sender.sendall, _frame(body))

        group.start_soon(send)
        assert await _read_frame(reader, 30.0) == body
    assert max(stream.asks) == LARGEST_RECEIVE
    sender.close()
    await stream.aclose()
