"""The sidecar's HTTP side, an ASGI app (Starlette): /metrics, /healthz, /readyz.

/healthz answers 200 while the process serves at all (liveness); /readyz answers 200 only while
the sidecar takes steps and the log takes appends, else 503 with the reason (readiness).
The audit API (issue 7) mounts here too. Nothing here changes state.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

if TYPE_CHECKING:
    from coordinator.sidecar.server import Sidecar


def make_app(sidecar: Sidecar) -> Starlette:
    async def metrics(_: Request) -> Response:
        return Response(generate_latest(sidecar.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    async def healthz(_: Request) -> Response:
        return JSONResponse({"alive": True, "global_seq": sidecar.ledger.last_seq})

    async def readyz(_: Request) -> Response:
        ready, reason = sidecar.readiness()
        return JSONResponse({"ready": ready, "reason": reason}, status_code=200 if ready else 503)

    return Starlette(routes=[
        Route("/metrics", metrics, methods=["GET"]),
        Route("/healthz", healthz, methods=["GET"]),
        Route("/readyz", readyz, methods=["GET"]),
    ])
