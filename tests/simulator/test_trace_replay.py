"""Issue 20: a real production trace (Mooncake's conversation trace, FAST'25 release, Apache-2.0;
its first 1,000 requests, shipped in coordinator/simulator/traces) replayed through the pure core as vLLM's offloading
manager drives kvledger (coordinator/simulator/trace.py). kvledger's hit blocks must equal those
of an independent LRU written here, exactly, at two capacities."""

from __future__ import annotations

from collections import OrderedDict
from pathlib import Path

import pytest

from coordinator.core.projector import apply, project
from coordinator.core.state import decode_state, encode_state
from coordinator.simulator.trace import (
    SHIPPED_TRACE,
    CoreReplay,
    LruTier,
    TraceError,
    TraceRequest,
    parse_trace,
    read_trace,
)

SLICE = SHIPPED_TRACE


def reference_hits(requests: list[TraceRequest], slots: int) -> tuple[int, int]:
    """An LRU tier of `slots` blocks that never evicts a key the current request relies on: per
    request, the hit is the chain up to the first missing block; the hit blocks are touched in
    order; the request's missing blocks are inserted in order (most recent last), evicting the
    least recently used blocks of other requests; when they cannot all fit, none is stored.
    (hit blocks, stores refused)."""
    cache: OrderedDict[int, None] = OrderedDict()
    hits = refused = 0
    for request in requests:
        ids = request.hash_ids
        hit = next((index for index, block in enumerate(ids) if block not in cache), len(ids))
        hits += hit
        kept = {block for block in ids if block in cache}
        new = list(dict.fromkeys(block for block in ids if block not in cache))
        evictable = [block for block in cache if block not in kept]
        room = slots - len(cache)
        if len(new) > room + len(evictable):
            refused += 1
            for block in ids[:hit]:
                cache.move_to_end(block)
            continue
        for block in evictable[: max(0, len(new) - room)]:
            del cache[block]
        for block in ids[:hit]:
            cache.move_to_end(block)
        for block in new:
            cache[block] = None
    return hits, refused


@pytest.mark.parametrize("slots", [64, 600, 4_000])
def test_the_traces_hit_blocks_equal_an_independent_lru(slots: int) -> None:
    requests = read_trace(SLICE)
    assert len(requests) == 1_000
    replay = CoreReplay(slots)
    hits = replay.replay_all(requests)
    expected, refused = reference_hits(requests, slots)
    assert (hits, replay.refused_stores) == (expected, refused)
    assert 0 < hits < replay.blocks  # some reuse, not all of it
    print(f"{slots} slots: hit blocks {hits} of {replay.blocks} (reference {expected}), {replay.refused_stores} stores refused")


def test_more_slots_never_hit_less_and_engines_sharing_the_tier_hit_the_same() -> None:
    """One namespace: requests dealt to two engines meet the same keys in the shared tier."""
    requests = read_trace(SLICE)[:400]
    small, large, shared = CoreReplay(300), CoreReplay(3_000), CoreReplay(3_000, engines=2)
    assert small.replay_all(requests) <= large.replay_all(requests) == shared.replay_all(requests)


def test_runs_of_evictions_and_publications_fold_as_event_by_event() -> None:
    """I18 (issue 22): `project` folds a run of KeyEvicted or KeyPublished events in one call; the
    state it builds from the replay's log is byte for byte the state `apply` builds one event at a
    time, and the live core's."""
    replay = CoreReplay(200, engines=2)
    declared = encode_state(replay.core.state)  # the tier and the engines, before any request
    replay.core._keep_events = True
    replay.replay_all(read_trace(SLICE)[:300])
    events = replay.core.events
    assert sum(type(event).__name__ == "KeyEvicted" for event in events) > 1_000  # long runs of both
    one_by_one = decode_state(declared)
    for event in events:
        apply(one_by_one, event)
    in_runs = project(events, decode_state(declared))
    assert encode_state(in_runs) == encode_state(one_by_one) == encode_state(replay.core.state)


def test_a_line_that_is_not_a_trace_request_is_named() -> None:
    good = '{"timestamp": 5, "input_length": 1024, "output_length": 3, "hash_ids": [1, 2]}'
    early = '{"timestamp": 1, "input_length": 512, "output_length": 3, "hash_ids": [1]}'
    assert [r.timestamp for r in parse_trace([good, "", early])] == [1, 5]  # timestamp order
    for line, message in [
        ('{"timestamp": 1, "input_length": 2}', "t.jsonl:2: not a trace request"),
        ("not json", "t.jsonl:2: not a trace request"),
        ('{"timestamp": -1, "input_length": 1, "output_length": 1, "hash_ids": [1]}', "t.jsonl:2: a negative"),
    ]:
        with pytest.raises(TraceError, match=message):
            parse_trace([good, line], "t.jsonl")
    with pytest.raises(ValueError, match="at least one slot"):
        CoreReplay(0)


def test_through_a_real_sidecar_the_trace_hits_the_cores_blocks_and_its_log_verifies_clean(tmp_path: Path) -> None:
    """ops/bench/trace.py's sidecar run on 150 requests of the slice, two engines sharing the tier:
    the sidecar (LookupKeys, a Step of load and store, the rank's Reports) hits exactly the pure
    core's blocks, and `kvledger verify` finds nothing in its log."""
    import json
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[2]
    log = tmp_path / "trace.sqlite"
    done = subprocess.run(
        [
            sys.executable,
            str(root / "ops" / "bench" / "trace.py"),
            "--trace",
            str(SLICE),
            "--slots",
            "600",
            "--engines",
            "2",
            "--limit",
            "150",
            "--log",
            str(log),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
        cwd=root,
    )
    assert done.returncode == 0, f"trace.py exited {done.returncode}:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    lines = done.stdout.splitlines()
    (hits,) = [int(line.split()[-1]) for line in lines if line.startswith("hit blocks ")]
    assert hits == CoreReplay(600, engines=2).replay_all(read_trace(SLICE)[:150]) > 0
    assert f"sidecar hit blocks {hits} (equal to the core's)" in lines
    verify = subprocess.run(
        [str(Path(sys.executable).parent / "kvledger"), "verify", "--log", str(log), "--json"],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert verify.returncode == 0, verify.stdout[-3000:] + verify.stderr[-2000:]
    report = json.loads(verify.stdout)
    assert report["ok"] and report["violation_count"] == 0 and report["events_checked"] > 0


@pytest.mark.parametrize("slots", [64, 600, 4_000])
def test_the_reference_the_demo_shows_is_this_tests_lru(slots: int) -> None:
    """`kvledger demo` prints kvledger's hit rate beside coordinator.simulator.trace.LruTier's:
    that reference agrees with the one written here, hit for hit and refusal for refusal."""
    requests = read_trace(SLICE)
    tier = LruTier(slots)
    hits = [tier.replay(request) for request in requests]
    assert (sum(hits), tier.refused_stores) == reference_hits(requests, slots)
    assert len(tier.blocks) <= slots
