"""Hostile and broken clients (issue 17), through a real sidecar on a real socket and log.

Command ids are the client's; the log's are scoped by engine and by kind of message, so that no
engine id (they may hold "/") forges another engine's scope and no message kind is answered with
another kind's committed events; a command id sent again with other content is refused
`command_id_reused`, never answered as the first. A Step or an Execute cannot carry the commands
that open and close a step (BeginStep, EndStep): the sidecar frames every step itself.
"""

from __future__ import annotations

import os
from collections.abc import Awaitable, Callable
from pathlib import Path

import anyio
import msgspec
import pytest

from coordinator.client import Address, EngineClient, SidecarError, WorkerClient
from coordinator.core.checks import MAX_LOOKUP_TOKENS
from coordinator.core.commands import (
    AnyCommand,
    BeginStep,
    EndStep,
    ExternalKey,
    FinishOwner,
    MarkComputed,
    ReportRank,
    StartOwner,
    StartStore,
)
from coordinator.sidecar import protocol as p
from events import OwnerStarted, PrefixLookedUp, RankReported, StepBegan
from events.log import EventLog, StoredStep
from tests.kit import builders as b
from tests.kit.sidecar import TIER_SPEC, Engine, RawConnection, declaration, sidecar_on

pytestmark = pytest.mark.anyio


def _client(sock: Path, engine_id: str) -> EngineClient:
    return EngineClient(Address(socket_path=str(sock)), declaration(engine_id), tiers=[TIER_SPEC], retry_for=5)


async def test_an_engine_id_holding_a_slash_cannot_forge_another_engines_command_scope(
    event_log: EventLog, tmp_path: Path
) -> None:
    """Engine "team" with id "a/s1" and engine "team/a" with id "s1" are two commands."""
    sock = tmp_path / "s.sock"
    async with sidecar_on(event_log, sock), _client(sock, "team") as team, _client(sock, "team/a") as team_a:
        first = await team.step(1, 1.0, [StartOwner(engine_id="team", req_id="tenant-secret")], command_id="a/s1")
        second = await team_a.step(1, 1.0, [StartOwner(engine_id="team/a", req_id="mine")], command_id="s1")
        assert not second.duplicate and second.first_seq > first.last_seq
        (owner,) = [e for e in second.results[0] if isinstance(e, OwnerStarted)]
        assert (owner.engine_id, owner.req_id) == ("team/a", "mine")


async def test_a_step_id_reused_by_an_execute_or_a_report_is_another_command(event_log: EventLog, tmp_path: Path) -> None:
    """An Execute reusing a Step's id is not answered as that step; a worker's Report whose id is
    one of its engine's Step ids is recorded (its job completes), not answered with the step."""
    sock = tmp_path / "s.sock"
    async with sidecar_on(event_log, sock), _client(sock, "pod-a") as client:
        job = await Engine(client).request(0)
        step = await client.step(100, 100.0, [], command_id="shared-id")
        executed = await client.execute(StartOwner(engine_id="pod-a", req_id="r2"), command_id="shared-id")
        assert not executed.duplicate and executed.first_seq > step.last_seq  # decided (refused: no step is open)
        worker = WorkerClient(Address(socket_path=str(sock)), "pod-a", 0)
        reported = await worker.report(
            ReportRank(job_id=job.job_id, rank=0, ok=True, checksums=[b"\x01" * 16] * len(job.items)), command_id="shared-id"
        )
        assert not reported.duplicate
        assert [(e.job_id, e.rank) for e in reported.events if isinstance(e, RankReported)] == [(job.job_id, 0)]
        await worker.aclose()


async def test_a_command_id_sent_again_with_other_content_is_refused_command_id_reused(
    event_log: EventLog, tmp_path: Path
) -> None:
    sock = tmp_path / "s.sock"
    async with sidecar_on(event_log, sock), _client(sock, "pod-a") as client:
        await client.step(1, 1.0, [StartOwner(engine_id="pod-a", req_id="r1")], command_id="s")
        head = await event_log.head()
        for step, clock in ((2, 2.0), (1, 5.0)):  # another step, or the same step at another clock
            with pytest.raises(SidecarError) as reused:
                await client.step(step, clock, [], command_id="s")
            assert reused.value.code is p.ErrorCode.COMMAND_ID_REUSED and "new command id" in str(reused.value)
        again = await client.step(1, 1.0, [StartOwner(engine_id="pod-a", req_id="r1")], command_id="s")
        assert again.duplicate  # the same step: its committed answer
        assert await event_log.head() == head


async def test_a_report_id_reused_for_another_job_or_rank_is_refused(event_log: EventLog, tmp_path: Path) -> None:
    sock = tmp_path / "s.sock"
    async with sidecar_on(event_log, sock), _client(sock, "pod-a") as client:
        engine = Engine(client)
        jobs = [await engine.request(index) for index in range(2)]
        worker = WorkerClient(Address(socket_path=str(sock)), "pod-a", 0)
        await worker.report(
            ReportRank(job_id=jobs[0].job_id, rank=0, ok=True, checksums=[b"\x01" * 16] * len(jobs[0].items)), command_id="rep"
        )
        with pytest.raises(SidecarError) as reused:
            await worker.report(
                ReportRank(job_id=jobs[1].job_id, rank=0, ok=True, checksums=[b"\x01" * 16] * len(jobs[1].items)),
                command_id="rep",
            )
        assert reused.value.code is p.ErrorCode.COMMAND_ID_REUSED
        assert f"job {jobs[0].job_id} rank 0" in str(reused.value)
        await worker.aclose()


async def test_a_command_id_holding_a_nul_is_committed_once_and_a_retry_answered_from_the_log(
    event_log: EventLog, tmp_path: Path
) -> None:
    """PostgreSQL's text holds no NUL: a client's command id "s\\x00" failed its group's append
    every time (an adversarial review, session 31). The log keeps such an id as its digest, as it
    keeps one too long, the same for every retry."""
    sock = tmp_path / "s.sock"
    async with sidecar_on(event_log, sock), _client(sock, "pod-a") as client:
        commands = [StartOwner(engine_id="pod-a", req_id="nul-id")]
        first = await client.step(1, 1.0, commands, command_id="s\x00")
        again = await client.step(1, 1.0, commands, command_id="s\x00")
        assert (again.first_seq, again.last_seq, again.duplicate) == (first.first_seq, first.last_seq, True)
        assert not first.duplicate


@pytest.mark.parametrize("control", [BeginStep(engine_id="pod-a", step=7, clock=7.0), EndStep(engine_id="pod-a")])
async def test_a_step_or_an_execute_carrying_step_control_commands_is_refused_whole(
    event_log: EventLog, tmp_path: Path, control: BeginStep | EndStep
) -> None:
    """One append could hold two steps, an Execute could open a step spanning appends, and a
    retried step holding an EndStep was answered with fewer events than its first answer."""
    sock = tmp_path / "s.sock"
    async with sidecar_on(event_log, sock), _client(sock, "pod-a") as client:
        await client.step(1, 1.0, [], command_id="first")
        head = await event_log.head()
        raw = await RawConnection.open(sock)
        assert isinstance(await raw.hello(role="engine", engine_id="pod-a", incarnation=client.incarnation), p.Welcome)
        await raw.send(
            p.Step(step=2, clock=2.0, commands=[StartOwner(engine_id="pod-a", req_id="r"), control], command_id="two-steps")
        )
        refused = await raw.receive()
        assert isinstance(refused, p.Error) and refused.code is p.ErrorCode.INVALID_MESSAGE
        assert type(control).__name__ in refused.message
        await raw.send(p.Execute(command=control, command_id="open"))
        refused = await raw.receive()
        assert isinstance(refused, p.Error) and refused.code is p.ErrorCode.INVALID_MESSAGE
        await raw.aclose()
        assert await event_log.head() == head
        after = await client.step(2, 2.0, [], command_id="second")  # the engine steps on
        assert isinstance(after.began[0], StepBegan)


# --- forensic commands read and create nothing -------------------------------------------------


def _written_log(directory: Path) -> Path:
    """A small real log, closed (no -wal, -shm or lock file beside it)."""
    import anyio

    from coordinator.core.commands import DeclareTier
    from coordinator.ledger.ledger import Ledger
    from events import TierSpec
    from events.log import open_log

    path = directory / "log.sqlite"

    async def write() -> None:
        event_log = await open_log(str(path))
        ledger = await Ledger.open(event_log)
        await ledger.execute(DeclareTier(spec=TierSpec(name="host", num_slots=4, bytes_per_slot=8)))
        await ledger.close()
        await event_log.close()

    anyio.run(write)
    (directory / "log.sqlite.lock").unlink()
    return path


@pytest.mark.parametrize("command", [["verify"], ["export", "--format", "jsonl"], ["replay"], ["audit", "refusals"]])
def test_a_forensic_command_pointed_at_a_file_that_is_no_log_is_one_line_exit_2_and_creates_nothing(
    tmp_path: Path, command: list[str]
) -> None:
    """`kvledger verify --log /etc/passwd` (as root) left /etc/passwd.lock, after which useradd
    refused to run."""
    from typer.testing import CliRunner

    from coordinator.cli.main import app

    passwd = tmp_path / "passwd"
    passwd.write_text("root:x:0:0:root:/root:/bin/bash\n")
    result = CliRunner().invoke(app, [*command, "--log", str(passwd)])
    assert result.exit_code == 2, result.output
    name = " ".join(command[:2]) if command[0] == "audit" else command[0]
    assert result.stderr.strip().splitlines() == [f"kvledger {name}: {passwd} is not a kvledger log: not a SQLite database"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["passwd"]
    assert passwd.read_text() == "root:x:0:0:root:/root:/bin/bash\n"


@pytest.mark.parametrize("command", [["verify"], ["export", "--format", "jsonl"], ["replay"]])
def test_read_only_commands_read_a_log_and_create_no_file(tmp_path: Path, command: list[str]) -> None:
    from typer.testing import CliRunner

    from coordinator.cli.main import app

    log = _written_log(tmp_path)
    before = {p.name: p.stat().st_mtime_ns for p in tmp_path.iterdir()}
    result = CliRunner().invoke(app, [*command, "--log", str(log)])
    assert result.exit_code == 0, result.output
    assert "tier_declared" in result.output or "1" in result.output
    assert {p.name: p.stat().st_mtime_ns for p in tmp_path.iterdir()} == before  # nothing made, nothing written


def test_a_sqlite_file_without_kvledgers_schema_is_not_a_log(tmp_path: Path) -> None:
    import sqlite3

    from typer.testing import CliRunner

    from coordinator.cli.main import app

    other = tmp_path / "other.db"
    with sqlite3.connect(other) as conn:
        conn.execute("CREATE TABLE t (x)")
    conn.close()
    result = CliRunner().invoke(app, ["verify", "--log", str(other)])
    assert result.exit_code == 2 and f"{other} is not a kvledger log: it has no kvledger schema" in result.stderr, result.output
    assert sorted(p.name for p in tmp_path.iterdir()) == ["other.db"]


# --- sessions bound to an incarnation ----------------------------------------------------------


async def test_a_declaring_hello_for_a_connected_engine_is_refused_unless_it_says_takeover(
    event_log: EventLog, tmp_path: Path
) -> None:
    """A Hello with `declare` for an engine that is connected started a new incarnation and
    fenced its jobs; the connected engine was not told. Now it is refused `engine_connected`; with
    `takeover` it is a deliberate act, recorded on EngineDeclared, and the old connection's next
    message (its ResetCache here, which would have fenced the new incarnation's jobs) is refused
    `stale_incarnation` and the connection closed."""
    from coordinator.core.commands import ResetCache
    from events import EngineDeclared

    sock = tmp_path / "s.sock"
    async with sidecar_on(event_log, sock) as sidecar, _client(sock, "pod-a") as old:
        with pytest.raises(SidecarError) as connected:
            await _client(sock, "pod-a").connect()
        assert connected.value.code is p.ErrorCode.ENGINE_CONNECTED and "takeover" in str(connected.value)
        assert sidecar.ledger.state.engines["pod-a"].incarnation == 1
        taker = EngineClient(Address(socket_path=str(sock)), declaration("pod-a"), tiers=[TIER_SPEC], takeover=True)
        async with taker:
            job = await Engine(taker).request(0)
            with pytest.raises(SidecarError) as stale:
                await old.execute(ResetCache(engine_id="pod-a"))
            assert stale.value.code is p.ErrorCode.STALE_INCARNATION and stale.value.fatal
            assert job.job_id in sidecar.ledger.state.jobs  # the new incarnation's job is not fenced
            assert sidecar.ledger.state.engines["pod-a"].incarnation == 2
        declared = [e for e in await _events(event_log) if isinstance(e, EngineDeclared)]
        assert [(e.incarnation, e.takeover) for e in declared] == [(1, False), (2, True)]
    # ... and in the audit index: the declaration that took the engine over says so.
    import sqlalchemy as sa

    from coordinator.audit.store import sync_index
    from events.log import SqlEventLog
    from events.log import schema as t

    assert isinstance(event_log, SqlEventLog)
    await sync_index(event_log)
    e = t.audit_engines.c
    async with event_log.engine.connect() as conn:
        rows = (
            await conn.execute(
                sa.select(e.incarnation, e.detail).where(e.engine == "pod-a", e.kind == "declared").order_by(e.seq)
            )
        ).all()
    assert [tuple(row) for row in rows] == [(1, ""), (2, "takeover")]


async def _events(event_log: EventLog) -> list[object]:
    from events import EventCodec
    from events.log.reading import decode

    codec = EventCodec()
    return [decode(codec, stored) for stored in await event_log.read(0, 100_000)]


async def test_an_engines_reset_fences_its_old_workers_which_say_hello_again_and_go_on(
    event_log: EventLog, tmp_path: Path
) -> None:
    """A worker connection bound to the old incarnation is refused at its next message; the
    worker client says Hello again (the new incarnation) and sends its report again, which the
    decider takes as what it now is (a fenced job's rank, I16), never silently lost."""
    from coordinator.core.commands import ResetCache
    from events import FencedRankDone

    sock = tmp_path / "s.sock"
    async with sidecar_on(event_log, sock), _client(sock, "pod-a") as client:
        job = await Engine(client).request(0)
        worker = WorkerClient(Address(socket_path=str(sock)), "pod-a", 0, retry_for=5)
        await worker.report(ReportRank(job_id=0, rank=0, ok=True, checksums=[]))  # opens its connection (no job 0: refused)
        await client.execute(ResetCache(engine_id="pod-a"))  # the engine's own reset: its own connection follows
        late = await worker.report(ReportRank(job_id=job.job_id, rank=0, ok=True, checksums=[b"\x01" * 16] * len(job.items)))
        # Taken for what it is now: a fenced job's rank done (its slots let go, nothing published).
        assert [type(e) for e in late.events] == [FencedRankDone]
        await client.step(50, 50.0, [])  # the engine itself was not fenced by its own reset
        await worker.aclose()


# --- bounded work --------------------------------------------------------------------------------


async def test_a_lookup_of_too_many_token_ids_is_refused_at_once_and_others_are_served(
    event_log: EventLog, tmp_path: Path
) -> None:
    """A Lookup had no cap on its token ids: one 16 MiB frame held every engine for 17-20 s. The
    bound is in the message's type, so the frame is refused before its token ids are decoded."""
    from coordinator.core.checks import MAX_EXTRA_KEYS, MAX_LOOKUP_TOKENS

    sock = tmp_path / "s.sock"
    async with sidecar_on(event_log, sock), _client(sock, "pod-a") as client, _client(sock, "pod-b") as bystander:
        with pytest.raises(SidecarError) as refused:
            await client.lookup(TIER_SPEC.name, list(range(MAX_LOOKUP_TOKENS + 1)))  # packed
        assert refused.value.code == p.ErrorCode.INVALID_MESSAGE
        assert f"at most {p.TOKEN_BYTES * MAX_LOOKUP_TOKENS:,} token bytes" in str(refused.value)
        listed = p.Lookup(tier=TIER_SPEC.name, token_ids=list(range(p.MAX_LISTED_TOKENS + 1)))
        with pytest.raises(SidecarError, match=f"at most {p.MAX_LISTED_TOKENS:,} token ids"):
            await client._request(listed, p.LookupResult)
        with pytest.raises(SidecarError) as many_keys:
            await client.lookup(TIER_SPEC.name, [1] * 64, extra_keys=["k"] * (MAX_EXTRA_KEYS + 1))
        assert f"at most {MAX_EXTRA_KEYS:,} extra keys" in str(many_keys.value)
        assert (await client.lookup(TIER_SPEC.name, [1] * MAX_LOOKUP_TOKENS)).answer is not None  # at the bound: served
        await bystander.step(1, 1.0, [])


async def test_a_client_flooding_refused_requests_slows_only_itself(event_log: EventLog, tmp_path: Path) -> None:
    """Every refusal was answered at once, so one client could keep the event loop busy with
    requests that are refused. Past `free_errors` a second, each refusal of that credential
    waits in its turn; another engine's steps go on meanwhile."""
    from coordinator.sidecar.server import ERROR_DELAY

    sock = tmp_path / "s.sock"
    flood, free = 12, 2
    async with (
        sidecar_on(event_log, sock, free_errors=free),
        _client(sock, "pod-a") as flooder,
        _client(sock, "pod-b") as bystander,
    ):

        async def refused_again_and_again() -> None:
            for _ in range(flood):
                with pytest.raises(SidecarError, match="controls the step"):
                    await flooder.execute(BeginStep(engine_id="pod-a", step=1, clock=1.0))

        flooding, stepping = await _beside_a_bystander(refused_again_and_again, bystander)
        # At most `free` refusals a second are answered at once (the flood spans at most two
        # seconds' windows); each other one waited.
        assert flooding >= (flood - 2 * free) * ERROR_DELAY * 0.9
        assert stepping < flooding, "the bystander's steps waited behind the flood"
        await flooder.step(1, 1.0, [])  # the flooder itself is still served


async def _beside_a_bystander(flood: Callable[[], Awaitable[None]], bystander: EngineClient) -> tuple[float, float]:
    """Run `flood` while `bystander` takes 5 empty steps; the seconds each took from the start."""
    ended: dict[str, float] = {}

    async def flooding() -> None:
        await flood()
        ended["flood"] = anyio.current_time()

    async def stepping() -> None:
        for n in range(1, 6):
            await bystander.step(n, float(n), [])
        ended["steps"] = anyio.current_time()

    started = anyio.current_time()
    async with anyio.create_task_group() as tg:
        tg.start_soon(flooding)
        tg.start_soon(stepping)
    return ended["flood"] - started, ended["steps"] - started


async def test_steps_of_refused_commands_slow_only_their_sender(event_log: EventLog, tmp_path: Path) -> None:
    """A Step whose commands the core refuses is decided, logged and answered (a Refused event
    each): one client sending 256-command steps of unknown owners back to back took over half a
    core, and another engine's step p99 rose 1.7x (ops/bench/hostile.py --attacks big-steps).
    Past `free_errors` refusals a second, such a reply waits in its sender's turn, ERROR_DELAY
    for every REFUSED_PER_ERROR_DELAY refused commands; the refusals are still recorded, and
    another engine's steps go on meanwhile."""
    from coordinator.sidecar.server import ERROR_DELAY, REFUSED_PER_ERROR_DELAY

    sock = tmp_path / "s.sock"
    commands, free, rounds = 64, 2, 3
    async with (
        sidecar_on(event_log, sock, free_errors=free),
        _client(sock, "pod-a") as flooder,
        _client(sock, "pod-b") as bystander,
    ):
        refused_seen = 0

        async def refused_steps() -> None:
            nonlocal refused_seen
            for n in range(1, rounds + 1):
                unknown = [FinishOwner(engine_id="pod-a", owner_id=10**6 + i) for i in range(commands)]
                result = await flooder.step(n, float(n), unknown)
                refused_seen += sum(1 for events in result.results for e in events if type(e).__name__ == "Refused")

        flooding, stepping = await _beside_a_bystander(refused_steps, bystander)
        assert refused_seen == commands * rounds  # refused, recorded and answered: nothing lost
        # Each step's refusals past the budget waited (the first at most `free` of them free).
        least = (commands * rounds - 2 * free) / REFUSED_PER_ERROR_DELAY * ERROR_DELAY
        assert flooding >= least * 0.9, (flooding, least)
        assert stepping < flooding, "the bystander's steps waited behind the refused ones"
        await flooder.step(rounds + 1, float(rounds + 1), [])  # the sender itself is still served


async def test_a_lookup_packs_its_token_ids_and_hits_as_the_listed_one(event_log: EventLog, tmp_path: Path) -> None:
    """A long Lookup's token ids were decoded one Python int each, holding the GIL (~7 ms for
    262,144) while other engines waited; packed (4 bytes a token) they are one copy. Both forms
    find the same prefix; a Lookup sending both, or bytes that are no whole uint32s, is refused."""
    sock = tmp_path / "s.sock"
    async with sidecar_on(event_log, sock), _client(sock, "pod-a") as client:
        engine = Engine(client)
        job = await engine.request(0)
        for rank in (0, 1):
            await client.report(
                ReportRank(job_id=job.job_id, rank=rank, ok=True, checksums=[b.checksum(i.key, rank) for i in job.items])
            )
        tokens = [hash(("pod-a", 0, i)) % 50_000 for i in range(2 * b.BLOCK)]  # what request(0) computed
        listed = await client._request(p.Lookup(tier=TIER_SPEC.name, token_ids=tokens), p.LookupResult)
        packed_bytes = b"".join(token.to_bytes(p.TOKEN_BYTES, "little") for token in tokens)
        packed = await client._request(p.Lookup(tier=TIER_SPEC.name, token_bytes=packed_bytes), p.LookupResult)
        assert isinstance(listed.answer, PrefixLookedUp) and listed.answer.boundary == 2 * b.BLOCK
        assert packed.answer == listed.answer
        long = tokens + list(range(p.MAX_LISTED_TOKENS))  # the client packs it: the same prefix hits
        hit = (await client.lookup(TIER_SPEC.name, long)).answer
        assert isinstance(hit, PrefixLookedUp) and hit.boundary == 2 * b.BLOCK
        for wrong, why in (
            (p.Lookup(tier=TIER_SPEC.name, token_ids=tokens, token_bytes=packed_bytes), "not both"),
            (p.Lookup(tier=TIER_SPEC.name, token_bytes=packed_bytes[:-1]), "not a multiple of 4"),
        ):
            with pytest.raises(SidecarError, match=why):
                await client._request(wrong, p.LookupResult)
        await engine.step([])  # still served


async def test_a_frame_over_the_default_request_bound_is_refused_unread(event_log: EventLog, tmp_path: Path) -> None:
    """A 14 MiB Step of token ids decoded for ~150 ms with the GIL held, and every engine's steps
    waited. By default the sidecar takes frames of at most 1.25 MiB (`serve --max-frame`): a larger
    one is refused from its header, its connection closed; the packed longest Lookup fits."""
    from coordinator.core.checks import MAX_LOOKUP_TOKENS

    sock = tmp_path / "s.sock"
    async with sidecar_on(event_log, sock), _client(sock, "pod-a") as client, _client(sock, "pod-b") as bystander:
        raw = await RawConnection.open(sock)
        try:
            await raw.hello(role="engine", engine_id="pod-a", incarnation=client.incarnation)
            await raw.send_bytes((p.MAX_REQUEST_FRAME + 1).to_bytes(p.HEADER_BYTES, "big") + b"\x00" * 1024)
            reply = await raw.receive()
            assert isinstance(reply, p.Error) and reply.code == p.ErrorCode.FRAME_TOO_LARGE and reply.fatal
            assert await raw.closed()
        finally:
            await raw.aclose()
        # Before Hello, a peer that has proven nothing may not make the sidecar buffer a large frame.
        from coordinator.sidecar.server import LARGE_FRAME

        raw = await RawConnection.open(sock)
        try:
            await raw.send_bytes((LARGE_FRAME + 1).to_bytes(p.HEADER_BYTES, "big"))
            reply = await raw.receive()
            assert isinstance(reply, p.Error) and reply.code == p.ErrorCode.FRAME_TOO_LARGE and "before Hello" in reply.message
            assert await raw.closed()
        finally:
            await raw.aclose()
        assert isinstance((await client.lookup(TIER_SPEC.name, [7] * MAX_LOOKUP_TOKENS)).answer, PrefixLookedUp)
        await bystander.step(1, 1.0, [])


def test_a_frame_over_a_list_bound_is_refused_before_its_items_are_decoded() -> None:
    """Every list a client message carries is bounded in its type: msgspec reads the length and
    refuses before it decodes an item, so an over-bound frame costs nothing to refuse."""
    import tracemalloc

    body = p.frame(p.Lookup(tier="t", token_ids=[1 << 30] * 4_000_000))[p.HEADER_BYTES :]
    tracemalloc.start()
    try:
        with pytest.raises(p.FrameError, match="at most 65,536 token ids"):
            p.decode_client(body)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20, f"refusing took {peak:,} bytes (decoding the 4M token ids takes ~140 MB)"
    for message in (
        p.Step(step=1, clock=1.0, commands=[FinishOwner(engine_id="e", owner_id=1)] * (p.MAX_COMMANDS + 1), command_id="s"),
        p.Reports(reports=[p.Report(report=ReportRank(job_id=1, rank=0, ok=True))] * (p.MAX_COMMANDS + 1)),
        p.LookupKeys(tier="t", keys=[ExternalKey(pool_id=0, engine_key=b"k")] * ((1 << 16) + 1)),
    ):
        with pytest.raises(p.FrameError, match="holds at most"):
            p.decode_client(p.frame(message)[p.HEADER_BYTES :])


# --- /metrics ----------------------------------------------------------------------------------


async def test_metrics_can_require_a_token_and_leave_engine_ids_out(event_log: EventLog, tmp_path: Path) -> None:
    """/metrics needed no token and labelled every engine id (engine ids can name tenants)."""
    import urllib.error
    import urllib.request

    import anyio

    sock = tmp_path / "s.sock"
    options = {"http": ("127.0.0.1", 0), "metrics_token": "scrape-secret", "metrics_engine_labels": False}
    async with sidecar_on(event_log, sock, **options) as sidecar, _client(sock, "tenant-a-secret-engine") as client:
        await Engine(client).request(0)
        assert sidecar.http_address is not None
        url = f"http://{sidecar.http_address[0]}:{sidecar.http_address[1]}/metrics"

        def get(token: str | None) -> tuple[int, str]:
            request = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"} if token else {})
            try:
                with urllib.request.urlopen(request, timeout=10) as answer:  # noqa: S310 - loopback
                    return answer.status, answer.read().decode()
            except urllib.error.HTTPError as error:
                return error.code, error.read().decode()

        for token in (None, "wrong"):
            status, body = await anyio.to_thread.run_sync(get, token)
            assert status == 401 and "scrape-secret" not in body and "kvledger_" not in body
        status, body = await anyio.to_thread.run_sync(get, "scrape-secret")
        assert status == 200 and 'kvledger_pins{engine="all"}' in body
        assert "tenant-a-secret-engine" not in body


async def test_tiers_beyond_the_sidecars_budget_are_refused_naming_the_budget(event_log: EventLog, tmp_path: Path) -> None:
    """Any engine connection could declare tiers of up to 2**24 slots, as many as it liked (one
    80-byte message added ~1.3 GB of RSS, and every restart rebuilt it from the log)."""
    import msgspec

    from coordinator.core.commands import DeclareTier
    from events import TierSpec

    sock = tmp_path / "s.sock"
    async with sidecar_on(event_log, sock, max_tier_slots=TIER_SPEC.num_slots + 100, max_tiers=2) as sidecar:
        async with _client(sock, "pod-a") as client:
            head = await event_log.head()
            huge = TierSpec(name="huge", num_slots=1 << 24, bytes_per_slot=64)
            greedy = EngineClient(Address(socket_path=str(sock)), declaration("pod-b"), tiers=[TIER_SPEC, huge])
            with pytest.raises(SidecarError) as refused:
                await greedy.connect()
            assert refused.value.code is p.ErrorCode.INVALID_MESSAGE and "--max-tier-slots" in str(refused.value)
            assert "huge" not in sidecar.ledger.state.tiers and "pod-b" not in sidecar.ledger.state.engines
            assert await event_log.head() == head  # nothing of the Hello committed
            small = TierSpec(name="small", num_slots=50, bytes_per_slot=64)
            await client.execute(DeclareTier(spec=small))  # within the budget: taken
            with pytest.raises(SidecarError) as too_many:
                await client.execute(DeclareTier(spec=msgspec.structs.replace(small, name="third")))
            assert too_many.value.code is p.ErrorCode.INVALID_MESSAGE and "--max-tiers" in str(too_many.value)
            await client.step(1, 1.0, [])  # the engine goes on


# --- step numbers and clocks that cannot be poisoned ------------------------------------------


async def test_a_poisoned_step_is_refused_and_a_new_incarnation_starts_its_steps_afresh(
    event_log: EventLog, tmp_path: Path
) -> None:
    """A Step numbered 2**63-1 (or at clock 1e18) was accepted, and every later step of the engine
    was refused, even after it was declared again. Now a step leaps at most MAX_STEP_JUMP (a clock
    MAX_CLOCK_JUMP), and a new incarnation starts its steps and clock afresh."""
    from coordinator.core.checks import MAX_STEP_JUMP
    from events import Refused

    sock = tmp_path / "s.sock"
    async with sidecar_on(event_log, sock) as sidecar:
        async with _client(sock, "pod-a") as client:
            await client.step(10, 10.0, [])
            for step, clock in ((2**63 - 1, 11.0), (11, 1e18)):
                poisoned = await client.step(step, clock, [])
                assert isinstance(poisoned.began[0], Refused) and poisoned.began[0].reason == "step_jump", poisoned.began
            await client.step(11, 11.0, [])  # the engine goes on
            await client.step(11 + MAX_STEP_JUMP, 12.0, [])  # the largest leap there is: taken
        async with _client(sock, "pod-a") as restarted:  # a new incarnation: its steps begin again
            assert sidecar.ledger.state.engines["pod-a"].incarnation == 2
            first = await restarted.step(2**63 - 1, 1.0, [])  # a first step is at most 2**53 (a microsecond clock)
            assert isinstance(first.began[0], Refused) and first.began[0].reason == "step_jump", first.began
            again = await restarted.step(1, 1.0, [])
            assert not isinstance(again.began[0], Refused), again.began


# --- least privilege: credentials bound to roles and engines -------------------------------------


def _credentials_file(tmp_path: Path, text: str) -> str:
    path = tmp_path / "credentials.toml"
    path.write_text(text)
    path.chmod(0o600)
    return str(path)


ENGINE_TOKEN, WORKER_TOKEN, TENANT_TOKEN, OPERATOR_TOKEN = (
    "engine-a-" + "e" * 16,
    "worker-a-" + "w" * 16,
    "tenant-b-" + "t" * 16,
    "operator-" + "o" * 16,
)
CREDENTIALS = f'''
[[credentials]]
name = "pod-a engine"
token = "{ENGINE_TOKEN}"
roles = ["engine"]
engines = ["pod-a"]

[[credentials]]
name = "pod-a workers"
token = "{WORKER_TOKEN}"
roles = ["worker"]
engines = ["pod-a"]

[[credentials]]
name = "tenant-b"
token = "{TENANT_TOKEN}"
roles = ["engine", "worker"]
tenant = "tenant-b"

[[credentials]]
name = "ops"
token = "{OPERATOR_TOKEN}"
roles = ["operator"]
'''


async def test_a_credential_takes_only_its_roles_for_its_engines_or_its_tenants(event_log: EventLog, tmp_path: Path) -> None:
    """Anyone with the one TCP token could say Hello as any engine's worker (and publish a store
    job with invented checksums), attach as the engine, or be an operator."""
    from coordinator.sidecar.config import ConfigError, ServeConfig, check_config

    sock = tmp_path / "s.sock"
    options = {"tcp": ("127.0.0.1", 0), "credentials": _credentials_file(tmp_path, CREDENTIALS)}
    async with sidecar_on(event_log, sock, **options) as sidecar:
        assert sidecar.tcp_address is not None

        def address(token: str) -> Address:
            assert sidecar.tcp_address is not None
            return Address(tcp=sidecar.tcp_address, token=token)

        async def refused(client: EngineClient | WorkerClient, *words: str) -> None:
            with pytest.raises(SidecarError) as caught:
                await (
                    client.connect()
                    if isinstance(client, EngineClient)
                    else client.report(ReportRank(job_id=1, rank=0, ok=True, checksums=[]))
                )
            assert caught.value.code is p.ErrorCode.UNAUTHORIZED, caught.value
            for word in words:
                assert word in str(caught.value), (word, caught.value)
            for token in (ENGINE_TOKEN, WORKER_TOKEN, TENANT_TOKEN, OPERATOR_TOKEN):
                assert token not in str(caught.value)

        async with EngineClient(address(ENGINE_TOKEN), declaration("pod-a"), tiers=[TIER_SPEC], retry_for=2) as engine:
            await Engine(engine).request(0)
            await refused(EngineClient(address(WORKER_TOKEN), declaration("pod-a"), retry_for=2), "not engine")
            await refused(EngineClient(address(ENGINE_TOKEN), declaration("pod-c"), retry_for=2), "'pod-c'")
            await refused(WorkerClient(address(ENGINE_TOKEN), "pod-a", 0, retry_for=2), "not worker")
            await refused(WorkerClient(address(WORKER_TOKEN), "pod-b", 0, retry_for=2), "'pod-b'")
            worker = WorkerClient(address(WORKER_TOKEN), "pod-a", 0, retry_for=2)
            await worker.report(ReportRank(job_id=0, rank=0, ok=True, checksums=[]))  # its own engine: in (no job 0: refused)
            await worker.aclose()
            # Tenant b's credential declares its tenant's engines only, and takes over no other's.
            tenant_b = msgspec.structs.replace(declaration("pod-b"), namespace=b.namespace(tenant="tenant-b"))
            async with EngineClient(address(TENANT_TOKEN), tenant_b, tiers=[TIER_SPEC], retry_for=2) as own:
                await own.step(1, 1.0, [])
            await refused(EngineClient(address(TENANT_TOKEN), declaration("pod-x"), retry_for=2), "'pod-x'")
            hijack = msgspec.structs.replace(tenant_b, engine_id="pod-a")
            await refused(EngineClient(address(TENANT_TOKEN), hijack, takeover=True, retry_for=2), "'pod-a'")
            await refused(EngineClient(address(OPERATOR_TOKEN), declaration("pod-a"), retry_for=2), "not engine")
            await refused(EngineClient(address("no-such-token-at-all"), declaration("pod-a"), retry_for=2), "wrong token")
            await engine.step(50, 50.0, [])  # the engine was never taken over
            assert sidecar.ledger.state.engines["pod-a"].incarnation == 1
    with pytest.raises(ConfigError, match="exactly one of token and uid"):
        check_config(
            ServeConfig(socket_path=str(sock), credentials=_credentials_file(tmp_path, '[[credentials]]\nroles = ["observer"]\n'))
        )
    with pytest.raises(ConfigError, match="engines"):
        check_config(
            ServeConfig(
                socket_path=str(sock),
                credentials=_credentials_file(tmp_path, f'[[credentials]]\ntoken = "{ENGINE_TOKEN}"\nroles = ["worker"]\n'),
            )
        )
    with pytest.raises(ConfigError, match="both given"):
        check_config(ServeConfig(socket_path=str(sock), token="t", credentials=_credentials_file(tmp_path, CREDENTIALS)))


_UNIX_PEER = r"""
import os, sys
from coordinator.client import Address, SidecarError, SyncWorkerClient
from coordinator.core.commands import ReportRank
os.setgid(int(sys.argv[2])); os.setuid(int(sys.argv[2]))
worker = SyncWorkerClient(Address(socket_path=sys.argv[1]), sys.argv[3], 0, retry_for=2)
try:
    worker.report(ReportRank(job_id=0, rank=0, ok=True, checksums=[]))  # no job 0: committed as refused
except SidecarError as error:
    print(error.code.value, str(error))
else:
    print("ok")
"""


@pytest.mark.skipif(os.geteuid() != 0, reason="runs its peers as other uids, which needs root")
async def test_the_unix_socket_checks_the_peers_uid_against_its_credentials(event_log: EventLog) -> None:
    """On the Unix socket the kernel's peer uid (SO_PEERCRED) is the credential: a uid the
    sidecar does not know is cut at once; a known uid takes only its roles for its engines."""
    import subprocess
    import sys
    import tempfile

    import anyio

    allowed, stranger = 65534, 65533
    with tempfile.TemporaryDirectory() as folder:
        os.chmod(folder, 0o755)
        sock = Path(folder) / "s.sock"
        text = (
            f'[[credentials]]\nuid = {allowed}\nroles = ["worker"]\nengines = ["pod-a"]\n'
            f'[[credentials]]\nuid = 0\nroles = ["engine"]\nengines = ["*"]\n'
        )
        async with sidecar_on(event_log, sock, credentials=_credentials_file(Path(folder), text)), _client(sock, "pod-a"):
            assert sock.stat().st_mode & 0o777 == 0o666  # other uids may connect: the peer uid is the check

            def peer(uid: int, engine: str) -> str:
                done = subprocess.run(
                    [sys.executable, "-c", _UNIX_PEER, str(sock), str(uid), engine],
                    capture_output=True,
                    text=True,
                    timeout=60,
                    cwd=Path(__file__).resolve().parents[2],
                )
                return (done.stdout.strip() or done.stderr.strip()).splitlines()[-1]  # its answer, after its log lines

            assert await anyio.to_thread.run_sync(peer, allowed, "pod-a") == "ok"
            assert (await anyio.to_thread.run_sync(peer, allowed, "pod-b")).startswith("unauthorized")
            stranger_said = await anyio.to_thread.run_sync(peer, stranger, "pod-a")
            assert stranger_said.startswith("unauthorized") and f"uid {stranger}" in stranger_said


async def test_pools_and_live_owners_beyond_the_sidecars_budget_are_refused_naming_the_budget(
    event_log: EventLog, tmp_path: Path
) -> None:
    """Nothing limited what a client left behind: owners never finished (~500 B each: 295k added
    ~140 MB), pools of 2**24 blocks each, in every declaration."""
    sock = tmp_path / "s.sock"
    async with sidecar_on(event_log, sock, max_pool_blocks=600, max_owners_per_engine=3) as sidecar:
        async with _client(sock, "pod-a") as client:  # 256 blocks
            head = await event_log.head()
            greedy = EngineClient(Address(socket_path=str(sock)), declaration("pod-b", num_blocks=400), tiers=[TIER_SPEC])
            with pytest.raises(SidecarError) as refused:
                await greedy.connect()
            assert refused.value.code is p.ErrorCode.INVALID_MESSAGE and "--max-pool-blocks" in str(refused.value)
            assert "pod-b" not in sidecar.ledger.state.engines and await event_log.head() == head
            async with _client(sock, "pod-c"):  # another 256: within the budget
                pass
            await client.step(1, 1.0, [StartOwner(engine_id="pod-a", req_id=f"r{i}") for i in range(3)])
            with pytest.raises(SidecarError) as owners:
                await client.step(2, 2.0, [StartOwner(engine_id="pod-a", req_id="r3")])
            assert owners.value.code is p.ErrorCode.INVALID_MESSAGE and "--max-owners-per-engine" in str(owners.value)
            assert "3 live owners" in str(owners.value)
            assert sum(1 for o in sidecar.ledger.state.owners.values() if o.engine_id == "pod-a") == 3
            await client.step(2, 2.0, [])  # the engine goes on


async def test_a_subscribers_catch_up_is_decoded_off_the_event_loop_and_a_made_up_engine_reads_nothing(
    event_log: EventLog, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Subscribe(from_seq=0) as a worker of any engine id, even an undeclared one, read and
    decoded the whole log on the event loop (20 small frames pushed another engine's p99 past 50 ms)."""
    import threading

    import anyio

    from coordinator.sidecar.hub import DecisionHub

    loop_thread = threading.get_ident()
    decoded_on: list[int] = []
    streams_read: list[str] = []
    real = DecisionHub._decisions_in

    def spy(self: DecisionHub, steps: list[StoredStep], *args: object) -> object:
        decoded_on.append(threading.get_ident())
        streams_read.extend(step.stream_id for step in steps)
        return real(self, steps, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(DecisionHub, "_decisions_in", spy)
    sock = tmp_path / "s.sock"
    async with sidecar_on(event_log, sock), _client(sock, "pod-a") as client:
        engine = Engine(client)
        for index in range(3):
            await engine.request(index)
        worker = WorkerClient(Address(socket_path=str(sock)), "pod-a", 0, retry_for=5)
        with anyio.fail_after(10):
            async for decision in worker.decisions(from_seq=0):
                break
        assert decision.seq > 0 and decoded_on and loop_thread not in decoded_on
        decoded_on.clear()
        stranger = WorkerClient(Address(socket_path=str(sock)), "no-such-engine", 0, retry_for=5)
        with anyio.move_on_after(0.5):
            async for _ in stranger.decisions(from_seq=0):
                raise AssertionError("a made-up engine has no decision")
        assert decoded_on == []  # nothing of the log was read for it
        await worker.aclose()
        await stranger.aclose()
        # A catch-up reads its own engine's steps only, not every stream's (it read the whole
        # log and dropped the rest: 20 catch-ups of engines with few steps held every engine ~2x).
        async with _client(sock, "pod-b") as other:
            await Engine(other).request(0)
            streams_read.clear()
            own = WorkerClient(Address(socket_path=str(sock)), "pod-b", 0, retry_for=5)
            with anyio.fail_after(10):
                async for decision in own.decisions(from_seq=0):
                    break
            await own.aclose()
        assert streams_read and set(streams_read) == {"engine/pod-b"}, set(streams_read)


async def test_a_command_id_is_a_duplicate_only_for_the_same_content_even_across_a_restart(
    event_log: EventLog, tmp_path: Path
) -> None:
    """The same step number and clock with other commands, or an Execute reusing its id for
    another command, was answered with the first one's events as a duplicate. The log keeps each
    id's content digest (kvl_commands.digest), so this holds after a restart too."""
    sock = tmp_path / "s.sock"
    first_commands = [StartOwner(engine_id="pod-a", req_id="r1")]
    for restart in (False, True):
        async with sidecar_on(event_log, sock), _client(sock, "pod-a") as client:
            if not restart:
                await client.step(1, 1.0, first_commands, command_id="s")
                await client.execute(StartStore(engine_id="pod-a", tier=TIER_SPEC.name, blocks=[]), command_id="e")
            head = await event_log.head()
            with pytest.raises(SidecarError) as other_step:
                await client.step(1, 1.0, [StartOwner(engine_id="pod-a", req_id="another")], command_id="s")
            assert other_step.value.code is p.ErrorCode.COMMAND_ID_REUSED and "other content" in str(other_step.value)
            with pytest.raises(SidecarError) as other_execute:
                await client.execute(StartStore(engine_id="pod-a", tier="another-tier", blocks=[]), command_id="e")
            assert other_execute.value.code is p.ErrorCode.COMMAND_ID_REUSED
            assert (await client.step(1, 1.0, first_commands, command_id="s")).duplicate  # the same: its answer
            assert (await client.execute(StartStore(engine_id="pod-a", tier=TIER_SPEC.name, blocks=[]), command_id="e")).duplicate
            assert await event_log.head() == head


async def test_two_reports_with_one_command_id_in_one_batch_are_refused_unless_the_same(
    event_log: EventLog, tmp_path: Path
) -> None:
    sock = tmp_path / "s.sock"
    async with sidecar_on(event_log, sock), _client(sock, "pod-a") as client:
        job = await Engine(client).request(0)
        ok = ReportRank(job_id=job.job_id, rank=0, ok=True, checksums=[b"\x01" * 16] * len(job.items))
        failed = ReportRank(job_id=job.job_id, rank=0, ok=False, checksums=[])
        import anyio

        from coordinator.client import SyncWorkerClient

        worker = SyncWorkerClient(Address(socket_path=str(sock)), "pod-a", 0, retry_for=5)
        try:
            with pytest.raises(SidecarError) as reused:
                await anyio.to_thread.run_sync(worker.report_all, [(ok, "same-id"), (failed, "same-id")])
            assert reused.value.code is p.ErrorCode.COMMAND_ID_REUSED
            same = await anyio.to_thread.run_sync(worker.report_all, [(ok, "id-2"), (ok, "id-2")])
            assert same[0] == same[1]
        finally:
            worker.close()


def test_a_group_takes_a_small_step_before_other_engines_large_ones_and_keeps_each_engines_order() -> None:
    """A group was the queue's first 64 transactions, whatever their size: a small step queued
    behind other engines' large steps waited for all of them, one group each."""
    from coordinator.ledger.ledger import Single, Step
    from coordinator.sidecar.committer import MAX_GROUP_WORK, _Waiter, take_fairly

    def step(engine: str, commands: int, command_id: str) -> _Waiter:
        return _Waiter(
            Step(
                engine_id=engine,
                step=1,
                clock=1.0,
                command_id=command_id,
                commands=[StartOwner(engine_id=engine, req_id=str(i)) for i in range(commands)],
            )
        )

    big = [step(f"mallory-{i}", MAX_GROUP_WORK, f"big-{i}") for i in range(4)]
    small = step("legit", 32, "small")
    second = step("mallory-1", 10, "second")  # mallory-1's next step: never before its first
    queue = big + [second, small]
    group = take_fairly(queue, set(), 64)
    assert group == [big[0], small], [w.tx.command_id for w in group]
    rest = [w for w in queue if w not in group]
    assert take_fairly(rest, set(), 64) == [big[1], second]  # mallory-1's second, after its first
    # The oldest always goes (nothing starves), unless its command id is in the group in flight:
    # then its engine's later steps wait too, and the next engine's oldest goes.
    assert take_fairly(rest, {"big-1"}, 64) == [big[2]]
    report = _Waiter(Single(command=ReportRank(job_id=1, rank=0, ok=True, checksums=[]), command_id="r"))
    assert take_fairly([report], {"r"}, 64) == []


def test_a_long_lookup_that_misses_hashes_only_up_to_its_first_unloadable_block(monkeypatch: pytest.MonkeyPatch) -> None:
    """A Lookup of 262,144 token ids hashed all 16,384 (here 65,536) blocks and summed them, on the
    event loop, even when its first block missed: ~100 ms for every other engine to wait."""
    from coordinator.core import CoordinatorCore
    from coordinator.core import jobs as _jobs
    from coordinator.core.checks import MAX_LOOKUP_TOKENS
    from coordinator.core.commands import DeclareTier, LookupPrefix
    from coordinator.core.decider import lookup
    from events import PrefixLookedUp

    core = CoordinatorCore()
    core.execute(DeclareTier(spec=TIER_SPEC))
    core.execute(declaration("pod-a"))
    hashed = 0
    real = _jobs.iter_chain_keys  # type: ignore[attr-defined]

    def counting(*args: object, **kwargs: object) -> object:
        nonlocal hashed
        for key in real(*args, **kwargs):  # type: ignore[arg-type]
            hashed += 1
            yield key

    monkeypatch.setattr(_jobs, "iter_chain_keys", counting)
    answer = lookup(core.state, LookupPrefix(engine_id="pod-a", tier=TIER_SPEC.name, token_ids=[7] * MAX_LOOKUP_TOKENS))
    assert isinstance(answer, PrefixLookedUp) and answer.boundary == 0
    assert hashed == 1, hashed


async def test_a_dense_frame_over_the_large_frame_bound_is_decoded_off_the_event_loop(
    event_log: EventLog, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Decoding costs per element: a 256 KiB Step of block references held the event loop ~10 ms
    while it was decoded there (ops/bench/hostile.py's dense-frames attack: every other engine's
    step p50 went from ~3 to ~13 ms). A frame over LARGE_FRAME (32 KiB) is decoded in a worker
    thread, as a heavy read; smaller ones stay on the loop. The refusal is typed and the
    bystander is served."""
    import threading

    from coordinator.core.commands import FreeBlocks
    from coordinator.sidecar.server import LARGE_FRAME
    from events import BlockRef

    loop_thread = threading.get_ident()
    decoded_in: dict[int, bool] = {}
    decode = p.decode_client

    def spying(body: bytes) -> p.ClientMessage:
        decoded_in[len(body)] = threading.get_ident() == loop_thread
        return decode(body)

    monkeypatch.setattr(p, "decode_client", spying)
    ref = BlockRef(pool_id=0, block_id=1, generation=1)
    dense = p.Step(
        step=1, clock=1.0, commands=[FreeBlocks(engine_id="pod-a", owner_id=99, blocks=[ref] * 16_000)], command_id="d"
    )
    frame = p.frame(dense)
    assert LARGE_FRAME < len(frame) < 256 << 10
    sock = tmp_path / "s.sock"
    async with sidecar_on(event_log, sock), _client(sock, "pod-a") as client, _client(sock, "pod-b") as bystander:
        raw = await RawConnection.open(sock)
        try:
            await raw.hello(role="engine", engine_id="pod-a", incarnation=client.incarnation)
            await raw.send_bytes(frame)
            reply = await raw.receive()
            assert not isinstance(reply, p.Error) or not reply.fatal
        finally:
            await raw.aclose()
        await bystander.step(1, 1.0, [])
    large = {length: on_loop for length, on_loop in decoded_in.items() if length > LARGE_FRAME}
    assert large == {len(frame) - p.HEADER_BYTES: False}
    assert any(on_loop for length, on_loop in decoded_in.items() if length <= LARGE_FRAME)


async def test_a_frame_over_the_dense_bound_is_refused_unless_it_is_a_lookup(event_log: EventLog, tmp_path: Path) -> None:
    """Only a Lookup's bulk is packed bytes (one copy to decode); any other message's is lists
    of small ints, ~10 ns a byte, decoded in one call that holds the GIL: a 1.25 MiB Step of
    token ids held every engine ~27 ms (ops/bench/hostile.py's huge-frames attack). A frame over
    MAX_DENSE_FRAME that is not a Lookup is refused `frame_too_large` from its first bytes,
    before the rest is read; a Lookup of 1 MiB of packed tokens is answered; the bystander is
    served throughout."""
    over = p.Step(
        step=1,
        clock=1.0,
        commands=[MarkComputed(engine_id="pod-a", owner_id=1, blocks=[], token_ids=[5] * (p.MAX_DENSE_FRAME + 16))],
        command_id="over",
    )
    frame = p.frame(over)
    assert p.MAX_DENSE_FRAME < len(frame) < p.MAX_REQUEST_FRAME
    tokens = list(range(MAX_LOOKUP_TOKENS))
    long_lookup = p.frame(p.lookup_message(TIER_SPEC.name, tokens))
    assert len(long_lookup) > p.MAX_DENSE_FRAME
    sock = tmp_path / "s.sock"
    async with sidecar_on(event_log, sock), _client(sock, "pod-a") as client, _client(sock, "pod-b") as bystander:
        raw = await RawConnection.open(sock)
        try:
            await raw.hello(role="engine", engine_id="pod-a", incarnation=client.incarnation)
            await raw.send_bytes(frame[: p.HEADER_BYTES + p.LOOKUP_PEEK])  # the rest is never read
            reply = await raw.receive()
            assert isinstance(reply, p.Error) and reply.code == p.ErrorCode.FRAME_TOO_LARGE and reply.fatal
            assert f"{p.MAX_DENSE_FRAME:,} bytes for anything but a Lookup" in reply.message
        finally:
            await raw.aclose()
        raw = await RawConnection.open(sock)
        try:
            await raw.hello(role="engine", engine_id="pod-a", incarnation=client.incarnation)
            await raw.send_bytes(long_lookup)
            answer = await raw.receive()
            assert isinstance(answer, p.LookupResult) and isinstance(answer.answer, PrefixLookedUp), answer
        finally:
            await raw.aclose()
        result = await bystander.step(1, 1.0, [])
        assert not result.duplicate
        assert (await client.step(1, 1.0, [])).first_seq > 0  # pod-a's own engine goes on too


def test_frame_chunks_split_by_count_and_by_bytes_in_order() -> None:
    """A client's split of a pass or a batch of reports: each chunk within MAX_COMMANDS items and
    MAX_DENSE_FRAME bytes framed, every item once, in order; one item too large alone stays alone."""
    small = [StartOwner(engine_id="e", req_id=f"r{i}") for i in range(p.MAX_COMMANDS * 2 + 3)]
    assert [len(c) for c in p.frame_chunks(small)] == [p.MAX_COMMANDS, p.MAX_COMMANDS, 3]
    wide: list[AnyCommand] = [MarkComputed(engine_id="e", owner_id=i, blocks=[], token_ids=[70_000] * 6_000) for i in range(40)]
    chunks = p.frame_chunks(wide)
    assert len(chunks) > 1 and [c for chunk in chunks for c in chunk] == wide
    for chunk in chunks:
        assert len(p.frame(p.Step(step=1, clock=1.0, commands=chunk, command_id="x" * 64))) <= p.MAX_DENSE_FRAME
    huge = MarkComputed(engine_id="e", owner_id=0, blocks=[], token_ids=[1] * (p.MAX_DENSE_FRAME + 1))
    assert p.frame_chunks([small[0], huge, small[1]]) == [[small[0]], [huge], [small[1]]]
    assert p.frame_chunks([]) == []
