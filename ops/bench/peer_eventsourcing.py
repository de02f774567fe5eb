"""Benchmark: kvledger's SQLite log against the eventsourcing library (the peer a Python user would
pick) on the same events: append, then replay (issue 22; DESIGN.md's target: append >= 10x,
replay >= 20x the peer).

    pip install -e '.[bench]'        # eventsourcing, a bench-only extra: nothing of the project needs it
    .venv/bin/python ops/bench/peer_eventsourcing.py [--events 300000] [--step-size 256] [--rounds 1]

The events are ops/bench/log.py's: a realistic mix made by the real decider (not timed).

* kvledger: SqlEventLog on a SQLite file, one AppendBatch of --step-size events a call (each with
  its command id and expected version), then coordinator.ledger.recovery.replay (read, decode, fold
  with the real projector), as ops/bench/log.py times them.
* eventsourcing 9.5: what its Application does to save and to read back, on its own SQLite
  persistence (SQLiteDatastore on a file, SQLiteApplicationRecorder): each event becomes a
  DomainEvent of one class holding the event's fields (msgspec.to_builtins), converted by its
  Mapper with its JSONTranscoder into a StoredEvent, and --step-size of them go in one
  `insert_events` call (one transaction), their versions counted here. Replay: its notification
  log read in pages of 1,000 (`select_notifications`), each turned back into a domain event by the
  Mapper, into kvledger's event (msgspec.convert), and folded by the same projector, so the fold
  costs both sides the same and the state digest must equal kvledger's.

Ends with plain lines: `append ratio R` and `replay ratio R` (kvledger events/s over the peer's).
With --rounds N both run N times, alternating which goes first, each round on fresh files, and the
ratios are the medians of the rounds': on a shared host one pair of runs moved the append ratio
from 6.2 to 13.1 with nothing changed (issue 22), as other work took the cores from one side or
the other.
"""

from __future__ import annotations

import argparse
import functools
import gc
import statistics
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import anyio  # noqa: E402
import msgspec  # noqa: E402
from figures import core_build, load, out  # noqa: E402
from log import bench_append, encode_all, generate  # noqa: E402

from coordinator.core.projector import apply  # noqa: E402
from coordinator.core.state import State, state_digest  # noqa: E402
from coordinator.ledger.recovery import replay  # noqa: E402
from events import AnyEvent, Event, EventCodec  # noqa: E402
from events.log import SqlEventLog, open_log  # noqa: E402

APPEND_TARGET = 10.0
REPLAY_TARGET = 20.0
PAGE = 1_000


@functools.cache
def peer_classes() -> tuple[Any, Any, Any, Any]:
    """The peer's classes, made once: eventsourcing refuses a second class under one topic (a
    second round would make one)."""
    try:
        from eventsourcing.domain import DomainEvent
        from eventsourcing.persistence import DatetimeAsISO, JSONTranscoder, Mapper, UUIDAsHex
        from eventsourcing.sqlite import SQLiteApplicationRecorder, SQLiteDatastore
    except ImportError as error:
        raise SystemExit(
            f"peer_eventsourcing.py: the eventsourcing library is not installed ({error}): "
            "pip install -e '.[bench]' (a bench-only extra)"
        ) from None

    @dataclass(frozen=True)
    class KvledgerEvent(DomainEvent):  # type: ignore[misc]
        """One kvledger event as an eventsourcing domain event: its fields, as JSON takes them."""

        event: dict[str, Any]

    transcoder = JSONTranscoder()
    transcoder.register(UUIDAsHex())
    transcoder.register(DatetimeAsISO())
    return KvledgerEvent, Mapper(transcoder=transcoder), SQLiteDatastore, SQLiteApplicationRecorder


def bench_peer(events: list[Event], step_size: int, directory: Path) -> tuple[float, float, State]:
    """The peer's append and replay seconds, and the state its replay folded."""
    from datetime import UTC, datetime

    event_class, mapper, datastore_class, recorder_class = peer_classes()
    datastore = datastore_class(str(directory / "eventsourcing.sqlite"))
    recorder = recorder_class(datastore)
    recorder.create_table()
    originator = uuid.uuid4()
    stamp = datetime.now(UTC)
    domain = [
        event_class(originator_id=originator, originator_version=version, timestamp=stamp, event=msgspec.to_builtins(event))
        for version, event in enumerate(events, 1)
    ]  # the domain events exist before they are saved, as in an Application: not timed
    gc.collect()
    started = time.perf_counter()
    for start in range(0, len(domain), step_size):
        recorder.insert_events([mapper.to_stored_event(event) for event in domain[start : start + step_size]])
    appended = time.perf_counter() - started

    gc.collect()
    started = time.perf_counter()
    state = State()
    position = 1
    while True:
        page = recorder.select_notifications(position, PAGE)
        if not page:
            break
        for notification in page:
            apply(state, msgspec.convert(mapper.to_domain_event(notification).event, AnyEvent))
        position = page[-1].id + 1
    replayed = time.perf_counter() - started
    datastore.close()
    return appended, replayed, state


async def bench_kvledger(pending: list[Any], step_size: int, directory: Path) -> tuple[float, float, State]:
    log = await open_log(str(directory / "kvledger.sqlite"))
    assert isinstance(log, SqlEventLog)
    try:
        # One append after another, as the peer's Application saves: nothing in flight beside it.
        appended, _ = await bench_append(log, pending, step_size, "kvledger", in_flight=1)
        gc.collect()
        started = time.perf_counter()
        state, _ = await replay(log, EventCodec())
        replayed = time.perf_counter() - started
    finally:
        await log.close()
    return appended, replayed, state


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--events", type=int, default=300_000)
    parser.add_argument("--step-size", type=int, default=256)
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--rounds", type=int, default=1, help="runs of both, alternating which goes first (medians)")
    args = parser.parse_args()
    if args.events < 1 or args.step_size < 1 or args.rounds < 1:
        parser.error("--events, --step-size and --rounds must be positive")
    peer_classes()  # fail early, saying how to install it
    out(f"host: {load()}")
    out(core_build())
    workload = generate(args.events, args.seed)
    events = list(workload.core.events)
    pending = encode_all(workload)
    n = len(events)
    rounds: list[tuple[float, float, float, float]] = []
    for round_number in range(args.rounds):
        with tempfile.TemporaryDirectory(prefix="kvl-peer-bench-") as name:
            directory = Path(name)
            if round_number % 2:  # the peer first
                peer_append, peer_replay, peer_state = bench_peer(events, args.step_size, directory)
            ours_append, ours_replay, ours_state = anyio.run(bench_kvledger, pending, args.step_size, directory)
            if not round_number % 2:
                peer_append, peer_replay, peer_state = bench_peer(events, args.step_size, directory)
        assert state_digest(ours_state) == state_digest(peer_state) == state_digest(workload.core.state), "the replays disagree"
        rounds.append((ours_append, ours_replay, peer_append, peer_replay))
        if args.rounds > 1:
            out(
                f"round {round_number + 1}: append ratio {peer_append / ours_append:.2f}, "
                f"replay ratio {peer_replay / ours_replay:.2f}"
            )
    ours_append, ours_replay, peer_append, peer_replay = (statistics.median(column) for column in zip(*rounds, strict=True))
    out(
        f"{n:,} events, {args.step_size} a step, on SQLite files"
        + (f"; medians of {args.rounds} rounds" if args.rounds > 1 else "")
    )
    out(f"kvledger: append {n / ours_append:12,.0f} events/s   replay {n / ours_replay:12,.0f} events/s")
    out(f"eventsourcing: append {n / peer_append:9,.0f} events/s   replay {n / peer_replay:12,.0f} events/s")
    append_ratio = statistics.median([peer / ours for ours, _, peer, _ in rounds])
    replay_ratio = statistics.median([peer / ours for _, ours, _, peer in rounds])
    out(
        f"targets: append >= {APPEND_TARGET:g}x: {'met' if append_ratio >= APPEND_TARGET else 'MISSED'}; "
        f"replay >= {REPLAY_TARGET:g}x: {'met' if replay_ratio >= REPLAY_TARGET else 'MISSED'}"
    )
    print(f"append ratio {append_ratio:.2f}")
    print(f"replay ratio {replay_ratio:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
