"""`kvledger ingest vllm` against vLLM's wire format on real ZMQ sockets (loopback).

A fake vLLM in the test publishes frames exactly as vLLM's ZmqEventPublisher does (topic, 8-byte
big-endian sequence number, msgpack KVEventBatch), in both encodings: vLLM 0.32's maps tagged by
"type", and the older `array_like` tagged arrays with int hashes. Its socket connects to the
endpoint the ingestor binds, as vLLM's PUB does; it is an XPUB (the same frames as a PUB) only so
that the test can wait for the subscription instead of sleeping. The replay side is a ROUTER that
answers as vLLM's `_service_replay` does. Frames captured from a real vLLM 0.32
(tests/fixtures/vllm/, ops/vllm/probe.py) are replayed too when present.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import anyio
import msgspec
import pytest
import sqlalchemy as sa
import zmq
import zmq.asyncio
from structlog.testing import capture_logs
from typer.testing import CliRunner

from coordinator.audit.queries import Audit
from coordinator.audit.store import sync_index
from coordinator.audit.verify_run import verify_log
from coordinator.cli.main import app
from coordinator.core import CoordinatorCore
from coordinator.core.commands import ObserveEngine
from coordinator.core.state import state_digest
from coordinator.ledger.ledger import Ledger
from coordinator.ledger.recovery import replay
from coordinator.vllm.ingest import IngestConfig, Ingestor
from coordinator.vllm.kv_events import DecodedBatch, Unreadable, decode_frames, decode_payload, hash_bytes
from events import (
    EngineObserved,
    Event,
    EventCodec,
    NamespaceSpec,
    ObservedBlocksRemoved,
    ObservedBlocksStored,
    ObservedCacheCleared,
    ObservedEventsMissed,
    Reason,
    Refused,
)
from events.log import LogUnavailable, SqlEventLog, open_log, upgrade_log
from events.log.reading import decode
from tests.kit import builders as b

pytestmark = pytest.mark.anyio

ENGINE = "vllm-0"
TOPIC = "kv"
BLOCK = 32
FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "vllm"


# --- vLLM's structs, as vllm/distributed/kv_events.py declares them -----------------------------


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class MapEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """vLLM 0.32: events are maps tagged by "type"."""


class BlockStored(MapEvent, tag="BlockStored"):
    block_hashes: list[bytes | int]
    parent_block_hash: bytes | int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None


class BlockRemoved(MapEvent, tag="BlockRemoved"):
    block_hashes: list[bytes | int]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class AllBlocksCleared(MapEvent, tag="AllBlocksCleared"):
    pass


class BlockTeleported(MapEvent, tag="BlockTeleported"):
    """An event type from a vLLM newer than this kvledger."""

    block_hashes: list[bytes]


class ArrayEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    """Older vLLM: events are tagged arrays."""


class OldBlockStored(ArrayEvent, tag="BlockStored"):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None


class OldBlockRemoved(ArrayEvent, tag="BlockRemoved"):
    block_hashes: list[int]
    medium: str | None


class OldAllBlocksCleared(ArrayEvent, tag="AllBlocksCleared"):
    pass


def h(n: int) -> bytes:
    """A vLLM 0.32 block hash (sha256: 32 bytes)."""
    return n.to_bytes(32, "big")


def stored(
    *hashes: bytes, parent: bytes | None = None, size: int = BLOCK, medium: str | None = "GPU", group: int = 0
) -> BlockStored:
    return BlockStored(
        block_hashes=list(hashes),
        parent_block_hash=parent,
        token_ids=list(range(size * len(hashes))),
        block_size=size,
        lora_id=None,
        medium=medium,
        lora_name=None,
        group_idx=group,
        extra_keys=[None] * len(hashes),
        session_id="s-1",
    )


def removed(*hashes: bytes, medium: str | None = "GPU", group: int = 0) -> BlockRemoved:
    return BlockRemoved(block_hashes=list(hashes), medium=medium, group_idx=group)


class FakeVllm:
    """vLLM's publisher side: frames out of a socket that connects to the ingestor's endpoint,
    a replay buffer and, with `replay_endpoint`, a ROUTER serving it."""

    END_SEQ = (-1).to_bytes(8, "big", signed=True)

    def __init__(self, context: zmq.asyncio.Context, topic: str = TOPIC) -> None:
        self.context = context
        self.topic = topic.encode()
        self.seq = 0
        self.buffer: list[tuple[int, bytes]] = []
        self.pub = context.socket(zmq.XPUB)
        self.pub.setsockopt(zmq.LINGER, 0)
        self.router: zmq.asyncio.Socket | None = None
        self.replay_requests: list[int] = []

    async def connect(self, endpoint: str) -> None:
        self.pub.connect(endpoint)
        with anyio.fail_after(10):
            subscription = await self.pub.recv()  # the SUB's subscription: frames sent now arrive
        assert subscription[:1] == b"\x01"

    def bind_replay(self) -> str:
        self.router = self.context.socket(zmq.ROUTER)
        self.router.setsockopt(zmq.LINGER, 0)
        self.router.bind("tcp://127.0.0.1:*")
        return str(self.router.getsockopt_string(zmq.LAST_ENDPOINT))

    async def serve_replay(self) -> None:
        assert self.router is not None
        while True:
            client, _, start = await self.router.recv_multipart()
            first = int.from_bytes(start, "big")
            self.replay_requests.append(first)
            for seq, payload in self.buffer:
                if seq >= first:
                    await self.router.send_multipart([client, b"", self.topic, seq.to_bytes(8, "big"), payload])
            await self.router.send_multipart([client, b"", b"", self.END_SEQ, b""])

    async def publish(self, events: list[Any], *, send: bool = True, dp_rank: int | None = 0, ts: float | None = None) -> int:
        """One batch, as ZmqEventPublisher._publisher_thread sends it; `send=False` loses it on
        the way (it is still in the replay buffer)."""
        seq = self.seq
        self.seq += 1
        payload = msgspec.msgpack.encode(
            EventBatch(ts=1_700_000_000.0 + seq if ts is None else ts, events=events, data_parallel_rank=dp_rank)
        )
        self.buffer.append((seq, payload))
        if send:
            await self.pub.send_multipart([self.topic, seq.to_bytes(8, "big"), payload])
        return seq

    async def raw(self, frames: list[bytes]) -> None:
        await self.pub.send_multipart(frames)

    def restart(self) -> None:
        """A new vLLM process: its sequence numbers start at 0 and its replay buffer is empty."""
        self.seq = 0
        self.buffer = []

    def close(self) -> None:
        self.pub.close(linger=0)
        if self.router is not None:
            self.router.close(linger=0)


class Harness:
    def __init__(self, ledger: Ledger, ingestor: Ingestor, vllm: FakeVllm, event_log: SqlEventLog) -> None:
        self.ledger, self.ingestor, self.vllm, self.log = ledger, ingestor, vllm, event_log
        self.done = anyio.Event()

    async def recorded(self, next_seq: int, incarnation: int = 1) -> None:
        """Wait until the log holds the engine's batches before `next_seq` (the ledger's state
        runs ahead of the log while an append is in flight: `committed` waits it out)."""
        with anyio.fail_after(10):
            while True:
                async with self.ledger.committed() as state:
                    observed = state.observed.get(ENGINE)
                    if observed is not None and observed.incarnation == incarnation and observed.next_seq >= next_seq:
                        return
                await anyio.sleep(0.01)

    async def refusals_recorded(self, count: int) -> None:
        with anyio.fail_after(10):
            while self.ingestor.stats.refusals < count:
                await anyio.sleep(0.01)

    async def stop(self) -> None:
        """Stop the ingestor as SIGTERM does (what it holds is committed first) and wait for it."""
        self.ingestor.stop()
        with anyio.fail_after(10):
            await self.done.wait()

    async def logged(self) -> list[tuple[int, Event]]:
        """Every event of the log with its global sequence; the log projects to the ledger's state (I18)."""
        state, _ = await replay(self.log, EventCodec())
        assert state_digest(state) == state_digest(self.ledger.state)
        return [(stored.global_seq, decode(EventCodec(), stored)) for stored in await self.log.read(0, 100_000)]

    async def events(self) -> list[Event]:
        return [event for _, event in await self.logged()]

    def stored(self, place: str = "GPU/0") -> list[bytes]:
        return list(self.ledger.state.observed[ENGINE].stored.get(place, {}))


def namespace(block_sizes: tuple[int, ...] = (BLOCK,)) -> NamespaceSpec:
    return b.namespace(block_sizes=block_sizes, tp=1, hash_algorithm="vllm:sha256")


@pytest.fixture
async def running(tmp_path: Path) -> AsyncIterator[Callable[..., Any]]:
    """Start an ingestor on a SQLite log (a fresh one unless `log_path` names one) and a fake vLLM
    connected to it; stopped and closed at the end of the test."""
    context = zmq.asyncio.Context()
    started: list[Harness] = []
    async with anyio.create_task_group() as tg:

        async def start(
            *,
            replay: str | None = None,
            with_replay: bool = False,
            replay_timeout: float = 1.0,
            log_path: Path | str | None = None,
            block_sizes: tuple[int, ...] = (BLOCK,),
        ) -> Harness:
            url = str(log_path or tmp_path / "log.sqlite")
            if url.startswith("postgresql"):
                await upgrade_log(url)
            event_log = await open_log(url)
            assert isinstance(event_log, SqlEventLog)
            ledger = await Ledger.open(event_log)
            vllm = FakeVllm(context)
            if with_replay:
                replay = vllm.bind_replay()
                tg.start_soon(vllm.serve_replay)
            config = IngestConfig(
                endpoint="tcp://127.0.0.1:*",
                engine_id=ENGINE,
                namespace=namespace(block_sizes),
                topic=TOPIC,
                replay=replay,
                replay_timeout=replay_timeout,
                retry_every=0.05,
            )
            harness = Harness(ledger, Ingestor(ledger, config), vllm, event_log)
            ready = anyio.Event()

            async def run() -> None:
                try:
                    await harness.ingestor.run(on_ready=lambda _: ready.set())
                finally:
                    harness.done.set()

            tg.start_soon(run)
            with anyio.fail_after(10):
                await ready.wait()
            await vllm.connect(harness.ingestor.endpoint)
            started.append(harness)
            return harness

        try:
            yield start
        finally:
            for harness in started:
                await harness.stop()
            tg.cancel_scope.cancel()  # the replay servers
    for harness in started:  # their sockets closed once nothing waits on them
        harness.vllm.close()
        await harness.log.close()
    context.destroy(linger=0)


# --- decoding (pure) ----------------------------------------------------------------------------


def test_both_encodings_decode_to_the_same_normalized_events() -> None:
    new = msgspec.msgpack.encode(
        EventBatch(
            ts=5.0,
            events=[
                BlockStored(
                    block_hashes=[7, 2**64 - 1],
                    parent_block_hash=-1,
                    token_ids=[1, 2],
                    block_size=1,
                    lora_id=3,
                    medium=None,
                    lora_name="x",
                    group_idx=None,
                ),
                BlockRemoved(block_hashes=[7], medium="CPU"),
                AllBlocksCleared(),
            ],
            data_parallel_rank=2,
        )
    )
    old = msgspec.msgpack.encode(
        EventBatch(
            ts=5.0,
            events=[
                OldBlockStored(
                    block_hashes=[7, 2**64 - 1], parent_block_hash=-1, token_ids=[1, 2], block_size=1, lora_id=3, medium=None
                ),
                OldBlockRemoved(block_hashes=[7], medium="CPU"),
                OldAllBlocksCleared(),
            ],
            data_parallel_rank=2,
        )
    )
    decoded = [decode_payload(4, payload) for payload in (new, old)]
    assert isinstance(decoded[0], DecodedBatch) and decoded[0] == decoded[1]
    first, second, third = decoded[0].events
    assert (first.kind, first.medium, first.group, first.lora_id) == ("stored", "GPU", 0, 3)
    assert first.block_hashes == [bytes(7) + b"\x07", b"\xff" * 8] and first.parent_hash == b"\xff" * 8
    assert (second.kind, second.medium, second.block_hashes) == ("removed", "CPU", [bytes(7) + b"\x07"])
    assert (third.kind, third.medium) == ("cleared", "GPU")
    assert (decoded[0].seq, decoded[0].ts, decoded[0].dp_rank) == (4, 5.0, 2)


def test_int_hashes_become_8_byte_big_endian_twos_complement() -> None:
    assert hash_bytes(1) == bytes(7) + b"\x01"
    assert hash_bytes(-1) == hash_bytes(2**64 - 1) == b"\xff" * 8  # Python's hash() and vLLM's masked int
    assert hash_bytes(2**70) == (2**70).to_bytes(9, "big", signed=True)  # as many signed bytes as it needs
    assert hash_bytes(b"\x01\x02") == b"\x01\x02"


def test_unknown_fields_and_a_batch_map_are_tolerated() -> None:
    payload = msgspec.msgpack.encode(
        {
            "ts": 1,
            "events": [
                {
                    "type": "BlockStored",
                    "block_hashes": [b"\x01" * 32],
                    "parent_block_hash": None,
                    "token_ids": [1],
                    "block_size": 1,
                    "lora_id": None,
                    "medium": "GPU",
                    "group_idx": 1,
                    "a_field_from_the_future": [1, 2],
                },
                ["BlockRemoved", [b"\x01" * 32], "GPU", 1, "LOCAL", "owner", "and more"],
            ],
            "data_parallel_rank": None,
            "extra": 1,
        }
    )
    decoded = decode_payload(0, payload)
    assert isinstance(decoded, DecodedBatch)
    assert [(e.kind, e.group) for e in decoded.events] == [("stored", 1), ("removed", 1)]


@pytest.mark.parametrize(
    ("frames", "detail"),
    [
        ([b"kv", (0).to_bytes(8, "big")], "2 frames"),
        ([b"kv", b"\x00\x01", b"\x90"], "sequence-number frame of 2 bytes"),
        ([b"kv", (3).to_bytes(8, "big"), b"\x93\xcb\x41"], "not a msgpack batch"),
        ([b"kv", (3).to_bytes(8, "big"), msgspec.msgpack.encode("hello")], "not an array or a map"),
        ([b"kv", (3).to_bytes(8, "big"), msgspec.msgpack.encode([float("nan"), []])], "not a finite number"),
    ],
)
def test_unreadable_frames_are_values_naming_what_is_wrong(frames: list[bytes], detail: str) -> None:
    decoded = decode_frames(frames)
    assert isinstance(decoded, Unreadable) and detail in decoded.detail


def test_unreadable_events_are_malformed_or_unknown_never_raised() -> None:
    payload = msgspec.msgpack.encode(
        [
            1.0,
            [
                42,
                ["BlockStored", [1]],
                {"type": "BlockStored", "block_hashes": "x", "parent_block_hash": None, "token_ids": [], "block_size": 1},
                ["Nope"],
                {"no": "type"},
            ],
        ]
    )
    decoded = decode_payload(0, payload)
    assert isinstance(decoded, DecodedBatch)
    assert [e.kind for e in decoded.events] == ["malformed", "malformed", "malformed", "unknown", "malformed"]
    assert decoded.events[3].type_name == "Nope"


# --- ingestion on real sockets --------------------------------------------------------------------


@pytest.mark.parametrize("encoding", ["map", "array"])
async def test_stored_removed_and_cleared_are_recorded_with_the_incarnation(running: Callable[..., Any], encoding: str) -> None:
    harness: Harness = await running()
    vllm = harness.vllm
    if encoding == "map":
        a, b_, c = h(1), h(2), h(3)
        await vllm.publish([stored(a, b_), stored(c, parent=b_)])
        await vllm.publish([removed(b_), stored(h(9), medium="CPU")])
        clear: list[Any] = [AllBlocksCleared()]
    else:  # older vLLM: tagged arrays, int hashes, no medium
        a, b_, c = hash_bytes(1), hash_bytes(-2), hash_bytes(3)
        await vllm.publish(
            [
                OldBlockStored(
                    block_hashes=[1, -2],
                    parent_block_hash=None,
                    token_ids=list(range(64)),
                    block_size=BLOCK,
                    lora_id=None,
                    medium=None,
                ),
                OldBlockStored(
                    block_hashes=[3], parent_block_hash=-2, token_ids=list(range(32)), block_size=BLOCK, lora_id=None, medium=None
                ),
            ],
            dp_rank=None,
        )
        await vllm.publish([OldBlockRemoved(block_hashes=[-2], medium=None)], dp_rank=None)
        clear = [OldAllBlocksCleared()]
    await harness.recorded(2)
    assert harness.stored() == [a, c]
    await vllm.publish(clear, dp_rank=None if encoding == "array" else 0)
    await harness.recorded(3)
    assert harness.stored() == []
    events = await harness.events()
    [observed] = [e for e in events if isinstance(e, EngineObserved)]
    assert (observed.incarnation, observed.reason) == (1, "first_seen") and "tcp://127.0.0.1:" in observed.source
    stores = [e for e in events if isinstance(e, ObservedBlocksStored)]
    assert [(e.incarnation, e.source_seq, e.block_hashes, e.parent_hash) for e in stores][:2] == [
        (1, 0, [a, b_], None),
        (1, 0, [c], b_),
    ]
    assert stores[0].token_ids == list(range(64)) and stores[0].block_size == BLOCK
    [removal] = [e for e in events if isinstance(e, ObservedBlocksRemoved)]
    assert (removal.source_seq, removal.block_hashes, removal.medium) == (1, [b_], "GPU")
    assert [e.medium for e in events if isinstance(e, ObservedCacheCleared)] == ["GPU"]
    assert not [e for e in events if isinstance(e, Refused)]
    assert harness.ledger.state.observed[ENGINE].complete


async def test_a_gap_is_filled_by_the_replay_socket(running: Callable[..., Any]) -> None:
    harness: Harness = await running(with_replay=True)
    vllm = harness.vllm
    await vllm.publish([stored(h(1))])
    await vllm.publish([stored(h(2), parent=h(1))], send=False)  # lost on the way
    await vllm.publish([stored(h(3), parent=h(2))], send=False)
    await vllm.publish([removed(h(1))])
    await vllm.publish([stored(h(4), parent=h(3))])  # after the replay: its live copy is not a restart
    await harness.recorded(5)
    assert vllm.replay_requests == [1]
    observed = harness.ledger.state.observed[ENGINE]
    assert observed.complete and observed.incarnation == 1
    assert harness.stored() == [h(2), h(3), h(4)]
    events = await harness.events()
    assert [e.source_seq for e in events if isinstance(e, ObservedBlocksStored)] == [0, 1, 2, 4]
    assert not [e for e in events if isinstance(e, ObservedEventsMissed | Refused)]
    assert len([e for e in events if isinstance(e, EngineObserved)]) == 1


async def test_a_gap_the_replay_buffer_no_longer_holds_is_recorded_and_the_next_batch_kept(running: Callable[..., Any]) -> None:
    harness: Harness = await running(with_replay=True)
    vllm = harness.vllm
    await vllm.publish([stored(h(1))])
    await vllm.publish([stored(h(2), parent=h(1))], send=False)
    await vllm.publish([stored(h(3), parent=h(2))], send=False)
    vllm.buffer = [entry for entry in vllm.buffer if entry[0] != 1]  # the buffer dropped batch 1
    await vllm.publish([stored(h(4), parent=h(3))])
    await harness.recorded(4)
    events = await harness.events()
    [missed] = [e for e in events if isinstance(e, ObservedEventsMissed)]
    assert (missed.first_seq, missed.last_seq) == (1, 1) and "replay buffer" in missed.reason
    assert [e.source_seq for e in events if isinstance(e, ObservedBlocksStored)] == [0, 2, 3]
    assert not harness.ledger.state.observed[ENGINE].complete


async def test_a_gap_with_no_replay_answer_is_recorded_after_the_timeout(running: Callable[..., Any]) -> None:
    silent = zmq.asyncio.Context()
    nobody = silent.socket(zmq.ROUTER)  # binds, never answers
    nobody.bind("tcp://127.0.0.1:*")
    try:
        harness: Harness = await running(replay=str(nobody.getsockopt_string(zmq.LAST_ENDPOINT)), replay_timeout=0.3)
        await harness.vllm.publish([stored(h(1))])
        await harness.vllm.publish([stored(h(2), parent=h(1))], send=False)
        await harness.vllm.publish([stored(h(3), parent=h(2))])
        await harness.recorded(3)
        [missed] = [e for e in await harness.events() if isinstance(e, ObservedEventsMissed)]
        assert (missed.first_seq, missed.last_seq) == (1, 1) and "did not answer within 0.3 s" in missed.reason
        assert harness.stored() == [h(1), h(3)]  # with the view incomplete, 3's parent is not checked
    finally:
        nobody.close(linger=0)
        silent.destroy(linger=0)


async def test_a_restart_seq_back_to_0_is_a_new_incarnation(running: Callable[..., Any]) -> None:
    harness: Harness = await running()
    vllm = harness.vllm
    for n in range(1, 4):
        await vllm.publish([stored(h(n), parent=h(n - 1) if n > 1 else None)])
    await harness.recorded(3)
    vllm.restart()
    with capture_logs() as logs:
        await vllm.publish([stored(h(7))])
        await harness.recorded(1, incarnation=2)
    assert {"event": "engine_restarted", "log_level": "warning", "last_seq": 2, "seq": 0} in logs
    events = await harness.events()
    restarts = [e for e in events if isinstance(e, EngineObserved)]
    assert [e.incarnation for e in restarts] == [1, 2]
    assert "from 2 to 0" in restarts[1].reason
    assert harness.stored() == [h(7)] and harness.ledger.state.observed[ENGINE].complete
    assert harness.ingestor.stats.restarts == 1


async def test_bad_input_is_refused_and_ingestion_goes_on(running: Callable[..., Any]) -> None:
    harness: Harness = await running()
    vllm = harness.vllm
    seq_frame = (1).to_bytes(8, "big")
    await vllm.publish([stored(h(1))])
    await harness.recorded(1)
    before = harness.stored()
    # A malformed payload, and a truncated frame (its payload frame missing) for batch 1.
    await vllm.raw([vllm.topic, seq_frame, b"\xc1 not msgpack"])
    await vllm.raw([vllm.topic, seq_frame])
    await harness.refusals_recorded(2)
    assert harness.stored() == before
    vllm.seq = 2
    # An unknown event type, an impossible parent chain and a mismatched block size, then good ones.
    await vllm.publish(
        [BlockTeleported(block_hashes=[h(5)]), stored(h(6), parent=h(99)), stored(h(8), size=16), stored(h(2), parent=h(1))]
    )
    await vllm.publish([stored(h(3), parent=h(2))])
    await harness.recorded(4)
    refused = [e for e in await harness.events() if isinstance(e, Refused)]
    assert [e.reason for e in refused] == [
        Reason.MALFORMED_EVENT,
        Reason.MALFORMED_EVENT,
        Reason.UNKNOWN_EVENT_TYPE,
        Reason.NAMESPACE_MISMATCH,
    ]
    assert "batch 1" in refused[0].detail and "not a msgpack batch" in refused[0].detail
    assert "2 frames" in refused[1].detail and "BlockTeleported" in refused[2].detail
    assert "block size 16" in refused[3].detail and f"says {BLOCK}" in refused[3].detail
    # Batch 1 was never readable, so the view is incomplete from batch 2 on (6's parent is not
    # checked: the unreadable batch may have stored it); the next good batches are recorded.
    assert harness.stored() == [h(1), h(6), h(2), h(3)]
    assert not harness.ledger.state.observed[ENGINE].complete


async def test_an_impossible_parent_chain_and_a_mismatched_block_size_are_refused_on_a_complete_view(
    running: Callable[..., Any],
) -> None:
    harness: Harness = await running()
    vllm = harness.vllm
    await vllm.publish([stored(h(1))])
    await vllm.publish([stored(h(6), parent=h(99)), stored(h(8), size=16, parent=h(1)), stored(h(2), parent=h(1))])
    await vllm.publish([removed(h(42)), stored(h(3), parent=h(2))])
    await harness.recorded(3)
    refused = [e for e in await harness.events() if isinstance(e, Refused)]
    assert [e.reason for e in refused] == [Reason.BROKEN_PARENT_CHAIN, Reason.NAMESPACE_MISMATCH, Reason.UNKNOWN_BLOCK_HASH]
    assert h(99).hex() in refused[0].detail
    assert "block size 16" in refused[1].detail and f"says {BLOCK}" in refused[1].detail
    assert all(e.engine_id == ENGINE and e.command == "observe_kv_events" for e in refused)
    assert harness.stored() == [h(1), h(2), h(3)] and harness.ledger.state.observed[ENGINE].complete


async def test_ingestion_resumes_on_the_ledger_without_a_new_incarnation(running: Callable[..., Any], tmp_path: Path) -> None:
    path = tmp_path / "resume.sqlite"
    first: Harness = await running(log_path=path)
    await first.vllm.publish([stored(h(1))])
    await first.recorded(1)
    await first.stop()
    second: Harness = await running(log_path=path)
    assert second.ingestor.stats.expected == 1
    second.vllm.seq = 1
    await second.vllm.publish([stored(h(2), parent=h(1))])
    await second.recorded(2)
    assert second.ledger.state.observed[ENGINE].incarnation == 1 and second.stored() == [h(1), h(2)]


async def test_batches_are_committed_once_when_the_log_comes_back(running: Callable[..., Any]) -> None:
    harness: Harness = await running()
    append = harness.log.append
    outage = [2]

    async def unavailable_twice(batches: Any, *, expected_head: int | None = None) -> Any:
        if outage[0]:
            outage[0] -= 1
            raise LogUnavailable("the database went away (test)")
        return await append(batches, expected_head=expected_head)

    setattr(harness.log, "append", unavailable_twice)  # noqa: B010 - the log's own append, failing first
    with capture_logs() as logs:
        for n in range(1, 4):
            await harness.vllm.publish([stored(h(n), parent=h(n - 1) if n > 1 else None)])
        await harness.recorded(3)
    assert outage == [0] and [line["event"] for line in logs].count("log_unavailable") == 2
    events = await harness.events()
    assert [e.source_seq for e in events if isinstance(e, ObservedBlocksStored)] == [0, 1, 2]
    assert harness.stored() == [h(1), h(2), h(3)] and not [e for e in events if isinstance(e, Refused)]


# --- the audit ------------------------------------------------------------------------------------


async def test_audit_hash_says_when_each_hash_was_stored_and_removed(log_url: str, running: Callable[..., Any]) -> None:
    """On SQLite and PostgreSQL."""
    path = log_url
    harness: Harness = await running(log_path=path, block_sizes=(BLOCK, BLOCK))
    vllm = harness.vllm
    await vllm.publish([stored(h(1)), stored(h(1), medium="CPU", group=1)])  # batch 0
    await vllm.publish([removed(h(1))])  # batch 1
    await vllm.publish([stored(h(1)), removed(h(77))])  # batch 2: 77 was never stored: refused
    await vllm.publish([AllBlocksCleared()])  # batch 3
    await harness.recorded(4)
    vllm.restart()
    await vllm.publish([stored(h(1))])
    await harness.recorded(1, incarnation=2)
    seq_of: dict[tuple[str, int, str, int], int] = {}
    for seq, event in await harness.logged():
        if isinstance(event, ObservedBlocksStored | ObservedBlocksRemoved | ObservedCacheCleared | EngineObserved):
            seq_of.setdefault(
                (type(event).__name__, getattr(event, "source_seq", -1), getattr(event, "medium", ""), event.incarnation), seq
            )
    assert (await verify_log(harness.log)).ok

    await sync_index(harness.log)
    answer = await Audit(harness.log).observed(h(1).hex())
    stays = [
        (r.engine, r.incarnation, r.medium, r.group, r.stored_source_seq, r.ended_by, r.ended_source_seq)
        for r in answer.residencies
    ]
    assert stays == [
        (ENGINE, 1, "GPU", 0, 0, "removed", 1),
        (ENGINE, 1, "CPU", 1, 0, "restarted", None),
        (ENGINE, 1, "GPU", 0, 2, "cleared", 3),
        (ENGINE, 2, "GPU", 0, 0, "stored", None),
    ]
    first = answer.residencies[0]
    assert first.stored_seq == seq_of[("ObservedBlocksStored", 0, "GPU", 1)]
    assert first.ended_seq == seq_of[("ObservedBlocksRemoved", 1, "GPU", 1)]
    assert answer.residencies[2].ended_seq == seq_of[("ObservedCacheCleared", 3, "GPU", 1)]
    assert answer.residencies[1].ended_seq == seq_of[("EngineObserved", -1, "", 2)]
    assert answer.total == 5 and answer.tenant == "tenant-a"

    await harness.stop()
    runner = CliRunner()

    def cli(*args: str) -> Any:
        return runner.invoke(app, list(args))

    async def invoke(*args: str) -> Any:  # the command runs its own event loop: in a thread
        return await anyio.to_thread.run_sync(lambda: cli(*args))

    result = await invoke("audit", "hash", h(1).hex(), "--log", str(path), "--json")
    assert result.exit_code == 0, result.output
    assert [r["ended_by"] for r in json.loads(result.stdout)["residencies"]] == ["removed", "restarted", "cleared", "stored"]
    result = await invoke("audit", "hash", "0x" + h(1).hex(), "--log", str(path))
    assert result.exit_code == 0 and "removed" in result.stdout and "CPU/1" in result.stdout
    result = await invoke("audit", "hash", h(12345).hex(), "--log", str(path))
    assert result.exit_code == 2 and "not in the log" in result.output
    result = await invoke("audit", "hash", "xyz", "--log", str(path))
    assert result.exit_code == 2 and "not hex" in result.output
    result = await invoke("audit", "refusals", "--log", str(path), "--json")
    [refusal] = json.loads(result.stdout)
    assert (refusal["engine"], refusal["subject"], refusal["reason"]) == (ENGINE, "observe_kv_events", "unknown_block_hash")
    assert h(77).hex() in refusal["detail"]


async def test_another_tenant_does_not_see_an_observed_hash(running: Callable[..., Any]) -> None:
    harness: Harness = await running()
    await harness.vllm.publish([stored(h(1))])
    await harness.recorded(1)
    await sync_index(harness.log)
    assert (await Audit(harness.log, tenant="tenant-a").observed(h(1).hex())).residencies
    from coordinator.audit.answers import OutOfScope

    with pytest.raises(OutOfScope):
        await Audit(harness.log, tenant="tenant-b").observed(h(1).hex())


async def test_0004_creates_the_observed_table_and_its_downgrade_makes_the_index_rebuild(
    log_url: str, running: Callable[..., Any]
) -> None:
    """On SQLite and PostgreSQL: upgraded, the table is what events/log/schema.py declares;
    downgraded to 0003, it is gone with the rest of the index and its checkpoint; upgraded again,
    the index is rebuilt from the log with the observed rows."""
    from sqlalchemy.ext.asyncio import create_async_engine

    import migrations
    from events.log import normalize
    from events.log import schema as t

    harness: Harness = await running(log_path=log_url)
    await harness.vllm.publish([stored(h(1), h(2))])
    await harness.recorded(1)
    await harness.stop()
    await sync_index(harness.log)
    url = log_url if log_url.startswith("postgresql") else f"sqlite:///{log_url}"

    async def on_connection(work: Callable[[Any], Any]) -> Any:
        engine = create_async_engine(normalize(url))
        try:
            async with engine.begin() as conn:
                return await conn.run_sync(work)
        finally:
            await engine.dispose()

    def shape(conn: Any) -> tuple[list[str], list[str], int]:
        inspector = sa.inspect(conn)
        columns = [c["name"] for c in inspector.get_columns("kvl_audit_observed")]
        indexes = [i["name"] for i in inspector.get_indexes("kvl_audit_observed")]
        return columns, indexes, int(conn.execute(sa.text("SELECT count(*) FROM kvl_audit_observed")).scalar())

    assert await on_connection(shape) == ([c.name for c in t.audit_observed.columns], ["ix_kvl_audit_observed_hash"], 2)

    def downgrade(conn: Any) -> tuple[bool, int, int]:
        migrations.downgrade(conn, "0003")
        checkpoint = conn.execute(sa.text("SELECT count(*) FROM kvl_checkpoints WHERE name = 'audit'")).scalar()
        engines = conn.execute(sa.text("SELECT count(*) FROM kvl_audit_engines")).scalar()
        return sa.inspect(conn).has_table("kvl_audit_observed"), int(checkpoint), int(engines)

    assert await on_connection(downgrade) == (False, 0, 0)
    assert await upgrade_log(log_url) == migrations.head()
    await sync_index(harness.log)
    assert (await on_connection(shape))[2] == 2
    assert [r.ended_by for r in (await Audit(harness.log).observed(h(2).hex())).residencies] == ["stored"]


# --- the command ----------------------------------------------------------------------------------


def test_the_command_records_until_sigterm_and_stops_cleanly(tmp_path: Path) -> None:
    path = tmp_path / "cli.sqlite"
    context = zmq.Context()
    probe = context.socket(zmq.SUB)
    probe.bind("tcp://127.0.0.1:*")
    endpoint = str(probe.getsockopt_string(zmq.LAST_ENDPOINT))
    probe.close(linger=0)  # a free port, now bound by the command
    command = [
        sys.executable,
        "-m",
        "coordinator.cli",
        "ingest",
        "vllm",
        "--endpoint",
        endpoint,
        "--engine-id",
        ENGINE,
        "--log",
        str(path),
        "--topic",
        TOPIC,
        "--model-id",
        "org/model",
        "--weights-revision",
        "sha256:1111",
        "--tokenizer-digest",
        "sha256:2222",
        "--block-size",
        str(BLOCK),
        "--progress-every",
        "0.2",
    ]
    process = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env={**os.environ, "KVLEDGER_LOG_LEVEL": "info"}
    )
    pub = context.socket(zmq.XPUB)
    try:
        assert process.stdout is not None
        assert "bound" in process.stdout.readline()
        pub.connect(endpoint)
        pub.setsockopt(zmq.RCVTIMEO, 10_000)
        assert pub.recv()[:1] == b"\x01"
        for seq in range(3):
            payload = msgspec.msgpack.encode(EventBatch(ts=1.0, events=[stored(h(seq + 1), parent=h(seq) if seq else None)]))
            pub.send_multipart([TOPIC.encode(), seq.to_bytes(8, "big"), payload])
        pub.send_multipart([TOPIC.encode(), (3).to_bytes(8, "big"), b"\xc1"])
        anyio.run(anyio.sleep, 1.0)
        process.send_signal(signal.SIGTERM)
        _, stderr = process.communicate(timeout=20)
    finally:
        if process.poll() is None:
            process.kill()
        pub.close(linger=0)
        context.destroy(linger=0)
    assert process.returncode == 0, stderr
    lines = [json.loads(line) for line in stderr.splitlines() if line.startswith("{")]
    names = [line["event"] for line in lines]
    assert "ingest_started" in names and "ingest_progress" in names and "frame_malformed" in names
    stopped = next(line for line in lines if line["event"] == "ingest_stopped")
    assert (stopped["batches"], stopped["malformed"], stopped["refusals"], stopped["engine"]) == (3, 1, 1, ENGINE)

    async def check() -> None:
        event_log = await open_log(str(path))
        try:
            state, _ = await replay(event_log, EventCodec())
        finally:
            await event_log.close()
        assert list(state.observed[ENGINE].stored["GPU/0"]) == [h(1), h(2), h(3)]

    anyio.run(check)


def test_a_namespace_that_is_not_usable_is_one_line_exit_2(tmp_path: Path) -> None:
    result = CliRunner().invoke(
        app,
        [
            "ingest",
            "vllm",
            "--endpoint",
            "tcp://127.0.0.1:1",
            "--engine-id",
            ENGINE,
            "--log",
            str(tmp_path / "x.sqlite"),
            "--model-id",
            "m",
            "--weights-revision",
            "",
            "--tokenizer-digest",
            "t",
            "--block-size",
            "16",
        ],
    )
    assert result.exit_code == 2 and "weights_revision is empty" in result.output


# --- a real vLLM's frames ---------------------------------------------------------------------------
# tests/fixtures/vllm/README.md: vLLM 0.32 on a tiny local model, block size 32; int hashes, bytes
# hashes, and an offloading connector's CPU tier (ops/vllm/probe.py records them).

FIXTURE_NAMES = ["kv_events_0_32", "kv_events_0_32_bytes", "kv_events_0_32_offload"]


def fixture(name: str, suffix: str = "") -> list[list[bytes]]:
    path = FIXTURES / f"{name}.msgpack-frames{suffix}"
    if not path.exists():
        pytest.skip(f"no frames captured from a real vLLM at {path} (ops/vllm/probe.py records them)")
    frames: list[list[bytes]] = msgspec.msgpack.decode(path.read_bytes())
    return frames


@pytest.mark.parametrize("name", FIXTURE_NAMES)
async def test_frames_captured_from_a_real_vllm_are_recorded_without_refusal(running: Callable[..., Any], name: str) -> None:
    frames = fixture(name)
    decoded = [decode_frames(message) for message in frames]
    assert all(isinstance(d, DecodedBatch) for d in decoded), [d for d in decoded if isinstance(d, Unreadable)]
    harness: Harness = await running()
    for message in frames:
        await harness.vllm.raw(message)
    await harness.recorded(len(frames))
    events = await harness.events()
    assert not [e for e in events if isinstance(e, Refused | ObservedEventsMissed)]
    kinds = {type(e) for e in events}
    assert {ObservedBlocksStored, ObservedBlocksRemoved, ObservedCacheCleared} <= kinds
    assert harness.ledger.state.observed[ENGINE].complete
    if name.endswith("offload"):
        assert harness.stored("CPU/0")  # the connector's tier, untouched by the GPU cache's reset


def test_int_hashes_of_a_real_vllm_are_the_low_8_bytes_of_its_bytes_hashes() -> None:
    """The same blocks recorded with int and with bytes hashes: the int one normalizes to the
    last 8 bytes of the sha256 (vLLM's `maybe_convert_block_hash`)."""

    def hashes(name: str) -> list[bytes]:
        found = []
        for message in fixture(name):
            decoded = decode_frames(message)
            assert isinstance(decoded, DecodedBatch)
            found += [block for event in decoded.events for block in event.block_hashes]
        return found

    as_ints, as_bytes = hashes("kv_events_0_32"), hashes("kv_events_0_32_bytes")
    assert as_ints and len(as_bytes[0]) == 32
    assert as_ints == [block[-8:] for block in as_bytes]


async def test_a_gap_is_filled_from_a_real_vllm_replay_answer(running: Callable[..., Any]) -> None:
    """The ROUTER answers with exactly what a real vLLM's replay socket sent (the `.replay` file)."""
    live, answer = fixture("kv_events_0_32"), fixture("kv_events_0_32", ".replay")
    harness: Harness = await running()
    router = harness.vllm.context.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    router.bind("tcp://127.0.0.1:*")
    harness.ingestor.config = msgspec.structs.replace(
        harness.ingestor.config, replay=str(router.getsockopt_string(zmq.LAST_ENDPOINT))
    )
    try:
        async with anyio.create_task_group() as tg:

            async def serve() -> None:
                client, _, start = await router.recv_multipart()
                first = int.from_bytes(start, "big")
                for frames in answer:
                    seq = int.from_bytes(frames[2], "big", signed=True)
                    if seq >= first or seq == -1:
                        await router.send_multipart([client, *frames])

            tg.start_soon(serve)
            await harness.vllm.raw(live[0])
            await harness.vllm.raw(live[-1])  # everything between is lost on the way
            await harness.recorded(len(live))
        events = await harness.events()
        assert not [e for e in events if isinstance(e, Refused | ObservedEventsMissed)]
        assert harness.ingestor.stats.replayed == len(live) - 1 and harness.ledger.state.observed[ENGINE].complete
        full = CoordinatorCore()
        full.execute(ObserveEngine(engine_id=ENGINE, namespace=namespace(), source="s", reason="r"))
        for message in live:
            decoded = decode_frames(message)
            assert isinstance(decoded, DecodedBatch)
            full.execute(decoded.command(ENGINE))
        assert harness.ledger.state.observed[ENGINE].stored == full.state.observed[ENGINE].stored
    finally:
        router.close(linger=0)
