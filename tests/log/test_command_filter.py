"""The Bloom filters of a SQL log's command ids (events/log/_command_filter.py): a group whose
ids are surely new is decided without a look-up in the database, and a retried command id is
still found, after a restart, after a failed append, and when another writer committed it."""

from __future__ import annotations

from typing import Any

import anyio
import pytest

from coordinator.core.commands import StartOwner
from coordinator.core.state import encode_state
from coordinator.ledger.ledger import Ledger
from coordinator.ledger.recovery import replay
from events import EventCodec
from events.log import AppendBatch, AppendResult, PendingEvent, WrongExpectedVersion, open_log, upgrade_log
from events.log._command_filter import FIRST_CAPACITY, CommandFilter
from events.log._sql import SqlEventLog
from tests.log.test_ledger import ENGINE, _declare

pytestmark = pytest.mark.anyio


def _result(last_seq: int, *, duplicate: bool = False) -> AppendResult:
    return AppendResult(stream_id="s", first_seq=last_seq, last_seq=last_seq, stream_version=1, duplicate=duplicate)


def _ready(ids: list[str], head: int) -> CommandFilter:
    known = CommandFilter()
    known.built(ids, head)
    return known


# --- the filter alone ---------------------------------------------------------------------------


def test_a_filter_never_misses_an_id_it_was_given_however_many() -> None:
    """Past its first filter's capacity it adds filters: every id given is still held."""
    ids = [f"engine-{i % 7}/step/{i}" for i in range(3 * FIRST_CAPACITY + 11)]
    known = _ready(ids[:1000], 1000)
    for index, command_id in enumerate(ids[1000:], start=1001):
        known.began()
        known.appended(index - 1, [command_id], [_result(index)])
    assert known.ready and known.through == len(ids)
    assert all(known.may_hold_any([command_id]) for command_id in ids)
    strangers = [f"stranger/{i}" for i in range(20_000)]
    assert sum(known.may_hold_any([command_id]) for command_id in strangers) <= 2  # 1e-6 an id


def test_an_append_that_began_at_the_filters_head_moves_it_on() -> None:
    known = _ready(["a"], 5)
    known.began()
    known.appended(5, ["b", None], [_result(7), _result(8)])
    assert known.ready and known.through == 8 and known.may_hold_any(["b"])
    assert not known.may_hold_any(["c"])


def test_an_append_that_began_past_the_filters_head_turns_it_off_for_good() -> None:
    """Another writer appended in between: its ids are not known here, so the filter is never
    trusted again (building it again at each of its appends would scan the table each time)."""
    known = _ready(["a"], 5)
    known.began()
    known.appended(9, ["b"], [_result(10)])
    assert known.off and not known.ready
    known.built(["a", "b"], 10)
    assert not known.ready


def test_a_head_past_the_filters_read_while_no_append_runs_turns_it_off() -> None:
    known = _ready(["a"], 5)
    known.began()
    known.saw_head(9)  # an append of ours is running: the head may be its own
    assert known.ready
    known.appended(5, ["b"], [_result(9)])
    known.saw_head(9)
    assert known.ready
    known.saw_head(10)
    assert known.off


@pytest.mark.parametrize("how", ["failed", "no expected head", "duplicate it did not hold"])
def test_an_append_whose_outcome_is_not_known_leaves_the_filter_to_be_built_again(how: str) -> None:
    known = _ready(["a"], 5)
    known.began()
    if how == "failed":
        known.failed()  # it may have committed all the same
    elif how == "no expected head":
        known.appended(None, ["b"], [_result(6)])
    else:
        known.appended(5, ["stranger"], [_result(3, duplicate=True)])
    assert not known.ready and not known.off and known.appending == 0


def test_a_duplicate_the_filter_held_changes_nothing() -> None:
    known = _ready(["a"], 5)
    known.began()
    known.appended(5, ["a"], [_result(2, duplicate=True)])
    assert known.ready and known.through == 5


def test_a_build_read_while_an_append_ran_is_not_trusted() -> None:
    known = CommandFilter()
    appends, running = known.appends, known.appending
    assert known.build_valid(appends, running)
    known.began()
    assert not known.build_valid(appends, running)  # one began during the read
    known.appended(5, ["b"], [_result(6)])
    assert not known.build_valid(appends, running)  # and ended: its ids may be missing
    assert known.build_valid(known.appends, known.appending)


# --- on a SQL log (SQLite and PostgreSQL: the `log_url` fixture) ----------------------------------


async def _open(url: str) -> SqlEventLog:
    if url.startswith("postgresql"):
        await upgrade_log(url)
    event_log = await open_log(url)
    assert isinstance(event_log, SqlEventLog)
    return event_log


def _count_lookups(event_log: SqlEventLog, monkeypatch: pytest.MonkeyPatch) -> list[list[str]]:
    """The look-ups that reached the database, recorded."""
    calls: list[list[str]] = []
    look_up = event_log._look_up_commands

    async def counted(command_ids: list[str], build: bool) -> Any:
        calls.append(list(command_ids))
        return await look_up(command_ids, build)

    monkeypatch.setattr(event_log, "_look_up_commands", counted)
    return calls


async def test_a_step_whose_command_id_is_new_is_decided_without_a_lookup_in_the_database(
    log_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    event_log = await _open(log_url)
    try:
        lookups = _count_lookups(event_log, monkeypatch)
        ledger = await Ledger.open(event_log)
        await _declare(ledger)
        for step in range(1, 6):
            await ledger.run_step(
                ENGINE, step, float(step), [StartOwner(engine_id=ENGINE, req_id=f"r{step}")], command_id=f"s{step}"
            )
        assert len(lookups) == 1  # the first builds the filter; the other four were surely new
        retry = await ledger.run_step(ENGINE, 3, 3.0, [StartOwner(engine_id=ENGINE, req_id="r3")], command_id="s3")
        assert retry.duplicate and lookups[-1] == ["s3"]  # a retried id is looked up, and found
        assert len(await event_log.read(0, 1000)) == await event_log.head()
    finally:
        await event_log.close()


async def test_a_command_id_committed_before_a_restart_is_found_after_it(log_url: str) -> None:
    event_log = await _open(log_url)
    ledger = await Ledger.open(event_log)
    await _declare(ledger)
    first = await ledger.run_step(ENGINE, 1, 1.0, [StartOwner(engine_id=ENGINE, req_id="r")], command_id="step-1")
    await ledger.close()
    await event_log.close()
    event_log = await _open(log_url)
    try:
        ledger = await Ledger.open(event_log)
        head = await event_log.head()
        await ledger.run_step(ENGINE, 2, 2.0, [StartOwner(engine_id=ENGINE, req_id="s")], command_id="step-2")
        retry = await ledger.run_step(ENGINE, 1, 1.0, [StartOwner(engine_id=ENGINE, req_id="r")], command_id="step-1")
        assert retry.duplicate and (retry.first_seq, retry.last_seq) == (first.first_seq, first.last_seq)
        assert await event_log.head() > head
        assert sorted(o.req_id for o in ledger.state.owners.values()) == ["r", "s"]
    finally:
        await event_log.close()


async def test_a_command_id_is_found_after_an_append_that_failed(log_url: str) -> None:
    """A failed append may have committed: the filter is built again before it is trusted."""
    event_log = await _open(log_url)
    try:
        ledger = await Ledger.open(event_log)
        await _declare(ledger)
        await ledger.run_step(ENGINE, 1, 1.0, [StartOwner(engine_id=ENGINE, req_id="r")], command_id="step-1")
        assert event_log._commands.ready
        event = PendingEvent(event_id="e", step=1, recorded_at=0.0, event_type="refused", schema_version=1, payload=b"")
        with pytest.raises(WrongExpectedVersion):
            await event_log.append([AppendBatch(stream_id="x", expected_version=5, events=[event], command_id="bad")])
        assert not event_log._commands.ready
        assert set(await event_log.find_commands(["step-1", "bad"])) == {"step-1"}
        assert event_log._commands.ready
    finally:
        await event_log.close()


@pytest.mark.parametrize("caught_up", [False, True])
async def test_a_command_another_writer_committed_is_never_committed_twice(log_url: str, caught_up: bool) -> None:
    """Two sidecars on one log, each its own log object: one commits a step; the same step,
    retried at the other, is answered as that commit (whether or not the other folded it in
    first), and the log holds it once."""
    first_log, second_log = await _open(log_url), await _open(log_url)
    try:
        first = await Ledger.open(first_log)
        await _declare(first)
        await first.run_step(ENGINE, 1, 1.0, [StartOwner(engine_id=ENGINE, req_id="r")], command_id="step-1")
        second = await Ledger.open(second_log)
        await second.run_step(ENGINE, 2, 2.0, [StartOwner(engine_id=ENGINE, req_id="s")], command_id="step-2")
        committed = await first.run_step(ENGINE, 2, 2.0, [StartOwner(engine_id=ENGINE, req_id="s")], command_id="step-2")
        assert committed.duplicate  # decided as new on the first's filter, refused (HeadMoved), found
        step = [StartOwner(engine_id=ENGINE, req_id="t")]
        original = await second.run_step(ENGINE, 3, 3.0, step, command_id="step-3")
        if caught_up:
            assert await first.catch_up() > 0
        retry = await first.run_step(ENGINE, 3, 3.0, step, command_id="step-3")
        assert retry.duplicate and (retry.first_seq, retry.last_seq) == (original.first_seq, original.last_seq)
        full, _ = await replay(first_log, EventCodec())
        assert sorted(o.req_id for o in full.owners.values()) == ["r", "s", "t"]
        assert encode_state(first.state) == encode_state(full)
    finally:
        await first_log.close()
        await second_log.close()


async def test_the_filter_holds_every_id_when_the_log_is_busy(log_url: str) -> None:
    """Look-ups while appends run (the committer decides the next group while the one before
    is appended): every id appended is found, none appended is missed."""
    event_log = await _open(log_url)
    try:
        stream = "busy"
        ids: list[str] = []

        async def appender() -> None:
            for index in range(60):
                command_id = f"c{index}"
                event = PendingEvent(
                    event_id=f"e{index}", step=index, recorded_at=0.0, event_type="refused", schema_version=1, payload=b""
                )
                head = await event_log.head()
                await event_log.append(
                    [AppendBatch(stream_id=stream, expected_version=index, events=[event], command_id=command_id)],
                    expected_head=head,
                )
                ids.append(command_id)

        async def looker() -> None:
            for _ in range(200):
                known = list(ids)
                found = await event_log.find_commands([*known, "never"])
                assert set(known) <= set(found) and "never" not in found
                await anyio.sleep(0)

        async with anyio.create_task_group() as tasks:
            tasks.start_soon(appender)
            tasks.start_soon(looker)
        assert set(await event_log.find_commands(ids)) == set(ids)
    finally:
        await event_log.close()
