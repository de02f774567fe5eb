"""The read-only HTTP audit API: the audit queries (queries.py) as JSON under /audit/ on the
sidecar's HTTP side, behind bearer tokens each scoped to one tenant, or to all (DESIGN.md,
"Interfaces"; I9 for audit reads).

    GET /audit/block/{pool}/{block}?engine=&at_seq=|at_step=|at_time=   BlockAnswer
    GET /audit/history/{pool}/{block}?engine=                            HistoryAnswer
    GET /audit/key/{key}                                                 KeyAnswer
    GET /audit/request/{req_id}                                          RequestAnswer
    GET /audit/refusals?since_seq=&since_time=&limit=                    [RefusalEntry]
    GET /audit/namespaces                                                [NamespaceEntry]
    GET /audit/openapi.json                                              this API's OpenAPI 3.1 schema

Only GET: any other method (HEAD too) answers 405. Nothing here writes, except that a query first
brings the audit index (a projection of the log) up to the log's head.

Tokens come from a file (`load_tokens`) mapping each token to {"tenant": NAME}, or to
{"tenant": "*"} for an operator who reads every tenant. A sidecar without a tokens file still
mounts the routes, and they answer 401 to everything: the API is there and says why it is shut,
rather than missing (a client would take a 404 for an older sidecar). The schema needs no token:
it describes the API and holds no data.

Statuses: 401 a missing or wrong token (with WWW-Authenticate: Bearer), checked before anything
else; 422 a malformed parameter, named in the body; 404 an unknown engine, key or request, and
another tenant's, with the same body (I9: a 403 told a tenant that another tenant had computed a
key); 503 the index could not catch up. An error body (`ErrorBody`) holds a code,
the parameter at fault and what the caller sent, never data of the log.

Freshness: every query first catches the index up to the log's head at that moment
(store.sync_index: exactly once, safe against other indexers), one catch-up at a time in this
process, in transactions of `CATCH_UP_BATCH` events. The event loop is the committer's too, and it
runs steps between batches: catching up an 88,000-event backlog took about 4 s, and the loop's
longest stall was 12-18 ms (up to 90 ms while other work loaded the machine; with 2,000-event
batches, 60-180 ms). A background catch-up task was the other choice: it would write the index at
every step even when nobody audits, on the loop and under the SQLite write lock appends need.
"""

from __future__ import annotations

import re
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import NoneType, UnionType
from typing import Annotated, Any, TypeVar, Union, get_args, get_origin

import anyio
import msgspec
import structlog
from msgspec import Meta
from sqlalchemy.exc import SQLAlchemyError
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Mount, Route
from starlette.types import ASGIApp

from coordinator.audit.answers import (
    AuditError,
    BlockAnswer,
    HistoryAnswer,
    KeyAnswer,
    NamespaceEntry,
    NotFound,
    OutOfScope,
    RefusalEntry,
    RequestAnswer,
)
from coordinator.audit.queries import Audit, parse_time
from coordinator.audit.store import sync_index
from coordinator.audit.times import EARLIEST, LATEST, RANGE, time_problem
from coordinator.tokens import TokenFileError as TokenFileError
from coordinator.tokens import TokenMatcher, check_token, read_file, warn_if_readable
from events.log import LogError, SqlEventLog

log = structlog.get_logger("kvledger.audit.api")

MOUNT = "/audit"
"""Where the sidecar's app mounts this one (coordinator/sidecar/http.py)."""
OPERATOR = "*"
"""The tenant of a token that reads every tenant."""
CATCH_UP_BATCH = 500
"""Events per index transaction when a query catches the index up (see the module's docstring)."""
REALM = "kvledger-audit"
INDEXED_SEQ_HEADER = "Kvledger-Indexed-Seq"
"""On every answer: the global sequence the index held when it answered."""
JSON = "application/json"
_MAX_INT = 2**63 - 1  # a BIGINT column: anything larger is not in the log, and SQL would overflow
_MAX_SLOT = 2**31 - 1  # pools and blocks are INTEGER columns (PostgreSQL would refuse a larger one)
_PRINTABLE = r"^(?![\s\S]*[\x00-\x1f\x7f-\x9f])"
"""No control character anywhere (PostgreSQL's text cannot hold NUL, and none is a name). A
lookahead, since `$` lets a trailing newline through (and JSON Schema's regexes have no `\\Z`)."""
_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]")


# --- tokens -------------------------------------------------------------------------------------


class Grant(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """What one token may read."""

    tenant: Annotated[str, Meta(min_length=1)]
    """The tenant whose data the token reads, or "*": an operator, who reads every tenant's."""
    name: str = ""
    """Who holds the token, for the log lines (a token itself is never logged)."""

    @property
    def scope(self) -> str | None:
        """The `tenant=` of the Audit this token reads through (None: every tenant)."""
        return None if self.tenant == OPERATOR else self.tenant


class Tokens(TokenMatcher[Grant]):
    """The audit API's tokens and their grants (coordinator/tokens.py matches them)."""

    def __init__(self, grants: Mapping[str, Grant]) -> None:
        super().__init__(grants.items())


def load_tokens(path: Path) -> Tokens:
    """The tokens file: a JSON object or a TOML table mapping each token to {"tenant": NAME}
    (NAME "*": an operator) and optionally "name" (who holds it, for the logs)."""
    raw, mode = read_file(path, "--audit-tokens")
    try:
        grants = msgspec.convert(raw, dict[str, Grant])
    except msgspec.ValidationError as error:  # its path shows a token as `[...]`
        raise TokenFileError(f'--audit-tokens {path}: {error} (each token maps to {{"tenant": NAME or "*"}})') from None
    if not grants:
        raise TokenFileError(f"--audit-tokens {path} names no token")
    for position, token in enumerate(grants, 1):
        check_token(token, path=path, option="--audit-tokens", position=position)
    warn_if_readable(path, mode, "--audit-tokens")
    return Tokens(grants)


# --- errors -------------------------------------------------------------------------------------


class ErrorBody(msgspec.Struct, frozen=True, kw_only=True):
    """The body of every error: what went wrong, never data of the log."""

    error: str
    """unauthorized, not_found, invalid_parameter, method_not_allowed, unavailable or internal."""
    detail: str
    parameter: str | None = None
    """The path or query parameter at fault (422); several are comma-separated."""


class ApiError(Exception):
    def __init__(
        self, status: int, error: str, detail: str, *, parameter: str | None = None, headers: Mapping[str, str] | None = None
    ) -> None:
        super().__init__(detail)
        self.status = status
        self.body = ErrorBody(error=error, detail=detail, parameter=parameter)
        self.headers = dict(headers or {})

    def response(self) -> Response:
        return _json(self.body, self.status, self.headers)


def invalid(parameter: str, detail: str) -> ApiError:
    return ApiError(422, "invalid_parameter", detail, parameter=parameter)


def _json(value: object, status: int = 200, headers: Mapping[str, str] | None = None) -> Response:
    # Audit answers are one tenant's secrets: no cache keeps them.
    return Response(
        msgspec.json.encode(value), status_code=status, media_type=JSON, headers={"Cache-Control": "no-store", **(headers or {})}
    )


# --- parameters ---------------------------------------------------------------------------------
# Each route's path and query parameters are one Struct: it validates them (`parse`) and is what
# the OpenAPI schema describes (`openapi`), so the two cannot disagree.

Moment = (
    Annotated[float, Meta(ge=EARLIEST, le=LATEST)]
    | Annotated[str, Meta(min_length=1, max_length=64, extra_json_schema={"format": "date-time"})]
)
"""Seconds since the epoch, or an ISO 8601 time (UTC when it names no zone), years 1..9999 (times.py).
The schema says the range of seconds too: schemathesis found it promised any number."""
EngineName = Annotated[
    str,
    Meta(
        min_length=1,
        max_length=256,
        pattern=_PRINTABLE,
        description="The engine (default: the only one the token may read; a 422 when it may read several).",
    ),
]


class Params(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    def check(self) -> None:
        """What no single parameter's type says (raises ApiError)."""


class SlotParams(Params, kw_only=True):
    pool: Annotated[int, Meta(ge=0, le=_MAX_SLOT, description="The pool id.")]
    block: Annotated[int, Meta(ge=0, le=_MAX_SLOT, description="The block id in that pool.")]
    engine: EngineName | None = None


_ONE_POINT = " At most one of at_seq, at_step and at_time (a 422 otherwise: no schema relates two parameters)."


class BlockParams(SlotParams, kw_only=True):
    at_seq: (
        Annotated[int, Meta(ge=0, le=_MAX_INT, description="The point: a global sequence (default: the head)." + _ONE_POINT)]
        | None
    ) = None
    at_step: (
        Annotated[int, Meta(ge=0, le=_MAX_INT, description="The point: the end of that step of the engine." + _ONE_POINT)] | None
    ) = None
    at_time: (
        Annotated[Moment, Meta(description="The point: the last step recorded by then (epoch seconds or ISO 8601)." + _ONE_POINT)]
        | None
    ) = None

    def check(self) -> None:
        given = [name for name in ("at_seq", "at_step", "at_time") if getattr(self, name) is not None]
        if len(given) > 1:
            raise invalid(",".join(given), "give at most one of at_seq, at_step and at_time")
        if self.at_time is not None:
            seconds(self.at_time, "at_time")


class KeyParams(Params, kw_only=True):
    key: Annotated[str, Meta(pattern="^(?:[0-9a-fA-F]{2}){1,64}$", description="The content key, in hex.")]


class RequestParams(Params, kw_only=True):
    req_id: Annotated[
        str, Meta(min_length=1, max_length=1024, pattern=_PRINTABLE, description="The request id (every owner that used it).")
    ]


class RefusalParams(Params, kw_only=True):
    since_seq: Annotated[int, Meta(ge=0, le=_MAX_INT, description="Only refusals after this global sequence.")] = 0
    since_time: (
        Annotated[Moment, Meta(description="Only refusals recorded at or after this time (epoch seconds or ISO 8601).")] | None
    ) = None
    limit: Annotated[int, Meta(ge=1, le=10_000, description="At most this many, oldest first.")] = 1000

    def check(self) -> None:
        if self.since_time is not None:
            seconds(self.since_time, "since_time")


class NoParams(Params, kw_only=True):
    pass


def seconds(moment: float | str, parameter: str) -> float:
    """A Moment as epoch seconds. Every RFC 3339 date-time (what the schema promises) parses:
    its lower-case t and z, and a leap second (read as the second before it: fromisoformat
    refuses :60), besides what parse_time takes."""
    try:
        if isinstance(moment, str):
            moment = re.sub(r"(T\d\d:\d\d):60", r"\1:59", moment.strip().upper())
        value = moment if isinstance(moment, float) else parse_time(moment)
    except AuditError:
        raise invalid(parameter, "expected seconds since the epoch or an ISO 8601 time") from None
    except (ValueError, OverflowError):  # a zone offset that takes the time past year 1 or 9999
        raise invalid(parameter, f"expected a time between {RANGE}") from None
    # Years 1..9999 only: no log holds a step outside them, and a datetime can show any time inside.
    problem = time_problem(value)
    if problem is not None:
        raise invalid(parameter, problem)
    return value


P = TypeVar("P", bound=Params)


def parse(model: type[P], request: Request) -> P:
    """The route's parameters, each converted to its field's type, or ApiError 422 naming the
    first one at fault. Unknown and repeated parameters are refused: a misspelt `at-seq` must
    not silently answer at the head."""
    fields = {field.name: field for field in msgspec.structs.fields(model)}
    raw: dict[str, str] = {name: str(value) for name, value in request.path_params.items()}
    for name, value in request.query_params.multi_items():
        if name not in fields:
            raise invalid(name, f"unknown parameter; this route takes {', '.join(fields) or 'none'}")
        if name in raw:
            raise invalid(name, "given more than once")
        raw[name] = value
    for name, value in raw.items():
        if _CONTROL.search(value):  # no parameter holds one (the names' schemas say so: _PRINTABLE)
            raise invalid(name, "expected no control characters")
    if _CONTROL.search(request.scope["path"]):  # a trailing newline, which the route's `$` kept out of its last parameter
        raise invalid(list(request.path_params)[-1] if request.path_params else "path", "expected no control characters")
    values = {}
    for name, value in raw.items():
        try:
            values[name] = msgspec.convert(value, _given(fields[name].type), strict=False)
        except msgspec.ValidationError as error:
            raise invalid(name, str(error)) from None
    params = model(**values)
    params.check()
    return params


def _given(annotation: Any) -> Any:
    """The type of a parameter that was given: an optional one is absent or a value, never null.
    Converted to `int | None`, `?at_seq=null` became None and was answered at the head, as if
    absent (found by schemathesis); an engine named "null" is a name."""
    if get_origin(annotation) in (Union, UnionType):
        present = [arg for arg in get_args(annotation) if arg is not NoneType]
        if len(present) == 1:
            return present[0]
    return annotation


# --- the queries --------------------------------------------------------------------------------


async def _engine(audit: Audit, engine: str | None) -> str:
    """The engine named, or the caller's only one (Audit.engine: another tenant's engine is out
    of scope, and messages list only the caller's engines)."""
    try:
        return await audit.engine(engine)
    except (NotFound, OutOfScope):
        raise
    except AuditError:  # several engines: error bodies echo only what the caller sent
        raise invalid("engine", "the log has several engines: name one") from None


async def _block(audit: Audit, params: BlockParams) -> BlockAnswer:
    engine = await _engine(audit, params.engine)
    at_time = None if params.at_time is None else seconds(params.at_time, "at_time")
    try:
        seq = await audit.resolve(engine, at_seq=params.at_seq, at_step=params.at_step, at_time=at_time)
    except NotFound:
        raise ApiError(
            404,
            "not_found",
            f"engine {engine!r} has no such step"
            if params.at_step is not None
            else "nothing was recorded at or before that time",
        ) from None
    return await audit.block(engine, params.pool, params.block, seq)


async def _history(audit: Audit, params: SlotParams) -> HistoryAnswer:
    return await audit.history(await _engine(audit, params.engine), params.pool, params.block)


async def _key(audit: Audit, params: KeyParams) -> KeyAnswer:
    return await audit.key(params.key.lower())


async def _request(audit: Audit, params: RequestParams) -> RequestAnswer:
    return await audit.request(params.req_id)


async def _refusals(audit: Audit, params: RefusalParams) -> list[RefusalEntry]:
    since_time = None if params.since_time is None else seconds(params.since_time, "since_time")
    return await audit.refusals(since_seq=params.since_seq, since_time=since_time, limit=params.limit)


async def _namespaces(audit: Audit, _: NoParams) -> list[NamespaceEntry]:
    return await audit.namespaces(now=time.time())


@dataclass(frozen=True)
class Operation:
    """One route: what serves it and what the schema says of it."""

    path: str
    """Under MOUNT, in Starlette's syntax."""
    operation_id: str
    summary: str
    params: type[Params]
    answer: Any
    """The answer's type (its JSON schema is the 200 response's)."""
    run: Callable[[Audit, Any], Awaitable[Any]]
    not_found: str = ""
    """The 404 detail, formatted with the parameters; empty: the route has no 404 of its own."""
    scoped: bool = False
    """Whether the route names something of one tenant (another tenant's reads as absent: 404)."""


OPERATIONS = (
    Operation(
        "/block/{pool}/{block}",
        "block",
        "Who held a block at a point in time: its generation, owner, jobs and every event of that generation.",
        BlockParams,
        BlockAnswer,
        _block,
        "the engine, step or time is not in the log",
        scoped=True,
    ),
    Operation(
        "/history/{pool}/{block}",
        "history",
        "Every generation of a block: who allocated it, when, and how it ended.",
        SlotParams,
        HistoryAnswer,
        _history,
        "the engine is not in the log",
        scoped=True,
    ),
    Operation(
        "/key/{key}",
        "key",
        "A content key: where it was computed, each publication, load, eviction and quarantine.",
        KeyParams,
        KeyAnswer,
        _key,
        "key {key} is not in the log",
        scoped=True,
    ),
    Operation(
        "/request/{req_id:path}",
        "request",
        "A request id: every owner (lifetime) that carried it, and its blocks.",
        RequestParams,
        RequestAnswer,
        _request,
        "request {req_id!r} is not in the log",
        scoped=True,
    ),
    Operation(
        "/refusals",
        "refusals",
        "Refused commands, dropped notices, failed jobs and quarantined keys, oldest first.",
        RefusalParams,
        list[RefusalEntry],
        _refusals,
    ),
    Operation(
        "/namespaces",
        "namespaces",
        "Each namespace: its live keys, their bytes, first publication and last use.",
        NoParams,
        list[NamespaceEntry],
        _namespaces,
    ),
)


# --- the app ------------------------------------------------------------------------------------


class AuditApi:
    def __init__(self, event_log: SqlEventLog, tokens: Tokens | None, *, batch: int = CATCH_UP_BATCH) -> None:
        self.event_log = event_log
        self.tokens = tokens
        self.batch = batch
        self._catching_up = anyio.Lock()
        self.schema = msgspec.json.encode(openapi(OPERATIONS))

    def authorize(self, request: Request) -> Grant:
        scheme, _, presented = request.headers.get("authorization", "").partition(" ")
        presented = presented.strip()
        if self.tokens is None:
            reason, detail = "no_tokens", "this sidecar has no audit tokens (kvledger serve --audit-tokens FILE)"
        elif not presented or scheme.lower() != "bearer":
            reason, detail = "missing", "send Authorization: Bearer <token>"
        else:
            grant = self.tokens.match(presented)
            if grant is not None:
                return grant
            reason, detail = "wrong", "the token is not valid"
        log.warning(
            "audit_unauthorized", reason=reason, path=request.url.path, peer=request.client.host if request.client else None
        )
        challenge = f'Bearer realm="{REALM}"' + (', error="invalid_token"' if reason == "wrong" else "")
        raise ApiError(401, "unauthorized", detail, headers={"WWW-Authenticate": challenge})

    async def catch_up(self) -> int:
        """Bring the index to the log's head now (one catch-up at a time: others wait, then find
        it done); returns the sequence it holds."""
        try:
            async with self._catching_up:
                return await sync_index(self.event_log, batch=self.batch)
        except (SQLAlchemyError, LogError, OSError) as error:
            log.error("audit_catch_up_failed", error=f"{type(error).__name__}: {error}")
            raise ApiError(
                503, "unavailable", "the audit index could not catch up with the log; retry", headers={"Retry-After": "1"}
            ) from None

    def endpoint(self, operation: Operation) -> Callable[[Request], Awaitable[Response]]:
        async def answer(request: Request) -> Response:
            grant: Grant | None = None
            try:
                grant = self.authorize(request)
                params = parse(operation.params, request)
                indexed = await self.catch_up()
                try:
                    result = await operation.run(Audit(self.event_log, tenant=grant.scope), params)
                except (OutOfScope, NotFound):
                    # Another tenant's engine, key or request reads exactly as an absent one: a
                    # 403 told a tenant that another tenant computed a key (I9: no metadata either).
                    raise ApiError(404, "not_found", operation.not_found.format(**msgspec.structs.asdict(params))) from None
                except AuditError:  # every case is refused above as a 422 or a 404; kept as a backstop
                    raise ApiError(422, "invalid_parameter", "the index cannot answer this query as asked") from None
            except ApiError as error:
                if error.status != 401:
                    log.info(
                        "audit_read",
                        operation=operation.operation_id,
                        status=error.status,
                        error=error.body.error,
                        tenant=grant.tenant if grant else None,
                        holder=grant.name if grant else None,
                    )
                return error.response()
            except Exception as error:  # noqa: BLE001 - answer 500, never a traceback; the log keeps it
                log.exception("audit_query_failed", operation=operation.operation_id, error=f"{type(error).__name__}: {error}")
                return ApiError(500, "internal", "the query failed; the sidecar's log says why").response()
            log.info(
                "audit_read",
                operation=operation.operation_id,
                status=200,
                tenant=grant.tenant,
                holder=grant.name,
                indexed_seq=indexed,
            )
            return _json(result, headers={INDEXED_SEQ_HEADER: str(indexed)})

        return answer

    async def openapi_json(self, _: Request) -> Response:
        return Response(self.schema, media_type=JSON)

    def app(self) -> Starlette:
        routes = [Route(operation.path, self.endpoint(operation), methods=["GET"]) for operation in OPERATIONS]
        routes.append(Route("/openapi.json", self.openapi_json, methods=["GET"]))
        for route in routes:
            route.methods = {"GET"}  # Starlette adds HEAD to GET; this API answers GET only
        return Starlette(routes=routes, exception_handlers={HTTPException: _http_error})


async def _http_error(_: Request, error: Exception) -> Response:
    """Starlette's own 404 (no such route) and 405 (not GET), as JSON like every other error."""
    assert isinstance(error, HTTPException)
    code = {404: "not_found", 405: "method_not_allowed"}.get(error.status_code, "invalid_request")
    return ApiError(error.status_code, code, error.detail, headers=error.headers).response()


def audit_app(event_log: SqlEventLog, tokens: Tokens | None, *, batch: int = CATCH_UP_BATCH) -> Starlette:
    """The API as an ASGI app, to mount at MOUNT (`AuditMount`). `tokens` None: every query answers 401."""
    return AuditApi(event_log, tokens, batch=batch).app()


class AuditMount(Mount):
    """An app (the API) at MOUNT, for every path under it. Starlette's Mount matches `.*` after its
    prefix, and `.` stops at a newline: /audit/block/a%0Ab/1 fell through to the enclosing app's
    plain-text 404, never reaching `parse` and its JSON 422 (found by schemathesis)."""

    def __init__(self, app: ASGIApp) -> None:
        super().__init__(MOUNT, app=app)
        self.path_regex = re.compile(self.path_regex.pattern, re.DOTALL)


# --- the OpenAPI schema -------------------------------------------------------------------------


def openapi(operations: Sequence[Operation]) -> dict[str, Any]:
    """OpenAPI 3.1 for `operations` under MOUNT: parameters from each route's Params, answers
    and errors from their msgspec types."""
    answers, components = msgspec.json.schema_components(
        [*(operation.answer for operation in operations), ErrorBody], ref_template="#/components/schemas/{name}"
    )
    error_schema = answers[-1]

    def error(description: str, headers: dict[str, Any] | None = None) -> dict[str, Any]:
        response: dict[str, Any] = {"description": description, "content": {JSON: {"schema": error_schema}}}
        if headers:
            response["headers"] = headers
        return response

    paths: dict[str, Any] = {}
    for operation, answer in zip(operations, answers, strict=False):
        responses: dict[str, Any] = {
            "200": {
                "description": "The answer.",
                "content": {JSON: {"schema": answer}},
                "headers": {
                    INDEXED_SEQ_HEADER: {
                        "description": "The global sequence the index held when it answered.",
                        "required": True,
                        "schema": {"type": "integer", "minimum": 0},
                    }
                },
            },
            "401": error(
                "No token, a wrong one, or no tokens configured.",
                {"WWW-Authenticate": {"required": True, "schema": {"type": "string"}}},
            ),
            "422": error("A malformed parameter; `parameter` names it."),
            "503": error(
                "The audit index could not catch up with the log; retry.",
                {"Retry-After": {"required": True, "schema": {"type": "integer"}}},
            ),
        }
        if operation.not_found:
            responses["404"] = error(
                "Not in the log (an engine, step, time, key or request), or another tenant's: the two read alike."
            )
        paths[MOUNT + re.sub(r"\{(\w+):\w+\}", r"{\1}", operation.path)] = {
            "get": {
                "operationId": operation.operation_id,
                "summary": operation.summary,
                "parameters": _parameters(operation),
                "responses": dict(sorted(responses.items())),
            }
        }
    paths[MOUNT + "/openapi.json"] = {
        "get": {
            "operationId": "openapi",
            "summary": "This schema.",
            "security": [],
            "responses": {"200": {"description": "OpenAPI 3.1.", "content": {JSON: {"schema": {"type": "object"}}}}},
        }
    }
    return {
        "openapi": "3.1.0",
        "info": {
            "title": "kvledger audit API",
            "version": "1",
            "description": "Read-only forensics over the sidecar's log; every answer is scoped to the token's tenant.",
        },
        "paths": paths,
        "components": {
            "schemas": components,
            "securitySchemes": {
                "bearer": {
                    "type": "http",
                    "scheme": "bearer",
                    "description": 'A token from the sidecar\'s --audit-tokens file; it reads one tenant, or all for "*".',
                }
            },
        },
        "security": [{"bearer": []}],
    }


def _parameters(operation: Operation) -> list[dict[str, Any]]:
    parameters = []
    for field in msgspec.structs.fields(operation.params):
        schema = _without_null(msgspec.json.schema(field.type))
        where = "path" if re.search(r"\{" + field.name + r"[}:]", operation.path) else "query"
        parameter: dict[str, Any] = {"name": field.name, "in": where, "required": where == "path"}
        description = schema.pop("description", None)
        if description:
            parameter["description"] = description
        if field.default is not msgspec.NODEFAULT and field.default is not None:
            schema["default"] = field.default
        parameter["schema"] = schema
        parameters.append(parameter)
    return parameters


def _without_null(schema: dict[str, Any]) -> dict[str, Any]:
    """An optional parameter is absent, never null: drop the null branch of `X | None`."""
    branches = schema.get("anyOf")
    if branches is None or {"type": "null"} not in branches:
        return schema
    rest = [branch for branch in branches if branch != {"type": "null"}]
    others = {name: value for name, value in schema.items() if name != "anyOf"}
    return {**others, **rest[0]} if len(rest) == 1 else {**others, "anyOf": rest}
