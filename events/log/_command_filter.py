"""The command ids a SQL log holds, in Bloom filters: a group whose ids are surely new is
decided without a trip to the database.

The ledger asks the log which of a group's command ids were already committed
(`EventLog.find_commands`) before it decides the group, at every step. On SQLite that is a hop to a
worker thread and back, and it found nothing for almost every step: measured with
`ops/bench/sidecar.py --engines 1 --commands 4`, the hop took a quarter of the sidecar's CPU a
step and of its step latency. On PostgreSQL it is a query through SQLAlchemy's async engine. A Bloom filter never misses an id it was given (it may only answer
"maybe" for one it was not), so an id it does not hold is surely not in the log, provided every id
of the log went into it. That is what this class keeps track of:

* it is *built* from the log's `kvl_commands` rows and the log's head, read in one transaction:
  it then holds every id of the log up to that head (`through`);
* each append the log made moves `through` on, with the appended ids added, when it began at
  `through` (its expected head): nothing else was appended in between;
* anything else makes it unknown: an append that failed (it may have committed), one without an
  expected head, one that found an id already committed that the filter did not hold. It is
  built again at the next look-up;
* an append that began past `through`, or a head read past it while none of this log's appends
  ran, means another writer appends to the same log (a second sidecar): that turns it off for
  good, since the ids another process appends are not seen here, and building it again at each
  of them would cost a scan of the table each time. The log then asks the database every time,
  as before.

Between another writer's append and the moment this log sees it, a look-up may answer "new" for
an id that writer committed. The ledger then decides it as new and its append fails safe: the
head it names has moved (HeadMoved), or the append itself finds the id committed; the ledger
rebuilds from the log and the id is found (tests/log/test_command_filter.py).

Pure: no I/O; the SQL log reads the rows (in a worker thread, into a new filter) and calls the
rest on the event loop's thread.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from rbloom import Bloom

from events.log._contract import AppendResult

FIRST_CAPACITY = 65_536
"""Ids the first filter holds at its error rate; each filter after it holds twice the one before."""
ERROR_RATE = 1e-6
"""The chance that a filter answers "maybe" for an id it was not given (then the database is
asked, as without the filter): ~29 bits, 3.6 bytes, an id."""


class CommandFilter:
    """Which command ids may be in the log (see the module's docstring)."""

    def __init__(self) -> None:
        self._filters: list[Bloom] = []
        self._capacity = 0
        self._count = 0
        self.through: int | None = None
        """Every command id of the log up to this global sequence is in the filters; None: unknown."""
        self.off = False
        """Another writer appends to the log: the filters are not kept (the database is asked)."""
        self.appends = 0
        """Appends begun, counted: a build read while one was running may miss its ids."""
        self.appending = 0
        """Appends running now."""

    @property
    def ready(self) -> bool:
        """True when an id the filters do not hold is surely not in the log."""
        return self.through is not None and not self.off

    def may_hold_any(self, command_ids: Iterable[str]) -> bool:
        return any(command_id in bloom for command_id in command_ids for bloom in self._filters)

    @classmethod
    def read(cls, chunks: Iterable[Sequence[str]], head: int, expected: int = 0) -> CommandFilter:
        """A filter of every command id of the log as it was at `head`, read in one transaction
        (in chunks: a log of 1M commands is never a list of 1M strings), about `expected` of them:
        the first filter holds them and FIRST_CAPACITY and a quarter more. Made off the event
        loop, then `adopt`ed on it."""
        fresh = cls()
        size = FIRST_CAPACITY + expected + expected // 4
        fresh._filters.append(Bloom(size, ERROR_RATE))
        fresh._capacity = size
        for chunk in chunks:
            fresh.add_read(chunk)
        fresh.through = head
        return fresh

    def add_read(self, chunk: Sequence[str]) -> None:
        """More ids of a filter being `read` (not yet adopted)."""
        self._add(chunk)

    def adopt(self, fresh: CommandFilter) -> None:
        """Trust a filter `read` while no append ran (`build_valid`)."""
        if not self.off:
            self._filters, self._capacity, self._count = fresh._filters, fresh._capacity, fresh._count
            self.through = fresh.through

    def built(self, command_ids: Sequence[str], head: int) -> None:
        """Every command id of the log as it was at `head`."""
        self.adopt(CommandFilter.read([command_ids], head))

    def began(self) -> None:
        """An append begins."""
        self.appends += 1
        self.appending += 1

    def build_valid(self, appends_before: int, running_before: int) -> bool:
        """A build read while no append ran, with no append begun meanwhile, holds the log as it
        is (`appends` and `appending` read before the build began)."""
        return running_before == 0 and self.appending == 0 and appends_before == self.appends

    def appended(self, expected_head: int | None, command_ids: Sequence[str | None], results: Sequence[AppendResult]) -> None:
        """An append returned: `command_ids` are its batches' ids (None for a batch without one),
        `results` its results, in the same order."""
        self.appending -= 1
        if not self.ready:
            return
        if expected_head is None:
            self.through = None  # where it began is not known: built again
            return
        if expected_head != self.through:
            self._turn_off()
            return
        if any(
            result.duplicate and command_id is not None and not self.may_hold_any((command_id,))
            for command_id, result in zip(command_ids, results, strict=True)
        ):
            self.through = None  # the log held an id the filters did not: built again
            return
        self._add(
            [
                command_id
                for command_id, result in zip(command_ids, results, strict=True)
                if command_id is not None and not result.duplicate
            ]
        )
        self.through = max([self.through, *(result.last_seq for result in results if not result.duplicate)])

    def failed(self) -> None:
        """An append raised; it may have committed all the same: built again before it is trusted."""
        self.appending -= 1
        self.through = None

    def saw_head(self, head: int) -> None:
        """The log's head, read while no append of this log's ran: past `through`, another
        writer appended (its ids are not here)."""
        if self.ready and self.appending == 0 and head > (self.through or 0):
            self._turn_off()

    def _turn_off(self) -> None:
        self.off = True
        self.through = None
        self._filters = []
        self._capacity = self._count = 0

    def _add(self, command_ids: Sequence[str]) -> None:
        done = 0
        while done < len(command_ids):
            if self._count >= self._capacity:
                size = max(FIRST_CAPACITY, 2 * self._capacity, len(command_ids) - done)
                self._filters.append(Bloom(size, ERROR_RATE))
                self._capacity += size
            chunk = command_ids[done : done + self._capacity - self._count]
            self._filters[-1].update(chunk)
            self._count += len(chunk)
            done += len(chunk)
