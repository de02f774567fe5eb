"""The sidecar's HTTP side, an ASGI app (Starlette): /metrics, /healthz, /readyz, and the audit
API under /audit/ (coordinator/audit/api.py).

/healthz answers 200 while the process serves at all (liveness); /readyz answers 200 only while
the sidecar takes steps and the log takes appends, else 503 with the reason (readiness).
Nothing here changes state (the audit API brings its index, a projection, up to the log).
"""

from __future__ import annotations

import hmac
from pathlib import Path
from typing import TYPE_CHECKING

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import BaseRoute, Route

from coordinator.audit.api import AuditMount, audit_app, load_tokens
from events.log import SqlEventLog

if TYPE_CHECKING:
    from coordinator.sidecar.server import Sidecar


def make_app(sidecar: Sidecar) -> Starlette:
    expected = sidecar.config.metrics_token.encode()

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
        async with sidecar.ledger.committed():
            body = generate_latest(sidecar.metrics.registry)
        return Response(body, media_type=CONTENT_TYPE_LATEST)

    async def healthz(_: Request) -> Response:
        return JSONResponse({"alive": True, "global_seq": sidecar.ledger.last_seq})

    async def readyz(_: Request) -> Response:
        ready, reason = sidecar.readiness()
        return JSONResponse({"ready": ready, "reason": reason}, status_code=200 if ready else 503)

    routes: list[BaseRoute] = [
        Route("/metrics", metrics, methods=["GET"]),
        Route("/healthz", healthz, methods=["GET"]),
        Route("/readyz", readyz, methods=["GET"]),
    ]
    if isinstance(sidecar.ledger.log, SqlEventLog):  # the audit index lives in a SQL log's database
        # Read once, at start (check_config has validated it): rotating tokens is a restart.
        path = sidecar.config.audit_tokens
        routes.append(AuditMount(audit_app(sidecar.ledger.log, load_tokens(Path(path)) if path else None)))
    return Starlette(routes=routes)
