"""The client library engines and workers use to talk to `kvledger serve`.

`EngineClient` (async) declares the engine in its Hello and sends steps. Each step carries a
command id; if the connection drops or the sidecar restarts while a step is in flight, the
client reconnects (as the same incarnation, so nothing is fenced) and sends the step again with
the same id: the sidecar either commits it now or returns the committed result, never twice.
`SyncEngineClient` is the same for engines that are not async (a vLLM scheduler): a plain
blocking socket, no event loop and no thread hop per call.

`WorkerClient` subscribes to the committed decisions for one (engine, rank) and resumes after
the last decision it handed out, on a reconnect or after being cut off as a slow subscriber; its
reports go on one connection that stays open. `SyncWorkerClient` reports the same way from code
that is not async (a vLLM worker), on a blocking socket.

`OperatorClient` sends an operator's commands (namespace decisions, `kvledger namespace`).
"""

from __future__ import annotations

import math
import socket
import time
from collections.abc import AsyncIterator, Callable, Sequence
from types import TracebackType
from typing import Any, TypeVar

import anyio
import structlog
import uuid_utils
from anyio.abc import ByteStream

from coordinator import unix_streams
from coordinator.core.commands import AnyCommand, DeclareEngine, ExternalKey, ReportRank
from coordinator.core.routing import Decision
from coordinator.frames import FrameReader
from coordinator.sidecar import protocol as p
from events import EngineReset, Event, TierSpec

log = structlog.get_logger("kvledger.client")

R = TypeVar("R", bound=p.Message)

RETRY_CODES = frozenset({p.ErrorCode.SHUTTING_DOWN, p.ErrorCode.COMMIT_FAILED})
"""Errors after which the same request, with the same command id, is safe to send again."""
WORKER_RETRY_CODES = RETRY_CODES | {p.ErrorCode.STALE_INCARNATION}
"""A worker's too: its engine began a new incarnation, which fenced its connection; it says Hello
again (bound to the new incarnation) and sends the report again, which the decider takes or drops
as stale (I16). An engine's connection fenced so was taken over: it stops (SidecarError)."""


class SidecarError(Exception):
    """The sidecar answered with an Error."""

    def __init__(self, error: p.Error) -> None:
        super().__init__(f"{error.code}: {error.message}")
        self.error = error
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
            return await unix_streams.connect_unix(self.socket_path)
        assert self.tcp is not None
        return await anyio.connect_tcp(*self.tcp)

    def __str__(self) -> str:
        return self.socket_path or f"{self.tcp[0]}:{self.tcp[1]}"  # type: ignore[index]


class _Channel:
    """One connection: frames out, frames in."""

    def __init__(self, stream: ByteStream, max_frame: int) -> None:
        self.stream = stream
        self.reader = FrameReader(stream)
        self.max_frame = max_frame

    async def send(self, message: p.Message) -> None:
        await self.stream.send(p.frame(message))

    async def receive(self) -> p.ServerMessage:
        length = p.frame_length(await self.reader.receive_exactly(p.HEADER_BYTES), self.max_frame)
        return p.decode_server(await self.reader.receive_exactly(length))

    async def aclose(self) -> None:
        await self.stream.aclose()


_LOST = (OSError, anyio.EndOfStream, anyio.IncompleteRead, anyio.BrokenResourceError, anyio.ClosedResourceError)


async def _close_quietly(channel: _Channel) -> None:
    """Close a connection whatever its peer left of it; shielded, so a cancelled caller closes it too."""
    with anyio.CancelScope(shield=True):
        try:
            await channel.aclose()
        except _LOST:
            pass


def _hello(
    role: p.Role,
    engine_id: str,
    token: str,
    *,
    rank: int = 0,
    declare: DeclareEngine | None = None,
    incarnation: int = 0,
    tiers: Sequence[TierSpec] = (),
    takeover: bool = False,
) -> p.Hello:
    return p.Hello(
        protocol=p.PROTOCOL_VERSION,
        role=role,
        engine_id=engine_id,
        rank=rank,
        token=token,
        declare=declare,
        incarnation=incarnation,
        tiers=list(tiers),
        takeover=takeover,
    )


def _engine_hello(client: EngineClient | SyncEngineClient) -> p.Hello:
    """The first Hello declares the engine (and its tiers); a reconnect names its incarnation."""
    first = client.incarnation == 0
    return _hello(
        "engine",
        client.engine_id,
        client.address.token,
        declare=client.declare if first else None,
        incarnation=client.incarnation,
        tiers=client.tiers if first else (),
        takeover=first and client.takeover,
    )


async def _said_hello(address: Address, max_frame: int, hello: p.Hello, timeout: float) -> tuple[_Channel, p.Welcome]:
    """A new connection that said `hello`, and the Welcome it got: the one handshake every client
    makes. Closed again, and SidecarError, when the answer is not a Welcome."""
    channel = _Channel(await address.connect(), max_frame)
    try:
        with anyio.fail_after(timeout):
            await channel.send(hello)
            welcome = _welcomed(await channel.receive())
    except BaseException:
        await _close_quietly(channel)
        raise
    return channel, welcome


def _welcomed(reply: p.ServerMessage) -> p.Welcome:
    """The Hello's answer: a Welcome, or SidecarError."""
    if isinstance(reply, p.Error):
        raise SidecarError(reply)
    if not isinstance(reply, p.Welcome):
        raise SidecarError(p.Error(code=p.ErrorCode.INVALID_MESSAGE, message=f"expected Welcome, got {reply!r}"))
    return reply


def _verdict(reply: p.ServerMessage, expected: type[R], retry: frozenset[p.ErrorCode] = RETRY_CODES) -> R | str:
    """The reply, if it is the one expected; else why the same request (same command id) may be
    sent again on a new connection; raises SidecarError for an answer that retrying cannot change."""
    if isinstance(reply, expected):
        return reply
    if isinstance(reply, p.Error):
        if reply.code not in retry:
            raise SidecarError(reply)
        return f"{reply.code}: {reply.message}"
    raise SidecarError(p.Error(code=p.ErrorCode.INVALID_MESSAGE, message=f"unexpected reply {reply!r}"))


def _incarnation_after(reply: p.Message, engine_id: str, incarnation: int) -> int:
    """A committed cache reset (ResetCache) begins a new incarnation of this engine: a later
    reconnect must name it, or the sidecar takes the Hello for a stale engine (found by the
    soak: after a reset and a serve restart the engine could not reconnect)."""
    if isinstance(reply, p.StepResult):
        events: list[Any] = [*reply.began, *(e for result in reply.results for e in result), *reply.ended]
    elif isinstance(reply, p.Committed):
        events = list(reply.events)
    else:
        return incarnation
    for event in events:
        if isinstance(event, EngineReset) and event.engine_id == engine_id and event.incarnation > incarnation:
            log.info("incarnation_advanced", engine=engine_id, incarnation=event.incarnation, reason=event.reason)
            incarnation = event.incarnation
    return incarnation


class EngineClient:
    def __init__(
        self,
        address: Address,
        declare: DeclareEngine,
        *,
        tiers: Sequence[TierSpec] = (),
        retry_for: float = 30.0,
        reply_timeout: float = 30.0,
        max_frame: int = p.DEFAULT_MAX_FRAME,
        takeover: bool = False,
    ) -> None:
        self.address = address
        self.takeover = takeover
        """Declare the engine even while another connection of it is open (fencing that one)."""
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
        self._lock = anyio.Lock(fast_acquire=True)  # a free lock without a loop iteration

    async def __aenter__(self) -> EngineClient:
        await self.connect()
        return self

    async def __aexit__(self, *_: object) -> None:
        await self.aclose()

    async def connect(self) -> p.Welcome:
        async with self._lock:
            return await self._connect()

    async def _connect(self) -> p.Welcome:
        first = self.incarnation == 0
        channel, reply = await _said_hello(self.address, self.max_frame, _engine_hello(self), self.reply_timeout)
        self.incarnation = reply.incarnation
        self.welcome = reply
        self.reconnects += not first
        self._channel = channel
        log.info(
            "connected", engine=self.engine_id, incarnation=reply.incarnation, address=str(self.address), reconnect=not first
        )
        return reply

    async def step(
        self, step: int, clock: float, commands: Sequence[AnyCommand], *, command_id: str | None = None
    ) -> p.StepResult:
        """Commit one scheduler step; safe through reconnects (the command id makes it exactly once)."""
        message = p.Step(step=step, clock=clock, commands=list(commands), command_id=command_id or uuid_utils.uuid7().hex)
        return await self._request(message, p.StepResult)

    async def execute(self, command: AnyCommand, *, command_id: str | None = None) -> p.Committed:
        return await self._request(p.Execute(command=command, command_id=command_id or uuid_utils.uuid7().hex), p.Committed)

    async def report(self, report: ReportRank, *, command_id: str | None = None) -> p.Committed:
        return await self._request(p.Report(report=report, command_id=command_id or uuid_utils.uuid7().hex), p.Committed)

    async def lookup(self, tier: str, token_ids: Sequence[int], extra_keys: Sequence[str] = ()) -> p.LookupResult:
        return await self._request(p.lookup_message(tier, token_ids, extra_keys), p.LookupResult)

    async def lookup_keys(self, tier: str, keys: Sequence[ExternalKey]) -> p.KeysLookedUp:
        """Which of these keys are loadable, answered at once (never waits for a commit)."""
        return await self._request(p.LookupKeys(tier=tier, keys=list(keys)), p.KeysLookedUp)

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
                    try:
                        verdict = _verdict(reply, expected)
                    except SidecarError as error:
                        if error.fatal:
                            await self._drop()
                        raise
                    if not isinstance(verdict, str):
                        self.incarnation = _incarnation_after(verdict, self.engine_id, self.incarnation)
                        return verdict
                    await self._drop()
                    problem = verdict
                if anyio.current_time() >= deadline:
                    raise SidecarUnavailable(f"sidecar at {self.address} unavailable for {self.retry_for} s: {problem}")
                log.warning("retrying", engine=self.engine_id, request=type(message).__name__, error=problem, delay=delay)
                await anyio.sleep(delay)
                delay = min(delay * 2, 1.0)

    async def _drop(self) -> None:
        if self._channel is not None:
            await _close_quietly(self._channel)
            self._channel = None

    async def aclose(self) -> None:
        async with self._lock:
            await self._drop()


class WorkerClient:
    """Decisions for one (engine, rank), in order, each once, across reconnects."""

    def __init__(
        self, address: Address, engine_id: str, rank: int, *, retry_for: float = 30.0, max_frame: int = p.DEFAULT_MAX_FRAME
    ) -> None:
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
        self._reports: _Channel | None = None
        """The connection reports go on: opened at the first, kept open, opened again after a loss."""
        self._reporting = anyio.Lock(fast_acquire=True)

    async def welcome(self) -> p.Welcome:
        """Hello as this worker; the Welcome names the engine's pools once it is declared. A
        sidecar that cannot be reached (not started yet, or restarting: a refused or reset
        connection) is waited for, up to retry_for: a worker process started beside it need not
        be started after it."""
        deadline = anyio.current_time() + self.retry_for
        delay = 0.05
        while True:
            try:
                channel = await self._open()
                break
            except _LOST:  # refused, or reset mid-Hello by a sidecar going down
                if anyio.current_time() + delay > deadline:
                    raise
                await anyio.sleep(delay)
                delay = min(delay * 2, 1.0)
        await channel.aclose()
        assert self.last_welcome is not None
        return self.last_welcome

    async def _open(self) -> _Channel:
        hello = _hello("worker", self.engine_id, self.address.token, rank=self.rank)
        channel, self.last_welcome = await _said_hello(self.address, self.max_frame, hello, self.retry_for)
        return channel

    async def decisions(self, from_seq: int | None = None) -> AsyncIterator[Decision]:
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
                        if message.code not in (p.ErrorCode.SLOW_SUBSCRIBER, p.ErrorCode.STALE_INCARNATION):
                            raise SidecarError(message)
                        log.warning(
                            "resubscribing",
                            engine=self.engine_id,
                            rank=self.rank,
                            reason=message.code.value,
                            resume_from=message.resume_from,
                        )
                        break
            except (*_LOST, TimeoutError) as lost:
                if deadline == math.inf:
                    deadline = anyio.current_time() + self.retry_for
                if anyio.current_time() >= deadline:
                    raise SidecarUnavailable(f"sidecar at {self.address} unavailable for {self.retry_for} s: {lost}") from lost
                await anyio.sleep(0.05)
            finally:
                if channel is not None:
                    await _close_quietly(channel)
            self.resumes += 1

    async def report(self, report: ReportRank, *, command_id: str | None = None) -> p.Committed:
        """Send one (job, rank) report on this worker's report connection (opened once, kept
        open); through a lost connection it is sent again, with the same command id, on a new
        one: the sidecar counts it once (I4)."""
        message = p.Report(report=report, command_id=command_id or uuid_utils.uuid7().hex)
        deadline = anyio.current_time() + self.retry_for
        async with self._reporting:
            while True:
                try:
                    if self._reports is None:
                        self._reports = await self._open()
                    with anyio.fail_after(self.retry_for):
                        await self._reports.send(message)
                        reply = await self._reports.receive()
                except (*_LOST, TimeoutError) as lost:
                    await self._drop_reports()
                    problem = f"{type(lost).__name__}: {lost}"
                else:
                    verdict = _verdict(reply, p.Committed, WORKER_RETRY_CODES)
                    if not isinstance(verdict, str):
                        return verdict
                    await self._drop_reports()
                    problem = verdict
                if anyio.current_time() >= deadline:
                    raise SidecarUnavailable(f"sidecar at {self.address} unavailable for {self.retry_for} s: {problem}")
                await anyio.sleep(0.05)

    async def _drop_reports(self) -> None:
        if self._reports is not None:
            await _close_quietly(self._reports)
            self._reports = None

    async def aclose(self) -> None:
        """Close the report connection (a subscription ends with its iterator)."""
        async with self._reporting:
            await self._drop_reports()


class OperatorClient:
    """An operator's connection: Execute of operator commands (coordinator.core.commands.OPERATOR_COMMANDS),
    each on a short connection of its own, retried with the same command id through a lost
    connection or a restarting sidecar (the id makes it exactly once)."""

    def __init__(
        self, address: Address, *, retry_for: float = 30.0, reply_timeout: float = 30.0, max_frame: int = p.DEFAULT_MAX_FRAME
    ) -> None:
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
        try:
            hello = _hello("operator", "", self.address.token)
            channel, _ = await _said_hello(self.address, self.max_frame, hello, self.reply_timeout)
        except SidecarError as refused:
            return refused.error  # retried or raised by the caller, as any reply
        try:
            with anyio.fail_after(self.reply_timeout):
                await channel.send(message)
                return await channel.receive()
        finally:
            await _close_quietly(channel)


class _BlockingChannel:
    """One connection on a plain blocking socket: frames out, frames in (the synchronous clients)."""

    def __init__(self, address: Address, timeout: float, max_frame: int) -> None:
        if address.socket_path is not None:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.settimeout(timeout)
            try:
                sock.connect(address.socket_path)
            except BaseException:
                sock.close()
                raise
        else:
            assert address.tcp is not None
            sock = socket.create_connection(address.tcp, timeout=timeout)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.sock = sock
        self.max_frame = max_frame

    def exchange(self, message: p.Message) -> p.ServerMessage:
        self.sock.sendall(p.frame(message))
        length = p.frame_length(self._exactly(p.HEADER_BYTES), self.max_frame)
        return p.decode_server(self._exactly(length))

    def _exactly(self, count: int) -> bytes:
        buffer = bytearray(count)
        view = memoryview(buffer)
        got = 0
        while got < count:
            received = self.sock.recv_into(view[got:])
            if not received:
                raise ConnectionResetError("the sidecar closed the connection")
            got += received
        return bytes(buffer)

    def close(self) -> None:
        self.sock.close()


class _BlockingRequester:
    """A request sent again, with the same command id, through lost connections until an answer
    comes or `retry_for` runs out (SidecarUnavailable); what the synchronous clients share."""

    def __init__(
        self,
        address: Address,
        *,
        retry_for: float,
        reply_timeout: float,
        max_frame: int,
        retry: frozenset[p.ErrorCode] = RETRY_CODES,
    ) -> None:
        self.address = address
        self.retry = retry
        self.retry_for = retry_for
        self.reply_timeout = reply_timeout
        """Seconds to wait for one reply; past it the connection counts as lost."""
        self.max_frame = max_frame
        self._channel: _BlockingChannel | None = None
        self.connections = 0
        """Connections opened so far (the first, then one after each loss)."""

    def open(self, hello: p.Hello) -> p.Welcome:
        channel = _BlockingChannel(self.address, self.reply_timeout, self.max_frame)
        try:
            welcome = _welcomed(channel.exchange(hello))
        except BaseException:
            channel.close()
            raise
        self._channel = channel
        self.connections += 1
        return welcome

    def request(
        self,
        message: p.Message,
        expected: type[R],
        hello: Callable[[], p.Hello],
        welcomed: Callable[[p.Welcome], None] = lambda _: None,
    ) -> R:
        deadline = time.monotonic() + self.retry_for
        delay = 0.05
        while True:
            try:
                if self._channel is None:
                    welcomed(self.open(hello()))
                assert self._channel is not None
                reply = self._channel.exchange(message)
            except (OSError, p.FrameError) as lost:  # a socket timeout is an OSError too
                self.drop()
                problem = f"{type(lost).__name__}: {lost}"
            else:
                try:
                    verdict = _verdict(reply, expected, self.retry)
                except SidecarError as error:
                    if error.fatal:
                        self.drop()
                    raise
                if not isinstance(verdict, str):
                    return verdict
                self.drop()
                problem = verdict
            if time.monotonic() >= deadline:
                raise SidecarUnavailable(f"sidecar at {self.address} unavailable for {self.retry_for} s: {problem}")
            log.warning("retrying", request=type(message).__name__, error=problem, delay=delay)
            time.sleep(delay)
            delay = min(delay * 2, 1.0)

    def drop(self) -> None:
        if self._channel is not None:
            self._channel.close()
            self._channel = None


class SyncEngineClient:
    """EngineClient for code that is not async (a vLLM scheduler): the same requests and retries,
    on a plain blocking socket. Not thread-safe: one caller at a time, as a scheduler is."""

    def __init__(
        self,
        address: Address,
        declare: DeclareEngine,
        *,
        tiers: Sequence[TierSpec] = (),
        retry_for: float = 30.0,
        reply_timeout: float = 30.0,
        max_frame: int = p.DEFAULT_MAX_FRAME,
        takeover: bool = False,
    ) -> None:
        self.address = address
        self.takeover = takeover
        self.declare = declare
        self.engine_id = declare.engine_id
        self.tiers = list(tiers)
        self.incarnation = 0
        self._requester = _BlockingRequester(address, retry_for=retry_for, reply_timeout=reply_timeout, max_frame=max_frame)
        self.welcome = self._connect()

    def _connect(self) -> p.Welcome:
        welcome = self._requester.open(_engine_hello(self))
        self._welcomed(welcome)
        return welcome

    def _welcomed(self, welcome: p.Welcome) -> None:
        first = self.incarnation == 0
        self.incarnation = welcome.incarnation
        self.welcome = welcome
        log.info(
            "connected", engine=self.engine_id, incarnation=welcome.incarnation, address=str(self.address), reconnect=not first
        )

    @property
    def reconnects(self) -> int:
        return self._requester.connections - 1

    def _request(self, message: p.Message, expected: type[R]) -> R:
        reply = self._requester.request(message, expected, lambda: _engine_hello(self), self._welcomed)
        self.incarnation = _incarnation_after(reply, self.engine_id, self.incarnation)
        return reply

    def step(self, step: int, clock: float, commands: Sequence[AnyCommand], *, command_id: str | None = None) -> p.StepResult:
        message = p.Step(step=step, clock=clock, commands=list(commands), command_id=command_id or uuid_utils.uuid7().hex)
        return self._request(message, p.StepResult)

    def execute(self, command: AnyCommand, *, command_id: str | None = None) -> p.Committed:
        return self._request(p.Execute(command=command, command_id=command_id or uuid_utils.uuid7().hex), p.Committed)

    def report(self, report: ReportRank, *, command_id: str | None = None) -> p.Committed:
        return self._request(p.Report(report=report, command_id=command_id or uuid_utils.uuid7().hex), p.Committed)

    def lookup(self, tier: str, token_ids: Sequence[int], extra_keys: Sequence[str] = ()) -> p.LookupResult:
        return self._request(p.lookup_message(tier, token_ids, extra_keys), p.LookupResult)

    def lookup_keys(self, tier: str, keys: Sequence[ExternalKey]) -> p.KeysLookedUp:
        """Which of these keys are loadable, answered at once (never waits for a commit)."""
        return self._request(p.LookupKeys(tier=tier, keys=list(keys)), p.KeysLookedUp)

    def health(self) -> p.HealthResult:
        return self._request(p.Health(), p.HealthResult)

    def close(self) -> None:
        self._requester.drop()

    def __enter__(self) -> SyncEngineClient:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.close()


class SyncWorkerClient:
    """A worker rank's reports from code that is not async (a vLLM worker): one connection,
    opened at the first report and kept open, on a blocking socket; through a lost connection a
    report is sent again with the same command id (the sidecar counts it once, I4)."""

    def __init__(
        self,
        address: Address,
        engine_id: str,
        rank: int,
        *,
        retry_for: float = 30.0,
        reply_timeout: float = 30.0,
        max_frame: int = p.DEFAULT_MAX_FRAME,
    ) -> None:
        self.address = address
        self.engine_id = engine_id
        self.rank = rank
        self._requester = _BlockingRequester(
            address, retry_for=retry_for, reply_timeout=reply_timeout, max_frame=max_frame, retry=WORKER_RETRY_CODES
        )

    @property
    def connections(self) -> int:
        """Connections opened so far: 1 for a worker whose connection was never lost."""
        return self._requester.connections

    def report(self, report: ReportRank, *, command_id: str | None = None) -> list[Event]:
        """What the report committed (RankReported; with the last rank, the job's end)."""
        message = p.Report(report=report, command_id=command_id or uuid_utils.uuid7().hex)
        committed = self._requester.request(
            message, p.Committed, lambda: _hello("worker", self.engine_id, self.address.token, rank=self.rank)
        )
        return list(committed.events)

    def report_all(self, reports: Sequence[tuple[ReportRank, str]]) -> list[list[Event]]:
        """Several (report, command id) in one round trip, committed together; what each committed."""
        results: list[list[Event]] = []
        messages = [p.Report(report=report, command_id=command_id) for report, command_id in reports]
        for chunk in p.frame_chunks(messages):  # the sidecar refuses a larger Reports
            message = p.Reports(reports=chunk)
            committed = self._requester.request(
                message, p.ReportsCommitted, lambda: _hello("worker", self.engine_id, self.address.token, rank=self.rank)
            )
            results += [list(result.events) for result in committed.results]
        return results

    def close(self) -> None:
        self._requester.drop()


async def sidecar_answers(socket_path: str) -> bool:
    """Whether something serves this socket: a stale socket file refuses the connection. Once
    connected, any answer to a Hello (even UNAUTHORIZED from a sidecar with a token), or none
    within two seconds (a busy one), counts as a sidecar."""
    try:
        stream = await Address(socket_path=socket_path).connect()
    except OSError:
        return False
    channel = _Channel(stream, p.DEFAULT_MAX_FRAME)
    try:
        with anyio.move_on_after(2.0):
            await channel.send(p.Hello(protocol=p.PROTOCOL_VERSION, role="observer"))
            await channel.receive()
    except (OSError, anyio.EndOfStream, anyio.IncompleteRead, anyio.BrokenResourceError, ValueError):
        return False  # it hung up without a word: not a sidecar
    finally:
        with anyio.CancelScope(shield=True):
            await channel.aclose()
    return True
