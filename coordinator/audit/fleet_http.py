"""The fleet audit service's HTTP side (`kvledger fleet --http HOST:PORT`): the audit API under
/audit/ for the whole fleet, with /healthz, /readyz and /metrics, as the sidecar serves them.

The service reopens its Kafka log after an outage (coordinator/audit/fleet.py), so the audit API is
bound to whichever log is open at the moment of the request: while none is (the broker or the
audit database is down), /audit/... answers 503 with the reason, and /readyz says the same.

Readiness: ready while the log is open and the last pass over the topic succeeded; the reason
otherwise ("starting", "the log is unavailable: ...", "the audit database failed: ...",
"shutting down"). Being behind the topic's head is not unready (a catch-up after a restart is
normal work); `kvledger_fleet_behind_events` shows how far.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, generate_latest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from coordinator.audit.api import AuditMount, Tokens, audit_app
from events.log import SqlEventLog


@dataclass
class FleetHealth:
    """What the service knows of itself; run_fleet writes it, the HTTP side reads it."""

    log: SqlEventLog | None = None
    problem: str | None = "starting"
    indexed_seq: int = 0
    head: int = 0
    registry: CollectorRegistry = field(default_factory=CollectorRegistry)

    def __post_init__(self) -> None:
        self._indexed = Gauge("kvledger_fleet_indexed_seq", "The global sequence the audit index holds.", registry=self.registry)
        self._head = Gauge("kvledger_fleet_log_head_seq", "The topic's head, as last seen.", registry=self.registry)
        self._behind = Gauge(
            "kvledger_fleet_behind_events", "Events on the topic not yet in the audit index.", registry=self.registry
        )
        self._ready = Gauge("kvledger_fleet_ready", "1 while the service is ready (see /readyz).", registry=self.registry)
        self._outages = Counter(
            "kvledger_fleet_outages", "Outages the service retried, by what failed.", ["what"], registry=self.registry
        )

    def progressed(self, indexed_seq: int, head: int) -> None:
        self.indexed_seq, self.head = indexed_seq, max(head, indexed_seq)
        self._indexed.set(self.indexed_seq)
        self._head.set(self.head)
        self._behind.set(self.head - self.indexed_seq)

    def serving(self, event_log: SqlEventLog) -> None:
        self.log, self.problem = event_log, None
        self._ready.set(1)

    def failed(self, what: str, reason: str) -> None:
        """An outage of `what` ("log": the broker or the state store on opening; "database": the
        audit database while indexing): the log is closed until it reopens."""
        self.log, self.problem = None, reason
        self._ready.set(0)
        self._outages.labels(what=what).inc()

    def stopping(self) -> None:
        self.problem = "shutting down"
        self._ready.set(0)

    def readiness(self) -> tuple[bool, str]:
        return (self.problem is None, self.problem or "ready")


class _CurrentLogAudit:
    """An ASGI app: the audit API on the log open now (rebuilt when the service reopens it), or
    a 503 saying why there is none."""

    def __init__(self, health: FleetHealth, tokens: Tokens | None) -> None:
        self.health = health
        self.tokens = tokens
        self._bound: tuple[SqlEventLog, Any] | None = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        event_log = self.health.log
        if event_log is None:
            # No reason here: this answers before any token is checked (the reason, which may name
            # the backend, is on /readyz for whoever operates the service).
            response = JSONResponse(
                {
                    "error": "unavailable",
                    "parameter": None,
                    "detail": "the fleet service has no open log now (see /readyz); retry",
                },
                status_code=503,
                headers={"Retry-After": "1"},
            )
            await response(scope, receive, send)
            return
        if self._bound is None or self._bound[0] is not event_log:
            self._bound = (event_log, audit_app(event_log, self.tokens))
        await self._bound[1](scope, receive, send)


def fleet_app(health: FleetHealth, tokens: Tokens | None) -> Starlette:
    async def metrics(_: Request) -> Response:
        return Response(generate_latest(health.registry), media_type=CONTENT_TYPE_LATEST)

    async def healthz(_: Request) -> Response:
        return JSONResponse({"alive": True, "indexed_seq": health.indexed_seq})

    async def readyz(_: Request) -> Response:
        ready, reason = health.readiness()
        return JSONResponse(
            {"ready": ready, "reason": reason, "indexed_seq": health.indexed_seq, "head": health.head},
            status_code=200 if ready else 503,
        )

    return Starlette(
        routes=[
            Route("/metrics", metrics, methods=["GET"]),
            Route("/healthz", healthz, methods=["GET"]),
            Route("/readyz", readyz, methods=["GET"]),
            AuditMount(_CurrentLogAudit(health, tokens)),
        ]
    )
