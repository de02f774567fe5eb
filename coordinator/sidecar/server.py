"""`kvledger serve`: the sidecar. It owns the ledger, listens on a Unix socket (and on TCP when
asked), speaks coordinator/sidecar/protocol.py, and serves /metrics, /healthz and /readyz.

The step pipeline: decide -> end-of-step reconciliation -> one atomic append (group commit) ->
publish decisions -> reply. Nothing is answered or published before the log took it.

One connection's bad frame gets an Error on that connection only. SIGTERM (or SIGINT) stops
accepting, finishes the steps in flight, writes a snapshot and returns; the process exits 0.
"""

from __future__ import annotations

import contextlib
import hmac
import os
import signal
import socket
import stat
import sys
import time
from collections.abc import Awaitable, Callable, Container, Sequence
from pathlib import Path
from typing import Any

import anyio
import msgspec
import structlog
import uuid_utils
from anyio.abc import SocketStream, TaskGroup

from coordinator import unix_streams
from coordinator.core.checks import MAX_EXTRA_KEYS, MAX_LOOKUP_TOKENS
from coordinator.core.commands import OPERATOR_COMMANDS, AnyCommand, DeclareTier, LookupExternal, LookupPrefix, ReportRank
from coordinator.core.decider import lookup, lookup_keys
from coordinator.core.jobs import Chains, hash_chains, lookup_groups
from coordinator.core.protections import switched_off
from coordinator.core.routing import decisions_for
from coordinator.core.state import State
from coordinator.frames import FrameReader
from coordinator.http_serving import listen, serve_http
from coordinator.ledger.ledger import Commit, Ledger, Single, StepCommit
from coordinator.ledger.ledger import Step as LedgerStep
from coordinator.sidecar import admission
from coordinator.sidecar import protocol as p
from coordinator.sidecar.committer import Committer, ShuttingDown, freeze_long_lived
from coordinator.sidecar.config import ConfigError, ServeConfig, Service, check_config, load_credentials_of
from coordinator.sidecar.connection import Connection, PerSecond, Session, peer_uid
from coordinator.sidecar.credentials import ALL, Credential, permits
from coordinator.sidecar.http import make_app
from coordinator.sidecar.hub import DecisionHub, SlowSubscriber, Subscription
from coordinator.sidecar.memory import limit_arenas
from coordinator.sidecar.metrics import SidecarMetrics
from events import EngineDeclared, EngineReset, Event, ExternalKeysLookedUp, PrefixLookedUp, Refused
from events.log import EventLog, LogError, open_log

log = structlog.get_logger("kvledger.sidecar")

SERVER_NAME = "kvledger/0.1"
DRAIN_SECONDS = 30.0
"""How long SIGTERM waits for the steps in flight to commit and be answered."""


LARGE_FRAME = 32 << 10
"""A frame of more bytes is decoded in a worker thread, as a heavy read of its credential (in the
heavy lane: coordinator/sidecar/heavy.py). Decoding costs per element, not per byte: block
references ~40 ns a byte, one-byte ints ~10, packed bytes ~0.1 (measured on these machines). At
256 KiB a Step of block references held the event loop ~10 ms; ops/bench/hostile.py's
dense-frames attack pushed a legitimate engine's step p50 from 2.7-3.5 ms to 13-14 ms, and
with this bound to 4.2-4.4 ms. Frames before Hello hold at most this much too."""
LONG_LOOKUP_TOKENS = 4096
"""A Lookup of more token ids is hashed in a worker thread (`_hash_long_lookup`)."""
SWITCH_INTERVAL = 0.001
"""Seconds a thread holds the GIL before another may take it (Python's default is 0.005): the
event loop waits at most this long behind a heavy read running in a worker thread."""
REQUESTS_PER_CREDENTIAL = 2
"""Requests one credential's connections may have in progress together (`Sidecar._turns`)."""
REFUSAL_DELAY = 0.5
"""Seconds a refused Hello (`unauthorized`) waits before its answer."""
ERROR_DELAY = 0.05
"""Seconds each further refusal of a credential in the same second waits (`Sidecar._slow_down`)."""
REFUSED_PER_ERROR_DELAY = 8
"""Refused commands in a committed reply that weigh one ERROR_DELAY (`Sidecar._slow_down`)."""
MAX_REFUSED_DELAY = 1.0
"""The longest one reply of refused commands waits."""
ERROR_LOGS_PER_SECOND = 10
"""Protocol errors logged per error code and second; the rest are counted, and the next line
logged says how many were left out (a flood of bad frames cost a JSON line each)."""
PROBE_SECONDS = 2.0
"""How often the sidecar looks at its log while serving (`Sidecar._probe_log`)."""
PROBE_TIMEOUT_SECONDS = 10.0


class Sidecar:
    def __init__(self, ledger: Ledger, config: ServeConfig, services: Sequence[Service] = ()) -> None:
        self.ledger = ledger
        self.config = config
        self.services = list(services)
        """What the sidecar runs beside its connections (handed in: the CLI composes them)."""
        self.metrics = SidecarMetrics(lambda: ledger.state, engine_labels=config.metrics_engine_labels)
        self.hub = DecisionHub(ledger.log, ledger.codec, ledger.last_seq, config.subscriber_buffer)
        self.committer = Committer(ledger, self.hub, self.metrics, appends_in_flight=config.appends_in_flight)
        self.accepting = False
        self.draining = False
        self._in_flight = 0
        """Requests read and not yet answered: a drain waits for them."""
        self.http_address: tuple[str, int] | None = None
        self.tcp_address: tuple[str, int] | None = None
        self.probe_failure: str | None = None
        """Why the last look at the log (`_probe_log`) failed, if it did: readiness reports it."""
        self._declaring = anyio.Lock()
        """Held while a Hello's declarations are checked and committed (`_engine_hello`)."""
        self._engine_connections: dict[str, int] = {}
        """Open engine connections per engine id: declaring a connected engine again is a takeover."""
        self.metrics.ready.set_function(lambda: 1.0 if self.readiness()[0] else 0.0)
        self._credential_turns: dict[str, anyio.Semaphore] = {}
        self._error_logs = PerSecond(ERROR_LOGS_PER_SECOND)
        """Protocol errors logged per code and second (all are counted in the metrics)."""
        self._free_errors = PerSecond(config.free_errors)
        """Refusals per credential and second sent without delay (`_slow_down`)."""
        self.credentials = load_credentials_of(config)
        self.budget = admission.Budget(
            tier_slots=config.max_tier_slots,
            tiers=config.max_tiers,
            pool_blocks=config.max_pool_blocks,
            owners_per_engine=config.max_owners_per_engine,
        )
        self.socket_uids = frozenset(
            {os.geteuid(), *config.socket_uids, *(self.credentials.uids if self.credentials is not None else ())}
        )
        """Who may connect to the Unix socket at all (SO_PEERCRED)."""

    # --- readiness -------------------------------------------------------------------------

    def readiness(self) -> tuple[bool, str]:
        if self.draining:
            return False, "shutting down"
        if not self.accepting:
            return False, "starting"
        failure = getattr(self.ledger.log, "failure", None)  # a log that failed closed (Kafka: LogDiverged)
        if failure:
            return False, f"the log failed closed: {failure}"
        if self.committer.failure is not None:  # e.g. the broker is unreachable: ready again after an append succeeds
            return False, f"the log refused the last append: {self.committer.failure}"
        if self.probe_failure is not None:  # an idle sidecar's look at the log failed: ready again after one succeeds
            return False, f"the log is unreachable: {self.probe_failure}"
        if self.ledger.stale:
            return False, "the state is being rebuilt from the log after a failed append"
        return True, "ready"

    def health(self) -> p.HealthResult:
        ready, reason = self.readiness()
        return p.HealthResult(
            ready=ready,
            reason=reason,
            head_seq=self.ledger.last_seq,
            engines=sorted(self.ledger.state.engines),
            subscribers=len(self.hub.subscriptions),
            server=SERVER_NAME,
        )

    # --- serving ---------------------------------------------------------------------------

    async def serve(self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Run until `stop()` (or SIGTERM/SIGINT when installed by `run_sidecar`), then drain."""
        self._stop = anyio.Event()
        committer_done = anyio.Event()

        async def commit_loop() -> None:
            try:
                await self.committer.run()
            finally:
                committer_done.set()

        freeze_long_lived()  # the recovered state: see its docstring
        async with anyio.create_task_group() as service:
            service.start_soon(commit_loop)
            service.start_soon(self._probe_log)
            if self.config.follow_seconds > 0:
                service.start_soon(self._follow_log)
            async with anyio.create_task_group() as doors:
                listeners = await self._listeners()
                for listener in listeners:
                    doors.start_soon(listener.serve, self._connection_task(service))
                if self.config.http is not None:
                    await doors.start(self._serve_http)
                self.accepting = True
                services_stop, services_done = anyio.Event(), anyio.Event()
                await service.start(self._run_services, services_stop, services_done)
                log.info("sidecar_started", **self.where())
                task_status.started()
                await self._stop.wait()
                # The services first: what they hold is committed while the committer still takes it.
                services_stop.set()
                with anyio.move_on_after(DRAIN_SECONDS):
                    await services_done.wait()
                # Stop accepting: close the doors; connections already open live in `service`.
                self.draining = True
                self.accepting = False
                doors.cancel_scope.cancel()
            for listener in listeners:
                await listener.aclose()
            # Finish what was submitted (the committer takes nothing new), let every request in
            # flight send its reply, then close the connections.
            self.committer.close()
            with anyio.move_on_after(DRAIN_SECONDS):
                await committer_done.wait()
                while self._in_flight:
                    await anyio.sleep(0.005)
            if self._in_flight or not committer_done.is_set():
                log.warning("drain_timed_out", requests_in_flight=self._in_flight, seconds=DRAIN_SECONDS)
            service.cancel_scope.cancel()
        with anyio.CancelScope(shield=True):
            await self.ledger.close()
        if self.config.socket_path:
            Path(self.config.socket_path).unlink(missing_ok=True)
        log.info("sidecar_stopped", global_seq=self.ledger.last_seq)

    def stop(self) -> None:
        self._stop.set()

    async def _run_services(
        self, stop: anyio.Event, done: anyio.Event, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED
    ) -> None:
        """Run the services handed to the sidecar until `stop`, each committing through the group
        commit; started once every one has started."""
        try:
            async with anyio.create_task_group() as inner:
                for service in self.services:
                    await inner.start(service, self.ledger, self.committer.submit_all, stop)
                task_status.started()
        finally:
            done.set()

    async def _probe_log(self) -> None:
        """Every PROBE_SECONDS, ask the log for its head: an idle sidecar then notices a log it
        cannot reach (a broker gone, a database down) without waiting for an append to fail."""
        while True:
            await anyio.sleep(PROBE_SECONDS)
            try:
                with anyio.fail_after(PROBE_TIMEOUT_SECONDS):
                    await self.ledger.log.head()
            except (LogError, OSError, TimeoutError) as error:
                reason = f"{type(error).__name__}: {error}" if str(error) else type(error).__name__
                if self.probe_failure is None:
                    log.warning("log_probe_failed", error=reason)
                self.probe_failure = reason
            except Exception as error:  # noqa: BLE001 - e.g. a SQL driver's error: still a reason to be unready
                if self.probe_failure is None:
                    log.warning("log_probe_failed", error=f"{type(error).__name__}: {error}")
                self.probe_failure = f"{type(error).__name__}: {error}"
            else:
                if self.probe_failure is not None:
                    log.info("log_probe_recovered")
                    self.probe_failure = None

    async def _follow_log(self) -> None:
        """Every follow_seconds, fold what other writers appended to the log (the other sidecars
        of a fleet on one log) into the state: their publications, leases and evictions of a
        shared tier become this sidecar's answers. A failure is the probe's to report."""
        while True:
            await anyio.sleep(self.config.follow_seconds)
            try:
                folded = await self.ledger.catch_up()
            except Exception as error:  # noqa: BLE001 - the log is down: _probe_log and the next append say so
                log.debug("log_follow_failed", error=f"{type(error).__name__}: {error}")
                continue
            if folded:
                self.metrics.caught_up_events.inc(folded)
                await self.hub.publish_from_log(self.ledger.last_seq, quiet=True)

    def where(self) -> dict[str, Any]:
        return {
            "log": self.ledger.log.url,
            "socket": self.config.socket_path,
            "tcp": f"{self.tcp_address[0]}:{self.tcp_address[1]}" if self.tcp_address else None,
            "http": f"http://{self.http_address[0]}:{self.http_address[1]}" if self.http_address else None,
            "global_seq": self.ledger.last_seq,
        }

    async def _listeners(self) -> list[Any]:
        listeners: list[Any] = []
        path = Path(self.config.socket_path)
        path.parent.mkdir(parents=True, exist_ok=True)
        if path.exists() or path.is_symlink():
            if not stat.S_ISSOCK(path.lstat().st_mode):
                raise ConfigError(f"--socket {path} exists and is not a socket; refusing to replace it")
            path.unlink()
        # Bound and listening under a name of its own, then renamed into place: the socket's path
        # appears only once a client can connect (a client that waits for the file, as
        # supervisors and tests do, was refused in the gap between bind and listen).
        pending = path.with_name(f".{os.getpid()}.sock")  # no longer than most names: a socket path has a length limit
        pending.unlink(missing_ok=True)
        previous = os.umask(0o177)  # the socket is created owner-only, never briefly open
        try:
            unix = await unix_streams.create_unix_listener(pending)
        finally:
            os.umask(previous)
        # Owner-only, unless other uids may connect: then the kernel's peer uid is the check (_handle).
        os.chmod(pending, 0o600 if self.socket_uids <= {os.geteuid()} else 0o666)
        os.replace(pending, path)
        listeners.append(unix)
        if self.config.tcp is not None:
            host, port = self.config.tcp
            tcp = await anyio.create_tcp_listener(local_host=host, local_port=port)
            host_port = tcp.extra(anyio.abc.SocketAttribute.local_address)
            assert isinstance(host_port, tuple)
            self.tcp_address = (str(host_port[0]), int(host_port[1]))
            listeners.append(tcp)
        return listeners

    async def _serve_http(self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        assert self.config.http is not None
        sock = listen(*self.config.http)
        self.http_address = sock.getsockname()[:2]
        app = make_app(
            self.ledger,
            self.metrics.registry,
            self.readiness,
            metrics_token=self.config.metrics_token,
            audit_tokens=self.config.audit_tokens,
        )
        task_status.started()
        await serve_http(app, sock)

    def _connection_task(self, service: TaskGroup) -> Callable[[SocketStream], Awaitable[None]]:
        async def accept(stream: SocketStream) -> None:
            # Connections run in the service task group, so closing the doors does not cut them.
            service.start_soon(self._handle, stream)

        return accept

    async def _handle(self, stream: SocketStream) -> None:
        try:
            peer = str(stream.extra(anyio.abc.SocketAttribute.remote_address, "unix"))
        except Exception:  # noqa: BLE001
            peer = "unix"
        is_tcp = self.config.tcp is not None and stream.extra(anyio.abc.SocketAttribute.family) != socket.AF_UNIX
        conn = Connection(stream, peer, None if is_tcp else peer_uid(stream))
        self.metrics.connections.inc()
        try:
            async with stream, anyio.create_task_group() as tasks:
                if not is_tcp and conn.peer_uid not in self.socket_uids:
                    await self._error(
                        conn,
                        p.ErrorCode.UNAUTHORIZED,
                        f"uid {conn.peer_uid} may not connect to this socket (allowed: the sidecar's own uid, "
                        "--socket-uid and the credentials file's uids)",
                        fatal=True,
                    )
                    return
                await self._converse(conn, tasks, is_tcp)
                tasks.cancel_scope.cancel()
        except* _GONE:
            pass  # the peer went away: nothing to answer
        except* Exception as errors:  # noqa: BLE001 - one connection's failure must not stop the others
            log.error("connection_failed", peer=conn.peer, errors=[f"{type(e).__name__}: {e}" for e in errors.exceptions])
        finally:
            self.metrics.connections.dec()
            if conn.engine_id is not None:
                left = self._engine_connections.get(conn.engine_id, 1) - 1
                if left > 0:
                    self._engine_connections[conn.engine_id] = left
                else:
                    self._engine_connections.pop(conn.engine_id, None)

    def _credential_key(self, session: Session) -> str:
        """Whose turns a session takes: its credential's. Without a credentials file, each
        engine (or role) is its own."""
        return (
            session.credential.name or str(id(session.credential))
            if self.credentials is not None
            else f"{session.role}:{session.engine_id}"
        )

    def _turns(self, session: Session) -> anyio.Semaphore:
        """The requests a credential may have in progress at once (its engines' connections
        together): many connections of one credential (a hostile tenant's) take turns, and
        cannot fill the event loop ahead of the others'. A free turn is taken without a loop
        iteration (fast_acquire): waiters still queue in order, and each frame yields at its reply."""
        key = self._credential_key(session)
        turns = self._credential_turns.get(key)
        if turns is None:
            turns = self._credential_turns[key] = anyio.Semaphore(REQUESTS_PER_CREDENTIAL, fast_acquire=True)
        return turns

    def _stale_incarnation(self, session: Session) -> str | None:
        """Why this connection may no longer speak for its engine: the engine began a new
        incarnation (declared again, or reset by another connection) since its Hello. A worker
        that said Hello before its engine was declared takes the first incarnation it sees."""
        if session.role not in ("engine", "worker"):
            return None
        known = self.ledger.state.engines.get(session.engine_id)
        if known is None:
            return None
        if session.incarnation == 0 and session.role == "worker":
            session.incarnation = known.incarnation
        if known.incarnation == session.incarnation:
            return None
        return (
            f"engine {session.engine_id!r} is now incarnation {known.incarnation}; this connection spoke for "
            f"incarnation {session.incarnation}, which was fenced: say Hello again"
        )

    def _follow_own(self, session: Session, events: list[Event]) -> None:
        """A connection's own reset or declaration moves it to the new incarnation (only the
        engine's other connections are fenced by it)."""
        for event in events:
            if isinstance(event, (EngineReset, EngineDeclared)) and event.engine_id == session.engine_id:
                session.incarnation = max(session.incarnation, event.incarnation)

    async def _converse(self, conn: Connection, tasks: TaskGroup, is_tcp: bool) -> None:
        reader = FrameReader(conn.stream)
        session: Session | None = None
        while True:
            try:
                first = await reader.receive_exactly(1)  # an idle connection may wait for ever
            except (anyio.EndOfStream, anyio.IncompleteRead):
                return
            # One frame at a time, in a call of its own: what a frame decoded to is let go of
            # before the next is read (a connection held its last Lookup's 262,144 decoded token
            # ids while it decoded the next: two of them at once).
            session, go_on = await self._frame(conn, reader, first, session, tasks, is_tcp)
            if not go_on:
                return

    async def _frame(
        self,
        conn: Connection,
        reader: FrameReader,
        first: bytes,
        session: Session | None,
        tasks: TaskGroup,
        is_tcp: bool,
    ) -> tuple[Session | None, bool]:
        """Reads, decodes and answers one frame (its first byte read): (the session after it,
        whether the connection goes on)."""
        async with contextlib.AsyncExitStack() as turn:
            length = await self._frame_length(conn, reader, first)
            if length is None:
                return session, False
            if session is not None:
                self.hub.heavy_lane.saw(self._credential_key(session))
            held = length > LARGE_FRAME
            if held and session is None:
                await self._error(
                    conn,
                    p.ErrorCode.FRAME_TOO_LARGE,
                    f"a frame before Hello holds at most {LARGE_FRAME:,} bytes, not {length:,}",
                    fatal=True,
                )
                return session, False
            if session is not None and held:
                # Read, decoded and served in its credential's turn: a credential holds at most
                # REQUESTS_PER_CREDENTIAL large frames in memory, however many connections it
                # opens (a Step of 1.25 MiB of token ids is ~10 MiB decoded).
                await turn.enter_async_context(self._turns(session))
            if length > p.MAX_DENSE_FRAME:
                body = await self._large_body(conn, reader, length)
            else:
                body = await self._frame_body(conn, reader, length)
            if body is None:
                return session, False
            try:
                # A large frame (a long Lookup: 262,144 token ids take ~11 ms) is decoded off the loop.
                message = (
                    await self.hub.heavy(self._credential_key(session), p.decode_client, body)
                    if session is not None and len(body) > LARGE_FRAME
                    else p.decode_client(body)
                )
            except p.FrameError as error:
                if session is not None:
                    await self._slow_down(session, turn, held)
                await self._error(conn, error.code, str(error))
                return session, True
            del body
            if session is None:
                if not isinstance(message, p.Hello):
                    await self._error(conn, p.ErrorCode.HELLO_FIRST, f"send Hello first, not {type(message).__name__}")
                    return None, True
                session, fatal = await self._hello(conn, message, is_tcp)
                if fatal:
                    return session, False
                if session is not None and session.role == "engine":
                    conn.engine_id = session.engine_id
                    self._engine_connections[session.engine_id] = self._engine_connections.get(session.engine_id, 0) + 1
                return session, True
            stale = self._stale_incarnation(session)
            if stale is not None:
                await self._error(conn, p.ErrorCode.STALE_INCARNATION, stale, fatal=True)
                return session, False
            if self.draining and not isinstance(message, p.Health):
                await self._error(conn, p.ErrorCode.SHUTTING_DOWN, "the sidecar is shutting down", fatal=True)
                return session, False
            if isinstance(message, p.Subscribe):
                await self._subscribe(conn, session, message, tasks)
                return session, True
            self._in_flight += 1
            try:
                if not held and not isinstance(message, p.Health):
                    await turn.enter_async_context(self._turns(session))
                    held = True
                reply = await self._dispatch(session, message)
                del message
                if isinstance(reply, p.Error):
                    self.metrics.protocol_errors.labels(reply.code.value).inc()
                    await self._slow_down(session, turn, held)
                elif refused := _refusals_in(reply):
                    await self._slow_down(session, turn, held, refused)
                await conn.send(reply)
            finally:
                self._in_flight -= 1
            return session, not (isinstance(reply, p.Error) and reply.fatal)

    async def _frame_length(self, conn: Connection, reader: FrameReader, first: bytes) -> int | None:
        """The length a frame's header announces, its first byte read; None when the connection
        is to close (told why)."""
        try:
            # A frame that has begun must end, its header too: a peer that sends part of one
            # and stalls would otherwise hold its connection and buffer forever (found by
            # fuzzing; 1-3 bytes of a header were never cut).
            header = first + await reader.receive_within(p.HEADER_BYTES - 1, self.config.frame_timeout)
        except (anyio.EndOfStream, anyio.IncompleteRead):
            return None
        except TimeoutError:
            await self._incomplete(conn)
            return None
        try:
            return p.frame_length(header, self.config.max_frame)
        except p.FrameError as error:
            await self._error(conn, error.code, str(error), fatal=True)
            return None

    async def _large_body(self, conn: Connection, reader: FrameReader, length: int) -> bytes | None:
        """The body of a frame over MAX_DENSE_FRAME, which only a Lookup may be (its first bytes
        tell: `protocol.frame_bound`); None when the connection is to close (told why)."""
        prefix = await self._frame_body(conn, reader, p.LOOKUP_PEEK)
        if prefix is None:
            return None
        if length > p.frame_bound(prefix, self.config.max_frame):
            await self._error(
                conn,
                p.ErrorCode.FRAME_TOO_LARGE,
                f"a frame of {length:,} bytes is over the limit of {p.MAX_DENSE_FRAME:,} bytes for anything but a "
                "Lookup (one that begins with its `msg` tag): split the step (coordinator.sidecar.protocol.frame_chunks)",
                fatal=True,
            )
            return None
        rest = await self._frame_body(conn, reader, length - len(prefix))
        return prefix + rest if rest is not None else None

    async def _frame_body(self, conn: Connection, reader: FrameReader, length: int) -> bytes | None:
        try:
            return await reader.receive_within(length, self.config.frame_timeout)
        except (anyio.EndOfStream, anyio.IncompleteRead):
            return None
        except TimeoutError:
            await self._incomplete(conn)
            return None

    async def _incomplete(self, conn: Connection) -> None:
        await self._error(
            conn, p.ErrorCode.INVALID_MESSAGE, f"a frame begun was not complete after {self.config.frame_timeout:g} s", fatal=True
        )

    async def _slow_down(self, session: Session, turn: contextlib.AsyncExitStack, held: bool, refused: int = 0) -> None:
        """A credential refused more than `ServeConfig.free_errors` times in a second waits
        ERROR_DELAY before each further refusal is sent, in its turn: a client that floods the
        sidecar with what it refuses gets through at most REQUESTS_PER_CREDENTIAL / ERROR_DELAY
        of them a second, and the others' requests are served meanwhile.

        A committed reply whose commands the core refused (`refused` of them, each recorded in
        the log) counts each as a refusal, and waits ERROR_DELAY for every
        REFUSED_PER_ERROR_DELAY of them past the budget, at most MAX_REFUSED_DELAY: a Step of 256
        refused commands costs the sidecar ~5 ms (decided, appended and answered, 258 events),
        and a client sending them back to back took over half a core while another engine's
        step p99 rose 1.7x (ops/bench/hostile.py --attacks big-steps)."""
        over = self._free_errors.over(self._credential_key(session), max(refused, 1))
        if not over:
            return
        delay = ERROR_DELAY if not refused else min(ERROR_DELAY * over / REFUSED_PER_ERROR_DELAY, MAX_REFUSED_DELAY)
        if not held:
            await turn.enter_async_context(self._turns(session))
        await anyio.sleep(delay)

    async def _error(self, conn: Connection, code: p.ErrorCode, message: str, *, fatal: bool = False) -> None:
        self.metrics.protocol_errors.labels(code.value).inc()
        suppressed = self._error_logs.take(code.value)
        if suppressed is not None:
            log.warning(
                "protocol_error",
                peer=conn.peer,
                code=code.value,
                error=message,
                fatal=fatal,
                **({"suppressed_since_last": suppressed} if suppressed else {}),
            )
        if code is p.ErrorCode.UNAUTHORIZED:
            # A tarpit: a client refused its credentials waits before it hears so (and before its
            # connection closes), so a loop of refused Hellos costs the sidecar little CPU.
            await anyio.sleep(REFUSAL_DELAY)
        await conn.send(p.Error(code=code, message=message, fatal=fatal))

    # --- hello -----------------------------------------------------------------------------

    async def _hello(self, conn: Connection, hello: p.Hello, is_tcp: bool) -> tuple[Session | None, bool]:
        """(the session, whether the connection must close)."""
        if hello.protocol != p.PROTOCOL_VERSION:
            await self._error(
                conn,
                p.ErrorCode.PROTOCOL_MISMATCH,
                f"client speaks protocol {hello.protocol}, this server speaks {p.PROTOCOL_VERSION}",
                fatal=True,
            )
            return None, True
        credential = self._identify(conn, hello, is_tcp)
        if credential is None:
            # The token itself is never logged.
            await self._error(conn, p.ErrorCode.UNAUTHORIZED, "missing or wrong token", fatal=True)
            return None, True
        if hello.role not in ("observer", "operator") and not hello.engine_id:
            await self._error(conn, p.ErrorCode.INVALID_MESSAGE, f"a {hello.role}'s Hello names its engine_id")
            return None, False
        problem = permits(credential, hello.role, hello.engine_id, self._tenants(hello))
        if problem is not None:
            await self._error(conn, p.ErrorCode.UNAUTHORIZED, problem, fatal=True)
            return None, True
        if hello.role in ("observer", "operator"):
            await conn.send(p.Welcome(protocol=p.PROTOCOL_VERSION, server=SERVER_NAME, head_seq=self.ledger.last_seq))
            return Session(hello.role, "", 0, credential=credential), False
        if hello.role == "worker":
            log.info("worker_connected", engine=hello.engine_id, rank=hello.rank, peer=conn.peer)
            # A declaration of this engine still being appended must not be shown (it may yet
            # fail): then from the committed state. Otherwise at once (waiting for the groups in
            # flight held every engine's next group back, once per worker's Hello); what a
            # Welcome shows of an engine changes only when it is declared or reset. head_seq is
            # the last sequence the log holds either way.
            if hello.engine_id in self.ledger.uncommitted_keys()[1]:
                async with self.ledger.committed() as state:
                    welcome = self._worker_welcome(state, hello.engine_id)
            else:
                welcome = self._worker_welcome(self.ledger.state, hello.engine_id)
            await conn.send(welcome)
            return Session("worker", hello.engine_id, hello.rank, welcome.incarnation, credential), False
        return await self._engine_hello(conn, hello, credential)

    def _worker_welcome(self, state: State, engine_id: str) -> p.Welcome:
        known = state.engines.get(engine_id)
        return p.Welcome(
            protocol=p.PROTOCOL_VERSION,
            server=SERVER_NAME,
            engine_id=engine_id,
            incarnation=known.incarnation if known else 0,
            head_seq=self.ledger.last_seq,
            pools=[pool.spec for pool in known.pools.values()] if known else [],
            world_size=known.world_size if known else 0,
            tiers=list(known.tiers) if known else [],
            kv_dtype=state.namespaces[known.namespace_id].kv_dtype if known else "",
        )

    def _identify(self, conn: Connection, hello: p.Hello, is_tcp: bool) -> Credential | None:
        """The credential this Hello presents (None: refused). Without a credentials file, the
        shared token, where one is set or on TCP, lets in as anything; so does the socket's owner."""
        if self.credentials is not None:
            return self.credentials.identify(hello.token, None if is_tcp else conn.peer_uid)
        if (is_tcp or self.config.token) and not hmac.compare_digest(hello.token.encode(), self.config.token.encode()):
            return None
        return ALL

    def _tenants(self, hello: p.Hello) -> list[str]:
        """The tenants a Hello speaks for: its engine's as known, and the one it declares."""
        tenants = []
        known = self.ledger.state.engines.get(hello.engine_id)
        namespace = self.ledger.state.namespaces.get(known.namespace_id) if known is not None else None
        if namespace is not None:
            tenants.append(namespace.tenant)
        if hello.role == "engine" and hello.declare is not None:
            tenants.append(hello.declare.namespace.tenant)
        return tenants

    async def _engine_hello(self, conn: Connection, hello: p.Hello, credential: Credential) -> tuple[Session | None, bool]:
        engine_id = hello.engine_id
        known = self.ledger.state.engines.get(engine_id)
        reconnect = known is not None and hello.incarnation != 0 and hello.incarnation == known.incarnation
        if not reconnect and (hello.declare is None or hello.declare.engine_id != engine_id):
            await self._error(
                conn,
                p.ErrorCode.INVALID_MESSAGE,
                f"engine {engine_id!r} is not running incarnation {hello.incarnation}: its Hello must "
                "carry `declare` (a DeclareEngine for the same engine_id)",
            )
            return None, False
        problem = admission.tier_conflict(hello.tiers)
        if problem is None:
            hello_declares: list[AnyCommand] = [DeclareTier(spec=spec) for spec in hello.tiers]
            if hello.declare is not None and not reconnect:
                hello_declares.append(hello.declare)
            over = admission.over_budget(self.ledger.state, engine_id, hello_declares, self.budget)
            problem = over.message if over is not None else None
        if problem is None and not reconnect:
            assert hello.declare is not None
            problem = admission.declaration_problem(hello.declare)
        if problem is not None:
            await self._error(conn, p.ErrorCode.INVALID_MESSAGE, problem)
            return None, False
        connected = self._engine_connections.get(engine_id, 0)
        if not reconnect and connected and not hello.takeover:
            # Declaring again begins a new incarnation, which fences the connected engine's jobs
            # and connections: a deliberate act, never the side effect of a Hello.
            await self._error(
                conn,
                p.ErrorCode.ENGINE_CONNECTED,
                f"engine {engine_id!r} is connected (incarnation {known.incarnation if known else 0}); a "
                "Hello that declares it again must say takeover (its connections and workers are then "
                "fenced), or come after its connection closed",
            )
            return None, False
        declarations: list[AnyCommand] = [DeclareTier(spec=spec) for spec in hello.tiers]
        if not reconnect:
            assert hello.declare is not None
            declarations.append(msgspec.structs.replace(hello.declare, takeover=bool(connected)))
            if connected:
                log.warning(
                    "engine_taken_over",
                    engine=engine_id,
                    connections=connected,
                    peer=conn.peer,
                    incarnation=known.incarnation if known else 0,
                )
        events: list[Event] = []
        try:
            # A Hello is taken whole or not at all (admission.refused_declaration): its declarations
            # are decided first, one Hello at a time; a refused one is committed alone and ends it.
            async with self._declaring:
                # On the state as it is (the committer decides each declaration for real): this
                # only puts a refused one first.
                with switched_off(self.ledger.protections_off):
                    refused_first = admission.refused_declaration(self.ledger.state, declarations)
                if refused_first is not None:
                    declarations.remove(refused_first)
                    declarations.insert(0, refused_first)
                for command in declarations:
                    commit = _commit_of(await self.committer.submit(Single(command=command)))
                    events += commit.events
                    refused = [e for e in commit.events if isinstance(e, Refused)]
                    if refused:
                        await self._error(conn, p.ErrorCode.REFUSED, f"{refused[0].reason}: {refused[0].detail}")
                        return None, False
        except Exception as error:  # noqa: BLE001 - the log failed: this Hello was not committed
            await self._error(conn, p.ErrorCode.COMMIT_FAILED, admission.told(error), fatal=True)
            return None, True
        if reconnect:
            assert known is not None
            log.info("engine_reconnected", engine=engine_id, incarnation=known.incarnation, peer=conn.peer)
            await conn.send(
                p.Welcome(
                    protocol=p.PROTOCOL_VERSION,
                    server=SERVER_NAME,
                    engine_id=engine_id,
                    incarnation=known.incarnation,
                    head_seq=self.ledger.last_seq,
                    events=p.any_events(events),
                )
            )
            return Session("engine", engine_id, 0, known.incarnation, credential), False
        declared = next(e for e in events if isinstance(e, EngineDeclared))
        log.info("engine_declared", engine=engine_id, incarnation=declared.incarnation, peer=conn.peer)
        await conn.send(
            p.Welcome(
                protocol=p.PROTOCOL_VERSION,
                server=SERVER_NAME,
                engine_id=engine_id,
                incarnation=declared.incarnation,
                head_seq=self.ledger.last_seq,
                events=p.any_events(events),
            )
        )
        return Session("engine", engine_id, 0, declared.incarnation, credential), False

    # --- requests --------------------------------------------------------------------------

    async def _dispatch(self, session: Session, message: p.ClientMessage) -> p.ServerMessage:
        if isinstance(message, p.Health):
            return self.health()
        if isinstance(message, p.Hello):
            return p.Error(code=p.ErrorCode.INVALID_MESSAGE, message="Hello was already sent on this connection")
        if isinstance(message, p.Report):
            if session.role not in ("worker", "engine"):
                return _wrong_role(session, message)
            (report,) = admission.attributed(session.engine_id, [message.report])
            assert isinstance(report, ReportRank)
            problem = admission.foreign_report(self.ledger.state, session.engine_id, report, _worker_rank(session))
            if problem is not None:
                return problem
            return await self._commit_single(session, "report", report, message.command_id or _report_id(message))
        if isinstance(message, p.Reports):
            if session.role not in ("worker", "engine"):
                return _wrong_role(session, message)
            return await self._commit_reports(session, message)
        if session.role == "operator" and isinstance(message, p.Execute) and isinstance(message.command, OPERATOR_COMMANDS):
            # Scoped by the operator session's empty engine id, which no engine's can be.
            return await self._commit_single(session, "execute", message.command, message.command_id)
        if session.role != "engine":
            return _wrong_role(session, message)
        if isinstance(message, p.Lookup):
            try:
                tokens = p.lookup_tokens(message)
            except p.FrameError as error:
                return p.Error(code=error.code, message=str(error))
            command = LookupPrefix(
                engine_id=session.engine_id, tier=message.tier, token_ids=tokens, extra_keys=message.extra_keys
            )
            # Answered at once, as LookupKeys: what groups in flight changed is answered as a miss.
            keys, engines = self.ledger.uncommitted_keys()
            uncommitted: Container[bytes] = _EVERY_KEY if session.engine_id in engines else keys
            hashed = await self._hash_long_lookup(session, command, uncommitted)
            if hashed is not None:  # again: groups were decided while it was hashed
                keys, engines = self.ledger.uncommitted_keys()
                uncommitted = _EVERY_KEY if session.engine_id in engines else keys
            with switched_off(self.ledger.protections_off):  # empty outside the simulator
                return p.LookupResult(answer=lookup(self.ledger.state, command, hashed, uncommitted))
        if isinstance(message, p.LookupKeys):
            return self._lookup_keys(session, message)
        if isinstance(message, p.Execute):
            (executed,) = admission.attributed(session.engine_id, [message.command])
            problem = admission.foreign_commands(self.ledger.state, session.engine_id, [executed])
            problem = problem or self._over_budget(session, [executed])
            return problem or await self._commit_single(session, "execute", executed, message.command_id)
        assert isinstance(message, p.Step)
        return await self._step(session, message)

    async def _hash_long_lookup(self, session: Session, command: LookupPrefix, uncommitted: Container[bytes]) -> Chains | None:
        """A long Lookup's chain keys, hashed in a worker thread, one heavy read at a time: one of
        262,144 token ids hashes for ~0.1 s, which held every engine's steps on the event loop.
        Only when its first LONG_LOOKUP_TOKENS still hit: a miss there is answered on the loop
        at once (the search stops at a full-attention group's first unloadable block)."""
        engine = self.ledger.state.engines.get(session.engine_id)
        if (
            engine is None
            or not LONG_LOOKUP_TOKENS < len(command.token_ids) <= MAX_LOOKUP_TOKENS
            or len(command.extra_keys) > MAX_EXTRA_KEYS
        ):
            return None  # short, or refused by the decider anyway
        head = msgspec.structs.replace(command, token_ids=command.token_ids[:LONG_LOOKUP_TOKENS])
        with switched_off(self.ledger.protections_off):
            quick = lookup(self.ledger.state, head, None, uncommitted)
        attention = any(pool.spec.kind == "attention" for pool in engine.pools.values())
        if (
            attention
            and isinstance(quick, PrefixLookedUp)
            and quick.reuse_unit
            and quick.boundary < LONG_LOOKUP_TOKENS // quick.reuse_unit * quick.reuse_unit
        ):
            return None
        return await self.hub.heavy(
            self._credential_key(session),
            hash_chains,
            engine.namespace_id,
            lookup_groups(engine),
            command.token_ids,
            command.extra_keys,
        )

    def _lookup_keys(self, session: Session, message: p.LookupKeys) -> p.ServerMessage:
        """Answered at once from the state, never waiting for a commit: what the groups in
        flight (or a failed append not yet rebuilt) changed is answered as a miss, so every hit
        is one the log holds. The answer is recorded with a later group (the audit; the hit rate).
        A hit that goes stale before its load is refused by the load decision (committed, leased)."""
        command = LookupExternal(engine_id=session.engine_id, tier=message.tier, keys=message.keys)
        keys, engines = self.ledger.uncommitted_keys()
        uncommitted: Container[bytes] = _EVERY_KEY if session.engine_id in engines else keys
        with switched_off(self.ledger.protections_off):  # empty outside the simulator
            answer = lookup_keys(self.ledger.state, command, uncommitted)
        head = self.ledger.last_seq
        if isinstance(answer, ExternalKeysLookedUp):
            answer = msgspec.structs.replace(answer, answered_at=time.time(), head_seq=head)
        self.committer.record(f"engine/{session.engine_id}", answer)
        return p.KeysLookedUp(answer=answer, head_seq=head)

    def _over_budget(self, session: Session, commands: list[AnyCommand]) -> p.Error | None:
        return admission.over_budget(self.ledger.state, session.engine_id, commands, self.budget)

    async def _step(self, session: Session, message: p.Step) -> p.ServerMessage:
        commands = admission.attributed(session.engine_id, message.commands)
        problem = admission.foreign_commands(self.ledger.state, session.engine_id, commands)
        problem = problem or self._over_budget(session, commands)
        if problem is not None:
            return problem
        if not message.command_id:
            return p.Error(code=p.ErrorCode.INVALID_MESSAGE, message="a Step needs a command_id (unique per step)")
        started = time.perf_counter()
        bound = log.bind(engine=session.engine_id, step=message.step)
        tx = LedgerStep(
            engine_id=session.engine_id,
            step=message.step,
            clock=message.clock,
            commands=commands,
            command_id=admission.scoped(session.engine_id, "step", message.command_id),
        )
        try:
            result = await self.committer.submit(tx)
        except ShuttingDown as error:
            return p.Error(code=p.ErrorCode.SHUTTING_DOWN, message=str(error), fatal=True)
        except Exception as error:  # noqa: BLE001 - the log failed: nothing of the step was committed
            bound.error("step_failed", error=str(error))
            return p.Error(
                code=p.ErrorCode.COMMIT_FAILED, message=f"step {message.step} was not committed: {admission.told(error)}"
            )
        assert isinstance(result, StepCommit)
        commit = result.commit
        self._follow_own(session, commit.events)
        reused = admission.retried_as_another_step(result, message) or admission.reused_for_other_content(
            commit, message.command_id, "step"
        )
        if reused is not None:
            return reused
        self.metrics.step_seconds.observe(time.perf_counter() - started)
        bound.debug("step_committed", first_seq=commit.first_seq, last_seq=commit.last_seq, duplicate=commit.duplicate)
        return p.StepResult(
            command_id=message.command_id,
            step=message.step,
            first_seq=commit.first_seq,
            last_seq=commit.last_seq,
            duplicate=commit.duplicate,
            began=p.any_events(result.began),
            results=[p.any_events(r) for r in result.results],
            ended=p.any_events(result.ended),
            decisions=decisions_for(commit.events, commit.first_seq, session.engine_id, 0),
        )

    async def _commit_single(self, session: Session, kind: str, command: AnyCommand, command_id: str) -> p.ServerMessage:
        try:
            scoped = admission.scoped(session.engine_id, kind, command_id) if command_id else None
            result = await self.committer.submit(Single(command=command, command_id=scoped))
        except ShuttingDown as error:
            return p.Error(code=p.ErrorCode.SHUTTING_DOWN, message=str(error), fatal=True)
        except Exception as error:  # noqa: BLE001
            return p.Error(code=p.ErrorCode.COMMIT_FAILED, message=f"not committed: {admission.told(error)}")
        commit = _commit_of(result)
        self._follow_own(session, commit.events)
        reused = (
            admission.reused_for_another_report(commit.events, command, command_id)
            if commit.duplicate and isinstance(command, ReportRank)
            else None
        )
        reused = reused or admission.reused_for_other_content(commit, command_id, kind)
        if reused is not None:
            return reused
        return p.Committed(
            command_id=command_id,
            first_seq=commit.first_seq,
            last_seq=commit.last_seq,
            duplicate=commit.duplicate,
            events=p.any_events(commit.events),
        )

    async def _commit_reports(self, session: Session, message: p.Reports) -> p.ServerMessage:
        """A worker's reports of one pass, committed together (one group: submit_all)."""
        if not message.reports:
            return p.ReportsCommitted(results=[])
        ids = []
        reports = admission.attributed(session.engine_id, [sent.report for sent in message.reports])
        for sent, report in zip(message.reports, reports, strict=True):
            assert isinstance(report, ReportRank)
            problem = admission.foreign_report(self.ledger.state, session.engine_id, report, _worker_rank(session))
            if problem is not None:
                return problem
            ids.append(sent.command_id or _report_id(sent))
        txs = [
            Single(command=report, command_id=admission.scoped(session.engine_id, "report", command_id))
            for report, command_id in zip(reports, ids, strict=True)
        ]
        try:
            results = await self.committer.submit_all(txs)
        except ShuttingDown as error:
            return p.Error(code=p.ErrorCode.SHUTTING_DOWN, message=str(error), fatal=True)
        except Exception as error:  # noqa: BLE001 - nothing of it, or not all, committed: retry it with its command ids
            return p.Error(code=p.ErrorCode.COMMIT_FAILED, message=f"not committed: {admission.told(error)}")
        committed = []
        for sent, command_id, result in zip(message.reports, ids, results, strict=True):
            commit = _commit_of(result)
            reused = (
                admission.reused_for_another_report(commit.events, sent.report, command_id) if commit.duplicate else None
            ) or admission.reused_for_other_content(commit, command_id, "report")
            if reused is not None:
                return reused
            committed.append(
                p.Committed(
                    command_id=command_id,
                    first_seq=commit.first_seq,
                    last_seq=commit.last_seq,
                    duplicate=commit.duplicate,
                    events=p.any_events(commit.events),
                )
            )
        return p.ReportsCommitted(results=committed)

    async def _subscribe(self, conn: Connection, session: Session, message: p.Subscribe, tasks: TaskGroup) -> None:
        """Subscribe has no reply of its own: Decisions frames follow on this connection."""
        if session.role != "worker":
            await conn.send(_wrong_role(session, message))
            return
        if session.subscribed:
            await self._error(conn, p.ErrorCode.INVALID_MESSAGE, "this connection is already subscribed")
            return
        session.subscribed = True
        # An engine never decided on has no decision in the log: nothing to read (a Subscribe
        # from 0 for a made-up engine id used to read and decode the whole log).
        from_seq = (
            message.from_seq if session.engine_id in self.ledger.state.engines else max(message.from_seq, self.hub.last_seq)
        )
        subscription = self.hub.register(session.engine_id, session.rank, from_seq, self._credential_key(session))
        log.info("subscribed", engine=session.engine_id, rank=session.rank, from_seq=message.from_seq)
        tasks.start_soon(self._push, conn, session, subscription, tasks.cancel_scope)

    async def _push(
        self, conn: Connection, session: Session, subscription: Subscription, connection_scope: anyio.CancelScope
    ) -> None:
        self.metrics.subscribers.inc()
        try:
            async for decisions in self.hub.stream(subscription):
                stale = self._stale_incarnation(session)
                if stale is not None:  # a new incarnation fences its old workers' subscriptions too
                    with anyio.move_on_after(5):
                        await conn.send(p.Error(code=p.ErrorCode.STALE_INCARNATION, message=stale, fatal=True))
                    connection_scope.cancel()
                    return
                with anyio.CancelScope() as sending:
                    subscription.send_scope = sending
                    await conn.send(p.Decisions(items=decisions))
                subscription.send_scope = None
                if sending.cancelled_caught:  # blocked past the grace: the peer stopped reading
                    self.metrics.slow_subscribers.inc()
                    log.warning(
                        "subscriber_cut",
                        engine=subscription.engine_id,
                        rank=subscription.rank,
                        resume_from=subscription.delivered,
                        reason="stopped reading with its buffer full",
                    )
                    connection_scope.cancel()
                    return
                subscription.delivered = decisions[-1].seq
        except SlowSubscriber as slow:
            self.metrics.slow_subscribers.inc()
            log.warning(
                "subscriber_too_slow", engine=subscription.engine_id, rank=subscription.rank, resume_from=slow.resume_from
            )
            with anyio.move_on_after(5):
                await conn.send(
                    p.Error(code=p.ErrorCode.SLOW_SUBSCRIBER, message=str(slow), fatal=True, resume_from=slow.resume_from)
                )
            connection_scope.cancel()  # ends the connection: its reader too
        finally:
            self.hub.unregister(subscription)
            self.metrics.subscribers.dec()


_GONE = (anyio.EndOfStream, anyio.IncompleteRead, anyio.BrokenResourceError, anyio.ClosedResourceError, ConnectionError)


def _refusals_in(reply: p.ServerMessage) -> int:
    """The commands the core refused in a committed reply (a Refused event each)."""
    if isinstance(reply, p.StepResult):
        events = [*reply.began, *(event for result in reply.results for event in result), *reply.ended]
    elif isinstance(reply, p.Committed):
        events = list(reply.events)
    elif isinstance(reply, p.ReportsCommitted):
        events = [event for result in reply.results for event in result.events]
    else:
        return 0
    return sum(1 for event in events if isinstance(event, Refused))


class _EveryKey:
    """Every key: what a lookup answers as a miss while its engine's own declaration or reset is in flight."""

    def __contains__(self, key: object) -> bool:
        return True


_EVERY_KEY = _EveryKey()


def _commit_of(result: StepCommit | Commit) -> Commit:
    return result.commit if isinstance(result, StepCommit) else result


def _report_id(message: p.Report) -> str:
    # Reports are idempotent in the decider (I4); a generated id only keeps retries cheap.
    return f"report/{message.report.job_id}/{message.report.rank}/{uuid_utils.uuid7().hex}"


def _worker_rank(session: Session) -> int | None:
    """The rank a worker's connection reports for (its Hello's); None for an engine's, which
    reports for any rank of its own jobs."""
    return session.rank if session.role == "worker" else None


def _wrong_role(session: Session, message: p.Message) -> p.Error:
    return p.Error(code=p.ErrorCode.WRONG_ROLE, message=f"a {session.role} connection cannot send {type(message).__name__}")


async def run_sidecar(
    config: ServeConfig, services: Sequence[Service] = (), *, on_started: Callable[[Sidecar], None] | None = None
) -> None:
    """Open the log, recover, serve (running `services` beside) until SIGTERM/SIGINT, drain, snapshot."""
    check_config(config)
    sys.setswitchinterval(SWITCH_INTERVAL)
    limit_arenas()
    event_log: EventLog = await open_log(config.log_url)
    try:
        ledger = await Ledger.open(event_log, snapshot_every=config.snapshot_every)
        sidecar = Sidecar(ledger, config, services)
        async with anyio.create_task_group() as tg:

            async def watch_signals() -> None:
                with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
                    async for signum in signals:
                        log.info("signal_received", signal=signal.Signals(signum).name)
                        sidecar.stop()
                        return

            tg.start_soon(watch_signals)
            await tg.start(sidecar.serve)
            if on_started is not None:
                on_started(sidecar)
    finally:
        with anyio.CancelScope(shield=True):
            await event_log.close()
