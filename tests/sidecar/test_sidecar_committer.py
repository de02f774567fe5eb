"""The sidecar's group commit (coordinator/sidecar/committer.py) through its real socket: a
reply only after its step is in the log, several engines' steps in one append, a failed append,
snapshot or rebuild failing nothing else, and metrics that never show a group in flight."""

from __future__ import annotations

import urllib.request
from collections.abc import Sequence
from pathlib import Path

import anyio
import pytest

from coordinator.client import Address, EngineClient, SidecarError, SidecarUnavailable, WorkerClient
from coordinator.core.commands import AllocateBlocks, StartOwner
from coordinator.core.routing import Decision
from coordinator.core.state import state_digest
from coordinator.ledger.ledger import Ledger
from coordinator.ledger.recovery import replay
from events import BlocksAllocated, EventCodec, OwnerStarted, StepBegan
from events.log import AppendBatch, AppendResult, EventLog
from tests.kit import builders as b
from tests.kit.sidecar import TIER_SPEC, Engine, declaration, engine_client, sidecar_on

pytestmark = pytest.mark.anyio


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

            async def held_then_failed(batches: Sequence[AppendBatch], *, expected_head: int | None = None) -> list[AppendResult]:
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

            async def failing(batches: Sequence[AppendBatch], *, expected_head: int | None = None) -> list[AppendResult]:
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
    from coordinator.ledger.recovery import replay as replay_log

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
    from coordinator.ledger.ledger import Step
    from coordinator.sidecar.committer import Committer
    from coordinator.sidecar.hub import DecisionHub
    from coordinator.sidecar.metrics import SidecarMetrics

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


async def test_a_failed_commit_tells_the_client_no_sql(
    event_log: EventLog, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import sqlalchemy as sa

    sock = tmp_path / "s.sock"
    async with sidecar_on(event_log, sock), engine_client(sock, "pod-a") as client:
        client.retry_for = 0.1

        async def failing(batches: Sequence[AppendBatch], *, expected_head: int | None = None) -> list[AppendResult]:
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
    from coordinator.ledger.ledger import Step
    from coordinator.sidecar.committer import Committer
    from coordinator.sidecar.hub import DecisionHub
    from coordinator.sidecar.metrics import SidecarMetrics

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


async def test_a_commit_published_from_the_log_and_then_by_its_group_is_offered_to_workers_once(event_log: EventLog) -> None:
    """After a failed append, the committer publishes from the log whatever landed; a group that
    landed behind it (several in flight on Kafka) is then published again when it is answered:
    each decision still reaches a worker once."""
    from coordinator.core.commands import DeclareTier, FinishOwner, MarkComputed, StartStore
    from coordinator.sidecar.hub import DecisionHub
    from events import StoreJobStarted

    ledger = await Ledger.open(event_log)
    await ledger.execute(DeclareTier(spec=TIER_SPEC))
    await ledger.execute(declaration("pod-a"))
    started = await ledger.run_step("pod-a", 1, 1.0, [StartOwner(engine_id="pod-a", req_id="r")])
    owner = next(e for e in started.events if isinstance(e, OwnerStarted)).owner_id
    allocated = await ledger.run_step("pod-a", 2, 2.0, [AllocateBlocks(engine_id="pod-a", owner_id=owner, pool_id=0, count=2)])
    blocks = next(e for e in allocated.events if isinstance(e, BlocksAllocated)).blocks
    hub = DecisionHub(ledger.log, ledger.codec, ledger.last_seq, 100)
    subscription = hub.register("pod-a", 0, ledger.last_seq)
    stored = await ledger.run_step(
        "pod-a",
        3,
        3.0,
        [
            MarkComputed(engine_id="pod-a", owner_id=owner, blocks=blocks, token_ids=list(range(2 * b.BLOCK))),
            StartStore(engine_id="pod-a", tier=b.TIER, blocks=blocks),
            FinishOwner(engine_id="pod-a", owner_id=owner),
        ],
    )
    [job] = [e for e in stored.events if isinstance(e, StoreJobStarted)]
    await hub.publish_from_log(stored.last_seq)  # what a failed group's answer publishes
    hub.publish([(stored.events, stored.first_seq)], stored.last_seq)  # the group behind it, answered
    with anyio.fail_after(5):
        decisions = await subscription.live()
    assert [decision.event for decision in decisions] == [job]
