"""The core on the durable log: recovery, snapshots (I18), retries, failed appends."""

from __future__ import annotations

import anyio
import msgspec
import pytest
import sqlalchemy as sa
from structlog.testing import capture_logs

from coordinator.core.commands import (
    AllocateBlocks,
    DeclareEngine,
    DeclareTier,
    FinishOwner,
    FreeBlocks,
    MarkComputed,
    ReportRank,
    StartOwner,
    StartStore,
)
from coordinator.core.state import encode_state
from coordinator.core.step import REFUSED_NAMES_STREAM
from coordinator.ledger.ledger import Ledger, Step, StepCommit
from coordinator.ledger.recovery import make_snapshot, recover, replay
from events import BlocksAllocated, EventCodec, OwnerStarted, Reason, Refused, StoreJobStarted, TierSpec
from events.log import AppendBatch, AppendResult, EventLog, HeadMoved, LogUnavailable, PendingEvent, Snapshot
from tests.kit import builders as b

pytestmark = pytest.mark.anyio
ENGINE = b.ENGINE


async def _declare(ledger: Ledger) -> None:
    await ledger.execute(DeclareTier(spec=TierSpec(name=b.TIER, num_slots=8, bytes_per_slot=64)))
    pools = [b.attention_pool(num_blocks=12)]
    await ledger.execute(
        DeclareEngine(engine_id=ENGINE, namespace=b.namespace(block_sizes=(b.BLOCK,)), pools=pools, world_size=2, tiers=[b.TIER])
    )


async def _serve_request(ledger: Ledger, index: int, clock: float) -> None:
    """Four steps of one request: admit, allocate + compute + store, report, finish."""
    engine = ledger.state.engines[ENGINE]
    step = engine.step + 1
    commit = await ledger.run_step(ENGINE, step, clock, [StartOwner(engine_id=ENGINE, req_id=f"req-{index}")])
    owner = next(e for e in commit.events if isinstance(e, OwnerStarted)).owner_id
    commit = await ledger.run_step(
        ENGINE, step + 1, clock + 0.1, [AllocateBlocks(engine_id=ENGINE, owner_id=owner, pool_id=0, count=2)]
    )
    blocks = next(e for e in commit.events if isinstance(e, BlocksAllocated)).blocks
    tokens = [index * 100 + i for i in range(2 * b.BLOCK)]
    commit = await ledger.run_step(
        ENGINE,
        step + 2,
        clock + 0.2,
        [
            MarkComputed(engine_id=ENGINE, owner_id=owner, blocks=blocks, token_ids=tokens),
            StartStore(engine_id=ENGINE, tier=b.TIER, blocks=blocks),
        ],
    )
    job = next(e for e in commit.events if isinstance(e, StoreJobStarted))
    reports = [
        ReportRank(job_id=job.job_id, rank=rank, ok=True, checksums=[b.checksum(i.key, rank) for i in job.items])
        for rank in (1, 0)
    ]
    await ledger.run_step(ENGINE, step + 3, clock + 0.3, [*reports, FinishOwner(engine_id=ENGINE, owner_id=owner)])


async def test_I18_snapshot_plus_tail_equals_a_full_replay_of_the_log(event_log: EventLog) -> None:
    ledger = await Ledger.open(event_log, snapshot_every=5)  # 24 steps: a 4-step tail
    await _declare(ledger)
    for index in range(6):
        await _serve_request(ledger, index, clock=float(index))
    live = encode_state(ledger.state)
    snapshots = await event_log.snapshots(limit=100)
    assert snapshots and snapshots[0].global_seq < await event_log.head()  # a tail to fold
    recovered, last = await recover(event_log, EventCodec())
    full, full_last = await replay(event_log, EventCodec())
    assert last == full_last == await event_log.head()
    assert encode_state(recovered) == encode_state(full) == live
    await ledger.close()  # clean shutdown leaves a snapshot at the head
    assert (await event_log.snapshots())[0].global_seq == await event_log.head()
    reopened = await Ledger.open(event_log)
    assert encode_state(reopened.state) == live


async def test_a_snapshot_whose_digest_does_not_match_is_ignored_with_a_warning(event_log: EventLog) -> None:
    ledger = await Ledger.open(event_log, snapshot_every=1000)
    await _declare(ledger)
    await _serve_request(ledger, 1, clock=1.0)
    good = make_snapshot(ledger.state, ledger.last_seq)
    await event_log.save_snapshot(msgspec.structs.replace(good, digest="0" * 64))
    with capture_logs() as logs:
        recovered, _ = await recover(event_log, EventCodec())
    assert any(entry["event"] == "snapshot_ignored" and "digest" in entry["reason"] for entry in logs)
    assert any(entry["event"] == "recovery_full_replay" for entry in logs)
    assert encode_state(recovered) == encode_state(ledger.state)


async def test_a_retried_command_id_returns_the_original_commit_and_appends_nothing(event_log: EventLog) -> None:
    ledger = await Ledger.open(event_log)
    await _declare(ledger)
    first = await ledger.run_step(ENGINE, 1, 1.0, [StartOwner(engine_id=ENGINE, req_id="r")], command_id="step-1")
    head = await event_log.head()
    retry = await ledger.run_step(ENGINE, 1, 1.0, [StartOwner(engine_id=ENGINE, req_id="r")], command_id="step-1")
    assert retry.duplicate and (retry.first_seq, retry.last_seq) == (first.first_seq, first.last_seq)
    assert retry.events == first.events
    assert await event_log.head() == head
    full, _ = await replay(event_log, EventCodec())
    assert encode_state(full) == encode_state(ledger.state)


async def test_an_append_refused_because_another_writer_appended_first_rebuilds_and_is_decided_again(
    event_log: EventLog,
) -> None:
    """Another writer appends between two of the ledger's steps (here to the engine's own stream).
    The next append names the head it was decided on, so the log refuses it (HeadMoved) whatever
    stream the other wrote; the state is rebuilt from the log, with the other's event, and the
    step is decided again on top of it: the state equals the log's, nothing is lost."""
    ledger = await Ledger.open(event_log)
    await _declare(ledger)
    await ledger.run_step(ENGINE, 1, 1.0, [StartOwner(engine_id=ENGINE, req_id="r")])
    stream = f"engine/{ENGINE}"
    intruder = PendingEvent(
        event_id="intruder",
        step=9,
        recorded_at=0.0,
        event_type="refused",
        schema_version=1,
        payload=EventCodec().encode(Refused(engine_id=ENGINE, command="x", reason=Reason.INVALID_ARGUMENT, detail="x"))[2],
    )
    head = await event_log.head()
    with pytest.raises(HeadMoved):  # what the ledger's append meets: the log is past its head
        await event_log.append([AppendBatch(stream_id="elsewhere", expected_version=0, events=[])], expected_head=head - 1)
    await event_log.append(
        [AppendBatch(stream_id=stream, expected_version=await event_log.stream_version(stream), events=[intruder])]
    )
    commit = await ledger.run_step(ENGINE, 2, 2.0, [StartOwner(engine_id=ENGINE, req_id="again")])
    assert commit.first_seq == head + 2  # after the intruder's event
    full, _ = await replay(event_log, EventCodec())
    assert encode_state(ledger.state) == encode_state(full)
    assert sorted(o.req_id for o in ledger.state.owners.values()) == ["again", "r"]


async def test_a_ledger_catches_up_with_what_another_writer_appended(event_log: EventLog) -> None:
    """Two ledgers on one log (two sidecars of a fleet): what one commits, the other folds in
    when it catches up (its lookups then see it), and its own next step lands after it."""
    first = await Ledger.open(event_log)
    await _declare(first)
    second = await Ledger.open(event_log)
    await first.run_step(ENGINE, 1, 1.0, [StartOwner(engine_id=ENGINE, req_id="r")])
    assert not second.state.owners
    assert await second.catch_up() > 0
    assert [o.req_id for o in second.state.owners.values()] == ["r"]
    assert await second.catch_up() == 0
    await second.run_step(ENGINE, 2, 2.0, [StartOwner(engine_id=ENGINE, req_id="s")])
    await first.run_step(ENGINE, 3, 3.0, [StartOwner(engine_id=ENGINE, req_id="t")])  # HeadMoved, decided again
    full, _ = await replay(event_log, EventCodec())
    await second.catch_up()
    assert encode_state(first.state) == encode_state(full) == encode_state(second.state)
    assert sorted(o.req_id for o in full.owners.values()) == ["r", "s", "t"]


async def test_refusals_are_committed_to_the_log(event_log: EventLog) -> None:
    ledger = await Ledger.open(event_log)
    await _declare(ledger)
    commit = await ledger.run_step(ENGINE, 1, 1.0, [AllocateBlocks(engine_id=ENGINE, owner_id=42, pool_id=0, count=1)])
    refused = [e for e in commit.events if isinstance(e, Refused)]
    assert refused and refused[0].reason is Reason.UNKNOWN_OWNER
    stored = await event_log.read(commit.first_seq - 1, commit.last_seq - commit.first_seq + 1)
    assert "refused" in [s.event_type for s in stored]


async def test_a_tier_or_engine_named_longer_than_a_stream_is_refused_and_the_refusal_committed(event_log: EventLog) -> None:
    """A stream id is at most 255 characters (kvl_steps.stream_id). A DeclareTier of a 300-character
    name went to the stream "tier/<name>": PostgreSQL refused the append, the group failed and the
    ledger was rebuilt from the log, once for every declaration an attacker sent (an adversarial
    review, session 31). Now the name is refused and the refusal committed to REFUSED_NAMES_STREAM;
    the log serves on."""
    ledger = await Ledger.open(event_log)
    await _declare(ledger)
    head = await event_log.head()
    tier = await ledger.execute(DeclareTier(spec=TierSpec(name="t" * 300, num_slots=8, bytes_per_slot=64)))
    engine = await ledger.execute(
        DeclareEngine(
            engine_id="e" * 300, namespace=b.namespace(block_sizes=(b.BLOCK,)), pools=[b.attention_pool()], world_size=2
        )
    )
    for commit, what in ((tier, "tier name"), (engine, "engine_id")):
        [refused] = commit.events
        assert isinstance(refused, Refused) and refused.reason is Reason.INVALID_ARGUMENT and what in refused.detail
    stored = await event_log.read(head, 10)
    assert [(s.stream_id, s.event_type) for s in stored] == [(REFUSED_NAMES_STREAM, "refused")] * 2
    await _serve_request(ledger, 0, 1.0)  # and the ledger goes on


async def test_sqlite_work_never_runs_on_the_event_loop(tmp_path: pytest.TempPathFactory) -> None:
    """STYLE 10: every SQLite statement of a ledger's life runs in aiosqlite's thread. SQLite's
    trace callback fires in the thread that executes each statement; record them all."""
    import threading
    from pathlib import Path

    from events.log import SqlEventLog, open_log

    event_log = await open_log(str(Path(str(tmp_path)) / "trace.sqlite"))
    assert isinstance(event_log, SqlEventLog) and event_log.blocking_engine is not None
    executed_in: list[int] = []

    def trace(_sql: str) -> None:
        executed_in.append(threading.get_ident())

    # The hot paths (append, read) run on a pysqlite engine in worker threads ...
    sa.event.listen(event_log.blocking_engine, "connect", lambda dbapi, _record: dbapi.set_trace_callback(trace))
    # ... and the rest on aiosqlite, whose pooled connection already exists.
    async with event_log.engine.connect() as conn:
        raw = await conn.get_raw_connection()
        await raw.driver_connection.set_trace_callback(trace)  # type: ignore[union-attr]
    ledger = await Ledger.open(event_log, snapshot_every=2)
    await _declare(ledger)
    await _serve_request(ledger, 1, clock=1.0)
    await ledger.close()
    await event_log.read(0)
    assert event_log.engine.pool.checkedin() == 1  # type: ignore[attr-defined]  # one pooled connection: the traced one
    assert len(set(executed_in)) >= 2  # both engines' threads executed statements
    assert len(executed_in) > 20
    assert threading.get_ident() not in executed_in
    await event_log.close()


async def test_a_snapshot_being_written_does_not_hold_up_the_next_step(
    event_log: EventLog, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The state is encoded under the ledger's lock, but written to the log after it: a slow
    snapshot write (held open here) does not stop the next step from committing."""
    ledger = await Ledger.open(event_log, snapshot_every=1)
    await _declare(ledger)
    release, writing = anyio.Event(), anyio.Event()
    save = event_log.save_snapshot

    async def slow_save(snapshot: Snapshot) -> None:
        writing.set()
        await release.wait()
        await save(snapshot)

    monkeypatch.setattr(event_log, "save_snapshot", slow_save)
    with anyio.fail_after(20):
        async with anyio.create_task_group() as tasks:
            tasks.start_soon(ledger.run_step, ENGINE, 1, 1.0, [StartOwner(engine_id=ENGINE, req_id="first")])
            await writing.wait()  # step 1 is committed; its snapshot is being written
            monkeypatch.setattr(event_log, "save_snapshot", save)
            commit = await ledger.run_step(ENGINE, 2, 2.0, [StartOwner(engine_id=ENGINE, req_id="second")])
            assert commit.first_seq > 0
            release.set()
    assert [s.global_seq for s in await event_log.snapshots()][:2] == [ledger.last_seq, commit.first_seq - 1]


async def test_only_the_newest_snapshots_are_kept(event_log: EventLog) -> None:
    """Recovery reads the newest valid snapshot: the log keeps KEEP_SNAPSHOTS of them, not one
    per `snapshot_every` steps forever (each is a whole state)."""
    from events.log._sql import KEEP_SNAPSHOTS

    ledger = await Ledger.open(event_log, snapshot_every=1)
    await _declare(ledger)
    for step in range(1, KEEP_SNAPSHOTS + 4):
        await ledger.run_step(ENGINE, step, float(step), [StartOwner(engine_id=ENGINE, req_id=f"r{step}")])
    kept = await event_log.snapshots(limit=100)
    assert len(kept) == KEEP_SNAPSHOTS
    assert kept[0].global_seq == ledger.last_seq
    await ledger.close()
    reopened = await Ledger.open(event_log)
    assert encode_state(reopened.state) == encode_state(ledger.state)


async def test_a_retried_step_gives_back_its_end_of_step_notices_with_its_end(event_log: EventLog) -> None:
    """A step whose end-of-step reconciliation dropped a notice (I14: a block freed and taken
    again in the same step), retried with its command id: the reply keeps the dropped notice with
    StepEnded, as the original did, not after the commands' events (the soak's regrouping of a
    retried step found it there: "1 events left after the last command")."""
    ledger = await Ledger.open(event_log)
    await ledger.execute(DeclareTier(spec=TierSpec(name=b.TIER, num_slots=8, bytes_per_slot=64)))
    await ledger.execute(
        DeclareEngine(
            engine_id=ENGINE,
            namespace=b.namespace(block_sizes=(b.BLOCK,)),
            pools=[b.attention_pool(num_blocks=2)],
            world_size=2,
            tiers=[b.TIER],
        )
    )
    commit = await ledger.run_step(
        ENGINE, 1, 1.0, [StartOwner(engine_id=ENGINE, req_id="a"), StartOwner(engine_id=ENGINE, req_id="b")]
    )
    first, second = [e.owner_id for e in commit.events if isinstance(e, OwnerStarted)]
    commit = await ledger.run_step(ENGINE, 2, 2.0, [AllocateBlocks(engine_id=ENGINE, owner_id=first, pool_id=0, count=1)])
    [old] = next(e for e in commit.events if isinstance(e, BlocksAllocated)).blocks
    step = Step(
        engine_id=ENGINE,
        step=3,
        clock=3.0,
        command_id="step-3",
        commands=[
            FreeBlocks(engine_id=ENGINE, owner_id=first, blocks=[old]),
            AllocateBlocks(engine_id=ENGINE, owner_id=second, pool_id=0, count=1),
        ],
    )
    [original] = await ledger.commit_group([step])
    [retried] = await ledger.commit_group([step])
    assert isinstance(original, StepCommit) and isinstance(retried, StepCommit) and retried.commit.duplicate
    assert [(type(e).__name__, getattr(e, "notice", "")) for e in original.ended] == [
        ("NoticeDropped", "block_freed"),
        ("StepEnded", ""),
    ]
    assert retried.began == original.began and retried.ended == original.ended
    assert retried.results == [[e for group in original.results for e in group]]


async def test_a_group_decided_while_the_append_before_it_fails_is_decided_on_the_rebuilt_state(
    event_log: EventLog, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The sidecar decides a group while the one before it is appended (pipelined). That append
    fails while the new group's command ids are read from the log: the new group must then be
    decided on the state rebuilt from the log. Decided on the state the failed append left, it
    was a group the append's rebuild waited for, and nothing appended it: the sidecar hung
    (seen as tests/sidecar/test_hot_path.py's PostgreSQL case hanging under load)."""
    ledger = await Ledger.open(event_log)
    await _declare(ledger)
    head = await event_log.head()

    def step(number: int, req_id: str) -> Step:
        return Step(
            engine_id=ENGINE,
            step=number,
            clock=float(number),
            commands=[StartOwner(engine_id=ENGINE, req_id=req_id)],
            command_id=req_id,
        )

    first = await ledger.decide_group([step(1, "first")])
    find = event_log.find_commands
    reading = anyio.Event()
    reads = 0

    async def fails(batches: list[AppendBatch], *, expected_head: int | None = None) -> list[AppendResult]:
        await reading.wait()
        raise LogUnavailable("the append in flight fails while the next group's ids are read (test)")

    async def slow_find(ids: list[str]) -> dict[str, AppendResult]:
        nonlocal reads
        reads += 1
        found = await find(ids)
        if reads == 1:
            reading.set()
            with anyio.fail_after(10):
                while not ledger.stale:  # the append failed (its rebuild waits for the lock)
                    await anyio.sleep(0.001)
        return found

    monkeypatch.setattr(event_log, "append", fails)
    monkeypatch.setattr(event_log, "find_commands", slow_find)
    failed: list[BaseException] = []

    async def append_first() -> None:
        try:
            await ledger.append_decided(first)
        except LogUnavailable as error:
            failed.append(error)

    async with anyio.create_task_group() as tasks:
        tasks.start_soon(append_first)
        second = await ledger.decide_group([step(2, "second")])
        stale = ledger.stale
        if stale:  # decided on the state the failed append left: let its rebuild go, so this fails, not hangs
            ledger._fail_epoch()
        assert not stale, "the group was decided on a state the log does not hold"
    assert failed and reads == 2  # the ids were read again, after the rebuild
    monkeypatch.undo()
    [commit] = await ledger.append_decided(second)
    assert isinstance(commit, StepCommit) and commit.commit.first_seq == head + 1
    assert [e.req_id for e in commit.commit.events if isinstance(e, OwnerStarted)] == ["second"]
    assert encode_state(ledger.state) == encode_state((await replay(event_log, EventCodec()))[0])


def test_a_reports_command_id_stands_for_the_report_whichever_engine_is_stamped_on_it() -> None:
    """content_digest leaves a report's engine out: the sidecar stamps it from the connection
    (since 2026-12-05) and the command id is scoped by the engine already, so a report committed
    before that and retried after is the same report, not other content. Any other field is."""
    from coordinator.ledger.ledger import Single, content_digest

    report = ReportRank(job_id=3, rank=1, ok=True, checksums=[b"\x01" * 16])
    stamped = msgspec.structs.replace(report, engine_id="pod-a")
    assert content_digest(Single(command=report)) == content_digest(Single(command=stamped))
    in_step = [Step(engine_id="pod-a", step=1, clock=1.0, commands=[command]) for command in (report, stamped)]
    assert content_digest(in_step[0]) == content_digest(in_step[1])
    for other in (msgspec.structs.replace(stamped, rank=0), msgspec.structs.replace(stamped, ok=False)):
        assert content_digest(Single(command=other)) != content_digest(Single(command=stamped))
