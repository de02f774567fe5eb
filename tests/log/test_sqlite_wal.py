"""SQLite's WAL is copied into the database file beside the appends, never by one of them.

SQLite checkpoints on the commit that takes the WAL past `wal_autocheckpoint` pages (10,000:
40 MB): under ops/bench/hostile.py that one append took 40-55 ms and every engine's step waited
behind it. The log's own checkpointer (events/log/_sql.py, `_Checkpointer`) copies it in a thread
while appends come in; these tests watch the files and the threads, not the timing.
"""

from __future__ import annotations

import threading
from pathlib import Path

import anyio
import pytest

from events.log import open_log
from tests.kit.log_writer import append_steps

pytestmark = pytest.mark.anyio

CHECKPOINTER = "kvledger-wal-checkpoint"


def _checkpointers() -> list[threading.Thread]:
    return [thread for thread in threading.enumerate() if thread.name == CHECKPOINTER]


async def test_appends_are_checkpointed_into_the_database_file_in_the_background(tmp_path: Path) -> None:
    path = tmp_path / "log.sqlite"
    event_log = await open_log(f"sqlite:///{path}")
    try:
        assert _checkpointers() == []  # opened, nothing appended: nothing started
        empty = path.stat().st_size
        await append_steps(event_log, "engine/a", 200, 8)  # ~1,600 events: far below 10,000 WAL pages
        with anyio.fail_after(10):
            while path.stat().st_size <= empty:  # SQLite alone would leave all of it in the WAL
                await anyio.sleep(0.05)
        assert len(_checkpointers()) == 1
        assert await event_log.head() == 1600
    finally:
        await event_log.close()
    assert _checkpointers() == []  # closed with its log


async def test_a_log_only_read_starts_no_checkpointer(tmp_path: Path) -> None:
    path = tmp_path / "log.sqlite"
    event_log = await open_log(f"sqlite:///{path}")
    await append_steps(event_log, "engine/a", 3, 2)
    await event_log.close()
    reader = await open_log(f"sqlite:///{path}")
    try:
        assert [step.stream_id for step in await reader.read_steps(0, 100)] == ["engine/a"] * 3
        assert _checkpointers() == []
    finally:
        await reader.close()
