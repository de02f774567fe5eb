"""The HTTP audit API (coordinator/audit/api.py) on a real sidecar, over real HTTP: every route
cross-checked against `Audit` on the same log, tenant scoping (I9, for audit reads), bearer
tokens, malformed queries, read-only methods, and the OpenAPI schema checked against the answers.

The log comes from the simulator: engines of two tenants on a real sidecar with real workers
(built once for the module, copied for each test). The API is served by a second sidecar on that
copy, which a test can drive further: the index must catch up before it answers.
"""

from __future__ import annotations

import json
import math
import re
import shutil
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
import msgspec
import pytest
from structlog.testing import capture_logs
from typer.testing import CliRunner

from coordinator.audit.api import INDEXED_SEQ_HEADER, TokenFileError, Tokens, load_tokens
from coordinator.audit.queries import Audit
from coordinator.cli.main import app as cli
from coordinator.core.commands import AllocateBlocks, DeclareTier, StartOwner
from coordinator.sidecar.config import ConfigError, ServeConfig, check_config
from coordinator.sidecar.server import Sidecar
from coordinator.simulator.harness import Simulation
from coordinator.simulator.scenarios import admit, attention, load_prefix, namespace, produce, prompt
from events import BlockRef, OwnerStarted
from events.log import SqlEventLog, open_log
from tests.kit.sidecar import TIER_SPEC, declaration, sidecar_on

pytestmark = pytest.mark.anyio

OPERATOR = "operator-token-0123456789"
TENANT_A = "tenant-a-token-0123456789"
TENANT_B = "tenant-b-token-0123456789"
TOKENS = {OPERATOR: {"tenant": "*", "name": "sre"}, TENANT_A: {"tenant": "tenant-a"}, TENANT_B: {"tenant": "tenant-b"}}
ERROR_FIELDS = {"error", "detail", "parameter"}


# --- the log ------------------------------------------------------------------------------------


class Story(msgspec.Struct, frozen=True):
    """What the simulated log holds, to ask about."""

    directory: Path
    a_block: BlockRef
    a_key: str
    b_block: BlockRef
    b_key: str


async def _tell(directory: Path) -> Story:
    """pod-a (tenant-a) and pod-b (tenant-b) each store a prompt; both run a request named
    "shared"; pod-b is told to load pod-a's keys (refused: another namespace, I9); pod-a names an
    unknown owner (refused)."""
    async with Simulation(directory) as sim:
        a = await sim.engine("pod-a", namespace(tenant="tenant-a"), [attention()])
        b = await sim.engine("pod-b", namespace(tenant="tenant-b"), [attention()])
        tokens_a = prompt(1, 2)
        stored_a = await produce(a, "a-1", tokens_a)
        stored_b = await produce(b, "b-1", prompt(2, 2))
        await produce(a, "shared", prompt(3, 1))
        await produce(b, "shared", prompt(4, 1))
        owner = await admit(b, "b-2")
        assert not await load_prefix(b, owner, [item.key for item in stored_a.items], tokens_a)
        await a.step([AllocateBlocks(engine_id="pod-a", owner_id=987_654, pool_id=0, count=1)])
    return Story(
        directory, stored_a.items[0].source, stored_a.items[0].key.hex(), stored_b.items[0].source, stored_b.items[0].key.hex()
    )


@pytest.fixture(scope="module")
def story(tmp_path_factory: pytest.TempPathFactory) -> Story:
    return anyio.run(_tell, tmp_path_factory.mktemp("story"))


@dataclass
class Served:
    sidecar: Sidecar
    log: SqlEventLog
    base: str

    async def get(
        self, path: str, token: str | None = None, *, method: str = "GET", headers: dict[str, str] | None = None
    ) -> tuple[int, dict[str, str], Any]:
        """(status, headers with lower-case names, the JSON body or None)."""
        sent = {**(headers or {}), **({"Authorization": f"Bearer {token}"} if token is not None else {})}

        def call() -> tuple[int, dict[str, str], bytes]:
            request = urllib.request.Request(self.base + path, method=method, headers=sent)
            try:
                with urllib.request.urlopen(request, timeout=30) as response:
                    return response.status, {k.lower(): v for k, v in response.headers.items()}, response.read()
            except urllib.error.HTTPError as error:
                return error.code, {k.lower(): v for k, v in error.headers.items()}, error.read()

        status, got, body = await anyio.to_thread.run_sync(call)
        return status, got, json.loads(body) if body else None


@asynccontextmanager
async def serving(story: Story, directory: Path, **options: Any) -> AsyncIterator[Served]:
    for path in story.directory.glob("log.sqlite*"):
        shutil.copy(path, directory / path.name)
    event_log = await open_log(str(directory / "log.sqlite"))
    assert isinstance(event_log, SqlEventLog)
    try:
        async with sidecar_on(event_log, directory / "s.sock", http=("127.0.0.1", 0), **options) as sidecar:
            assert sidecar.http_address is not None
            yield Served(sidecar, event_log, f"http://{sidecar.http_address[0]}:{sidecar.http_address[1]}")
    finally:
        await event_log.close()


@pytest.fixture
def tokens_file(tmp_path: Path) -> Path:
    path = tmp_path / "tokens.json"
    path.write_text(json.dumps(TOKENS))
    path.chmod(0o600)
    return path


@pytest.fixture
async def served(story: Story, tmp_path: Path, tokens_file: Path) -> AsyncIterator[Served]:
    async with serving(story, tmp_path, audit_tokens=str(tokens_file)) as served:
        yield served


def builtins(value: object) -> Any:
    return msgspec.json.decode(msgspec.json.encode(value))


def ageless(namespaces: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Namespace entries without their age, which is measured from the moment of asking."""
    return [{name: value for name, value in entry.items() if name != "age_seconds"} for entry in namespaces]


def slot(ref: BlockRef) -> str:
    return f"{ref.pool_id}/{ref.block_id}"


# --- every route answers what Audit answers -----------------------------------------------------


async def test_every_route_answers_what_the_audit_queries_answer(served: Served, story: Story) -> None:
    status, headers, body = await served.get(f"/audit/block/{slot(story.a_block)}?engine=pod-a", OPERATOR)
    assert status == 200, body
    assert headers["content-type"] == "application/json" and headers["cache-control"] == "no-store"
    head = await served.log.head()
    assert int(headers[INDEXED_SEQ_HEADER.lower()]) == head, "the index caught up before answering"
    audit = Audit(served.log)
    pool, block = story.a_block.pool_id, story.a_block.block_id
    assert body == builtins(await audit.block("pod-a", pool, block, head))
    assert body["status"] == "free" and body["generation"]["req_id"] == "a-1" and body["tenant"] == "tenant-a"

    # Each way of naming the point in time.
    allocated = body["generation"]["allocated_seq"]
    step = body["generation"]["allocated_step"]
    for query, seq in (
        (f"at_seq={allocated}", allocated),
        (f"at_step={step}", await audit.resolve("pod-a", at_step=step)),
        (f"at_time={body['at']['recorded_at']}", await audit.resolve("pod-a", at_time=body["at"]["recorded_at"])),
    ):
        status, _, at = await served.get(f"/audit/block/{slot(story.a_block)}?engine=pod-a&{query}", OPERATOR)
        assert status == 200 and at == builtins(await audit.block("pod-a", pool, block, seq)), query
    iso = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(math.ceil(body["at"]["recorded_at"])))
    status, _, at = await served.get(f"/audit/block/{slot(story.a_block)}?engine=pod-a&at_time={iso}", OPERATOR)
    assert status == 200 and at["at"]["seq"] == await audit.resolve("pod-a", at_time=math.ceil(body["at"]["recorded_at"]))
    status, _, at = await served.get(f"/audit/block/{slot(story.a_block)}?engine=pod-a&at_time=2100-12-31t23:59:60z", OPERATOR)
    assert (status, at["at"]["seq"]) == (200, head), "any RFC 3339 date-time: lower-case t and z, a leap second"

    answers = {
        f"/audit/history/{slot(story.a_block)}?engine=pod-a": await audit.history("pod-a", pool, block),
        f"/audit/key/{story.a_key}": await audit.key(story.a_key),
        f"/audit/key/{story.b_key.upper()}": await audit.key(story.b_key),
        "/audit/request/a-1": await audit.request("a-1"),
        "/audit/request/shared": await audit.request("shared"),
        "/audit/refusals": await audit.refusals(),
        "/audit/refusals?since_seq=1&limit=1": await audit.refusals(since_seq=1, limit=1),
    }
    for path, expected in answers.items():
        status, _, got = await served.get(path, OPERATOR)
        assert (status, got) == (200, builtins(expected)), path
    status, _, refusals = await served.get("/audit/refusals", OPERATOR)
    assert {(r["engine"], r["reason"]) for r in refusals} >= {("pod-b", "key_not_published"), ("pod-a", "unknown_owner")}
    since = refusals[0]["recorded_at"]
    status, _, later = await served.get(f"/audit/refusals?since_time={since + 1e-6}", OPERATOR)
    assert later == builtins(await audit.refusals(since_time=since + 1e-6))

    status, _, spaces = await served.get("/audit/namespaces", OPERATOR)
    assert status == 200 and ageless(spaces) == ageless(builtins(await audit.namespaces(now=time.time())))
    assert {s["tenant"] for s in spaces} == {"tenant-a", "tenant-b"}


async def test_a_request_id_with_a_slash_is_one_path_parameter(served: Served) -> None:
    status, _, body = await served.get("/audit/request/" + urllib.parse.quote("a-1/not-a-route", safe=""), OPERATOR)
    assert (status, body["error"]) == (404, "not_found") and "a-1/not-a-route" in body["detail"]


# --- tenants ------------------------------------------------------------------------------------


async def test_a_tenant_token_reads_its_tenant_and_another_tenants_things_read_as_absent(served: Served, story: Story) -> None:
    """I9 for audit reads: another tenant's engine, key or request answers exactly as an absent
    one (404, the same body: a 403 told tenant-a that tenant-b had computed a key); lists hold
    only the token's tenant."""
    mine = Audit(served.log, tenant="tenant-a")
    status, _, body = await served.get(f"/audit/block/{slot(story.a_block)}?engine=pod-a", TENANT_A)
    assert (status, body) == (
        200,
        builtins(await mine.block("pod-a", story.a_block.pool_id, story.a_block.block_id, await served.log.head())),
    )
    status, _, body = await served.get(f"/audit/key/{story.a_key}", TENANT_A)
    assert status == 200 and body["tenant"] == "tenant-a"

    absent_key = "ab" * 16
    theirs = {  # tenant-b's thing -> the same query of a thing nobody has
        f"/audit/block/{slot(story.b_block)}?engine=pod-b": f"/audit/block/{slot(story.b_block)}?engine=pod-x",
        f"/audit/history/{slot(story.b_block)}?engine=pod-b": f"/audit/history/{slot(story.b_block)}?engine=pod-x",
        f"/audit/block/{slot(story.b_block)}?engine=pod-b&at_step=999999":  # scope before existence
        f"/audit/block/{slot(story.b_block)}?engine=pod-x&at_step=999999",
        f"/audit/key/{story.b_key}": f"/audit/key/{absent_key}",
        "/audit/request/b-1": "/audit/request/nobody-1",
        "/audit/request/b-2": "/audit/request/nobody-2",
    }
    for path, absent in theirs.items():
        status, _, body = await served.get(path, TENANT_A)
        absent_status, _, absent_body = await served.get(absent, TENANT_A)
        assert status == absent_status == 404, (path, body)
        sent = {"pod-b": "pod-x", story.b_key: absent_key, "b-1": "nobody-1", "b-2": "nobody-2"}
        echoed = json.dumps(body)
        for theirs_name, absent_name in sent.items():
            echoed = echoed.replace(theirs_name, absent_name)
        assert json.loads(echoed) == absent_body, (path, body, absent_body)  # alike but for what the caller sent
        status, _, body = await served.get(path, TENANT_B)
        assert status == (404 if "at_step" in path else 200), (path, body)

    status, _, shared = await served.get("/audit/request/shared", TENANT_A)
    assert shared == builtins(await mine.request("shared")) and {o["engine"] for o in shared["owners"]} == {"pod-a"}
    status, _, refusals = await served.get("/audit/refusals", TENANT_A)
    assert refusals == builtins(await mine.refusals()) and {r["engine"] for r in refusals} == {"pod-a"}
    status, _, spaces = await served.get("/audit/namespaces", TENANT_A)
    assert ageless(spaces) == ageless(builtins(await mine.namespaces(now=time.time())))
    assert {s["tenant"] for s in spaces} == {"tenant-a"}
    seen = json.dumps([refusals, shared, spaces])
    assert "pod-b" not in seen and "tenant-b" not in seen and story.b_key not in seen


# --- tokens -------------------------------------------------------------------------------------


async def test_a_missing_or_wrong_token_is_401_with_a_bearer_challenge_before_anything_else(served: Served) -> None:
    wrong = "tenant-a-token-012345678X"
    cases: list[tuple[str, dict[str, str]]] = [
        ("/audit/namespaces", {}),
        ("/audit/namespaces", {"Authorization": f"Bearer {wrong}"}),
        ("/audit/namespaces", {"Authorization": f"Bearer {TENANT_A[:-1]}"}),  # a prefix is not the token
        ("/audit/namespaces", {"Authorization": f"Basic {TENANT_A}"}),
        ("/audit/namespaces", {"Authorization": "Bearer "}),
        ("/audit/block/x/-1?at_seq=nope", {}),  # 401 before 422: nothing is said to a stranger
        ("/audit/key/00ff", {"Authorization": f"Bearer {wrong}"}),
    ]
    with capture_logs() as logs:
        for path, headers in cases:
            status, got, body = await served.get(path, headers=headers)
            assert status == 401 and body["error"] == "unauthorized" and set(body) == ERROR_FIELDS, (path, headers)
            assert got["www-authenticate"].startswith('Bearer realm="kvledger-audit"')
            if wrong in headers.get("Authorization", ""):
                assert 'error="invalid_token"' in got["www-authenticate"]
    assert sum(entry["event"] == "audit_unauthorized" for entry in logs) == len(cases)
    assert wrong not in repr(logs) and TENANT_A not in repr(logs), "a token is never logged"
    status, _, _ = await served.get("/audit/namespaces", headers={"Authorization": f"bearer {TENANT_A}"})
    assert status == 200, "the scheme is case-insensitive (RFC 7235)"


async def test_without_a_tokens_file_every_query_is_401_and_the_schema_is_served(story: Story, tmp_path: Path) -> None:
    async with serving(story, tmp_path) as served:
        for path in ("/audit/namespaces", "/audit/refusals", "/audit/request/a-1"):
            status, headers, body = await served.get(path, OPERATOR)
            assert status == 401 and "--audit-tokens" in body["detail"] and "www-authenticate" in headers
        status, _, schema = await served.get("/audit/openapi.json")
        assert status == 200 and schema["openapi"] == "3.1.0"


def test_tokens_files_in_json_or_toml_and_what_is_refused(tmp_path: Path) -> None:
    toml = tmp_path / "tokens.toml"
    toml.write_text(f'"{OPERATOR}" = {{ tenant = "*", name = "sre" }}\n"{TENANT_A}" = {{ tenant = "tenant-a" }}\n')
    bare = tmp_path / "tokens"  # no suffix (a mounted secret): JSON when it starts with "{"
    bare.write_text(json.dumps(TOKENS))
    for path in (toml, bare):
        tokens = load_tokens(path)
        operator, tenant = tokens.match(OPERATOR), tokens.match(TENANT_A)
        assert operator is not None and operator.scope is None and operator.name == "sre"
        assert tenant is not None and tenant.scope == "tenant-a"
        assert tokens.match(TENANT_A + "x") is None and tokens.match("") is None
    assert len(Tokens({})) == 0

    secret = "short-secret"
    refused = {
        "empty.json": "{}",
        "list.json": "[]",
        "short.json": json.dumps({secret: {"tenant": "t"}}),
        "spaces.json": json.dumps({"a token with spaces in it": {"tenant": "t"}}),
        "no-tenant.json": json.dumps({TENANT_A: {"tenant": ""}}),
        "extra.json": json.dumps({TENANT_A: {"tenant": "t", "role": "admin"}}),
        "broken.json": '{"' + TENANT_A + '": ',
        "broken.toml": f'"{TENANT_A}" = {{ tenant = }}',
    }
    for name, text in refused.items():
        path = tmp_path / name
        path.write_text(text)
        with pytest.raises(TokenFileError) as caught:
            load_tokens(path)
        message = str(caught.value)
        assert str(path) in message and secret not in message and TENANT_A not in message, (name, message)
        with pytest.raises(ConfigError):
            check_config(ServeConfig(socket_path=str(tmp_path / "s"), audit_tokens=str(path)))
    with pytest.raises(TokenFileError, match="No such file"):
        load_tokens(tmp_path / "missing.json")


def test_serve_refuses_to_start_with_a_bad_tokens_file(tmp_path: Path) -> None:
    bad = tmp_path / "tokens.json"
    bad.write_text(json.dumps({"tiny-secret": {"tenant": "t"}}))
    result = CliRunner().invoke(
        cli,
        ["serve", "--socket", str(tmp_path / "s.sock"), "--log", str(tmp_path / "log.sqlite"), "--http", "off"],
        env={"KVLEDGER_AUDIT_TOKENS": str(bad)},
    )
    assert result.exit_code == 2 and "--audit-tokens" in result.stderr and "tiny-secret" not in result.stderr


# --- malformed and unknown ----------------------------------------------------------------------

MALFORMED = [
    ("/audit/block/x/1?engine=pod-a", "pool"),
    ("/audit/block/0/-1?engine=pod-a", "block"),
    ("/audit/block/0/1.5?engine=pod-a", "block"),
    ("/audit/block/0/1?engine=pod-a&at_seq=-5", "at_seq"),
    ("/audit/block/0/1?engine=pod-a&at_seq=99999999999999999999", "at_seq"),
    ("/audit/block/0/1?engine=pod-a&at_seq=1&at_step=2", "at_seq,at_step"),
    ("/audit/block/0/1?engine=pod-a&at_step=1&at_time=5", "at_step,at_time"),
    ("/audit/block/0/1?engine=pod-a&at_time=yesterday", "at_time"),
    ("/audit/block/0/1?engine=pod-a&at_time=nan", "at_time"),
    ("/audit/block/0/1?engine=pod-a&at-seq=5", "at-seq"),
    ("/audit/block/0/1?engine=pod-a&at_seq=1&at_seq=2", "at_seq"),
    ("/audit/block/0/1?engine=", "engine"),
    ("/audit/block/0/1", "engine"),  # two engines: which one?
    ("/audit/history/0/x?engine=pod-a", "block"),
    ("/audit/history/0/1?engine=pod-a&at_seq=3", "at_seq"),
    ("/audit/key/not-hex", "key"),
    ("/audit/key/abc", "key"),
    ("/audit/key/" + "ab" * 65, "key"),
    ("/audit/request/" + "r" * 1025, "req_id"),
    ("/audit/refusals?limit=0", "limit"),
    ("/audit/refusals?limit=10001", "limit"),
    ("/audit/refusals?since_seq=abc", "since_seq"),
    ("/audit/refusals?since_time=soon", "since_time"),
    ("/audit/namespaces?tenant=tenant-b", "tenant"),
]


async def test_a_malformed_query_is_422_naming_the_parameter_and_nothing_else(served: Served) -> None:
    for path, parameter in MALFORMED:
        status, _, body = await served.get(path, OPERATOR)
        assert status == 422 and body["error"] == "invalid_parameter" and body["parameter"] == parameter, (path, body)
        assert set(body) == ERROR_FIELDS and "pod-b" not in body["detail"] and "tenant-b" not in body["detail"], body


async def test_what_the_log_does_not_hold_is_404(served: Served) -> None:
    for path in (
        "/audit/block/0/1?engine=pod-z",
        "/audit/history/0/1?engine=pod-z",
        "/audit/key/" + "00" * 32,
        "/audit/request/never-ran",
        "/audit/block/0/1?engine=pod-a&at_step=999999",
        "/audit/block/0/1?engine=pod-a&at_time=1.0",
        "/audit/no-such-route",
        "/audit/block//1",
    ):
        status, headers, body = await served.get(path, OPERATOR)
        assert status == 404 and body["error"] == "not_found" and set(body) == ERROR_FIELDS, (path, body)
        assert headers["content-type"] == "application/json"
    status, _, body = await served.get("/audit/block/0/1?engine=pod-a&at_seq=999999999", OPERATOR)
    assert status == 200 and body["at"]["seq"] == await served.log.head(), "a sequence past the head is the head"


async def test_only_get_is_answered_and_nothing_changes(served: Served, story: Story) -> None:
    await served.get("/audit/namespaces", OPERATOR)  # the index caught up: a write would now show
    before = (await served.log.head(), await Audit(served.log).indexed(), await Audit(served.log).refusals())
    for path in ("/audit/namespaces", f"/audit/key/{story.a_key}", "/audit/refusals", "/audit/openapi.json"):
        for method in ("POST", "PUT", "PATCH", "DELETE", "HEAD", "OPTIONS"):
            status, headers, body = await served.get(path, OPERATOR, method=method, headers={"Content-Type": "application/json"})
            assert status == 405 and headers["allow"] == "GET", (method, path)
            if method != "HEAD":
                assert body["error"] == "method_not_allowed" and set(body) == ERROR_FIELDS
    assert (await served.log.head(), await Audit(served.log).indexed(), await Audit(served.log).refusals()) == before


# --- freshness and the event loop ---------------------------------------------------------------


async def test_the_index_catches_up_with_steps_committed_since_the_last_query(served: Served, tmp_path: Path) -> None:
    from coordinator.client import Address, EngineClient

    status, headers, _ = await served.get("/audit/refusals", OPERATOR)
    before = int(headers[INDEXED_SEQ_HEADER.lower()])
    async with EngineClient(Address(socket_path=str(tmp_path / "s.sock")), declaration("pod-c"), tiers=[TIER_SPEC]) as client:
        await client.step(1, 1.0, [AllocateBlocks(engine_id="pod-c", owner_id=4242, pool_id=0, count=1)])
    status, headers, refusals = await served.get(f"/audit/refusals?since_seq={before}", OPERATOR)
    assert int(headers[INDEXED_SEQ_HEADER.lower()]) == served.sidecar.ledger.last_seq > before
    assert [(r["engine"], r["reason"]) for r in refusals] == [("pod-c", "unknown_owner")]
    status, _, block = await served.get("/audit/block/0/1?engine=pod-c", TENANT_A)  # pod-c is tenant-a's
    assert status == 200 and block["status"] == "never_allocated"


async def test_concurrent_first_queries_index_once_and_leave_the_loop_free(served: Served, story: Story) -> None:
    """The first queries on a log whose index is empty catch it up together: one catch-up runs,
    the others wait for it, all answer the same; the sidecar's loop keeps turning meanwhile."""
    assert await Audit(served.log).indexed() == 0
    worst, done = 0.0, False

    async def tick() -> None:
        nonlocal worst
        last = time.perf_counter()
        while not done:
            await anyio.sleep(0.001)
            now = time.perf_counter()
            worst, last = max(worst, now - last), now

    answers: list[Any] = []

    async def ask() -> None:
        answers.append(await served.get(f"/audit/key/{story.a_key}", OPERATOR))

    async with anyio.create_task_group() as tasks:
        tasks.start_soon(tick)
        async with anyio.create_task_group() as asking:
            for _ in range(8):
                asking.start_soon(ask)
        done = True
    assert all(status == 200 for status, _, _ in answers) and len({json.dumps(body) for _, _, body in answers}) == 1
    assert await Audit(served.log).indexed() == await served.log.head()
    assert worst < 0.5, f"the event loop stalled {worst:.3f} s"


# --- the OpenAPI schema -------------------------------------------------------------------------


def _conforms(instance: Any, schema: dict[str, Any], components: dict[str, Any], where: str = "$") -> list[str]:
    """Where `instance` breaks `schema`: the JSON Schema keywords msgspec and this API emit."""
    if "$ref" in schema:
        return _conforms(instance, components[schema["$ref"].rsplit("/", 1)[1]], components, where)
    if "anyOf" in schema:
        if not any(not _conforms(instance, branch, components, where) for branch in schema["anyOf"]):
            return [f"{where}: {instance!r} matches no branch of {schema['anyOf']}"]
        return []
    kinds = {"object": dict, "array": list, "string": str, "boolean": bool, "null": type(None)}
    kind = schema.get("type")
    if kind == "integer":
        ok = isinstance(instance, int) and not isinstance(instance, bool)
    elif kind == "number":
        ok = isinstance(instance, int | float) and not isinstance(instance, bool)
    else:
        ok = kind is None or isinstance(instance, kinds[kind])
    if not ok:
        return [f"{where}: {instance!r} is not {kind}"]
    errors = []
    if isinstance(instance, dict):
        errors += [f"{where}: {name} missing" for name in schema.get("required", []) if name not in instance]
        for name, value in instance.items():
            if name in schema.get("properties", {}):
                errors += _conforms(value, schema["properties"][name], components, f"{where}.{name}")
            elif schema.get("properties") is not None and schema.get("additionalProperties") is False:
                errors.append(f"{where}: {name} is not a property")
    if isinstance(instance, list) and "items" in schema:
        for index, value in enumerate(instance):
            errors += _conforms(value, schema["items"], components, f"{where}[{index}]")
    if "minimum" in schema and instance < schema["minimum"] or "maximum" in schema and instance > schema["maximum"]:
        errors.append(f"{where}: {instance!r} is out of range")
    if "pattern" in schema and not re.search(schema["pattern"], instance):
        errors.append(f"{where}: {instance!r} does not match {schema['pattern']}")
    if "enum" in schema and instance not in schema["enum"]:
        errors.append(f"{where}: {instance!r} is not one of {schema['enum']}")
    return errors


async def test_the_openapi_schema_lists_every_route_and_the_answers_conform_to_it(served: Served, story: Story) -> None:
    status, _, schema = await served.get("/audit/openapi.json")  # no token needed: no data in it
    assert status == 200 and schema["openapi"] == "3.1.0"
    assert set(schema["paths"]) == {
        "/audit/block/{pool}/{block}",
        "/audit/history/{pool}/{block}",
        "/audit/key/{key}",
        "/audit/request/{req_id}",
        "/audit/refusals",
        "/audit/namespaces",
        "/audit/openapi.json",
    }
    assert schema["components"]["securitySchemes"] == {
        "bearer": {
            "type": "http",
            "scheme": "bearer",
            "description": schema["components"]["securitySchemes"]["bearer"]["description"],
        }
    } and schema["security"] == [{"bearer": []}]
    components = schema["components"]["schemas"]
    refs = re.findall(r'"\$ref": "#/components/schemas/(\w+)"', json.dumps(schema))
    assert refs and set(refs) <= set(components)
    for path, item in schema["paths"].items():
        assert list(item) == ["get"], path
        operation = item["get"]
        declared = {p["name"] for p in operation.get("parameters", []) if p["in"] == "path"}
        assert declared == set(re.findall(r"\{(\w+)\}", path)), path
        if path != "/audit/openapi.json":
            assert {"200", "401", "422", "503"} <= set(operation["responses"]), path
            assert operation["responses"]["401"]["headers"]["WWW-Authenticate"]["required"]

    # Every answer, and every error body, conforms to what the schema says of its route.
    samples = [
        ("/audit/block/{pool}/{block}", f"/audit/block/{slot(story.a_block)}?engine=pod-a", TENANT_A),
        ("/audit/block/{pool}/{block}", f"/audit/block/{slot(story.b_block)}?engine=pod-b", TENANT_A),
        ("/audit/block/{pool}/{block}", "/audit/block/0/63?engine=pod-a&at_seq=1", OPERATOR),
        ("/audit/history/{pool}/{block}", f"/audit/history/{slot(story.a_block)}?engine=pod-a", OPERATOR),
        ("/audit/key/{key}", f"/audit/key/{story.a_key}", OPERATOR),
        ("/audit/key/{key}", "/audit/key/zz", OPERATOR),
        ("/audit/request/{req_id}", "/audit/request/shared", OPERATOR),
        ("/audit/request/{req_id}", "/audit/request/nobody", OPERATOR),
        ("/audit/refusals", "/audit/refusals", OPERATOR),
        ("/audit/namespaces", "/audit/namespaces", None),
        ("/audit/namespaces", "/audit/namespaces", OPERATOR),
    ]
    for route, path, token in samples:
        status, headers, body = await served.get(path, token)
        response = schema["paths"][route]["get"]["responses"][str(status)]
        assert not _conforms(body, response["content"]["application/json"]["schema"], components), (path, status)
        for name, header in response.get("headers", {}).items():
            assert not header["required"] or name.lower() in headers, (path, name)

    # Every parameter the schema declares is one the server takes.
    values = {
        "pool": "0",
        "block": "1",
        "engine": "pod-a",
        "at_seq": "1",
        "at_step": "1",
        "at_time": "2030-01-01T00:00:00Z",
        "key": story.a_key,
        "req_id": "a-1",
        "since_seq": "0",
        "since_time": "0",
        "limit": "5",
    }
    for path, item in schema["paths"].items():
        parameters = item["get"].get("parameters", [])
        url = re.sub(r"\{(\w+)\}", lambda m: values[m.group(1)], path)
        for parameter in (p for p in parameters if p["in"] == "query"):
            status, _, body = await served.get(
                f"{url}?{parameter['name']}={values[parameter['name']]}"
                + ("&engine=pod-a" if parameter["name"] != "engine" and "pool" in path else ""),
                OPERATOR,
            )
            assert status == 200, (path, parameter["name"], body)


# --- odd input: 404 or 422, never 500 -----------------------------------------------------------


async def _asgi_get(app: Any, target: str, token: str) -> tuple[int, Any]:
    """GET `target` (a percent-encoded path and query, as a client sends it) from an ASGI app in
    this process: (status, the JSON body)."""
    path, _, query = target.partition("?")
    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "GET",
        "scheme": "http",
        "path": urllib.parse.unquote(path),
        "raw_path": path.encode(),
        "query_string": query.encode(),
        "root_path": "",
        "headers": [(b"host", b"test"), (b"authorization", f"Bearer {token}".encode())],
        "client": ("127.0.0.1", 1),
        "server": ("test", 80),
    }
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    await app(scope, receive, send)
    status = next(m["status"] for m in sent if m["type"] == "http.response.start")
    return status, json.loads(b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body"))


ODD = [  # (the request, its status, the parameter a 422 names)
    ("/block/0/1?engine=pod-x&at_time=-1e12", 422, "at_time"),  # was 500: the 404's message could not print the time
    ("/block/0/1?engine=pod-x&at_time=-62135596801", 422, "at_time"),  # a second before year 1
    ("/block/0/1?engine=pod-x&at_time=1e300", 422, "at_time"),
    ("/block/0/1?engine=pod-x&at_time=0001-01-01T00:00:00%2B01:00", 422, "at_time"),
    ("/block/0/1?engine=pod-x&at_time=-inf", 422, "at_time"),
    ("/refusals?since_time=-1e12", 422, "since_time"),
    ("/block/0/1?engine=pod-x&at_time=-62135596800", 404, None),  # year 1 itself: nothing was recorded by then
    ("/block/3000000000/1?engine=pod-x", 422, "pool"),  # was 500 on PostgreSQL: an INTEGER column
    ("/history/0/2147483648?engine=pod-x", 422, "block"),
    ("/block/2147483647/2147483647?engine=pod-x", 200, None),
    ("/block/0/1?engine=pod-x&at_seq=9223372036854775807", 200, None),
    ("/block/0/1?engine=pod-x&at_step=9223372036854775807", 404, None),
    ("/block/0/1?engine=pod-x&at_step=9223372036854775808", 422, "at_step"),
    ("/refusals?since_seq=9223372036854775807&limit=10000", 200, None),
    ("/refusals?since_seq=9223372036854775808", 422, "since_seq"),
    ("/request/%00", 422, "req_id"),  # was 500 on PostgreSQL: text cannot hold NUL
    ("/request/a%00b", 422, "req_id"),
    ("/request/a%0A", 422, "req_id"),  # Starlette's route would have read it as "a"
    ("/request/tab%09id", 422, "req_id"),
    ("/block/0/1?engine=%00", 422, "engine"),
    ("/history/0/1?engine=pod%7F", 422, "engine"),
    ("/refusals?since_time=%00", 422, "since_time"),
    ("/key/00", 404, None),
    ("/request/r%C3%A9q-%F0%9F%98%80", 404, None),  # printable Unicode is a name like any other
]


async def test_odd_input_is_404_or_422_never_500_on_each_backend(event_log: SqlEventLog) -> None:
    from coordinator.audit.api import AuditApi, Grant
    from coordinator.ledger.ledger import Ledger

    ledger = await Ledger.open(event_log)
    await ledger.execute(DeclareTier(spec=TIER_SPEC))
    await ledger.execute(declaration("pod-x"))
    commit = await ledger.run_step("pod-x", 1, 1.0, [StartOwner(engine_id="pod-x", req_id="r-1")])
    owner = next(e for e in commit.events if isinstance(e, OwnerStarted)).owner_id
    await ledger.run_step("pod-x", 2, 2.0, [AllocateBlocks(engine_id="pod-x", owner_id=owner, pool_id=0, count=1)])
    app = AuditApi(event_log, Tokens({OPERATOR: Grant(tenant="*")})).app()
    wrong = []
    for target, status, parameter in ODD:
        got, body = await _asgi_get(app, target, OPERATOR)
        if got != status or (status == 422 and (body["error"], body["parameter"]) != ("invalid_parameter", parameter)):
            wrong.append((target, got, body))
        assert set(body) == ERROR_FIELDS or got == 200
    assert not wrong, wrong
    _, body = await _asgi_get(app, "/block/0/1?engine=pod-x&at_time=-1e12", OPERATOR)
    assert "0001-01-01" in body["detail"] and "9999-12-31" in body["detail"], "the 422 says which times are accepted"


async def test_odd_input_over_real_http(served: Served) -> None:
    for path, parameter in (
        ("/audit/request/%00", "req_id"),
        ("/audit/block/0/1?engine=pod-a&at_time=-1e12", "at_time"),
        ("/audit/block/0/1?engine=pod-a%0A", "engine"),
        ("/audit/history/4294967296/1?engine=pod-a", "pool"),
    ):
        status, _, body = await served.get(path, OPERATOR)
        assert status == 422 and body["parameter"] == parameter, (path, body)
