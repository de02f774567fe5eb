"""One append on PostgreSQL in two statements after the lock, whatever the number of batches.

The generic path this replaces (SQLAlchemy Core, a statement per row kind and per batch) read
the head, each command id and each stream's version, then wrote each step, its ids, each
stream's new version and each command, then sent NOTIFY: eleven round trips for one engine step
with BEGIN, the lock and COMMIT, five now. On PostgreSQL the round trips, not the work, were the
append (ops/bench/sidecar.py --log postgresql: a 4-command step took ~5 ms, and the log alone
~5 ms an append).

Here, under the same advisory lock (taken by the caller in a statement of its own, so that the
next statement's snapshot sees every append committed before it):

1. one SELECT reads the head, the versions of the streams the batches name, and the command ids
   the log already holds;
2. the batches are decided by the plan every SQL log follows (events/log/_append_plan.py: a
   command already done answers its first result; a wrong expected version or head refuses the
   whole append);
3. one INSERT ... SELECT FROM unnest(...) statement with data-modifying CTEs writes every step,
   event id, stream version and command, and notifies the log's listeners.

Event ids are kept as SQLite keeps them (migration 0009): a step whose ids ascend, all above
every id the log holds, is one kvl_id_runs row; any other step's ids are kvl_event_ids rows, and
an id among them inside a run's bounds is refused when that run's step lists it. The look-up
also reads the highest run's last id and, for each step whose ids ascend, whether a row lies
between its first and last id; `keep_ids` then decides step by step, as SQLite's statements do
one step after another, counting this append's own runs and rows. Only when rows are kept (a
step out of order, rare) does a third statement look for runs around them. The id columns
compare byte by byte (collation "C", migration 0010), as the code's `<` does.

Every constraint still holds in the database: a repeated event id (or stream version) fails the
write statement with its unique violation, and the transaction rolls back whole.
"""

from __future__ import annotations

from bisect import bisect_left, insort
from collections.abc import Sequence

import msgspec
import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncConnection

from events.log._append_plan import PackedStep, StepRow, ascending, plan_append
from events.log._contract import AppendBatch, AppendRejected, AppendResult
from events.log._step_rows import STEP_COLUMNS, stored_step

_LOOK_UP = sa.text(
    "SELECT (SELECT last_seq FROM kvl_steps ORDER BY first_seq DESC LIMIT 1), "
    "(SELECT coalesce(json_object_agg(stream_id, version), '{}') FROM kvl_streams "
    " WHERE stream_id = ANY(CAST(:streams AS text[]))), "
    "(SELECT coalesce(json_agg(json_build_array(command_id, stream_id, first_seq, last_seq, stream_version, "
    "  encode(digest, 'hex'))), '[]') FROM kvl_commands WHERE command_id = ANY(CAST(:commands AS text[]))), "
    "(SELECT last_id FROM kvl_id_runs ORDER BY first_id DESC LIMIT 1), "
    # Per step whose ids ascend (its first and last id): whether a kvl_event_ids row lies between.
    # (The id columns' collation, "C", orders every comparison with them here: migration 0010.)
    "(SELECT coalesce(array_agg(EXISTS (SELECT 1 FROM kvl_event_ids WHERE event_id BETWEEN c.f AND c.l) "
    "  ORDER BY c.n), '{}') "
    " FROM unnest(CAST(:run_firsts AS text[]), CAST(:run_lasts AS text[])) WITH ORDINALITY AS c(f, l, n))"
)

_WITHIN_RUNS = sa.text(
    # Each id that lies within a run's bounds, with that run's step: the run starting at or below
    # it, if it ends at or above it (runs never overlap).
    "SELECT i.id, r.first_seq FROM unnest(CAST(:ids AS text[])) AS i(id) JOIN LATERAL ("
    " SELECT last_id, first_seq FROM kvl_id_runs WHERE first_id <= i.id ORDER BY first_id DESC LIMIT 1"
    ") AS r ON r.last_id >= i.id"
)

_STEPS_AT = sa.text(f"SELECT {STEP_COLUMNS} FROM kvl_steps WHERE first_seq = ANY(CAST(:seqs AS bigint[]))")

_WRITE = sa.text(
    "WITH steps AS ("
    " INSERT INTO kvl_steps (first_seq, last_seq, stream_id, first_version, step, recorded_at, schemas, header, payload, codec)"
    " SELECT * FROM unnest(CAST(:first AS bigint[]), CAST(:last AS bigint[]), CAST(:stream AS text[]),"
    "  CAST(:first_version AS integer[]), CAST(:step AS bigint[]), CAST(:recorded_at AS double precision[]),"
    "  CAST(:schemas AS text[]), CAST(:header AS bytea[]), CAST(:payload AS bytea[]), CAST(:codec AS smallint[]))"
    "), ids AS ("
    " INSERT INTO kvl_event_ids (event_id, global_seq)"
    " SELECT * FROM unnest(CAST(:event_ids AS text[]), CAST(:event_seqs AS bigint[]))"
    "), runs AS ("
    " INSERT INTO kvl_id_runs (first_id, last_id, first_seq)"
    " SELECT * FROM unnest(CAST(:run_firsts AS text[]), CAST(:run_lasts AS text[]), CAST(:run_seqs AS bigint[]))"
    "), versions AS ("
    " INSERT INTO kvl_streams (stream_id, version)"
    " SELECT * FROM unnest(CAST(:version_streams AS text[]), CAST(:versions AS integer[]))"
    " ON CONFLICT (stream_id) DO UPDATE SET version = excluded.version"
    "), commands AS ("
    " INSERT INTO kvl_commands (command_id, stream_id, first_seq, last_seq, stream_version, digest)"
    " SELECT * FROM unnest(CAST(:command_ids AS text[]), CAST(:command_streams AS text[]), CAST(:command_firsts AS bigint[]),"
    "  CAST(:command_lasts AS bigint[]), CAST(:command_versions AS integer[]), CAST(:command_digests AS bytea[]))"
    ")"
    " SELECT pg_notify(:channel, '') WHERE CAST(:notify AS boolean)"
)

_Done = tuple[str, str, int, int, int, str | None]
"""A kvl_commands row as the look-up returns it: (command id, stream, first, last, version, digest hex)."""


async def append_postgresql(
    conn: AsyncConnection,
    batches: Sequence[AppendBatch],
    expected_head: int | None,
    packed: Sequence[PackedStep | None],
    channel: str,
) -> list[AppendResult]:
    """The append's look-up, plan and writes; the caller holds the advisory lock and commits.
    Raises AppendRejected for an event id a run of the log holds."""
    streams = sorted({batch.stream_id for batch in batches})
    command_ids = sorted({batch.command_id for batch in batches if batch.command_id is not None})
    candidates = sorted({(ids[0], ids[-1]) for ids in (step[3] for step in packed if step is not None) if ascending(ids)})
    head, versions_json, commands_json, top, between = (
        await conn.execute(
            _LOOK_UP,
            {
                "streams": streams,
                "commands": command_ids,
                "run_firsts": [first for first, _ in candidates],
                "run_lasts": [last for _, last in candidates],
            },
        )
    ).one()
    versions: dict[str, int] = msgspec.json.decode(versions_json) if isinstance(versions_json, str) else dict(versions_json)
    held: list[_Done] = msgspec.json.decode(commands_json) if isinstance(commands_json, str) else list(commands_json)
    done = {
        row[0]: AppendResult(
            stream_id=row[1],
            first_seq=row[2],
            last_seq=row[3],
            stream_version=row[4],
            duplicate=True,
            digest=None if row[5] is None else bytes.fromhex(row[5]),
        )
        for row in held
    }
    plan = plan_append(batches, packed, int(head or 0), expected_head, versions.get, done.get)
    if not plan.steps and not plan.commands:
        return plan.results  # every batch a command already done: nothing to write
    runs, rows = keep_ids(plan.steps, top, dict(zip(candidates, between, strict=True)))
    if rows:
        await _refuse_ids_runs_hold(conn, rows)
    write = _columns(_STEP_COLUMNS, [row for row, _ in plan.steps])
    write |= _columns(("event_ids", "event_seqs"), rows)
    write |= _columns(("run_firsts", "run_lasts", "run_seqs"), runs)
    write["version_streams"] = list(plan.versions)
    write["versions"] = [version for version, _ in plan.versions.values()]
    commands = [(command_id, r.stream_id, r.first_seq, r.last_seq, r.stream_version, r.digest) for command_id, r in plan.commands]
    write |= _columns(_COMMAND_COLUMNS, commands)
    notify = any(not result.duplicate and result.last_seq for result in plan.results)
    await conn.execute(_WRITE, {**write, "channel": channel, "notify": notify})
    return plan.results


def keep_ids(
    steps: Sequence[tuple[StepRow, list[str]]], top: str | None, rows_between: dict[tuple[str, str], bool]
) -> tuple[list[tuple[str, str, int]], list[tuple[str, int]]]:
    """How each step's ids are kept, deciding step after step as SQLite does: (runs as (first id,
    last id, first global sequence), rows as (id, global sequence)). A step is a run when its ids
    ascend above `top` (the log's highest run's last id, then this append's) and no row lies
    between its first and last id: none of the log's (`rows_between`, read for each ascending
    step) and none this append keeps before it. A row id inside a run this append makes is
    refused when that run holds it (AppendRejected); the log's own rows and runs are checked by
    the primary key and by `_refuse_ids_runs_hold`."""
    runs: list[tuple[str, str, int, list[str]]] = []
    rows: list[tuple[str, int]] = []
    ordered: list[str] = []  # this append's row ids so far, sorted
    for row, event_ids in steps:
        first_seq = row[0]
        first, last = event_ids[0], event_ids[-1]
        if (
            ascending(event_ids)
            and (top is None or first > top)
            and not rows_between.get((first, last), True)
            and not _any_between(ordered, first, last)
        ):
            runs.append((first, last, first_seq, event_ids))
            top = last
            continue
        for index, event_id in enumerate(event_ids):
            for run_first, run_last, run_seq, run_ids in runs:
                if run_first <= event_id <= run_last and event_id in run_ids:
                    raise AppendRejected(_taken(event_id, run_seq + run_ids.index(event_id)))
            insort(ordered, event_id)
            rows.append((event_id, first_seq + index))
    return [(first, last, first_seq) for first, last, first_seq, _ in runs], rows


def _any_between(ordered: list[str], first: str, last: str) -> bool:
    """Whether sorted `ordered` holds an id from `first` to `last`."""
    at = bisect_left(ordered, first)
    return at < len(ordered) and ordered[at] <= last


async def _refuse_ids_runs_hold(conn: AsyncConnection, rows: Sequence[tuple[str, int]]) -> None:
    """AppendRejected naming the first id among `rows` that a run of the log holds: an id inside
    a run's bounds is held only when the run's step lists it (its header, read once a step)."""
    inside = (await conn.execute(_WITHIN_RUNS, {"ids": [event_id for event_id, _ in rows]})).all()
    if not inside:
        return
    seqs = sorted({int(first_seq) for _, first_seq in inside})
    steps = (await conn.execute(_STEPS_AT, {"seqs": seqs})).all()
    listed = {step.first_seq: step.event_ids() for step in map(stored_step, steps)}
    for event_id, first_seq in inside:
        ids = listed[first_seq]
        if event_id in ids:
            raise AppendRejected(_taken(event_id, first_seq + ids.index(event_id)))


def _taken(event_id: str, global_seq: int) -> str:
    return f"UNIQUE constraint failed: event id {event_id!r} is taken (global sequence {global_seq})"


_STEP_COLUMNS = ("first", "last", "stream", "first_version", "step", "recorded_at", "schemas", "header", "payload", "codec")
_COMMAND_COLUMNS = ("command_ids", "command_streams", "command_firsts", "command_lasts", "command_versions", "command_digests")


def _columns(names: Sequence[str], rows: Sequence[tuple[object, ...]]) -> dict[str, list[object]]:
    """Rows as one list per column, by name: unnest's arrays (empty when there is no row)."""
    columns: dict[str, list[object]] = {name: [] for name in names}
    for row in rows:
        for name, value in zip(names, row, strict=True):
            columns[name].append(value)
    return columns
