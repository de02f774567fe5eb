"""The Kafka log's records and their fold: the topic, read in offset order, decides what the log is.

No I/O, no clock, no randomness: values in, values out. Every reader folds the same records in
the same order under these rules, so every reader, in any process, derives the same log: the
same accepted steps at the same global sequences, the same stream versions, the same epochs.
A writer learns what became of its own record by folding up to the offset the broker gave it
(its *verdict*); there is no other arbiter, because the broker checks nothing but order.

Records (value: msgpack, array-like structs; Kafka headers `kvl-format` and `kvl-kind`):

* `claim` (ClaimRecord): a writer takes streams at an epoch. A claim with an epoch above the
  stream's current one takes the stream over; an equal or lower one (a lost race) changes nothing.
* `append` (AppendRecord): one EventLog.append, whole: one StepPart per stream written, each
  with the writer's epoch on that stream, the version it expects, its command id, and the
  step's events encoded as the SQL log stores them (pack_step: a header naming each event, the
  payloads concatenated). An append is atomic: accepted whole or not at all.
* `appends` (format 2): several appends of one writer in one record, the ones it queued while
  its previous record travelled. Each is judged alone, in order, as if it were a record of its
  own at that offset; they share the record's offset, not its fate.

Rules for an append, part by part; a refused part refuses the whole append (the other appends
of an `appends` record are judged on their own):

0. (The whole append.) Its expected head, if it names one, must be the log's head: else HeadMoved
   (another writer's record came first; the writer reads it and decides again). A copy of an
   accepted record (rule 2) is refused by this rule too, which changes nothing: it was applied once.
   An append that names the head also names the append its writer had in flight when it decided
   (`follows`, appends are pipelined): that one must be the writer's last append that appended
   something, else HeadMoved too. A head is a count: without this, an append decided on a refused
   predecessor would pass rule 0 whenever another writer's append happened to add as many events.

1. A part whose command id is already committed is answered by the original (duplicate).
2. A part with the same stream, first version and event ids as an accepted step is a copy of it
   (a producer's retry, a re-sent record): answered by the original, applied once.
3. The part's epoch and the record's writer must be the stream's current claim: else the writer
   is fenced (a newer writer claimed the stream, or this one never did): WriterFenced. Except
   for a shared stream (any but an engine's, ENGINE_STREAM_PREFIX) in an append that names the
   head: HeadMoved. Sidecars of a fleet take turns on those; the writer claims it again and
   decides again, as when another writer's append came first.
4. The part's expected version must be the stream's version: else WrongExpectedVersion.
5. Its event ids must be new to the log: else AppendRejected.
Accepted parts take consecutive global sequences after the head, in part order.

A record without `kvl-format` is not kvledger's and is skipped; a record in a format this code does
not read fails closed (SchemaMismatch): folding it differently from a newer reader would fork
global sequences. Format 2 added `follows` to append records: a format-1 reader refuses them
rather than ignore the field; format-1 records are read as ever (no `follows`).
A kvledger record whose bytes do not decode is skipped by every reader alike.
"""

from __future__ import annotations

import hashlib
from bisect import bisect_right
from collections.abc import Iterable, Sequence

import msgspec

from events.log._contract import (
    AppendRejected,
    AppendResult,
    HeadMoved,
    LogError,
    SchemaMismatch,
    StepEntry,
    StoredStep,
    WriterFenced,
    WrongExpectedVersion,
)

ENGINE_STREAM_PREFIX = "engine/"
"""An engine's stream (coordinator.core.step.engine_stream) has one writer at a time: a second one
fences the first. Every other stream is shared by the sidecars of a fleet (claimed in turn, rule 3)."""

FORMAT = b"2"
"""What this code writes."""
READABLE_FORMATS = (b"1", b"2")
FORMAT_HEADER = "kvl-format"
KIND_HEADER = "kvl-kind"
APPEND = b"append"
APPENDS = b"appends"
CLAIM = b"claim"

Headers = Sequence[tuple[str, bytes]]


class StepPart(msgspec.Struct, frozen=True, array_like=True):
    """One stream's part of an append record."""

    stream_id: str
    epoch: int
    """The writer's epoch on this stream (its claim)."""
    expected_version: int
    command_id: str | None
    step: int
    recorded_at: float
    schemas: str
    header: bytes
    """pack_step's header: one StepEntry per event (id, type, schema version, length, ...)."""
    payload: bytes
    digest: bytes | None = None
    """The command id's content digest (AppendBatch.digest); absent from records written before it."""


class AppendRecord(msgspec.Struct, frozen=True, array_like=True):
    append_id: str
    """Unique per append call: the writer finds its verdict by it (copies share it)."""
    writer: str
    parts: list[StepPart]
    expected_head: int | None = None
    """The log's last global sequence the writer decided on (rule 0); absent: any."""
    follows: str | None = None
    """With expected_head: the append id of the writer's last append still in flight when it
    decided that appends an event (rule 0), None when it had none."""


class ClaimRecord(msgspec.Struct, frozen=True, array_like=True):
    claim_id: str
    writer: str
    epochs: dict[str, int]
    """stream id -> the epoch claimed on it."""


_encoder = msgspec.msgpack.Encoder()
_append_decoder = msgspec.msgpack.Decoder(AppendRecord)
_appends_decoder = msgspec.msgpack.Decoder(list[AppendRecord])
_claim_decoder = msgspec.msgpack.Decoder(ClaimRecord)
_entries_decoder = msgspec.msgpack.Decoder(list[StepEntry])


def encode_append(record: AppendRecord) -> tuple[bytes, list[tuple[str, bytes]]]:
    """(value, headers) of an append record."""
    return _encoder.encode(record), [(FORMAT_HEADER, FORMAT), (KIND_HEADER, APPEND)]


def encode_appends(records: Sequence[AppendRecord]) -> tuple[bytes, list[tuple[str, bytes]]]:
    """(value, headers) of a record carrying several appends (format 2), each judged alone, in order."""
    return _encoder.encode(records), [(FORMAT_HEADER, FORMAT), (KIND_HEADER, APPENDS)]


def encode_claim(record: ClaimRecord) -> tuple[bytes, list[tuple[str, bytes]]]:
    return _encoder.encode(record), [(FORMAT_HEADER, FORMAT), (KIND_HEADER, CLAIM)]


ReadAppend = tuple[AppendRecord, list[tuple[StepPart, list[str]]]]
"""An append record as the fold reads it: each part with its events' ids, in order."""

Verdict = list[AppendResult] | dict[str, int] | LogError
"""What the fold made of an awaited record: an append's results (one per part), the epochs a
claim won (stream -> epoch), or the error that refused an append."""


def first_repeated(ids: Sequence[str], known: set[str]) -> str:
    """The first of `ids` that is in `known` or earlier in `ids` (there is one)."""
    seen: set[str] = set()
    for event_id in ids:
        if event_id in known or event_id in seen:
            return event_id
        seen.add(event_id)
    raise ValueError("no repeated event id")


def _ids_digest(event_ids: Iterable[str]) -> bytes:
    return hashlib.blake2b("\x00".join(event_ids).encode(), digest_size=16).digest()


class KafkaFold:
    """The log as folded from the topic so far: accepted steps, versions, claims, commands.

    Holds every accepted step in memory (the topic's events, with their payloads): a reader
    answers reads, tails and replays from here. Event ids are kept to refuse a repeated one."""

    def __init__(self) -> None:
        self.next_offset = 0
        """The offset of the next record to fold."""
        self.head = 0
        """The last global sequence."""
        self.steps: list[StoredStep] = []
        self._starts: list[int] = []
        """first_seq of each step, for bisecting."""
        self._stream_steps: dict[str, tuple[list[int], list[StoredStep]]] = {}
        """stream id -> (last_seq of each of its steps, the steps): one stream read alone."""
        self.versions: dict[str, int] = {}
        self.epochs: dict[str, tuple[int, str]] = {}
        """stream id -> (epoch, writer) of its current claim."""
        self.commands: dict[str, AppendResult] = {}
        """command id -> its append's result (duplicate=True), as find_commands answers."""
        self.event_ids: set[str] = set()
        self._step_keys: dict[tuple[str, int], tuple[bytes, AppendResult]] = {}
        """(stream, first version) -> (digest of its event ids, its result): spots copies."""
        self._last_appended: dict[str, str] = {}
        """writer -> the append id of its last record that appended something (rule 0's follows)."""
        self.awaited: set[str] = set()
        """Ids of this process's records whose verdicts are wanted."""
        self.verdicts: dict[str, Verdict] = {}
        self.origin: bytes | None = None
        """A digest of the record at offset 0: which history of the topic this is."""

    # --- folding ---------------------------------------------------------------------------

    def fold(self, offset: int, headers: Headers, value: bytes | None, decoded: Sequence[ReadAppend] | None = None) -> str | None:
        """Fold the record at `offset` (at or after next_offset); returns why it was skipped,
        if it was. Raises SchemaMismatch for a record in a format this code does not read.

        `decoded`: the appends of an `appends` record whose value the caller encoded itself from
        exactly these (a writer folding its own record), each with its parts' event ids, so
        they are not decoded back from the bytes."""
        if offset < self.next_offset:
            raise ValueError(f"offset {offset} folded twice (next is {self.next_offset})")
        self.next_offset = offset + 1
        if offset == 0:
            self.origin = hashlib.blake2b(value or b"", digest_size=8).digest()
        named = dict(headers)
        record_format, kind = named.get(FORMAT_HEADER), named.get(KIND_HEADER)
        if record_format is None:
            return "not a kvledger record (no kvl-format header)"
        kinds = (APPEND, CLAIM, APPENDS) if record_format == FORMAT else (APPEND, CLAIM)
        if record_format not in READABLE_FORMATS or kind not in kinds:
            readable = ", ".join(repr(known) for known in READABLE_FORMATS)
            raise SchemaMismatch(
                f"the record at offset {offset} is kvledger format {record_format!r}, kind {kind!r}; this kvledger "
                f"reads formats {readable} (append, appends, claim): upgrade it before reading this topic"
            )
        if decoded is not None and kind == APPENDS:
            for own, read in decoded:
                self._settle(own.append_id, self._fold_append(own, read))
            return None
        try:
            if kind == CLAIM:
                claim = _claim_decoder.decode(value or b"")
                self._settle(claim.claim_id, self._fold_claim(claim))
                return None
            records = _appends_decoder.decode(value or b"") if kind == APPENDS else [_append_decoder.decode(value or b"")]
            appends = [(record, [(part, _entries_decoder.decode(part.header)) for part in record.parts]) for record in records]
        except msgspec.DecodeError as error:
            return f"undecodable {kind!r} record: {error}"
        skipped = None
        for record, parts in appends:
            garbled = next((p for p, entries in parts if sum(e.length for e in entries) != len(p.payload)), None)
            if garbled is not None:
                rejected = AppendRejected(f"the record at offset {offset} is garbled: its header and payload disagree")
                self._settle(record.append_id, rejected)
                skipped = f"stream {garbled.stream_id!r}: header and payload lengths disagree"
                continue
            read = [(part, [entry.event_id for entry in entries]) for part, entries in parts]
            self._settle(record.append_id, self._fold_append(record, read))
        return skipped

    def _settle(self, record_id: str, verdict: Verdict) -> None:
        if record_id in self.awaited:  # the first copy's verdict stands
            self.awaited.discard(record_id)
            self.verdicts[record_id] = verdict

    def _fold_claim(self, claim: ClaimRecord) -> dict[str, int]:
        won = {}
        for stream, epoch in claim.epochs.items():
            if epoch > self.epochs.get(stream, (0, ""))[0]:
                self.epochs[stream] = (epoch, claim.writer)
                won[stream] = epoch
        return won

    def _fold_append(self, record: AppendRecord, parts: Sequence[tuple[StepPart, list[str]]]) -> Verdict:
        head = self.head
        if record.expected_head is not None:
            if record.expected_head != head:
                return HeadMoved(record.expected_head, head)
            if record.follows is not None and self._last_appended.get(record.writer) != record.follows:
                return HeadMoved(
                    record.expected_head,
                    head,
                    detail=f"the record it was decided after ({record.follows}) was not accepted",
                )
        versions: dict[str, int] = {}
        commands: dict[str, AppendResult] = {}
        new_ids: set[str] = set()
        steps: list[StoredStep] = []
        keys: dict[tuple[str, int], tuple[bytes, AppendResult]] = {}
        results: list[AppendResult] = []
        for part, ids in parts:
            stream, command_id = part.stream_id, part.command_id
            if command_id is not None:
                done = commands[command_id] if command_id in commands else self.commands.get(command_id)
                if done is not None:
                    results.append(done)
                    continue
            key = (stream, part.expected_version + 1)
            digest = _ids_digest(ids)
            if ids:
                known = keys[key] if key in keys else self._step_keys.get(key)
                if known is not None and known[0] == digest:
                    results.append(msgspec.structs.replace(known[1], duplicate=True))
                    continue
            claim = self.epochs.get(stream, (0, ""))
            if (part.epoch, record.writer) != claim:
                if record.expected_head is not None and not stream.startswith(ENGINE_STREAM_PREFIX):
                    return HeadMoved(
                        record.expected_head, head, detail=f"shared stream {stream!r} was claimed by writer {claim[1]} since"
                    )
                return WriterFenced(
                    f"stream {stream!r} is claimed at epoch {claim[0]} by writer {claim[1] or 'none'}; this append "
                    f"came from writer {record.writer} at epoch {part.epoch}: it is fenced and was dropped"
                )
            actual = versions.get(stream, self.versions.get(stream, 0))
            if part.expected_version != actual:
                return WrongExpectedVersion(stream, part.expected_version, actual)
            seen = set(ids)  # set operations, not a loop an event: this runs for every record read
            if len(seen) != len(ids) or not seen.isdisjoint(new_ids) or not seen.isdisjoint(self.event_ids):
                repeated = first_repeated(ids, new_ids | self.event_ids)
                return AppendRejected(f"event id {repeated!r} is already in the log (stream {stream!r})")
            new_ids |= seen
            count = len(ids)
            first, last = (head + 1, head + count) if count else (0, 0)
            result = AppendResult(
                stream_id=stream, first_seq=first, last_seq=last, stream_version=actual + count, digest=part.digest
            )
            if count:
                steps.append(
                    StoredStep(
                        first, last, stream, actual + 1, part.schemas, part.header, part.payload, part.step, part.recorded_at
                    )
                )
                keys[key] = (digest, result)
                head = last
            versions[stream] = actual + count
            if command_id is not None:
                commands[command_id] = msgspec.structs.replace(result, duplicate=True)
            results.append(result)
        # Accepted whole: only now does anything of it change the log.
        self.head = head
        for step in steps:
            self.steps.append(step)
            self._starts.append(step.first_seq)
            ends, stream_steps = self._stream_steps.setdefault(step.stream_id, ([], []))
            ends.append(step.last_seq)
            stream_steps.append(step)
        self.versions.update(versions)
        self.commands.update(commands)
        self.event_ids |= new_ids
        self._step_keys.update(keys)
        if steps:
            self._last_appended[record.writer] = record.append_id
        return results

    # --- reading ---------------------------------------------------------------------------

    def steps_for(self, after_seq: int, limit: int) -> list[StoredStep]:
        """The steps holding events after_seq + 1 .. after_seq + limit, whole (as the SQL log's
        read_steps: from the step holding after_seq + 1 to the last starting by after_seq + limit)."""
        if limit <= 0:
            return []
        start = max(bisect_right(self._starts, after_seq + 1) - 1, 0)
        end = bisect_right(self._starts, after_seq + limit)
        return self.steps[start:end]

    def stream_steps_for(self, stream_id: str, after_seq: int, limit: int) -> list[StoredStep]:
        """One stream's steps ending after after_seq, at most `limit` (as the SQL log's read_stream_steps)."""
        ends, stream_steps = self._stream_steps.get(stream_id, ((), ()))
        start = bisect_right(ends, after_seq)
        return list(stream_steps[start : start + max(limit, 0)])

    def origin_code(self) -> int:
        """The origin as a positive 63-bit integer (0: the topic is empty), to keep as a checkpoint."""
        if self.origin is None:
            return 0
        return (int.from_bytes(self.origin, "big") >> 1) | 1
