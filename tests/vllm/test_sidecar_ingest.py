"""`kvledger serve --ingest-vllm FILE`: the sidecar records vLLM's KV events itself, through its
own group commit, beside the engines' steps (one log, one writer). A fake vLLM publisher
(tests/vllm/test_vllm_ingest.py's FakeVllm: frames exactly as vLLM 0.32 sends them) connects to the
endpoint the sidecar binds; an engine steps at the same time. Bad files stop `serve` before it
starts, naming the file and what is wrong."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import anyio
import pytest
import zmq
import zmq.asyncio

from coordinator.audit.queries import Audit
from coordinator.audit.store import sync_index
from coordinator.core.commands import StartOwner
from coordinator.core.state import state_digest
from coordinator.ledger.recovery import replay
from coordinator.vllm.sidecar_ingest import IngestFileError, IngestService, load_ingest_file
from events import EventCodec, ObservedBlocksRemoved, ObservedBlocksStored, Refused
from events.log import EventLog, SqlEventLog
from tests.kit.sidecar import ROOT, engine_client, sidecar_on
from tests.vllm.test_vllm_ingest import BLOCK, TOPIC, FakeVllm, h, removed, stored

pytestmark = pytest.mark.anyio

NAMESPACE = f"""
[engine.namespace]
model_id = "tiny/llama"
weights_revision = "sha256:weights"
tokenizer_digest = "sha256:tokenizer"
kv_dtype = "auto"
kv_layout_version = 1
block_sizes = [{BLOCK}]
tensor_parallel_size = 1
tenant = "tenant-a"
hash_algorithm = "vllm:sha256"
"""


def ingest_file(tmp_path: Path, *engines: tuple[str, str], extra: str = "") -> Path:
    path = tmp_path / "ingest.toml"
    path.write_text(
        "".join(
            f'[[engine]]\nengine_id = "{engine}"\nendpoint = "{endpoint}"\ntopic = "{TOPIC}"\n{extra}{NAMESPACE}'
            for engine, endpoint in engines
        )
    )
    return path


async def test_the_sidecar_records_vllm_events_beside_engine_steps_in_one_log(event_log: EventLog, tmp_path: Path) -> None:
    path = ingest_file(tmp_path, ("vllm-0", "tcp://127.0.0.1:*"), ("vllm-1", "tcp://127.0.0.1:*"))
    sock = tmp_path / "s.sock"
    context = zmq.asyncio.Context()
    publishers = [FakeVllm(context), FakeVllm(context)]
    try:
        ingest = IngestService(load_ingest_file(path))
        async with sidecar_on(event_log, sock, services=[ingest]) as sidecar:
            assert [i.config.engine_id for i in ingest.ingestors] == ["vllm-0", "vllm-1"]
            for vllm, ingestor in zip(publishers, ingest.ingestors, strict=True):
                await vllm.connect(ingestor.endpoint)
            client = engine_client(sock, "pod-a")
            await client.connect()
            try:
                for step in range(1, 4):  # an engine steps while both vLLMs publish
                    await client.step(step, float(step), [StartOwner(engine_id="pod-a", req_id=f"r{step}")])
                    await publishers[0].publish([stored(h(step), parent=h(step - 1) if step > 1 else None)])
                    await publishers[1].publish([stored(h(100 + step))])
                await publishers[0].publish([removed(h(3))])
            finally:
                await client.aclose()
            with anyio.fail_after(10):
                while any(i.stats.batches < n for i, n in zip(ingest.ingestors, (4, 3), strict=True)):
                    await anyio.sleep(0.02)
        # The sidecar stopped (drained): everything it took is in the log, in one history.
        state, _ = await replay(event_log, EventCodec())
        assert state_digest(state) == state_digest(sidecar.ledger.state)
        assert list(state.observed["vllm-0"].stored["GPU/0"]) == [h(1), h(2)]
        assert list(state.observed["vllm-1"].stored["GPU/0"]) == [h(101), h(102), h(103)]
        assert len([o for o in state.owners.values() if o.engine_id == "pod-a"]) == 3
        codec = EventCodec()
        events = [codec.decode(s.event_type, s.schema_version, s.payload) for s in await event_log.read(0, 100_000)]
        assert not [e for e in events if isinstance(e, Refused)]
        assert sum(isinstance(e, ObservedBlocksStored) for e in events) == 6
        assert sum(isinstance(e, ObservedBlocksRemoved) for e in events) == 1
        assert isinstance(event_log, SqlEventLog)
        await sync_index(event_log)  # the audit index answers for the observed hash
        [stay] = (await Audit(event_log).observed(h(3).hex())).residencies
        assert stay.engine == "vllm-0" and stay.ended_by == "removed", stay
    finally:
        for vllm in publishers:
            vllm.close()
        context.destroy(linger=0)


@pytest.mark.parametrize(
    ("body", "says"),
    [
        ('[[engine]]\nengine_id = "a"\nendpoint = "tcp://127.0.0.1:1"\nport = 3\n' + NAMESPACE, "port"),
        ('[[engine]]\nengine_id = "a"\nendpoint = "tcp://127.0.0.1:1"\n', "namespace"),
        ("engine = []\n", "no [[engine]] table"),
        (
            '[[engine]]\nengine_id = "a"\nendpoint = "tcp://127.0.0.1:1"\n'
            + NAMESPACE.replace(f"[{BLOCK}]", "[]")
            + '[[engine]]\nengine_id = "b"\nendpoint = "tcp://127.0.0.1:2"\n'
            + NAMESPACE,
            "the namespace is not usable",
        ),
        (
            '[[engine]]\nengine_id = "a"\nendpoint = "tcp://127.0.0.1:1"\n'
            + NAMESPACE
            + '[[engine]]\nengine_id = "a"\nendpoint = "tcp://127.0.0.1:2"\n'
            + NAMESPACE,
            "listed twice",
        ),
        ("[[engine]\n", "--ingest-vllm"),
        (
            '[[engine]]\nengine_id = "a"\nendpoint = "tcp://127.0.0.1:1"\nreplay = "127.0.0.1:5558"\n' + NAMESPACE,
            "is not a ZMQ endpoint",
        ),
    ],
)
def test_a_bad_ingest_file_is_refused_naming_the_file_and_the_problem(tmp_path: Path, body: str, says: str) -> None:
    path = tmp_path / "bad.toml"
    path.write_text(body)
    with pytest.raises(IngestFileError) as raised:
        load_ingest_file(path)
    assert str(path) in str(raised.value) and says in str(raised.value), raised.value


def test_serve_with_a_bad_ingest_file_exits_2_with_one_line(tmp_path: Path) -> None:
    path = tmp_path / "bad.toml"
    path.write_text('[[engine]]\nengine_id = "a"\n')
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "coordinator.cli",
            "serve",
            "--log",
            str(tmp_path / "log.sqlite"),
            "--socket",
            str(tmp_path / "s.sock"),
            "--http",
            "off",
            "--ingest-vllm",
            str(path),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2, done.stderr
    [line] = [line for line in done.stderr.splitlines() if line.startswith("kvledger serve:")]
    assert str(path) in line and "endpoint" in line, line


def test_serve_whose_ingest_endpoint_is_taken_exits_2_naming_the_engine_and_endpoint(tmp_path: Path) -> None:
    context = zmq.Context()
    taken = context.socket(zmq.PUB)
    try:
        taken.bind("tcp://127.0.0.1:*")
        endpoint = taken.getsockopt_string(zmq.LAST_ENDPOINT)
        path = ingest_file(tmp_path, ("vllm-0", endpoint))
        done = subprocess.run(
            [
                sys.executable,
                "-m",
                "coordinator.cli",
                "serve",
                "--log",
                str(tmp_path / "log.sqlite"),
                "--socket",
                str(tmp_path / "s.sock"),
                "--http",
                "off",
                "--ingest-vllm",
                str(path),
            ],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=60,
        )
    finally:
        taken.close(linger=0)
        context.term()
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr, done.stderr
    [line] = [line for line in done.stderr.splitlines() if line.startswith("kvledger serve:")]
    assert "'vllm-0' cannot bind" in line and endpoint in line, line


async def test_a_database_outage_during_ingestion_is_retried_and_the_sidecar_keeps_serving(tmp_path: Path) -> None:
    """PostgreSQL behind a proxy the test cuts while vLLM publishes: the ingestor inside the
    sidecar retries (it crashed the whole sidecar before: the outage came up as a driver error,
    not LogUnavailable), and once the database is back the batch is recorded, once."""
    from coordinator.ledger.ledger import Ledger
    from coordinator.sidecar.config import ServeConfig
    from coordinator.sidecar.server import Sidecar
    from events.log import open_log, upgrade_log
    from tests.conftest import PG_URL, _drop_pg_database, _new_pg_database, require_postgres
    from tests.kit.tcp_proxy import TcpProxy

    await anyio.to_thread.run_sync(require_postgres)
    name = await anyio.to_thread.run_sync(_new_pg_database)
    base = PG_URL.rsplit("/", 1)[0]
    await upgrade_log(f"{base}/{name}")
    context = zmq.asyncio.Context()
    vllm = FakeVllm(context)
    try:
        with TcpProxy(("127.0.0.1", 5432)) as proxy:
            event_log = await open_log(f"{base.rsplit('@', 1)[0]}@127.0.0.1:{proxy.port}/{name}")
            try:
                ledger = await Ledger.open(event_log)
                path = ingest_file(tmp_path, ("vllm-0", "tcp://127.0.0.1:*"))
                ingest = IngestService(load_ingest_file(path))
                sidecar = Sidecar(ledger, ServeConfig(socket_path=str(tmp_path / "s.sock")), [ingest])
                with anyio.fail_after(60):
                    async with anyio.create_task_group() as tasks:
                        await tasks.start(sidecar.serve)
                        await vllm.connect(ingest.ingestors[0].endpoint)
                        await vllm.publish([stored(h(1))])
                        while ingest.ingestors[0].stats.batches < 1:
                            await anyio.sleep(0.02)
                        proxy.cut()
                        await vllm.publish([stored(h(2), parent=h(1))])
                        await anyio.sleep(1.5)  # the commit fails, is retried, fails again...
                        assert not sidecar.draining  # still serving
                        proxy.restore()
                        while ledger.state.observed["vllm-0"].next_seq < 2:
                            await anyio.sleep(0.05)
                        sidecar.stop()
                state, _ = await replay(event_log, EventCodec())
                assert list(state.observed["vllm-0"].stored["GPU/0"]) == [h(1), h(2)] and state.observed["vllm-0"].complete
            finally:
                await event_log.close()
    finally:
        vllm.close()
        context.destroy(linger=0)
        await anyio.to_thread.run_sync(_drop_pg_database, name)


async def test_a_batch_is_committed_whole_in_order_even_when_larger_than_a_group(tmp_path: Path) -> None:
    """Committer.submit_all with more transactions than a group holds, the first append failing:
    the retry with the same command ids records every batch in order (before, the second group
    committed, leaving a false gap, and the retried first group was refused as duplicates)."""
    from coordinator.core.commands import ObservedKvEvent, ObserveEngine, ObserveKvEvents
    from coordinator.ledger.ledger import Commit, Ledger, Single
    from coordinator.sidecar.committer import MAX_GROUP, Committer
    from coordinator.sidecar.hub import DecisionHub
    from coordinator.sidecar.metrics import SidecarMetrics
    from events.log import LogUnavailable, open_log
    from tests.vllm.test_vllm_ingest import namespace

    event_log = await open_log(str(tmp_path / "log.sqlite"))
    try:
        ledger = await Ledger.open(event_log)
        await ledger.execute(ObserveEngine(engine_id="v", namespace=namespace(), source="test", reason="first_seen"))
        committer = Committer(ledger, DecisionHub(event_log, EventCodec(), ledger.last_seq), SidecarMetrics(lambda: ledger.state))
        append, calls = event_log.append, [0]

        async def fails_once(batches: object, *, expected_head: int | None = None) -> object:
            calls[0] += 1
            if calls[0] == 1:
                raise LogUnavailable("a blip (test)")
            return await append(batches, expected_head=expected_head)  # type: ignore[arg-type]

        event_log.append = fails_once  # type: ignore[method-assign,assignment]
        count = MAX_GROUP + 6
        txs = [
            Single(
                command=ObserveKvEvents(
                    engine_id="v",
                    seq=n,
                    ts=1.0,
                    dp_rank=None,
                    events=[
                        ObservedKvEvent(
                            kind="stored",
                            medium="GPU",
                            group=0,
                            block_hashes=[n.to_bytes(8, "big")],
                            token_ids=[1] * BLOCK,
                            block_size=BLOCK,
                        )
                    ],
                ),
                command_id=f"ingest/run/{n}",
            )
            for n in range(count)
        ]
        with anyio.fail_after(30):
            async with anyio.create_task_group() as tasks:
                tasks.start_soon(committer.run)
                with pytest.raises(LogUnavailable):
                    await committer.submit_all(txs)
                results = await committer.submit_all(txs)  # the ingestor's retry
                committer.close()
        assert all(isinstance(r, Commit) for r in results)
        assert not [e for r in results if isinstance(r, Commit) for e in r.events if isinstance(e, Refused)]
        observed = ledger.state.observed["v"]
        assert observed.next_seq == count and observed.complete
        assert len(observed.stored["GPU/0"]) == count
    finally:
        await event_log.close()
