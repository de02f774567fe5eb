"""kvledger's coordinator: the pure core (coordinator.core), the ledger on the durable log
(coordinator.ledger), the sidecar and its clients, the audit, the vLLM glue, the simulator and the
CLI that composes them (README, "Layout").

The public surface below is imported on first use, so that importing the pure core loads no I/O
library (tests/core/test_purity.py)::

    from coordinator import Ledger, Sidecar, ServeConfig, EngineClient, WorkerClient
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from coordinator import _compiled

_compiled.install()  # before any module of the core is imported: a stale build never runs

if TYPE_CHECKING:
    from coordinator.client import (
        Address,
        EngineClient,
        OperatorClient,
        SidecarError,
        SidecarUnavailable,
        SyncEngineClient,
        SyncWorkerClient,
        WorkerClient,
    )
    from coordinator.core import CoordinatorCore
    from coordinator.ledger.ledger import Ledger
    from coordinator.sidecar.config import ServeConfig, Service
    from coordinator.sidecar.embedded import embedded_sidecar
    from coordinator.sidecar.server import Sidecar, run_sidecar

_PUBLIC = {
    "Address": "coordinator.client",
    "CoordinatorCore": "coordinator.core",
    "EngineClient": "coordinator.client",
    "Ledger": "coordinator.ledger.ledger",
    "OperatorClient": "coordinator.client",
    "ServeConfig": "coordinator.sidecar.config",
    "Service": "coordinator.sidecar.config",
    "Sidecar": "coordinator.sidecar.server",
    "SidecarError": "coordinator.client",
    "SidecarUnavailable": "coordinator.client",
    "SyncEngineClient": "coordinator.client",
    "SyncWorkerClient": "coordinator.client",
    "WorkerClient": "coordinator.client",
    "embedded_sidecar": "coordinator.sidecar.embedded",
    "run_sidecar": "coordinator.sidecar.server",
}

__all__ = [
    "Address",
    "CoordinatorCore",
    "EngineClient",
    "Ledger",
    "OperatorClient",
    "ServeConfig",
    "Service",
    "Sidecar",
    "SidecarError",
    "SidecarUnavailable",
    "SyncEngineClient",
    "SyncWorkerClient",
    "WorkerClient",
    "embedded_sidecar",
    "run_sidecar",
]


def __getattr__(name: str) -> Any:
    module = _PUBLIC.get(name)
    if module is None:
        raise AttributeError(f"module 'coordinator' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
