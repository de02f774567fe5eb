"""The sidecar through its real socket: several engines and workers at once, group commit,
exactly-once retries, read-only lookups, and every bad input the protocol names.

Each test runs a real Sidecar (coordinator/sidecar/server.py) in this process on a real Unix
socket and a real log; the process-level cases (SIGTERM, SIGKILL, the CLI) are in
tests/test_sidecar_process.py.
"""

from __future__ import annotations

import os
import stat
import urllib.request
from collections.abc import Sequence
from pathlib import Path

import anyio
import msgspec
import pytest

from coordinator.client import Address, EngineClient, SidecarError, SidecarUnavailable, WorkerClient
from coordinator.core.commands import AllocateBlocks, Move, PlanStateCopy, ReportRank, StartOwner
from coordinator.core.routing import Decision
from coordinator.core.state import state_digest
from coordinator.ledger import Ledger
from coordinator.recovery import replay
from coordinator.sidecar import protocol as p
from coordinator.sidecar.hub import SlowSubscriber, Subscription
from coordinator.sidecar.server import ConfigError, ServeConfig, check_config
from events import BlocksAllocated, EventCodec, KeyPublished, OwnerStarted, PrefixLookedUp, Refused, StepBegan, StoreJobStarted
from events.log import AppendBatch, AppendResult, EventLog
from tests import builders as b
from tests.sidecar_kit import TIER_SPEC, Engine, RawConnection, declaration, sidecar_on

pytestmark = pytest.mark.anyio


def engine_client(socket_path: Path, engine_id: str, **kw: object) -> EngineClient:
    return EngineClient(Address(socket_path=str(socket_path)), declaration(engine_id, **kw), tiers=[TIER_SPEC])  # type: ignore[arg-type]


async def test_several_engines_and_workers_at_once_each_worker_gets_its_decisions_once_in_order(
    event_log: EventLog, tmp_path: Path
) -> None:
    """Three engines with two ranks each run concurrently. Every worker sees exactly the store
    decisions of its own engine, each once, in commit order; their reports publish the keys.
    Afterwards the sidecar's state is exactly what the log replays to (I18)."""
    sock = tmp_path / "s.sock"
    engines = ["pod-a", "pod-b", "pod-c"]
    requests = 6
    async with sidecar_on(event_log, sock) as sidecar:
        decided: dict[str, list[StoreJobStarted]] = {}
        seen: dict[tuple[str, int], list[Decision]] = {}
        published: list[KeyPublished] = []

        async def worker(engine_id: str, rank: int) -> None:
            client = WorkerClient(Address(socket_path=str(sock)), engine_id, rank)
            got = seen.setdefault((engine_id, rank), [])
            async for decision in client.decisions(0):
                got.append(decision)
                assert isinstance(decision.event, StoreJobStarted)
                job = decision.event
                committed = await client.report(
                    ReportRank(job_id=job.job_id, rank=rank, ok=True, checksums=[b.checksum(i.key, rank) for i in job.items])
                )
                published.extend(e for e in committed.events if isinstance(e, KeyPublished))
                if len(got) == requests:
                    return

        async def engine(engine_id: str) -> None:
            async with engine_client(sock, engine_id) as client:
                driver = Engine(client)
                decided[engine_id] = [await driver.request(index) for index in range(requests)]

        with anyio.fail_after(60):
            async with anyio.create_task_group() as tg:
                for engine_id in engines:
                    tg.start_soon(engine, engine_id)
                    for rank in (0, 1):
                        tg.start_soon(worker, engine_id, rank)

        for engine_id in engines:
            jobs = [job.job_id for job in decided[engine_id]]
            for rank in (0, 1):
                got = seen[(engine_id, rank)]
                assert [d.event.job_id for d in got] == jobs, f"{engine_id} rank {rank}"
                assert [d.seq for d in got] == sorted({d.seq for d in got})
        assert len(published) == len(engines) * requests * 2
        state, _ = await replay(event_log, EventCodec())
        async with sidecar.ledger.committed() as live:
            assert state_digest(state) == state_digest(live)


async def test_a_reply_comes_only_after_its_step_is_in_the_log(event_log: EventLog, tmp_path: Path) -> None:
    sock = tmp_path / "s.sock"
    async with sidecar_on(event_log, sock), engine_client(sock, "pod-a") as client:
        result = await client.step(1, 0.5, [StartOwner(engine_id="pod-a", req_id="r1")], command_id="step-1")
        stored = await event_log.read(result.first_seq - 1, result.last_seq - result.first_seq + 1)
        assert [s.global_seq for s in stored] == list(range(result.first_seq, result.last_seq + 1))
        assert stored[0].event_type == "step_began" and stored[-1].event_type == "step_ended"
        assert await event_log.head() >= result.last_seq


async def test_group_commit_puts_concurrent_steps_of_several_engines_in_one_append_each_stream_in_order(
    event_log: EventLog, tmp_path: Path
) -> None:
    sock = tmp_path / "s.sock"
    async with sidecar_on(event_log, sock) as sidecar:
        clients = [engine_client(sock, f"pod-{i}") for i in range(6)]
        for client in clients:
            await client.connect()
        try:

            async def run(client: EngineClient) -> None:
                for step in range(1, 11):
                    await client.step(step, float(step), [StartOwner(engine_id=client.engine_id, req_id=f"r{step}")])

            async with anyio.create_task_group() as tg:
                for client in clients:
                    tg.start_soon(run, client)
        finally:
            for client in clients:
                await client.aclose()
        groups = list(sidecar.metrics.group_size.collect())[0].samples
        count = next(s.value for s in groups if s.name.endswith("_count"))
        total = next(s.value for s in groups if s.name.endswith("_sum"))
        assert total >= 60 and count < total, "no two transactions were ever committed together"
    stored = await event_log.read(0, 100_000)
    for index in range(6):
        stream = [s for s in stored if s.stream_id == f"engine/pod-{index}"]
        assert [s.stream_version for s in stream] == list(range(1, len(stream) + 1))
        began = [EventCodec().decode(s.event_type, s.schema_version, s.payload) for s in stream if s.event_type == "step_began"]
        assert [e.step for e in began if isinstance(e, StepBegan)] == list(range(1, 11))


async def test_a_retried_step_returns_the_committed_result_once_and_appends_nothing(event_log: EventLog, tmp_path: Path) -> None:
    sock = tmp_path / "s.sock"
    async with sidecar_on(event_log, sock), engine_client(sock, "pod-a") as client:
        first = await client.step(1, 1.0, [StartOwner(engine_id="pod-a", req_id="r1")], command_id="the-step")
        head = await event_log.head()
        again = await client.step(1, 1.0, [StartOwner(engine_id="pod-a", req_id="r1")], command_id="the-step")
        assert again.duplicate and not first.duplicate
        assert (again.first_seq, again.last_seq) == (first.first_seq, first.last_seq)
        assert again.began + [e for r in again.results for e in r] + again.ended == (
            first.began + [e for r in first.results for e in r] + first.ended
        )
        assert await event_log.head() == head
        # The same step number with a new command id is a new step: refused as not advancing.
        fresh = await client.step(1, 1.0, [], command_id="another")
        assert isinstance(fresh.began[0], Refused) and fresh.began[0].reason == "step_not_advancing"


async def test_lookup_is_read_only_and_answers_from_committed_state(event_log: EventLog, tmp_path: Path) -> None:
    sock = tmp_path / "s.sock"
    async with sidecar_on(event_log, sock) as sidecar, engine_client(sock, "pod-a") as client:
        driver = Engine(client)
        job = await driver.request(0)
        tokens = [hash(("pod-a", 0, i)) % 50_000 for i in range(2 * b.BLOCK)]
        before = await client.lookup(b.TIER, tokens)
        assert isinstance(before.answer, PrefixLookedUp) and before.answer.boundary == 0, "not published yet (I5)"
        for rank in (0, 1):
            await client.report(
                ReportRank(job_id=job.job_id, rank=rank, ok=True, checksums=[b.checksum(i.key, rank) for i in job.items])
            )
        head = await event_log.head()
        after = await client.lookup(b.TIER, tokens)
        assert isinstance(after.answer, PrefixLookedUp) and after.answer.boundary == 2 * b.BLOCK
        assert [k for hit in after.answer.hits for k in hit.keys] == [i.key for i in job.items]
        # A Lookup is answered at once, never waiting for the groups in flight: a key one of them
        # changed is not loadable (here: the second block's key, as if its report were in flight).
        from coordinator.core.commands import LookupPrefix
        from coordinator.core.decider import lookup

        in_flight = lookup(
            sidecar.ledger.state, LookupPrefix(engine_id="pod-a", tier=b.TIER, token_ids=tokens), uncommitted={job.items[1].key}
        )
        assert isinstance(in_flight, PrefixLookedUp) and in_flight.boundary == b.BLOCK
        unknown = await client.lookup("no-such-tier", tokens)
        assert isinstance(unknown.answer, Refused) and unknown.answer.reason == "unknown_tier"
        assert await event_log.head() == head, "a lookup wrote to the log"


async def test_a_reconnecting_engine_keeps_its_incarnation_and_its_jobs(event_log: EventLog, tmp_path: Path) -> None:
    sock = tmp_path / "s.sock"
    async with sidecar_on(event_log, sock) as sidecar:
        client = engine_client(sock, "pod-a")
        await client.connect()
        job = await Engine(client).request(0)
        await client.aclose()
        assert client.incarnation == 1
        # A new connection of the same engine process: same incarnation, nothing fenced (I16).
        result = await client.step(10, 10.0, [])
        assert client.incarnation == 1 and not result.duplicate
        assert job.job_id in sidecar.ledger.state.jobs
        # A fresh engine process declares again while the old connection is open: a takeover, refused
        # unless the Hello says so (issue 17); then the new incarnation fences the old one's jobs
        # and connection.
        with pytest.raises(SidecarError) as connected:
            await engine_client(sock, "pod-a").connect()
        assert connected.value.code is p.ErrorCode.ENGINE_CONNECTED and sidecar.ledger.state.engines["pod-a"].incarnation == 1
        async with EngineClient(
            Address(socket_path=str(sock)), declaration("pod-a"), tiers=[TIER_SPEC], takeover=True
        ) as restarted:
            assert restarted.incarnation == 2
        assert job.job_id not in sidecar.ledger.state.jobs
        with pytest.raises(SidecarError) as stale:
            await client.step(11, 11.0, [])
        assert stale.value.code is p.ErrorCode.STALE_INCARNATION and "incarnation 2" in str(stale.value)
        await client.aclose()


async def test_after_a_cache_reset_the_engine_reconnects_as_its_new_incarnation(event_log: EventLog, tmp_path: Path) -> None:
    """ResetCache begins a new incarnation: the client follows it, so a later reconnect names it
    (it named the old one and was refused: found by the soak, after a reset and a serve restart)."""
    from coordinator.core.commands import ResetCache

    sock = tmp_path / "s.sock"
    async with sidecar_on(event_log, sock) as sidecar:
        client = engine_client(sock, "pod-a")
        await client.connect()
        await client.step(1, 1.0, [])
        await client.execute(ResetCache(engine_id="pod-a"))
        assert client.incarnation == sidecar.ledger.state.engines["pod-a"].incarnation == 2
        await client.aclose()
        result = await client.step(2, 2.0, [StartOwner(engine_id="pod-a", req_id="after-reset")])  # reconnects
        assert not result.duplicate and client.incarnation == 2
        assert sidecar.ledger.state.engines["pod-a"].incarnation == 2  # not a third: a reconnect, not a restart
        await client.aclose()


async def test_a_workers_welcome_never_shows_a_declaration_the_log_has_not_taken(
    event_log: EventLog, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A worker says Hello while its engine's declaration is being appended, and that append
    fails: the Welcome comes from the committed state, so it names no engine (incarnation 0),
    never one the log does not hold."""
    from events.log import LogUnavailable

    sock = tmp_path / "s.sock"
    async with sidecar_on(event_log, sock):
        appending, release = anyio.Event(), anyio.Event()
        append = event_log.append

        async def failing_append(batches: Sequence[AppendBatch]) -> list[AppendResult]:
            if any(b.stream_id == "engine/pod-a" for b in batches):
                appending.set()
                await release.wait()
                raise LogUnavailable("the log went away during this append")
            return await append(batches)

        monkeypatch.setattr(event_log, "append", failing_append)
        welcome: list[p.Welcome] = []

        async def declare() -> None:
            with pytest.raises((SidecarError, SidecarUnavailable)):
                async with engine_client(sock, "pod-a") as client:
                    client.retry_for = 0.2
                    await client.step(1, 1.0, [])

        async def worker_hello() -> None:
            await appending.wait()  # the declaration is folded in memory, not yet in the log
            welcome.append(await WorkerClient(Address(socket_path=str(sock)), "pod-a", 0).welcome())

        with anyio.fail_after(20):
            async with anyio.create_task_group() as tasks:
                tasks.start_soon(declare)
                tasks.start_soon(worker_hello)
                await appending.wait()
                await anyio.sleep(0.2)  # the worker's Hello is in; with the old code it was already answered
                release.set()
        [answer] = welcome
        assert answer.incarnation == 0 and answer.pools == [], answer


async def test_metrics_never_show_a_group_whose_append_is_in_flight(
    event_log: EventLog, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A scrape while a step that starts a store job is being appended, and that append fails:
    the gauges come from the committed state, so the job never shows as in flight."""
    from coordinator.core.commands import MarkComputed, StartStore
    from events.log import LogUnavailable

    sock = tmp_path / "s.sock"
    async with sidecar_on(event_log, sock, http=("127.0.0.1", 0)) as sidecar:
        async with engine_client(sock, "pod-a") as client:
            result = await client.step(1, 1.0, [StartOwner(engine_id="pod-a", req_id="r")])
            own = next(e for e in result.results[0] if isinstance(e, OwnerStarted)).owner_id
            result = await client.step(2, 2.0, [AllocateBlocks(engine_id="pod-a", owner_id=own, pool_id=0, count=2)])
            blocks = next(e for e in result.results[0] if isinstance(e, BlocksAllocated)).blocks
            await client.step(3, 3.0, [MarkComputed(engine_id="pod-a", owner_id=own, blocks=blocks, token_ids=list(range(8)))])
            appending, release = anyio.Event(), anyio.Event()
            append = event_log.append

            async def held_then_failed(batches: Sequence[AppendBatch]) -> list[AppendResult]:
                appending.set()
                await release.wait()
                raise LogUnavailable("the log went away during this append")

            monkeypatch.setattr(event_log, "append", held_then_failed)
            assert sidecar.http_address is not None
            url = f"http://{sidecar.http_address[0]}:{sidecar.http_address[1]}/metrics"
            scraped: list[str] = []

            def scrape() -> None:
                with urllib.request.urlopen(url, timeout=20) as response:
                    scraped.append(response.read().decode())

            async def store() -> None:
                client.retry_for = 0.1
                with pytest.raises((SidecarError, SidecarUnavailable)):
                    await client.step(4, 4.0, [StartStore(engine_id="pod-a", tier=b.TIER, blocks=blocks)])

            with anyio.fail_after(30):
                async with anyio.create_task_group() as tasks:
                    tasks.start_soon(store)
                    await appending.wait()  # the store job is folded in memory, not in the log
                    tasks.start_soon(anyio.to_thread.run_sync, scrape)
                    await anyio.sleep(0.3)
                    release.set()
                    monkeypatch.setattr(event_log, "append", append)
            [text] = scraped
            assert "kvledger_jobs_in_flight 0.0" in text, [line for line in text.splitlines() if "jobs_in_flight" in line]


# --- bad input ----------------------------------------------------------------------------------


async def test_bad_frames_get_typed_errors_and_only_their_connection_is_affected(event_log: EventLog, tmp_path: Path) -> None:
    sock = tmp_path / "s.sock"
    async with sidecar_on(event_log, sock, max_frame=4096), engine_client(sock, "pod-a") as bystander:
        await bystander.step(1, 1.0, [])
        raw = await RawConnection.open(sock)
        try:
            # Before Hello, anything else is refused; the connection stays open.
            await raw.send(p.Health())
            reply = await raw.receive()
            assert isinstance(reply, p.Error) and reply.code == p.ErrorCode.HELLO_FIRST and not reply.fatal
            assert isinstance(await raw.hello(role="observer"), p.Welcome)
            cases = {
                p.ErrorCode.MALFORMED_FRAME: b"\xc1\xc1\xc1",
                p.ErrorCode.UNKNOWN_MESSAGE: msgspec.msgpack.encode({"msg": "teleport_block"}),
                p.ErrorCode.INVALID_MESSAGE: msgspec.msgpack.encode({"msg": "step", "step": "one"}),
            }
            for code, body in cases.items():
                await raw.send_bytes(len(body).to_bytes(4, "big") + body)
                reply = await raw.receive()
                assert isinstance(reply, p.Error) and reply.code == code and not reply.fatal, (code, reply)
                assert code.value in repr(reply)
            # An observer may not step; the connection still answers.
            await raw.send(p.Step(step=1, clock=0.0, commands=[], command_id="x"))
            reply = await raw.receive()
            assert isinstance(reply, p.Error) and reply.code == p.ErrorCode.WRONG_ROLE
            await raw.send(p.Health())
            assert isinstance(await raw.receive(), p.HealthResult)
            # Oversized: refused by its header alone, then the connection is closed.
            await raw.send_bytes((5000).to_bytes(4, "big") + b"\x00" * 10)
            reply = await raw.receive()
            assert isinstance(reply, p.Error) and reply.code == p.ErrorCode.FRAME_TOO_LARGE and reply.fatal
            assert "4096" in reply.message
            assert await raw.closed()
        finally:
            await raw.aclose()
        # Everyone else was served throughout.
        assert not (await bystander.step(2, 2.0, [])).duplicate
        assert (await bystander.health()).ready


async def test_a_protocol_version_mismatch_is_refused_naming_both_versions(event_log: EventLog, tmp_path: Path) -> None:
    sock = tmp_path / "s.sock"
    async with sidecar_on(event_log, sock):
        raw = await RawConnection.open(sock)
        try:
            await raw.send(p.Hello(protocol=99, role="observer"))
            reply = await raw.receive()
            assert isinstance(reply, p.Error) and reply.code == p.ErrorCode.PROTOCOL_MISMATCH and reply.fatal
            assert "99" in reply.message and str(p.PROTOCOL_VERSION) in reply.message
            assert await raw.closed()
        finally:
            await raw.aclose()


async def test_an_engine_cannot_speak_for_another_and_nothing_of_its_step_is_committed(
    event_log: EventLog, tmp_path: Path
) -> None:
    sock = tmp_path / "s.sock"
    async with sidecar_on(event_log, sock), engine_client(sock, "pod-a") as client:
        await client.step(1, 1.0, [])
        head = await event_log.head()
        with pytest.raises(SidecarError) as refused:
            await client.step(2, 2.0, [StartOwner(engine_id="pod-a", req_id="ok"), StartOwner(engine_id="pod-b", req_id="x")])
        assert refused.value.code == p.ErrorCode.INVALID_MESSAGE and "pod-b" in str(refused.value)
        assert await event_log.head() == head
        assert not (await client.step(2, 2.0, [])).duplicate


async def test_a_refused_engine_declaration_is_a_typed_error(event_log: EventLog, tmp_path: Path) -> None:
    sock = tmp_path / "s.sock"
    async with sidecar_on(event_log, sock):
        bad = declaration("pod-a", world_size=2)
        bad = msgspec.structs.replace(bad, world_size=3)  # the namespace says 2
        client = EngineClient(Address(socket_path=str(sock)), bad, tiers=[TIER_SPEC])
        with pytest.raises(SidecarError) as refused:
            await client.connect()
        assert refused.value.code == p.ErrorCode.REFUSED and "namespace_mismatch" in str(refused.value)


async def test_tcp_needs_the_token_compared_whole_and_never_logs_it(event_log: EventLog, tmp_path: Path) -> None:
    from structlog.testing import capture_logs

    sock = tmp_path / "s.sock"
    secret = "s3cret-token-value"
    with capture_logs() as logs:
        async with sidecar_on(event_log, sock, tcp=("127.0.0.1", 0), token=secret) as sidecar:
            assert sidecar.tcp_address is not None
            for token in ("", "s3cret", secret + "x"):
                client = EngineClient(Address(tcp=sidecar.tcp_address, token=token), declaration("pod-a"), tiers=[TIER_SPEC])
                with pytest.raises(SidecarError) as refused:
                    await client.connect()
                assert refused.value.code == p.ErrorCode.UNAUTHORIZED
            async with EngineClient(
                Address(tcp=sidecar.tcp_address, token=secret), declaration("pod-a"), tiers=[TIER_SPEC]
            ) as ok:
                assert not (await ok.step(1, 1.0, [])).duplicate
    assert secret not in repr(logs)


def test_tcp_without_a_token_or_off_loopback_refuses_to_start(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="token"):
        check_config(ServeConfig(socket_path=str(tmp_path / "s"), tcp=("127.0.0.1", 7000)))
    with pytest.raises(ConfigError, match="--allow-remote"):
        check_config(ServeConfig(socket_path=str(tmp_path / "s"), tcp=("0.0.0.0", 7000), token="t"))
    with pytest.raises(ConfigError, match="--allow-remote"):
        check_config(ServeConfig(socket_path=str(tmp_path / "s"), http=("10.1.2.3", 9464)))
    check_config(ServeConfig(socket_path=str(tmp_path / "s"), tcp=("0.0.0.0", 7000), token="t", allow_remote=True))


async def test_the_unix_socket_is_owner_only(event_log: EventLog, tmp_path: Path) -> None:
    sock = tmp_path / "s.sock"
    async with sidecar_on(event_log, sock):
        mode = stat.S_IMODE(os.stat(sock).st_mode)
        assert mode == 0o600, oct(mode)
    assert not sock.exists(), "the socket is removed at shutdown"


# --- subscribers ------------------------------------------------------------------------------


def test_a_full_subscription_buffer_cuts_off_with_the_sequence_to_resume_from() -> None:
    subscription = Subscription("pod-a", 0, from_seq=0, registered_at=0, capacity=3)
    decisions = [
        Decision(seq, StoreJobStarted(job_id=seq, engine_id="pod-a", incarnation=1, tier="t", world_size=1, items=[]))
        for seq in range(1, 6)
    ]
    subscription.offer(decisions[:2])
    subscription.delivered = 0
    subscription.offer(decisions[2:])  # 5 > 3: cut off, nothing more is buffered

    async def take() -> None:
        await subscription.live()

    with pytest.raises(SlowSubscriber) as cut:
        anyio.run(take)
    assert cut.value.resume_from == 0 and "resume from sequence 0" in str(cut.value)


@pytest.mark.parametrize("grace", ["reads-again-in-time", "stays-stalled"])
async def test_a_slow_subscriber_is_cut_off_and_resumes_without_gaps_or_repeats(
    event_log: EventLog, tmp_path: Path, grace: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A worker that stops reading is disconnected once its buffer (here 2 decisions) is full;
    the others are not slowed. If it reads again within the grace it gets an Error naming
    `resume_from`; if it stays stalled, the blocked send is cut and the connection just ends.
    Subscribing again from the last decision it got delivers the rest: together, every decision
    exactly once, in order."""
    import coordinator.sidecar.hub as hub_module

    if grace == "stays-stalled":
        monkeypatch.setattr(hub_module, "SEND_GRACE", 0.05)
    sock = tmp_path / "s.sock"
    big_block = 1 << 16
    pools = [msgspec.structs.replace(b.attention_pool(num_blocks=64), bytes_per_block=big_block)]
    async with sidecar_on(event_log, sock, subscriber_buffer=2):
        stalled = await RawConnection.open(sock)
        assert isinstance(await stalled.hello(role="worker", engine_id="pod-a", rank=0), p.Welcome)
        await stalled.send(p.Subscribe(from_seq=0))
        client = EngineClient(Address(socket_path=str(sock)), declaration("pod-a", pools=pools), tiers=[TIER_SPEC])
        async with client:
            driver = Engine(client)
            first = await driver.step([StartOwner(engine_id="pod-a", req_id="r")])
            owner = next(e for e in first.results[0] if isinstance(e, OwnerStarted)).owner_id
            copies = []
            for _ in range(24):  # each decision is ~22 KiB: together more than the socket buffers hold
                alloc = await driver.step([AllocateBlocks(engine_id="pod-a", owner_id=owner, pool_id=0, count=2)])
                src, dst = next(e for e in alloc.results[0] if isinstance(e, BlocksAllocated)).blocks
                moves = [Move(src, 2 * i, dst, 2 * i + 1, 1) for i in range(1000)]
                result = await driver.step([PlanStateCopy(engine_id="pod-a", pool_id=0, moves=moves)])
                copies += result.decisions
        got: list[Decision] = []
        cut: p.Error | None = None
        ended = False
        while cut is None and not ended:
            try:
                message = await stalled.receive()
            except (anyio.EndOfStream, anyio.IncompleteRead, anyio.BrokenResourceError, ConnectionError):
                ended = True  # cut while its send was blocked: no room for an Error frame
                continue
            if isinstance(message, p.Decisions):
                got += message.items
            else:
                assert isinstance(message, p.Error), message
                cut = message
        await stalled.aclose()
        assert len(got) < len(copies), "the stalled subscriber was never cut off"
        if grace == "reads-again-in-time":
            assert cut is not None and cut.code == p.ErrorCode.SLOW_SUBSCRIBER and cut.fatal
            assert (got[-1].seq if got else 0) == cut.resume_from
        else:
            assert ended and cut is None
        worker = WorkerClient(Address(socket_path=str(sock)), "pod-a", 0)
        rest: list[Decision] = []
        with anyio.fail_after(30):
            async for decision in worker.decisions(got[-1].seq if got else 0):
                rest.append(decision)
                if len(got) + len(rest) == len(copies):
                    break
        assert [d.seq for d in got + rest] == [d.seq for d in copies]


# --- observability ------------------------------------------------------------------------------


async def test_metrics_health_and_readiness_over_http(event_log: EventLog, tmp_path: Path) -> None:
    sock = tmp_path / "s.sock"
    async with sidecar_on(event_log, sock, http=("127.0.0.1", 0)) as sidecar, engine_client(sock, "pod-a") as client:
        driver = Engine(client)
        await driver.request(0)
        await client.step(driver.step_no + 1, 99.0, [AllocateBlocks(engine_id="pod-a", owner_id=424242, pool_id=0, count=1)])
        assert sidecar.http_address is not None
        base = f"http://{sidecar.http_address[0]}:{sidecar.http_address[1]}"

        def get(path: str) -> tuple[int, str]:
            try:
                with urllib.request.urlopen(base + path, timeout=10) as response:
                    return response.status, response.read().decode()
            except urllib.error.HTTPError as error:
                return error.code, error.read().decode()

        status, text = await anyio.to_thread.run_sync(get, "/metrics")
        assert status == 200
        for name in (
            "kvledger_step_seconds_bucket",
            "kvledger_events_appended_total",
            "kvledger_pins",
            "kvledger_draining_slots",
            "kvledger_published_keys",
            "kvledger_lease_expiries_total",
        ):
            assert name in text, name
        assert 'kvledger_refusals_total{kind="refused",reason="unknown_owner"} 1.0' in text
        assert 'kvledger_pins{engine="pod-a"} 2.0' in text, "the store job pins its two source blocks (I3)"
        assert await anyio.to_thread.run_sync(get, "/healthz") == (
            200,
            f'{{"alive":true,"global_seq":{sidecar.ledger.last_seq}}}',
        )
        status, body = await anyio.to_thread.run_sync(get, "/readyz")
        assert (status, msgspec.json.decode(body)) == (200, {"ready": True, "reason": "ready"})
        sidecar.draining = True
        status, body = await anyio.to_thread.run_sync(get, "/readyz")
        assert status == 503 and msgspec.json.decode(body)["reason"] == "shutting down"
        sidecar.draining = False


async def test_a_log_that_fails_makes_the_step_fail_whole_and_readiness_false(tmp_path: Path) -> None:
    """The log fails an append (a fault injected at the log's boundary: the sidecar, the ledger
    and the committer are all real): the step fails whole, readiness says why, the state is what
    the log holds, and the next step after the log recovers commits."""
    from events.log import open_log

    event_log = await open_log(str(tmp_path / "log.sqlite"))
    sock = tmp_path / "s.sock"
    try:
        async with sidecar_on(event_log, sock) as sidecar, engine_client(sock, "pod-a") as client:
            client.retry_for = 0.5
            await client.step(1, 1.0, [StartOwner(engine_id="pod-a", req_id="r1")])
            digest = state_digest(sidecar.ledger.state)
            ledger: Ledger = sidecar.ledger
            original = ledger.log.append

            async def failing(batches: Sequence[AppendBatch]) -> list[AppendResult]:
                raise OSError("disk I/O error (injected)")

            ledger.log.append = failing  # type: ignore[method-assign]
            try:
                with pytest.raises(Exception) as failed:
                    await client.step(2, 2.0, [StartOwner(engine_id="pod-a", req_id="r2")])
                assert "disk I/O error" in str(failed.value)
                ready, reason = sidecar.readiness()
                assert not ready and "disk I/O error" in reason
                assert state_digest(ledger.state) == digest, "the state kept what the log did not take"
            finally:
                ledger.log.append = original  # type: ignore[method-assign]
            assert not (await client.step(2, 2.0, [StartOwner(engine_id="pod-a", req_id="r2")])).duplicate
            assert sidecar.readiness() == (True, "ready")
    finally:
        await event_log.close()


async def test_a_store_with_nothing_new_is_not_sent_to_workers(event_log: EventLog, tmp_path: Path) -> None:
    """Storing keys the tier already holds succeeds at once (I10): the decision is recorded, but
    no worker is asked to do (and report) nothing."""
    sock = tmp_path / "s.sock"
    async with sidecar_on(event_log, sock), engine_client(sock, "pod-a") as client:
        driver = Engine(client)
        job = await driver.request(0)
        for rank in (0, 1):
            await client.report(
                ReportRank(job_id=job.job_id, rank=rank, ok=True, checksums=[b.checksum(i.key, rank) for i in job.items])
            )
        owner = next(
            e
            for e in (await driver.step([StartOwner(engine_id="pod-a", req_id="again")])).results[0]
            if isinstance(e, OwnerStarted)
        ).owner_id
        blocks = next(
            e
            for e in (await driver.step([AllocateBlocks(engine_id="pod-a", owner_id=owner, pool_id=0, count=2)])).results[0]
            if isinstance(e, BlocksAllocated)
        ).blocks
        from coordinator.core.commands import MarkComputed, StartStore

        tokens = [hash(("pod-a", 0, i)) % 50_000 for i in range(2 * b.BLOCK)]
        result = await driver.step(
            [
                MarkComputed(engine_id="pod-a", owner_id=owner, blocks=blocks, token_ids=tokens),
                StartStore(engine_id="pod-a", tier=b.TIER, blocks=blocks),
            ]
        )
        stored = [e for e in result.results[1] if isinstance(e, StoreJobStarted)]
        assert stored and not stored[0].items and stored[0].already_published == [i.key for i in job.items]
        assert result.decisions == []


# --- failures inside the sidecar (found in review) -------------------------------------------------


async def test_a_hello_that_fails_to_commit_affects_only_its_connection(event_log: EventLog, tmp_path: Path) -> None:
    """Any error while committing one engine's Hello is that connection's COMMIT_FAILED; the
    sidecar goes on serving the others (an unexpected error used to end `serve`)."""
    sock = tmp_path / "s.sock"
    async with sidecar_on(event_log, sock) as sidecar, engine_client(sock, "pod-a") as bystander:
        await bystander.step(1, 1.0, [])
        original = sidecar.ledger.log.append

        async def broken(batches: Sequence[AppendBatch]) -> list[AppendResult]:
            raise RuntimeError("driver exploded (injected)")

        sidecar.ledger.log.append = broken  # type: ignore[method-assign]
        try:
            newcomer = engine_client(sock, "pod-b")
            newcomer.retry_for = 0
            with pytest.raises(SidecarError) as failed:
                await newcomer.connect()
            assert failed.value.code == p.ErrorCode.COMMIT_FAILED and "driver exploded" in str(failed.value)
        finally:
            sidecar.ledger.log.append = original  # type: ignore[method-assign]
        assert not (await bystander.step(2, 2.0, [])).duplicate
        assert "pod-b" not in sidecar.ledger.state.engines


async def test_a_hello_with_a_refused_tier_declares_nothing_and_fences_nothing(event_log: EventLog, tmp_path: Path) -> None:
    sock = tmp_path / "s.sock"
    async with sidecar_on(event_log, sock) as sidecar, engine_client(sock, "pod-a") as running:
        job = await Engine(running).request(0)
        other_tier = msgspec.structs.replace(TIER_SPEC, num_slots=TIER_SPEC.num_slots + 1)
        impostor = EngineClient(Address(socket_path=str(sock)), declaration("pod-a"), tiers=[other_tier], takeover=True)
        with pytest.raises(SidecarError) as refused:
            await impostor.connect()
        assert refused.value.code == p.ErrorCode.REFUSED and "tier_spec_changed" in str(refused.value)
        assert sidecar.ledger.state.engines["pod-a"].incarnation == 1, "a refused Hello restarted the engine"
        assert job.job_id in sidecar.ledger.state.jobs, "a refused Hello fenced the running engine's job"


async def test_command_ids_are_per_engine_so_a_shared_id_never_returns_another_engines_events(
    event_log: EventLog, tmp_path: Path
) -> None:
    sock = tmp_path / "s.sock"
    async with sidecar_on(event_log, sock), engine_client(sock, "pod-a") as a, engine_client(sock, "pod-b") as b_:
        first = await a.step(1, 1.0, [StartOwner(engine_id="pod-a", req_id="secret-a")], command_id="step-1")
        second = await b_.step(1, 1.0, [StartOwner(engine_id="pod-b", req_id="b")], command_id="step-1")
        assert not second.duplicate and second.first_seq > first.last_seq
        [owner] = [e for e in second.results[0] if isinstance(e, OwnerStarted)]
        assert owner.req_id == "b" and owner.engine_id == "pod-b"
        again = await a.step(1, 1.0, [StartOwner(engine_id="pod-a", req_id="secret-a")], command_id="step-1")
        assert again.duplicate and again.first_seq == first.first_seq


async def test_a_failed_snapshot_fails_no_step_and_loses_no_decision(event_log: EventLog, tmp_path: Path) -> None:
    """A snapshot is a cache: when writing one fails, the step that triggered it is still
    committed, answered once, and its decisions still reach the workers."""
    sock = tmp_path / "s.sock"
    async with sidecar_on(event_log, sock) as sidecar, engine_client(sock, "pod-a") as client:
        sidecar.ledger._snapshot_every = 1  # noqa: SLF001 - every step tries to snapshot
        original = sidecar.ledger.log.save_snapshot

        async def full_disk(snapshot: object) -> None:
            raise OSError("no space left on device (injected)")

        sidecar.ledger.log.save_snapshot = full_disk  # type: ignore[method-assign]
        worker = WorkerClient(Address(socket_path=str(sock)), "pod-a", 0)
        got: list[Decision] = []
        try:
            async with anyio.create_task_group() as tg:

                async def listen() -> None:
                    async for decision in worker.decisions(0):
                        got.append(decision)

                tg.start_soon(listen)
                job = await Engine(client).request(0)
                with anyio.fail_after(10):
                    while not got:
                        await anyio.sleep(0.01)
                tg.cancel_scope.cancel()
        finally:
            sidecar.ledger.log.save_snapshot = original  # type: ignore[method-assign]
        assert [d.event.job_id for d in got] == [job.job_id]


async def test_a_rebuild_that_fails_is_retried_before_anything_else_is_decided(event_log: EventLog, tmp_path: Path) -> None:
    """The append fails and so does the rebuild after it (the database is down): the state in
    memory still holds the failed step. Nothing may be decided on it: the next step first
    rebuilds, and what the log then holds is exactly the state."""
    from coordinator.recovery import replay as replay_log

    sock = tmp_path / "s.sock"
    async with sidecar_on(event_log, sock) as sidecar, engine_client(sock, "pod-a") as client:
        client.retry_for = 0
        await client.step(1, 1.0, [StartOwner(engine_id="pod-a", req_id="r1")])
        log_ = sidecar.ledger.log
        append, read_steps = log_.append, log_.read_steps

        async def down(*_: object, **__: object) -> list[AppendResult]:
            raise OSError("database is down (injected)")

        log_.append = down  # type: ignore[method-assign]
        log_.read_steps = down  # type: ignore[method-assign,assignment]
        try:
            with pytest.raises(SidecarUnavailable, match="database is down"):
                await client.step(2, 2.0, [StartOwner(engine_id="pod-a", req_id="r2-lost")])
            assert sidecar.ledger.stale and not sidecar.readiness()[0]
        finally:
            log_.append, log_.read_steps = append, read_steps  # type: ignore[method-assign]
        await client.step(2, 2.0, [StartOwner(engine_id="pod-a", req_id="r3")])
        assert not sidecar.ledger.stale
        replayed, _ = await replay_log(event_log, EventCodec())
        async with sidecar.ledger.committed() as live:
            assert state_digest(replayed) == state_digest(live)
            assert sorted(o.req_id for o in live.owners.values()) == ["r1", "r3"]


async def test_a_transaction_the_core_fails_on_fails_alone_and_the_rest_of_its_group_commits(
    event_log: EventLog, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A bug in the core on one transaction of a group: that one gets the error, the others are
    committed without it (they were failed with it before), and readiness is untouched."""
    from coordinator.core import decider
    from coordinator.core.commands import DeclareTier
    from coordinator.ledger import Step
    from coordinator.sidecar.committer import Committer
    from coordinator.sidecar.hub import DecisionHub
    from coordinator.sidecar.metrics import SidecarMetrics
    from tests.sidecar_kit import TIER_SPEC

    ledger = await Ledger.open(event_log)
    await ledger.execute(DeclareTier(spec=TIER_SPEC))
    engines = ["pod-a", "pod-b", "pod-c", "pod-d"]
    for engine in engines:
        await ledger.execute(declaration(engine))
    real = decider._HANDLERS[StartOwner]

    def buggy(state: object, command: StartOwner) -> object:
        if command.req_id == "boom":
            raise ZeroDivisionError("a bug in the core")
        return real(state, command)  # type: ignore[arg-type]

    monkeypatch.setitem(decider._HANDLERS, StartOwner, buggy)  # type: ignore[misc]
    committer = Committer(
        ledger, DecisionHub(ledger.log, ledger.codec, ledger.last_seq, 100), SidecarMetrics(lambda: ledger.state)
    )
    outcomes: dict[str, object] = {}

    async def submit(engine: str, req_id: str) -> None:
        tx = Step(
            engine_id=engine, step=1, clock=1.0, commands=[StartOwner(engine_id=engine, req_id=req_id)], command_id=f"{engine}-1"
        )
        try:
            outcomes[engine] = await committer.submit(tx)
        except ZeroDivisionError as error:
            outcomes[engine] = error

    with anyio.fail_after(20):
        async with anyio.create_task_group() as tasks:
            for engine, req_id in zip(engines, ["r", "boom", "r", "boom"], strict=True):
                tasks.start_soon(submit, engine, req_id)
            await anyio.sleep(0.05)  # all four queued: the committer takes them as one group
            tasks.start_soon(committer.run)
            while len(outcomes) < len(engines):
                await anyio.sleep(0.01)
            committer.close()
    assert isinstance(outcomes["pod-b"], ZeroDivisionError) and isinstance(outcomes["pod-d"], ZeroDivisionError)
    assert not isinstance(outcomes["pod-a"], Exception) and not isinstance(outcomes["pod-c"], Exception), outcomes
    assert committer.failure is None  # the log never failed: readiness stays true
    stored = await event_log.read(0, 100_000)
    began = {s.stream_id for s in stored if s.event_type == "step_began"}
    assert began == {"engine/pod-a", "engine/pod-c"}
    full, _ = await replay(event_log, EventCodec())
    assert state_digest(full) == state_digest(ledger.state)  # what the failed transactions folded is gone


async def test_a_frame_begun_and_never_finished_is_cut_off_and_others_are_served(event_log: EventLog, tmp_path: Path) -> None:
    sock = tmp_path / "s.sock"
    async with sidecar_on(event_log, sock, frame_timeout=0.5), engine_client(sock, "pod-a") as bystander:
        raw = await RawConnection.open(sock)
        await raw.send_bytes((100).to_bytes(p.HEADER_BYTES, "big") + b"\x00" * 10)  # 10 of 100 bytes, then nothing
        reply = await raw.receive()
        assert isinstance(reply, p.Error) and reply.fatal and "not complete after 0.5 s" in reply.message, reply
        assert await raw.closed()
        await bystander.step(1, 1.0, [])  # everyone else is served


@pytest.mark.parametrize("sent", [1, 2, 3])
async def test_a_header_begun_and_never_finished_is_cut_off_and_others_are_served(
    event_log: EventLog, tmp_path: Path, sent: int
) -> None:
    """1-3 bytes of a frame's 4-byte header, then nothing: the frame deadline covers the header too."""
    sock = tmp_path / "s.sock"
    async with sidecar_on(event_log, sock, frame_timeout=0.5), engine_client(sock, "pod-a") as bystander:
        raw = await RawConnection.open(sock)
        await raw.send_bytes((100).to_bytes(p.HEADER_BYTES, "big")[:sent])
        reply = await raw.receive()
        assert isinstance(reply, p.Error) and reply.fatal and "not complete after 0.5 s" in reply.message, reply
        assert await raw.closed()
        await bystander.step(1, 1.0, [])


async def test_a_step_of_too_many_commands_is_refused_and_nothing_is_committed(event_log: EventLog, tmp_path: Path) -> None:
    from coordinator.sidecar.admission import MAX_COMMANDS_PER_STEP

    sock = tmp_path / "s.sock"
    async with sidecar_on(event_log, sock) as sidecar, engine_client(sock, "pod-a") as client:
        head = sidecar.ledger.last_seq
        commands = [StartOwner(engine_id="pod-a", req_id=f"r{i}") for i in range(MAX_COMMANDS_PER_STEP + 1)]
        with pytest.raises(SidecarError) as refused:
            await client.step(1, 1.0, commands)
        assert refused.value.code == p.ErrorCode.INVALID_MESSAGE and "split it" in str(refused.value)
        assert sidecar.ledger.last_seq == head
        await client.step(1, 1.0, commands[:MAX_COMMANDS_PER_STEP])  # at the limit: taken


async def test_a_failed_commit_tells_the_client_no_sql(
    event_log: EventLog, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import sqlalchemy as sa

    sock = tmp_path / "s.sock"
    async with sidecar_on(event_log, sock), engine_client(sock, "pod-a") as client:
        client.retry_for = 0.1

        async def failing(batches: Sequence[AppendBatch]) -> list[AppendResult]:
            raise sa.exc.IntegrityError(
                "INSERT INTO kvl_steps (secret_column) VALUES (?)", ("tenant-a's-payload",), Exception("boom")
            )

        monkeypatch.setattr(event_log, "append", failing)
        with pytest.raises((SidecarError, SidecarUnavailable)) as failed:
            await client.step(1, 1.0, [StartOwner(engine_id="pod-a", req_id="r")])
        text = str(failed.value)
        assert "IntegrityError" in text and "boom" in text, text
        assert "INSERT" not in text and "secret_column" not in text and "tenant-a's-payload" not in text, text


async def test_a_slow_snapshot_write_holds_up_no_step_through_the_committer(
    event_log: EventLog, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The sidecar's committer writes due snapshots in a task of its own: with a snapshot due
    after every step and each write taking 3 s, steps are still answered at once (before, each
    waited for its own snapshot and the next for the one before: found in review)."""
    from coordinator.core.commands import DeclareTier
    from coordinator.ledger import Step
    from coordinator.sidecar.committer import Committer
    from coordinator.sidecar.hub import DecisionHub
    from coordinator.sidecar.metrics import SidecarMetrics
    from tests.sidecar_kit import TIER_SPEC

    ledger = await Ledger.open(event_log, snapshot_every=1)
    await ledger.execute(DeclareTier(spec=TIER_SPEC))
    await ledger.execute(declaration("pod-a"))
    save = event_log.save_snapshot
    writes: list[int] = []

    async def slow_save(snapshot: object) -> None:
        await anyio.sleep(3.0)
        await save(snapshot)  # type: ignore[arg-type]
        writes.append(1)

    monkeypatch.setattr(event_log, "save_snapshot", slow_save)
    committer = Committer(
        ledger, DecisionHub(ledger.log, ledger.codec, ledger.last_seq, 100), SidecarMetrics(lambda: ledger.state)
    )
    with anyio.fail_after(30):
        async with anyio.create_task_group() as tasks:
            tasks.start_soon(committer.run)
            for step in (1, 2, 3):
                await committer.submit(
                    Step(
                        engine_id="pod-a",
                        step=step,
                        clock=float(step),
                        commands=[StartOwner(engine_id="pod-a", req_id=f"r{step}")],
                        command_id=f"s{step}",
                    )
                )
            answered_before_any_write = not writes
            while not writes:  # the writes go on beside the steps
                await anyio.sleep(0.05)
            committer.close()
    assert answered_before_any_write, "a step waited for a snapshot write"


async def test_a_worker_report_to_a_sidecar_that_never_answers_is_sidecar_unavailable(tmp_path: Path) -> None:
    """A sidecar that accepts connections but never answers the Hello (stopped, wedged): the
    report is retried until `retry_for` and then raises SidecarUnavailable, what callers handle
    (the vLLM worker refuses the load), not the Hello's own TimeoutError."""
    path = tmp_path / "silent.sock"
    accepted: list[anyio.abc.SocketStream] = []
    listener = await anyio.create_unix_listener(path)

    async def keep(stream: anyio.abc.SocketStream) -> None:
        accepted.append(stream)  # held open, never read from nor written to
        await anyio.sleep_forever()

    async with anyio.create_task_group() as tasks:
        tasks.start_soon(listener.serve, keep)
        client = WorkerClient(Address(socket_path=str(path)), "pod-a", 0, retry_for=0.3)
        with anyio.fail_after(20), pytest.raises(SidecarUnavailable, match="unavailable"):
            await client.report(ReportRank(job_id=1, rank=0, ok=True, checksums=[b"x"]))
        tasks.cancel_scope.cancel()
    await listener.aclose()
    assert accepted, "the client did connect"
