"""Fan-out of committed decisions to worker subscriptions, each with a bounded buffer.

A subscription first catches up from the log (everything committed after its `from_seq` up to
the hub's high-water mark when it registered), then takes live decisions, which the committer
publishes right after each commit. Registration and publication both run on the event loop
without awaiting in between, so the handover has no gap and no repeat. A subscription whose
buffer fills is closed with the sequence it can resume from; the others are not slowed.
"""

from __future__ import annotations

from collections import deque
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any, TypeVar

import anyio
import structlog

from coordinator.core.routing import DECISION_TYPES, Decision, decisions_for
from coordinator.core.step import engine_stream
from coordinator.sidecar.heavy import HeavyLane
from coordinator.sidecar.memory import give_back_free_memory
from events import Event, EventCodec
from events.log import EventLog, StoredStep
from events.log.reading import decode_step, stored_steps

log = structlog.get_logger("kvledger.hub")
T = TypeVar("T")

CATCH_UP_STEPS = 64
"""Steps of its engine's stream a catch-up reads and decodes at a time (in a worker thread): a
32-command step is ~40 events."""
DEFAULT_BUFFER = 10_000
"""Decisions a subscription may hold undelivered before it is cut off."""
SEND_GRACE = 5.0
"""Seconds a send already blocked on a subscriber that stopped reading may still take once its
buffer is full; then the connection is cut (it cannot take an Error frame either)."""


class SlowSubscriber(Exception):
    def __init__(self, resume_from: int, capacity: int) -> None:
        super().__init__(f"subscriber fell {capacity} decisions behind; resume from sequence {resume_from}")
        self.resume_from = resume_from


class Subscription:
    def __init__(self, engine_id: str, rank: int, from_seq: int, registered_at: int, capacity: int, who: str = "") -> None:
        self.engine_id = engine_id
        self.rank = rank
        self.who = who
        """Whose heavy-lane turns its catch-up takes (its connection's credential)."""
        self.from_seq = from_seq
        self.registered_at = registered_at
        """Decisions up to this sequence come from the log; later ones from `offer`."""
        self.capacity = capacity
        self.delivered = from_seq
        """The last sequence handed to the connection."""
        self._pending: deque[Decision] = deque()
        self._wake = anyio.Event()
        self.overflowed = False
        self.send_scope: anyio.CancelScope | None = None
        """The send in progress, if any: an overflow gives it SEND_GRACE more seconds."""

    def offer(self, decisions: list[Decision]) -> None:
        if self.overflowed:
            return
        if len(self._pending) + len(decisions) > self.capacity:
            self.overflowed = True
            self._pending.clear()
            if self.send_scope is not None:  # the peer stopped reading: do not wait on it forever
                self.send_scope.deadline = min(self.send_scope.deadline, anyio.current_time() + SEND_GRACE)
        else:
            self._pending.extend(decisions)
        self._wake.set()

    async def live(self) -> list[Decision]:
        """The next live decisions; raises SlowSubscriber once the buffer overflowed."""
        while not self._pending and not self.overflowed:
            await self._wake.wait()
            self._wake = anyio.Event()
        if self.overflowed:
            raise SlowSubscriber(self.delivered, self.capacity)
        items = [d for d in self._pending if d.seq > self.delivered]
        self._pending.clear()
        return items


class DecisionHub:
    def __init__(self, event_log: EventLog, codec: EventCodec, last_seq: int, capacity: int = DEFAULT_BUFFER) -> None:
        self.log = event_log
        self.codec = codec
        self.last_seq = last_seq
        """The highest committed sequence published so far."""
        self.capacity = capacity
        self.subscriptions: set[Subscription] = set()
        self.heavy_lane = HeavyLane()
        """Catch-up batches, long lookups' hashing, large frames' decoding (server.py) take turns
        in it (coordinator/sidecar/heavy.py)."""

    def register(self, engine_id: str, rank: int, from_seq: int, who: str = "") -> Subscription:
        subscription = Subscription(engine_id, rank, from_seq, self.last_seq, self.capacity, who)
        self.subscriptions.add(subscription)
        return subscription

    def unregister(self, subscription: Subscription) -> None:
        self.subscriptions.discard(subscription)

    def publish(self, commits: list[tuple[list[Event], int]], last_seq: int) -> None:
        """After a commit: offer each subscription its decisions among (events, first_seq), those
        after the last published sequence only: a commit that `publish_from_log` published
        already (after a failed append, groups that landed behind it) is not offered twice."""
        if self.subscriptions:
            # The decisions among the events, found once (most commits hold none), then each
            # subscription's among them: not every event once per subscription.
            published = self.last_seq
            found = [
                (first + index, event)
                for events, first in commits
                for index, event in enumerate(events)
                if isinstance(event, DECISION_TYPES) and first + index > published
            ]
            if found:
                engines = {event.engine_id for _, event in found}
                for subscription in self.subscriptions:
                    if subscription.engine_id not in engines:
                        continue
                    decisions = [
                        d for seq, event in found for d in decisions_for([event], seq, subscription.engine_id, subscription.rank)
                    ]
                    if decisions:
                        subscription.offer(decisions)
        self.last_seq = max(self.last_seq, last_seq)

    async def publish_from_log(self, until: int, *, quiet: bool = False) -> None:
        """Publish what the log committed after the last published sequence, up to `until`: for
        a group whose append landed although the commit call then failed (its waiters got an
        error, and a retry is answered as a duplicate, which is never published); `quiet` for
        what other writers appended (the sidecar's follower: nothing went wrong)."""
        if until <= self.last_seq:
            return
        commits: list[tuple[list[Event], int]] = []
        async for steps in stored_steps(self.log, self.last_seq, until):
            for step in steps:
                after = max(self.last_seq, step.first_seq - 1)
                commits.append((decode_step(self.codec, step, after), after + 1))
        (log.debug if quiet else log.warning)("published_from_log", after_seq=self.last_seq, until_seq=until, steps=len(commits))
        self.publish(commits, until)

    async def stream(self, subscription: Subscription) -> AsyncIterator[list[Decision]]:
        """Every decision for the subscription after its from_seq, in order, forever."""
        async for decisions in self._catch_up(subscription):
            yield decisions
        while True:
            decisions = await subscription.live()
            if decisions:
                yield decisions

    async def _catch_up(self, subscription: Subscription) -> AsyncIterator[list[Decision]]:
        """What the log holds for the subscription up to its registration, CATCH_UP_STEPS steps of
        its engine's stream at a time, each batch read and decoded off the event loop, one
        catch-up at a time (the heavy lane). A Subscribe(from_seq=0) decoded the whole log on the
        loop, and 20 of them pushed another engine's step p99 past 50 ms; read off the loop but
        whole, every stream's steps, they still held it ~2x (issue 17): a worker's catch-up now
        reads its own engine's steps only (EventLog.read_stream_steps), and one of an engine
        with no steps reads nothing."""
        stream = engine_stream(subscription.engine_id)
        last, until = subscription.from_seq, subscription.registered_at
        while last < until:
            async with self.heavy_turn(subscription.who):
                steps = [
                    step for step in await self.log.read_stream_steps(stream, last, CATCH_UP_STEPS) if step.first_seq <= until
                ]
                if not steps:
                    return
                decisions = await anyio.to_thread.run_sync(self._decisions_in, steps, subscription, last)
            last = steps[-1].last_seq
            if decisions:
                yield decisions

    async def heavy(self, who: str, work: Callable[..., T], *args: Any) -> T:
        """`work(*args)` in a worker thread, as a heavy read of credential `who` (`heavy_turn`)."""
        async with self.heavy_turn(who):
            return await anyio.to_thread.run_sync(work, *args)

    @asynccontextmanager
    async def heavy_turn(self, who: str) -> AsyncIterator[None]:
        """One heavy read's turn in the heavy lane (coordinator/sidecar/heavy.py: one at a time,
        credentials in turns, each within a share of the time while others are served). What
        the read freed is given back to the OS before the next (coordinator/sidecar/memory.py)."""
        async with self.heavy_lane.turn(who):
            try:
                yield
            finally:
                with anyio.CancelScope(shield=True):
                    await anyio.to_thread.run_sync(give_back_free_memory)

    def _decisions_in(self, steps: list[StoredStep], subscription: Subscription, after_seq: int) -> list[Decision]:
        # A decision is an event of its engine's own command (StartStore, StartLoad, PlanStateCopy,
        # their external forms), and every command naming an engine is committed to the engine's
        # stream (coordinator.core.step.stream_for): `steps` are that stream's.
        decisions = []
        for step in steps:
            after = max(after_seq, step.first_seq - 1)
            events = decode_step(self.codec, step, after)
            decisions += [
                d
                for d in decisions_for(events, after + 1, subscription.engine_id, subscription.rank)
                if d.seq <= subscription.registered_at
            ]
        return decisions
