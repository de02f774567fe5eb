"""Helpers for the sidecar tests: a real sidecar on a real socket (in this process or as a
`kvledger serve` subprocess), engines that serve requests through it, raw frame access."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import AbstractAsyncContextManager, contextmanager
from pathlib import Path
from typing import Any

import anyio
from anyio.abc import ByteStream
from anyio.streams.buffered import BufferedByteReceiveStream

from coordinator import unix_streams
from coordinator.client import Address, EngineClient
from coordinator.core.commands import AllocateBlocks, DeclareEngine, FinishOwner, MarkComputed, StartOwner, StartStore
from coordinator.sidecar import protocol as p
from coordinator.sidecar.embedded import embedded_sidecar
from coordinator.sidecar.server import Sidecar
from events import BlockRef, BlocksAllocated, OwnerStarted, PoolSpec, Refused, StoreJobStarted, TierSpec
from events.log import EventLog
from tests.kit import builders as b

ROOT = Path(__file__).resolve().parents[2]
TIER_SPEC = TierSpec(name=b.TIER, num_slots=4096, bytes_per_slot=64)


def declaration(
    engine_id: str, *, num_blocks: int = 256, world_size: int = 2, pools: list[PoolSpec] | None = None
) -> DeclareEngine:
    pools = pools or [b.attention_pool(num_blocks=num_blocks)]
    return DeclareEngine(
        engine_id=engine_id,
        namespace=b.namespace(block_sizes=tuple(x.block_size for x in pools), tp=world_size),
        pools=pools,
        world_size=world_size,
        tiers=[b.TIER],
    )


def engine_client(socket_path: Path, engine_id: str, **kw: object) -> EngineClient:
    """An engine's client on `socket_path`, declaring `engine_id` (`declaration`) and the test tier."""
    return EngineClient(Address(socket_path=str(socket_path)), declaration(engine_id, **kw), tiers=[TIER_SPEC])  # type: ignore[arg-type]


def sidecar_on(event_log: EventLog, socket_path: Path, **options: Any) -> AbstractAsyncContextManager[Sidecar]:
    """A sidecar serving `event_log` on `socket_path` in this process, stopped (drained) after."""
    return embedded_sidecar(event_log, socket_path, **options)


class Engine:
    """An engine driving requests through the sidecar: admit, allocate, compute, store, finish."""

    def __init__(self, client: EngineClient) -> None:
        self.client = client
        self.step_no = 0
        self.clock = 0.0
        self.results: list[p.StepResult] = []

    async def step(self, commands: list[object], **kw: object) -> p.StepResult:
        self.step_no += 1
        self.clock += 0.01
        result = await self.client.step(self.step_no, self.clock, commands, **kw)  # type: ignore[arg-type]
        self.results.append(result)
        refused = [e for r in result.results for e in r if isinstance(e, Refused)]
        assert not refused, refused
        return result

    async def request(self, index: int, blocks: int = 2) -> StoreJobStarted:
        """One request: admitted, given blocks, computed and stored; returns the store decision."""
        engine_id = self.client.engine_id
        first = await self.step([StartOwner(engine_id=engine_id, req_id=f"{engine_id}-req-{index}")])
        owner = next(e for e in first.results[0] if isinstance(e, OwnerStarted)).owner_id
        alloc = await self.step([AllocateBlocks(engine_id=engine_id, owner_id=owner, pool_id=0, count=blocks)])
        refs: list[BlockRef] = next(e for e in alloc.results[0] if isinstance(e, BlocksAllocated)).blocks
        tokens = [hash((engine_id, index, i)) % 50_000 for i in range(blocks * b.BLOCK)]
        stored = await self.step(
            [
                MarkComputed(engine_id=engine_id, owner_id=owner, blocks=refs, token_ids=tokens),
                StartStore(engine_id=engine_id, tier=b.TIER, blocks=refs),
                FinishOwner(engine_id=engine_id, owner_id=owner),
            ]
        )
        [decision] = stored.decisions
        assert isinstance(decision.event, StoreJobStarted)
        return decision.event


class RawConnection:
    """Frames by hand, for what a well-behaved client never sends."""

    def __init__(self, stream: ByteStream) -> None:
        self.stream = stream
        self.reader = BufferedByteReceiveStream(stream)

    @classmethod
    async def open(cls, socket_path: Path) -> RawConnection:
        return cls(await unix_streams.connect_unix(socket_path))

    async def send_bytes(self, data: bytes) -> None:
        await self.stream.send(data)

    async def send(self, message: p.Message) -> None:
        await self.stream.send(p.frame(message))

    async def receive(self) -> p.ServerMessage:
        with anyio.fail_after(10):
            length = int.from_bytes(await self.reader.receive_exactly(p.HEADER_BYTES), "big")
            return p.decode_server(await self.reader.receive_exactly(length))

    async def closed(self) -> bool:
        """True when the server closed the connection (reading hits end of stream)."""
        try:
            with anyio.fail_after(5):
                await self.reader.receive_exactly(1)
        except (anyio.EndOfStream, anyio.IncompleteRead, anyio.BrokenResourceError, ConnectionError):
            return True
        return False

    async def hello(self, **fields: object) -> p.ServerMessage:
        await self.send(p.Hello(protocol=p.PROTOCOL_VERSION, **fields))  # type: ignore[arg-type]
        return await self.receive()

    async def aclose(self) -> None:
        await self.stream.aclose()


# --- `kvledger serve` as a real process ---------------------------------------------------------


class ServeProcess:
    def __init__(self, directory: Path, *extra: str, env: dict[str, str] | None = None, log: str | None = None) -> None:
        """`log`: the log's URL (default: log.sqlite in `directory`)."""
        self.directory = directory
        self.socket = directory / "kvledger.sock"
        self.log_path = directory / "log.sqlite"
        self.stderr_path = directory / "serve.stderr"
        self.args = [
            sys.executable,
            "-m",
            "coordinator.cli",
            "serve",
            "--socket",
            str(self.socket),
            "--log",
            log or str(self.log_path),
            "--http",
            "off",
            *extra,
        ]
        self.env = {**os.environ, "KVLEDGER_DATA_DIR": str(directory), **(env or {})}
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout: float = 30.0) -> None:
        self.socket.unlink(missing_ok=True)
        stderr = open(self.stderr_path, "ab")  # noqa: SIM115 - kept open by the child
        self.proc = subprocess.Popen(self.args, cwd=ROOT, env=self.env, stdout=subprocess.PIPE, stderr=stderr)
        stderr.close()
        deadline = time.monotonic() + timeout
        while not self.socket.exists():
            if self.proc.poll() is not None:
                raise RuntimeError(f"kvledger serve exited {self.proc.returncode}: {self.stderr()}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"kvledger serve did not open {self.socket} in {timeout} s: {self.stderr()}")
            time.sleep(0.02)

    def signal(self, signum: signal.Signals) -> None:
        assert self.proc is not None
        self.proc.send_signal(signum)

    def wait(self, timeout: float = 30.0) -> int:
        assert self.proc is not None
        return self.proc.wait(timeout)

    def stdout(self) -> str:
        assert self.proc is not None and self.proc.stdout is not None
        return self.proc.stdout.read().decode()

    def stderr(self) -> str:
        return self.stderr_path.read_text() if self.stderr_path.exists() else ""

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)


@contextmanager
def serve_process(directory: Path, *extra: str, env: dict[str, str] | None = None) -> Iterator[ServeProcess]:
    server = ServeProcess(directory, *extra, env=env)
    try:
        server.start()
        yield server
    finally:
        server.kill()
