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

Every constraint still holds in the database: a repeated event id (or stream version) fails the
write statement with its unique violation, and the transaction rolls back whole.
"""

from __future__ import annotations

from collections.abc import Sequence

import msgspec
import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncConnection

from events.log._append_plan import PackedStep, plan_append
from events.log._contract import AppendBatch, AppendResult

_LOOK_UP = sa.text(
    "SELECT (SELECT last_seq FROM kvl_steps ORDER BY first_seq DESC LIMIT 1), "
    "(SELECT coalesce(json_object_agg(stream_id, version), '{}') FROM kvl_streams "
    " WHERE stream_id = ANY(CAST(:streams AS text[]))), "
    "(SELECT coalesce(json_agg(json_build_array(command_id, stream_id, first_seq, last_seq, stream_version, "
    "  encode(digest, 'hex'))), '[]') FROM kvl_commands WHERE command_id = ANY(CAST(:commands AS text[])))"
)

_WRITE = sa.text(
    "WITH steps AS ("
    " INSERT INTO kvl_steps (first_seq, last_seq, stream_id, first_version, step, recorded_at, schemas, header, payload, codec)"
    " SELECT * FROM unnest(CAST(:first AS bigint[]), CAST(:last AS bigint[]), CAST(:stream AS text[]),"
    "  CAST(:first_version AS integer[]), CAST(:step AS bigint[]), CAST(:recorded_at AS double precision[]),"
    "  CAST(:schemas AS text[]), CAST(:header AS bytea[]), CAST(:payload AS bytea[]), CAST(:codec AS smallint[]))"
    "), ids AS ("
    " INSERT INTO kvl_event_ids (event_id, global_seq)"
    " SELECT * FROM unnest(CAST(:event_ids AS text[]), CAST(:event_seqs AS bigint[]))"
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
    """The append's look-up, plan and writes; the caller holds the advisory lock and commits."""
    streams = sorted({batch.stream_id for batch in batches})
    command_ids = sorted({batch.command_id for batch in batches if batch.command_id is not None})
    head, versions_json, commands_json = (await conn.execute(_LOOK_UP, {"streams": streams, "commands": command_ids})).one()
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
    write = _columns(_STEP_COLUMNS, [row for row, _ in plan.steps])
    write["event_ids"] = [event_id for _, event_ids in plan.steps for event_id in event_ids]
    write["event_seqs"] = [seq for row, event_ids in plan.steps for seq in range(row[0], row[0] + len(event_ids))]
    write["version_streams"] = list(plan.versions)
    write["versions"] = [version for version, _ in plan.versions.values()]
    commands = [(command_id, r.stream_id, r.first_seq, r.last_seq, r.stream_version, r.digest) for command_id, r in plan.commands]
    write |= _columns(_COMMAND_COLUMNS, commands)
    notify = any(not result.duplicate and result.last_seq for result in plan.results)
    await conn.execute(_WRITE, {**write, "channel": channel, "notify": notify})
    return plan.results


_STEP_COLUMNS = ("first", "last", "stream", "first_version", "step", "recorded_at", "schemas", "header", "payload", "codec")
_COMMAND_COLUMNS = ("command_ids", "command_streams", "command_firsts", "command_lasts", "command_versions", "command_digests")


def _columns(names: Sequence[str], rows: Sequence[tuple[object, ...]]) -> dict[str, list[object]]:
    """Rows as one list per column, by name: unnest's arrays (empty when there is no row)."""
    columns: dict[str, list[object]] = {name: [] for name in names}
    for row in rows:
        for name, value in zip(names, row, strict=True):
            columns[name].append(value)
    return columns
