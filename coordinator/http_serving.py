"""Serving an ASGI app over HTTP, as the sidecar (/metrics, probes, the audit API) and the fleet
service do: uvicorn on a socket bound here, so the bound port is known before it serves and a
taken port is an OSError at start, not a log line."""

from __future__ import annotations

import contextlib
import socket
from collections.abc import Iterator

import uvicorn
from starlette.types import ASGIApp


def is_loopback(host: str) -> bool:
    """Whether a listening address is this machine's own (--http and --tcp refuse any other
    without --allow-remote)."""
    return host in ("localhost", "::1") or host.startswith("127.")


def listen(host: str, port: int) -> socket.socket:
    """A listening, non-blocking TCP socket on (host, port); port 0 takes a free one. Raises
    OSError when it cannot bind."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(128)
    except OSError:
        sock.close()
        raise
    sock.setblocking(False)
    return sock


class _HttpServer(uvicorn.Server):
    """uvicorn, minus its signal handlers: the sidecar and the fleet service handle SIGTERM
    themselves (and drain)."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


async def serve_http(app: ASGIApp, sock: socket.socket) -> None:
    """Serve `app` on `sock` (from `listen`) until cancelled; the socket is closed after."""
    server = _HttpServer(uvicorn.Config(app, log_config=None, access_log=False, lifespan="off"))
    try:
        await server.serve(sockets=[sock])
    finally:
        sock.close()
