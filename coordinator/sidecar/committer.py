"""Group commit: transactions that arrive while a commit is in flight are committed together.

Connections submit transactions and wait; one task takes everything queued (up to a limit),
commits it with `Ledger.commit_group` in one append, publishes the decisions, then wakes the
waiters. There is no timer: under light load a group is one transaction and waits for nothing;
under load the groups grow by themselves. A waiter that goes away does not cancel its commit,
so a client that reconnects and retries its command id gets the committed result.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Sequence

import anyio
import structlog

from coordinator.ledger import Commit, DecideFailed, Ledger, StepCommit, Transaction
from coordinator.sidecar.hub import DecisionHub
from coordinator.sidecar.metrics import SidecarMetrics

log = structlog.get_logger("kvledger.committer")

MAX_GROUP = 64


class ShuttingDown(Exception):
    """The sidecar is draining: it takes no new transactions."""


class NotCommitted(Exception):
    """A transaction of a batch left uncommitted because one before it failed."""


class _Waiter:
    __slots__ = ("tx", "batch", "done", "result", "error")

    def __init__(self, tx: Transaction, batch: object | None = None) -> None:
        self.tx = tx
        self.batch = batch
        """The submit_all call it came with: a batch is committed in one group, in its order."""
        self.done = anyio.Event()
        self.result: StepCommit | Commit | None = None
        self.error: BaseException | None = None


class Committer:
    def __init__(self, ledger: Ledger, hub: DecisionHub, metrics: SidecarMetrics, max_group: int = MAX_GROUP) -> None:
        self.ledger = ledger
        self.hub = hub
        self.metrics = metrics
        self.max_group = max_group
        self._queue: deque[_Waiter] = deque()
        self._wake = anyio.Event()
        self._snapshot_wake = anyio.Event()
        self._closing = False
        self.failure: str | None = None
        """Why the log stopped taking appends, if it did: readiness reports it."""

    async def submit(self, tx: Transaction) -> StepCommit | Commit:
        """Commit one transaction (with whatever else is queued) and return its result."""
        if self._closing:
            raise ShuttingDown("the sidecar is shutting down; retry against the restarted one")
        waiter = _Waiter(tx)
        self._queue.append(waiter)
        self._wake.set()
        with anyio.CancelScope(shield=True):
            # Leaving early would not undo the commit; wait so the result is never lost.
            await waiter.done.wait()
        if waiter.error is not None:
            raise waiter.error
        assert waiter.result is not None
        return waiter.result

    async def submit_all(self, txs: Sequence[Transaction]) -> list[StepCommit | Commit]:
        """Commit several transactions in their order (queued together: one group, or consecutive
        groups), and return their results; raises the first error any of them got, after all are
        answered (a retry with the same command ids then gets what was committed)."""
        if self._closing:
            raise ShuttingDown("the sidecar is shutting down; retry against the restarted one")
        batch = object()
        waiters = [_Waiter(tx, batch) for tx in txs]
        self._queue.extend(waiters)
        self._wake.set()
        with anyio.CancelScope(shield=True):
            for waiter in waiters:
                await waiter.done.wait()
        for waiter in waiters:
            if waiter.error is not None:
                raise waiter.error
        return [waiter.result for waiter in waiters if waiter.result is not None]

    def close(self) -> None:
        """Take no new transactions; `run` returns once the queue is empty."""
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
            # Cancelled at a drain timeout, or failed: whoever is still queued gets an answer.
            self._closing = True
            while self._queue:
                waiter = self._queue.popleft()
                waiter.error = ShuttingDown("the sidecar stopped before this commit; retry it with its command id")
                waiter.done.set()

    async def _save_snapshots(self) -> None:
        """Write each snapshot a commit left due, beside the commits: no step waits for it."""
        while True:
            await self._snapshot_wake.wait()
            self._snapshot_wake = anyio.Event()
            await self.ledger.save_due_snapshot()

    async def _run(self) -> None:
        while True:
            while not self._queue:
                if self._closing:
                    return
                await self._wake.wait()
                self._wake = anyio.Event()
            group = [self._queue.popleft() for _ in range(min(self.max_group, len(self._queue)))]
            # A batch (submit_all) is never split across groups: were one group of it to fail and
            # the next to commit, its order would break (an ingested batch after a missing one).
            while self._queue and group[-1].batch is not None and self._queue[0].batch is group[-1].batch:
                group.append(self._queue.popleft())
            await self._commit(group)

    async def _commit(self, group: list[_Waiter]) -> None:
        try:
            await self._commit_and_publish(group)
        finally:
            # Whatever happened (even cancellation), no waiter is left waiting forever.
            for waiter in group:
                if waiter.result is None and waiter.error is None:
                    waiter.error = ShuttingDown("the sidecar stopped before this commit finished; retry it with its command id")
                waiter.done.set()

    async def _commit_and_publish(self, group: list[_Waiter]) -> None:
        started = time.perf_counter()
        try:
            results = await self.ledger.commit_group([w.tx for w in group], save_snapshot=False)
            if self.ledger.snapshot_due is not None:
                self._snapshot_wake.set()
        except DecideFailed as failed:
            # A bug in the core on one transaction: nothing of the group was committed and the
            # state is the log's again. That transaction gets the error; the others are committed
            # without it, as if they had come alone (each failing one is taken out in turn).
            culprit = group[failed.index]
            culprit.error = failed.cause
            log.error("transaction_failed", transactions=len(group), error=f"{type(failed.cause).__name__}: {failed.cause}",
                      command_id=culprit.tx.command_id)
            # What came after the culprit in its own batch is not committed either: a batch keeps
            # its order (its submitter retries it with the same command ids).
            after = group[failed.index + 1:]
            for waiter in after:
                if culprit.batch is not None and waiter.batch is culprit.batch:
                    waiter.error = NotCommitted(f"not committed: an earlier transaction of its batch failed "
                                                f"({type(failed.cause).__name__}: {failed.cause})")
            rest = [waiter for waiter in group if waiter is not culprit and waiter.error is None]
            if rest:
                await self._commit_and_publish(rest)
            return
        except Exception as error:  # noqa: BLE001 - every waiter gets the error; the loop goes on
            self.metrics.append_errors.inc()
            self.failure = f"{type(error).__name__}: {error}"
            log.error("commit_failed", transactions=len(group), error=self.failure)
            for waiter in group:
                waiter.error = error
            try:  # whatever of it did land, workers must still hear of
                await self.hub.publish_from_log(self.ledger.last_seq)
            except Exception as late:  # noqa: BLE001 - the log is down; the next commit tries again
                log.error("publish_from_log_failed", error=f"{type(late).__name__}: {late}")
            return
        self.failure = None
        published = []
        for waiter, result in zip(group, results, strict=True):
            waiter.result = result
            commit = result.commit if isinstance(result, StepCommit) else result
            if not commit.duplicate:
                published.append((commit.events, commit.first_seq))
                self.metrics.committed(commit.events)
        await self.hub.publish_from_log(min(c[1] for c in published) - 1 if published else self.ledger.last_seq)
        self.hub.publish(published, self.ledger.last_seq)
        self.metrics.group_size.observe(len(group))
        log.debug("group_committed", transactions=len(group), seconds=time.perf_counter() - started, global_seq=self.ledger.last_seq)
