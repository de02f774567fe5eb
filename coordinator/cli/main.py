"""`kvledger`: the command line: demo, simulate, serve, worker, db, and the forensic commands
(audit, replay, export: coordinator/cli/audit.py)."""

from __future__ import annotations

import anyio
import msgspec
import structlog
import typer
from rich.console import Console
from rich.table import Table

from coordinator.cli._common import configure_json_logs, host_port
from coordinator.cli.audit import audit_app, export_command, replay_command, verify_command
from coordinator.cli.fleet import fleet_command
from coordinator.cli.ingest import ingest_app
from coordinator.cli.jobs import jobs_app
from coordinator.cli.namespace import namespace_app

app = typer.Typer(help="kvledger: an event-sourced coordinator for LLM KV caches.", no_args_is_help=True)
log = structlog.get_logger("kvledger.cli")

_STYLE = {"ok": "green", "refused": "bold red", "dropped": "yellow", "violation": "bold magenta"}


db = typer.Typer(help="The log's database schema.", no_args_is_help=True)
app.add_typer(db, name="db")
app.add_typer(audit_app, name="audit")
app.command("replay")(replay_command)
app.command("export")(export_command)
app.command("verify")(verify_command)
app.command("fleet")(fleet_command)
app.add_typer(namespace_app, name="namespace")
app.add_typer(ingest_app, name="ingest")
app.add_typer(jobs_app, name="jobs")
LOG_OPTION = typer.Option(
    None,
    "--log",
    envvar="KVLEDGER_LOG",
    help="SQLite path or URL, or PostgreSQL URL (default: the data directory's SQLite file).",
)


@app.callback()
def main() -> None:
    """kvledger: every block allocation, store, load and eviction is a versioned event."""


@app.command()
def demo(
    json_output: bool = typer.Option(False, "--json", help="Print the rows as JSON lines."),
    core_only: bool = typer.Option(False, "--core", help="Only part one: the pure core, in process."),
) -> None:
    """Play the seeds' failures against the pure core, step by step; then run them as fault
    scenarios on a real sidecar and real workers, protection on and off."""
    from coordinator.cli.demo import run_demo

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
        console.print(
            f"{result.events} events. Live state digest {result.digest[:16]}; full replay {result.replay_digest[:16]}: {same}"
        )
    log.info("demo_finished", events=result.events, rows=len(result.rows), replay_equal=result.digest == result.replay_digest)
    if result.digest != result.replay_digest:
        raise typer.Exit(code=1)
    _demo_trace(json_output)
    if core_only:
        return
    _demo_on_the_sidecar(json_output)


DEMO_TRACE_SLOTS = 8_000
"""The tier the demo replays the shipped trace slice on: small enough that it evicts."""


def _demo_trace(json_output: bool) -> None:
    """A production trace's hit rate through the pure core, beside an LRU reference's (issue 20)."""
    from coordinator.simulator.trace import SHIPPED_TRACE, beside_reference, read_trace

    trace = beside_reference(read_trace(SHIPPED_TRACE), DEMO_TRACE_SLOTS, "Mooncake's conversation trace, first 1,000 requests")
    if json_output:
        typer.echo(
            msgspec.json.encode(
                {
                    "trace": msgspec.structs.asdict(trace)
                    | {"hit_rate": trace.hit_rate, "reference_hit_rate": trace.reference_hit_rate}
                }
            ).decode()
        )
    else:
        Console(width=200).print(
            f"A production trace ({trace.trace}: {trace.blocks:,} blocks of 512 tokens) on a tier of {trace.slots:,} slots: "
            f"kvledger's hit rate {trace.hit_rate:.4f} ({trace.hit_blocks:,} blocks), an LRU reference's "
            f"{trace.reference_hit_rate:.4f} ({trace.reference_hit_blocks:,}): "
            + ("equal" if trace.equal else "[bold red]DIFFERENT[/]")
        )
    if not trace.equal:
        typer.echo(f"kvledger demo: the trace replay disagrees with its reference: {trace}", err=True)
        raise typer.Exit(code=1)


def _demo_on_the_sidecar(json_output: bool) -> None:
    """Part two: the seeds' failures as fault scenarios, on an embedded sidecar with real
    workers and real bytes, each with its protection on and off."""
    quiet_torch()
    from coordinator.simulator.report import mixed_workload, not_holding, run_scenarios, scenario_table, workload_table
    from coordinator.simulator.reported import REPORTED
    from events.log import data_dir

    keep = data_dir() / "demo"
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(30))  # warnings and up
    workload = anyio.run(lambda: mixed_workload(engines=2, steps=120, keep=keep / "mixed-workload"))
    seeds = anyio.run(lambda: run_scenarios(keep=keep))
    reported = anyio.run(lambda: run_scenarios(list(REPORTED.values()), keep=keep))
    results = seeds + reported
    if json_output:
        typer.echo(msgspec.json.encode({"workload": workload}).decode())
        for on, off in results:
            typer.echo(msgspec.json.encode({"scenario": on.scenario, "on": on, "off": off}).decode())
    else:
        console = Console(width=200)
        console.print(
            workload_table(
                workload, "kvledger demo, part two: a mixed workload of two engines on a real sidecar and real workers"
            )
        )
        console.print(
            scenario_table(seeds, "kvledger demo, part three: the seeds' failures as fault scenarios, protection on and off")
        )
        console.print(
            scenario_table(
                reported, "kvledger demo, part four: failures users reported this year, as fault scenarios, protection on and off"
            )
        )
        example = keep / "mixed-workload" / "log.sqlite"
        refused = keep / "duplicate-offload-with-different-bytes-on" / "log.sqlite"
        console.print(
            f"Every run's log is under {keep}. Try next:\n"
            f"  kvledger audit block 0 5 --engine wl-0 --at-step 60 --log {example}\n"
            f"  kvledger audit refusals --log {refused}\n"
            f"  kvledger simulate --engines 2 --steps 400"
        )
    if workload.wrong_reads:
        typer.echo(f"kvledger demo: {workload.wrong_reads} wrong-KV reads in the mixed workload", err=True)
        raise typer.Exit(code=1)
    failed = not_holding(results)
    if failed:
        typer.echo(f"kvledger demo: scenarios that did not hold (on > 0 or off == 0): {failed}", err=True)
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


def quiet_torch() -> None:
    """torch warns once at import when numpy is absent (kvledger itself installs it)."""
    import warnings

    warnings.filterwarnings("ignore", message="Failed to initialize NumPy", category=UserWarning)


@app.command()
def serve(
    log_url: str | None = LOG_OPTION,
    socket_path: str | None = typer.Option(
        None,
        "--socket",
        envvar="KVLEDGER_SOCKET",
        help="Unix socket path (default: kvledger.sock in the data directory); created mode 0600.",
    ),
    tcp: str | None = typer.Option(
        None,
        "--tcp",
        envvar="KVLEDGER_TCP",
        help="Also listen on TCP HOST:PORT (loopback only unless --allow-remote); needs --token.",
    ),
    token: str = typer.Option(
        "",
        "--token",
        envvar="KVLEDGER_TOKEN",
        help="Shared secret clients send in Hello; required for --tcp.",
        show_default=False,
    ),
    http: str = typer.Option(
        "127.0.0.1:9464", "--http", envvar="KVLEDGER_HTTP", help="HOST:PORT for /metrics, /healthz and /readyz; 'off' disables."
    ),
    max_frame: int = typer.Option(
        (1 << 20) + (256 << 10),
        "--max-frame",
        envvar="KVLEDGER_MAX_FRAME",
        help="Largest frame accepted from a client, bytes (decoding one holds every engine's steps, ~11 ms a MiB).",
    ),
    subscriber_buffer: int = typer.Option(
        10_000,
        "--subscriber-buffer",
        envvar="KVLEDGER_SUBSCRIBER_BUFFER",
        help="Decisions a worker may fall behind before it is cut off (it resumes).",
    ),
    follow: float = typer.Option(
        0.1,
        "--follow",
        envvar="KVLEDGER_FOLLOW",
        help="Seconds between looks for what other sidecars on the same log appended (their publications "
        "become lookups' answers here); 0: never.",
    ),
    appends_in_flight: int = typer.Option(
        4,
        "--appends-in-flight",
        envvar="KVLEDGER_APPENDS_IN_FLIGHT",
        min=1,
        help="Groups of steps whose appends may travel at once on a Kafka log (a SQL log takes one at a time).",
    ),
    snapshot_every: int = typer.Option(
        1000,
        "--snapshot-every",
        envvar="KVLEDGER_SNAPSHOT_EVERY",
        help="Steps between snapshots (one is also written at shutdown).",
    ),
    allow_remote: bool = typer.Option(False, "--allow-remote", help="Allow --tcp/--http on a non-loopback address."),
    max_tier_slots: int = typer.Option(
        1 << 22,
        "--max-tier-slots",
        envvar="KVLEDGER_MAX_TIER_SLOTS",
        min=1,
        help="Tier slots all tiers together may hold; engines' declarations beyond it are refused (~150 B of state a slot).",
    ),
    max_tiers: int = typer.Option(
        64,
        "--max-tiers",
        envvar="KVLEDGER_MAX_TIERS",
        min=1,
        help="Tiers the sidecar holds; engines' declarations beyond it are refused.",
    ),
    max_pool_blocks: int = typer.Option(
        1 << 23,
        "--max-pool-blocks",
        envvar="KVLEDGER_MAX_POOL_BLOCKS",
        min=1,
        help="Blocks all engines' pools together may hold; a declaration beyond it is refused (~100 B of state a block).",
    ),
    max_owners_per_engine: int = typer.Option(
        1 << 16,
        "--max-owners-per-engine",
        envvar="KVLEDGER_MAX_OWNERS_PER_ENGINE",
        min=1,
        help="Live owners (requests started, not finished) one engine may hold; a step starting more is refused.",
    ),
    free_errors: int = typer.Option(
        10,
        "--free-errors",
        envvar="KVLEDGER_FREE_ERRORS",
        min=1,
        help="Refusals per credential and second answered at once; each further one in that second waits 50 ms, in the credential's turn (a client flooding what is refused slows only itself).",
    ),
    metrics_token: str = typer.Option(
        "", "--metrics-token", envvar="KVLEDGER_METRICS_TOKEN", help="A bearer token /metrics requires (default: none)."
    ),
    metrics_engine_labels: bool = typer.Option(
        True,
        "--metrics-engine-labels/--no-metrics-engine-labels",
        help='Label per-engine gauges with engine ids (off: one engine="all" series).',
    ),
    audit_tokens: str | None = typer.Option(
        None,
        "--audit-tokens",
        envvar="KVLEDGER_AUDIT_TOKENS",
        help='Tokens file (JSON or TOML: token -> {tenant = NAME or "*"}) of the HTTP audit API under /audit/; without it the API answers 401.',
    ),
    credentials: str | None = typer.Option(
        None,
        "--credentials",
        envvar="KVLEDGER_CREDENTIALS",
        help="Credentials file (TOML or JSON, one credentials table each: token or uid, roles, engines or tenant): who may take which role for which engines. Replaces --token.",
    ),
    socket_uid: list[int] = typer.Option(
        [],
        "--socket-uid",
        help="A uid, beside the sidecar's own and the credentials file's, that may connect to the socket (checked with SO_PEERCRED; the socket is then 0666). Repeatable.",
    ),
    frame_timeout: float = typer.Option(
        30.0,
        "--frame-timeout",
        envvar="KVLEDGER_FRAME_TIMEOUT",
        min=0.1,
        max=3600.0,
        help="Seconds a frame that has begun may take to arrive whole; then its connection is closed.",
    ),
    ingest_vllm: str | None = typer.Option(
        None,
        "--ingest-vllm",
        envvar="KVLEDGER_INGEST_VLLM",
        help="TOML file of vLLM engines ([[engine]]: engine_id, endpoint, replay, topic, [engine.namespace]) whose KV events this sidecar records, as `kvledger ingest vllm` does.",
    ),
) -> None:
    """Run the sidecar: the coordinator on its log, on a Unix socket (and TCP if asked)."""
    from coordinator.sidecar.config import ConfigError, ServeConfig
    from coordinator.sidecar.server import Sidecar, run_sidecar
    from coordinator.vllm.sidecar_ingest import IngestFileError, IngestService, load_ingest_file
    from events.log import LogError, data_dir

    configure_json_logs()
    import os

    if os.environ.get("KVLEDGER_PROTECTIONS_OFF"):
        typer.echo(
            "kvledger serve: KVLEDGER_PROTECTIONS_OFF is set; protections are switched off only inside "
            "`kvledger simulate`, never in a sidecar",
            err=True,
        )
        raise typer.Exit(code=2)
    config = ServeConfig(
        log_url=log_url,
        socket_path=socket_path or str(data_dir() / "kvledger.sock"),
        tcp=host_port(tcp, "--tcp"),
        token=token,
        http=host_port(http, "--http"),
        max_frame=max_frame,
        subscriber_buffer=subscriber_buffer,
        snapshot_every=snapshot_every,
        follow_seconds=follow,
        appends_in_flight=appends_in_flight,
        allow_remote=allow_remote,
        audit_tokens=audit_tokens,
        metrics_token=metrics_token,
        metrics_engine_labels=metrics_engine_labels,
        max_tier_slots=max_tier_slots,
        max_tiers=max_tiers,
        max_pool_blocks=max_pool_blocks,
        max_owners_per_engine=max_owners_per_engine,
        credentials=credentials,
        socket_uids=list(socket_uid),
        frame_timeout=frame_timeout,
        free_errors=free_errors,
    )

    try:  # the services this sidecar runs beside its connections
        services = [IngestService(load_ingest_file(ingest_vllm))] if ingest_vllm else []
    except IngestFileError as error:
        typer.echo(f"kvledger serve: {error}", err=True)
        raise typer.Exit(code=2) from None

    def started(sidecar: Sidecar) -> None:
        where = sidecar.where()
        typer.echo(
            f"kvledger serving: log {where['log']}, socket {where['socket']}"
            + (f", tcp {where['tcp']}" if where["tcp"] else "")
            + (f", http {where['http']}/metrics /healthz /readyz" if where["http"] else ", http off")
            + "".join(f", ingesting vLLM {i.config.engine_id} on {i.endpoint}" for s in services for i in s.ingestors)
            + f", at global sequence {where['global_seq']}"
        )

    try:
        anyio.run(lambda: run_sidecar(config, services, on_started=started))
    except (ConfigError, LogError, OSError) as error:
        typer.echo(f"kvledger serve: {error}", err=True)
        raise typer.Exit(code=2 if isinstance(error, ConfigError) else 1) from None
    except BaseExceptionGroup as group:  # a task of the sidecar failed at start: e.g. an ingest endpoint taken
        found, _ = group.split((ConfigError, IngestFileError, LogError, OSError))
        if found is None:
            raise
        first = found.exceptions[0]
        while isinstance(first, BaseExceptionGroup):
            first = first.exceptions[0]
        typer.echo(f"kvledger serve: {first}", err=True)
        raise typer.Exit(code=2 if isinstance(first, (ConfigError, IngestFileError)) else 1) from None


@app.command()
def worker(
    engine: str = typer.Option(
        ..., "--engine", envvar="KVLEDGER_ENGINE", help="The engine whose decisions this worker executes."
    ),
    rank: int = typer.Option(..., "--rank", envvar="KVLEDGER_RANK", help="The tensor-parallel rank this worker serves."),
    socket_path: str | None = typer.Option(
        None,
        "--socket",
        envvar="KVLEDGER_SOCKET",
        help="The sidecar's Unix socket (default: kvledger.sock in the data directory).",
    ),
    tier: list[str] = typer.Option(
        [],
        "--tier",
        help="NAME=host, NAME=disk:DIR or NAME=mooncake:MASTER_HOST:PORT,METADATA_URL (repeatable); "
        "tiers not named live in host memory.",
    ),
    fsync: str = typer.Option(
        "always", "--fsync", envvar="KVLEDGER_FSYNC", help="Disk tiers: always (file and directory before rename) or never."
    ),
    state_dir: str | None = typer.Option(
        None,
        "--state-dir",
        envvar="KVLEDGER_WORKER_STATE",
        help="Where the worker keeps its acknowledged sequence (default: the data directory).",
    ),
    pools_dir: str | None = typer.Option(
        None,
        "--pools-dir",
        help="Map the engine's KV pools from the files pool-ID.kv in this directory (host memory shared with the "
        "engine process, e.g. under /dev/shm) instead of allocating pools of its own.",
    ),
) -> None:
    """Run a worker rank: execute the committed decisions (stores, loads, state copies) for it."""
    from pathlib import Path

    quiet_torch()
    from coordinator.client import Address, SidecarError, SidecarUnavailable, WorkerClient
    from events.log import data_dir
    from gpu.device import default_device
    from gpu.pools import DevicePools
    from gpu.tiers import DiskTier, HostTier, Tier, TierError
    from gpu.worker import Worker

    configure_json_logs()
    if fsync not in ("always", "never"):
        raise typer.BadParameter(f"{fsync!r} is not always or never", param_hint="--fsync")
    device = default_device()
    if pools_dir:  # the engine's pools, mapped from files: host memory
        import torch

        device = torch.device("cpu")
    configured: dict[str, str] = {}
    for item in tier:
        name, sep, where = item.partition("=")
        mooncake_ok = where.startswith("mooncake:") and len(where[9:].split(",")) == 2 and all(where[9:].split(","))
        if not sep or not name or not (where == "host" or where.startswith("disk:") or mooncake_ok):
            raise typer.BadParameter(
                f"{item!r} is not NAME=host, NAME=disk:DIR or NAME=mooncake:MASTER_HOST:PORT,METADATA_URL", param_hint="--tier"
            )
        configured[name] = where
    client = WorkerClient(Address(socket_path=socket_path or str(data_dir() / "kvledger.sock")), engine, rank)

    async def main() -> None:
        welcome = await client.welcome()
        while not welcome.pools:  # the engine has not declared itself yet
            await anyio.sleep(0.5)
            welcome = await client.welcome()
        tiers: dict[str, Tier] = {}
        unknown = sorted(set(configured) - set(welcome.tiers))
        if unknown:
            raise typer.BadParameter(f"engine {engine!r} has no tiers {unknown} (it has {welcome.tiers})", param_hint="--tier")
        for name in welcome.tiers:
            where = configured.get(name, "host")
            if where.startswith("disk:"):
                tiers[name] = DiskTier(name, Path(where[5:]) / f"rank-{rank}", device, fsync)  # type: ignore[arg-type]
            elif where.startswith("mooncake:"):
                from gpu.mooncake import MooncakeTier, connect

                master, metadata_url = where[9:].split(",")
                tiers[name] = MooncakeTier(name, connect(master, metadata_url), rank=rank, device=device)
            else:
                tiers[name] = HostTier(name, device)
        state = Path(state_dir) if state_dir else data_dir()
        state.mkdir(parents=True, exist_ok=True)
        runner = Worker(
            engine,
            rank,
            DevicePools(welcome.pools, device, welcome.kv_dtype or "uint8", directory=Path(pools_dir) if pools_dir else None),
            tiers,
            state / f"worker-{engine}-{rank}.json",
        )
        typer.echo(
            f"kvledger worker: engine {engine} rank {rank} on {device}, {welcome.kv_dtype} pools {[p.pool_id for p in welcome.pools]}, "
            f"tiers {sorted(tiers)}, resuming after sequence {runner.state.acked}"
        )
        await runner.run(client)

    try:
        anyio.run(main)
    except (SidecarError, SidecarUnavailable, OSError, TierError, ImportError) as error:
        typer.echo(f"kvledger worker: {error}", err=True)
        raise typer.Exit(code=1) from None
    except (anyio.BrokenResourceError, anyio.EndOfStream, anyio.ClosedResourceError) as error:
        typer.echo(f"kvledger worker: the sidecar closed the connection ({type(error).__name__})", err=True)
        raise typer.Exit(code=1) from None


@app.command()
def simulate(
    scenario: list[str] = typer.Option([], "--scenario", help="Run only these scenarios (repeatable; default: all)."),
    json_output: bool = typer.Option(False, "--json", help="Print one JSON object per run."),
    keep: str | None = typer.Option(None, "--keep", help="Keep each run's log under this directory (for `kvledger audit`)."),
    engines: int = typer.Option(0, "--engines", help="Run the mixed workload (the benchmark) with this many engines instead."),
    steps: int = typer.Option(200, "--steps", help="Steps per engine of the mixed workload."),
    seed: int = typer.Option(7, "--seed", help="The mixed workload's seed (the same seed runs the same way)."),
) -> None:
    """Run the seeds' failures as fault scenarios on a real sidecar and real workers, each with
    kvledger's protection on and off, and count wrong-KV reads from the bytes. With --engines:
    run the mixed workload instead and print its throughput and step latency."""
    quiet_torch()
    from pathlib import Path

    from coordinator.simulator.report import ALL_SCENARIOS as SCENARIOS
    from coordinator.simulator.report import mixed_workload, not_holding, run_scenarios, scenario_table, workload_table

    if engines:
        if engines < 1 or steps < 1:
            raise typer.BadParameter("--engines and --steps must be positive")
        structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(30))
        report = anyio.run(lambda: mixed_workload(engines=engines, steps=steps, seed=seed, keep=Path(keep) if keep else None))
        if json_output:
            typer.echo(msgspec.json.encode(report).decode())
        else:
            Console(width=200).print(
                workload_table(
                    report, f"kvledger simulate: mixed workload, {engines} engines x {steps} steps, every protection on"
                )
            )
        if report.wrong_reads:
            typer.echo(f"kvledger simulate: {report.wrong_reads} wrong-KV reads with every protection on", err=True)
            raise typer.Exit(code=1)
        return

    unknown = sorted(set(scenario) - set(SCENARIOS))
    if unknown:
        raise typer.BadParameter(f"unknown scenarios {unknown}; known: {sorted(SCENARIOS)}", param_hint="--scenario")
    chosen = [SCENARIOS[name] for name in scenario] or list(SCENARIOS.values())
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(30))  # warnings and up
    results = anyio.run(lambda: run_scenarios(chosen, Path(keep) if keep else None))
    if json_output:
        for on, off in results:
            typer.echo(msgspec.json.encode(on).decode())
            typer.echo(msgspec.json.encode(off).decode())
    else:
        Console(width=200).print(
            scenario_table(results, "kvledger simulate: wrong-KV reads counted from the bytes, protection off vs on")
        )
    failed = not_holding(results)
    if failed:
        typer.echo(f"kvledger simulate: scenarios that did not hold (on > 0 or off == 0): {failed}", err=True)
        raise typer.Exit(code=1)


if __name__ == "__main__":
    app()
