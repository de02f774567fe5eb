"""`kvledger serve --ingest-vllm FILE`: record vLLM engines' KV events inside the sidecar.

A separate `kvledger ingest vllm` must be its log's only writer. Inside `serve`, ingestion commits
through the sidecar's own group commit (Committer.submit_all), beside the engines' steps, so one
log has one writer and the sidecar's state holds what was observed.

FILE is TOML, one `[[engine]]` table per vLLM engine (per data-parallel rank), with the fields of
`kvledger ingest vllm`'s options:

    [[engine]]
    engine_id = "vllm-0"
    endpoint = "tcp://127.0.0.1:5557"        # bound here; vLLM's kv_events_config endpoint
    replay = "tcp://127.0.0.1:5558"          # optional: vLLM's replay_endpoint
    topic = "kv"                             # optional
    [engine.namespace]
    model_id = "org/model"
    weights_revision = "sha256:..."
    tokenizer_digest = "sha256:..."
    kv_dtype = "auto"
    kv_layout_version = 1
    block_sizes = [16]
    tensor_parallel_size = 1
    tenant = "default"
    hash_algorithm = "vllm:sha256"

A file that cannot be used (unknown keys, a missing field, an unusable namespace, two engines on
one id or one endpoint) stops `serve` before it starts, naming the file and what is wrong.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import anyio
import anyio.abc
import msgspec
import structlog
import zmq

from coordinator.core.keys import namespace_problems
from coordinator.core.state import State
from coordinator.ledger.ledger import Commit, Ledger, StepCommit, Submission, SubmitAll
from coordinator.vllm.ingest import IngestConfig, Ingestor
from events import NamespaceSpec

log = structlog.get_logger("kvledger.ingest")


class IngestFileError(ValueError):
    """The --ingest-vllm file cannot be used; the message names the file and the problem."""


class _Entry(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    engine_id: str
    endpoint: str
    namespace: NamespaceSpec
    topic: str = ""
    replay: str | None = None
    replay_timeout: float = 2.0


class _File(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    engine: list[_Entry]


def load_ingest_file(path: str | Path) -> list[IngestConfig]:
    """The ingestion configs of a TOML file, or IngestFileError."""
    try:
        text = Path(path).read_bytes()
    except OSError as error:
        raise IngestFileError(f"--ingest-vllm {path}: {error.strerror or error}") from None
    try:
        parsed = msgspec.toml.decode(text, type=_File)
    except msgspec.DecodeError as error:  # ValidationError too: it names the field, e.g. `$.engine[0].namespace`
        raise IngestFileError(f"--ingest-vllm {path}: {error}") from None
    if not parsed.engine:
        raise IngestFileError(f"--ingest-vllm {path}: no [[engine]] table")
    configs, seen_ids, seen_endpoints = [], set(), set()
    for index, entry in enumerate(parsed.engine):
        where = f"--ingest-vllm {path}: engine {index} ({entry.engine_id!r})"
        if not entry.engine_id.strip():
            raise IngestFileError(f"{where}: engine_id is empty")
        problems = namespace_problems(entry.namespace)
        if problems:
            raise IngestFileError(f"{where}: the namespace is not usable: {'; '.join(problems)}")
        if entry.engine_id in seen_ids:
            raise IngestFileError(f"{where}: engine_id {entry.engine_id!r} is listed twice")
        if entry.endpoint in seen_endpoints and not entry.endpoint.endswith(":*"):  # ":*": any free port, each its own
            raise IngestFileError(f"{where}: endpoint {entry.endpoint!r} is listed twice")
        problem = _endpoint_problem(entry.replay) if entry.replay is not None else None
        if problem is not None:  # (the bound endpoint is checked by binding it, before serve starts)
            raise IngestFileError(f"{where}: replay {entry.replay!r} is not a ZMQ endpoint: {problem}")
        seen_ids.add(entry.engine_id)
        seen_endpoints.add(entry.endpoint)
        configs.append(
            IngestConfig(
                endpoint=entry.endpoint,
                engine_id=entry.engine_id,
                namespace=entry.namespace,
                topic=entry.topic,
                replay=entry.replay,
                replay_timeout=entry.replay_timeout,
            )
        )
    return configs


def _endpoint_problem(endpoint: str) -> str | None:
    """Why ZMQ would refuse `endpoint` (checked by connecting a throwaway socket: connecting needs
    no peer), or None. A bad replay endpoint otherwise surfaced only at the first gap, hours later."""
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
    probe = context.socket(zmq.DEALER)
    try:
        probe.setsockopt(zmq.LINGER, 0)
        probe.connect(endpoint)
    except zmq.ZMQError as error:
        return str(error)
    finally:
        probe.close(linger=0)
    return None


class SidecarLedger:
    """The sidecar's ledger, committed to through its group commit (an `IngestLedger`)."""

    def __init__(self, ledger: Ledger, submit_all: SubmitAll) -> None:
        self.ledger = ledger
        self.submit_all = submit_all

    @property
    def state(self) -> State:
        return self.ledger.state

    @property
    def last_seq(self) -> int:
        return self.ledger.last_seq

    async def commit_group(self, transactions: Sequence[Submission]) -> list[StepCommit | Commit]:
        return await self.submit_all(transactions)


class IngestService:
    """`kvledger serve --ingest-vllm`: one Ingestor per config on the sidecar's ledger, committing
    through its group commit. A sidecar service (`coordinator.sidecar.server.Service`): the CLI
    composes it and hands it to the sidecar, which knows nothing of vLLM."""

    def __init__(self, configs: Sequence[IngestConfig]) -> None:
        self.configs = list(configs)
        self.ingestors: list[Ingestor] = []
        """The running ingestors, once started (each has bound its endpoint)."""

    async def __call__(
        self,
        ledger: Ledger,
        submit_all: SubmitAll,
        stop: anyio.Event,
        *,
        task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED,
    ) -> None:
        """Run until `stop` is set; each ingestor commits what it holds before this returns.
        Started (task_status) once every one has bound its endpoint."""
        ingestors = [Ingestor(SidecarLedger(ledger, submit_all), config) for config in self.configs]
        bound = anyio.Event()
        ready: list[Ingestor] = []

        def on_ready(ingestor: Ingestor) -> None:
            ready.append(ingestor)
            if len(ready) == len(ingestors):
                bound.set()

        async def run(ingestor: Ingestor) -> None:
            try:
                await ingestor.run(on_ready=on_ready)
            except zmq.ZMQError as error:
                if ingestor not in ready:  # e.g. the endpoint is taken: say which engine and where
                    raise IngestFileError(
                        f"--ingest-vllm: engine {ingestor.config.engine_id!r} cannot bind {ingestor.config.endpoint}: {error}"
                    ) from None
                log.error("ingest_failed", engine=ingestor.config.engine_id, error=f"{type(error).__name__}: {error}")
            except Exception as error:  # noqa: BLE001 - one engine's ingestion must not stop the sidecar serving the rest
                if ingestor not in ready:
                    raise
                log.error("ingest_failed", engine=ingestor.config.engine_id, error=f"{type(error).__name__}: {error}")

        async with anyio.create_task_group() as tasks:
            for ingestor in ingestors:
                tasks.start_soon(run, ingestor)
            if ingestors:
                await bound.wait()
            self.ingestors = ingestors
            task_status.started()
            await stop.wait()
            for ingestor in ingestors:
                ingestor.stop()
