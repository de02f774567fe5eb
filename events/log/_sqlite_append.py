"""One append on SQLite: its statements, straight on sqlite3 inside the transaction the log's
thread began (`BEGIN IMMEDIATE`, events/log/_sql.py). The plan every SQL log follows
(events/log/_append_plan.py) looks streams and command ids up a statement each here; PostgreSQL
looks them all up in one statement (events/log/_postgres_append.py).

Event ids stay unique: a step whose ids ascend above every id the log holds is one kvl_id_runs
row (migration 0009), any other step's ids a kvl_event_ids row each, checked against the runs.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Sequence
from typing import Any

import msgspec

from events.log._append_plan import PackedStep, StepRow, ascending, plan_append
from events.log._contract import AppendBatch, AppendResult
from events.log._step_rows import STEP_COLUMNS, stored_step

HEAD_SQL = "SELECT last_seq FROM kvl_steps ORDER BY first_seq DESC LIMIT 1"
"""The log's head: the last sequence of its last step (0 when it has none)."""

_INSERT_STEP_SQL = (
    "INSERT INTO kvl_steps (first_seq, last_seq, stream_id, first_version, step, recorded_at, schemas, header, payload, codec) "
    "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)"
)
_INSERT_IDS_AT_ONCE_SQL = (
    # A step's event ids in one statement, from a JSON array (key: the index in it).
    "INSERT INTO kvl_event_ids (event_id, global_seq) SELECT value, ? + key FROM json_each(?)"
)

# Event ids kept as runs (migration 0009): a step whose ids ascend above every id the log holds is
# one kvl_id_runs row. Runs never overlap, so the highest by first id has the log's highest last id.
_INSERT_RUN_SQL = "INSERT INTO kvl_id_runs (first_id, last_id, first_seq) VALUES (?, ?, ?)"
_ABOVE_EVERY_ID_SQL = (
    # Whether ids from ? to ? lie above every run and no kvl_event_ids row lies among them.
    "SELECT coalesce((SELECT last_id FROM kvl_id_runs ORDER BY first_id DESC LIMIT 1) < ?1, 1) "
    "AND NOT EXISTS (SELECT 1 FROM kvl_event_ids WHERE event_id BETWEEN ?1 AND ?2)"
)
_IDS_WITHIN_RUNS_SQL = (
    # Each id of a JSON array that lies within a run's bounds, with that run's step: the run
    # starting at or below it that starts highest, if it ends at or above it.
    "SELECT ids.value, runs.first_seq FROM json_each(?) AS ids JOIN kvl_id_runs AS runs "
    "ON runs.first_id = (SELECT max(first_id) FROM kvl_id_runs WHERE first_id <= ids.value) "
    "WHERE ids.value <= runs.last_id"
)


def append_rows(
    rows: SqliteRows, batches: Sequence[AppendBatch], expected_head: int | None, packed: Sequence[PackedStep | None]
) -> list[AppendResult]:
    """The append's plan (events/log/_append_plan.py), looking streams and command ids up a
    statement each, then its rows written."""
    plan = plan_append(batches, packed, rows.head(), expected_head, rows.stream_version, rows.command)
    for row, event_ids in plan.steps:
        rows.insert_step(row, event_ids)
    for stream_id, (version, held) in plan.versions.items():
        rows.set_stream_version(stream_id, version, new=not held)
    for command_id, result in plan.commands:
        rows.insert_command(command_id, result)
    return plan.results


class SqliteRows:
    """The statements of one SQLite append, on one connection inside its transaction, straight
    to sqlite3: SQLAlchemy's per-statement work was a quarter of an append (ops/bench/log.py,
    profiled). PostgreSQL's appends are events/log/_postgres_append.py."""

    def __init__(self, driver: Any) -> None:
        self.driver = driver

    def head(self) -> int:
        row = self.driver.execute(HEAD_SQL).fetchone()
        return int(row[0]) if row else 0

    def command(self, command_id: str) -> AppendResult | None:
        row = self.driver.execute(
            "SELECT stream_id, first_seq, last_seq, stream_version, digest FROM kvl_commands WHERE command_id = ?", (command_id,)
        ).fetchone()
        if row is None:
            return None
        return AppendResult(
            stream_id=row[0], first_seq=row[1], last_seq=row[2], stream_version=row[3], duplicate=True, digest=row[4]
        )

    def stream_version(self, stream_id: str) -> int | None:
        row = self.driver.execute("SELECT version FROM kvl_streams WHERE stream_id = ?", (stream_id,)).fetchone()
        return None if row is None else int(row[0])

    def insert_step(self, step: StepRow, event_ids: list[str]) -> None:
        """The step's row, then its event ids kept unique: as one run when they ascend above every
        id the log holds (the ledger's UUIDv7s nearly always do), else a kvl_event_ids row each,
        none of them inside a run's step."""
        self.driver.execute(_INSERT_STEP_SQL, step)
        if self._a_new_run(event_ids):
            self.driver.execute(_INSERT_RUN_SQL, (event_ids[0], event_ids[-1], step[0]))
            return
        # One statement, not one per event (executemany): sqlite3 lets go of the GIL around each
        # row's step, and while the event loop is busy each handover waits up to the switch
        # interval for it back. A 258-event step of refusals took 10-18 ms to append under
        # ops/bench/hostile.py's attack, and every engine's step waited behind it.
        ids = msgspec.json.encode(event_ids)
        try:
            self.driver.execute(_INSERT_IDS_AT_ONCE_SQL, (step[0], ids))
        except sqlite3.IntegrityError as error:
            raise sqlite3.IntegrityError(f"{error}: {self._taken(event_ids, ids)}") from error
        steps: dict[int, list[str]] = {}
        for event_id, first_seq in self.driver.execute(_IDS_WITHIN_RUNS_SQL, (ids,)).fetchall():
            # Inside a run's bounds: taken only if its step lists it (a header read each step, rare).
            held = steps.get(first_seq)
            if held is None:
                row = self.driver.execute(f"SELECT {STEP_COLUMNS} FROM kvl_steps WHERE first_seq = ?", (first_seq,)).fetchone()
                held = steps[first_seq] = stored_step(row).event_ids()
            if event_id in held:
                raise sqlite3.IntegrityError(
                    f"UNIQUE constraint failed: event id {event_id!r} is taken (global sequence {first_seq + held.index(event_id)})"
                )

    def _a_new_run(self, event_ids: list[str]) -> bool:
        """Whether the ids ascend (so none is given twice) and all lie above every id the log
        holds: the highest run's last id, and any kvl_event_ids row between the first and last."""
        if not ascending(event_ids):
            return False
        return bool(self.driver.execute(_ABOVE_EVERY_ID_SQL, (event_ids[0], event_ids[-1])).fetchone()[0])

    def _taken(self, event_ids: list[str], ids: bytes) -> str:
        """Which of a step's event ids broke their uniqueness (the statement failed as a whole)."""
        seen: set[str] = set()
        for event_id in event_ids:
            if event_id in seen:
                return f"event id {event_id!r} is given twice in the step"
            seen.add(event_id)
        row = self.driver.execute(
            "SELECT event_id, global_seq FROM kvl_event_ids WHERE event_id IN (SELECT value FROM json_each(?)) "
            "ORDER BY global_seq LIMIT 1",
            (ids,),
        ).fetchone()
        return f"event id {row[0]!r} is taken (global sequence {row[1]})" if row else "an event id is taken"

    def set_stream_version(self, stream_id: str, version: int, *, new: bool) -> None:
        if new:
            self.driver.execute("INSERT INTO kvl_streams (stream_id, version) VALUES (?, ?)", (stream_id, version))
        else:
            self.driver.execute("UPDATE kvl_streams SET version = ? WHERE stream_id = ?", (version, stream_id))

    def insert_command(self, command_id: str, result: AppendResult) -> None:
        self.driver.execute(
            "INSERT INTO kvl_commands (command_id, stream_id, first_seq, last_seq, stream_version, digest) "
            "VALUES (?, ?, ?, ?, ?, ?)",
            (command_id, result.stream_id, result.first_seq, result.last_seq, result.stream_version, result.digest),
        )
