"""The sidecar protocol: length-prefixed msgpack frames (msgspec), one message per frame.

A frame is a 4-byte big-endian length, then that many bytes: one msgpack map tagged by its
`msg` field. The first message on a connection is `Hello`, carrying PROTOCOL_VERSION; engines
then send `Step`, `Execute`, `Lookup` and `LookupKeys`, workers `Subscribe` and `Report`, anyone `Health`.
Each request gets exactly one reply, in request order. After `Subscribe` the server also pushes
`Decisions` frames on that connection; a client tells them apart by their tag.

Anything the server cannot take gets an `Error` naming a stable `ErrorCode`; `fatal` says the
server closes the connection after it (the others go on serving). Pure: no I/O here.
"""

from __future__ import annotations

import array
import enum
import re
import sys
from collections.abc import Sequence
from typing import Annotated, Literal, TypeVar, Union, cast

import msgspec
from msgspec import Meta

from coordinator.core.checks import MAX_EXTRA_KEYS, MAX_ITEMS_PER_COMMAND, MAX_LOOKUP_TOKENS, MAX_STREAM_NAME
from coordinator.core.commands import AnyCommand, DeclareEngine, ExternalKey, ReportRank
from coordinator.core.routing import Decision
from events import (
    AnyEvent,
    Event,
    ExternalKeysLookedUp,
    PoolSpec,
    PrefixLookedUp,
    Refused,
    TierSpec,
)

T = TypeVar("T")

PROTOCOL_VERSION = 1
HEADER_BYTES = 4
DEFAULT_MAX_FRAME = 16 << 20
"""Bytes of a frame a client takes from the sidecar (a reply, a batch of decisions)."""
MAX_REQUEST_FRAME = (1 << 20) + (256 << 10)
"""Bytes of a frame the sidecar takes from a client, by default (`kvledger serve --max-frame`):
the longest Lookup, packed (1 MiB), and room for its extra keys. Only a Lookup may be larger
than MAX_DENSE_FRAME. Decoding a frame holds the GIL,
~11 ms a MiB of small ints, and every engine's step waits meanwhile (a 14 MiB Step held them
~150 ms; at 2 MiB a legitimate engine's step p99 under attack was 25 ms, and the sidecar grew by
68 MiB). vLLM's steps are far smaller: a step computes at most max_num_batched_tokens."""
MAX_DENSE_FRAME = 128 << 10
"""Bytes of any frame but a Lookup's (a Step, a Report, an Execute): one whose header says more is
refused `frame_too_large` before its body is read. A Lookup's bulk is packed bytes, one copy to
decode; every other message's is lists of small ints and structs, ~10-40 ns a byte to decode,
all of it holding the GIL in one call (a 1.25 MiB Step of token ids held it ~27 ms, and every
other engine waited: ops/bench/hostile.py's huge-frames attack). At this bound a frame decodes
in at most ~5 ms. A client splits a larger step or batch of reports (`frame_chunks`)."""
LOOKUP_PREFIX = b"\xa3msg\xa6lookup"
"""How a Lookup's body begins after its map header: the `msg` key and its tag, written first
(msgspec writes a struct's tag before its fields). A frame over MAX_DENSE_FRAME must begin so."""
MAX_STEP = 2**63 - 1
"""The log keeps a step's number in a signed 64-bit column (events/log/schema.py, kvl_steps.step):
a larger one failed the append of its whole group and made the ledger rebuild from the log."""
MAX_ENGINE_ID = MAX_STREAM_NAME
"""Characters: the engine's stream id, "engine/<id>", is a 255-character column (kvl_steps.stream_id;
PostgreSQL refused a longer one at the append). The core refuses a longer one too."""
MAX_LISTED_TOKENS = 1 << 16
"""Token ids a Lookup may list (`Lookup.token_ids`); a longer Lookup packs them (`token_bytes`)."""
TOKEN_BYTES = 4
"""Bytes of one packed token id (`Lookup.token_bytes`: little-endian uint32)."""
MAX_COMMANDS = 256
"""Commands in one Step, reports in one Reports: a larger one is refused (`invalid_message`),
and a client splits it (see coordinator.sidecar.admission.MAX_COMMANDS_PER_STEP for why).

This bound and the others on a message's lists are part of its type (`Meta(max_length=...)`):
the decoder reads a list's length before its items, so a frame over a bound is refused before
anything in it is decoded (a Lookup of 262,145 token ids held ~10 MiB while it was decoded only
to be refused)."""


class ErrorCode(enum.StrEnum):
    """Stable codes of `Error` replies. Values are part of the protocol: add, never rename."""

    MALFORMED_FRAME = "malformed_frame"  # not msgpack, or not a map with a known shape
    FRAME_TOO_LARGE = "frame_too_large"  # fatal: the rest of the frame is not read
    UNKNOWN_MESSAGE = "unknown_message"  # a `msg` tag this server does not know
    INVALID_MESSAGE = "invalid_message"  # a known tag with missing or mistyped fields
    PROTOCOL_MISMATCH = "protocol_mismatch"  # fatal
    HELLO_FIRST = "hello_first"  # a request before Hello
    UNAUTHORIZED = "unauthorized"  # fatal: missing or wrong token
    WRONG_ROLE = "wrong_role"  # e.g. a Step on a worker's connection
    REFUSED = "refused"  # the engine declaration itself was refused (the reason is in the message)
    SLOW_SUBSCRIBER = "slow_subscriber"  # fatal: resume with Subscribe(from_seq=resume_from)
    SHUTTING_DOWN = "shutting_down"  # fatal: retry against the restarted server
    COMMIT_FAILED = "commit_failed"  # nothing of the request was committed; retry with the same command id
    COMMAND_ID_REUSED = "command_id_reused"  # the command id was committed for other content: use a new one
    STALE_INCARNATION = "stale_incarnation"  # fatal: the engine began a new incarnation since this connection's Hello
    ENGINE_CONNECTED = "engine_connected"  # a declaring Hello for an engine still connected, without `takeover`


Role = Literal["engine", "worker", "observer", "operator"]
"""Who a connection speaks for: an engine, one worker rank of an engine, an observer (health), an operator."""


class Message(msgspec.Struct, frozen=True, kw_only=True, tag_field="msg"):
    pass


# --- client -> server ----------------------------------------------------------------------


class Hello(Message, frozen=True, tag="hello"):
    """Opens a connection. Engines declare themselves; workers name their engine and rank.

    An engine that reconnects (the sidecar restarted, the socket dropped) sends the incarnation
    it runs: if that is the engine's current incarnation nothing is declared again and its jobs
    go on. A fresh start sends 0 and is declared: a new incarnation that fences the old one's
    jobs (I16)."""

    protocol: int
    role: Role
    """An operator (`kvledger namespace`) names no engine and may only Execute operator commands
    (coordinator.core.commands.OPERATOR_COMMANDS); engines may not send those."""
    engine_id: Annotated[str, Meta(max_length=MAX_ENGINE_ID)] = ""
    token: str = ""
    declare: DeclareEngine | None = None
    incarnation: int = 0
    tiers: list[TierSpec] = []
    """Tiers to declare before the engine; declaring a known tier with the same spec is a no-op."""
    takeover: bool = False
    """Declare the engine although a connection of it is still open: the new incarnation fences
    that connection (and its workers'). Without it such a Hello is refused `engine_connected`."""
    rank: int = 0
    """Workers: the tensor-parallel rank this worker serves."""


class Step(Message, frozen=True, tag="step"):
    """One scheduler step: the server runs BeginStep, the commands, EndStep, as one transaction."""

    step: Annotated[int, Meta(le=MAX_STEP)]
    """Above the engine's last step (the decider refuses one that does not advance)."""
    clock: float
    commands: Annotated[list[AnyCommand], Meta(max_length=MAX_COMMANDS)]
    command_id: str
    """Unique per step; a retry with the same id returns the committed result exactly once."""


class Execute(Message, frozen=True, tag="execute"):
    """One command outside any step (a tier declaration, a cache reset; from an operator, a
    namespace decision)."""

    command: AnyCommand
    command_id: str


class Subscribe(Message, frozen=True, tag="subscribe"):
    """Stream the committed decisions for this worker's engine and rank after `from_seq`."""

    from_seq: int = 0


class Report(Message, frozen=True, tag="report"):
    """A worker's result for one (job, rank). Reports are idempotent (I4)."""

    report: ReportRank
    command_id: str = ""


class Reports(Message, frozen=True, tag="reports"):
    """Several (job, rank) reports of one worker, committed together in one group (a worker that
    moves many jobs in one engine pass reports them in one round trip). Each keeps its command id:
    a retried batch counts each report once (I4)."""

    reports: Annotated[list[Report], Meta(max_length=MAX_COMMANDS)]


class Lookup(Message, frozen=True, tag="lookup", forbid_unknown_fields=True):
    """Read-only: the longest loadable prefix in a tier, from committed state; nothing is logged.

    The tokens come as a list (`token_ids`, at most MAX_LISTED_TOKENS) or packed (`token_bytes`:
    each token id a little-endian uint32, at most MAX_LOOKUP_TOKENS of them), never both. A
    long list is expensive to take: decoding each int holds the GIL (~7 ms for 262,144 of
    them, while every other engine's step waited); packed bytes are one copy. The only message
    whose frame may exceed MAX_DENSE_FRAME; it holds no field but these (a large frame padded
    with others would be skimmed whole to be decoded)."""

    tier: str
    token_ids: Annotated[list[int], Meta(max_length=MAX_LISTED_TOKENS)] = []
    extra_keys: Annotated[list[str], Meta(max_length=MAX_EXTRA_KEYS)] = []
    token_bytes: Annotated[bytes, Meta(max_length=TOKEN_BYTES * MAX_LOOKUP_TOKENS)] = b""


class LookupKeys(Message, frozen=True, tag="lookup_keys"):
    """Read-only: which of the engine's own keys (vLLM's offload keys) are loadable in a tier,
    answered at once from the committed state (never waiting for a commit). The answer is
    recorded in the log with a later group (`ExternalKeysLookedUp`), for the audit."""

    tier: str
    keys: Annotated[list[ExternalKey], Meta(max_length=MAX_ITEMS_PER_COMMAND)]


class Health(Message, frozen=True, tag="health"):
    pass


ClientMessage = Union[Hello, Step, Execute, Subscribe, Report, Reports, Lookup, LookupKeys, Health]  # noqa: UP007
CLIENT_TAGS = frozenset({"hello", "step", "execute", "subscribe", "report", "reports", "lookup", "lookup_keys", "health"})


# --- server -> client ----------------------------------------------------------------------


class Welcome(Message, frozen=True, tag="welcome"):
    protocol: int
    server: str
    engine_id: str = ""
    incarnation: int = 0
    head_seq: int = 0
    events: list[AnyEvent] = []
    """What the Hello committed (the engine's declaration); empty on a reconnect."""
    pools: list[PoolSpec] = []
    """Workers: the engine's pools, to shape their device pools from (empty until declared)."""
    world_size: int = 0
    tiers: list[str] = []
    """Workers: the names of the engine's tiers."""
    kv_dtype: str = ""
    """Workers: the namespace's KV dtype, to type their device pools."""


class StepResult(Message, frozen=True, tag="step_result"):
    command_id: str
    step: int
    first_seq: int
    last_seq: int
    duplicate: bool
    """A retry of a committed step: the events are the committed ones, all in `results[0]`."""
    began: list[AnyEvent]
    results: list[list[AnyEvent]]
    """Per command, in order: its events; a refusal is a `Refused` event."""
    ended: list[AnyEvent]
    decisions: list[Decision]


class Committed(Message, frozen=True, tag="committed"):
    """The reply to Execute and Report."""

    command_id: str
    first_seq: int
    last_seq: int
    duplicate: bool
    events: list[AnyEvent]


class ReportsCommitted(Message, frozen=True, tag="reports_committed"):
    """What each report of a `Reports` committed, in its order."""

    results: list[Committed]


class Decisions(Message, frozen=True, tag="decisions"):
    items: list[Decision]


class LookupResult(Message, frozen=True, tag="lookup_result"):
    answer: PrefixLookedUp | Refused


class KeysLookedUp(Message, frozen=True, tag="keys_looked_up"):
    answer: ExternalKeysLookedUp | Refused
    head_seq: int
    """The last committed sequence the answer read."""


class HealthResult(Message, frozen=True, tag="health_result"):
    ready: bool
    reason: str
    head_seq: int
    engines: list[str]
    subscribers: int
    server: str


class Error(Message, frozen=True, tag="error"):
    code: ErrorCode
    message: str
    fatal: bool = False
    resume_from: int | None = None
    """SLOW_SUBSCRIBER: the last sequence delivered; subscribe again from it."""


ServerMessage = Union[  # noqa: UP007
    Welcome, StepResult, Committed, ReportsCommitted, Decisions, LookupResult, KeysLookedUp, HealthResult, Error
]


# --- frames ----------------------------------------------------------------------------------

_encoder = msgspec.msgpack.Encoder()
_client_decoder = msgspec.msgpack.Decoder(ClientMessage)
_server_decoder = msgspec.msgpack.Decoder(ServerMessage)


class _Tag(msgspec.Struct):
    """A message's tag alone: decoding it skips the other fields without building them."""

    msg: object = None


_tag_only = msgspec.msgpack.Decoder(_Tag)


class FrameError(ValueError):
    """A frame that cannot be taken; `code` says why (an ErrorCode)."""

    def __init__(self, code: ErrorCode, message: str) -> None:
        super().__init__(message)
        self.code = code


def frame(message: Message) -> bytes:
    """One message as a frame: 4-byte big-endian length, then the msgpack body."""
    body = _encoder.encode(message)
    return len(body).to_bytes(HEADER_BYTES, "big") + body


def frame_length(header: bytes, limit: int) -> int:
    length = int.from_bytes(header, "big")
    if length > limit:
        raise FrameError(ErrorCode.FRAME_TOO_LARGE, f"frame of {length} bytes is over the limit of {limit} bytes")
    return length


def frame_bound(prefix: bytes, limit: int) -> int:
    """The most bytes a frame whose body begins with `prefix` (at least LOOKUP_PEEK bytes) may
    hold: `limit` for a Lookup, MAX_DENSE_FRAME (or `limit`, if less) for anything else."""
    if 0x81 <= prefix[0] <= 0x8F and prefix[1:LOOKUP_PEEK] == LOOKUP_PREFIX:
        return limit
    return min(limit, MAX_DENSE_FRAME)


LOOKUP_PEEK = 1 + len(LOOKUP_PREFIX)
"""Bytes of a large frame's body read first, to tell a Lookup (`frame_bound`)."""


def frame_chunks(items: Sequence[T], overhead: int = 1024) -> list[list[T]]:
    """`items` (a step's commands, a worker's reports) in order, in as few chunks as the sidecar
    takes in one message each: at most MAX_COMMANDS items, and at most MAX_DENSE_FRAME bytes
    framed (`overhead` left for the message's other fields). An item too large even alone gets a
    chunk of its own (the sidecar refuses it, naming the bound)."""
    room = MAX_DENSE_FRAME - overhead
    if len(items) <= MAX_COMMANDS and len(_encoder.encode(items)) <= room:
        return [list(items)] if items else []  # the common case: one encode, not one per item
    chunks: list[list[T]] = [[]]
    used = 0
    for item in items:
        size = len(_encoder.encode(item))
        if chunks[-1] and (len(chunks[-1]) >= MAX_COMMANDS or used + size > room):
            chunks.append([])
            used = 0
        chunks[-1].append(item)
        used += size
    return chunks if chunks[-1] else []


def decode_client(body: bytes) -> ClientMessage:
    """A client message, or FrameError naming what is wrong with it."""
    try:
        return _client_decoder.decode(body)
    except msgspec.ValidationError as error:
        raise _explain(body, error) from error
    except msgspec.DecodeError as error:
        raise FrameError(ErrorCode.MALFORMED_FRAME, f"frame is not a msgpack message: {error}") from error


def decode_server(body: bytes) -> ServerMessage:
    try:
        return _server_decoder.decode(body)
    except msgspec.DecodeError as error:
        raise FrameError(ErrorCode.MALFORMED_FRAME, f"server sent an undecodable frame: {error}") from error


_OVER_LENGTH = re.compile(r"Expected `(?:array|bytes)` of length <= (\d+) - at `(\$[\w.\[\]]*)`")


def _explain(body: bytes, error: msgspec.ValidationError) -> FrameError:
    try:
        tag = _tag_only.decode(body).msg
    except msgspec.DecodeError:  # a ValidationError too: not a map
        return FrameError(ErrorCode.MALFORMED_FRAME, f"frame is not a msgpack map: {error}")
    if not isinstance(tag, str):
        return FrameError(ErrorCode.MALFORMED_FRAME, f"message has no string 'msg' tag: {error}")
    if tag not in CLIENT_TAGS:
        return FrameError(ErrorCode.UNKNOWN_MESSAGE, f"unknown message type {tag!r}; this server knows {sorted(CLIENT_TAGS)}")
    over = _OVER_LENGTH.fullmatch(str(error))
    if over is not None:
        most, where = int(over[1]), over[2]
        field = where.rpartition(".")[2].replace("_", " ")
        return FrameError(
            ErrorCode.INVALID_MESSAGE, f"a {tag!r} message holds at most {most:,} {field} (`{where}`): split it, or send fewer"
        )
    return FrameError(ErrorCode.INVALID_MESSAGE, f"message {tag!r} is invalid: {error}")


def lookup_tokens(message: Lookup) -> Sequence[int]:
    """A Lookup's token ids, listed or packed; FrameError when it sends both, or bytes that are
    not whole uint32s. Packed ones stay packed (an array, 4 bytes a token): nothing is boxed
    until a block of them is hashed."""
    if not message.token_bytes:
        return message.token_ids
    if message.token_ids:
        raise FrameError(
            ErrorCode.INVALID_MESSAGE, "a Lookup sends its tokens listed (token_ids) or packed (token_bytes), not both"
        )
    if len(message.token_bytes) % TOKEN_BYTES:
        raise FrameError(
            ErrorCode.INVALID_MESSAGE,
            f"token_bytes holds {len(message.token_bytes):,} bytes, not a "
            f"multiple of {TOKEN_BYTES} (each token id a little-endian uint32)",
        )
    tokens = array.array("I", message.token_bytes)
    if sys.byteorder == "big":
        tokens.byteswap()
    return tokens


def lookup_message(tier: str, token_ids: Sequence[int], extra_keys: Sequence[str] = ()) -> Lookup:
    """A Lookup listing up to MAX_LISTED_TOKENS token ids, packing more (OverflowError for an id
    that is no uint32)."""
    if len(token_ids) <= MAX_LISTED_TOKENS:
        return Lookup(tier=tier, token_ids=list(token_ids), extra_keys=list(extra_keys))
    tokens = array.array("I", token_ids)
    if sys.byteorder == "big":
        tokens.byteswap()
    return Lookup(tier=tier, token_bytes=tokens.tobytes(), extra_keys=list(extra_keys))


def any_events(events: Sequence[Event]) -> list[AnyEvent]:
    """Events as a message field holds them (every Event is one of AnyEvent's members)."""
    return cast(list[AnyEvent], list(events))
