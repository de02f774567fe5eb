"""Reading a connection's frames (a length header, then a body) off a byte stream: the sidecar's
and the async client's reader.

Each receive takes whatever has arrived (up to CHUNK bytes), so a frame that arrived whole, as a
step's nearly always does, is read from the socket once, and its header and body are then cut
from the buffer with no more I/O. anyio's `BufferedByteReceiveStream.receive_exactly` asks its
stream for exactly the bytes still missing, and anyio's Unix stream spends a loop iteration (a
checkpoint) and a `recv` on each ask: three of each for every frame the sidecar read (its first
byte, the rest of its header, its body). At an engine's pace every loop iteration costs 2-3x
what it does back to back (ops/bench/README.md, "Where the rest of vLLM's overhead goes").
"""

from __future__ import annotations

import anyio
from anyio.abc import ByteReceiveStream

CHUNK = 65_536
"""The most a receive asks for beyond what the frame being read still needs."""
LARGEST_RECEIVE = 1 << 20
"""The most one receive asks for: a socket returns at most what it holds, but a Unix stream
allocates the whole ask for each `recv`, so a 10 MB frame is read a MiB at a time."""


class FrameReader:
    """A buffered reader of one byte stream; only one task reads it at a time."""

    def __init__(self, stream: ByteReceiveStream) -> None:
        self.stream = stream
        self._buffer = bytearray()

    @property
    def buffered(self) -> int:
        """Bytes received and not yet read."""
        return len(self._buffer)

    async def receive_exactly(self, nbytes: int) -> bytes:
        """The next `nbytes` bytes, waiting as long as it takes. Raises anyio.IncompleteRead when
        the stream ends first (its bytes so far stay unread)."""
        buffer = self._buffer
        while len(buffer) < nbytes:
            missing = nbytes - len(buffer)
            try:
                buffer += await self.stream.receive(min(max(missing, CHUNK), LARGEST_RECEIVE))
            except anyio.EndOfStream as error:
                raise anyio.IncompleteRead from error
        return self._take(nbytes)

    async def receive_within(self, nbytes: int, seconds: float) -> bytes:
        """The next `nbytes` bytes: at once when they have arrived, else within `seconds`
        (TimeoutError: a peer that began a frame and stalls). No timer when nothing is awaited."""
        if len(self._buffer) >= nbytes:
            return self._take(nbytes)
        with anyio.fail_after(seconds):
            return await self.receive_exactly(nbytes)

    def _take(self, nbytes: int) -> bytes:
        taken = bytes(self._buffer[:nbytes])
        del self._buffer[:nbytes]
        return taken
