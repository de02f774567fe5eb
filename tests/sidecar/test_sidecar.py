"""The sidecar through its real socket: several engines and workers at once, group commit,
exactly-once retries, read-only lookups, and every bad input the protocol names. Its group commit
is in tests/sidecar/test_sidecar_committer.py, its decisions to workers in tests/sidecar/test_sidecar_hub.py.

Each test runs a real Sidecar (coordinator/sidecar/server.py) in this process on a real Unix
socket and a real log; the process-level cases (SIGTERM, SIGKILL, the CLI) are in
tests/sidecar/test_sidecar_process.py.
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

from coordinator import unix_streams
from coordinator.client import Address, EngineClient, SidecarError, SidecarUnavailable, WorkerClient
from coordinator.core.commands import AllocateBlocks, ReportRank, StartOwner
from coordinator.sidecar import protocol as p
from coordinator.sidecar.config import ConfigError, ServeConfig, check_config
from events import OwnerStarted, PrefixLookedUp, Refused
from events.log import AppendBatch, AppendResult, EventLog
from tests.kit import builders as b
from tests.kit.sidecar import TIER_SPEC, Engine, RawConnection, declaration, engine_client, sidecar_on

pytestmark = pytest.mark.anyio


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


# --- failures inside the sidecar (found in review) -------------------------------------------------


async def test_a_hello_that_fails_to_commit_affects_only_its_connection(event_log: EventLog, tmp_path: Path) -> None:
    """Any error while committing one engine's Hello is that connection's COMMIT_FAILED; the
    sidecar goes on serving the others (an unexpected error used to end `serve`)."""
    sock = tmp_path / "s.sock"
    async with sidecar_on(event_log, sock) as sidecar, engine_client(sock, "pod-a") as bystander:
        await bystander.step(1, 1.0, [])
        original = sidecar.ledger.log.append

        async def broken(batches: Sequence[AppendBatch], *, expected_head: int | None = None) -> list[AppendResult]:
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


async def test_a_worker_report_to_a_sidecar_that_never_answers_is_sidecar_unavailable(tmp_path: Path) -> None:
    """A sidecar that accepts connections but never answers the Hello (stopped, wedged): the
    report is retried until `retry_for` and then raises SidecarUnavailable, what callers handle
    (the vLLM worker refuses the load), not the Hello's own TimeoutError."""
    path = tmp_path / "silent.sock"
    accepted: list[anyio.abc.SocketStream] = []
    listener = await unix_streams.create_unix_listener(path)

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
