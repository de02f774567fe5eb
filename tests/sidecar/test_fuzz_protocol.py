"""Fuzzing the sidecar protocol (issue 10, item 7): hostile frames against a real sidecar.

A real Sidecar (coordinator/sidecar/server.py) runs in this process, in a blocking portal's event
loop on a thread of its own, on a real Unix socket over a temporary SQLite log. Three engines are
declared: `fuzz-a`, whose connections the fuzzer opens, `fuzz-b` (another engine, for commands
that name it) and `bystander`, a well-behaved EngineClient. Each example opens a connection,
says Hello or not (as fuzz-a's engine, one of its workers, an observer or an operator), sends
the fuzzed bytes, closes its sending side and reads every reply, the whole exchange under a
deadline. It checks:

* nothing hangs: every exchange ends within EXCHANGE_SECONDS (the server closes the connection
  once the client's side is closed);
* every reply is typed: a frame the client's decoder (protocol.decode_server) takes, an Error
  with a code and a reason; nothing follows a fatal Error; every whole frame gets its one reply
  (a Subscribe none) unless a fatal Error ends the connection first;
* a frame answered only by Errors changed nothing: the log's head and the state digest
  (coordinator.core.state.state_digest) are as before. REFUSED is the exception the protocol names: a
  refused declaration is recorded (I1), so only `Refused` events may have been appended;
* fuzz-a's connections (its engine's, its workers') never change fuzz-b's engine or jobs (I9);
* a retried step is answered as the step it committed, never as another;
* the server handled whatever it raised (no `connection_failed` log line), no input made an
  append fail (COMMIT_FAILED) or the ledger rebuild, it is still ready, and the bystander steps
  fine after every example.

Inputs: raw bytes; frames holding random bytes, random msgpack, or messages built from the real
protocol's msgspec types (protocol.ClientMessage and coordinator.core.commands, walked with
msgspec.inspect) with values at the edges (negative, 2**31, 2**63, 2**64-1, NaN, long strings),
as they are or with one thing wrong (a field of another type, a field missing, an unknown field,
an unknown tag); truncated frames; a length over --max-frame; huge lists; reports naming the
prepared jobs (fuzz-a's and fuzz-b's). Ids come from small pools, so steps arrive out of order,
commands name other engines and command ids come back with other content.

KVLEDGER_FUZZ_EXAMPLES=N runs N examples per fuzz test (the default keeps the file under a
minute on two shared cores). The findings are the regression tests at the end, each with its
minimal input.
"""

from __future__ import annotations

import copy
import math
import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, TypeVar

import anyio
import msgspec
import msgspec.inspect as mi
import pytest
from anyio.from_thread import BlockingPortal, start_blocking_portal
from anyio.streams.buffered import BufferedByteReceiveStream
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from structlog.testing import capture_logs

from coordinator import unix_streams
from coordinator.audit.store import sync_index
from coordinator.client import Address, EngineClient, SidecarError, SyncWorkerClient, WorkerClient
from coordinator.core.commands import AllocateBlocks, EndStep, ReportRank, StartOwner
from coordinator.core.state import state_digest
from coordinator.sidecar import admission
from coordinator.sidecar import protocol as p
from coordinator.sidecar.admission import MAX_POOL_ID
from coordinator.sidecar.server import Sidecar
from events import BlocksAllocated, EventCodec, NoticeDropped, OwnerStarted, Reason, Refused, StepBegan, TierSpec
from events.log import EventLog, SqlEventLog, open_log, upgrade_log
from tests.conftest import log_url_for
from tests.kit import builders as b
from tests.kit.sidecar import TIER_SPEC, Engine, RawConnection, declaration, sidecar_on

EXAMPLES = int(os.environ.get("KVLEDGER_FUZZ_EXAMPLES", "300"))
FUZZ = settings(
    max_examples=EXAMPLES,
    deadline=None,
    derandomize=False,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.large_base_example],
)
MAX_FRAME = 1 << 20
"""The fuzzed sidecar's --max-frame: room for the huge lists, small enough to be crossed."""
EXCHANGE_SECONDS = 20.0
"""One exchange's deadline: an answer not back by then is a hang."""
FUZZED = "fuzz-a"
OTHER = "fuzz-b"
BYSTANDER = "bystander"

T = TypeVar("T")


# --- the sidecar under fuzz -----------------------------------------------------------------------


Role = Literal["engine", "worker", "observer", "operator"]


@dataclass
class Exchange:
    """What one connection saw: the replies, in order, and the (head, digest) around the fuzz."""

    replies: list[p.ServerMessage]
    before: tuple[int, str]
    after: tuple[int, str]
    other_engine: tuple[bytes, bytes]
    """fuzz-b's part of the state before and after: fuzz-a's connections never change it (I9)."""
    appended: list[object] = field(default_factory=list)
    """The events the fuzz appended (decoded), when the head moved."""


@dataclass
class Target:
    portal: BlockingPortal
    sidecar: Sidecar
    socket: Path
    event_log: EventLog
    bystander: EngineClient
    bystander_step: int = 0

    def run(self, function: Callable[..., Any], *args: Any) -> Any:
        return self.portal.call(function, *args)

    async def mark(self) -> tuple[int, str]:
        async with self.sidecar.ledger.committed() as state:
            return await self.event_log.head(), state_digest(state)

    async def other_engine(self) -> bytes:
        """fuzz-b's part of the state: its engine, its jobs in flight and fenced ones."""
        async with self.sidecar.ledger.committed() as state:
            jobs = [job for job in state.jobs.values() if job.decision.engine_id == OTHER]
            fenced = [f for f in state.fenced.values() if f.job.decision.engine_id == OTHER]
            return msgspec.msgpack.encode((state.engines[OTHER], jobs, fenced))

    def hello(self, role: Role, rank: int = 0) -> p.Hello:
        if role == "engine":  # fuzz-a reconnecting as its current incarnation: nothing is declared
            incarnation = self.sidecar.ledger.state.engines[FUZZED].incarnation
            return p.Hello(protocol=p.PROTOCOL_VERSION, role="engine", engine_id=FUZZED, incarnation=incarnation)
        if role == "worker":
            return p.Hello(protocol=p.PROTOCOL_VERSION, role="worker", engine_id=FUZZED, rank=rank)
        return p.Hello(protocol=p.PROTOCOL_VERSION, role=role)

    async def exchange(self, opening: p.Hello | None, payload: bytes) -> Exchange:
        """Hello (when given), then `payload`, then EOF; every reply until the server closes."""
        stream = await unix_streams.connect_unix(self.socket)
        reader = BufferedByteReceiveStream(stream)
        async with stream:
            with anyio.fail_after(EXCHANGE_SECONDS):
                if opening is not None:
                    await stream.send(p.frame(opening))
                    welcome = await _read(reader)
                    assert isinstance(welcome, p.Welcome), welcome
                before, other_before = await self.mark(), await self.other_engine()
                try:
                    await stream.send(payload)
                    await stream.send_eof()
                except (anyio.BrokenResourceError, anyio.ClosedResourceError, ConnectionError):
                    pass  # the server closed first (a fatal error): its replies are still to read
                replies: list[p.ServerMessage] = []
                while (reply := await _read(reader)) is not None:
                    replies.append(reply)
            after = await self.mark()
            other_after = await self.other_engine()
        appended: list[object] = []
        if after[0] != before[0]:
            codec = EventCodec()
            stored = await self.event_log.read(before[0], after[0] - before[0])
            appended = [codec.decode(s.event_type, s.schema_version, s.payload) for s in stored]
        return Exchange(replies, before, after, (other_before, other_after), appended)

    def step_bystander(self) -> p.StepResult:
        self.bystander_step += 1
        step = self.bystander_step
        result: p.StepResult = self.run(
            lambda: self.bystander.step(step, float(step), [StartOwner(engine_id=BYSTANDER, req_id=f"r{step}")])
        )
        return result


async def _read(reader: BufferedByteReceiveStream) -> p.ServerMessage | None:
    """The next reply, or None at the end of the stream. A partial frame is a failure, and so is
    a body the client's decoder refuses (an untyped reply: FrameError)."""
    try:
        header = await reader.receive_exactly(p.HEADER_BYTES)
    except (anyio.IncompleteRead, anyio.EndOfStream, anyio.BrokenResourceError, ConnectionError):
        assert not reader.buffer, f"the server sent {len(reader.buffer)} bytes of a frame header, then closed"
        return None
    length = p.frame_length(header, p.DEFAULT_MAX_FRAME)
    return p.decode_server(await reader.receive_exactly(length))


@pytest.fixture(scope="module", params=os.environ.get("KVLEDGER_FUZZ_BACKENDS", "sqlite").split(","))
def target(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Target]:
    """The sidecar under fuzz, on a SQLite log (KVLEDGER_FUZZ_BACKENDS=sqlite,postgresql adds a
    run on PostgreSQL, whose columns check lengths SQLite does not)."""
    directory = tmp_path_factory.mktemp("fuzz")
    socket_path = directory / "s.sock"
    urls = log_url_for(request, directory)
    url = next(urls)
    try:
        yield from _serve(url, directory, socket_path)
    finally:
        next(urls, None)


def _serve(url: str, directory: Path, socket_path: Path) -> Iterator[Target]:
    with start_blocking_portal("asyncio") as portal:
        if url.startswith("postgresql"):
            portal.call(upgrade_log, url)
        event_log: EventLog = portal.call(open_log, url)
        try:
            # The fuzzer is one client sending thousands of refused frames: none of them is slowed
            # down (Sidecar._slow_down; tests/sidecar/test_hostile_clients.py shows that it is).
            with portal.wrap_async_context_manager(
                sidecar_on(event_log, socket_path, max_frame=MAX_FRAME, free_errors=1 << 30)
            ) as sidecar:
                bystander = EngineClient(Address(socket_path=str(socket_path)), declaration(BYSTANDER), tiers=[TIER_SPEC])
                portal.call(bystander.connect)
                try:
                    portal.call(_prepare, socket_path)
                    yield Target(portal, sidecar, socket_path, event_log, bystander)
                finally:
                    portal.call(bystander.aclose)
        finally:
            portal.call(event_log.close)


async def _prepare(socket_path: Path) -> None:
    """fuzz-a and fuzz-b each run a request to a store job that rank 0 reported and rank 1 never
    will (jobs, blocks and keys for fuzzed commands to name, their own and the other's)."""
    address = Address(socket_path=str(socket_path))
    for engine_id in (FUZZED, OTHER):
        async with EngineClient(address, declaration(engine_id), tiers=[TIER_SPEC]) as client:
            job = await Engine(client).request(0)
            worker = WorkerClient(address, engine_id, 0)
            await worker.report(
                ReportRank(job_id=job.job_id, rank=0, ok=True, checksums=[b.checksum(i.key, 0) for i in job.items])
            )


# --- the checks ---------------------------------------------------------------------------------------


DECODE_CODES = frozenset({p.ErrorCode.MALFORMED_FRAME, p.ErrorCode.UNKNOWN_MESSAGE, p.ErrorCode.INVALID_MESSAGE})


@dataclass(frozen=True)
class Payload:
    """Bytes to send after the opening, and how many whole frames they hold (None: not known,
    e.g. raw bytes), of which how many are Subscribe (answered by no reply of its own)."""

    data: bytes
    frames: int | None
    subscribes: int = 0
    label: str = ""


def check_exchange(
    target: Target, opening: p.Hello | None, payload: Payload, exchange: Exchange, logs: Sequence[Mapping[str, Any]]
) -> None:
    answers = [r for r in exchange.replies if not isinstance(r, p.Decisions)]
    errors = [r for r in answers if isinstance(r, p.Error)]
    for index, reply in enumerate(answers):
        if isinstance(reply, p.Error):
            assert reply.message.strip(), f"an Error without a reason: {reply!r}"
            assert reply.code in set(p.ErrorCode)
            if reply.fatal:
                assert index == len(answers) - 1, f"replies after a fatal error: {answers[index:]}"
    if payload.frames is not None:
        fatal = bool(errors) and errors[-1].fatal and answers[-1] is errors[-1]
        assert len(answers) <= payload.frames, f"{len(answers)} replies to {payload.frames} frames: {answers}"
        if not fatal:
            assert len(answers) >= payload.frames - payload.subscribes, (
                f"{payload.frames} frames got {len(answers)} replies, with no fatal error: {answers}"
            )
    assert not [e for e in errors if e.code == p.ErrorCode.COMMIT_FAILED], f"input made an append fail: {errors}"
    for reply in answers:  # a retry is answered as the step it committed, never as another
        if isinstance(reply, p.StepResult) and reply.duplicate:
            assert [e.step for e in reply.began if isinstance(e, StepBegan)] in ([], [reply.step]), reply
    if len(errors) == len(answers):  # only errors (or nothing): nothing may have changed
        if any(e.code == p.ErrorCode.REFUSED for e in errors):
            assert all(isinstance(e, Refused) for e in exchange.appended), exchange.appended
        else:
            assert exchange.after == exchange.before, f"state changed by a frame answered {errors}: {exchange.appended}"
    if opening is not None and opening.role in ("engine", "worker"):  # fuzz-a's: never another engine's state
        assert exchange.other_engine[0] == exchange.other_engine[1], f"{opening.role} of {FUZZED} changed {OTHER}: {answers}"
    failed = [entry for entry in logs if entry.get("event") in ("connection_failed", "step_failed", "ledger_rebuilt_from_log")]
    assert not failed, failed
    assert target.sidecar.readiness() == (True, "ready")
    result = target.step_bystander()
    assert not result.duplicate and not [e for r in result.results for e in r if isinstance(e, Refused)], result


def fuzz(target: Target, opening: p.Hello | None, payload: Payload) -> Exchange:
    with capture_logs() as logs:
        exchange: Exchange = target.run(target.exchange, opening, payload.data)
        event(
            f"{payload.label}: "
            + ", ".join(sorted({r.code.value if isinstance(r, p.Error) else type(r).__name__ for r in exchange.replies}))
        )
        check_exchange(target, opening, payload, exchange, logs)
    return exchange


# --- strategies from the protocol's own types ---------------------------------------------------------


EDGE_INTS = (-(2**63), -(2**31) - 1, -1, 0, 1, 2, 3, 2**31 - 1, 2**31, 2**32, 2**53 + 1, 2**63 - 1, 2**63, 2**64 - 1)
INTS = st.one_of(st.integers(-2, 40), st.sampled_from(EDGE_INTS), st.integers(-(2**63), 2**64 - 1))
FLOATS = st.one_of(st.floats(-2.0, 1e6), st.sampled_from((math.nan, math.inf, -math.inf, -0.0, 1e300, 5e-324)), st.floats())
TEXT = st.one_of(st.sampled_from((FUZZED, OTHER, b.TIER, "", "x")), st.text(max_size=12), st.text(min_size=129, max_size=300))
ENGINE_IDS = st.one_of(st.sampled_from((FUZZED, FUZZED, FUZZED, OTHER)), TEXT)
"""Never the bystander's: a Hello declaring it again would fence it (a restart, not a fuzz)."""
COMMAND_IDS = st.one_of(st.sampled_from(("dup-1", "dup-2", "dup-3")), TEXT)
SMALL_IDS = st.one_of(*[st.integers(0, 2)] * 3, INTS)
"""Ids the prepared state holds (its jobs, owners, ranks, pools and generations are 0..2) or any."""
BY_FIELD_NAME: dict[str, st.SearchStrategy[Any]] = {
    "engine_id": ENGINE_IDS,
    "command_id": COMMAND_IDS,
    "tier": st.one_of(st.just(b.TIER), TEXT),
    "protocol": st.one_of(st.just(p.PROTOCOL_VERSION), INTS),
    **dict.fromkeys(("job_id", "owner_id", "rank", "pool_id", "generation", "block_id"), SMALL_IDS),
}
MSGPACK: st.SearchStrategy[Any] = st.recursive(
    st.one_of(st.none(), st.booleans(), INTS, FLOATS, st.text(max_size=8), st.binary(max_size=8)),
    lambda children: st.one_of(st.lists(children, max_size=3), st.dictionaries(st.text(max_size=8), children, max_size=3)),
    max_leaves=8,
)
"""Any msgpack value: what a wrong field holds, or a whole body of the wrong shape."""


def shaped(t: mi.Type, name: str = "") -> st.SearchStrategy[Any]:
    """Values of msgspec type `t` as msgpack holds them (dicts, lists), constraints ignored."""
    if name in BY_FIELD_NAME and isinstance(t, (mi.IntType, mi.StrType)):
        return BY_FIELD_NAME[name]
    if isinstance(t, mi.IntType):
        return INTS
    if isinstance(t, mi.FloatType):
        return FLOATS
    if isinstance(t, mi.StrType):
        return TEXT
    if isinstance(t, mi.BytesType):
        return st.binary(max_size=40)
    if isinstance(t, mi.BoolType):
        return st.booleans()
    if isinstance(t, mi.NoneType):
        return st.none()
    if isinstance(t, mi.LiteralType):
        return st.sampled_from(t.values)
    if isinstance(t, mi.EnumType):
        return st.sampled_from([member.value for member in t.cls])
    if isinstance(t, (mi.ListType, mi.VarTupleType, mi.SetType, mi.FrozenSetType)):
        return st.lists(shaped(t.item_type, name), max_size=3)
    if isinstance(t, mi.TupleType):
        return st.tuples(*(shaped(item) for item in t.item_types)).map(list)
    if isinstance(t, mi.DictType):
        return st.dictionaries(shaped(t.key_type), shaped(t.value_type), max_size=3)
    if isinstance(t, mi.UnionType):
        return st.one_of(*(shaped(member, name) for member in t.types))
    if isinstance(t, mi.Metadata):
        return shaped(t.type, name)
    if isinstance(t, mi.StructType):
        return _struct(t)
    if isinstance(t, mi.AnyType):
        return MSGPACK
    raise AssertionError(f"no strategy for {t!r}")  # a new kind of field in the protocol: add it here


@st.composite
def _struct(draw: st.DrawFn, t: mi.StructType) -> Any:
    values: dict[str, Any] = {}
    for member in t.fields:
        if t.array_like or member.required or draw(st.booleans()):
            values[member.encode_name] = draw(shaped(member.type, member.name))
    if t.array_like:
        return ([t.tag] if t.tag is not None else []) + list(values.values())
    if t.tag_field is not None:
        values[t.tag_field] = t.tag
    return values


CLIENT_TYPES = {s.cls: s for s in mi.type_info(p.ClientMessage).types if isinstance(s, mi.StructType)}  # type: ignore[attr-defined]


def messages(*types: type[p.Message]) -> st.SearchStrategy[Any]:
    return st.one_of(*(_struct(CLIENT_TYPES[cls]) for cls in types))


ANY_MESSAGE = messages(p.Step, p.Step, p.Execute, p.Execute, p.Report, p.Report, p.Lookup, p.Subscribe, p.Health, p.Hello)


@st.composite
def mutated(draw: st.DrawFn, value: Any) -> Any:
    """`value` with one thing wrong somewhere: a value of another type, a field missing, an
    unknown field or tag."""
    value = copy.deepcopy(value)
    holder: Any = value  # a dict (a struct) or a list (an array-like struct, or a list field)
    while True:
        keys: list[Any] = list(holder) if isinstance(holder, dict) else list(range(len(holder)))
        if not keys:
            return draw(MSGPACK)  # nothing inside to get wrong: the whole value is
        key = draw(st.sampled_from(keys))
        inner = holder[key]
        if not isinstance(inner, (dict, list)) or not inner or draw(st.booleans()):
            break
        holder = inner
    how = draw(st.sampled_from(("replace", "drop", "extra", "retag")))
    tag = next((name for name in ("msg", "command") if isinstance(holder, dict) and name in holder), None)
    if how == "drop":
        del holder[key]
    elif how == "extra" and isinstance(holder, dict):
        holder[draw(st.text(max_size=8))] = draw(MSGPACK)
    elif how == "extra":
        holder.append(draw(MSGPACK))
    elif how == "retag" and tag is not None:
        holder[tag] = draw(st.one_of(st.text(max_size=12), MSGPACK))
    else:
        holder[key] = draw(MSGPACK)
    return value


def _encode(value: Any) -> bytes:
    return msgspec.msgpack.encode(value)


BODIES = st.one_of(
    st.binary(max_size=64),  # not msgpack, mostly
    MSGPACK.map(_encode),  # msgpack of the wrong shape
    *[ANY_MESSAGE.map(_encode)] * 4,  # shaped like a message, values at the edges
    *[ANY_MESSAGE.flatmap(mutated).map(_encode)] * 2,  # one thing wrong
)


def _framed(body: bytes) -> bytes:
    return len(body).to_bytes(p.HEADER_BYTES, "big") + body


def _whole(bodies: list[bytes]) -> Payload:
    subscribes = 0
    for body in bodies:
        try:
            subscribes += isinstance(p.decode_client(body), p.Subscribe)
        except p.FrameError:
            pass
    return Payload(b"".join(_framed(body) for body in bodies), len(bodies), subscribes, "frames")


@st.composite
def _truncated(draw: st.DrawFn) -> Payload:
    whole = _framed(draw(BODIES))
    return Payload(whole[: draw(st.integers(1, len(whole) - 1))], None, label="truncated")


def _huge() -> list[Payload]:
    """Valid frames holding huge lists (each under MAX_FRAME)."""
    engine = FUZZED
    bodies: list[p.Message] = [
        p.Lookup(tier=b.TIER, token_ids=list(range(150_000))),
        p.Lookup(tier=b.TIER, token_ids=[7] * 8, extra_keys=["k"] * 50_000),
        p.Lookup(tier=b.TIER, token_bytes=b"\x07" * (p.TOKEN_BYTES * 200_000)),
        p.Lookup(tier=b.TIER, token_bytes=b"\x07" * 7),
        p.Lookup(tier=b.TIER, token_ids=[7] * 8, token_bytes=b"\x07" * 8),
        p.Step(step=2**40, clock=1.0, commands=[EndStep(engine_id=engine)] * 20_000, command_id="huge-1"),
        p.Step(
            step=2**41,
            clock=1.0,
            commands=[StartOwner(engine_id=engine, req_id=str(i)) for i in range(5_000)],
            command_id="huge-2",
        ),
        p.Report(report=ReportRank(job_id=1, rank=1, ok=True, checksums=[b"\x00" * 16] * 40_000)),
        p.Subscribe(from_seq=2**63 - 1),
    ]
    return [Payload(p.frame(body), 1, isinstance(body, p.Subscribe), f"huge {type(body).__name__}") for body in bodies]


REPORTS_AT_JOBS = st.builds(
    lambda job_id, rank, ok, checksums: _encode(
        p.Report(report=ReportRank(job_id=job_id, rank=rank, ok=ok, checksums=checksums))
    ),
    st.sampled_from((1, 2)),
    st.sampled_from((0, 1, 2)),
    st.booleans(),
    st.lists(st.binary(min_size=16, max_size=16), max_size=3),
)
"""Reports naming the prepared jobs (fuzz-a's is 1, fuzz-b's 2), from any rank."""
PAYLOADS = st.one_of(
    st.lists(BODIES, min_size=1, max_size=3).map(_whole),
    st.lists(REPORTS_AT_JOBS, min_size=1, max_size=2).map(_whole),
    _truncated(),
    st.binary(min_size=1, max_size=64).map(lambda data: Payload(data, None, label="raw")),
    st.integers(MAX_FRAME + 1, 2**32 - 1).map(lambda n: Payload(n.to_bytes(4, "big") + b"\x00" * 8, 1, label="over max-frame")),
    st.sampled_from(_huge()),
)
HELLOS = st.one_of(messages(p.Hello), messages(p.Hello).flatmap(mutated)).map(_encode).map(lambda body: [body]).map(_whole)
"""Hellos with any content: other roles, engines, protocols, tokens, declarations, tiers."""


# --- the fuzz tests ---------------------------------------------------------------------------------


@FUZZ
@given(payload=st.one_of(PAYLOADS, HELLOS))
def test_fuzz_before_hello(target: Target, payload: Payload) -> None:
    """Anything as the first bytes of a connection: typed answers, no hang, no crash."""
    fuzz(target, None, payload)


@FUZZ
@given(payload=PAYLOADS, role=st.sampled_from(("engine", "engine", "engine", "worker", "observer", "operator")), rank=INTS)
def test_fuzz_after_hello(target: Target, payload: Payload, role: Role, rank: int) -> None:
    """Anything after a Hello, in each role: typed answers, no hang, no crash."""
    fuzz(target, target.hello(role, rank), payload)


@FUZZ
@given(first=messages(p.Step, p.Execute), second=messages(p.Step, p.Execute), command_id=st.sampled_from(("again-1", "again-2")))
def test_fuzz_a_command_id_sent_again_with_other_content(target: Target, first: Any, second: Any, command_id: str) -> None:
    """The same command id twice on one connection with different content: typed answers."""
    first["command_id"] = second["command_id"] = command_id
    fuzz(target, target.hello("engine"), _whole([_encode(first), _encode(second)]))


# --- findings: each a regression test with its minimal input ----------------------------------------
# Run on every log backend (the `event_log` fixture: SQLite and PostgreSQL).


async def _mark(sidecar: Sidecar, event_log: EventLog) -> tuple[int, str]:
    async with sidecar.ledger.committed() as state:
        return await event_log.head(), state_digest(state)


async def _appended(event_log: EventLog, since: int) -> list[object]:
    codec = EventCodec()
    stored = await event_log.read(since, 1_000)
    return [codec.decode(s.event_type, s.schema_version, s.payload) for s in stored]


NEW_TIER = TierSpec(name="new-tier", num_slots=16, bytes_per_slot=64)


@pytest.mark.anyio
@pytest.mark.parametrize("refused", ["a later tier", "the declaration", "no declaration"])
async def test_a_refused_hello_declares_none_of_its_tiers(event_log: EventLog, tmp_path: Path, refused: str) -> None:
    """Found by test_fuzz_before_hello: a Hello whose second tier was refused (num_slots 2**31)
    had already committed its first, so the refused Hello declared a tier. The same held for a
    refused declaration, and for a Hello missing its declaration (INVALID_MESSAGE). Now a Hello
    is taken whole or not at all: only the refusal is recorded (I1)."""
    sock = tmp_path / "s.sock"
    tiers, declare = [TIER_SPEC, NEW_TIER], declaration("pod-x")
    if refused == "a later tier":
        tiers.append(TierSpec(name="bad-tier", num_slots=2**31, bytes_per_slot=64))
    elif refused == "the declaration":
        declare = msgspec.structs.replace(declare, world_size=3)
    async with sidecar_on(event_log, sock) as sidecar:
        head = await event_log.head()
        raw = await RawConnection.open(sock)
        try:
            reply = await raw.hello(
                role="engine", engine_id="pod-x", tiers=tiers, declare=None if refused == "no declaration" else declare
            )
        finally:
            await raw.aclose()
        assert isinstance(reply, p.Error)
        assert reply.code == (p.ErrorCode.INVALID_MESSAGE if refused == "no declaration" else p.ErrorCode.REFUSED), reply
        assert not sidecar.ledger.state.tiers and "pod-x" not in sidecar.ledger.state.engines
        appended = await _appended(event_log, head)
        assert all(isinstance(e, Refused) for e in appended) and len(appended) == (refused != "no declaration"), appended
        # The same Hello without its fault is welcome, tiers and all.
        async with EngineClient(Address(socket_path=str(sock)), declaration("pod-x"), tiers=[TIER_SPEC, NEW_TIER]):
            assert "new-tier" in sidecar.ledger.state.tiers


@pytest.mark.anyio
async def test_a_hello_whose_own_tiers_disagree_is_refused_whole(event_log: EventLog, tmp_path: Path) -> None:
    """A Hello naming one tier twice with two specs is invalid: nothing of it is committed."""
    sock = tmp_path / "s.sock"
    async with sidecar_on(event_log, sock) as sidecar:
        raw = await RawConnection.open(sock)
        try:
            reply = await raw.hello(
                role="engine",
                engine_id="pod-x",
                declare=declaration("pod-x"),
                tiers=[NEW_TIER, msgspec.structs.replace(NEW_TIER, num_slots=32)],
            )
        finally:
            await raw.aclose()
        assert isinstance(reply, p.Error) and reply.code == p.ErrorCode.INVALID_MESSAGE and "new-tier" in reply.message, reply
        assert not sidecar.ledger.state.tiers and await event_log.head() == 0


@pytest.mark.anyio
@pytest.mark.parametrize("step", [2**63, 2**64 - 1])
async def test_a_step_number_beyond_the_logs_64_bit_column_is_invalid_and_commits_nothing(
    event_log: EventLog, tmp_path: Path, step: int
) -> None:
    """Step(step=2**63) was decided, then failed the append (the log's step column is a signed
    64-bit integer): COMMIT_FAILED, which clients retry for 30 s, a rebuild of the whole state
    from the log, and every other transaction of its group failed with it. Now it is an invalid
    message, refused before anything is decided."""
    sock = tmp_path / "s.sock"
    async with sidecar_on(event_log, sock) as sidecar, _client(sock, "pod-a") as client:
        await client.step(1, 1.0, [])
        before = await _mark(sidecar, event_log)
        with capture_logs() as logs:
            raw = await RawConnection.open(sock)
            try:
                await raw.hello(role="engine", engine_id="pod-a", incarnation=client.incarnation)
                await raw.send_bytes(
                    _framed(
                        msgspec.msgpack.encode({"msg": "step", "step": step, "clock": 2.0, "commands": [], "command_id": "big"})
                    )
                )
                reply = await raw.receive()
            finally:
                await raw.aclose()
        assert isinstance(reply, p.Error) and reply.code == p.ErrorCode.INVALID_MESSAGE and "$.step" in reply.message, reply
        assert await _mark(sidecar, event_log) == before
        assert not [entry for entry in logs if entry["event"] in ("ledger_rebuilt_from_log", "commit_failed")]
        largest = await client.step(p.MAX_STEP, 2.0, [])  # a valid message, decided: a leap the decider refuses
        assert not largest.duplicate and isinstance(largest.began[0], Refused) and largest.began[0].reason == "step_jump"


@pytest.mark.anyio
async def test_a_command_id_too_long_for_the_logs_column_commits_once_and_retries(event_log: EventLog, tmp_path: Path) -> None:
    """A 200-character command id failed the append on PostgreSQL (the log keeps "ENGINE/ID" in a
    128-character column): COMMIT_FAILED for the whole group, and a rebuild. Now a long id is kept
    as its digest, the same on every retry, and stays per engine (I9)."""
    sock = tmp_path / "s.sock"
    long_id = "c" * 200
    async with sidecar_on(event_log, sock), _client(sock, "pod-a") as a, _client(sock, "pod-b") as b_client:
        first = await a.step(1, 1.0, [StartOwner(engine_id="pod-a", req_id="r")], command_id=long_id)
        again = await a.step(1, 1.0, [StartOwner(engine_id="pod-a", req_id="r")], command_id=long_id)
        assert not first.duplicate and again.duplicate and (again.first_seq, again.last_seq) == (first.first_seq, first.last_seq)
        other = await b_client.step(1, 1.0, [], command_id=long_id)
        assert not other.duplicate, "another engine's long id was answered with pod-a's step"


@pytest.mark.anyio
async def test_an_engine_id_too_long_for_the_logs_stream_column_is_invalid(event_log: EventLog, tmp_path: Path) -> None:
    """A 300-character engine id failed its declaration's append on PostgreSQL (its stream id,
    "engine/<id>", is a 255-character column). Now a Hello names at most MAX_ENGINE_ID characters."""
    sock = tmp_path / "s.sock"
    async with sidecar_on(event_log, sock) as sidecar:
        too_long = "e" * (p.MAX_ENGINE_ID + 1)
        raw = await RawConnection.open(sock)
        try:
            reply = await raw.hello(role="engine", engine_id=too_long, declare=declaration(too_long))
        finally:
            await raw.aclose()
        assert isinstance(reply, p.Error) and reply.code == p.ErrorCode.INVALID_MESSAGE and "$.engine_id" in reply.message, reply
        longest = "e" * p.MAX_ENGINE_ID
        async with _client(sock, longest) as client:
            assert not (await client.step(1, 1.0, [], command_id="x" * 100)).duplicate
        assert longest in sidecar.ledger.state.engines


@pytest.mark.anyio
@pytest.mark.parametrize("pool_id", [2**31, 2**64 - 1, -1])
async def test_a_pool_id_the_audit_index_cannot_hold_is_refused_and_the_index_keeps_up(
    event_log: EventLog, tmp_path: Path, pool_id: int
) -> None:
    """An engine declared with pool 2**31 (PostgreSQL's INTEGER) or 2**64-1 (SQLite's) allocated
    in it, and from then on every catch-up of the audit index failed at that step: every audit
    query answered 503 for good. Now the sidecar refuses a pool id outside what the audit API asks
    for (0..2**31-1), in a Hello or an Execute; the largest still works end to end."""
    sock = tmp_path / "s.sock"
    async with sidecar_on(event_log, sock) as sidecar:
        head = await event_log.head()
        odd = declaration("pod-x", pools=[b.attention_pool(pool_id=pool_id)])
        raw = await RawConnection.open(sock)
        try:
            reply = await raw.hello(role="engine", engine_id="pod-x", declare=odd)
        finally:
            await raw.aclose()
        assert isinstance(reply, p.Error) and reply.code == p.ErrorCode.INVALID_MESSAGE and str(pool_id) in reply.message, reply
        assert await event_log.head() == head
        largest = declaration("pod-y", pools=[b.attention_pool(pool_id=MAX_POOL_ID)])
        async with EngineClient(Address(socket_path=str(sock)), largest, tiers=[TIER_SPEC]) as client:
            with pytest.raises(SidecarError) as refused:
                await client.execute(msgspec.structs.replace(odd, engine_id="pod-y"))
            assert refused.value.code == p.ErrorCode.INVALID_MESSAGE
            started = await client.step(1, 1.0, [StartOwner(engine_id="pod-y", req_id="r")])
            owner = next(e for e in started.results[0] if isinstance(e, OwnerStarted)).owner_id
            allocated = await client.step(
                2, 2.0, [AllocateBlocks(engine_id="pod-y", owner_id=owner, pool_id=MAX_POOL_ID, count=1)]
            )
            assert isinstance(allocated.results[0][0], BlocksAllocated)
        assert isinstance(event_log, SqlEventLog)
        assert await sync_index(event_log) == sidecar.ledger.last_seq


@pytest.mark.anyio
async def test_a_command_id_sent_again_for_another_step_is_not_answered_as_that_step(event_log: EventLog, tmp_path: Path) -> None:
    """Found by test_fuzz_a_command_id_sent_again_with_other_content: step 2 sent with step 1's
    command id came back as StepResult(step=2, duplicate=True) holding step 1's events, telling
    the engine its step 2 was in the log. Now it is refused `command_id_reused` and nothing is
    committed; the real retry of step 1 still gets step 1."""
    sock = tmp_path / "s.sock"
    async with sidecar_on(event_log, sock) as sidecar, _client(sock, "pod-a") as client:
        first = await client.step(1, 1.0, [], command_id="reused")
        before = await _mark(sidecar, event_log)
        with pytest.raises(SidecarError) as reused:
            await client.step(2, 2.0, [StartOwner(engine_id="pod-a", req_id="r")], command_id="reused")
        assert reused.value.code == p.ErrorCode.COMMAND_ID_REUSED and "step 1 at clock 1.0, not step 2" in str(reused.value)
        assert await _mark(sidecar, event_log) == before
        retry = await client.step(1, 1.0, [], command_id="reused")
        assert retry.duplicate and retry.step == 1 and (retry.first_seq, retry.last_seq) == (first.first_seq, first.last_seq)


def _client(socket_path: Path, engine_id: str) -> EngineClient:
    return EngineClient(Address(socket_path=str(socket_path)), declaration(engine_id), tiers=[TIER_SPEC], retry_for=0)


async def _report_as(role: str, address: Address, engine: EngineClient, report: ReportRank) -> None:
    """Send `report` as `engine`'s worker (rank 0), its connection, an Execute of it or a Step holding it."""
    if role == "worker":
        await WorkerClient(address, engine.engine_id, 0).report(report)
    elif role == "engine":
        await engine.report(report)
    elif role == "engine's Execute":
        await engine.execute(report)
    else:
        await engine.step(1, 1.0, [StartOwner(engine_id=engine.engine_id, req_id="q"), report])


@pytest.mark.anyio
@pytest.mark.parametrize("role", ["worker", "engine", "engine's Execute", "engine's Step"])
async def test_another_engines_connection_cannot_report_this_engines_job(event_log: EventLog, tmp_path: Path, role: str) -> None:
    """A ReportRank names no engine, so the check that an engine speaks only for itself never saw
    it: pod-b's workers completed pod-a's store job, publishing pod-a's keys with checksums of
    bytes they never wrote (I9, I13). Now a report for another engine's job is an invalid message
    and nothing is committed; pod-a's own worker then completes the job. The same report sent as
    an engine's Execute or inside its Step was still taken until test_fuzz_a_command_id_sent_again_
    with_other_content found it (a failed report of the other engine's job, which failed the job)."""
    sock = tmp_path / "s.sock"
    address = Address(socket_path=str(sock))
    async with sidecar_on(event_log, sock) as sidecar, _client(sock, "pod-a") as a, _client(sock, "pod-b") as b_engine:
        job = await Engine(a).request(0)
        before = await _mark(sidecar, event_log)
        report = ReportRank(job_id=job.job_id, rank=0, ok=True, checksums=[b"\x00" * 16 for _ in job.items])
        with pytest.raises(SidecarError) as refused:
            await _report_as(role, address, b_engine, report)
        assert refused.value.code == p.ErrorCode.INVALID_MESSAGE and "pod-a" in str(refused.value)
        assert await _mark(sidecar, event_log) == before
        for rank in (0, 1):
            committed = await WorkerClient(address, "pod-a", rank).report(
                ReportRank(job_id=job.job_id, rank=rank, ok=True, checksums=[b.checksum(i.key, rank) for i in job.items])
            )
        assert [type(e).__name__ for e in committed.events][-1] == "JobSucceeded"


@pytest.mark.anyio
@pytest.mark.parametrize("role", ["worker", "engine", "engine's Execute", "engine's Step"])
async def test_a_report_that_names_another_engine_than_its_connections_is_refused(
    event_log: EventLog, tmp_path: Path, role: str
) -> None:
    """The sidecar attributes every report to its connection's engine (ReportRank.engine_id); a
    report that names another engine itself is an invalid message, nothing committed, even on
    that engine's own job."""
    sock = tmp_path / "s.sock"
    address = Address(socket_path=str(sock))
    async with sidecar_on(event_log, sock) as sidecar, _client(sock, "pod-a") as a, _client(sock, "pod-b") as b_engine:
        job = await Engine(a).request(0)
        before = await _mark(sidecar, event_log)
        report = ReportRank(job_id=job.job_id, rank=0, ok=True, checksums=[b"\x00" * 16 for _ in job.items], engine_id="pod-a")
        with pytest.raises(SidecarError) as refused:
            await _report_as(role, address, b_engine, report)
        assert refused.value.code == p.ErrorCode.INVALID_MESSAGE
        assert "pod-a" in str(refused.value) and "pod-b" in str(refused.value)
        assert await _mark(sidecar, event_log) == before


@pytest.mark.anyio
@pytest.mark.parametrize("batched", [False, True], ids=["report", "reports"])
async def test_a_workers_connection_reports_for_its_own_rank_only(event_log: EventLog, tmp_path: Path, batched: bool) -> None:
    """A worker's Hello names its rank. A rank-0 worker that also reported rank 1 completed a
    two-rank store alone, publishing a checksum for a shard no rank-1 worker wrote (I5; an
    adversarial review, session 31). Now the report of another rank is an invalid message, alone
    or in a batch, and nothing is committed; the rank-1 worker then completes the job."""
    sock = tmp_path / "s.sock"
    address = Address(socket_path=str(sock))
    async with sidecar_on(event_log, sock) as sidecar, _client(sock, "pod-a") as a:
        job = await Engine(a).request(0)
        honest = [
            ReportRank(job_id=job.job_id, rank=rank, ok=True, checksums=[b.checksum(i.key, rank) for i in job.items])
            for rank in (0, 1)
        ]
        before = await _mark(sidecar, event_log)
        with pytest.raises(SidecarError) as refused:
            if batched:
                worker = SyncWorkerClient(address, "pod-a", 0, retry_for=5)
                try:
                    await anyio.to_thread.run_sync(worker.report_all, [(honest[0], "r0"), (honest[1], "r1")])
                finally:
                    worker.close()
            else:
                await WorkerClient(address, "pod-a", 0).report(honest[1])
        assert refused.value.code == p.ErrorCode.INVALID_MESSAGE
        assert "rank 1" in str(refused.value) and "worker rank 0" in str(refused.value)
        assert await _mark(sidecar, event_log) == before
        await WorkerClient(address, "pod-a", 0).report(honest[0])
        committed = await WorkerClient(address, "pod-a", 1).report(honest[1])
        assert [type(e).__name__ for e in committed.events][-1] == "JobSucceeded"


@pytest.mark.anyio
async def test_a_report_the_door_let_in_counts_for_no_other_engines_job(
    event_log: EventLog, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The door checks a report's job against the state before the report is decided; in between,
    a failed append's rebuild can free the job id and another engine's step make it again in the
    same group (issue 22's note). The decider checks it again: with the door's check out of the
    way, pod-b's worker's report on pod-a's job is dropped FOREIGN_JOB and committed as such, the
    job untouched, and pod-a's own workers then complete it."""
    sock = tmp_path / "s.sock"
    address = Address(socket_path=str(sock))
    async with sidecar_on(event_log, sock) as sidecar, _client(sock, "pod-a") as a, _client(sock, "pod-b"):
        job = await Engine(a).request(0)
        monkeypatch.setattr(admission, "foreign_report", lambda *args: None)
        committed = await WorkerClient(address, "pod-b", 0).report(
            ReportRank(job_id=job.job_id, rank=0, ok=True, checksums=[b"\x00" * 16 for _ in job.items])
        )
        [dropped] = committed.events
        assert isinstance(dropped, NoticeDropped) and dropped.reason == Reason.FOREIGN_JOB and "pod-b" in str(dropped)
        assert not sidecar.ledger.state.jobs[job.job_id].reports
        for rank in (0, 1):
            done = await WorkerClient(address, "pod-a", rank).report(
                ReportRank(job_id=job.job_id, rank=rank, ok=True, checksums=[b.checksum(i.key, rank) for i in job.items])
            )
        assert [type(e).__name__ for e in done.events][-1] == "JobSucceeded"


@pytest.mark.anyio
@pytest.mark.parametrize("role", ["worker", "engine's Execute"])
async def test_a_report_for_a_job_not_made_yet_is_refused_before_it_is_decided(
    event_log: EventLog, tmp_path: Path, role: str
) -> None:
    """Job ids are counted: a report naming the next one passed the check of whose job it is
    (the state did not know it yet), and if another engine's step made that job in the same
    group, decided just before the report, the report counted for that job (I9). A report for a
    job not made yet is refused whole, nothing committed."""
    sock = tmp_path / "s.sock"
    address = Address(socket_path=str(sock))
    async with sidecar_on(event_log, sock) as sidecar, _client(sock, "pod-a") as a, _client(sock, "pod-b") as b_engine:
        engine = Engine(a)
        await engine.request(0)
        coming = sidecar.ledger.state.next_job_id
        before = await _mark(sidecar, event_log)
        report = ReportRank(job_id=coming, rank=0, ok=False, checksums=[])
        with pytest.raises(SidecarError) as refused:
            if role == "worker":
                await WorkerClient(address, "pod-b", 0).report(report)
            else:
                await b_engine.execute(report, command_id="guess-1")
        assert refused.value.code == p.ErrorCode.INVALID_MESSAGE and f"job {coming} does not exist" in str(refused.value)
        assert await _mark(sidecar, event_log) == before
        job = await engine.request(1)
        assert job.job_id == coming and coming in sidecar.ledger.state.jobs  # made later, untouched
