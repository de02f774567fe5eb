"""`kvledger ingest vllm`: subscribe to a vLLM engine's KV events and record them in the ledger.

The I/O shell around coordinator/vllm/kv_events.py (decoding) and coordinator/core/observe.py
(deciding). vLLM's ZMQ PUB socket *connects* to the configured endpoint (it binds only `*`, `::`,
ipc and inproc endpoints: vllm/distributed/kv_events.py, `_is_bind_endpoint`), so this subscriber
binds a SUB socket there. Per frame:

- the batch the engine should send next (`expected`) is known: from the ledger's state when
  ingestion resumes, else 0 after an ObserveEngine;
- a sequence number beyond it is a gap: the replay endpoint (vLLM's ROUTER, `--replay`) is asked
  for every buffered batch from `expected` on; whatever it cannot give is recorded as ObserveGap;
- a sequence number below it on the live socket is a restart (vLLM's counter starts at 0 in a
  new process): ObserveEngine again, a new observed incarnation, naming both numbers. Live
  frames that a replay already delivered are skipped, not taken for a restart;
- a frame that cannot be decoded is recorded as ObserveMalformed, and ingestion goes on.

Frames that arrive together are committed together (one `commit_group`), each command with its
own command id, so a retry after a log outage is exactly once.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Protocol
from uuid import uuid4

import anyio
import msgspec
import structlog
import zmq
import zmq.asyncio

from coordinator.core.commands import AnyCommand, ObserveEngine, ObserveGap
from coordinator.core.keys import namespace_id
from coordinator.core.state import State
from coordinator.ledger.ledger import Commit, Single, StepCommit, Submission
from coordinator.vllm.kv_events import DecodedBatch, Unreadable, decode_frames, is_replay_end, replay_request, sequence
from events import NamespaceSpec, Refused
from events.log import LogUnavailable

log = structlog.get_logger("kvledger.ingest")

MAX_GROUP = 256
"""Most commands committed in one append: a burst of frames costs one commit per this many."""


class IngestConfig(msgspec.Struct, frozen=True, kw_only=True):
    endpoint: str
    """What the SUB socket binds, e.g. tcp://127.0.0.1:5557: vLLM's `KVEventsConfig.endpoint`."""
    engine_id: str
    namespace: NamespaceSpec
    topic: str = ""
    """vLLM's `KVEventsConfig.topic`; frames of another topic are ignored."""
    replay: str | None = None
    """vLLM's `KVEventsConfig.replay_endpoint` as seen from here (its ROUTER binds it)."""
    replay_timeout: float = 2.0
    """Seconds to wait for each replayed frame before what is missing is recorded as a gap."""
    progress_every: float = 10.0
    """Seconds between progress lines."""
    max_frame: int = 64 << 20
    """Largest message accepted, bytes (ZMQ drops a larger one: it shows as a gap)."""
    retry_every: float = 1.0
    """Seconds between attempts to commit while the log is unavailable."""

    @property
    def source(self) -> str:
        topic = f" topic {self.topic}" if self.topic else ""
        replay = f" replay {self.replay}" if self.replay else ""
        return f"vllm zmq {self.endpoint}{topic}{replay}"


class IngestStats(msgspec.Struct, kw_only=True):
    """Counts since this ingestor started."""

    batches: int = 0
    events: int = 0
    replayed: int = 0
    """Batches recorded from the replay socket."""
    gaps: int = 0
    """Ranges of batches recorded as missed."""
    malformed: int = 0
    restarts: int = 0
    refusals: int = 0
    """Refused events (a whole batch or one event of it)."""
    skipped: int = 0
    """Live frames already recorded through a replay, or of another topic."""
    expected: int = 0
    """The engine's sequence number expected next."""


class IngestLedger(Protocol):
    """Where ingestion commits: a Ledger of its own (`kvledger ingest vllm`), or the sidecar's
    group commit (`kvledger serve --ingest-vllm`, coordinator/vllm/sidecar_ingest.py)."""

    @property
    def state(self) -> State: ...

    @property
    def last_seq(self) -> int: ...

    async def commit_group(self, transactions: Sequence[Submission]) -> list[StepCommit | Commit]: ...


class Ingestor:
    """Records one vLLM engine's KV events (one data-parallel rank: each publishes on its own
    port, with its own sequence numbers) in a ledger."""

    def __init__(self, ledger: IngestLedger, config: IngestConfig) -> None:
        self.ledger = ledger
        self.config = config
        self.stats = IngestStats()
        self.endpoint = config.endpoint
        """The endpoint bound (a `tcp://host:*` endpoint gets its port here)."""
        self._topic = config.topic.encode()
        self._context = zmq.asyncio.Context()
        self._stop = anyio.Event()
        self._pending: list[AnyCommand] = []
        self._run_id = uuid4().hex[:12]
        self._command_count = 0
        self._duplicates: tuple[int, int] | None = None
        """(next, last): after a replay, the live socket still holds the batches it queued meanwhile,
        in order from the one after the frame that set off the replay: those up to the last batch
        replayed are copies. Anything else ends the run of copies (a restart's batch 0 included)."""
        self._last_progress = time.monotonic()

    def stop(self) -> None:
        """Finish the frames in hand, commit them, and return from `run`."""
        self._stop.set()

    async def run(self, *, on_ready: Callable[[Ingestor], None] | None = None) -> IngestStats:
        """Bind, record until `stop()`, then commit what is in hand and close the sockets."""
        with structlog.contextvars.bound_contextvars(engine=self.config.engine_id):
            await self._begin()
            sub = self._context.socket(zmq.SUB)
            try:
                sub.setsockopt(zmq.LINGER, 0)
                sub.setsockopt(zmq.MAXMSGSIZE, self.config.max_frame)
                sub.setsockopt(zmq.RCVHWM, 100_000)  # vLLM's PUB side keeps 100,000 (its `hwm`)
                sub.setsockopt(zmq.SUBSCRIBE, self._topic)
                sub.bind(self.config.endpoint)
                self.endpoint = str(sub.getsockopt_string(zmq.LAST_ENDPOINT))
                log.info(
                    "ingest_started",
                    endpoint=self.endpoint,
                    replay=self.config.replay,
                    topic=self.config.topic,
                    expected=self.stats.expected,
                    global_seq=self.ledger.last_seq,
                )
                if on_ready is not None:
                    on_ready(self)
                await self._loop(sub)
            finally:
                with anyio.CancelScope(shield=True):
                    sub.close(linger=0)
                    self._context.destroy(linger=0)
            log.info("ingest_stopped", **msgspec.structs.asdict(self.stats), global_seq=self.ledger.last_seq)
            return self.stats

    # --- the loop ---------------------------------------------------------------------------

    async def _loop(self, sub: zmq.asyncio.Socket) -> None:
        while not self._stop.is_set():
            if not await sub.poll(timeout=100):
                self._progress()
                continue
            # Everything already queued goes into one commit.
            while len(self._pending) < MAX_GROUP:
                try:
                    frames = await sub.recv_multipart(flags=zmq.NOBLOCK)
                except zmq.Again:
                    break
                await self._live(frames)
            await self._flush()
            self._progress()

    async def _begin(self) -> None:
        """Observe the engine, unless the ledger already observes it under this namespace: then
        resume at the batch after its last recorded one (a gap, if any, is asked of the replay)."""
        known = self.ledger.state.observed.get(self.config.engine_id)
        wanted = namespace_id(self.config.namespace)
        if known is not None and known.namespace_id == wanted:
            self.stats.expected = known.next_seq
            log.info("ingest_resumed", incarnation=known.incarnation, expected=known.next_seq, complete=known.complete)
            return
        reason = "first_seen" if known is None else f"namespace changed from {known.namespace_id.hex()} to {wanted.hex()}"
        self._pending.append(self._observe(reason))
        self.stats.expected = 0
        await self._flush()

    def _observe(self, reason: str) -> ObserveEngine:
        return ObserveEngine(
            engine_id=self.config.engine_id, namespace=self.config.namespace, source=self.config.source, reason=reason
        )

    async def _live(self, frames: list[bytes]) -> None:
        if self._topic and frames and frames[0] != self._topic:
            self.stats.skipped += 1  # SUBSCRIBE matches a prefix: "kv" also lets "kv2" through
            return
        decoded = decode_frames(frames)
        seq = decoded.seq
        if self._duplicates is not None:
            following, last = self._duplicates
            self._duplicates = (seq + 1, last) if seq == following and seq < last else None
            if seq == following and seq <= last:
                self.stats.skipped += 1  # recorded from the replay already
                return
        if isinstance(decoded, DecodedBatch) and seq < self.stats.expected:
            log.warning("engine_restarted", last_seq=self.stats.expected - 1, seq=seq)
            self._pending.append(self._observe(f"restart: sequence went back from {self.stats.expected - 1} to {seq}"))
            self.stats.restarts += 1
            self.stats.expected = 0
        if seq > self.stats.expected:
            await self._fill(self.stats.expected, seq - 1)
            if seq < self.stats.expected:  # the replay brought it, and maybe later ones the socket holds too
                if seq + 1 < self.stats.expected:
                    self._duplicates = (seq + 1, self.stats.expected - 1)
                return
        self._record(decoded)

    def _record(self, decoded: DecodedBatch | Unreadable) -> None:
        engine_id = self.config.engine_id
        if isinstance(decoded, Unreadable):
            log.warning("frame_malformed", seq=decoded.seq, detail=decoded.detail)
            self.stats.malformed += 1
            self._pending.append(decoded.command(engine_id))
        else:
            self.stats.batches += 1
            self.stats.events += len(decoded.events)
            self._pending.append(decoded.command(engine_id))
        if decoded.seq >= self.stats.expected:
            self.stats.expected = decoded.seq + 1

    def _gap(self, first: int, last: int, reason: str) -> None:
        log.warning("events_missed", first_seq=first, last_seq=last, reason=reason)
        self.stats.gaps += 1
        self._pending.append(ObserveGap(engine_id=self.config.engine_id, first_seq=first, last_seq=last, reason=reason))
        self.stats.expected = last + 1

    # --- replay -------------------------------------------------------------------------------

    async def _fill(self, first: int, last: int) -> None:
        """Ask the replay socket for batches first.. (it sends every buffered batch from there on,
        then an end marker); record them, and as missed whatever of first..last it lacks."""
        if self.config.replay is None:
            self._gap(first, last, "no replay endpoint")
            return
        log.info("replay_requested", first_seq=first, last_seq=last, replay=self.config.replay)
        dealer = self._context.socket(zmq.DEALER)
        delivered: list[int] = []
        answered = False
        try:
            dealer.setsockopt(zmq.LINGER, 0)
            dealer.setsockopt(zmq.MAXMSGSIZE, self.config.max_frame)
            dealer.connect(self.config.replay)
            with anyio.move_on_after(self.config.replay_timeout):
                await dealer.send_multipart(replay_request(first))
            while True:
                frames: list[bytes] | None = None
                with anyio.move_on_after(self.config.replay_timeout):
                    frames = await dealer.recv_multipart()
                if frames is None:
                    break
                if frames and frames[0] == b"":
                    frames = frames[1:]  # the ROUTER's empty delimiter
                if len(frames) == 3 and is_replay_end(sequence(frames[1]), frames[2]):
                    answered = True
                    break
                decoded = decode_frames(frames)
                if decoded.seq < self.stats.expected:
                    continue  # before what is asked (or unreadable with no sequence: nothing to place)
                if decoded.seq > self.stats.expected:
                    self._gap(self.stats.expected, decoded.seq - 1, "the replay buffer did not hold them")
                self._record(decoded)
                self.stats.replayed += 1
                delivered.append(decoded.seq)
        finally:
            dealer.close(linger=0)
        if self.stats.expected <= last:
            why = (
                "the replay buffer did not hold them"
                if answered
                else (f"the replay endpoint did not answer within {self.config.replay_timeout:g} s")
            )
            self._gap(self.stats.expected, last, why)
        log.info("replay_done", first_seq=first, last_seq=last, replayed=len(delivered), answered=answered)

    # --- committing ---------------------------------------------------------------------------

    async def _flush(self) -> None:
        """Commit what is pending in one append; while the log is unavailable, try again."""
        if not self._pending:
            return
        group = []
        for command in self._pending:
            self._command_count += 1
            group.append(Single(command=command, command_id=f"ingest/{self._run_id}/{self._command_count}"))
        self._pending = []
        while True:
            try:
                commits = await self.ledger.commit_group(group)
                break
            except LogUnavailable as error:
                if self._stop.is_set():
                    # Nothing of the group is in the log: the next start resumes before it and asks
                    # the replay socket for those batches.
                    log.error("ingest_stopped_uncommitted", error=str(error), commands=len(group))
                    return
                log.warning("log_unavailable", error=str(error), retry_in=self.config.retry_every, commands=len(group))
                await anyio.sleep(self.config.retry_every)
        for commit in commits:
            assert isinstance(commit, Commit)  # a Single commits as a Commit
            for event in commit.events:
                if isinstance(event, Refused):
                    self.stats.refusals += 1
                    log.warning("observed_refused", command=event.command, reason=str(event.reason), detail=event.detail)

    def _progress(self) -> None:
        now = time.monotonic()
        if now - self._last_progress >= self.config.progress_every:
            self._last_progress = now
            log.info("ingest_progress", **msgspec.structs.asdict(self.stats), global_seq=self.ledger.last_seq)
