"""`kvledger ingest vllm`: record a running vLLM's KV events in a ledger (observer mode).

    kvledger ingest vllm --endpoint tcp://127.0.0.1:5557 --replay tcp://127.0.0.1:5558 --topic kv \\
        --engine-id vllm-0 --log ingest.sqlite --model-id org/model --weights-revision sha256:... \\
        --tokenizer-digest sha256:... --block-size 16

vLLM is started with `--kv-events-config '{"enable_kv_cache_events": true, "publisher": "zmq",
"endpoint": "tcp://127.0.0.1:5557", "replay_endpoint": "tcp://*:5558", "topic": "kv"}'`: its PUB
socket connects to --endpoint, which this command binds, and its ROUTER binds the replay port.
One command per data-parallel rank (vLLM publishes rank r on port + r), each its own --engine-id.

The ledger this writes must have no other writer (not a running sidecar's log): two writers'
states would fork from the log. Afterwards `kvledger audit hash HEX --log ...` answers when each
block hash was stored and removed, and `kvledger audit refusals` lists what was refused.
"""

from __future__ import annotations

import signal

import anyio
import typer

from coordinator.cli._common import configure_json_logs
from coordinator.core.keys import namespace_problems
from events import NamespaceSpec

ingest_app = typer.Typer(help="Record an engine's own KV events in the ledger (observer mode).", no_args_is_help=True)


@ingest_app.command("vllm")
def vllm(
    endpoint: str = typer.Option(
        ...,
        "--endpoint",
        help="Bind this ZMQ endpoint; vLLM's KV-event publisher connects to it (its kv_events_config endpoint).",
    ),
    engine_id: str = typer.Option(..., "--engine-id", help="The engine's id in the ledger (one per data-parallel rank)."),
    log_url: str | None = typer.Option(
        None,
        "--log",
        envvar="KVLEDGER_LOG",
        help="SQLite path or URL, or PostgreSQL URL, written by nothing else (default: the data directory's SQLite file).",
    ),
    replay: str | None = typer.Option(None, "--replay", help="vLLM's replay endpoint (its ROUTER), asked for missed batches."),
    topic: str = typer.Option("", "--topic", help="vLLM's kv_events_config topic (default: any)."),
    model_id: str = typer.Option(..., "--model-id", help="Namespace: the model vLLM serves."),
    weights_revision: str = typer.Option(..., "--weights-revision", help="Namespace: a digest of the exact checkpoint."),
    tokenizer_digest: str = typer.Option(
        ..., "--tokenizer-digest", help="Namespace: a digest of the tokenizer files, template and special-token rules."
    ),
    block_size: list[int] = typer.Option(
        ..., "--block-size", min=1, help="Namespace: tokens per block of each KV-cache group, in group order (repeat per group)."
    ),
    kv_dtype: str = typer.Option("auto", "--kv-dtype", help="Namespace: vLLM's kv_cache_dtype."),
    kv_layout_version: int = typer.Option(1, "--kv-layout-version", min=0, help="Namespace: the KV layout version."),
    hash_algorithm: str = typer.Option(
        "vllm:sha256", "--hash-algorithm", help="Namespace: vLLM's prefix_caching_hash_algo, as vllm:NAME."
    ),
    tensor_parallel_size: int = typer.Option(1, "--tensor-parallel-size", min=1, help="Namespace."),
    pipeline_parallel_size: int = typer.Option(1, "--pipeline-parallel-size", min=1, help="Namespace."),
    tenant: str = typer.Option("default", "--tenant", help="Namespace: the sharing boundary (I9)."),
    adapter_id: str = typer.Option("", "--adapter-id", help="Namespace: a LoRA adapter's id."),
    adapter_revision: str = typer.Option("", "--adapter-revision", help="Namespace: the adapter's revision."),
    replay_timeout: float = typer.Option(
        2.0, "--replay-timeout", min=0.01, max=3600.0, help="Seconds to wait for each replayed batch."
    ),
    progress_every: float = typer.Option(10.0, "--progress-every", min=0.1, help="Seconds between progress log lines."),
) -> None:
    """Subscribe to a vLLM engine's KV events and record them: blocks stored, removed and cleared,
    per incarnation, medium and group, with gaps, restarts and refusals. Stops on SIGTERM/SIGINT."""
    from coordinator.ledger.ledger import Ledger
    from coordinator.vllm.ingest import IngestConfig, Ingestor
    from events.log import LogError, open_log

    namespace = NamespaceSpec(
        model_id=model_id,
        weights_revision=weights_revision,
        tokenizer_digest=tokenizer_digest,
        kv_dtype=kv_dtype,
        kv_layout_version=kv_layout_version,
        block_sizes=tuple(block_size),
        tensor_parallel_size=tensor_parallel_size,
        pipeline_parallel_size=pipeline_parallel_size,
        tenant=tenant,
        hash_algorithm=hash_algorithm,
        adapter_id=adapter_id,
        adapter_revision=adapter_revision,
    )
    problems = namespace_problems(namespace)
    if problems:
        typer.echo(f"kvledger ingest vllm: the namespace is not usable: {'; '.join(problems)}", err=True)
        raise typer.Exit(code=2)
    if not engine_id.strip():
        typer.echo("kvledger ingest vllm: --engine-id is empty", err=True)
        raise typer.Exit(code=2)
    configure_json_logs()
    config = IngestConfig(
        endpoint=endpoint,
        engine_id=engine_id,
        namespace=namespace,
        topic=topic,
        replay=replay,
        replay_timeout=replay_timeout,
        progress_every=progress_every,
    )

    async def main() -> None:
        event_log = await open_log(log_url)
        try:
            ledger = await Ledger.open(event_log)
            ingestor = Ingestor(ledger, config)
            async with anyio.create_task_group() as tg:

                async def watch_signals() -> None:
                    with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
                        async for _ in signals:
                            ingestor.stop()
                            return

                tg.start_soon(watch_signals)

                def ready(running: Ingestor) -> None:
                    typer.echo(
                        f"kvledger ingest vllm: engine {engine_id} bound {running.endpoint}, "
                        f"log {event_log.url}, expecting batch {running.stats.expected}"
                    )

                await ingestor.run(on_ready=ready)
                tg.cancel_scope.cancel()
            await ledger.close()
        finally:
            with anyio.CancelScope(shield=True):
                await event_log.close()

    import zmq

    try:
        anyio.run(main)
    except (LogError, OSError, zmq.ZMQError) as error:
        typer.echo(f"kvledger ingest vllm: {error}", err=True)
        raise typer.Exit(code=1) from None
