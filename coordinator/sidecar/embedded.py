"""A sidecar inside this process, on a real socket: what the simulator and the tests drive."""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anyio

from coordinator.core.protections import Protection
from coordinator.ledger.ledger import Ledger
from coordinator.sidecar.config import ServeConfig, Service
from coordinator.sidecar.server import Sidecar
from events.log import EventLog


@asynccontextmanager
async def embedded_sidecar(
    event_log: EventLog,
    socket_path: Path,
    *,
    protections_off: frozenset[Protection] = frozenset(),
    services: Sequence[Service] = (),
    **options: Any,
) -> AsyncIterator[Sidecar]:
    """A sidecar serving `event_log` on `socket_path` (running `services` beside), stopped
    (drained, snapshotted) after."""
    ledger = await Ledger.open(event_log, protections_off=protections_off)
    sidecar = Sidecar(ledger, ServeConfig(socket_path=str(socket_path), **options), services)
    async with anyio.create_task_group() as tg:
        await tg.start(sidecar.serve)
        try:
            yield sidecar
        finally:
            sidecar.stop()
