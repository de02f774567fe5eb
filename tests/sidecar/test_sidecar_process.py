"""`kvledger serve` as a real process: its startup line and JSON logs, SIGTERM (drain,
snapshot, exit 0), and SIGKILL under load (a restart recovers exactly the committed state; the
engine's in-flight step, retried with its command id, is committed exactly once).

Every subprocess is killed in a `finally` (tests/kit/sidecar.py, serve_process)."""

from __future__ import annotations

import json
import random
import signal
import subprocess
import sys
from pathlib import Path

import anyio
import pytest

from coordinator.client import Address, EngineClient, WorkerClient
from coordinator.core.commands import StartOwner
from coordinator.core.state import state_digest
from coordinator.ledger.recovery import replay
from events import EventCodec, OwnerStarted, StepBegan
from events.log import open_log
from tests.kit.sidecar import ROOT, TIER_SPEC, Engine, declaration, serve_process

pytestmark = pytest.mark.anyio


def test_serve_prints_where_it_listens_and_logs_json_lines(tmp_path: Path) -> None:
    with serve_process(tmp_path, env={"KVLEDGER_LOG_LEVEL": "debug"}) as server:

        async def one_step() -> None:
            async with EngineClient(Address(socket_path=str(server.socket)), declaration("pod-a"), tiers=[TIER_SPEC]) as client:
                await client.step(1, 1.0, [StartOwner(engine_id="pod-a", req_id="r1")])

        anyio.run(one_step)
        server.signal(signal.SIGTERM)
        assert server.wait() == 0
        stdout = server.stdout()
    [line] = stdout.splitlines()
    assert line.startswith("kvledger serving: log ") and str(server.socket) in line and "http off" in line
    records = [json.loads(raw) for raw in server.stderr().splitlines() if raw.startswith("{")]
    assert records, server.stderr()
    step = next(r for r in records if r["event"] == "step_committed")
    assert (step["engine"], step["step"], step["level"]) == ("pod-a", 1, "debug")
    assert {"timestamp", "level", "event"} <= set(records[0])


def test_serve_refuses_tcp_without_a_token_in_one_line(tmp_path: Path) -> None:
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "coordinator.cli",
            "serve",
            "--socket",
            str(tmp_path / "s.sock"),
            "--log",
            str(tmp_path / "log.sqlite"),
            "--tcp",
            "127.0.0.1:0",
            "--http",
            "off",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        env={"PATH": "/usr/bin:/bin", "KVLEDGER_DATA_DIR": str(tmp_path)},
    )
    assert run.returncode == 2
    assert (
        run.stderr.strip().splitlines()[-1]
        == "kvledger serve: --tcp needs a token (--token or KVLEDGER_TOKEN, or a token in --credentials): TCP clients must authenticate"
    )


def test_serve_on_a_socket_path_that_is_a_regular_file_is_one_line_and_exit_2(tmp_path: Path) -> None:
    taken = tmp_path / "not-a-socket"
    taken.write_text("an operator's file\n")
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "coordinator.cli",
            "serve",
            "--socket",
            str(taken),
            "--log",
            str(tmp_path / "log.sqlite"),
            "--http",
            "off",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        env={"PATH": "/usr/bin:/bin", "KVLEDGER_DATA_DIR": str(tmp_path)},
    )
    assert run.returncode == 2, run.stderr
    assert (
        run.stderr.strip().splitlines()[-1]
        == f"kvledger serve: --socket {taken} exists and is not a socket; refusing to replace it"
    )
    assert "Traceback" not in run.stderr
    assert taken.read_text() == "an operator's file\n"


def test_sigterm_finishes_in_flight_steps_snapshots_and_exits_0(tmp_path: Path) -> None:
    with serve_process(tmp_path) as server:
        results = []

        async def steps_until_closed() -> None:
            async with EngineClient(
                Address(socket_path=str(server.socket)), declaration("pod-a"), tiers=[TIER_SPEC], retry_for=0.5
            ) as client:
                for step in range(1, 10_000):
                    try:
                        results.append(await client.step(step, float(step), [StartOwner(engine_id="pod-a", req_id=f"r{step}")]))
                    except Exception:  # noqa: BLE001 - the server went away: the test checks what was committed
                        return
                    if step == 20:
                        server.signal(signal.SIGTERM)

        anyio.run(steps_until_closed)
        assert server.wait() == 0
        assert not server.socket.exists()

    async def check() -> None:
        event_log = await open_log(str(server.log_path))
        try:
            head = await event_log.head()
            [latest, *_] = await event_log.snapshots()
            assert latest.global_seq == head, "the shutdown snapshot covers every committed event"
            assert results and results[-1].last_seq == head, "every step the engine saw committed is in the log, and no more"
        finally:
            await event_log.close()

    anyio.run(check)


@pytest.mark.timeout(240)
def test_sigkill_under_load_loses_nothing_committed_and_retries_commit_exactly_once(tmp_path: Path) -> None:
    """Two engines and a worker run steps flat out while `kvledger serve` is SIGKILLed three
    times at random moments and restarted. Each engine retries its in-flight step with the same
    command id. Afterwards: every step each engine was answered for is in the log exactly once,
    with the positions it was answered with; no step is in the log twice; the worker saw every
    decision once; and the restarted state equals a full replay of the log."""
    rng = random.Random(20261129)
    with serve_process(tmp_path) as server:
        answered: dict[str, list[tuple[int, int, int]]] = {"pod-a": [], "pod-b": []}
        requests: dict[str, int] = {}
        reconnects: dict[str, int] = {}
        worker_seen: list[int] = []
        killed = anyio.Event()
        clients: dict[str, EngineClient] = {}

        async def engine(engine_id: str) -> None:
            client = EngineClient(
                Address(socket_path=str(server.socket)), declaration(engine_id, num_blocks=4096), tiers=[TIER_SPEC], retry_for=60
            )
            clients[engine_id] = client
            driver = Engine(client)
            async with client:
                index = 0
                while not killed.is_set() or index < 10:
                    await driver.request(index)
                    index += 1
            requests[engine_id] = index
            reconnects[engine_id] = client.reconnects
            answered[engine_id] = [(r.step, r.first_seq, r.last_seq) for r in driver.results]

        async def worker() -> None:
            client = WorkerClient(Address(socket_path=str(server.socket)), "pod-a", 0, retry_for=60)
            async for decision in client.decisions(0):
                worker_seen.append(decision.seq)

        async def killer() -> None:
            for kill in range(1, 4):
                await anyio.sleep(rng.uniform(0.3, 1.0))
                server.kill()  # SIGKILL
                await anyio.to_thread.run_sync(server.start)
                # Each kill must land under load: wait until both engines are back and stepping
                # (on a busy machine two kills could otherwise fall into one reconnect backoff).
                with anyio.fail_after(60):
                    while len(clients) < 2 or any(c.reconnects < kill for c in clients.values()):
                        await anyio.sleep(0.02)
            killed.set()

        async def main() -> None:
            with anyio.fail_after(150):
                async with anyio.create_task_group() as tg:
                    tg.start_soon(worker)
                    async with anyio.create_task_group() as load:
                        load.start_soon(engine, "pod-a")
                        load.start_soon(engine, "pod-b")
                        load.start_soon(killer)
                    while len(worker_seen) < requests["pod-a"]:  # one store decision per request
                        await anyio.sleep(0.05)
                    tg.cancel_scope.cancel()

        anyio.run(main)
        server.signal(signal.SIGTERM)
        assert server.wait() == 0

    async def check() -> None:
        event_log = await open_log(str(server.log_path))
        try:
            stored = await event_log.read(0, 1_000_000)
            codec = EventCodec()
            assert all(count >= 3 for count in reconnects.values()), f"the kills did not land under load: {reconnects}"
            for engine_id, seen in answered.items():
                steps_per_engine = 3 * requests[engine_id]
                assert [step for step, _, _ in seen] == list(range(1, steps_per_engine + 1))
                began = [
                    (s.global_seq, codec.decode(s.event_type, s.schema_version, s.payload))
                    for s in stored
                    if s.stream_id == f"engine/{engine_id}" and s.event_type == "step_began"
                ]
                steps = [e.step for _, e in began if isinstance(e, StepBegan)]
                assert steps == list(range(1, steps_per_engine + 1)), f"{engine_id}: steps in the log {steps}"
                first_seqs = {seq for seq, _ in began}
                assert all(first in first_seqs for _, first, _ in seen), "an answer's positions are not where the log has it"
            owners = [codec.decode(s.event_type, s.schema_version, s.payload) for s in stored if s.event_type == "owner_started"]
            req_ids = [e.req_id for e in owners if isinstance(e, OwnerStarted)]
            assert len(req_ids) == len(set(req_ids)) == sum(requests.values()), "a retried step was committed twice"
            assert worker_seen == sorted(set(worker_seen)), "the worker saw a decision twice or out of order"
            # The last restart recovered from snapshot + tail and ran on; its shutdown snapshot of
            # that live state must equal a full replay of the log (I18).
            state, last = await replay(event_log, codec)
            [latest, *_] = await event_log.snapshots()
            assert latest.global_seq == last
            assert latest.digest == state_digest(state)
        finally:
            await event_log.close()

    anyio.run(check)


def test_the_sync_client_steps_looks_up_and_survives_a_sidecar_restart(tmp_path: Path) -> None:
    """SyncEngineClient, for engines that are not async: the same exactly-once step through a
    SIGKILL and restart of `kvledger serve` between two steps."""
    from coordinator.client import SyncEngineClient

    with serve_process(tmp_path) as server:
        with SyncEngineClient(Address(socket_path=str(server.socket)), declaration("pod-a"), tiers=[TIER_SPEC]) as client:
            assert client.incarnation == 1
            first = client.step(1, 1.0, [StartOwner(engine_id="pod-a", req_id="r1")], command_id="sync-1")
            assert isinstance(first.results[0][0], OwnerStarted)
            server.kill()
            server.start()
            again = client.step(1, 1.0, [StartOwner(engine_id="pod-a", req_id="r1")], command_id="sync-1")
            assert again.duplicate and (again.first_seq, again.last_seq) == (first.first_seq, first.last_seq)
            second = client.step(2, 2.0, [], command_id="sync-2")
            assert not second.duplicate and second.first_seq == first.last_seq + 1
            assert client.incarnation == 1, "a reconnect is not a restart of the engine"
            assert client.health().ready
            assert client.lookup("host", [1, 2, 3, 4]).answer.boundary == 0  # type: ignore[union-attr]
