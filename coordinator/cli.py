"""`kvledger`: the command line. Today: `demo`, `db` and `serve`. replay, audit, verify and bench
come with the issues that build them."""

from __future__ import annotations

import anyio
import msgspec
import structlog
import typer
from rich.console import Console
from rich.table import Table

app = typer.Typer(help="kvledger: an event-sourced coordinator for LLM KV caches.", no_args_is_help=True)
log = structlog.get_logger("kvledger.cli")

_STYLE = {"ok": "green", "refused": "bold red", "dropped": "yellow", "violation": "bold magenta"}


db = typer.Typer(help="The log's database schema.", no_args_is_help=True)
app.add_typer(db, name="db")
LOG_OPTION = typer.Option(None, "--log", envvar="KVLEDGER_LOG", help="SQLite path or URL, or PostgreSQL URL (default: the data directory's SQLite file).")


@app.callback()
def main() -> None:
    """kvledger: every block allocation, store, load and eviction is a versioned event."""


@app.command()
def demo(
    json_output: bool = typer.Option(False, "--json", help="Print the rows as JSON lines."),
) -> None:
    """Play the seeds' failures against the pure core and show what it decided, step by step."""
    from coordinator.demo import run_demo

    result = run_demo()
    if json_output:
        for row in result.rows:
            typer.echo(msgspec.json.encode(row).decode())
    else:
        console = Console(width=200)
        table = Table(title="kvledger demo: decider + projector, in process", show_lines=False)
        for column in ("engine", "step", "command", "verdict", "what the coordinator recorded", "shows"):
            table.add_column(column, overflow="fold")
        for row in result.rows:
            style = _STYLE[row.verdict]
            table.add_row(row.engine, str(row.step or "-"), row.command, f"[{style}]{row.verdict}[/]", row.outcome, row.shows)
        console.print(table)
        same = "equal (I18 holds)" if result.digest == result.replay_digest else "DIFFERENT (I18 broken)"
        console.print(f"{result.events} events. Live state digest {result.digest[:16]}; full replay {result.replay_digest[:16]}: {same}")
    log.info("demo_finished", events=result.events, rows=len(result.rows), replay_equal=result.digest == result.replay_digest)
    if result.digest != result.replay_digest:
        raise typer.Exit(code=1)


@db.command("upgrade")
def db_upgrade(log_url: str | None = LOG_OPTION) -> None:
    """Bring the log's schema to this kvledger's head (PostgreSQL needs this before serving)."""
    from events.log import LogError, mask, normalize, upgrade_log

    try:
        revision = anyio.run(upgrade_log, log_url)
    except (LogError, ValueError) as error:
        typer.echo(f"kvledger db upgrade: {error}", err=True)
        raise typer.Exit(code=1) from None
    typer.echo(f"{mask(normalize(log_url))}: schema at {revision} (head)")


@db.command("status")
def db_status(log_url: str | None = LOG_OPTION) -> None:
    """Show the log's schema revision against this kvledger's head."""
    from events.log import LogError, mask, normalize, schema_revision

    try:
        revision, head = anyio.run(schema_revision, log_url)
    except (LogError, ValueError) as error:
        typer.echo(f"kvledger db status: {error}", err=True)
        raise typer.Exit(code=1) from None
    import migrations

    if revision == head:
        verdict = "up to date"
    elif revision is not None and not migrations.known(revision):
        verdict = "NEWER than this kvledger: upgrade kvledger"
    else:
        verdict = "behind: run `kvledger db upgrade`"
    typer.echo(f"{mask(normalize(log_url))}: schema {revision or 'none'}, head {head}: {verdict}")


def _address(text: str | None, option: str) -> tuple[str, int] | None:
    """HOST:PORT (IPv6 in brackets) as a tuple; "off" or empty: None."""
    if not text or text.lower() == "off":
        return None
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit() or not host:
        raise typer.BadParameter(f"{text!r} is not HOST:PORT", param_hint=option)
    return host.strip("[]"), int(port)


def configure_json_logs() -> None:
    """structlog JSON lines on stderr: what a sidecar's log collector reads. The level comes
    from $KVLEDGER_LOG_LEVEL (default info; debug adds a line per committed step)."""
    import logging
    import os
    import sys

    level = logging.getLevelNamesMapping().get(os.environ.get("KVLEDGER_LOG_LEVEL", "info").upper(), logging.INFO)
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            structlog.processors.JSONRenderer(),
        ],
        wrapper_class=structlog.make_filtering_bound_logger(level),
        logger_factory=structlog.PrintLoggerFactory(sys.stderr),
        cache_logger_on_first_use=True,
    )


@app.command()
def serve(
    log_url: str | None = LOG_OPTION,
    socket_path: str | None = typer.Option(None, "--socket", envvar="KVLEDGER_SOCKET", help="Unix socket path (default: kvledger.sock in the data directory); created mode 0600."),
    tcp: str | None = typer.Option(None, "--tcp", envvar="KVLEDGER_TCP", help="Also listen on TCP HOST:PORT (loopback only unless --allow-remote); needs --token."),
    token: str = typer.Option("", "--token", envvar="KVLEDGER_TOKEN", help="Shared secret clients send in Hello; required for --tcp.", show_default=False),
    http: str = typer.Option("127.0.0.1:9464", "--http", envvar="KVLEDGER_HTTP", help="HOST:PORT for /metrics, /healthz and /readyz; 'off' disables."),
    max_frame: int = typer.Option(16 << 20, "--max-frame", envvar="KVLEDGER_MAX_FRAME", help="Largest frame accepted, bytes."),
    subscriber_buffer: int = typer.Option(10_000, "--subscriber-buffer", envvar="KVLEDGER_SUBSCRIBER_BUFFER", help="Decisions a worker may fall behind before it is cut off (it resumes)."),
    snapshot_every: int = typer.Option(1000, "--snapshot-every", envvar="KVLEDGER_SNAPSHOT_EVERY", help="Steps between snapshots (one is also written at shutdown)."),
    allow_remote: bool = typer.Option(False, "--allow-remote", help="Allow --tcp/--http on a non-loopback address."),
) -> None:
    """Run the sidecar: the coordinator on its log, on a Unix socket (and TCP if asked)."""
    from coordinator.sidecar.server import ConfigError, ServeConfig, Sidecar, run_sidecar
    from events.log import LogError, data_dir

    configure_json_logs()
    config = ServeConfig(
        log_url=log_url, socket_path=socket_path or str(data_dir() / "kvledger.sock"), tcp=_address(tcp, "--tcp"),
        token=token, http=_address(http, "--http"), max_frame=max_frame, subscriber_buffer=subscriber_buffer,
        snapshot_every=snapshot_every, allow_remote=allow_remote,
    )

    def started(sidecar: Sidecar) -> None:
        where = sidecar.where()
        typer.echo(
            f"kvledger serving: log {where['log']}, socket {where['socket']}"
            + (f", tcp {where['tcp']}" if where["tcp"] else "")
            + (f", http {where['http']}/metrics /healthz /readyz" if where["http"] else ", http off")
            + f", at global sequence {where['global_seq']}"
        )

    try:
        anyio.run(lambda: run_sidecar(config, on_started=started))
    except (ConfigError, LogError, OSError) as error:
        typer.echo(f"kvledger serve: {error}", err=True)
        raise typer.Exit(code=2 if isinstance(error, ConfigError) else 1) from None


if __name__ == "__main__":
    app()
