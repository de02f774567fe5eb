"""Event ids stay unique across the whole log (DESIGN.md, "The log") when a step whose ids
ascend above every id the log holds is kept as one run (kvl_id_runs: migration 0009 on SQLite,
0010 on PostgreSQL) instead of a kvl_event_ids row each: an append is taken exactly when its ids
are distinct and none is held, whichever way each earlier step (or an earlier batch of the same
append) was kept; a refusal names the id (with the global sequence holding it wherever
kvledger's own check refused it) and leaves the log as it was; a downgrade writes every run's
ids back as rows."""

from __future__ import annotations

import random
import re
import uuid

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
    runs, rows = await _counts(log_url)
    assert runs > 30 and rows > 30  # both ways of keeping ids were taken, many times
    event_log = await open_log(log_url)  # and a log opened afresh refuses every held id still
    try:
        for event_id, global_seq in rng.sample(sorted(held.items()), 25):
            with pytest.raises(AppendRejected) as refusal:
                await event_log.append([batch("engine/c", 0, [pending("9999-new"), pending(event_id)])])
            _names(refusal.value, event_id, global_seq)
    finally:
        await event_log.close()


def _names(refusal: BaseException, event_id: str, global_seq: int) -> None:
    """The refusal names `event_id`: with its global sequence wherever kvledger's own check
    refused it (SQLite, or a run's id on PostgreSQL); by PostgreSQL's unique violation otherwise."""
    at = _TAKEN_AT.search(str(refusal))
    if at is not None:
        assert (at.group(1), int(at.group(2))) == (event_id, global_seq), refusal
    else:
        assert f"(event_id)=({event_id}) already exists" in str(refusal), refusal


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
        with pytest.raises(AppendRejected) as refusal:
            await event_log.append([batch("engine/c", 0, [pending("c-0"), pending("c-5")])])
        _names(refusal.value, "c-5", 7)
        [result] = await event_log.append([batch("engine/c", 0, pendings("d", 3))])  # a run again
        assert (result.first_seq, result.last_seq) == (10, 12)
        assert await _counts(log_url) == (2, 6)
        assert [e.event_id for e in await all_events(event_log)] == [
            "b-10", "b-20", "b-30", "b-15", "b-25", "c-6", "c-5", "c-1", "c-9", "d-0", "d-1", "d-2"
        ]  # fmt: skip
    finally:
        await event_log.close()


async def _runs_and_rows(log_url: str) -> tuple[list[str], dict[str, int]]:
    """1,200 runs of one id (more than a page of a downgrade's runs) and one step of 2 rows, on
    a new log: (sorted uuids, the first 1,200 and two more of them held; 100 left), and each
    held id's global sequence."""
    uuids = sorted(uuid.uuid4().hex for _ in range(1_300))
    event_log = await _open(log_url)
    try:
        for index in range(1_200):
            await event_log.append([batch("engine/a", index, [pending(uuids[index])])])
        await event_log.append([batch("engine/b", 0, [pending(uuids[1_250]), pending(uuids[1_200])])])  # rows
        held = {event.event_id: event.global_seq for event in await all_events(event_log)}
    finally:
        await event_log.close()
    assert await _counts(log_url) == (1_200, 2)
    return uuids, held


@pytest.mark.parametrize("log_url", ["sqlite"], indirect=True)
async def test_0009_downgrade_writes_each_runs_ids_back_as_rows(log_url: str) -> None:
    uuids, before = await _runs_and_rows(log_url)
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


async def test_two_writers_on_one_log_keep_ids_unique_as_their_runs_interleave(log_url: str) -> None:
    # Two logs on one database (two sidecars, say), their ids from one clock: each append sees the
    # other's runs and rows (BEGIN IMMEDIATE on SQLite, the advisory lock on PostgreSQL). Both
    # draw their ids, then append in an order drawn at random: when the later ids commit first,
    # the earlier ones lie below the highest run and fall back to rows; an id either holds is
    # refused to the other.
    rng = random.Random(7)
    clock = iter(range(1, 10_000))
    logs = {"a": await _open(log_url), "b": await _open(log_url)}
    versions = dict.fromkeys(logs, 0)
    taken: dict[str, int] = {}
    try:
        for _ in range(60):
            drawn = {name: [f"{next(clock):05d}-{name}" for _ in range(3)] for name in logs}
            for name in rng.sample(sorted(logs), 2):
                event_log = logs[name]
                [result] = await event_log.append([batch(f"engine/{name}", versions[name], [pending(i) for i in drawn[name]])])
                taken.update((event_id, result.first_seq + index) for index, event_id in enumerate(drawn[name]))
                versions[name] += 3
                stolen = sorted(taken)[rng.randrange(len(taken))]  # a held id, either writer's
                with pytest.raises(AppendRejected) as refusal:
                    await event_log.append(
                        [batch(f"engine/{name}", versions[name], [pending(f"{next(clock):05d}-x"), pending(stolen)])]
                    )
                named = _NAMED.search(str(refusal.value))
                assert named is not None and stolen in (named.group(1), named.group(2)), refusal.value
                at = _TAKEN_AT.search(str(refusal.value))
                assert at is None or int(at.group(2)) == taken[stolen], refusal.value
        assert {event.event_id: event.global_seq for event in await all_events(logs["a"])} == taken
        assert len(taken) == 360
        runs, rows = await _counts(log_url)
        assert runs > 10 and rows > 10 and runs * 3 + rows == 360  # the later ids first: rows
    finally:
        for event_log in logs.values():
            await event_log.close()


async def test_one_append_counts_its_own_runs_and_rows_step_by_step(log_url: str) -> None:
    # Several batches in one append (a committer's group of engines' steps): each step is kept as
    # if appended alone after the batches before it (PostgreSQL decides them all from one look-up).
    event_log = await _open(log_url)
    try:
        # A run, then rows whose ids lie inside it (not its own): taken; then a run above both.
        await event_log.append(
            [
                batch("engine/a", 0, [pending(i) for i in ("k-10", "k-20", "k-30")]),
                batch("engine/b", 0, [pending("k-25"), pending("k-15")]),
                batch("engine/c", 0, [pending(i) for i in ("m-1", "m-2")]),
            ]
        )
        assert await _counts(log_url) == (2, 2)
        # Rows first, then an ascending step straddling one of them: rows too, not a run.
        await event_log.append(
            [batch("engine/a", 3, [pending("p-5"), pending("p-1")]), batch("engine/b", 2, [pending("p-0"), pending("p-9")])]
        )
        assert await _counts(log_url) == (2, 6)
        # A run, then a step of this append reusing its id: refused, naming the run's sequence.
        head = await event_log.head()
        with pytest.raises(AppendRejected, match=r"event id 'q-2' is taken \(global sequence 13\)"):
            await event_log.append(
                [
                    batch("engine/a", 5, [pending(i) for i in ("q-1", "q-2", "q-3")]),
                    batch("engine/b", 4, [pending("q-9"), pending("q-2")]),
                ]
            )
        assert await event_log.head() == head and await _counts(log_url) == (2, 6)  # nothing of it kept
        # A step below the highest run (even a run of this append) is rows: its ids are checked one by one.
        with pytest.raises(AppendRejected) as refusal:
            await event_log.append([batch("engine/c", 2, [pending("r-1")]), batch("engine/a", 5, [pending("k-20")])])
        _names(refusal.value, "k-20", 2)
        # Rows of this append above an ascending step's bounds do not lie between them: still a run.
        await event_log.append(
            [batch("engine/c", 2, [pending("z-9"), pending("z-1")]), batch("engine/a", 5, [pending("y-1"), pending("y-2")])]
        )
        assert await _counts(log_url) == (3, 8)
        assert [e.event_id for e in await all_events(event_log)] == [
            "k-10", "k-20", "k-30", "k-25", "k-15", "m-1", "m-2", "p-5", "p-1", "p-0", "p-9", "z-9", "z-1", "y-1", "y-2"
        ]  # fmt: skip
    finally:
        await event_log.close()


@pytest.mark.parametrize("log_url", ["postgresql"], indirect=True)
async def test_0010_downgrade_writes_postgresqls_runs_back_as_rows(log_url: str) -> None:
    uuids, before = await _runs_and_rows(log_url)
    stored: dict[str, int] = {}
    collations: list[str | None] = []

    def down_and_read(conn: sa.Connection) -> None:
        migrations.downgrade(conn, "0009")
        stored.update(tuple(row) for row in conn.execute(sa.text("SELECT event_id, global_seq FROM kvl_event_ids")))
        assert conn.execute(sa.text("SELECT count(*) FROM kvl_id_runs")).scalar_one() == 0
        collations.extend(
            conn.execute(
                sa.text(
                    "SELECT collation_name FROM information_schema.columns "
                    "WHERE table_name IN ('kvl_event_ids', 'kvl_id_runs') AND data_type = 'character varying' ORDER BY column_name"
                )
            ).scalars()
        )

    await _on_connection(log_url, down_and_read)
    assert stored == before
    assert collations == [None, None, None]  # the database's own again
    assert await upgrade_log(log_url) == migrations.head()
    event_log = await open_log(log_url)
    try:
        with pytest.raises(AppendRejected, match=rf"\(event_id\)=\({uuids[7]}\) already exists"):
            await event_log.append([batch("engine/c", 0, [pending(uuids[1_299]), pending(uuids[7])])])
        await event_log.append([batch("engine/c", 0, [pending(uuids[1_299])])])  # above every id: a run again
        assert await _counts(log_url) == (1, 1_202)
    finally:
        await event_log.close()
