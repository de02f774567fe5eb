"""Event ids stay unique across the whole log (DESIGN.md, "The log") when SQLite keeps a step
whose ids ascend above every id the log holds as one run (kvl_id_runs, migration 0009) instead
of a kvl_event_ids row each: an append is taken exactly when its ids are distinct and none is
held, whichever way each earlier step was kept; a refusal names the id (and on SQLite the
global sequence holding it) and leaves the log as it was; a downgrade writes every run's ids
back as rows."""

from __future__ import annotations

import random
import re
import uuid

import anyio
import pytest
import sqlalchemy as sa

import migrations
from events.log import AppendRejected, SqlEventLog, open_log, upgrade_log
from tests.log.test_command_filter import _open
from tests.log.test_log_contract import all_events, batch, pending, pendings
from tests.log.test_migrations import _on_connection

pytestmark = pytest.mark.anyio

_NAMED = re.compile(r"event id '([^']+)'|\(event_id\)=\(([^)]+)\)")
"""The id a refusal names: SQLite's message, or PostgreSQL's unique violation."""
_TAKEN_AT = re.compile(r"event id '([^']+)' is taken \(global sequence (\d+)\)")


async def _counts(url: str) -> tuple[int, int]:
    """(kvl_id_runs rows, kvl_event_ids rows) as stored."""
    counted: list[int] = []

    def count(conn: sa.Connection) -> None:
        for table in ("kvl_id_runs", "kvl_event_ids"):
            counted.append(int(conn.execute(sa.text(f"SELECT count(*) FROM {table}")).scalar_one()))

    await _on_connection(url, count)
    return counted[0], counted[1]


def _random_step(rng: random.Random, held: list[str], top: int) -> tuple[list[str], int]:
    """A step's ids, and the next id above every one made so far. Ids are four digits, so steps
    that ascend, steps that do not, and steps straddling others' bounds all come often."""
    kind = rng.random()
    size = rng.randint(1, 6)
    if kind < 0.45:  # ascending above everything: the ledger's case (a run)
        ids = [f"{top + 1 + index * rng.randint(1, 3):04d}" for index in range(size)]
        return ids, int(ids[-1]) + 1
    if kind < 0.65:  # ascending, but among older ids (it may straddle runs and rows)
        return sorted({f"{rng.randint(0, top + 10):04d}" for _ in range(size)}), top + 11
    if kind < 0.8 and held:  # reuses a held id among fresh ones
        ids = [f"{rng.randint(0, top + 10):04d}" for _ in range(size - 1)] + [rng.choice(held)]
        rng.shuffle(ids)
        return ids, top + 11
    if kind < 0.9:  # an id given twice
        ids = [f"{rng.randint(0, top + 10):04d}" for _ in range(size)]
        return [*ids, ids[0]], top + 11
    return [f"{rng.randint(0, top + 10):04d}" for _ in range(size)], top + 11  # any order


async def test_event_ids_stay_unique_against_a_model_of_random_appends(log_url: str) -> None:
    # Event ids are unique across the whole log (DESIGN.md, "The log"), whichever way each is kept.
    rng = random.Random(20261205)
    held: dict[str, int] = {}  # id -> its global sequence
    versions = {"engine/a": 0, "engine/b": 0}
    top, refused, taken_steps = 0, 0, 0
    event_log = await _open(log_url)
    try:
        for _ in range(240):
            steps = []
            for stream in rng.sample(sorted(versions), rng.randint(1, 2)):
                ids, top = _random_step(rng, list(held), top)
                steps.append((stream, ids))
            given = [event_id for _, ids in steps for event_id in ids]
            clashing = {event_id for event_id in given if event_id in held or given.count(event_id) > 1}
            head = await event_log.head()
            batches = [batch(stream, versions[stream], [pending(event_id) for event_id in ids]) for stream, ids in steps]
            if clashing:
                with pytest.raises(AppendRejected) as refusal:
                    await event_log.append(batches)
                named = _NAMED.search(str(refusal.value))
                assert named is not None, refusal.value
                assert (named.group(1) or named.group(2)) in clashing, (refusal.value, clashing)
                at = _TAKEN_AT.search(str(refusal.value))
                if at is not None and at.group(1) in held:  # else taken by a batch before it in the append
                    assert held[at.group(1)] == int(at.group(2)), refusal.value
                assert await event_log.head() == head  # nothing of it kept
                refused += 1
                continue
            results = await event_log.append(batches)
            for (stream, ids), result in zip(steps, results, strict=True):
                held.update((event_id, result.first_seq + index) for index, event_id in enumerate(ids))
                versions[stream] += len(ids)
            taken_steps += len(steps)
        assert refused > 40 and taken_steps > 100  # both outcomes, many times
        assert {event.event_id: event.global_seq for event in await all_events(event_log)} == held
    finally:
        await event_log.close()
    if log_url.startswith("postgresql"):
        return
    runs, rows = await _counts(log_url)
    assert runs > 30 and rows > 30  # both ways of keeping ids were taken, many times
    event_log = await open_log(log_url)  # and a log opened afresh refuses every held id still
    try:
        for event_id, global_seq in rng.sample(sorted(held.items()), 25):
            with pytest.raises(AppendRejected, match=rf"event id '{event_id}' is taken \(global sequence {global_seq}\)"):
                await event_log.append([batch("engine/c", 0, [pending("9999-new"), pending(event_id)])])
    finally:
        await event_log.close()


@pytest.mark.parametrize("log_url", ["sqlite"], indirect=True)
async def test_an_id_inside_a_runs_bounds_is_taken_only_if_the_run_holds_it(log_url: str) -> None:
    event_log = await _open(log_url)
    try:
        await event_log.append([batch("engine/a", 0, [pending(i) for i in ("b-10", "b-20", "b-30")])])  # a run
        assert await _counts(log_url) == (1, 0)
        await event_log.append([batch("engine/b", 0, [pending("b-15"), pending("b-25")])])  # inside, not held
        with pytest.raises(AppendRejected, match=r"event id 'b-20' is taken \(global sequence 2\)"):
            await event_log.append([batch("engine/b", 2, [pending("a-0"), pending("b-20")])])
        with pytest.raises(AppendRejected, match=r"event id 'b-30' is taken \(global sequence 3\)"):
            # Ascending, starting at the highest run's last id: not a run, and refused.
            await event_log.append([batch("engine/b", 2, [pending("b-30"), pending("c-0")])])
        await event_log.append([batch("engine/b", 2, [pending("c-6"), pending("c-5")])])  # above every run: rows
        # Ascending above every run, but rows lie between its first and last id: rows too.
        await event_log.append([batch("engine/b", 4, [pending("c-1"), pending("c-9")])])
        with pytest.raises(AppendRejected, match=r"event id 'c-5' is taken \(global sequence 7\)"):
            await event_log.append([batch("engine/c", 0, [pending("c-0"), pending("c-5")])])
        [result] = await event_log.append([batch("engine/c", 0, pendings("d", 3))])  # a run again
        assert (result.first_seq, result.last_seq) == (10, 12)
        assert await _counts(log_url) == (2, 6)
        assert [e.event_id for e in await all_events(event_log)] == [
            "b-10", "b-20", "b-30", "b-15", "b-25", "c-6", "c-5", "c-1", "c-9", "d-0", "d-1", "d-2"
        ]  # fmt: skip
    finally:
        await event_log.close()


@pytest.mark.parametrize("log_url", ["sqlite"], indirect=True)
async def test_0009_downgrade_writes_each_runs_ids_back_as_rows(log_url: str) -> None:
    uuids = sorted(uuid.uuid4().hex for _ in range(1_300))  # more than a page of the downgrade's runs
    event_log = await _open(log_url)
    try:
        for index in range(0, 1_200, 1):  # 1,200 runs of one id
            await event_log.append([batch("engine/a", index, [pending(uuids[index])])])
        await event_log.append([batch("engine/b", 0, [pending(uuids[1_250]), pending(uuids[1_200])])])  # rows
        before = {event.event_id: event.global_seq for event in await all_events(event_log)}
    finally:
        await event_log.close()
    assert await _counts(log_url) == (1_200, 2)
    stored: dict[str, int] = {}

    def down_and_read(conn: sa.Connection) -> None:
        migrations.downgrade(conn, "0008")
        assert "kvl_id_runs" not in sa.inspect(conn).get_table_names()
        stored.update(tuple(row) for row in conn.execute(sa.text("SELECT event_id, global_seq FROM kvl_event_ids")))

    await _on_connection(log_url, down_and_read)
    assert stored == before
    assert await upgrade_log(log_url) == migrations.head()
    event_log = await open_log(log_url)
    try:
        assert isinstance(event_log, SqlEventLog)
        with pytest.raises(AppendRejected, match=rf"event id '{uuids[7]}' is taken \(global sequence 8\)"):
            await event_log.append([batch("engine/c", 0, [pending(uuids[1_299]), pending(uuids[7])])])
        await event_log.append([batch("engine/c", 0, [pending(uuids[1_299])])])
        assert await _counts(log_url) == (1, 1_202)
    finally:
        await event_log.close()


@pytest.mark.parametrize("log_url", ["sqlite"], indirect=True)
async def test_two_writers_on_one_file_keep_ids_unique_as_their_runs_interleave(log_url: str) -> None:
    # Two logs on one SQLite file (two sidecars, say), their ids from one clock: each append sees
    # the other's runs and rows (BEGIN IMMEDIATE), so interleaved ranges fall back to rows, and an
    # id one of them holds is refused to the other.
    clock = iter(range(1, 10_000))
    first, second = await _open(log_url), await _open(log_url)
    taken: dict[str, int] = {}
    try:

        async def write(event_log: SqlEventLog, name: str) -> None:
            version = 0
            for _ in range(60):
                # Ascending ids, a tick of the shared clock each: the two writers' ranges interleave.
                ids = [f"{next(clock):05d}-{name}" for _ in range(3)]
                [result] = await event_log.append([batch(f"engine/{name}", version, [pending(i) for i in ids])])
                taken.update((event_id, result.first_seq + index) for index, event_id in enumerate(ids))
                version += 3
                stolen = sorted(taken)[len(taken) // 2]  # a held id, either writer's
                with pytest.raises(AppendRejected, match=rf"event id '{stolen}' is taken \(global sequence {taken[stolen]}\)"):
                    await event_log.append([batch(f"engine/{name}", version, [pending(f"{next(clock):05d}-x"), pending(stolen)])])
                await anyio.sleep(0)

        async with anyio.create_task_group() as group:
            group.start_soon(write, first, "a")
            group.start_soon(write, second, "b")
        assert {event.event_id: event.global_seq for event in await all_events(first)} == taken
        assert len(taken) == 360
        runs, rows = await _counts(log_url)
        assert runs > 0 and rows > 0 and runs * 3 + rows == 360  # interleaved steps fell back to rows
    finally:
        await first.close()
        await second.close()
