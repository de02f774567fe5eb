"""`kvledger audit timeline POOL --steps A:B --out FILE.html|FILE.png`: the command around
coordinator/audit/timeline.py. coordinator/cli.py registers `timeline_command`.

Bad input (--steps, --out, an unknown engine, pool or range, a missing log file) is one line on
stderr and exit code 2; a log that cannot be reached is one line and exit code 1. Never a traceback.
"""

from __future__ import annotations

from pathlib import Path

import anyio
import typer

from coordinator.audit.answers import AuditError
from coordinator.audit.store import sync_index
from coordinator.audit.timeline import Timeline, output_format, parse_steps
from coordinator.audit.timeline_draw import draw_timeline
from coordinator.cli._common import BAD_INPUT, exits, quiet_logs
from events.log import is_kafka, normalize, open_log
from events.log.opening import open_for_audit

COMMAND = "kvledger audit timeline"
MAX_STEP = 2**63 - 1
"""The largest step a log holds (a BIGINT column): a larger one in --steps is bad input."""
MAX_POOL = 2**31 - 1


def timeline_command(
    pool: int = typer.Argument(..., min=0, max=MAX_POOL, help="The pool (cache group) whose slots are drawn."),
    steps: str = typer.Option(..., "--steps", help="The engine steps to draw, A:B (both included)."),
    out: Path = typer.Option(..., "--out", help="The picture: FILE.png, or FILE.html (self-contained, works offline)."),
    engine: str | None = typer.Option(None, "--engine", help="The engine (default: the log's only engine)."),
    log_url: str | None = typer.Option(
        None,
        "--log",
        envvar="KVLEDGER_LOG",
        help="SQLite path or URL, PostgreSQL URL, or Kafka log kafka://HOST:PORT/TOPIC?state=DB (default: the data directory's SQLite file).",
    ),
) -> None:
    """Draw which generation and owner held each slot of one pool over a range of steps, with
    pins, jobs and refusals marked: the picture for an incident report."""

    quiet_logs()
    with exits("audit timeline", bad_input=(*BAD_INPUT, ValueError)):
        first_step, last_step = parse_steps(steps)
        if last_step > MAX_STEP:
            raise AuditError(f"--steps {steps!r}: a step is at most {MAX_STEP}")
        output_format(out)
        target = _existing_log(log_url)
    with exits("audit timeline"):
        timeline = anyio.run(lambda: _run(target, pool, first_step, last_step, out, engine))
    typer.echo(
        f"{out}: engine {timeline.engine} pool {timeline.pool}, steps {timeline.first_step}..{timeline.last_step}: "
        f"{len(timeline.slots)} slots, {len(timeline.bars)} holds, {len(timeline.pins)} pins, "
        f"{len(timeline.jobs)} jobs, {len(timeline.refusals)} refusals"
    )
    if timeline.note:
        typer.echo(f"{COMMAND}: {timeline.note}", err=True)


async def _run(target: str, pool: int, first_step: int, last_step: int, out: Path, engine: str | None) -> Timeline:
    if is_kafka(target):  # its topic must exist; the index lives in its state store
        event_log = await open_for_audit(target)
    else:
        event_log = await open_log(target)
    try:
        await sync_index(event_log)  # catch the index up with the log first
        return await draw_timeline(event_log, pool=pool, first_step=first_step, last_step=last_step, out=out, engine=engine)
    finally:
        await event_log.close()


def _existing_log(log_url: str | None) -> str:
    """The log's URL; a SQLite file must exist (opening one would create an empty log: an audit
    command never writes a log into being). A Kafka log's URL as given (checked when opened)."""
    if is_kafka(log_url):
        return str(log_url)
    url = normalize(log_url)
    if url.get_backend_name() == "sqlite" and url.database and url.database != ":memory:" and not Path(url.database).exists():
        raise AuditError(f"there is no log at {url.database!r}: name it with --log or $KVLEDGER_LOG")
    return url.render_as_string(hide_password=False)
