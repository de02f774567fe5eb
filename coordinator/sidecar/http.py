"""The sidecar's HTTP side, an ASGI app (Starlette): /metrics, /healthz, /readyz, and the audit
API under /audit/ (coordinator/audit/api.py).

/healthz answers 200 while the process serves at all (liveness); /readyz answers 200 only while
the sidecar takes steps and the log takes appends, else 503 with the reason (readiness).
Nothing here changes state (the audit API brings its index, a projection, up to the log).
"""

from __future__ import annotations

import hmac
from collections.abc import Callable
from pathlib import Path

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import BaseRoute, Route

from coordinator.audit.api import AuditMount, audit_app, load_tokens
from coordinator.ledger.ledger import Ledger
from events.log import SqlEventLog


def make_app(
    ledger: Ledger,
    registry: CollectorRegistry,
    readiness: Callable[[], tuple[bool, str]],
    *,
    metrics_token: str = "",
    audit_tokens: str | None = None,
) -> Starlette:
    """/metrics (`registry`, read from the committed state; a bearer `metrics_token` if given),
    /healthz, /readyz (`readiness`), and the HTTP audit API where the log is a SQL one."""
    expected = metrics_token.encode()

    async def metrics(request: Request) -> Response:
        if expected:
            given = request.headers.get("authorization", "")
            scheme, _, token = given.partition(" ")
            if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), expected):
                # The token itself is never logged, nor echoed.
                return JSONResponse(
                    {"error": "unauthorized", "detail": "/metrics needs its bearer token"},
                    status_code=401,
                    headers={"WWW-Authenticate": "Bearer"},
                )
        # The gauges are read from the state at scrape time: from the committed state, so a group
        # still being appended (which may yet fail) never shows in them.
        async with ledger.committed():
            body = generate_latest(registry)
        return Response(body, media_type=CONTENT_TYPE_LATEST)

    async def healthz(_: Request) -> Response:
        return JSONResponse({"alive": True, "global_seq": ledger.last_seq})

    async def readyz(_: Request) -> Response:
        ready, reason = readiness()
        return JSONResponse({"ready": ready, "reason": reason}, status_code=200 if ready else 503)

    routes: list[BaseRoute] = [
        Route("/metrics", metrics, methods=["GET"]),
        Route("/healthz", healthz, methods=["GET"]),
        Route("/readyz", readyz, methods=["GET"]),
    ]
    if isinstance(ledger.log, SqlEventLog):  # the audit index lives in a SQL log's database
        # Read once, at start (check_config has validated it): rotating tokens is a restart.
        routes.append(AuditMount(audit_app(ledger.log, load_tokens(Path(audit_tokens)) if audit_tokens else None)))
    return Starlette(routes=routes)
