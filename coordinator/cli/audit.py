"""`kvledger audit ...`, `kvledger replay` and `kvledger export`: forensics on a log, live or
copied. Every audit command first catches the audit index up with the log (exactly once; only
the index's own tables are written), then answers from it: a table, or JSON with --json."""

from __future__ import annotations

import sys
import time
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar

import anyio
import msgspec
import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn
from rich.table import Table

from coordinator.audit.answers import (
    AuditError,
    BlockAnswer,
    DecisionEntry,
    HistoryAnswer,
    KeyAnswer,
    NamespaceEntry,
    ObservedHashAnswer,
    RefusalEntry,
    RequestAnswer,
)
from coordinator.audit.queries import Audit
from coordinator.audit.store import IndexProgress, sync_index
from coordinator.audit.times import read_time
from coordinator.cli._common import exits, quiet_logs
from coordinator.cli.timeline import timeline_command
from events.log import SqlEventLog
from events.log.opening import open_existing

audit_app = typer.Typer(help="Who owned what, when: point-in-time answers from the log's audit index.", no_args_is_help=True)
audit_app.command("timeline")(timeline_command)

LOG = typer.Option(
    None,
    "--log",
    envvar="KVLEDGER_LOG",
    help="SQLite path or URL, PostgreSQL URL, or Kafka log kafka://HOST:PORT/TOPIC?state=DB (the index lives in DB) (default: the data directory's SQLite file).",
)
ENGINE = typer.Option(None, "--engine", help="The engine whose pool and steps are meant (default: the log's only engine).")
JSON = typer.Option(False, "--json", help="Print JSON instead of a table.")
MAX_INT = 2**63 - 1
"""The largest sequence or step a log holds (BIGINT columns): a larger option is bad input."""
MAX_SLOT = 2**31 - 1
"""The largest pool or block id (INTEGER columns)."""
AT_SEQ = typer.Option(None, "--at-seq", max=MAX_INT, help="At this global sequence (default: the end of the log).")
AT_STEP = typer.Option(None, "--at-step", max=MAX_INT, help="At the end of this engine step.")
AT_TIME = typer.Option(None, "--at-time", help="At this time: ISO 8601 (UTC unless it names a zone) or seconds since the epoch.")

T = TypeVar("T")
console = Console(width=160)


def _progress() -> Progress:
    return Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeRemainingColumn(),
        console=Console(stderr=True),
        transient=True,
        disable=not sys.stderr.isatty(),
    )


def _writable(out: Path | None) -> None:
    """--out names a file in a directory that exists (checked before any work: an hour of replay
    must not end in 'no such directory')."""
    if out is not None and not out.parent.is_dir():
        raise AuditError(f"--out {str(out)!r}: the directory {str(out.parent)!r} does not exist")
    if out is not None and out.is_dir():
        raise AuditError(f"--out {str(out)!r} is a directory: name a file")


@contextmanager
def _naming(out: Path | None) -> Iterator[None]:
    """An OSError while writing `out` names it (a failed write says only 'No space left')."""
    try:
        yield
    except OSError as error:
        if error.filename is None and out is not None:
            error.filename = str(out)
        raise


def _run(command: str, log_url: str | None, query: Callable[[Audit], Awaitable[T]]) -> T:
    quiet_logs()

    async def main() -> T:
        event_log = await open_existing(log_url)
        try:
            await _catch_up(event_log)
            return await query(Audit(event_log))
        finally:
            await event_log.close()

    with exits(command):
        return anyio.run(main)


async def _catch_up(event_log: SqlEventLog) -> None:
    head = await event_log.head()
    with _progress() as progress:
        task = progress.add_task("indexing the log", total=head)

        def advanced(done: IndexProgress) -> None:
            progress.update(task, completed=done.indexed_seq)

        await sync_index(event_log, on_progress=advanced)


def _print(value: Any, json_output: bool, render: Callable[[Any], None]) -> None:
    if json_output:
        typer.echo(msgspec.json.encode(value).decode())
    else:
        render(value)


def _where(seq: int | None, step: int | None = None) -> str:
    if seq is None:
        return "-"
    return f"seq {seq}" + (f" (step {step})" if step is not None and step >= 0 else "")


# --- audit block / history ------------------------------------------------------------------------


@audit_app.command("block")
def block(
    pool: int = typer.Argument(..., min=0, max=MAX_SLOT, help="Pool id."),
    block_id: int = typer.Argument(..., metavar="ID", min=0, max=MAX_SLOT, help="Block id in the pool."),
    engine: str | None = ENGINE,
    at_seq: int | None = AT_SEQ,
    at_step: int | None = AT_STEP,
    at_time: str | None = AT_TIME,
    log_url: str | None = LOG,
    json_output: bool = JSON,
) -> None:
    """Which generation held the slot at that point: its owner, allocation and free, and the
    pins and jobs that touched it."""

    with exits("audit block"):  # before the log is opened and indexed
        when = None if at_time is None else read_time(at_time, "--at-time")

    async def query(audit: Audit) -> BlockAnswer:
        name = await audit.engine(engine)
        return await audit.block(name, pool, block_id, await audit.resolve(name, at_seq=at_seq, at_step=at_step, at_time=when))

    _print(_run("audit block", log_url, query), json_output, _render_block)


def _render_block(answer: BlockAnswer) -> None:
    at = answer.at
    console.print(
        f"[bold]{answer.engine} pool {answer.pool} block {answer.block}[/] at {_where(at.seq, at.step)}: "
        f"[bold]{answer.status}[/] (tenant {answer.tenant or '-'})"
    )
    life = answer.generation
    if life is not None:
        console.print(
            f"generation {life.generation}: allocated at {_where(life.allocated_seq, life.allocated_step)}, "
            f"ended at {_where(life.freed_seq, life.freed_step)} ({life.ended_by})"
        )
    if answer.owner is not None:
        owner = answer.owner
        finished = "not finished" if owner.finished_seq is None else f"{owner.finished_reason} at seq {owner.finished_seq}"
        console.print(
            f"owner {owner.owner_id} (req_id {owner.req_id}{', resumed' if owner.resumed else ''}): "
            f"started at seq {owner.started_seq}, {finished}"
        )
    if answer.jobs:
        table = Table("job", "kind", "started", "ended", "outcome", "pinned then")
        for job in answer.jobs:
            table.add_row(
                str(job.job_id),
                job.kind,
                str(job.started_seq),
                _where(job.ended_seq),
                job.outcome,
                "yes" if job.pinned_then else "no",
            )
        console.print(table)
    if answer.events:
        table = Table("seq", "what", "owner", "job", "key", title="that generation's events")
        for e in answer.events:
            table.add_row(str(e.seq), e.kind, _dash(e.owner_id), _dash(e.job_id), e.key or "-")
        console.print(table)


def _dash(value: object) -> str:
    return "-" if value is None else str(value)


@audit_app.command("history")
def history(
    pool: int = typer.Argument(..., min=0, max=MAX_SLOT, help="Pool id."),
    block_id: int = typer.Argument(..., metavar="ID", min=0, max=MAX_SLOT, help="Block id in the pool."),
    engine: str | None = ENGINE,
    log_url: str | None = LOG,
    json_output: bool = JSON,
) -> None:
    """Every generation of the slot: owner, allocation, end."""

    async def query(audit: Audit) -> HistoryAnswer:
        return await audit.history(await audit.engine(engine), pool, block_id)

    def render(answer: HistoryAnswer) -> None:
        table = Table(
            "generation",
            "owner",
            "req_id",
            "allocated",
            "ended",
            "by",
            title=f"{answer.engine} pool {answer.pool} block {answer.block}: {len(answer.generations)} generations",
        )
        for life in answer.generations:
            table.add_row(
                str(life.generation),
                _dash(life.owner_id),
                life.req_id or "-",
                _where(life.allocated_seq, life.allocated_step),
                _where(life.freed_seq, life.freed_step),
                life.ended_by,
            )
        console.print(table)

    _print(_run("audit history", log_url, query), json_output, render)


# --- audit key / request ----------------------------------------------------------------------------


@audit_app.command("key")
def key(
    key_hex: str = typer.Argument(..., metavar="KEY", help="The content key, hex."),
    log_url: str | None = LOG,
    json_output: bool = JSON,
) -> None:
    """A key's provenance: namespace, the job and slot it was stored from, each rank's checksum,
    the loads that used it, evictions and quarantines."""

    async def query(audit: Audit) -> KeyAnswer:
        return await audit.key(key_hex)

    def render(answer: KeyAnswer) -> None:
        console.print(
            f"[bold]key {answer.key}[/]: namespace {answer.namespace_id or '-'} ({answer.model_id or '-'}, "
            f"tenant {answer.tenant or '-'})"
        )
        for where in answer.computed:
            console.print(f"computed in {where}")
        table = Table("seq", "tier", "tier slot", "bytes", "job", "stored from", "checksums (rank order)", title="publications")
        for pub in answer.publications:
            table.add_row(
                str(pub.seq),
                pub.tier,
                _dash(pub.tier_slot),
                _dash(pub.size_bytes),
                _dash(pub.source_job),
                pub.source,
                "\n".join(pub.checksums),
            )
        console.print(table)
        table = Table(
            "seq",
            "engine",
            "job",
            "into",
            "outcome",
            title=f"loads (the newest {len(answer.loads)} of {answer.counts.get('loaded', 0)})",
        )
        for load in answer.loads:
            table.add_row(str(load.seq), load.engine, _dash(load.job_id), load.dest, load.outcome)
        console.print(table)
        if answer.evictions:
            console.print(f"evicted at seq {', '.join(map(str, answer.evictions))}")
        for line in answer.quarantines:
            console.print(f"[bold red]quarantined[/] {line}")

    _print(_run("audit key", log_url, query), json_output, render)


@audit_app.command("hash")
def observed_hash(
    hash_hex: str = typer.Argument(
        ...,
        metavar="HEX",
        help="The block hash as the engine names it, hex (an int hash: its 8-byte big-endian two's complement).",
    ),
    log_url: str | None = LOG,
    json_output: bool = JSON,
) -> None:
    """When an observed engine (`kvledger ingest vllm`) stored and removed a block hash: by which
    incarnation, in which medium and group, at which global sequence and engine sequence."""

    async def query(audit: Audit) -> ObservedHashAnswer:
        return await audit.observed(hash_hex)

    def render(answer: ObservedHashAnswer) -> None:
        console.print(
            f"[bold]block hash {answer.hash}[/] (tenant {answer.tenant or '-'}): "
            f"{len(answer.residencies)} stays, {answer.total} rows"
        )
        table = Table(
            "engine",
            "incarnation",
            "medium/group",
            "dp rank",
            "stored at",
            "ended at",
            "by",
            title="stays (seq: global sequence; engine: the engine's batch number)",
        )
        for r in answer.residencies:
            ended = (
                "-"
                if r.ended_seq is None
                else f"seq {r.ended_seq}" + (f" (engine {r.ended_source_seq})" if r.ended_source_seq is not None else "")
            )
            table.add_row(
                r.engine,
                str(r.incarnation),
                f"{r.medium}/{r.group}",
                _dash(r.dp_rank),
                f"seq {r.stored_seq} (engine {r.stored_source_seq})",
                ended,
                r.ended_by,
            )
        console.print(table)
        table = Table("seq", "kind", "engine", "incarnation", "medium/group", "engine seq", title="events")
        for e in answer.events:
            where = "-" if not e.medium else e.medium + ("" if e.group is None else f"/{e.group}")
            table.add_row(str(e.seq), e.kind, e.engine, str(e.incarnation), where, _dash(e.source_seq))
        console.print(table)
        for gap in answer.gaps:
            console.print(f"[yellow]missed[/] {gap}")

    _print(_run("audit hash", log_url, query), json_output, render)


@audit_app.command("request")
def request(req_id: str = typer.Argument(..., metavar="REQ_ID"), log_url: str | None = LOG, json_output: bool = JSON) -> None:
    """Every owner lifetime of that req_id (a resumed request is a new owner), and its blocks."""

    async def query(audit: Audit) -> RequestAnswer:
        return await audit.request(req_id)

    def render(answer: RequestAnswer) -> None:
        table = Table("engine", "owner", "started", "finished", "resumed", "blocks", title=f"request {answer.req_id}")
        for owner in answer.owners:
            table.add_row(
                owner.engine,
                str(owner.owner_id),
                f"seq {owner.started_seq}",
                f"{_where(owner.finished_seq)} {owner.finished_reason}",
                "yes" if owner.resumed else "no",
                "\n".join(owner.blocks),
            )
        console.print(table)

    _print(_run("audit request", log_url, query), json_output, render)


# --- audit refusals / namespaces ------------------------------------------------------------------


@audit_app.command("refusals")
def refusals(
    since: str | None = typer.Option(None, "--since", help="After this time (ISO 8601 or epoch seconds)."),
    since_seq: int = typer.Option(0, "--since-seq", min=0, max=MAX_INT, help="After this global sequence."),
    limit: int = typer.Option(1000, "--limit", min=1, max=MAX_INT, help="At most this many."),
    log_url: str | None = LOG,
    json_output: bool = JSON,
) -> None:
    """What the coordinator refused or dropped, the jobs it failed and the keys it quarantined."""

    with exits("audit refusals"):
        since_time = None if since is None else read_time(since, "--since")

    async def query(audit: Audit) -> list[RefusalEntry]:
        return await audit.refusals(since_seq=since_seq, since_time=since_time, limit=limit)

    def render(entries: list[RefusalEntry]) -> None:
        table = Table("seq", "step", "engine", "kind", "what", "reason", "detail", title=f"{len(entries)} refusals")
        for e in entries:
            table.add_row(str(e.seq), _dash(e.step if e.step >= 0 else None), e.engine, e.kind, e.subject, e.reason, e.detail)
        console.print(table)

    _print(_run("audit refusals", log_url, query), json_output, render)


@audit_app.command("namespaces")
def namespaces(log_url: str | None = LOG, json_output: bool = JSON) -> None:
    """Inventory for cleanup decisions: live keys, bytes, first publication, last use, age."""

    async def query(audit: Audit) -> list[NamespaceEntry]:
        return await audit.namespaces(now=time.time())

    def render(entries: list[NamespaceEntry]) -> None:
        table = Table("namespace", "tenant", "model", "weights", "keys", "bytes", "last use", "age", title="namespaces")
        for e in entries:
            table.add_row(
                e.namespace_id,
                e.tenant,
                e.model_id,
                str(e.spec.get("weights_revision", "")),
                str(e.keys),
                f"{e.bytes:,}",
                _ago(e.last_used_at),
                _duration(e.age_seconds),
            )
        console.print(table)

    _print(_run("audit namespaces", log_url, query), json_output, render)


@audit_app.command("decisions")
def decisions(
    namespace: str | None = typer.Option(None, "--namespace", help="Only decisions from or to this namespace (hex)."),
    log_url: str | None = LOG,
    json_output: bool = JSON,
) -> None:
    """Namespace release decisions (new, compatible, clear) and releases, oldest first."""

    async def query(audit: Audit) -> list[DecisionEntry]:
        return await audit.decisions(namespace)

    def render(entries: list[DecisionEntry]) -> None:
        table = Table("seq", "outcome", "from", "to", "tenant", "keys", "evidence", "reason", title=f"{len(entries)} decisions")
        for e in entries:
            table.add_row(
                str(e.seq),
                e.outcome,
                e.from_namespace,
                e.to_namespace or "-",
                e.tenant,
                str(e.affected_keys),
                e.evidence or "-",
                e.reason,
            )
        console.print(table)

    _print(_run("audit decisions", log_url, query), json_output, render)


def _ago(epoch: float | None) -> str:
    return "-" if epoch is None else f"{_duration(time.time() - epoch)} ago"


def _duration(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    for unit, size in (("d", 86_400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{seconds / size:.1f}{unit}"
    return f"{seconds:.0f}s"


# --- replay / export (top-level commands) -----------------------------------------------------------


def replay_command(
    log_url: str | None = LOG,
    until_seq: int | None = typer.Option(None, "--until-seq", max=MAX_INT, help="Stop after this global sequence."),
    until_step: int | None = typer.Option(
        None, "--until-step", max=MAX_INT, help="Stop at the end of this engine step (see --engine)."
    ),
    until_time: str | None = typer.Option(
        None, "--until-time", help="Stop at the last step recorded by then (ISO 8601 or epoch seconds)."
    ),
    engine: str | None = ENGINE,
    out: Path | None = typer.Option(
        None, "--out", help="Write the state there: .json for JSON (bytes as base64), else msgpack (a snapshot's state)."
    ),
    json_output: bool = JSON,
) -> None:
    """Rebuild the coordinator's state at any point of the log, and summarize it."""
    from coordinator.core.state import encode_state, state_digest
    from coordinator.ledger.recovery import replay
    from events import EventCodec

    async def main() -> dict[str, Any]:
        _writable(out)
        until_moment = None if until_time is None else read_time(until_time, "--until-time")
        # A replay to a step or a time asks the audit index (which it builds in the log's
        # database); to a sequence, or whole, it only reads.
        event_log = await open_existing(log_url, read_only=until_step is None and until_time is None)
        try:
            until = until_seq
            if until_step is not None or until_time is not None:
                await _catch_up(event_log)
                audit = Audit(event_log)
                name = await audit.engine(engine) if until_step is not None else ""
                until = await audit.resolve(name, at_seq=until_seq, at_step=until_step, at_time=until_moment)
            elif until is not None and until < 0:
                raise AuditError(f"--until-seq must be >= 0, got {until}")
            head = await event_log.head()
            target = head if until is None else min(until, head)
            with _progress() as progress:
                task = progress.add_task("replaying", total=target)
                state, last = await replay(
                    event_log, EventCodec(), until_seq=target, on_progress=lambda seq: progress.update(task, completed=seq)
                )
        finally:
            await event_log.close()
        if out is not None:
            with _naming(out):
                out.write_bytes(msgspec.json.encode(state) if out.suffix == ".json" else encode_state(state))
        tiers = {name: sum(len(keys) for keys in tier.published.values()) for name, tier in state.tiers.items()}
        return {
            "global_seq": last,
            "head": head,
            "digest": state_digest(state),
            "engines": sorted(state.engines),
            "published_keys": tiers,
            "out": None if out is None else str(out),
        }

    quiet_logs()
    with exits("replay"):
        summary = anyio.run(main)
    if json_output:
        typer.echo(msgspec.json.encode(summary).decode())
        return
    console.print(
        f"state at global sequence {summary['global_seq']} (log head {summary['head']}): "
        f"digest {summary['digest'][:16]}, engines {', '.join(summary['engines']) or '-'}, "
        f"published keys {summary['published_keys']}" + (f"; written to {out}" if out else "")
    )


def export_command(
    log_url: str | None = LOG,
    export_format: str = typer.Option("jsonl", "--format", help="Only jsonl: one JSON object per event."),
    out: Path | None = typer.Option(None, "--out", help="Write there instead of standard output."),
    after_seq: int = typer.Option(0, "--after-seq", min=0, max=MAX_INT, help="Only events after this global sequence."),
) -> None:
    """Every committed event as JSON lines (bytes in hex), for other tools."""
    from coordinator.audit.export import export_jsonl

    if export_format != "jsonl":
        typer.echo(f"kvledger export: unknown --format {export_format!r}; known: jsonl", err=True)
        raise typer.Exit(code=2)

    async def main() -> int:
        _writable(out)
        event_log = await open_existing(log_url, read_only=True)
        count = 0
        try:
            with _naming(out):
                sink = open(out, "wb") if out is not None else sys.stdout.buffer  # noqa: SIM115 - closed below
                try:
                    async for lines in export_jsonl(event_log, after_seq=after_seq):
                        if lines:
                            sink.write(b"\n".join(lines) + b"\n")
                            count += len(lines)
                finally:
                    if out is not None:
                        sink.close()
                    else:
                        sink.flush()
        finally:  # the log is closed whatever the file did (a full disk, no permission)
            await event_log.close()
        return count

    quiet_logs()
    with exits("export"):
        count = anyio.run(main)
    if out is not None:
        typer.echo(f"exported {count} events to {out}", err=True)


def verify_command(
    log_url: str | None = LOG,
    json_output: bool = JSON,
    max_violations: int = typer.Option(10_000, "--max-violations", min=1, help="List at most this many (all are counted)."),
) -> None:
    """Replay the whole log and check every invariant it can show (I1-I18); print each violation
    with its global sequence, step and evidence. Exits 1 when anything is found."""
    from coordinator.audit.verify_run import VerifyProgress, VerifyReport, verify_log

    async def main() -> VerifyReport:
        event_log = await open_existing(log_url, read_only=True)
        try:
            head = await event_log.head()
            with _progress() as progress:
                task = progress.add_task("verifying", total=head)

                def advanced(done: VerifyProgress) -> None:
                    progress.update(task, completed=done.checked_seq)

                return await verify_log(event_log, on_progress=advanced, max_violations=max_violations)
        finally:
            await event_log.close()

    quiet_logs()
    with exits("verify"):
        report = anyio.run(main)
    if json_output:
        typer.echo(msgspec.json.encode(report).decode())
    else:
        if report.violations:
            table = Table("invariant", "seq", "step", "engine", "what", "evidence", title=f"{report.violation_count} violations")
            for v in report.violations:
                table.add_row(
                    v.invariant,
                    str(v.seq),
                    _dash(v.step if v.step >= 0 else None),
                    v.engine or "-",
                    v.message,
                    "\n".join(v.evidence),
                )
            console.print(table)
        replay = report.replay
        console.print(
            f"{report.events_checked:,} events checked up to seq {report.head}: "
            f"{report.violation_count} violations {report.by_invariant() or ''}; "
            f"replay from a snapshot {'equals' if replay.ok else 'DIFFERS FROM'} the full replay (I18)"
            + (f"; {len(report.undecodable)} events undecodable" if report.undecodable else "")
        )
    if not report.ok:
        raise typer.Exit(code=1)
