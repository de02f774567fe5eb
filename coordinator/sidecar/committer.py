"""Group commit, pipelined: transactions that arrive while a commit is in flight are committed
together, and the next group is decided while the previous one is being appended.

Connections submit transactions and wait; one task takes everything queued (up to a limit),
decides it (`Ledger.decide_group`) on top of the group whose append is in flight, then waits for
that append, publishes its decisions and wakes its waiters, and only then starts appending the
new group. So the log is busy while the core decides, yet nothing reaches an engine or a worker
before its group is durable. If an append fails, its waiters get the error, the ledger rebuilds
from the log, and the group decided on top of it is superseded and decided again.

On a log that takes several appends in flight (Kafka: `Ledger.pipelines`), up to
`appends_in_flight` groups travel at once: a group is decided and handed to the log as soon as
its transactions are taken, behind the groups still travelling (the log keeps them in that order
and refuses one decided on a refused one), and the next waits only until it is queued there.
Groups are still answered one after the other in the order they were decided, each once its own
append returned: a group whose append fails fails its waiters; the groups behind it that the log
refused for it are superseded and decided again, in their order, before anything taken later; one
the log took all the same is committed and answered. On SQLite an append is one synchronous
transaction, and one group travels at a time.

There is no timer for transactions: under light load a group is one transaction and waits for
nothing; under load the groups grow by themselves. On a log that takes one append at a time
(SQL), a transaction (or batch) that finds the committer idle (nothing queued, nothing in flight,
its task parked) does not hand itself over: its own task leads, deciding, appending and answering
its group as the committer would (`_lead`). Once decided it is a group in flight like any other:
what comes meanwhile is decided on top of it by the committer, which then answers both in order.
A step at an engine's pace is spared four hand-overs between tasks (to the committer, to an
append task, back to the committer, back to the connection); under load the committer is seldom
idle, and the groups go through it as before. A waiter that goes away does not cancel its
commit, so a client that reconnects and retries its command id gets the committed result.

Records of reads (`record`: the lookups the sidecar answered at once, from the committed state)
ride along: each group carries those queued before it, and when no transaction comes within
RECORD_DELAY they are committed alone. While the log is down they wait (at most MAX_RECORDS;
past that the oldest are dropped and counted, never silently).
"""

from __future__ import annotations

import gc
import math
import time
from collections import deque
from collections.abc import Sequence

import anyio
import structlog

from coordinator.ledger.ledger import (
    HEAD_MOVED_ATTEMPTS,
    Commit,
    DecidedGroup,
    DecideFailed,
    Ledger,
    Recorded,
    Step,
    StepCommit,
    Submission,
    Superseded,
    Transaction,
)
from coordinator.sidecar.hub import DecisionHub
from coordinator.sidecar.metrics import SidecarMetrics
from events import Event, ExternalKeysLookedUp
from events.log import HeadMoved

log = structlog.get_logger("kvledger.committer")

MAX_GROUP = 64
MAX_GROUP_WORK = 512
"""Commands a group holds (a Step counts its commands, anything else one), beyond its first
transaction: a group is decided whole before the next, so a queue of large steps (one engine's,
or several) would hold every other engine's small step behind all of them. A transaction too
large for what is left waits for the next group, which it begins; smaller ones behind it, of
other engines, go on (issue 17: one engine's large step delays another's small one by at most
one group)."""
SMALL_ROOM = 128
"""Commands a group always has room for beside its first transaction, however large that is."""
RECORD_DELAY = 0.05
"""Seconds queued records wait for a group to ride with before they are committed alone."""
MAX_RECORDS = 100_000
"""Records held while the log does not take them; past this the oldest are dropped (and counted)."""
MAX_RECORD_KEYS = 1_000_000
"""Keys those records may name in all (a lookup names up to 65,536): about 50 MB at most."""
MAX_RECORDS_PER_GROUP = 8_192
APPENDS_IN_FLIGHT = 4
"""Groups whose appends may travel at once on a log that pipelines (ServeConfig.appends_in_flight)."""
RECORD_RETRY_MAX = 2.0
"""The longest wait before records alone are tried again on a log that refused them."""


class ShuttingDown(Exception):
    """The sidecar is draining: it takes no new transactions."""


class NotCommitted(Exception):
    """A transaction of a batch left uncommitted because one before it failed."""


class _Waiter:
    __slots__ = ("tx", "batch", "done", "result", "error", "moved")

    def __init__(self, tx: Submission, batch: object | None = None) -> None:
        self.tx = tx
        self.batch = batch
        """The submit_all call it came with: a batch is committed in one group, in its order."""
        self.done = anyio.Event()
        self.result: StepCommit | Commit | None = None
        self.error: BaseException | None = None
        self.moved = 0
        """How often its group was refused because another writer appended first (HeadMoved)."""


class _InFlight:
    """A decided group and its append, running in a task of its own."""

    __slots__ = ("waiters", "records", "decided", "queued", "landed", "results", "error", "started")

    def __init__(self, waiters: list[_Waiter], records: list[tuple[str, Event]], decided: DecidedGroup, started: float) -> None:
        self.waiters = waiters
        self.records = records
        self.decided = decided
        self.queued = anyio.Event()
        """Its append is queued in the log (or ended): the next group's may go behind it."""
        self.landed = anyio.Event()
        self.results: list[StepCommit | Commit] | None = None
        self.error: BaseException | None = None
        self.started = started


class Committer:
    def __init__(
        self,
        ledger: Ledger,
        hub: DecisionHub,
        metrics: SidecarMetrics,
        max_group: int = MAX_GROUP,
        appends_in_flight: int = APPENDS_IN_FLIGHT,
    ) -> None:
        self.ledger = ledger
        self.hub = hub
        self.metrics = metrics
        self.max_group = max_group
        self.appends_in_flight = max(1, appends_in_flight) if ledger.pipelines else 1
        """Groups whose appends travel at once: 1 on a log that does not pipeline (SQL)."""
        self._flights: deque[_InFlight] = deque()
        """The groups decided and handed to their append tasks, not yet answered, oldest first."""
        self._back_in_line = 0
        """Waiters put back at the head of the queue since the last take: the next go behind them."""
        self._records_back = 0
        """Records put back at the head of theirs since the last take (likewise)."""
        self._queue: deque[_Waiter] = deque()
        self._records: deque[tuple[str, Event]] = deque()
        self._wake = anyio.Event()
        self._snapshot_wake = anyio.Event()
        self._closing = False
        self._parked = False
        """The committer's task waits in `_wait` (for a transaction, a record's delay, an append)."""
        self._leading = False
        """A submitter's task is deciding, appending and answering a group of its own (`_lead`)."""
        self._deciding = False
        """... and is deciding it: the committer takes nothing meanwhile."""
        self._record_delay = RECORD_DELAY
        """How long records wait alone before they are committed: doubles while the log refuses them."""
        self._records_due = False
        self._records_offered = 0
        self._record_keys = 0
        """Keys the queued records name (bounded by MAX_RECORD_KEYS)."""
        """Records taken into a group whose append has not returned."""
        self._dropping = False
        self.failure: str | None = None
        """Why the log stopped taking appends, if it did: readiness reports it."""

    async def submit(self, tx: Submission) -> StepCommit | Commit:
        """Commit one transaction (with whatever else is queued) and return its result."""
        if self._closing:
            raise ShuttingDown("the sidecar is shutting down; retry against the restarted one")
        waiter = _Waiter(tx)
        await self._commit([waiter])
        if waiter.error is not None:
            raise waiter.error
        assert waiter.result is not None
        return waiter.result

    async def submit_all(self, txs: Sequence[Submission]) -> list[StepCommit | Commit]:
        """Commit several transactions in their order (queued together: one group, or consecutive
        groups), and return their results; raises the first error any of them got, after all are
        answered (a retry with the same command ids then gets what was committed)."""
        if self._closing:
            raise ShuttingDown("the sidecar is shutting down; retry against the restarted one")
        batch = object()
        waiters = [_Waiter(tx, batch) for tx in txs]
        await self._commit(waiters)
        for waiter in waiters:
            if waiter.error is not None:
                raise waiter.error
        return [waiter.result for waiter in waiters if waiter.result is not None]

    async def _commit(self, waiters: list[_Waiter]) -> None:
        """Lead the waiters' group when the committer is idle, else queue them for it; return
        once every one is answered."""
        with anyio.CancelScope(shield=True):
            # Leaving early would not undo the commit; wait so the result is never lost.
            if self._idle():
                await self._lead(waiters)
            else:
                self._queue.extend(waiters)
                self._wake.set()
            for waiter in waiters:
                if not waiter.done.is_set():  # a wait on a set event still takes a loop iteration
                    await waiter.done.wait()

    def _idle(self) -> bool:
        """Nothing queued, in flight or led, and the committer's task parked in `_wait` (not
        between taking a group and publishing it), on a log that takes one append at a time: a
        group decided now goes first, and the committer can decide the next on top of it."""
        return (
            self._parked
            and self.appends_in_flight == 1
            and not self._leading
            and not self._queue
            and not self._flights
            and not self._closing
        )

    async def _lead(self, waiters: list[_Waiter]) -> None:
        """Decide, append and answer one group in the caller's task, as the committer's loop
        would (records queued ride along). While it is decided the committer takes nothing
        (`_run` waits while `_deciding`); then it is a group in flight like any other, so a
        transaction that comes meanwhile is decided on top of it by the committer, which then
        answers this group itself (it comes first in `_flights`). A waiter put back in line (a
        superseded or overtaken group) is the committer's from there."""
        self._leading = self._deciding = True
        try:
            try:
                flight = await self._decide(waiters, self._take_records(True))
            finally:
                self._deciding = False
            if flight is None:
                return
            self._flights.append(flight)
            if self._queue:  # came while this was decided: the committer decides it on top
                self._wake.set()
            await self._append(flight, wake=False)
            if self._flights and self._flights[0] is flight:  # else the committer took it to answer
                self._flights.popleft()
                await self._finish(flight)
        finally:
            self._leading = False
            if self._queue or self._closing:
                self._wake.set()

    def record(self, stream_id: str, event: Event) -> None:
        """Append a read's record with a later group; never waits (the log may be down)."""
        self._records.append((stream_id, event))
        self._record_keys += _keys_of(event)
        self._bound_records()
        if len(self._records) == 1:
            self._wake.set()

    def close(self) -> None:
        """Take no new transactions; `run` returns once the queue (and the records) are committed."""
        self._closing = True
        self._wake.set()

    async def run(self) -> None:
        try:
            async with anyio.create_task_group() as saving:
                saving.start_soon(self._save_snapshots)
                try:
                    await self._run()
                finally:
                    saving.cancel_scope.cancel()  # a snapshot is a cache: the ledger writes one at close
        finally:
            # Cancelled at a drain timeout, or failed: whoever is still queued or in flight gets an answer.
            self._closing = True
            while self._flights:
                for waiter in self._flights.popleft().waiters:
                    if waiter.result is None and waiter.error is None:
                        waiter.error = ShuttingDown(
                            "the sidecar stopped before this commit finished; retry it with its command id"
                        )
                    waiter.done.set()
            while self._queue:
                waiter = self._queue.popleft()
                waiter.error = ShuttingDown("the sidecar stopped before this commit; retry it with its command id")
                waiter.done.set()
            if self._records:
                self._lost(len(self._records), "the sidecar stopped before the log took them")
                self._records.clear()
                self._record_keys = 0
                self._count_pending()

    async def _save_snapshots(self) -> None:
        """Write each snapshot a commit left due, beside the commits: no step waits for it."""
        while True:
            await self._snapshot_wake.wait()
            self._snapshot_wake = anyio.Event()
            await self.ledger.save_due_snapshot()
            freeze_long_lived()

    async def _run(self) -> None:
        flights = self._flights
        async with anyio.create_task_group() as appends:
            while True:
                # Answered in the order they were decided. Once a group went back in line (its
                # append was superseded or moved), every group behind it is answered (or put back
                # behind it) before anything is taken again: they keep their order.
                while flights and (flights[0].landed.is_set() or self._putting_back):
                    await self._finish(flights.popleft())
                if self._deciding:  # a submitter decides a group it leads: nothing is taken meanwhile
                    await self._wait()
                    continue
                waiters = self._take(flights)
                records = self._take_records(bool(waiters) or self._closing or self._records_due)
                if not waiters and not records:
                    if not flights and self._closing and not self._queue and not self._records and not self._leading:
                        return
                    await self._wait()  # for a transaction, a record's delay, or an append in flight
                    continue
                decided = await self._decide(waiters, records)
                while len(flights) >= self.appends_in_flight:
                    await self._finish(flights.popleft())  # its waiters are answered before the next append begins
                if decided is not None:
                    flights.append(decided)
                    appends.start_soon(self._append, decided)
                    if self.appends_in_flight > 1:
                        await decided.queued.wait()  # the next group's append goes behind this one's

    @property
    def _putting_back(self) -> bool:
        """Something of a group in flight went back in line since the last take, and more than
        one group travels at once: the groups behind it are answered first (with one, none is)."""
        return self.appends_in_flight > 1 and bool(self._back_in_line or self._records_back)

    def _take(self, flights: Sequence[_InFlight]) -> list[_Waiter]:
        """The next group (`take_fairly`), taken out of the queue."""
        self._back_in_line = self._records_back = 0
        busy = {w.tx.command_id for flight in flights for w in flight.waiters}
        group = take_fairly(list(self._queue), busy, self.max_group)
        if group:
            chosen = {id(waiter) for waiter in group}
            self._queue = deque(waiter for waiter in self._queue if id(waiter) not in chosen)
        return group

    def _take_records(self, take: bool) -> list[tuple[str, Event]]:
        if not take or not self._records:
            return []
        self._records_due = False
        count = min(len(self._records), MAX_RECORDS_PER_GROUP)
        records = [self._records.popleft() for _ in range(count)]
        self._record_keys -= sum(_keys_of(event) for _, event in records)
        self._records_offered += count
        return records

    def _put_back(self, records: list[tuple[str, Event]], *, in_flight: bool = True) -> None:
        """Records of a group the log did not take: first in line again (within MAX_RECORDS),
        unless the sidecar is stopping (then they are counted lost: the log is not coming back).
        Oldest first: a group in flight's go behind those of the groups before it put back since
        the last take, and in front of the group being decided's (`in_flight=False`), younger."""
        self._records_offered -= len(records)
        if self._closing:
            self._lost(len(records), "the sidecar stopped while the log refused them")
            self._count_pending()
            return
        back = min(self._records_back, len(self._records))
        self._records.rotate(-back)
        self._records.extendleft(reversed(records))
        self._records.rotate(back)
        if in_flight:
            self._records_back = back + len(records)
        self._record_keys += sum(_keys_of(event) for _, event in records)
        self._bound_records()

    def _in_line_again(self, waiters: list[_Waiter]) -> None:
        """Waiters of a group to decide again: first in line, behind those of groups before it
        put back since the last take (several groups may travel at once)."""
        self._queue.rotate(-self._back_in_line)
        self._queue.extendleft(reversed(waiters))
        self._queue.rotate(self._back_in_line)
        self._back_in_line += len(waiters)

    def _bound_records(self) -> None:
        over = 0
        while self._records and (len(self._records) > MAX_RECORDS or self._record_keys > MAX_RECORD_KEYS):
            _, event = self._records.popleft()
            self._record_keys -= _keys_of(event)
            over += 1
        if over:
            self._lost(
                over,
                f"the log has not taken records for too long (holding at most {MAX_RECORDS:,} "
                f"records of {MAX_RECORD_KEYS:,} keys)",
            )
        self._count_pending()

    def _count_pending(self) -> None:
        self.metrics.records_pending.set(len(self._records) + self._records_offered)

    def _lost(self, count: int, reason: str) -> None:
        self.metrics.records_lost.inc(count)
        if not self._dropping:  # the first of an outage is worth a line; the metric counts them all
            self._dropping = True
            log.error("lookup_records_dropped", records=count, reason=reason)

    async def _wait(self) -> None:
        """Until a transaction comes, or queued records have waited their delay."""
        delay = self._record_delay if self._records else math.inf
        self._parked = True
        try:
            with anyio.move_on_after(delay) as waited:
                await self._wake.wait()
        finally:
            self._parked = False
        if waited.cancelled_caught:
            self._records_due = True  # committed alone at the next turn
        else:
            self._wake = anyio.Event()

    async def _decide(self, waiters: list[_Waiter], records: list[tuple[str, Event]]) -> _InFlight | None:
        """Decide the group (on top of the one in flight); None when nothing is left to append."""
        started = time.perf_counter()
        txs: list[Transaction] = [Recorded(stream_id=stream, events=events) for stream, events in _by_stream(records)]
        try:
            decided = await self.ledger.decide_group(txs + [w.tx for w in waiters])
        except DecideFailed as failed:
            # A bug in the core on one transaction: nothing of the group was decided and the state
            # is the log's again. That transaction gets the error; the others are decided without
            # it, as if they had come alone (each failing one is taken out in turn).
            index = failed.index - len(txs)
            if index < 0:  # a record the core cannot fold: drop them, named (they change no state)
                self._records_offered -= len(records)
                self._lost(len(records), f"the core failed on a record: {type(failed.cause).__name__}: {failed.cause}")
                self._count_pending()
                return await self._decide(waiters, []) if waiters else None
            culprit = waiters[index]
            culprit.error = failed.cause
            log.error(
                "transaction_failed",
                transactions=len(waiters),
                error=f"{type(failed.cause).__name__}: {failed.cause}",
                command_id=culprit.tx.command_id,
            )
            culprit.done.set()
            # What came after the culprit in its own batch is not committed either: a batch keeps
            # its order (its submitter retries it with the same command ids).
            rest = []
            for waiter in waiters[index + 1 :]:
                if culprit.batch is not None and waiter.batch is culprit.batch:
                    waiter.error = NotCommitted(
                        f"not committed: an earlier transaction of its batch failed "
                        f"({type(failed.cause).__name__}: {failed.cause})"
                    )
                    waiter.done.set()
                else:
                    rest.append(waiter)
            rest = waiters[:index] + rest
            return await self._decide(rest, records) if rest or records else None
        except BaseException as error:
            # The log failed before anything was decided (a command id lookup, a rebuild): the
            # group gets the error; its records wait for the log.
            self._put_back(records, in_flight=False)
            self._failed(error, len(waiters))
            for waiter in waiters:
                waiter.error = error
                waiter.done.set()
            if isinstance(error, Exception):
                return None
            raise
        return _InFlight(waiters, records, decided, started)

    async def _append(self, flight: _InFlight, *, wake: bool = True) -> None:
        """The group's append; `wake`: the committer's task is told once it landed (a leader
        finishes its own group)."""
        queued = flight.queued if self.appends_in_flight > 1 else None
        try:
            flight.results = await self.ledger.append_decided(flight.decided, save_snapshot=False, queued=queued)
        except BaseException as error:
            flight.error = error
            if not isinstance(error, Exception):
                raise
        finally:
            flight.queued.set()
            flight.landed.set()
            if wake:
                self._wake.set()

    async def _finish(self, flight: _InFlight) -> None:
        """Wait for the group's append; publish and answer (or put it back, if superseded)."""
        try:
            if not flight.landed.is_set():  # anyio's wait on a set event still takes a loop iteration
                with anyio.CancelScope(shield=True):
                    await flight.landed.wait()
            if isinstance(flight.error, Superseded) or self._moved(flight):
                # Decided on top of a group whose append failed, or on a log another writer (a
                # sidecar on the same log) appended to since: decided again, first in line.
                self._in_line_again(flight.waiters)
                self._put_back(flight.records)
                return
            if flight.error is not None:
                self._put_back(flight.records)
                self._failed(flight.error, len(flight.waiters))
                for waiter in flight.waiters:
                    waiter.error = flight.error
                try:  # whatever of it did land, workers must still hear of
                    await self.hub.publish_from_log(self.ledger.last_seq)
                except Exception as late:  # noqa: BLE001 - the log is down; the next commit tries again
                    log.error("publish_from_log_failed", error=f"{type(late).__name__}: {late}")
                return
            await self._published(flight)
        finally:
            for waiter in flight.waiters:
                if waiter.result is None and waiter.error is None and not isinstance(flight.error, Superseded | HeadMoved):
                    waiter.error = ShuttingDown("the sidecar stopped before this commit finished; retry it with its command id")
                if waiter.result is not None or waiter.error is not None:
                    waiter.done.set()

    def _moved(self, flight: _InFlight) -> bool:
        """The group was refused because another writer appended first: True when its waiters
        go back in line (each at most HEAD_MOVED_ATTEMPTS times, then it is their error)."""
        if not isinstance(flight.error, HeadMoved):
            return False
        self.metrics.head_moved.inc()
        for waiter in flight.waiters:
            waiter.moved += 1
        if any(waiter.moved >= HEAD_MOVED_ATTEMPTS for waiter in flight.waiters):
            return False
        log.info("group_decided_again", transactions=len(flight.waiters), reason=str(flight.error))
        return True

    def _failed(self, error: BaseException, transactions: int) -> None:
        self.metrics.append_errors.inc()
        self.failure = f"{type(error).__name__}: {error}"
        log.error("commit_failed", transactions=transactions, error=self.failure)
        # Records alone are tried again later and later while the log refuses them.
        self._record_delay = min(self._record_delay * 2, RECORD_RETRY_MAX)

    async def _published(self, flight: _InFlight) -> None:
        assert flight.results is not None
        self.failure = None
        self._record_delay = RECORD_DELAY
        self._dropping = False
        self._records_offered -= len(flight.records)
        self._count_pending()
        if self.ledger.snapshot_due is not None:
            self._snapshot_wake.set()
        published = []
        records = len(flight.results) - len(flight.waiters)
        for index, result in enumerate(flight.results):
            commit = result.commit if isinstance(result, StepCommit) else result
            if index >= records:
                flight.waiters[index - records].result = result
            if not commit.duplicate:
                published.append((commit.events, commit.first_seq))
                self.metrics.committed(commit.events)
        # Up to this group's own last sequence: groups behind it may have landed already, and
        # are published when they are answered, in order.
        last = flight.decided.last_seq
        await self.hub.publish_from_log(min(c[1] for c in published) - 1 if published else last)
        self.hub.publish(published, last)
        if flight.waiters:
            self.metrics.group_size.observe(len(flight.waiters))
        log.debug(
            "group_committed",
            transactions=len(flight.waiters),
            records=len(flight.records),
            seconds=time.perf_counter() - flight.started,
            global_seq=self.ledger.last_seq,
        )


class _Unit:
    """Waiters that go into a group together: one transaction, or a whole batch (submit_all)."""

    def __init__(self, position: int, waiters: list[_Waiter], busy: set[str | None]) -> None:
        self.position = position
        self.waiters = waiters
        self.engine, _ = _engine_and_work(waiters[0].tx)
        self.work = sum(_engine_and_work(waiter.tx)[1] for waiter in waiters)
        self.busy = any(waiter.tx.command_id is not None and waiter.tx.command_id in busy for waiter in waiters)


def take_fairly(queue: list[_Waiter], busy: set[str | None], max_group: int) -> list[_Waiter]:
    """The next group out of `queue`, fairly between engines (issue 17: one engine's large step
    delays another's small one by at most one group):

    * the oldest transaction that may go (its command id is not in the group in flight, in
      `busy`) always goes: nothing waits for ever;
    * then each engine's next transaction, the smallest first (a Step's work is its commands,
      anything else 1), while they fit in what is left of MAX_GROUP_WORK (never less than
      SMALL_ROOM): a small step is not held behind other engines' large ones;
    * each engine's transactions keep their order (an engine's next one is the first of its
      own not taken), and a batch goes whole, in one group, in its order.
    """
    units: list[_Unit] = []
    index = 0
    while index < len(queue):
        end = index + 1
        batch = queue[index].batch
        while batch is not None and end < len(queue) and queue[end].batch is batch:
            end += 1
        units.append(_Unit(index, queue[index:end], busy))
        index = end
    taken: list[_Unit] = []
    waiting: dict[str, list[_Unit]] = {}
    for unit in units:
        waiting.setdefault(unit.engine, []).append(unit)
    head = next((unit for unit in units if not unit.busy and waiting[unit.engine][0] is unit), None)
    if head is None:
        return []
    taken.append(waiting[head.engine].pop(0))
    room = max(MAX_GROUP_WORK - head.work, SMALL_ROOM)
    count = len(head.waiters)
    while count < max_group:
        nexts = sorted(
            (units_[0] for units_ in waiting.values() if units_ and not units_[0].busy),
            key=lambda unit: (unit.work, unit.position),
        )
        fit = next((unit for unit in nexts if unit.work <= room), None)
        if fit is None:
            break
        taken.append(waiting[fit.engine].pop(0))
        room -= fit.work
        count += len(fit.waiters)
    return [waiter for unit in sorted(taken, key=lambda unit: unit.position) for waiter in unit.waiters]


def _engine_and_work(tx: Submission) -> tuple[str, int]:
    """Whose order a transaction keeps (its engine; "" for a command naming none: a report, a
    tier) and the work it brings a group (a step's commands; anything else 1)."""
    if isinstance(tx, Step):
        return tx.engine_id, max(1, len(tx.commands))
    return str(getattr(tx.command, "engine_id", "")), 1


def _keys_of(event: Event) -> int:
    return len(event.engine_keys) if isinstance(event, ExternalKeysLookedUp) else 1


def _by_stream(records: list[tuple[str, Event]]) -> list[tuple[str, list[Event]]]:
    streams: dict[str, list[Event]] = {}
    for stream, event in records:
        streams.setdefault(stream, []).append(event)
    return list(streams.items())


def freeze_long_lived() -> None:
    """Move every object alive now out of the cyclic garbage collector's reach (gc.freeze): the
    state is long-lived and freed by reference counts, and a collection of the oldest generation
    walked all of it while every engine waited. Measured under ops/bench/sidecar.py's 256-command
    steps on one engine: a 110 ms stall every ~65 steps, none after the freeze. Called once the
    state is recovered and after each snapshot (what grew since is frozen in its turn)."""
    gc.freeze()
