"""What `kvledger serve` is configured with (ServeConfig), what it refuses to start with
(ConfigError, check_config), and the services it can be handed (Service)."""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

import anyio
import anyio.abc
import msgspec

from coordinator.audit.api import load_tokens
from coordinator.http_serving import is_loopback
from coordinator.ledger.ledger import Ledger, SubmitAll
from coordinator.sidecar import admission
from coordinator.sidecar import protocol as p
from coordinator.sidecar.committer import APPENDS_IN_FLIGHT
from coordinator.sidecar.credentials import Credentials, load_credentials
from coordinator.sidecar.hub import DEFAULT_BUFFER
from coordinator.tokens import TokenFileError


class ServeConfig(msgspec.Struct, kw_only=True):
    log_url: str | None = None
    socket_path: str
    tcp: tuple[str, int] | None = None
    token: str = ""
    http: tuple[str, int] | None = None
    max_frame: int = p.MAX_REQUEST_FRAME
    subscriber_buffer: int = DEFAULT_BUFFER
    snapshot_every: int = 1000
    allow_remote: bool = False
    """Let --tcp/--http bind a non-loopback address (the operator asked for it explicitly)."""
    audit_tokens: str | None = None
    """The tokens file of the HTTP audit API (coordinator/audit/api.py); None: it answers 401."""
    frame_timeout: float = 30.0
    """Seconds a frame that has begun may take to arrive whole; then the connection is closed."""
    metrics_token: str = ""
    """A bearer token /metrics requires (empty: none; /healthz and /readyz never need one)."""
    max_tier_slots: int = admission.MAX_TIER_SLOTS
    """Tier slots all tiers together may hold (engines' declarations beyond it are refused)."""
    max_tiers: int = admission.MAX_TIERS
    max_pool_blocks: int = admission.MAX_POOL_BLOCKS
    """Blocks all engines' pools together may hold (a declaration beyond it is refused)."""
    max_owners_per_engine: int = admission.MAX_OWNERS_PER_ENGINE
    """Live owners one engine may hold (a step starting more is refused)."""
    free_errors: int = 10
    """Refusals (Error replies) per credential and second sent at once; each further one in the
    second waits ERROR_DELAY in the credential's turn (`Sidecar._slow_down`)."""
    credentials: str | None = None
    """The credentials file (coordinator/sidecar/credentials.py): who may take which role for which
    engines. None: the shared token (TCP) and the socket's owner may be anything."""
    socket_uids: list[int] = []
    """Unix uids, beside the sidecar's own (and the credentials file's), that may connect to the
    socket (SO_PEERCRED). Any of them makes the socket 0666: the kernel's peer uid is the check."""
    follow_seconds: float = 0.1
    """How often the sidecar folds what other writers (sidecars on the same log: the fleet case)
    appended into its state, so its lookups see their publications; 0: never (its own appends
    are safe either way: a group decided before another writer's append is decided again)."""
    appends_in_flight: int = APPENDS_IN_FLIGHT
    """Groups whose appends may travel at once on a log that takes several in flight (Kafka); a
    SQL log takes one at a time whatever this says (coordinator/sidecar/committer.py)."""
    metrics_engine_labels: bool = True
    """Label per-engine gauges with each engine id; False: one series, engine="all", for every engine
    (engine ids can name tenants, and /metrics is often scraped by a shared Prometheus)."""


class Service(Protocol):
    """A service the sidecar runs beside its connections, composed by its caller (the CLI hands it
    `serve --ingest-vllm`'s vLLM ingestion; the sidecar knows nothing of vLLM). It is started once
    the sidecar accepts, commits through the group commit (`submit_all`), returns once `stop` is
    set, and is stopped first at shutdown: what it holds is committed while the committer still
    takes it."""

    async def __call__(
        self, ledger: Ledger, submit_all: SubmitAll, stop: anyio.Event, *, task_status: anyio.abc.TaskStatus[None] = ...
    ) -> None: ...


class ConfigError(ValueError):
    """A configuration the sidecar refuses to start with; the message says what to change."""


def check_config(config: ServeConfig) -> None:
    credentials = load_credentials_of(config)
    if config.credentials and config.token:
        raise ConfigError("--token and --credentials both given: the credentials file's tokens replace the shared token")
    if config.tcp is not None and not (config.token or (credentials is not None and credentials.has_tokens)):
        raise ConfigError(
            "--tcp needs a token (--token or KVLEDGER_TOKEN, or a token in --credentials): TCP clients must authenticate"
        )
    for name, address in (("--tcp", config.tcp), ("--http", config.http)):
        if address is not None and not config.allow_remote and not is_loopback(address[0]):
            raise ConfigError(f"{name} {address[0]} is not a loopback address; pass --allow-remote to listen on it")
    if config.appends_in_flight < 1:
        raise ConfigError(f"--appends-in-flight {config.appends_in_flight} is below 1")
    if config.max_frame < 1024:
        raise ConfigError(f"--max-frame {config.max_frame} is below 1024 bytes")
    if config.audit_tokens:
        try:
            load_tokens(Path(config.audit_tokens))
        except TokenFileError as error:
            raise ConfigError(str(error)) from None


def load_credentials_of(config: ServeConfig) -> Credentials | None:
    if not config.credentials:
        return None
    try:
        return load_credentials(Path(config.credentials))
    except TokenFileError as error:
        raise ConfigError(str(error)) from None
