"""A command id names one append of one batch (exactly once): a batch whose command id the log
already holds, from an earlier append or from a batch before it in the same append, is answered
with that first result (duplicate, with its digest) and appends nothing; a batch with no events
records its command id too. On both SQL logs: PostgreSQL decides an append's batches from one
look-up and writes them in one statement (events/log/_postgres_append.py), SQLite a statement
at a time."""

from __future__ import annotations

import msgspec
import pytest

from events.log import AppendBatch, AppendResult, EventLog
from tests.log.test_log_contract import all_events, pendings

pytestmark = pytest.mark.anyio

DIGEST = b"\x00digest of the command\xff"


def _batch(stream: str, expected: int, prefix: str, count: int, command_id: str | None, digest: bytes | None) -> AppendBatch:
    return AppendBatch(
        stream_id=stream, expected_version=expected, events=pendings(prefix, count), command_id=command_id, digest=digest
    )


async def test_a_command_retried_in_the_same_append_or_a_later_one_answers_its_first_result(event_log: EventLog) -> None:
    first, again_within = await event_log.append(
        [_batch("engine/a", 0, "a", 2, "cmd-1", DIGEST), _batch("engine/b", 0, "b", 3, "cmd-1", DIGEST)]
    )
    assert first == AppendResult(stream_id="engine/a", first_seq=1, last_seq=2, stream_version=2, digest=DIGEST)
    assert again_within == msgspec.structs.replace(first, duplicate=True)
    assert await event_log.head() == 2 and await event_log.stream_version("engine/b") == 0
    # Later: the same command id answers the same, whatever the batch; others go on from the head.
    later, empty, undigested = await event_log.append(
        [
            _batch("engine/a", 0, "x", 1, "cmd-1", b"other content"),
            _batch("engine/b", 0, "e", 0, "cmd-empty", DIGEST),  # no events: only its command id is kept
            _batch("engine/b", 0, "b", 2, "cmd-2", None),
        ]
    )
    assert later == msgspec.structs.replace(first, duplicate=True)
    assert empty == AppendResult(stream_id="engine/b", first_seq=0, last_seq=0, stream_version=0, digest=DIGEST)
    assert undigested == AppendResult(stream_id="engine/b", first_seq=3, last_seq=4, stream_version=2, digest=None)
    retried = await event_log.append(
        [_batch("engine/b", 2, "z", 1, "cmd-empty", None), _batch("engine/b", 2, "z", 1, "cmd-2", None)]
    )
    assert retried == [msgspec.structs.replace(empty, duplicate=True), msgspec.structs.replace(undigested, duplicate=True)]
    assert [(e.event_id, e.stream_id, e.global_seq) for e in await all_events(event_log)] == [
        ("a-0", "engine/a", 1), ("a-1", "engine/a", 2), ("b-0", "engine/b", 3), ("b-1", "engine/b", 4)
    ]  # fmt: skip
    assert await event_log.stream_version("engine/b") == 2


async def test_several_batches_of_one_stream_in_one_append_take_consecutive_versions(event_log: EventLog) -> None:
    results = await event_log.append(
        [
            _batch("engine/a", 0, "a", 2, None, None),
            _batch("engine/a", 2, "b", 1, "c", None),
            _batch("engine/a", 3, "c", 2, None, None),
        ]
    )
    assert [(r.first_seq, r.last_seq, r.stream_version) for r in results] == [(1, 2, 2), (3, 3, 3), (4, 5, 5)]
    assert await event_log.stream_version("engine/a") == 5
    [next_one] = await event_log.append([_batch("engine/a", 5, "d", 1, None, None)])
    assert (next_one.first_seq, next_one.stream_version) == (6, 6)
