"""`kvledger fleet`: the fleet audit service (coordinator/audit/fleet.py) as a command."""

from __future__ import annotations

from pathlib import Path

import anyio
import sqlalchemy as sa
import typer

from coordinator.audit.api import TokenFileError, load_tokens
from coordinator.audit.fleet import DEFAULT_BATCH, DEFAULT_POLL_S, FleetError, fleet_url, serve_fleet
from coordinator.cli._common import configure_json_logs, host_port
from coordinator.http_serving import is_loopback
from events.log import LogError
from events.log.kafka_target import one_line
from events.log.opening import quiet_kafka_client


def fleet_command(
    log_url: str | None = typer.Option(
        None, "--log", envvar="KVLEDGER_LOG", help="The fleet's Kafka log: kafka://HOST:PORT/TOPIC."
    ),
    db: str | None = typer.Option(
        None,
        "--db",
        envvar="KVLEDGER_FLEET_DB",
        help="The audit index's database: postgresql://... (or a SQLite file); it becomes the log's ?state= store.",
    ),
    batch: int = typer.Option(DEFAULT_BATCH, "--batch", min=1, max=1_000_000, help="Events indexed per transaction."),
    poll: float = typer.Option(
        DEFAULT_POLL_S, "--poll", min=0.01, max=3600.0, help="Seconds between looks at the topic's head once caught up."
    ),
    http: str = typer.Option(
        "off",
        "--http",
        envvar="KVLEDGER_FLEET_HTTP",
        help="HOST:PORT for the fleet-wide audit API under /audit/, /metrics, /healthz and /readyz; 'off' (default) serves none.",
    ),
    audit_tokens: str | None = typer.Option(
        None,
        "--audit-tokens",
        envvar="KVLEDGER_AUDIT_TOKENS",
        help="Tokens file of the HTTP audit API (as `kvledger serve --audit-tokens`); without it /audit/ answers 401.",
    ),
    allow_remote: bool = typer.Option(False, "--allow-remote", help="Allow --http on a non-loopback address."),
) -> None:
    """Index every engine's stream of a Kafka log into one audit database, exactly once, and keep
    tailing it (until SIGTERM or SIGINT): `kvledger audit ... --log 'kafka://HOST:PORT/TOPIC?state=DB'`
    then answers for the whole fleet."""
    try:
        url = fleet_url(log_url, db)
        try:
            address = host_port(http, "--http")
        except typer.BadParameter:
            raise FleetError(f"--http {http!r} is not HOST:PORT (or 'off')") from None
        if address is not None and not allow_remote and not is_loopback(address[0]):
            raise FleetError(f"--http {address[0]} is not a loopback address; pass --allow-remote to listen on it")
        try:
            tokens = load_tokens(Path(audit_tokens)) if audit_tokens else None
        except TokenFileError as error:
            raise FleetError(str(error)) from None
    except FleetError as error:
        typer.echo(f"kvledger fleet: {error}", err=True)
        raise typer.Exit(code=2) from None
    configure_json_logs()
    quiet_kafka_client()
    try:
        anyio.run(serve_fleet, url, batch, poll, address, tokens)
    except FleetError as error:
        typer.echo(f"kvledger fleet: {error}", err=True)
        raise typer.Exit(code=2) from None
    except LogError as error:
        typer.echo(f"kvledger fleet: {error}", err=True)
        raise typer.Exit(code=1) from None
    except sa.exc.SQLAlchemyError as error:
        typer.echo(f"kvledger fleet: the audit database failed: {one_line(error)}", err=True)
        raise typer.Exit(code=1) from None
    except OSError as error:
        typer.echo(f"kvledger fleet: {error.strerror or error}", err=True)
        raise typer.Exit(code=1) from None
