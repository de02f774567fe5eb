"""`kvledger`: the command line. Today: `demo`. serve, replay, audit, verify, db, bench come
with the issues that build them."""

from __future__ import annotations

import msgspec
import structlog
import typer
from rich.console import Console
from rich.table import Table

app = typer.Typer(help="kvledger: an event-sourced coordinator for LLM KV caches.", no_args_is_help=True)
log = structlog.get_logger("kvledger.cli")

_STYLE = {"ok": "green", "refused": "bold red", "dropped": "yellow", "violation": "bold magenta"}


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
