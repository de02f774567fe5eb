"""Fuzzing the HTTP audit API against its own OpenAPI schema (issue 10, item 7), with schemathesis.

The schema is the one the API serves at /audit/openapi.json (`openapi(OPERATIONS)`; a test checks
the two are the same document). Schemathesis generates requests from it, valid and invalid ones
(its positive and negative modes), and each goes to the API as an ASGI app (`audit_app` in an
`AuditMount`, as the sidecar mounts it) over a copy of a real SQLite log: the simulated story of
tests/audit/test_audit_api.py, two engines of two tenants that share a tier and a request id.
Generation is steered toward the story's own engines, blocks, keys and request ids, so the
tenant checks meet real data.

Every generated request is sent four times: with the operator's token, tenant-a's, a wrong token
and none. It checks:

* no answer is a 5xx, whoever asks;
* without the right token (a wrong one or none) the answer is 401 with a bearer challenge and an
  error body (`ErrorBody`) that holds nothing of the log (or a 404/405 from the routing, before
  any route: just as empty);
* with a token, every answer conforms to the schema (schemathesis's own checks: status codes,
  content types, headers, bodies; an invalid request is refused with a 4xx);
* tenant-a's token never sees tenant-b's engine, keys or requests: every answer names tenant-a
  only (404 for what is tenant-b's, as for what is nobody's), and no answer holds pod-b's name,
  its key or its request ids (I9, for audit reads).

KVLEDGER_FUZZ_EXAMPLES=N runs N examples per route (the default keeps the file under a minute).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
import jsonschema_rs
import msgspec
import pytest
import schemathesis
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from schemathesis import Case, GenerationMode, HookContext
from schemathesis.checks import negative_data_rejection, positive_data_acceptance
from schemathesis.python import asgi
from starlette.applications import Starlette

from coordinator.audit.api import MOUNT, OPERATIONS, AuditMount, Grant, Tokens, audit_app, openapi
from coordinator.audit.times import EARLIEST, LATEST
from events.log import SqlEventLog, open_log
from tests.audit.test_audit_api import OPERATOR, TENANT_A, TENANT_B, TOKENS, Story, _tell

EXAMPLES = int(os.environ.get("KVLEDGER_FUZZ_EXAMPLES", "150"))
WRONG = "wrong-token-0123456789abcdef"
ERROR_FIELDS = {"error", "detail", "parameter"}
CALLERS: dict[str, str | None] = {"operator": OPERATOR, "tenant-a": TENANT_A, "wrong token": WRONG, "no token": None}


# --- the API under fuzz ---------------------------------------------------------------------------


@dataclass
class Audited:
    story: Story
    log_path: Path
    """A copy of the story's log: what the API reads (its index is written there as it catches up)."""
    tenant_b_marks: tuple[str, ...]
    """What of tenant-b's an answer to tenant-a must never hold."""


AUDITED: list[Audited] = []
"""What the `audited` fixture built: the app's lifespan opens its log, the generation hooks draw
its names (both read only once requests are generated and sent)."""
TOKEN_GRANTS = Tokens({token: msgspec.convert(grant, Grant) for token, grant in TOKENS.items()})


@asynccontextmanager
async def _lifespan(app: Starlette) -> AsyncIterator[None]:
    # Runs in the event loop schemathesis runs ASGI apps in: the log's connections belong to it.
    assert AUDITED, "the `audited` fixture copies the log before the first request"
    event_log = await open_log(str(AUDITED[0].log_path))
    assert isinstance(event_log, SqlEventLog)
    mount = AuditMount(audit_app(event_log, TOKEN_GRANTS))  # as the sidecar and `kvledger fleet` mount it
    app.router.routes.append(mount)
    try:
        yield
    finally:
        app.router.routes.remove(mount)
        await event_log.close()


APP = Starlette(lifespan=_lifespan)
schema = schemathesis.openapi.from_dict(openapi(OPERATIONS))
"""What /audit/openapi.json serves (test_the_fuzzed_schema_is_the_one_the_api_serves), bound to the app."""
schema.app = APP


@pytest.fixture(scope="module")
def audited(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Audited]:
    story = anyio.run(_tell, tmp_path_factory.mktemp("story"))
    copy = tmp_path_factory.mktemp("audited")
    for path in story.directory.glob("log.sqlite*"):
        shutil.copy(path, copy / path.name)
    AUDITED.append(Audited(story, copy / "log.sqlite", ("pod-b", "tenant-b", story.b_key, "b-1", "b-2")))
    try:
        yield AUDITED[0]
    finally:
        asgi.shutdown_lifespans()  # closes the log
        AUDITED.clear()


def _story() -> Story:
    assert AUDITED, "the `audited` fixture builds the story before any example is drawn"
    return AUDITED[0].story


@schema.hook
def flatmap_case(context: HookContext, case: Case[Any]) -> st.SearchStrategy[Case[Any]]:
    """Half of the valid requests name the story's own blocks, keys, requests and engines, of both
    tenants (random names rarely meet the log's). Invalid ones are left as generated: what makes
    them invalid may be the very parameter this would replace."""
    if case.meta is None or case.meta.generation.mode != GenerationMode.POSITIVE:
        return st.just(case)
    return st.one_of(st.just(case), st.deferred(lambda: _story_names(case)).map(lambda names: _naming(case, names)))


def _story_names(case: Case[Any]) -> st.SearchStrategy[dict[str, Any]]:
    story, path = _story(), case.operation.path
    if path.endswith("/{pool}/{block}"):
        refs = [{"pool": ref.pool_id, "block": ref.block_id} for ref in (story.a_block, story.b_block)]
        slots = st.sampled_from([*refs, {"pool": 0, "block": 2}, {"pool": 0, "block": 0}])
        return st.tuples(slots, st.sampled_from(("pod-a", "pod-b"))).map(lambda pair: {**pair[0], "engine": pair[1]})
    if path.endswith("/{key}"):
        return st.sampled_from([{"key": key} for key in (story.a_key, story.b_key, story.a_key.upper())])
    if path.endswith("/{req_id}"):
        return st.sampled_from([{"req_id": name} for name in ("a-1", "b-1", "b-2", "shared", "a-1/x")])
    return st.just({})


def _naming(case: Case[Any], names: dict[str, Any]) -> Case[Any]:
    named = case.derive(keep_auth=True)
    for name, value in names.items():
        (named.query if name == "engine" else named.path_parameters)[name] = value
    return named


# --- the fuzz test -----------------------------------------------------------------------------------


@schema.parametrize()
@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck))
def test_fuzz_audit_api(case: Case[Any], audited: Audited) -> None:
    """Every generated request, by every kind of caller: see the module's docstring."""
    for caller, token in CALLERS.items():
        headers = {} if token is None else {"Authorization": f"Bearer {token}"}
        if caller in ("operator", "tenant-a"):
            refused = _refused_though_schema_valid(case, caller)
            excluded = [positive_data_acceptance] if refused is not None else []
            if _negative(case) and _schema_valid(case):
                # What is sent is valid: the case's fault was the missing Authorization header this
                # caller's token fills, or a query value requests leaves out (None, an empty list).
                excluded.append(negative_data_rejection)
            response = case.call_and_validate(headers=headers, excluded_checks=excluded)
            if refused:  # what else the request holds is valid: this is the one thing refused
                assert response.status_code == 422 and response.json()["parameter"] == refused, response.text
        else:
            response = case.call(headers=headers)
        status, text = response.status_code, response.text
        event(f"{caller}: {status}")
        where = f"{caller}: {case.method} {case.formatted_path}?{case.query or ''} -> {status} {text[:300]}"
        assert status < 500, where
        if case.operation.path == MOUNT + "/openapi.json":
            continue  # the schema needs no token and holds no data
        body = json.loads(text) if text else None
        if caller in ("wrong token", "no token"):
            assert status in (401, 404, 405), where  # 404/405: the routing's, before any route
            assert isinstance(body, dict) and set(body) <= ERROR_FIELDS, where
            if status == 401:
                assert body["error"] == "unauthorized" and response.headers.get("www-authenticate", [""])[0].startswith(
                    "Bearer "
                ), where
        elif caller == "tenant-a":
            # An answer may echo what the caller sent (a 404 names the key asked for, tenant-b's or
            # nobody's alike), never anything else of tenant-b's.
            sent = f"{case.formatted_path}?{case.query or ''}"
            assert not [mark for mark in audited.tenant_b_marks if mark in text and mark not in sent], where
            assert _tenants(body) <= {"tenant-a"}, where


def _refused_though_schema_valid(case: Case[Any], caller: str) -> str | None:
    """The parameter a schema-valid request is refused for (422) by what no schema can say, or ""
    when schemathesis's coverage phase called positive a value the schema itself refuses (a
    257-character engine against maxLength 256); None: the request must be accepted."""
    if _negative(case):
        return None  # schemathesis's own checks want it refused
    if not _schema_valid(case):
        return ""
    query = case.query or {}
    points = [name for name in ("at_seq", "at_step", "at_time") if name in query]
    if len(points) > 1:  # "at most one of": OpenAPI relates no two parameters (their descriptions say it)
        return ",".join(points)
    if caller == "operator" and "{pool}/{block}" in case.operation.path and "engine" not in query:
        return "engine"  # the default is the log's only engine, and the operator sees two
    return None


def _negative(case: Case[Any]) -> bool:
    return case.meta is None or case.meta.generation.mode != GenerationMode.POSITIVE


def _schema_valid(case: Case[Any]) -> bool:
    """Whether every parameter `case` sends is one its schema accepts (a query value may come as
    text; requests sends no parameter for None or an empty list)."""
    parameters = case.operation.schema.raw_schema["paths"][case.operation.path]["get"].get("parameters", [])
    sent = {name: value for name, value in (case.query or {}).items() if value is not None and value != []}
    given = {**(case.path_parameters or {}), **sent}
    if set(given) - {parameter["name"] for parameter in parameters}:
        return False
    for parameter in parameters:
        if parameter["name"] not in given:
            continue
        value = given[parameter["name"]]
        readings = [value]
        if isinstance(value, str):
            with contextlib.suppress(ValueError):
                readings.append(json.loads(value))
        validator = jsonschema_rs.validator_for(parameter["schema"])  # schemathesis's own validator
        if not any(validator.is_valid(reading) for reading in readings):
            return False
    return True


def _tenants(value: object) -> set[str]:
    """Every tenant an answer names (its `tenant` fields, at any depth)."""
    if isinstance(value, dict):
        found = {str(value["tenant"])} if "tenant" in value else set()
        return found.union(*(_tenants(inner) for inner in value.values()))
    if isinstance(value, list):
        return set().union(*(_tenants(inner) for inner in value))
    return set()


# --- what the fuzz test relies on -----------------------------------------------------------------


def test_the_fuzzed_schema_is_the_one_the_api_serves(audited: Audited) -> None:
    with asgi.get_client(APP) as client:  # type: ignore[arg-type]  # Starlette takes a wider scope type
        served = client.get(MOUNT + "/openapi.json")
    assert served.status_code == 200 and served.json() == schema.raw_schema


def test_the_steering_reaches_both_tenants_data(audited: Audited) -> None:
    """The story's names reach the API: tenant-b's key is 200 for the operator and 404 for tenant-a."""
    with asgi.get_client(APP) as client:  # type: ignore[arg-type]  # Starlette takes a wider scope type
        for token, status in ((OPERATOR, 200), (TENANT_B, 200), (TENANT_A, 404)):
            answer = client.get(f"{MOUNT}/key/{audited.story.b_key}", headers={"Authorization": f"Bearer {token}"})
            assert answer.status_code == status, answer.text


# --- findings: each a regression test with its minimal input ----------------------------------------


def test_a_newline_in_a_path_reaches_the_api_and_is_a_json_422(audited: Audited) -> None:
    """Found by schemathesis (undocumented content type): /audit/block/a%0Ab/1 never reached the
    API. Starlette's Mount matched `.*` after /audit, and `.` stops at a newline, so the enclosing
    app (the sidecar's, `kvledger fleet`'s) answered its own plain-text 404. Now AuditMount takes
    every path under /audit and the API refuses the control character as it does elsewhere."""
    with asgi.get_client(APP) as client:  # type: ignore[arg-type]  # Starlette takes a wider scope type
        answer = client.get(f"{MOUNT}/block/a%0Ab/1", headers={"Authorization": f"Bearer {OPERATOR}"})
        assert answer.status_code == 422 and answer.headers["content-type"] == "application/json", answer.text
        assert answer.json() == {"error": "invalid_parameter", "detail": "expected no control characters", "parameter": "pool"}
        unauthorized = client.get(f"{MOUNT}/key/a%0Ab")
        assert unauthorized.status_code == 401 and set(unauthorized.json()) <= ERROR_FIELDS


@pytest.mark.parametrize("point", ["at_seq", "at_step"])
def test_a_null_point_is_refused_not_answered_at_the_head(audited: Audited, point: str) -> None:
    """Found by schemathesis (negative data accepted): `?at_step=null` was converted to None, as if
    absent, and answered 200 at the head; the API's own rule is that a malformed point must never
    silently answer at the head. Now it is a 422 naming the parameter."""
    pool, block = audited.story.a_block.pool_id, audited.story.a_block.block_id
    with asgi.get_client(APP) as client:  # type: ignore[arg-type]  # Starlette takes a wider scope type
        answer = client.get(
            f"{MOUNT}/block/{pool}/{block}?engine=pod-a&{point}=null", headers={"Authorization": f"Bearer {OPERATOR}"}
        )
    assert answer.status_code == 422 and answer.json()["parameter"] == point, answer.text


@pytest.mark.parametrize(("operation", "parameter"), [("block", "at_time"), ("refusals", "since_time")])
def test_the_schema_says_the_range_of_a_time_in_seconds(audited: Audited, operation: str, parameter: str) -> None:
    """Found by schemathesis (schema-valid request rejected): the schema let a time in seconds be
    any number, and the API refuses one outside years 1..9999 (422: no datetime shows it). Now the
    schema says the range the API takes."""
    [path] = [path for path, item in schema.raw_schema["paths"].items() if item["get"]["operationId"] == operation]
    [declared] = [p for p in schema.raw_schema["paths"][path]["get"]["parameters"] if p["name"] == parameter]
    seconds = next(branch for branch in declared["schema"]["anyOf"] if branch["type"] == "number")
    assert (seconds["minimum"], seconds["maximum"]) == (EARLIEST, LATEST)
    query = f"?{parameter}={LATEST + 1}" + ("&engine=pod-a" if operation == "block" else "")
    with asgi.get_client(APP) as client:  # type: ignore[arg-type]  # Starlette takes a wider scope type
        answer = client.get(
            path.replace("{pool}", "0").replace("{block}", "1") + query, headers={"Authorization": f"Bearer {OPERATOR}"}
        )
    assert answer.status_code == 422 and answer.json()["parameter"] == parameter, answer.text
