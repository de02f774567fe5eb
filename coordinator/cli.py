"""`kvledger`: the command line. Today: `demo` and `db`. serve, replay, audit, verify and bench
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
