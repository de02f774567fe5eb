"""The fleet audit service (coordinator/audit/fleet.py) on a real Kafka-protocol broker (Tansu) and the
real PostgreSQL: two engines write their streams to ONE topic and share a tier; the service
indexes both into one PostgreSQL database, exactly once across stops and restarts; the audit
CLI answers fleet-wide from it; bad input is one line and exit code 2 or 1.

The story (built once per module): engine A publishes keys to the shared tier, engine B (another
writer, with a state store of its own) loads two of them under a lease, then engine A (restarted,
a new writer) serves more requests."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import pytest
import sqlalchemy as sa
import uvicorn
from aiokafka.admin import AIOKafkaAdminClient  # type: ignore[import-untyped]
from typer.testing import CliRunner

import tests.kit.builders as b
from coordinator.audit.api import Grant, Tokens, audit_app
from coordinator.audit.fleet import fleet_url, run_fleet
from coordinator.audit.index import entries
from coordinator.audit.store import indexed_seq, sync_index
from coordinator.cli.main import app
from coordinator.core.commands import (
    AllocateBlocks,
    DeclareEngine,
    DeclareTier,
    FinishOwner,
    LoadRequest,
    MarkComputed,
    ReportRank,
    StartLoad,
    StartOwner,
    StartStore,
)
from coordinator.ledger.ledger import Ledger
from events import BlocksAllocated, LoadJobStarted, OwnerStarted, StoreJobStarted, TierSpec
from events.log import SqlEventLog, mask, open_log, upgrade_log
from events.log.opening import open_fleet_log
from events.log.schema import metadata
from tests.conftest import KAFKA_FETCH_WAIT_MS, PG_URL, _drop_pg_database, _new_pg_database, require_postgres
from tests.kit.kafka import KafkaBroker, free_port
from tests.kit.tcp_proxy import TcpProxy

ENGINE_A, ENGINE_B = "engine-a", "engine-b"
AUDIT_TABLES = sorted(name for name in metadata.tables if name.startswith("kvl_audit_"))


# --- the story: two engines, one topic, one shared tier -----------------------------------------


async def declare(ledger: Ledger, engine: str, *, tier: bool) -> None:
    if tier:
        await ledger.execute(DeclareTier(spec=TierSpec(name=b.TIER, num_slots=32, bytes_per_slot=64)))
    await ledger.execute(
        DeclareEngine(
            engine_id=engine,
            namespace=b.namespace(block_sizes=(b.BLOCK,)),
            pools=[b.attention_pool(num_blocks=12)],
            world_size=2,
            tiers=[b.TIER],
        )
    )


async def serve_and_store(ledger: Ledger, engine: str, index: int) -> list[bytes]:
    """One request that computes two blocks and stores them to the shared tier: their keys."""
    step = ledger.state.engines[engine].step + 1
    clock = float(step)
    commit = await ledger.run_step(engine, step, clock, [StartOwner(engine_id=engine, req_id=f"{engine}-req-{index}")])
    owner = next(e for e in commit.events if isinstance(e, OwnerStarted)).owner_id
    commit = await ledger.run_step(
        engine, step + 1, clock, [AllocateBlocks(engine_id=engine, owner_id=owner, pool_id=0, count=2)]
    )
    blocks = next(e for e in commit.events if isinstance(e, BlocksAllocated)).blocks
    tokens = [index * 100 + i for i in range(2 * b.BLOCK)]
    commit = await ledger.run_step(
        engine,
        step + 2,
        clock,
        [
            MarkComputed(engine_id=engine, owner_id=owner, blocks=blocks, token_ids=tokens),
            StartStore(engine_id=engine, tier=b.TIER, blocks=blocks),
        ],
    )
    job = next(e for e in commit.events if isinstance(e, StoreJobStarted))
    reports = [
        ReportRank(job_id=job.job_id, rank=rank, ok=True, checksums=[b.checksum(i.key, rank) for i in job.items])
        for rank in (1, 0)
    ]
    await ledger.run_step(engine, step + 3, clock, [*reports, FinishOwner(engine_id=engine, owner_id=owner)])
    return [item.key for item in job.items]


async def load(ledger: Ledger, engine: str, keys: list[bytes]) -> None:
    """A request of `engine` that loads `keys` from the shared tier instead of computing them."""
    step = ledger.state.engines[engine].step + 1
    clock = float(step)
    commit = await ledger.run_step(engine, step, clock, [StartOwner(engine_id=engine, req_id=f"{engine}-loader")])
    owner = next(e for e in commit.events if isinstance(e, OwnerStarted)).owner_id
    commit = await ledger.run_step(
        engine, step + 1, clock, [AllocateBlocks(engine_id=engine, owner_id=owner, pool_id=0, count=len(keys))]
    )
    blocks = next(e for e in commit.events if isinstance(e, BlocksAllocated)).blocks
    commit = await ledger.run_step(
        engine,
        step + 2,
        clock,
        [
            StartLoad(
                engine_id=engine, tier=b.TIER, items=[LoadRequest(key, dest) for key, dest in zip(keys, blocks, strict=True)]
            )
        ],
    )
    job = next(e for e in commit.events if isinstance(e, LoadJobStarted))
    reports = [
        ReportRank(job_id=job.job_id, rank=rank, ok=True, checksums=[b.checksum(i.key, rank) for i in job.items])
        for rank in (0, 1)
    ]
    await ledger.run_step(engine, step + 3, clock, [*reports, FinishOwner(engine_id=engine, owner_id=owner)])


async def as_engine(url: str, engine: str, work: object) -> object:
    """Open a writer of its own on the topic (a sidecar), recover the fleet's state, do `work`."""
    event_log = await open_log(url)
    try:
        ledger = await Ledger.open(event_log)
        result = await work(ledger)  # type: ignore[operator]
        await ledger.close()
        return result
    finally:
        await event_log.close()


class Story:
    def __init__(self, topic_url: str, published: list[bytes], loaded: list[bytes], head: int) -> None:
        self.topic_url, self.published, self.loaded, self.head = topic_url, published, loaded, head


async def tell(broker: KafkaBroker, directory: Path) -> Story:
    topic = broker.url(fetch_wait_ms=KAFKA_FETCH_WAIT_MS).split("?")[0].rsplit("/", 1)[1]
    a_url = broker.url(topic, state=directory / "a.sqlite", fetch_wait_ms=KAFKA_FETCH_WAIT_MS)
    b_url = broker.url(topic, state=directory / "b.sqlite", fetch_wait_ms=KAFKA_FETCH_WAIT_MS)

    async def engine_a(ledger: Ledger) -> list[bytes]:
        await declare(ledger, ENGINE_A, tier=True)
        return [key for index in range(4) for key in await serve_and_store(ledger, ENGINE_A, index)]

    published = await as_engine(a_url, ENGINE_A, engine_a)
    assert isinstance(published, list)
    loaded = published[:2]

    async def engine_b(ledger: Ledger) -> None:
        assert all(key in ledger.state.tiers[b.TIER].published[0] for key in loaded)  # A's publications, seen by B
        await declare(ledger, ENGINE_B, tier=False)
        await load(ledger, ENGINE_B, loaded)

    await as_engine(b_url, ENGINE_B, engine_b)

    async def engine_a_again(ledger: Ledger) -> None:
        for index in range(4, 7):
            await serve_and_store(ledger, ENGINE_A, index)

    await as_engine(a_url, ENGINE_A, engine_a_again)
    reader = await open_log(a_url)
    try:
        head = await reader.head()
    finally:
        await reader.close()
    return Story(broker.url(topic, fetch_wait_ms=KAFKA_FETCH_WAIT_MS), published, loaded, head)


@pytest.fixture(scope="module")
def story(kafka_broker: KafkaBroker, tmp_path_factory: pytest.TempPathFactory) -> Story:
    return anyio.run(tell, kafka_broker, tmp_path_factory.mktemp("fleet-story"))


@pytest.fixture
def pg_db() -> Iterator[str]:
    """A fresh PostgreSQL database at the schema's head."""
    yield from _pg_databases(1)


def _pg_databases(count: int) -> Iterator[str]:
    require_postgres()
    names = [_new_pg_database() for _ in range(count)]
    base = PG_URL.rsplit("/", 1)[0]
    try:
        for name in names:
            anyio.run(upgrade_log, f"{base}/{name}")
        yield f"{base}/{names[0]}" if count == 1 else ",".join(f"{base}/{n}" for n in names)
    finally:
        for name in names:
            _drop_pg_database(name)


@pytest.fixture
def two_pg_dbs() -> Iterator[list[str]]:
    for joined in _pg_databases(2):
        yield joined.split(",")


def with_state(topic_url: str, db: str) -> str:
    return fleet_url(topic_url, db)


async def index_rows(event_log: SqlEventLog) -> dict[str, list[tuple[object, ...]]]:
    """Every audit table's entries, sorted (the index's content, whatever order and batches it
    was written in: a packed row's entries one by one)."""
    rows = {}
    async with event_log.engine.connect() as conn:
        for table in AUDIT_TABLES:
            found = (await conn.execute(sa.text(f"SELECT * FROM {table}"))).all()
            name = table.removeprefix("kvl_audit_")
            rows[table] = sorted((entry for row in found for entry in entries(name, row)), key=repr)
    return rows


# --- exactly once -----------------------------------------------------------------------------


def test_the_service_indexes_every_stream_exactly_once_across_stops_and_restarts(story: Story, two_pg_dbs: list[str]) -> None:
    fleet_db, scratch_db = two_pg_dbs
    url = with_state(story.topic_url, fleet_db)

    async def main() -> None:
        # 1. Cancelled mid-way, as a kill would: after the batch that passed 40 events.
        seen: list[int] = []
        async with anyio.create_task_group() as tasks:

            def cancel_mid_way(progress: object) -> None:
                seen.append(progress.indexed_seq)  # type: ignore[attr-defined]
                if progress.indexed_seq >= 40:  # type: ignore[attr-defined]
                    tasks.cancel_scope.cancel()

            tasks.start_soon(lambda: run_fleet(url, stop=anyio.Event(), batch=13, poll_s=0.05, on_progress=cancel_mid_way))
        assert seen and 40 <= seen[-1] < story.head

        # 2. Stopped cleanly (SIGTERM's path) after one more batch.
        stop = anyio.Event()
        done = await run_fleet(url, stop=stop, batch=17, poll_s=0.05, on_progress=lambda _: stop.set())
        assert seen[-1] < done < story.head

        # 3. Restarted: it goes on from its checkpoint to the head.
        assert await run_fleet(url, stop=anyio.Event(), batch=29, until_idle=True) == story.head

        fleet = await open_fleet_log(url)
        scratch = await open_fleet_log(with_state(story.topic_url, scratch_db))
        try:
            assert await indexed_seq(fleet) == story.head
            assert await sync_index(scratch) == story.head  # from scratch, in one go
            built, fresh = await index_rows(fleet), await index_rows(scratch)
            assert built == fresh
            assert sum(map(len, built.values())) > story.head  # several rows per event: not vacuous
            async with fleet.engine.connect() as conn:  # each step indexed once
                steps = (await conn.execute(sa.text("SELECT count(*), count(DISTINCT first_seq) FROM kvl_audit_steps"))).one()
            assert steps[0] == steps[1] > 0
        finally:
            await fleet.close()
            await scratch.close()

    anyio.run(main)


# --- fleet-wide answers ------------------------------------------------------------------------


def test_audit_answers_fleet_wide_a_key_published_by_one_engine_and_loaded_by_another(story: Story, pg_db: str) -> None:
    url = with_state(story.topic_url, pg_db)
    assert anyio.run(lambda: run_fleet(url, stop=anyio.Event(), until_idle=True)) == story.head
    runner = CliRunner()
    for key in story.loaded:
        result = runner.invoke(app, ["audit", "key", key.hex(), "--log", url, "--json"])
        assert result.exit_code == 0, result.output
        answer = json.loads(result.stdout.strip().splitlines()[-1])
        [published] = answer["publications"]
        assert published["source"].startswith(ENGINE_A) and len(published["checksums"]) == 2
        [loaded] = answer["loads"]
        assert loaded["engine"] == ENGINE_B and loaded["outcome"] == "succeeded", loaded
        assert loaded["seq"] > published["seq"]
    never_loaded = story.published[-1]
    result = runner.invoke(app, ["audit", "key", never_loaded.hex(), "--log", url, "--json"])
    assert result.exit_code == 0 and json.loads(result.stdout.strip().splitlines()[-1])["loads"] == []
    result = runner.invoke(app, ["audit", "request", f"{ENGINE_B}-loader", "--log", url, "--json"])
    assert result.exit_code == 0, result.output
    assert [owner["engine"] for owner in json.loads(result.stdout.strip().splitlines()[-1])["owners"]] == [ENGINE_B]
    # The HTTP audit API on the same log and database answers the same, fleet-wide.
    http = anyio.run(_http_get, url, f"/key/{story.loaded[0].hex()}")
    assert [load["engine"] for load in http["loads"]] == [ENGINE_B]
    assert http["publications"][0]["source"].startswith(ENGINE_A)


async def _http_get(url: str, path: str) -> Any:
    """GET `path` from the HTTP audit API served on the Kafka log `url` (its state store holds the index)."""
    event_log = await open_fleet_log(url)
    port = free_port()
    server = uvicorn.Server(
        uvicorn.Config(
            audit_app(event_log, Tokens({"op-token": Grant(tenant="*")})),
            host="127.0.0.1",
            port=port,
            log_config=None,
            access_log=False,
            lifespan="off",
        )
    )

    def get() -> Any:
        request = urllib.request.Request(f"http://127.0.0.1:{port}{path}", headers={"Authorization": "Bearer op-token"})
        with urllib.request.urlopen(request, timeout=10) as response:
            return json.loads(response.read())

    answer: Any = None
    try:
        async with anyio.create_task_group() as tasks:
            tasks.start_soon(server.serve)
            while not server.started:
                await anyio.sleep(0.02)
            try:
                answer = await anyio.to_thread.run_sync(get)
            finally:
                server.should_exit = True
    finally:
        await event_log.close()
    return answer


# --- the command: SIGTERM, bad input ---------------------------------------------------------


def test_the_command_tails_and_stops_cleanly_on_sigterm(kafka_broker: KafkaBroker, pg_db: str, tmp_path: Path) -> None:
    topic_url = kafka_broker.url(fetch_wait_ms=KAFKA_FETCH_WAIT_MS)
    writer_url = f"{topic_url}&state={tmp_path / 'a.sqlite'}"

    async def first(ledger: Ledger) -> int:
        await declare(ledger, ENGINE_A, tier=True)
        await serve_and_store(ledger, ENGINE_A, 0)
        return ledger.last_seq

    async def more(ledger: Ledger) -> int:
        await serve_and_store(ledger, ENGINE_A, 1)
        return ledger.last_seq

    head = anyio.run(as_engine, writer_url, ENGINE_A, first)
    assert isinstance(head, int)
    env = {**os.environ, "KVLEDGER_LOG_LEVEL": "info"}
    process = subprocess.Popen(
        [sys.executable, "-m", "coordinator.cli", "fleet", "--log", topic_url, "--db", pg_db, "--poll", "0.05", "--batch", "7"],
        stderr=subprocess.PIPE,
        stdout=subprocess.PIPE,
        env=env,
    )
    try:
        assert _wait_for_checkpoint(pg_db, head) == head
        later = anyio.run(as_engine, writer_url, ENGINE_A, more)  # written while the service tails the topic
        assert isinstance(later, int) and later > head
        head = later
        assert _wait_for_checkpoint(pg_db, head) == head
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            _, stderr = process.communicate(timeout=20)
        except subprocess.TimeoutExpired:
            process.kill()
            raise
    assert process.returncode == 0, stderr.decode()
    lines = [json.loads(line) for line in stderr.decode().splitlines() if line.startswith("{")]
    events = [line["event"] for line in lines]
    assert "Traceback" not in stderr.decode()
    assert events.index("fleet_started") < events.index("fleet_caught_up") and events[-1] == "fleet_stopped", events
    assert [line for line in lines if line["event"] == "fleet_indexed"][-1]["indexed_seq"] == head
    assert lines[-1]["indexed_seq"] == head
    assert events.count("fleet_caught_up") == 2  # caught up, tailed, caught up again


def test_over_http_it_answers_fleet_wide_and_an_audit_database_outage_is_unready_retried_and_loses_nothing(
    kafka_broker: KafkaBroker,
    two_pg_dbs: list[str],
    tmp_path: Path,
) -> None:
    """`kvledger fleet --http`: the audit API, /readyz and /metrics. Its connections to PostgreSQL
    pass through a proxy that the test cuts while an engine writes: the service stays up, says
    why it is not ready, answers 503 to audit reads, then catches up once the database is back,
    each event indexed once (the same rows as an index built from scratch)."""
    fleet_db, scratch_db = two_pg_dbs
    topic_url = kafka_broker.url(fetch_wait_ms=KAFKA_FETCH_WAIT_MS)
    writer_url = f"{topic_url}&state={tmp_path / 'a.sqlite'}"

    async def first(ledger: Ledger) -> tuple[int, list[bytes]]:
        await declare(ledger, ENGINE_A, tier=True)
        keys = await serve_and_store(ledger, ENGINE_A, 0)
        return ledger.last_seq, keys

    async def more(ledger: Ledger) -> int:
        await serve_and_store(ledger, ENGINE_A, 1)
        return ledger.last_seq

    written = anyio.run(as_engine, writer_url, ENGINE_A, first)
    assert isinstance(written, tuple)
    head: int = written[0]
    keys: list[bytes] = written[1]
    pg = urllib.parse.urlsplit(fleet_db)
    tokens = tmp_path / "tokens.toml"
    token = "op-token-0123456789abcdef"
    tokens.write_text(f'["{token}"]\ntenant = "*"\n')
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    with TcpProxy((pg.hostname or "127.0.0.1", pg.port or 5432)) as proxy:
        proxied_db = urllib.parse.urlunsplit(pg._replace(netloc=f"{pg.username}@127.0.0.1:{proxy.port}"))
        process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "coordinator.cli",
                "fleet",
                "--log",
                topic_url,
                "--db",
                proxied_db,
                "--poll",
                "0.05",
                "--batch",
                "7",
                "--http",
                f"127.0.0.1:{port}",
                "--audit-tokens",
                str(tokens),
            ],
            stderr=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env={**os.environ, "KVLEDGER_LOG_LEVEL": "info"},
        )
        try:
            ready = _wait_for_http(f"{base}/readyz", lambda status, body: status == 200 and body["indexed_seq"] == head, process)
            assert ready["reason"] == "ready"
            status, answer = _get(f"{base}/audit/key/{keys[0].hex()}", token=token)
            assert status == 200 and answer["publications"][0]["source"].startswith(ENGINE_A)
            assert _get(f"{base}/audit/key/{keys[0].hex()}")[0] == 401
            metrics = urllib.request.urlopen(f"{base}/metrics", timeout=10).read().decode()
            assert f"kvledger_fleet_indexed_seq {float(head)}" in metrics and "kvledger_fleet_ready 1.0" in metrics

            proxy.cut()  # the audit database goes away ...
            later = anyio.run(as_engine, writer_url, ENGINE_A, more)  # ... while an engine writes
            assert isinstance(later, int) and later > head
            unready = _wait_for_http(f"{base}/readyz", lambda status, body: status == 503, process)
            assert "the audit database failed" in unready["reason"], unready
            status, refused = _get(f"{base}/audit/key/{keys[0].hex()}", token=token)
            assert status == 503 and "no open log" in refused["detail"], refused
            assert "postgres" not in json.dumps(refused) and "5432" not in json.dumps(refused)  # nothing of the backend
            assert process.poll() is None  # still serving

            proxy.restore()
            _wait_for_http(f"{base}/readyz", lambda status, body: status == 200 and body["indexed_seq"] == later, process)
        finally:
            process.send_signal(signal.SIGTERM)
            try:
                _, stderr = process.communicate(timeout=20)
            except subprocess.TimeoutExpired:
                process.kill()
                raise
            finally:
                print(stderr.decode())  # the service's log, shown when the test fails
    assert process.returncode == 0, stderr.decode()
    events = [json.loads(line)["event"] for line in stderr.decode().splitlines() if line.startswith("{")]
    assert "fleet_db_unavailable" in events and "fleet_log_reopened" in events, events

    async def compare() -> None:
        fleet = await open_fleet_log(with_state(topic_url, fleet_db))
        scratch = await open_fleet_log(with_state(topic_url, scratch_db))
        try:
            assert await indexed_seq(fleet) == later
            assert await sync_index(scratch) == later
            assert await index_rows(fleet) == await index_rows(scratch)
        finally:
            await fleet.close()
            await scratch.close()

    anyio.run(compare)


def _get(url: str, token: str | None = None) -> tuple[int, Any]:
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"} if token else {})
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


def _wait_for_http(url: str, until: Any, process: subprocess.Popen[bytes], timeout: float = 30.0) -> Any:
    deadline = time.monotonic() + timeout
    last: object = None
    while time.monotonic() < deadline and process.poll() is None:
        try:
            status, body = _get(url)
        except OSError as error:  # not listening yet
            last = error
        else:
            last = (status, body)
            if until(status, body):
                return body
        time.sleep(0.05)
    raise AssertionError(f"{url}: still {last} (the service's exit code: {process.poll()})")


def _wait_for_checkpoint(db: str, seq: int) -> int:
    deadline = time.monotonic() + 30
    indexed = 0
    while time.monotonic() < deadline and indexed < seq:
        time.sleep(0.1)
        indexed = anyio.run(_checkpoint, db)
    return indexed


async def _checkpoint(db: str) -> int:
    event_log = await open_log(db)
    try:
        return await indexed_seq(event_log)
    finally:
        await event_log.close()


async def _topics(broker: KafkaBroker) -> list[str]:
    admin = AIOKafkaAdminClient(bootstrap_servers=broker.bootstrap)
    await admin.start()
    try:
        return list(await admin.list_topics())
    finally:
        await admin.close()


def test_bad_input_is_one_line_and_never_creates_a_topic(
    kafka_broker: KafkaBroker, story: Story, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KVLEDGER_DATA_DIR", str(tmp_path / "data"))
    runner = CliRunner()
    state = str(tmp_path / "index.sqlite")
    missing = kafka_broker.url("kvl-no-such-topic", fetch_wait_ms=KAFKA_FETCH_WAIT_MS)
    cases = [
        (["fleet", "--log", f"kafka://127.0.0.1:{free_port()}/t", "--db", state], 1, "cannot reach log"),
        (["fleet", "--log", missing, "--db", state], 1, "no topic 'kvl-no-such-topic'"),
        (["fleet", "--log", story.topic_url, "--db", "mysql://u@h/db"], 2, "is not a PostgreSQL or SQLite database"),
        (["fleet", "--log", story.topic_url, "--db", "kafka://h/t"], 2, "is not a PostgreSQL or SQLite database"),
        (["fleet", "--log", str(tmp_path / "log.sqlite"), "--db", state], 2, "--log must be a Kafka log"),
        (["fleet", "--log", story.topic_url], 2, "name the audit index's database with --db"),
        (
            ["fleet", "--log", f"{story.topic_url}&state={urllib.parse.quote(state)}", "--db", str(tmp_path / "other.sqlite")],
            2,
            "name different databases",
        ),
        (["audit", "key", "00", "--log", f"{missing}&state={urllib.parse.quote(state)}"], 1, "no topic 'kvl-no-such-topic'"),
        (["audit", "refusals", "--log", story.topic_url], 2, "names no state store for the audit index"),
        (["audit", "key", "00", "--log", f"{story.topic_url}&state=mysql://u@h/db"], 2, "is not a PostgreSQL or SQLite database"),
    ]
    bad_tokens = tmp_path / "tokens.toml"
    bad_tokens.write_text('[short]\ntenant = "*"\n')
    cases += [
        (["fleet", "--log", story.topic_url, "--db", state, "--http", "0.0.0.0:9470"], 2, "is not a loopback address"),
        (["fleet", "--log", story.topic_url, "--db", state, "--http", "nowhere"], 2, "is not HOST:PORT"),
        (
            ["fleet", "--log", story.topic_url, "--db", state, "--http", "127.0.0.1:9470", "--audit-tokens", str(bad_tokens)],
            2,
            "must be at least 16 characters",
        ),
    ]
    require_postgres()
    behind = _new_pg_database()  # a PostgreSQL database nobody upgraded: the operator runs `kvledger db upgrade`
    cases.append((["fleet", "--log", story.topic_url, "--db", f"{PG_URL.rsplit('/', 1)[0]}/{behind}"], 1, "kvledger db upgrade"))
    try:
        check_cases(runner, cases)
    finally:
        _drop_pg_database(behind)
    assert "kvl-no-such-topic" not in anyio.run(_topics, kafka_broker)  # forensics never creates a log


def check_cases(runner: CliRunner, cases: list[tuple[list[str], int, str]]) -> None:
    for args, code, says in cases:
        result = runner.invoke(app, args)
        assert result.exit_code == code, (args, result.output)
        [line] = result.output.strip().splitlines()
        assert says in line, (args, line)
        assert result.exception is None or isinstance(result.exception, SystemExit), (args, result.exception)


def test_a_kafka_urls_state_store_password_is_masked() -> None:
    masked = mask(fleet_url("kafka://b1:9092/events?replication_factor=1", "postgresql://kvl:secret@db:5432/audit"))
    assert "secret" not in masked and "state=postgresql://kvl:***@db:5432/audit" in masked


def test_a_postgresql_connection_closed_mid_query_is_an_outage_to_retry_not_a_failure() -> None:
    """asyncpg's "connection was closed in the middle of operation" reaches SQLAlchemy as a plain
    dbapi Error, not flagged as a disconnect: it ended `kvledger fleet` (exit 1) instead of making
    it unready and retrying, in a CI run of the outage test above, when the cut fell mid-query."""
    import asyncpg
    import sqlalchemy as sa
    from sqlalchemy.dialects.postgresql.asyncpg import AsyncAdapt_asyncpg_dbapi

    from events.log import is_outage

    dbapi = AsyncAdapt_asyncpg_dbapi(asyncpg)  # type: ignore[no-untyped-call]
    lost = asyncpg.exceptions.ConnectionDoesNotExistError("connection was closed in the middle of operation")
    adapted = dbapi.Error(str(lost), lost)  # type: ignore[no-untyped-call]
    adapted.__cause__ = lost
    assert is_outage(sa.exc.DBAPIError("SELECT 1", {}, adapted))
    refused = dbapi.Error("duplicate key", asyncpg.exceptions.UniqueViolationError("duplicate key"))  # type: ignore[no-untyped-call]
    assert not is_outage(sa.exc.DBAPIError("INSERT", {}, refused))  # a refusal is not an outage
