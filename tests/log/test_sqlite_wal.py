"""SQLite's WAL is copied into the database file beside the appends, never by one of them, and
starts afresh while appends keep coming.

SQLite checkpoints on the commit that takes the WAL past `wal_autocheckpoint` pages (10,000:
40 MB): under ops/bench/hostile.py that one append took 40-55 ms and every engine's step waited
behind it. The log's own checkpointer (events/log/_sql.py, `_Checkpointer`) copies it in a thread
while appends come in, and past RESTART_FRAMES copies the rest with the appends held, so that
the next append starts the WAL afresh; these tests watch the files and the threads, not the timing.
"""

from __future__ import annotations

import sqlite3
import threading
from pathlib import Path

import anyio
import pytest

import events.log._sql as sql_log
from events.log import SqlEventLog, StoredStep, open_log
from tests.kit.log_writer import append_steps, payload_for

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


@pytest.fixture
def restart_early(monkeypatch: pytest.MonkeyPatch) -> None:
    """The checkpointer every 10 ms, starting the WAL afresh past 40 frames (160 KiB)."""
    monkeypatch.setattr(sql_log, "CHECKPOINT_EVERY", 0.01)
    monkeypatch.setattr(sql_log, "RESTART_FRAMES", 40)


async def _wal_bytes_after_appends(path: Path) -> tuple[int, int, list[StoredStep]]:
    """(the WAL's size, the checkpointer's restarts, the steps read back) after 600 steps of 8
    events appended one after another, with no pause between them: a checkpoint beside them never
    reaches the WAL's end by itself."""
    event_log = await open_log(f"sqlite:///{path}")
    assert isinstance(event_log, SqlEventLog) and event_log._checkpointer is not None
    try:
        await append_steps(event_log, "engine/a", 600, 8)
        wal = path.with_name(path.name + "-wal").stat().st_size
        return wal, event_log._checkpointer.restarts, await event_log.read_steps(0, 600 * 8)
    finally:
        await event_log.close()


async def test_the_wal_starts_afresh_while_appends_come_one_after_another(
    tmp_path: Path, restart_early: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    wal, restarts, steps = await _wal_bytes_after_appends(tmp_path / "restarted.sqlite")
    # Each commit writes several frames; a WAL that never starts afresh holds them all (~2,400
    # here: short of wal_autocheckpoint, SQLite's own bound), one that does is written over.
    monkeypatch.setattr(sql_log, "RESTART_FRAMES", 10**9)
    never_wal, never_restarts, _ = await _wal_bytes_after_appends(tmp_path / "never.sqlite")
    assert never_restarts == 0 and restarts >= 3
    # The file keeps its largest size: how far the WAL grew between two restarts depends on when
    # the checkpointer's thread got the CPU (on a loaded host, session 30: 12.7 MB of the 22.4 a
    # WAL never started afresh reached; 2.8-3.5 MB when quiet). That it was written over is the point.
    assert wal < never_wal
    # Nothing was lost or reordered by the appends held while a checkpoint finished.
    assert [(step.first_seq, step.stream_id) for step in steps] == [(1 + 8 * n, "engine/a") for n in range(600)]
    assert [event.payload for event in steps[-1].events()] == [payload_for("engine/a", 600, i) for i in range(8)]


async def test_a_reader_holding_its_snapshot_holds_up_neither_appends_nor_the_checkpointer(
    tmp_path: Path, restart_early: None
) -> None:
    """A checkpoint that finishes with the appends held never waits for a reader (PASSIVE): it
    copies what the reader's snapshot allows, and the WAL starts afresh on a later try."""
    path = tmp_path / "log.sqlite"
    event_log = await open_log(f"sqlite:///{path}")
    assert isinstance(event_log, SqlEventLog) and event_log._checkpointer is not None
    await append_steps(event_log, "engine/a", 5, 8)
    reader = sqlite3.connect(path, isolation_level=None)
    try:
        reader.execute("BEGIN")
        assert reader.execute("SELECT count(*) FROM kvl_steps").fetchone() == (5,)  # its snapshot, held
        with anyio.fail_after(60):  # a checkpoint waiting for the reader would hold the appends for good
            while event_log._checkpointer.restarts < 3:
                await append_steps(event_log, "engine/a", 20, 8)
                await anyio.sleep(0.02)
        assert reader.execute("SELECT count(*) FROM kvl_steps").fetchone() == (5,)  # its snapshot still
        reader.execute("COMMIT")
        assert reader.execute("SELECT max(last_seq) FROM kvl_steps").fetchone() == (await event_log.head(),)
    finally:
        reader.close()
        await event_log.close()
