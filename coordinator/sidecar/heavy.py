"""The heavy lane: reads that cost far more than a step, taken in turns and within a share of time.

A heavy read is a subscriber's catch-up batch (read from the log and decoded), a long Lookup's
hashing, or a large frame's decoding. Each runs in a worker thread, yet holds the GIL for most
of its time (msgspec decodes in one C call), so while it runs the event loop, and every engine's
step, waits. The lane bounds that:

* one heavy read at a time, sidecar-wide, and the credentials that wait take turns (a
  credential's next read waits for the slot only once its read before is done; the slot is
  first come, first served), so a tenant with twenty catch-ups in flight delays another
  tenant's one by at most the read that runs;
* after a read that took `d` seconds, its credential takes no further turn for
  `d * (1 / share - 1)` while another credential is being served (sent a frame within
  ACTIVE_WINDOW): its heavy reads get at most `share` of the time beside the others' work. A
  credential alone is never held back: nobody is waiting for it.

ops/bench/hostile.py (every attack of issue 17, one attacking credential) measured a legitimate
engine's step p99 under attack at 13-21 ms when heavy reads took half the time (each followed by
as long idle, and served in arrival order), 8-14 ms at a quarter, 7.6-12 ms at a tenth; alone it
was 3-5 ms. Pure scheduling: no I/O of its own.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

import anyio

HEAVY_SHARE = 0.1
"""Of the time, what one credential's heavy reads may take while another credential is served."""
ACTIVE_WINDOW = 0.25
"""Seconds since its last frame during which a credential counts as being served."""
MAX_SEEN = 4096
"""Credentials seen recently held before the stale ones are pruned (without a credentials file
each engine id is one)."""
REST_SLICE = 0.01
"""Seconds a resting credential sleeps before it looks again whether anyone else is served."""


class _Credential:
    __slots__ = ("queue", "rest_until", "users")

    def __init__(self) -> None:
        self.queue = anyio.Lock()
        """Held by the credential's read that waits for the slot or runs: its others wait here."""
        self.rest_until = 0.0
        self.users = 0


class HeavyLane:
    def __init__(
        self, share: float = HEAVY_SHARE, window: float = ACTIVE_WINDOW, clock: Callable[[], float] = time.monotonic
    ) -> None:
        if not 0 < share <= 1:
            raise ValueError(f"a heavy share is a fraction of the time in (0, 1], not {share}")
        self.share = share
        self.window = window
        self.clock = clock
        self._slot = anyio.Lock()
        self._credentials: dict[str, _Credential] = {}
        self._seen: dict[str, float] = {}
        self.rested = 0.0
        """Seconds credentials have rested in all (a figure for tests and metrics)."""

    def saw(self, who: str) -> None:
        """`who` sent a frame now: it is being served (a reason for others' heavy reads to rest)."""
        self._seen[who] = self.clock()
        if len(self._seen) > MAX_SEEN:  # many engines, no heavy read to prune them meanwhile
            self._prune()

    def others_served(self, who: str) -> bool:
        """Whether a credential other than `who` sent a frame within the window."""
        self._prune()
        return any(key != who for key in self._seen)

    def _prune(self) -> None:
        since = self.clock() - self.window
        for key in [key for key, seen in self._seen.items() if seen < since]:
            del self._seen[key]

    @asynccontextmanager
    async def turn(self, who: str) -> AsyncIterator[None]:
        """One heavy read of `who`: waits for its credential's turn (and rest), then for the slot."""
        credential = self._credentials.get(who)
        if credential is None:
            credential = self._credentials[who] = _Credential()
        credential.users += 1
        try:
            async with credential.queue:
                await self._rest(who, credential)
                async with self._slot:
                    started = self.clock()
                    try:
                        yield
                    finally:
                        credential.rest_until = self.clock() + (self.clock() - started) * (1 / self.share - 1)
        finally:
            credential.users -= 1
            if credential.users == 0 and credential.rest_until <= self.clock():
                del self._credentials[who]

    async def _rest(self, who: str, credential: _Credential) -> None:
        while True:
            left = credential.rest_until - self.clock()
            if left <= 0 or not self.others_served(who):
                return
            nap = min(left, REST_SLICE)
            await anyio.sleep(nap)
            self.rested += nap
