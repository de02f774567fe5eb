"""The client library engines and workers use to talk to `kvledger serve`.

`EngineClient` (async) declares the engine in its Hello and sends steps. Each step carries a
command id; if the connection drops or the sidecar restarts while a step is in flight, the
client reconnects (as the same incarnation, so nothing is fenced) and sends the step again with
the same id: the sidecar either commits it now or returns the committed result, never twice.
`SyncEngineClient` wraps it for engines that are not async (a vLLM scheduler).

`WorkerClient` subscribes to the committed decisions for one (engine, rank) and resumes after
the last decision it handed out, on a reconnect or after being cut off as a slow subscriber.

`OperatorClient` sends an operator's commands (namespace decisions, `kvledger namespace`).
"""

from __future__ import annotations

import math
from collections.abc import AsyncIterator, Sequence
from types import TracebackType
from typing import Any, TypeVar

import anyio
import structlog
import uuid_utils
from anyio.abc import ByteStream
from anyio.from_thread import BlockingPortal, start_blocking_portal
from anyio.streams.buffered import BufferedByteReceiveStream

from coordinator.commands import AnyCommand, DeclareEngine, ReportRank
from coordinator.sidecar import protocol as p
from events import EngineReset, TierSpec

log = structlog.get_logger("kvledger.client")

R = TypeVar("R", bound=p.Message)

RETRY_CODES = frozenset({p.ErrorCode.SHUTTING_DOWN, p.ErrorCode.COMMIT_FAILED})
"""Errors after which the same request, with the same command id, is safe to send again."""


class SidecarError(Exception):
    """The sidecar answered with an Error."""

    def __init__(self, error: p.Error) -> None:
        super().__init__(f"{error.code}: {error.message}")
        self.code = error.code
        self.fatal = error.fatal
        self.resume_from = error.resume_from


class SidecarUnavailable(Exception):
    """The sidecar could not be reached (or stayed unreachable past the retry deadline)."""


class Address:
    """Where the sidecar listens: a Unix socket path, or TCP host and port (with a token)."""

    def __init__(self, socket_path: str | None = None, tcp: tuple[str, int] | None = None, token: str = "") -> None:
        if (socket_path is None) == (tcp is None):
            raise ValueError("give exactly one of socket_path and tcp")
        self.socket_path = socket_path
        self.tcp = tcp
        self.token = token

    async def connect(self) -> ByteStream:
        if self.socket_path is not None:
            return await anyio.connect_unix(self.socket_path)
        assert self.tcp is not None
        return await anyio.connect_tcp(*self.tcp)

    def __str__(self) -> str:
        return self.socket_path or f"{self.tcp[0]}:{self.tcp[1]}"  # type: ignore[index]


class _Channel:
    """One connection: frames out, frames in."""

    def __init__(self, stream: ByteStream, max_frame: int) -> None:
        self.stream = stream
        self.reader = BufferedByteReceiveStream(stream)
        self.max_frame = max_frame

    async def send(self, message: p.Message) -> None:
        await self.stream.send(p.frame(message))

    async def receive(self) -> p.ServerMessage:
        length = p.frame_length(await self.reader.receive_exactly(p.HEADER_BYTES), self.max_frame)
        return p.decode_server(await self.reader.receive_exactly(length))

    async def aclose(self) -> None:
        await self.stream.aclose()


_LOST = (OSError, anyio.EndOfStream, anyio.IncompleteRead, anyio.BrokenResourceError, anyio.ClosedResourceError)


class EngineClient:
    def __init__(
        self, address: Address, declare: DeclareEngine, *, tiers: Sequence[TierSpec] = (),
        retry_for: float = 30.0, reply_timeout: float = 30.0, max_frame: int = p.DEFAULT_MAX_FRAME,
    ) -> None:
        self.address = address
        self.reply_timeout = reply_timeout
        """Seconds to wait for one reply; past it the connection counts as lost and the request
        is sent again (with the same command id) on a new one."""
        self.declare = declare
        self.engine_id = declare.engine_id
        self.tiers = list(tiers)
        self.retry_for = retry_for
        """Seconds a request keeps retrying through reconnects before SidecarUnavailable."""
        self.max_frame = max_frame
        self.incarnation = 0
        """0 until the first Welcome; then the incarnation this client runs (kept on reconnect)."""
        self.welcome: p.Welcome | None = None
        self.reconnects = 0
        """Connections opened after the first (a dropped socket, a restarted sidecar)."""
        self._channel: _Channel | None = None
        self._lock = anyio.Lock()

    async def __aenter__(self) -> EngineClient:
        await self.connect()
        return self

    async def __aexit__(self, *_: object) -> None:
        await self.aclose()

    async def connect(self) -> p.Welcome:
        async with self._lock:
            return await self._connect()

    async def _connect(self) -> p.Welcome:
        stream = await self.address.connect()
        channel = _Channel(stream, self.max_frame)
        first = self.incarnation == 0
        hello = p.Hello(protocol=p.PROTOCOL_VERSION, role="engine", engine_id=self.engine_id, token=self.address.token,
                        declare=self.declare if first else None, incarnation=self.incarnation, tiers=self.tiers if first else [])
        try:
            with anyio.fail_after(self.reply_timeout):
                await channel.send(hello)
                reply = await channel.receive()
        except BaseException:
            await channel.aclose()
            raise
        if isinstance(reply, p.Error):
            await channel.aclose()
            raise SidecarError(reply)
        assert isinstance(reply, p.Welcome), reply
        self.incarnation = reply.incarnation
        self.welcome = reply
        self.reconnects += not first
        self._channel = channel
        log.info("connected", engine=self.engine_id, incarnation=reply.incarnation, address=str(self.address), reconnect=not first)
        return reply

    async def step(self, step: int, clock: float, commands: Sequence[AnyCommand], *, command_id: str | None = None) -> p.StepResult:
        """Commit one scheduler step; safe through reconnects (the command id makes it exactly once)."""
        message = p.Step(step=step, clock=clock, commands=list(commands), command_id=command_id or uuid_utils.uuid7().hex)
        return await self._request(message, p.StepResult)

    async def execute(self, command: AnyCommand, *, command_id: str | None = None) -> p.Committed:
        return await self._request(p.Execute(command=command, command_id=command_id or uuid_utils.uuid7().hex), p.Committed)

    async def report(self, report: ReportRank, *, command_id: str | None = None) -> p.Committed:
        return await self._request(p.Report(report=report, command_id=command_id or uuid_utils.uuid7().hex), p.Committed)

    async def lookup(self, tier: str, token_ids: Sequence[int], extra_keys: Sequence[str] = ()) -> p.LookupResult:
        return await self._request(p.Lookup(tier=tier, token_ids=list(token_ids), extra_keys=list(extra_keys)), p.LookupResult)

    async def health(self) -> p.HealthResult:
        return await self._request(p.Health(), p.HealthResult)

    async def _request(self, message: p.Message, expected: type[R]) -> R:
        deadline = anyio.current_time() + self.retry_for
        delay = 0.05
        async with self._lock:
            while True:
                try:
                    if self._channel is None:
                        await self._connect()
                    assert self._channel is not None
                    with anyio.fail_after(self.reply_timeout):
                        await self._channel.send(message)
                        reply = await self._channel.receive()
                except (*_LOST, TimeoutError) as lost:
                    await self._drop()
                    problem: str = f"{type(lost).__name__}: {lost}"
                else:
                    if isinstance(reply, expected):
                        self._follow_resets(reply)
                        return reply
                    if isinstance(reply, p.Error):
                        if reply.code not in RETRY_CODES:
                            if reply.fatal:
                                await self._drop()
                            raise SidecarError(reply)
                        await self._drop()
                        problem = f"{reply.code}: {reply.message}"
                    else:
                        raise SidecarError(p.Error(code=p.ErrorCode.INVALID_MESSAGE, message=f"unexpected reply {reply!r}"))
                if anyio.current_time() >= deadline:
                    raise SidecarUnavailable(f"sidecar at {self.address} unavailable for {self.retry_for} s: {problem}")
                log.warning("retrying", engine=self.engine_id, request=type(message).__name__, error=problem, delay=delay)
                await anyio.sleep(delay)
                delay = min(delay * 2, 1.0)

    def _follow_resets(self, reply: p.Message) -> None:
        """A committed cache reset (ResetCache) begins a new incarnation of this engine: a later
        reconnect must name it, or the sidecar takes the Hello for a stale engine (found by the
        soak: after a reset and a serve restart the engine could not reconnect)."""
        if isinstance(reply, p.StepResult):
            events: list[Any] = [*reply.began, *(e for result in reply.results for e in result), *reply.ended]
        elif isinstance(reply, p.Committed):
            events = list(reply.events)
        else:
            return
        for event in events:
            if isinstance(event, EngineReset) and event.engine_id == self.engine_id and event.incarnation > self.incarnation:
                log.info("incarnation_advanced", engine=self.engine_id, incarnation=event.incarnation, reason=event.reason)
                self.incarnation = event.incarnation

    async def _drop(self) -> None:
        if self._channel is not None:
            with anyio.CancelScope(shield=True):
                try:
                    await self._channel.aclose()
                except _LOST:
                    pass
            self._channel = None

    async def aclose(self) -> None:
        async with self._lock:
            await self._drop()


class WorkerClient:
    """Decisions for one (engine, rank), in order, each once, across reconnects."""

    def __init__(self, address: Address, engine_id: str, rank: int, *, retry_for: float = 30.0,
                 max_frame: int = p.DEFAULT_MAX_FRAME) -> None:
        self.address = address
        self.engine_id = engine_id
        self.rank = rank
        self.retry_for = retry_for
        self.max_frame = max_frame
        self.last_seq = 0
        """The sequence of the last decision handed out; a resubscription starts after it."""
        self.resumes = 0
        """How many times the stream was resumed (a reconnect or a slow-subscriber cut)."""
        self.last_welcome: p.Welcome | None = None

    async def welcome(self) -> p.Welcome:
        """Hello as this worker; the Welcome names the engine's pools once it is declared."""
        channel = await self._open()
        await channel.aclose()
        assert self.last_welcome is not None
        return self.last_welcome

    async def _open(self) -> _Channel:
        channel = _Channel(await self.address.connect(), self.max_frame)
        try:
            with anyio.fail_after(self.retry_for):
                await channel.send(p.Hello(protocol=p.PROTOCOL_VERSION, role="worker", engine_id=self.engine_id,
                                           rank=self.rank, token=self.address.token))
                reply = await channel.receive()
        except BaseException:
            await channel.aclose()
            raise
        if isinstance(reply, p.Error):
            await channel.aclose()
            raise SidecarError(reply)
        assert isinstance(reply, p.Welcome), reply
        self.last_welcome = reply
        return channel

    async def decisions(self, from_seq: int | None = None) -> AsyncIterator[p.Decision]:
        """Every committed decision for this rank after `from_seq` (default: the last one handed
        out), forever. Reconnects and resubscribes on its own."""
        if from_seq is not None:
            self.last_seq = from_seq
        deadline = math.inf
        while True:
            channel: _Channel | None = None
            try:
                channel = await self._open()
                await channel.send(p.Subscribe(from_seq=self.last_seq))
                deadline = math.inf
                while True:
                    message = await channel.receive()
                    if isinstance(message, p.Decisions):
                        for decision in message.items:
                            if decision.seq > self.last_seq:
                                self.last_seq = decision.seq
                                yield decision
                    elif isinstance(message, p.Error):
                        if message.code != p.ErrorCode.SLOW_SUBSCRIBER:
                            raise SidecarError(message)
                        log.warning("resubscribing", engine=self.engine_id, rank=self.rank, reason=message.code.value,
                                    resume_from=message.resume_from)
                        break
            except (*_LOST, TimeoutError) as lost:
                if deadline == math.inf:
                    deadline = anyio.current_time() + self.retry_for
                if anyio.current_time() >= deadline:
                    raise SidecarUnavailable(f"sidecar at {self.address} unavailable for {self.retry_for} s: {lost}") from lost
                await anyio.sleep(0.05)
            finally:
                if channel is not None:
                    with anyio.CancelScope(shield=True):
                        try:
                            await channel.aclose()
                        except _LOST:
                            pass
            self.resumes += 1

    async def report(self, report: ReportRank, *, command_id: str | None = None) -> p.Committed:
        """Send one (job, rank) report on a short connection of its own; retried on loss."""
        message = p.Report(report=report, command_id=command_id or uuid_utils.uuid7().hex)
        deadline = anyio.current_time() + self.retry_for
        while True:
            try:
                channel = await self._open()
                try:
                    await channel.send(message)
                    reply = await channel.receive()
                finally:
                    await channel.aclose()
            except _LOST as lost:
                if anyio.current_time() >= deadline:
                    raise SidecarUnavailable(f"sidecar at {self.address} unavailable: {lost}") from lost
                await anyio.sleep(0.05)
                continue
            if isinstance(reply, p.Committed):
                return reply
            assert isinstance(reply, p.Error), reply
            if reply.code not in RETRY_CODES or anyio.current_time() >= deadline:
                raise SidecarError(reply)
            await anyio.sleep(0.05)


class OperatorClient:
    """An operator's connection: Execute of operator commands (coordinator.commands.OPERATOR_COMMANDS),
    each on a short connection of its own, retried with the same command id through a lost
    connection or a restarting sidecar (the id makes it exactly once)."""

    def __init__(self, address: Address, *, retry_for: float = 30.0, reply_timeout: float = 30.0,
                 max_frame: int = p.DEFAULT_MAX_FRAME) -> None:
        self.address = address
        self.retry_for = retry_for
        self.reply_timeout = reply_timeout
        self.max_frame = max_frame

    async def execute(self, command: AnyCommand, *, command_id: str | None = None) -> p.Committed:
        message = p.Execute(command=command, command_id=command_id or uuid_utils.uuid7().hex)
        deadline = anyio.current_time() + self.retry_for
        while True:
            try:
                reply = await self._exchange(message)
            except (*_LOST, TimeoutError) as lost:
                if anyio.current_time() >= deadline:
                    raise SidecarUnavailable(f"sidecar at {self.address} unavailable for {self.retry_for} s: {lost}") from lost
                await anyio.sleep(0.05)
                continue
            if isinstance(reply, p.Committed):
                return reply
            if not isinstance(reply, p.Error):
                raise SidecarError(p.Error(code=p.ErrorCode.INVALID_MESSAGE, message=f"unexpected reply {reply!r}"))
            if reply.code not in RETRY_CODES or anyio.current_time() >= deadline:
                raise SidecarError(reply)
            await anyio.sleep(0.05)

    async def _exchange(self, message: p.Message) -> p.ServerMessage:
        channel = _Channel(await self.address.connect(), self.max_frame)
        try:
            with anyio.fail_after(self.reply_timeout):
                await channel.send(p.Hello(protocol=p.PROTOCOL_VERSION, role="operator", token=self.address.token))
                welcome = await channel.receive()
                if not isinstance(welcome, p.Welcome):
                    return welcome
                await channel.send(message)
                return await channel.receive()
        finally:
            with anyio.CancelScope(shield=True):
                try:
                    await channel.aclose()
                except _LOST:
                    pass


class SyncEngineClient:
    """EngineClient for code that is not async: its event loop runs in a background thread."""

    def __init__(self, address: Address, declare: DeclareEngine, **options: Any) -> None:
        self._portal_cm = start_blocking_portal()
        self._portal: BlockingPortal = self._portal_cm.__enter__()
        self._client = EngineClient(address, declare, **options)
        try:
            self.welcome = self._portal.call(self._client.connect)
        except BaseException:
            self._portal_cm.__exit__(None, None, None)
            raise

    @property
    def incarnation(self) -> int:
        return self._client.incarnation

    def step(self, step: int, clock: float, commands: Sequence[AnyCommand], *, command_id: str | None = None) -> p.StepResult:
        return self._portal.call(lambda: self._client.step(step, clock, commands, command_id=command_id))

    def execute(self, command: AnyCommand, *, command_id: str | None = None) -> p.Committed:
        return self._portal.call(lambda: self._client.execute(command, command_id=command_id))

    def report(self, report: ReportRank, *, command_id: str | None = None) -> p.Committed:
        return self._portal.call(lambda: self._client.report(report, command_id=command_id))

    def lookup(self, tier: str, token_ids: Sequence[int], extra_keys: Sequence[str] = ()) -> p.LookupResult:
        return self._portal.call(lambda: self._client.lookup(tier, token_ids, extra_keys))

    def health(self) -> p.HealthResult:
        return self._portal.call(self._client.health)

    def close(self) -> None:
        try:
            self._portal.call(self._client.aclose)
        finally:
            self._portal_cm.__exit__(None, None, None)

    def __enter__(self) -> SyncEngineClient:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.close()
