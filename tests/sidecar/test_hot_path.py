"""The hot path (issue 16): reads that never wait for a commit, pipelined group commit, and
connections that stay open, each through a real sidecar on a real socket and a real log.

* A lookup of an engine's keys (LookupKeys) is answered at once from the committed state; its
  answer reaches the log with a later group, for the audit and the hit-rate metric, and during a
  log outage it is still answered: its record waits for the log, or is counted lost, never
  silently dropped.
* The committer decides the next group while the previous one is appended; a group decided on
  top of one whose append fails is never shown to anyone (decided again), and a lookup never
  answers a hit that only a group in flight published.
* A worker's reports go on one connection; one that breaks between a report and its reply is
  sent again with the same command id and counts once (I4).
* The vLLM manager's session asks a request's whole key chain once per scheduler pass and
  commits the pass's loads and stores as one step.
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import anyio
import pytest

from coordinator.client import Address, EngineClient, SidecarError, SyncWorkerClient, WorkerClient
from coordinator.core.commands import ExternalKey, ReportRank, StoreExternal
from coordinator.ledger.ledger import DecidedGroup, Transaction
from coordinator.sidecar import committer as committer_module
from coordinator.sidecar import protocol as p
from coordinator.sidecar.admission import scoped
from events import (
    Event,
    EventCodec,
    ExternalKeysLookedUp,
    ExternalStoreStarted,
    KeyPublished,
    RankReported,
    StepBegan,
    event_tag,
)
from events.log import AppendBatch, AppendResult, EventLog, LogUnavailable
from events.log.reading import decode
from tests.kit import builders as b
from tests.kit.sidecar import TIER_SPEC, declaration, sidecar_on

pytestmark = pytest.mark.anyio

POOL = b.attention_pool(managed=False)


def _client(sock: Path, engine_id: str) -> EngineClient:
    return EngineClient(
        Address(socket_path=str(sock)), declaration(engine_id, pools=[POOL], world_size=1), tiers=[TIER_SPEC], retry_for=5
    )


def _key(n: int) -> ExternalKey:
    return ExternalKey(POOL.pool_id, bytes([n]) * 36)


async def _logged(event_log: EventLog) -> list[tuple[int, Event]]:
    codec = EventCodec()
    return [(stored.global_seq, decode(codec, stored)) for stored in await event_log.read(0, 100_000)]


async def _store(client: EngineClient, step: int, keys: list[ExternalKey]) -> ExternalStoreStarted:
    result = await client.step(step, float(step), [StoreExternal(engine_id=client.engine_id, tier=TIER_SPEC.name, keys=keys)])
    (job,) = [e for e in result.results[0] if isinstance(e, ExternalStoreStarted)]
    return job


def _report(job: ExternalStoreStarted) -> ReportRank:
    return ReportRank(job_id=job.job_id, rank=0, ok=True, checksums=[b.checksum(item.key, 0) for item in job.items])


async def _wait_for(condition: Any, seconds: float = 10.0) -> None:
    with anyio.fail_after(seconds):
        while not await condition():
            await anyio.sleep(0.01)


async def test_a_lookup_is_answered_without_a_commit_and_its_answer_is_recorded_afterwards(
    event_log: EventLog, tmp_path: Path
) -> None:
    sock = tmp_path / "s.sock"
    async with sidecar_on(event_log, sock) as sidecar, _client(sock, "vllm-a") as client:
        job = await _store(client, 1, [_key(1)])
        await WorkerClient(Address(socket_path=str(sock)), "vllm-a", 0).report(_report(job))
        head = await event_log.head()
        reply = await client.lookup_keys(TIER_SPEC.name, [_key(1), _key(2)])
        assert isinstance(reply.answer, ExternalKeysLookedUp)
        assert reply.answer.loadable == [True, False] and reply.head_seq == head
        assert await event_log.head() == head  # answered before anything was appended

        async def recorded() -> bool:
            return any(isinstance(e, ExternalKeysLookedUp) for _, e in await _logged(event_log))

        await _wait_for(recorded)
        (record,) = [e for _, e in await _logged(event_log) if isinstance(e, ExternalKeysLookedUp)]
        assert record.engine_keys == [_key(1).engine_key, _key(2).engine_key] and record.loadable == [True, False]
        assert record.head_seq == head and record.answered_at > 0
        assert not [e for _, e in await _logged(event_log) if isinstance(e, StepBegan) and e.step > 1]  # no step for it
        hits = sidecar.metrics.registry.get_sample_value("kvledger_lookup_keys_total", {"answer": "hit"})
        misses = sidecar.metrics.registry.get_sample_value("kvledger_lookup_keys_total", {"answer": "miss"})
        assert (hits, misses) == (1.0, 1.0)


@contextmanager
def _log_down(event_log: EventLog, monkeypatch: pytest.MonkeyPatch) -> Iterator[list[int]]:
    """Every append fails as an unreachable database does, until the block ends."""
    refused: list[int] = []

    async def down(batches: list[AppendBatch], *, expected_head: int | None = None) -> list[AppendResult]:
        refused.append(len(batches))
        raise LogUnavailable(f"{event_log.url} is unreachable (test)")

    with monkeypatch.context() as patch:
        patch.setattr(event_log, "append", down)
        yield refused


async def test_a_lookup_during_a_log_outage_is_answered_and_recorded_when_the_log_is_back(
    event_log: EventLog, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    sock = tmp_path / "s.sock"
    async with sidecar_on(event_log, sock) as sidecar, _client(sock, "vllm-a") as client:
        job = await _store(client, 1, [_key(1)])
        await WorkerClient(Address(socket_path=str(sock)), "vllm-a", 0).report(_report(job))
        with _log_down(event_log, monkeypatch) as refused:
            for _ in range(3):
                reply = await client.lookup_keys(TIER_SPEC.name, [_key(1)])
                assert isinstance(reply.answer, ExternalKeysLookedUp) and reply.answer.loadable == [True]

            async def tried() -> bool:
                return len(refused) >= 2

            await _wait_for(tried)  # the records were offered to the log, and offered again
            assert sidecar.metrics.registry.get_sample_value("kvledger_lookup_records_pending") == 3

        async def all_recorded() -> bool:
            return len([e for _, e in await _logged(event_log) if isinstance(e, ExternalKeysLookedUp)]) == 3

        await _wait_for(all_recorded)
        assert sidecar.metrics.registry.get_sample_value("kvledger_lookup_records_pending") == 0
        assert sidecar.metrics.registry.get_sample_value("kvledger_lookup_records_lost_total") == 0


async def test_records_the_log_cannot_take_past_the_bound_are_counted_lost_never_silently_dropped(
    event_log: EventLog, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(committer_module, "MAX_RECORDS", 2)
    sock = tmp_path / "s.sock"
    async with sidecar_on(event_log, sock) as sidecar, _client(sock, "vllm-a") as client:
        with _log_down(event_log, monkeypatch):
            for n in range(5):
                reply = await client.lookup_keys(TIER_SPEC.name, [_key(n)])
                assert isinstance(reply.answer, ExternalKeysLookedUp)
            assert sidecar.metrics.registry.get_sample_value("kvledger_lookup_records_lost_total") == 3

        async def kept_recorded() -> bool:
            return len([e for _, e in await _logged(event_log) if isinstance(e, ExternalKeysLookedUp)]) == 2

        await _wait_for(kept_recorded)
        recorded = [e.engine_keys[0] for _, e in await _logged(event_log) if isinstance(e, ExternalKeysLookedUp)]
        assert recorded == [_key(3).engine_key, _key(4).engine_key]  # the newest are kept


async def test_a_group_decided_while_the_previous_append_fails_is_never_shown(
    event_log: EventLog, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Engine A's worker reports a store (its group publishes key 1); its append is held, then
    fails. Meanwhile engine B's step is decided on top of it (the pipeline), and A asks for key 1.
    A's lookup misses (only the failing group published it); B's step is decided again and its
    reply comes only once its events are in the log, which holds them once."""
    sock = tmp_path / "s.sock"
    async with sidecar_on(event_log, sock) as sidecar, _client(sock, "vllm-a") as a, _client(sock, "vllm-b") as b_client:
        job = await _store(a, 1, [_key(1)])
        await b_client.step(1, 1.0, [])
        decided: list[list[Transaction]] = []
        decide = sidecar.ledger.decide_group

        async def spy(transactions: list[Transaction]) -> DecidedGroup:
            decided.append(list(transactions))
            return await decide(transactions)

        monkeypatch.setattr(sidecar.ledger, "decide_group", spy)
        append = event_log.append
        holding, release = anyio.Event(), anyio.Event()
        calls = 0

        async def held_then_failed(batches: list[AppendBatch], *, expected_head: int | None = None) -> list[AppendResult]:
            # The worker's report's append, not whichever comes first: the lookups' records are
            # appended alone RECORD_DELAY after them, and one landing here first held the wrong
            # append (the test then hung on a report that was never answered).
            nonlocal calls
            if any(event.event_type == event_tag(RankReported) for batch in batches for event in batch.events):
                calls += 1
                if calls == 1:
                    holding.set()
                    await release.wait()
                    raise LogUnavailable("the first append of two in flight fails (test)")
            return await append(batches, expected_head=expected_head)

        monkeypatch.setattr(event_log, "append", held_then_failed)
        worker = SyncWorkerClient(Address(socket_path=str(sock)), "vllm-a", 0, retry_for=10)
        b_reply: list[p.StepResult] = []
        shown_at: list[int] = []
        reported: list[list[Event]] = []
        async with anyio.create_task_group() as tg:
            tg.start_soon(lambda: anyio.to_thread.run_sync(lambda: reported.append(worker.report(_report(job), command_id="r1"))))
            try:
                with anyio.fail_after(10):
                    await holding.wait()

                async def b_step() -> None:
                    b_reply.append(await b_client.step(2, 2.0, [], command_id="b-2"))
                    shown_at.append(await event_log.head())

                tg.start_soon(b_step)
                with anyio.fail_after(10):
                    # B's group is decided while A's append is in flight: both are in flight (the
                    # spy sees B's group when its deciding begins, before its command id is read).
                    while sidecar.ledger.in_flight < 2:
                        await anyio.sleep(0.005)
                assert len(decided) == 2
                lookup = await a.lookup_keys(TIER_SPEC.name, [_key(1)])
                assert isinstance(lookup.answer, ExternalKeysLookedUp) and lookup.answer.loadable == [False]
                assert not b_reply  # nothing of B's group is shown while the group under it is in flight
            finally:
                release.set()  # on a failure too: the worker's thread waits for its answer
        worker.close()
        (reply,) = b_reply
        assert shown_at[0] >= reply.last_seq  # B heard of its step only once the log held it
        logged = await _logged(event_log)
        b_steps = [seq for seq, e in logged if isinstance(e, StepBegan) and e.engine_id == "vllm-b" and e.step == 2]
        assert b_steps == [reply.first_seq]
        assert (
            sum(1 for group in decided for tx in group if getattr(tx, "command_id", None) == scoped("vllm-b", "step", "b-2")) == 2
        )
        # The worker's report was refused once (COMMIT_FAILED), sent again with its command id, and counts once.
        assert [e for e in reported[0] if isinstance(e, KeyPublished)]
        assert len([e for _, e in logged if isinstance(e, RankReported) and e.job_id == job.job_id]) == 1
        after = await a.lookup_keys(TIER_SPEC.name, [_key(1)])
        assert isinstance(after.answer, ExternalKeysLookedUp) and after.answer.loadable == [True]


class _CutAfterRequest:
    """A Unix-socket forwarder in front of the sidecar that passes the first connection's request
    (the report after the Hello) to the sidecar but never its reply: the connection closes instead."""

    def __init__(self, target: Path, path: Path) -> None:
        self.target = str(target)
        self.path = str(path)
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.listener.bind(self.path)
        self.listener.listen(8)
        self.connections = 0
        self.cut = threading.Event()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            self.connections += 1
            server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            server.connect(self.target)
            replies = 1 if self.connections == 1 else None  # the Welcome only
            threading.Thread(target=self._pipe, args=(client, server, None), daemon=True).start()
            threading.Thread(target=self._pipe, args=(server, client, replies), daemon=True).start()

    def _pipe(self, source: socket.socket, sink: socket.socket, frames: int | None) -> None:
        try:
            while True:
                header = source.recv(4, socket.MSG_WAITALL)
                if len(header) < 4:
                    break
                body = source.recv(int.from_bytes(header, "big"), socket.MSG_WAITALL)
                if frames is not None and frames == 0:
                    self.cut.wait(5)  # the sidecar committed the report; its reply is never passed on
                    break
                sink.sendall(header + body)
                if frames is not None:
                    frames -= 1
        except OSError:
            pass
        for sock in (source, sink):
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            sock.close()

    def close(self) -> None:
        self.listener.close()


async def test_a_worker_connection_that_breaks_mid_report_sends_it_again_and_it_counts_once(
    event_log: EventLog, tmp_path: Path
) -> None:
    sock = tmp_path / "s.sock"
    async with sidecar_on(event_log, sock) as sidecar, _client(sock, "vllm-a") as client:
        job = await _store(client, 1, [_key(1), _key(2)])
        proxy = _CutAfterRequest(sock, tmp_path / "proxy.sock")

        async def committed_report() -> bool:
            return any(isinstance(e, RankReported) for _, e in await _logged(event_log))

        worker = SyncWorkerClient(Address(socket_path=proxy.path), "vllm-a", 0, retry_for=10)
        async with anyio.create_task_group() as tg:
            result: list[list[Event]] = []
            tg.start_soon(lambda: anyio.to_thread.run_sync(lambda: result.append(worker.report(_report(job), command_id="c1"))))
            await _wait_for(committed_report)
            proxy.cut.set()  # the connection breaks after the sidecar committed, before the reply
        assert worker.connections == 2  # sent again on a new connection
        assert [e for e in result[0] if isinstance(e, KeyPublished)]  # the retry's answer: the committed events
        logged = [e for _, e in await _logged(event_log)]
        assert len([e for e in logged if isinstance(e, RankReported)]) == 1
        assert len([e for e in logged if isinstance(e, KeyPublished)]) == 2
        # And a second report goes on the same connection: no new one.
        job2 = await _store(client, 2, [_key(3)])
        await anyio.to_thread.run_sync(lambda: worker.report(_report(job2)))
        assert worker.connections == 2
        worker.close()
        proxy.close()
        assert sidecar.metrics.registry.get_sample_value("kvledger_connections") is not None


async def test_a_worker_reports_every_job_on_one_connection(event_log: EventLog, tmp_path: Path) -> None:
    sock = tmp_path / "s.sock"
    async with sidecar_on(event_log, sock) as sidecar, _client(sock, "vllm-a") as client:
        worker = WorkerClient(Address(socket_path=str(sock)), "vllm-a", 0)
        before = sidecar.metrics.registry.get_sample_value("kvledger_connections")
        for n in range(5):
            job = await _store(client, n + 1, [_key(n)])
            await worker.report(_report(job))
            assert sidecar.metrics.registry.get_sample_value("kvledger_connections") == (before or 0) + 1
        await worker.aclose()


def _session(sock: Path) -> Any:
    from coordinator.vllm.offload_client import EngineFacts, LedgerSession, OffloadSettings

    settings = OffloadSettings(
        socket=str(sock),
        namespace={
            "weights_revision": "sha256:1",
            "tokenizer_digest": "sha256:2",
            "tenant": "t",
            "block_sizes": [16],
            "hash_algorithm": "vllm:sha256",
        },
        tier_slots=64,
    )
    facts = EngineFacts(
        vllm_engine_id="e1", model="m", dtype="bfloat16", groups=[(0, 16)], bytes_per_block=64, hash_algorithm="sha256"
    )
    return LedgerSession(settings, facts, retry_for=5)


async def test_the_vllm_session_asks_a_chain_once_per_pass_and_commits_a_pass_as_one_step(
    event_log: EventLog, tmp_path: Path
) -> None:
    sock = tmp_path / "s.sock"
    async with sidecar_on(event_log, sock):
        session = await anyio.to_thread.run_sync(_session, sock)
        chain = [ExternalKey(0, bytes([n]) * 36) for n in range(6)]

        def first_pass() -> tuple[list[bool], Any, Any]:
            session.ask(chain)
            answers = [session.answer(key) for key in chain]  # vLLM's per-key lookups: no new question
            stored = session.store(chain[:3])
            other = session.store(chain[3:])
            session.end_pass()
            session.flush()
            return answers, stored, other

        answers, stored, other = await anyio.to_thread.run_sync(first_pass)
        assert answers == [False] * 6 and session.steps == 1
        assert [item.engine_key for item in stored.job.items] == [k.engine_key for k in chain[:3]]
        assert [item.engine_key for item in other.job.items] == [k.engine_key for k in chain[3:]]
        lookups = [e for _, e in await _logged(event_log) if isinstance(e, ExternalKeysLookedUp)]

        async def recorded() -> bool:
            return len([e for _, e in await _logged(event_log) if isinstance(e, ExternalKeysLookedUp)]) == 1

        await _wait_for(recorded)
        lookups = [e for _, e in await _logged(event_log) if isinstance(e, ExternalKeysLookedUp)]
        assert len(lookups[0].engine_keys) == 6  # one question for the chain
        worker = WorkerClient(Address(socket_path=str(sock)), session.engine_id, 0)
        for pending in (stored, other):
            await worker.report(
                ReportRank(
                    job_id=pending.job.job_id, rank=0, ok=True, checksums=[b.checksum(item.key, 0) for item in pending.job.items]
                )
            )
        await worker.aclose()

        def second_pass() -> tuple[list[bool], Any]:
            session.ask(chain)
            answers = [session.answer(key) for key in chain]
            session.end_pass()
            skipped = session.store(chain)  # vLLM offers the published chunks again: nothing is sent
            session.flush()
            return answers, skipped

        answers, skipped = await anyio.to_thread.run_sync(second_pass)
        assert answers == [True] * 6 and skipped is None and session.steps == 1
        session.close()


async def test_a_workers_reports_of_one_pass_go_in_one_round_trip_and_a_retried_batch_counts_each_once(
    event_log: EventLog, tmp_path: Path
) -> None:
    sock = tmp_path / "s.sock"
    async with sidecar_on(event_log, sock) as sidecar, _client(sock, "vllm-a") as client, _client(sock, "vllm-b") as other:
        jobs = [await _store(client, n + 1, [_key(n)]) for n in range(3)]
        worker = SyncWorkerClient(Address(socket_path=str(sock)), "vllm-a", 0, retry_for=5)
        batch = [(_report(job), f"r{job.job_id}") for job in jobs]
        groups_before = sidecar.metrics.registry.get_sample_value("kvledger_commit_group_transactions_count") or 0
        first = await anyio.to_thread.run_sync(worker.report_all, batch)
        assert [len([e for e in events if isinstance(e, KeyPublished)]) for events in first] == [1, 1, 1]
        assert sidecar.metrics.registry.get_sample_value("kvledger_commit_group_transactions_count") == groups_before + 1
        again = await anyio.to_thread.run_sync(worker.report_all, batch)  # the batch sent again: the same answers
        assert [[type(e) for e in events] for events in again] == [[type(e) for e in events] for events in first]
        logged = [e for _, e in await _logged(event_log)]
        assert len([e for e in logged if isinstance(e, RankReported)]) == 3
        # Another engine's job in a batch: refused whole, nothing of it committed.
        foreign = await _store(other, 1, [_key(9)])
        job = await _store(client, 4, [_key(4)])
        head = await event_log.head()
        with pytest.raises(SidecarError) as refused:
            await anyio.to_thread.run_sync(worker.report_all, [(_report(job), "ok"), (_report(foreign), "theirs")])
        assert refused.value.code is p.ErrorCode.INVALID_MESSAGE and "vllm-b" in str(refused.value)
        assert await event_log.head() == head
        worker.close()
