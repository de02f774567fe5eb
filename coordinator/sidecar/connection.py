"""One client connection and what its Hello established (Session), the peer's uid as the kernel
recorded it, and a per-second allowance (`PerSecond`) for log lines and refusals."""

from __future__ import annotations

import socket
import struct
import time

import anyio
import anyio.abc
from anyio.abc import ByteStream, SocketStream

from coordinator.sidecar import protocol as p
from coordinator.sidecar.credentials import ALL, Credential


class Session:
    """What a connection's Hello established: its role, and for an engine or a worker, the
    engine and the incarnation it speaks for (0: a worker whose engine was not declared yet)."""

    def __init__(self, role: str, engine_id: str, rank: int, incarnation: int = 0, credential: Credential = ALL) -> None:
        self.credential = credential
        """What let it in (the credentials file's entry, or ALL without one)."""
        self.role = role
        self.engine_id = engine_id
        self.rank = rank
        self.incarnation = incarnation
        self.subscribed = False


class Connection:
    def __init__(self, stream: ByteStream, peer: str, peer_uid: int | None = None) -> None:
        self.stream = stream
        self.peer = peer
        self.peer_uid = peer_uid
        """The Unix socket peer's uid, from the kernel (SO_PEERCRED); None on TCP."""
        self._send_lock = anyio.Lock(fast_acquire=True)
        """fast_acquire: a free lock is taken without a loop iteration; the stream's send still
        yields once, so a busy connection does not hold the loop (coordinator/frames.py says why
        iterations count)."""
        self.engine_id: str | None = None
        """The engine this connection speaks for, once its Hello made it an engine's."""

    async def send(self, message: p.Message) -> None:
        async with self._send_lock:
            await self.stream.send(p.frame(message))


class PerSecond:
    """At most `per_second` of something (a log line, a refusal sent at once) per key and second:
    `take` answers None when this one is over, else how many were over since the last one taken."""

    def __init__(self, per_second: int) -> None:
        self.per_second = per_second
        self._window: dict[str, tuple[int, int, int]] = {}
        """key -> (second, lines logged in it, lines left out since the last logged)."""

    def take(self, key: str) -> int | None:
        second = int(time.monotonic())
        start, logged, left_out = self._window.get(key, (second, 0, 0))
        if start != second:
            start, logged = second, 0
        if logged >= self.per_second:
            self._window[key] = (start, logged, left_out + 1)
            return None
        self._window[key] = (start, logged + 1, 0)
        return left_out

    def over(self, key: str, count: int) -> int:
        """Take `count` at once: how many of them are past this second's `per_second`."""
        second = int(time.monotonic())
        start, taken, left_out = self._window.get(key, (second, 0, 0))
        if start != second:
            start, taken = second, 0
        within = max(0, min(count, self.per_second - taken))
        self._window[key] = (start, taken + count, left_out + count - within)
        return count - within


def peer_uid(stream: SocketStream) -> int | None:
    """The uid of the process at the other end of a Unix socket, as the kernel recorded it when
    it connected (SO_PEERCRED, Linux): a client cannot forge it."""
    try:
        raw: socket.socket = stream.extra(anyio.abc.SocketAttribute.raw_socket)
        _pid, uid, _gid = struct.unpack("3i", raw.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")))
    except (OSError, AttributeError, anyio.TypedAttributeLookupError):
        return None
    return int(uid)
