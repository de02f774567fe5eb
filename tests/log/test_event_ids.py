"""Event ids are unique across the whole log (DESIGN.md, "The log"): an append that would break
that is refused naming the event id (one the log holds, with its global sequence, or one given
twice in the step), leaves the log as it was, and the next append is taken."""

from __future__ import annotations

from pathlib import Path

import pytest

from events.log import AppendRejected, open_log
from tests.log.test_log_contract import all_events, batch, pending, pendings

pytestmark = pytest.mark.anyio


@pytest.mark.parametrize(
    ("ids", "named"),
    [
        (["a-1", "b-0"], r"event id 'a-1' is taken \(global sequence 2\)"),  # engine/a's
        (["b-0", "b-0"], r"event id 'b-0' is given twice in the step"),
    ],
)
async def test_a_refused_append_names_the_event_id_leaves_the_log_unchanged_and_the_next_is_taken(
    tmp_path: Path, ids: list[str], named: str
) -> None:
    event_log = await open_log(f"sqlite:///{tmp_path / 'log.sqlite'}")
    try:
        await event_log.append([batch("engine/a", 0, pendings("a", 2))])
        with pytest.raises(AppendRejected, match=named):
            # Event ids are unique across the whole log (DESIGN.md, "The log").
            await event_log.append([batch("engine/b", 0, [pending(event_id) for event_id in ids])])
        assert [e.event_id for e in await all_events(event_log)] == ["a-0", "a-1"]
        assert await event_log.stream_version("engine/b") == 0
        [result] = await event_log.append([batch("engine/b", 0, pendings("b", 2))])
        assert (result.first_seq, result.last_seq) == (3, 4)
    finally:
        await event_log.close()
